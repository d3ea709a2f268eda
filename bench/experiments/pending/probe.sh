#!/usr/bin/env bash
# Decode probes in one call (carry .whl). Sections (default: tests micro ablate decode):
#   tests   the GDN mixer's GPU tests (gdn_step / gdn_step1 against NumPy)
#   micro   bench/experiments/gdn_step_micro.py (the mixer against its floors)
#   ablate  gpu_qwen35_ablate.py (the b1 step with each piece left out)
#   decode  gpu_qwen35_decode.py b1 / b8 / mtp3, gdn_fuse_qk on and off
#   cmp     micro + decode rows, this tree against the one before cur.patch, alternated
#   ab      gpu_qwen35_profile.py --rows 4 / --seqs 8 on this tree and with PATCHES applied
set -u
out=${OUT:-/tmp/out}; mkdir -p $out
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/root/cupycache PYTHONPATH=/tmp/site:$PWD
[ -e /tmp/site/trio ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
for what in ${@:-tests micro ablate decode}; do
  echo "### $what ($SECONDS s)"
  case $what in
    tests) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_cupy_ops.py \
             tests/kernels/test_cupy_spec.py -k "${TESTS_K:-gdn or qwen35 or bulk_mt or prestage or spec}" \
             2>&1 | tail -8 ;;
    micro) timeout 150 python3 bench/experiments/gdn_step_micro.py 2>&1 | tee $out/micro.txt | grep -v Warn ;;
    ablate) timeout 300 python3 bench/experiments/gpu_qwen35_ablate.py ${ABLATE_ARGS:-} 2>&1 | tee $out/ablate.txt | tail -16 ;;
    decode)
      for f in true false; do
        timeout 200 python3 bench/gpu_qwen35_decode.py --batches 1 8 --long-contexts --mtp-rounds 6 \
          --draft-tokens 3 --kv-dtype fp16 --config gdn_fuse_qk=$f 2>&1 | tee $out/decode-$f.txt \
          | grep -E "^decode b|k=3 accepting 3|copy_bw" | cut -c1-400
      done ;;
    cmp)   # this tree against the one before cur.patch (git diff HEAD -- ninfer), alternated
      rm -rf /tmp/before && mkdir /tmp/before && cp -r ninfer bench /tmp/before/
      (cd /tmp/before && patch -R -p1 -s < $OLDPWD/bench/experiments/pending/cur.patch) || exit 1
      for tree in $PWD /tmp/before $PWD /tmp/before; do
        echo "== $tree"
        (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 100 python3 bench/experiments/gdn_step_micro.py           --seqs 1 8 2>&1 | grep -E "^##|col_split 4|no state")
        (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 100 python3 bench/experiments/gpu_qwen35_profile.py \
          2>&1 | grep -E "^gdn")
        (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 150 python3 bench/gpu_qwen35_decode.py           --batches 1 2 4 8 --long-contexts --mtp-rounds 6 --draft-tokens 3 --kv-dtype fp16 2>&1           | grep -E "^decode b|k=3 accepting 3" | cut -c1-220)
      done 2>&1 | tee $out/cmp.txt ;;
    ab)
      rm -rf /tmp/pt && mkdir /tmp/pt && cp -r ninfer bench /tmp/pt/
      for p in ${PATCHES:-mt-preq-async}; do (cd /tmp/pt && patch -p1 -s < $OLDPWD/bench/experiments/pending/$p.patch) || exit 1; done
      for args in "--rows 4" "--seqs 8"; do
        for tree in $PWD /tmp/pt $PWD /tmp/pt; do
          echo "== $tree $args"
          (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 120 python3 bench/experiments/gpu_qwen35_profile.py $args 2>&1 | grep -E " us" | grep -v "^{")
        done
      done 2>&1 | tee $out/ab.txt ;;
  esac
done
