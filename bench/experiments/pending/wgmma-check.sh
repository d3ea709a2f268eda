# The wgmma-* patches in one device call (carry .whl): the wgmma tests on main + each, then
# attn_prefill_micro.py on main and each alternated, then ncu-attn.sh on wgmma-tma.
set -u
out=${OUT:-/tmp/out}; mkdir -p $out
here=$PWD
for p in "wgmma-producer" "wgmma-producer wgmma-kvsplit" "wgmma-producer wgmma-pingpong2" "wgmma-producer wgmma-tma"; do
  PATCHES="$p" TESTS_S=200 TESTS_FILES=tests/kernels/test_cupy_kv16.py TESTS_K=wgmma bash bench/experiments/pending/probe.sh tests 2>&1 | grep -v "^NVIDIA"
  name=${p##* }; rm -rf /tmp/$name; mv /tmp/pt /tmp/$name
done
export PYTHONPATH=/tmp/site:$PWD CUPY_CACHE_DIR=/root/cupycache
for args in "--tokens 2048 --depth 30720" "--tokens 8192 --depth 0"; do
  trees="$PWD /tmp/wgmma-producer /tmp/wgmma-kvsplit /tmp/wgmma-pingpong2 /tmp/wgmma-tma"
  [ "$args" = "--tokens 8192 --depth 0" ] || trees="$trees $trees"
  for tree in $trees; do
    echo "== $tree $args"
    (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 60 python3 bench/experiments/attn_prefill_micro.py $args --tilings wgmma 64,false,1,8 2>&1 | grep -v Warn | tail -2)
  done
done
for t in wgmma-tma; do
  echo "== ncu $t"
  (cd /tmp/$t && OUT=$out/$t bash $here/bench/experiments/pending/ncu-attn.sh 2>&1 | grep -E "^stall|tensor_cycles_active.avg.pct_of_peak_sustained_elapsed|Duration" | head -8)
done
