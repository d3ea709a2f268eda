#!/usr/bin/env bash
# Decode probes in one call (carry .whl): the GDN mixer micro-benchmark, the step with each
# piece left out, then the 4-row / 8-lane pieces on main and with the patches named in PATCHES.
set -u
out=${OUT:-/tmp/out}; mkdir -p $out
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/root/cupycache PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
what=${1:-all}
if [ $what = all ] || [ $what = micro ]; then
  timeout 150 python3 bench/experiments/gdn_step_micro.py 2>&1 | tee $out/micro.txt | grep -v Warn
fi
if [ $what = all ] || [ $what = ablate ]; then
  timeout 300 python3 bench/experiments/gpu_qwen35_ablate.py ${ABLATE_ARGS:-} 2>&1 | tee $out/ablate.txt | tail -16
fi
if [ $what = all ] || [ $what = ab ]; then
  rm -rf /tmp/pt && mkdir /tmp/pt && cp -r ninfer bench /tmp/pt/
  for p in ${PATCHES:-mt-preq-async}; do (cd /tmp/pt && patch -p1 -s < $OLDPWD/bench/experiments/pending/$p.patch) || exit 1; done
  for args in "--rows 4" "--seqs 8"; do
    for tree in $PWD /tmp/pt $PWD /tmp/pt; do
      echo "== $tree $args"
      (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 120 python3 bench/experiments/gpu_qwen35_profile.py $args 2>&1 | grep -E " us|estimate" | grep -v "^{")
    done
  done 2>&1 | tee $out/ab.txt
fi
