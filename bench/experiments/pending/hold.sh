#!/usr/bin/env bash
# One H200 hold for the pending patches (README.md here), a device call each, sent back to back
# (carry .whl; the machine keeps /tmp and the NVRTC cache between the calls of one hold):
#   call 1  bash bench/experiments/pending/hold.sh tests     the patches' GPU tests
#   call 2  bash bench/experiments/pending/hold.sh profile   prefill pieces at 8K, before / after
#   call 2b bash bench/experiments/pending/hold.sh profile2  the same at 512, and 2K at depth
#   call 3  bash bench/experiments/pending/hold.sh api       serve's fp16 KV default via the API
#   call 4  bash bench/experiments/pending/hold.sh prefill   the engine's 8K / 32K rows (GGUF ~50 s)
#   call 5  bash bench/experiments/pending/hold.sh decode    issue 30: mixer prefetch, K split
#   call 5b bash bench/experiments/pending/hold.sh decode2   the same as b1 steps
#   call 5c bash bench/experiments/pending/hold.sh verify    issue 30: mtp3 rounds at 32K
#   call 6  bash bench/experiments/pending/hold.sh fp8-agree fp8 against fp16 GEMMs, SmolLM2
#           (after `bash bench/gpu_hold.sh prep nopeer`, carrying .xfer/part.a; this one part.b)
# then `bash bench/gpu_hold.sh traces` (carry .whl .xfer/tmpl.gguf), prefixed by `hold.sh apply &&`.
# A 30-minute session budget holds a cold start (~3 min) and about five calls of ~5 min:
# tests, profile, decode, decode2 and verify first; profile2, api, prefill and fp8-agree next;
# traces in a hold of their own. A patch that fails its tests is left out (edit `patches`) before
# the benchmarks.
# Each call applies the patches to the copy of the tree it runs in (the copy is fresh each call);
# "before" runs from an unpatched copy in /tmp/base made first. Results under $OUT.
set -u
out=${OUT:-/tmp/out}
here=bench/experiments/pending
patches="kv-auto dequant-f16 prefill-fp8 prefill-attn-ldsm gdn-chunk-tc gdn-step-prefetch
  gemv-ksplit verify-shared-kv"
# (in this order: prefill-fp8 after dequant-f16, verify-shared-kv after prefill-attn-ldsm; a
# patch left out may leave a later one to apply with less context: apply() tries that too)
case ${1:-} in apply|tests|profile|profile2|api|prefill|decode|decode2|verify|fp8-agree) ;;
  *) echo "usage: bash $here/hold.sh" \
       "apply|tests|profile|profile2|api|prefill|decode|decode2|verify|fp8-agree" >&2
     exit 2 ;;
esac
mkdir -p "$out"
[ -e /tmp/site/trio ] || python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/root/cupycache

apply() {   # the unpatched tree to /tmp/base, then every patch here (git apply, else patch)
  rm -rf /tmp/base && mkdir -p /tmp/base && cp -r ninfer bench tests pyproject.toml /tmp/base/
  for p in $patches; do
    if command -v git > /dev/null; then
      git apply "$here/$p.patch" 2> /dev/null || git apply -C1 "$here/$p.patch"
    else patch -p1 -s -F2 < "$here/$p.patch"; fi || { echo "hold: $p.patch does not apply"; exit 1; }
  done
  echo "hold: applied $patches"
}

pp() {   # pp DIR NAME ARGS...: the prefill profile from DIR, its per-piece lines
  local dir=$1 name=$2; shift 2
  (cd "$dir" && PYTHONPATH=/tmp/site:$PWD timeout 170 python3 \
    bench/experiments/gpu_qwen35_prefill_profile.py "$@" --json "$out/pp-$name.json") \
    > "$out/pp-$name.log" 2>&1
  grep -E "delta|gdn_chunk|paged_attention|mlp|dequant|estimate" "$out/pp-$name.log" \
    | sed "s/^/$name /" | cut -c1-200
}

case ${1:-} in
  apply) apply ;;
  tests)
    apply
    ops_k="paged_attention or gdn or gated_delta or chunk or fp8 or dequant or linear or graph"
    ops_k="$ops_k or spec or greedy or bulk or shadow or verify"
    export PYTHONPATH=/tmp/site:$PWD
    # a hung kernel ends its test (the image's pytest-timeout; thread: a blocked CUDA call
    # never sees a signal), not the whole call
    tmo=$(python3 -c "import pytest_timeout" 2>/dev/null \
      && echo "--timeout 150 --timeout-method thread")
    timeout 280 python3 -m pytest -n 12 -q -rfE --tb=short -p no:cacheprovider $tmo \
      tests/kernels/test_cupy_gdn_chunk.py tests/kernels/test_cupy_gemm_fp8.py \
      tests/kernels/test_cupy_ops.py tests/kernels/test_cupy_spec.py -k "$ops_k" \
      2>&1 | tee "$out/t-ops.log" | tail -n 15
    timeout 280 python3 -m pytest -n 12 -q -rfE --tb=short -p no:cacheprovider $tmo \
      tests/kernels/test_cupy_kv16.py tests/kernels/test_cupy_kv8.py \
      tests/kernels/test_cupy_kvrk.py -k "attention or prefill or greedy or rows" \
      2>&1 | tee "$out/t-kv.log" | tail -n 15
    ;;
  profile)   # before (main) and after at 8,192 tokens, fp16 KV; fp8 GEMMs
    apply
    pp /tmp/base base-8k --tokens 8192 --kv-dtype fp16
    pp . new-8k --tokens 8192 --kv-dtype fp16
    pp . fp8-8k --tokens 8192 --kv-dtype fp16 --prefill-gemm fp8
    ;;
  profile2)   # the same at 512 tokens and at 2,048 over 30,720 cached
    apply
    pp /tmp/base base-512 --tokens 512 --kv-dtype fp16
    pp . new-512 --tokens 512 --kv-dtype fp16
    pp /tmp/base base-depth --tokens 2048 --context 30720 --kv-dtype fp16
    pp . new-depth --tokens 2048 --context 30720 --kv-dtype fp16
    ;;
  api)   # serve's default KV dtype is fp16 on the GPU with kv-auto: the API and reuse tests on it
    apply
    PYTHONPATH=/tmp/site:$PWD NINFER_TEST_BACKEND=cupy timeout 560 python3 -m pytest -n 8 -q \
      -rfE --tb=short -p no:cacheprovider tests/api tests/engine/test_prefix_reuse.py \
      2>&1 | tee "$out/t-api.log" | tail -n 15
    ;;
  prefill)   # the engine's chunked path on the 27B GGUF with the patches, fp16 KV (before:
    # 5,670 / 4,846 tok/s at 8K / 32K, fp32 KV; fp8 GEMMs are the profile's: off by default)
    apply
    export PYTHONPATH=/tmp/site:$PWD
    [ -e /tmp/q35.gguf ] || python3 bench/make_qwen35_gguf.py /tmp/q35.gguf 27b | tail -n 1
    timeout 500 python3 -m ninfer bench prefill /tmp/q35.gguf --backend cupy \
      --prefill 8192,32768 --chunk auto --reps 1 --kv-dtype fp16 --json "$out/prefill.json" \
      2>&1 | tail -n 8
    ;;
  decode|decode2)   # issue 30: the mixer before / after gdn-step-prefetch; the N = 5,120 GEMVs
    # (GDN out, attention o, down) split 160 32-row segments over 132 blocks (2 on some blocks:
    # 4 tiles against 2.4 on average) before gemv-ksplit, 640 half-K tiles with it: the new
    # tree with and without the split. decode: the pieces (profile); decode2: the b1 step
    apply
    for run in base:q8_shadow=true new:q8_shadow=true new:bulk_k_split=1; do
      dir=$([ "${run%%:*}" = base ] && echo /tmp/base || echo .) c=${run#*:}
      if [ "$1" = decode ]; then
        (cd "$dir" && PYTHONPATH=/tmp/site:$PWD timeout 180 python3 \
          bench/experiments/gpu_qwen35_profile.py --config $c) > "$out/prof-$run.log" 2>&1
        grep -vE "^\{" "$out/prof-$run.log" | sed "s/^/$run /" | tail -n 16 | cut -c1-160
      else
        (cd "$dir" && PYTHONPATH=/tmp/site:$PWD timeout 180 python3 bench/gpu_qwen35_decode.py \
          --batches 1 --mtp-rounds 0 --long-contexts --config $c) > "$out/dec-$run.log" 2>&1
        grep -E "^decode b1" "$out/dec-$run.log" | sed "s/^/$run /" | cut -c1-200
      fi
    done
    ;;
  verify)   # issue 30: mtp3 rounds at 32K, the verify pass's attention reading each KV tile once
    # for its 4 rows (verify-shared-kv) against once a row (before: 24.3 ms, 3.0x a plain step)
    apply
    for c in verify_shared_kv=true verify_shared_kv=false; do
      PYTHONPATH=/tmp/site:$PWD timeout 250 python3 bench/gpu_qwen35_decode.py --batches 1 \
        --context 32768 --long-contexts --mtp-rounds 6 --draft-tokens 3 --config $c \
        > "$out/ver-$c.log" 2>&1
      grep -E "^decode b1|^mtp" "$out/ver-$c.log" | sed "s/^/$c /" | cut -c1-220
    done
    ;;
  fp8-agree)   # after `bash bench/gpu_hold.sh prep nopeer` (carry .whl .xfer/part.a); carry
    # .xfer/part.b: greedy SmolLM2 with fp8 prefill GEMMs against fp16 (issue 31's agreement)
    apply
    bash bench/gpu_hold.sh smol > /dev/null || exit 1
    PYTHONPATH=/tmp/site:$PWD timeout 400 python3 bench/experiments/fp8_agreement.py \
      2>&1 | tee "$out/fp8-agree.log" | tail -n 5
    ;;
esac
