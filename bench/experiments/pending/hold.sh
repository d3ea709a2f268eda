#!/usr/bin/env bash
# One H200 hold for the pending patches (README.md here), a call each, sent back to back:
#   call 1  bash bench/experiments/pending/hold.sh tests      carry .whl (apply the patches first)
#   call 2  bash bench/experiments/pending/hold.sh profile
#   call 3  bash bench/experiments/pending/hold.sh decode
#   call 4  bash bench/experiments/pending/hold.sh prefill    (GGUF ~50 s, load ~80 s)
# then `bash bench/gpu_hold.sh traces` (carry .whl .xfer/tmpl.gguf) for issue 33's rows.
# Results under $OUT; the NVRTC cache survives between the calls of one hold.
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out"
[ -e /tmp/site/trio ] || python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/root/cupycache
dtypes="fp16 int8 rk4v4-e8"
case ${1:-} in
  tests)   # the patched kernels' tests, then the fixture move's (test_cupy_ops)
    timeout 330 python3 -m pytest -n 12 -q -rfE --tb=short -p no:cacheprovider \
      tests/kernels/test_cupy_kv16.py tests/kernels/test_cupy_kv8.py \
      tests/kernels/test_cupy_kvrk.py -k "attention or verify or fused or greedy" \
      2>&1 | tee "$out/t-kv.log" | tail -n 15
    timeout 200 python3 -m pytest -n 12 -q -rfE --tb=short -p no:cacheprovider \
      tests/kernels/test_cupy_ops.py -k "paged_attention or rope or gdn_mixer or prestaged" \
      2>&1 | tee "$out/t-ops.log" | tail -n 15
    ;;
  profile)   # one attention layer's prefill over a 32K cache, by dtype (before: 26.9 / 38.7 /
    # 37.7 ms)
    for d in $dtypes; do
      timeout 150 python3 bench/experiments/gpu_qwen35_prefill_profile.py --tokens 3456 \
        --context 29312 --kv-dtype $d --json "$out/pp-$d.json" > "$out/pp-$d.log" 2>&1
      grep -E "paged_attention|estimate" "$out/pp-$d.log" | sed "s/^/$d /"
    done
    ;;
  decode)   # b1 at 32K and 128K by dtype (before, 128K device step: 14.621 / 15.004 / 15.269)
    for d in $dtypes fp32; do
      timeout 140 python3 bench/gpu_qwen35_decode.py --batches 1 --mtp-rounds 0 \
        --long-contexts 32768 131072 --steps 16 --kv-dtype $d --json "$out/d-$d.json" \
        > "$out/d-$d.log" 2>&1
      grep -E "^decode b1" "$out/d-$d.log" | sed "s/^/$d /" | cut -c1-220
    done
    # the short-context rows over fp32 pages (decode-ring-fp32.patch must not cost them)
    timeout 150 python3 bench/gpu_qwen35_decode.py --batches 1 8 --long-contexts --mtp-rounds 8 \
      --draft-tokens 3 --json "$out/d-short.json" > "$out/d-short.log" 2>&1
    grep -E "^(decode b|mtp)" "$out/d-short.log" | cut -c1-200
    ;;
  prefill)   # 32K in 3,456-token passes by dtype, one load (before: 4,780 / 4,234 / 4,240)
    [ -e /tmp/q35.gguf ] || python3 bench/make_qwen35_gguf.py /tmp/q35.gguf 27b | tail -n 1
    timeout 480 python3 - "$out/p32k.json" $dtypes fp32 <<'PY'
import dataclasses, json, sys
from ninfer.bench import model, prefill
bm = model.load("/tmp/q35.gguf", "cupy", max_positions=33000, max_batch=1)
res = {}
for d in sys.argv[2:]:
    res[d] = prefill.measure(dataclasses.replace(bm, kv_dtype=d), lengths=(32768,),
                             chunk=3456, reps=1)
    print(d, res[d], flush=True)
json.dump(res, open(sys.argv[1], "w"))
PY
    ;;
  *) echo "usage: bash bench/experiments/pending/hold.sh tests|profile|decode|prefill" >&2; exit 2;;
esac
