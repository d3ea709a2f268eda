#!/usr/bin/env bash
# Decode probes in one device call (carry .whl): bash bench/experiments/pending/probe.sh SECTION...
# PATCHES (names of *.patch here, default: every one) are applied to a copy of the tree, /tmp/pt;
# "main" is the tree as carried.
#   setup   nothing more: /tmp/pt (main + PATCHES) and the wheels in /tmp/site, for commands after
#   tests   the GPU tests matching TESTS_K in TESTS_FILES (default: test_cupy_ops.py and
#           test_cupy_spec.py) on /tmp/pt (NVRTC compiles make the whole ~200 matching "gdn or
#           bulk_mt or prestage or spec" run past 300 s: narrow TESTS_K); SANITIZE=racecheck (or
#           synccheck, memcheck) runs them under compute-sanitizer; a line a test, then
#           "tests: exit RC" (124: TESTS_S ran out, the lines before say how far they got)
#   prefill gpu_qwen35_prefill_profile.py --kv-dtype fp16 at 8,192 tokens and at 2,048 over
#           30,720, main and /tmp/pt alternated twice (the attention and delta-rule rows)
#   micro   bench/experiments/gdn_step_micro.py on main (the GDN mixer against its floors)
#   ablate  gpu_qwen35_ablate.py on main (the b1 step with each piece left out; ABLATE_ARGS)
#   pieces  gpu_qwen35_profile.py --rows 4 / --seqs 8, main and /tmp/pt alternated twice
#   decode  gpu_qwen35_decode.py b1 / b2 / b4 / b8 and the mtp3 round, main and /tmp/pt
#           alternated twice
#   b1      gpu_qwen35_decode.py b1 without the MTP head, once on main and once on /tmp/pt (a
#           short hold's check)
#   timeline  bench/experiments/gemv_timeline.py (out_proj's blocks stamped), main and /tmp/pt
#   sweep   gpu_qwen35_decode.py b1 / b8 and the verify pass on /tmp/pt with each of the
#           ';'-separated KernelConfig changes in SWEEP (`--config` words, JSON values) and the
#           defaults, twice
set -u
out=${OUT:-/tmp/out}; mkdir -p $out
here=$PWD/bench/experiments/pending
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/root/cupycache PYTHONPATH=/tmp/site:$PWD
[ -e /tmp/site/trio ] || python3 -m pip install -q --no-index --no-deps --no-compile \
  --target /tmp/site .whl/*.whl > /dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
rm -rf /tmp/pt && mkdir /tmp/pt && cp -r ninfer bench tests pyproject.toml /tmp/pt/
patches=${PATCHES-$(cd $here && ls *.patch 2>/dev/null | sed 's/\.patch$//')}
for p in $patches; do
  (cd /tmp/pt && patch -p1 -s < $here/$p.patch) || { echo "probe: $p.patch does not apply"; exit 1; }
done
echo "probe: /tmp/pt = main +" ${patches:-nothing}
in_tree() { local tree=$1; shift; (cd $tree && PYTHONPATH=/tmp/site:$tree "$@"); }
for what in ${@:-tests pieces decode}; do
  echo "### $what ($SECONDS s)"
  case $what in
    tests) in_tree /tmp/pt timeout ${TESTS_S:-240} ${SANITIZE:+compute-sanitizer \
             --tool $SANITIZE --print-limit 5} python3 -m pytest -v -p no:cacheprovider \
             ${TESTS_FILES:-tests/kernels/test_cupy_ops.py tests/kernels/test_cupy_spec.py} \
             -k "${TESTS_K:-long_rows or gdn_step or gdn_mixer}" 2>&1 \
             | grep -E " (PASSED|FAILED|ERROR|SKIPPED)|passed|failed|error" | cut -c1-160 \
             | tail -${TESTS_TAIL:-200}
           rc=${PIPESTATUS[0]}   # (124: TESTS_S ran out; the lines say how far it got)
           echo "tests: exit $rc" ;;
    prefill)
      for args in "--tokens 8192" "--tokens 2048 --context 30720"; do
        for tree in $PWD /tmp/pt $PWD /tmp/pt; do
          echo "== $tree $args"
          in_tree $tree timeout 150 python3 bench/experiments/gpu_qwen35_prefill_profile.py \
            $args --kv-dtype fp16 2>&1 | grep -E "paged_attention|gated_delta_rule|estimate" \
            | grep -v "^{" | cut -c1-200
        done
      done 2>&1 | tee $out/prefill.txt ;;
    micro) timeout 150 python3 bench/experiments/gdn_step_micro.py 2>&1 | tee $out/micro.txt \
             | grep -v Warn ;;
    ablate) timeout 300 python3 bench/experiments/gpu_qwen35_ablate.py ${ABLATE_ARGS:-} 2>&1 \
              | tee $out/ablate.txt | tail -16 ;;
    pieces)
      for args in "--rows 4" "--seqs 8"; do
        for tree in $PWD /tmp/pt $PWD /tmp/pt; do
          echo "== $tree $args"
          in_tree $tree timeout 120 python3 bench/experiments/gpu_qwen35_profile.py $args 2>&1 \
            | grep -E " us" | grep -v "^{"
        done
      done 2>&1 | tee $out/pieces.txt ;;
    decode)
      for tree in $PWD /tmp/pt $PWD /tmp/pt; do
        echo "== $tree"
        in_tree $tree timeout 150 python3 bench/gpu_qwen35_decode.py --batches 1 2 4 8 \
          --long-contexts --mtp-rounds 6 --draft-tokens 3 --kv-dtype fp16 2>&1 \
          | grep -E "^decode b|k=3 accepting 3|k=3 device" | cut -c1-240
      done 2>&1 | tee $out/decode.txt ;;
    b1)   # one b1 run a tree, no MTP head: for a hold with little device time left
      for tree in $PWD /tmp/pt; do
        echo "== $tree"
        in_tree $tree timeout 90 python3 bench/gpu_qwen35_decode.py --batches 1 --long-contexts \
          --mtp-rounds 0 --kv-dtype fp16 2>&1 | grep -E "^decode b1:" | cut -c1-240
      done 2>&1 | tee $out/b1.txt ;;
    timeline)
      for tree in $PWD /tmp/pt; do
        echo "== $tree"
        in_tree $tree timeout 90 python3 bench/experiments/gemv_timeline.py 2>&1 \
          | grep -Ev "^  (entry|produced|first|ring) "
      done 2>&1 | tee $out/timeline.txt ;;
    sweep)
      IFS=';' read -ra cfgs <<< "${SWEEP:-}"
      for round in 1 2; do
        for c in "" "${cfgs[@]}"; do
          echo "== config: ${c:-defaults}"
          in_tree /tmp/pt timeout 120 python3 bench/gpu_qwen35_decode.py --batches 1 8 \
            --long-contexts --mtp-rounds 3 --draft-tokens 3 --kv-dtype fp16 --config $c 2>&1 \
            | grep -E "^decode b|k=3 device" | cut -c1-240
        done
      done 2>&1 | tee $out/sweep.txt ;;
    setup) ;;   # /tmp/pt and /tmp/site only, for the commands after it
    *) echo "probe: unknown section $what" ;;
  esac
done
