# A pending wgmma-* patch in one device call (carry .whl): the wgmma tests on main + it,
# attn_prefill_micro.py on main and it alternated, then ncu-attn.sh on it. PATCH: its name
# (required).
set -u
out=${OUT:-/tmp/out}; mkdir -p $out
here=$PWD name=${PATCH:?PATCH=name of a pending wgmma-* patch}
PATCHES="$name" bash bench/experiments/pending/probe.sh setup 2>&1 | grep -v "^###"
rm -rf /tmp/$name; mv /tmp/pt /tmp/$name
export PYTHONPATH=/tmp/site:$PWD CUPY_CACHE_DIR=/root/cupycache
(cd /tmp/$name && PYTHONPATH=/tmp/site:/tmp/$name timeout 200 python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_cupy_kv16.py -k wgmma 2>&1 | tail -2)
for args in "--tokens 2048 --depth 30720" "--tokens 8192 --depth 0"; do
  for tree in $PWD /tmp/$name $PWD /tmp/$name; do
    echo "== $tree $args"
    (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 60 python3 bench/experiments/attn_prefill_micro.py $args --tilings wgmma 64,false,1,8 2>&1 | grep -v Warn | tail -2)
  done
done
(cd /tmp/$name && OUT=$out/$name bash $here/bench/experiments/pending/ncu-attn.sh 2>&1 | grep -E "^stall|tensor_cycles_active.avg.pct_of_peak_sustained_elapsed|Duration" | head -8)
