# The wgmma-* patches in one device call (carry .whl), most telling first: the wgmma tests on
# main + producer + tma, attn_prefill_micro.py on main and each tree alternated, the tests of
# the other trees, then ncu-attn.sh on wgmma-tma. SHORT=1 (a hold of ~3 minutes): main,
# producer and tma only, the tma tests, the micro-benchmark's depth row twice and 8K once.
set -u
out=${OUT:-/tmp/out}; mkdir -p $out
here=$PWD
sets=("wgmma-producer" "wgmma-producer wgmma-tma" "wgmma-producer wgmma-pingpong2" "wgmma-producer wgmma-kvsplit")
[ -z "${SHORT:-}" ] || sets=("wgmma-producer" "wgmma-producer wgmma-tma")
for p in "${sets[@]}"; do
  PATCHES="$p" bash bench/experiments/pending/probe.sh setup 2>&1 | grep -v "^###"
  name=${p##* }; rm -rf /tmp/$name; mv /tmp/pt /tmp/$name
done
export PYTHONPATH=/tmp/site:$PWD CUPY_CACHE_DIR=/root/cupycache
tests() {
  (cd /tmp/$1 && PYTHONPATH=/tmp/site:/tmp/$1 timeout 150 python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_cupy_kv16.py -k wgmma 2>&1 | tail -2 | sed "s|^|$1: |")
}
tests wgmma-tma; [ -n "${SHORT:-}" ] || tests wgmma-producer
for args in "--tokens 2048 --depth 30720" "--tokens 8192 --depth 0"; do
  trees="$PWD /tmp/wgmma-producer /tmp/wgmma-tma"
  [ -n "${SHORT:-}" ] || trees="$trees /tmp/wgmma-pingpong2 /tmp/wgmma-kvsplit"
  [ "$args" = "--tokens 8192 --depth 0" ] || trees="$trees $trees"
  for tree in $trees; do
    echo "== $tree $args"
    (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 60 python3 bench/experiments/attn_prefill_micro.py $args --tilings wgmma 64,false,1,8 2>&1 | grep -v Warn | tail -2)
  done
done
[ -z "${SHORT:-}" ] || exit 0
tests wgmma-pingpong2; tests wgmma-kvsplit
for t in wgmma-tma; do
  echo "== ncu $t"
  (cd /tmp/$t && OUT=$out/$t bash $here/bench/experiments/pending/ncu-attn.sh 2>&1 | grep -E "^stall|tensor_cycles_active.avg.pct_of_peak_sustained_elapsed|Duration" | head -8)
done
