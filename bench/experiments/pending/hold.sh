#!/usr/bin/env bash
# One H200 hold for the pending patches (README.md here), a device call each, sent back to back
# (carry .whl; the machine keeps /tmp and the NVRTC cache between the calls of one hold):
#   bash bench/experiments/pending/hold.sh tests          the patches' GPU tests
#   bash bench/experiments/pending/hold.sh verify-micro   one 4-row verify pass's attention at
#                                                         32K / 128K, with and without
#   bash bench/experiments/pending/hold.sh verify         mtp3 rounds at 32K, with and without
#   bash bench/experiments/pending/hold.sh api            serve's fp16 KV default via the API
#        (after `bash bench/gpu_hold.sh prep nopeer`, carrying .xfer/part.a; this one part.b)
#   bash bench/experiments/pending/hold.sh prefill-split  SmolLM2's 512 / 4,096-token pass:
#        host against device time, device time by op, then its prefill rows on this tree and
#        on HEAD's (after prep, as api; carry .xfer/part.b and .xfer/before.tgz)
#   bash bench/experiments/pending/hold.sh dequant        the prefill GEMMs' operands: their
#        tests, the 27B prefill profile on this tree and on HEAD's (carry .xfer/before.tgz)
#   bash bench/experiments/pending/hold.sh l2-restore     where an L2 restore's time goes (27B shape)
#   bash bench/experiments/pending/hold.sh attn           the prefill attention at depth: its tests,
#        then the 27B profile at 2,048 tokens over 30,720 before the patches, after them, and
#        after them in 4-warp blocks two a multiprocessor (--attn-tiling 32,false,2,4); then
#        the kernel alone (attn_prefill_micro.py) before, and after in five tilings
#   bash bench/experiments/pending/hold.sh graph          prefill passes from CUDA graphs: their
#        tests, then SmolLM2's prefill rows before / after the patches (300 and 1,500 tokens:
#        padded to 512 and 2,048), alternated three times (one process to the next varies +-40 %
#        on the VM), and the pass's host / device split
#        (after prep nopeer, as api; carry .xfer/part.b)
#   bash bench/experiments/pending/hold.sh gdn            the chunked delta rule: its tests, then
#        the 27B profile at 8,192 tokens before and after the patches, twice
#   bash bench/experiments/pending/hold.sh fp8-gemm       the prefill GEMMs on fp8 (prefill_fp8): its
#        tests, then the 27B profile at 2,048 / 8,192 tokens on fp16, on fp8 before the
#        patches and after them
#   bash bench/experiments/pending/hold.sh sweep          no-code choices of the 27B decode step:
#        gdn_step over 4 blocks a value head (the default) against 8 (its mixer is 10-12 us a
#        GDN layer at one row, against ~1.5 us for the 6.3 MB of state it reads and writes)
#   bash bench/experiments/pending/hold.sh ncu [KERNELS]  Nsight Compute on the kernels furthest
#        from their bounds (KERNELS: any of attn_prefill gdn_chunk gdn_step, default all three):
#        the prefill attention at 2,048 tokens over 30,720 (attn_prefill_wgmma: ~240 TFLOP/s,
#        ~9K cycles a KV tile of two warpgroups against ~2K of MMA and ~2K of shared-memory
#        traffic), the chunked delta rule at 8,192 and gdn_step at one row; throughput, stall
#        reasons, L2 / shared-memory traffic (ncu.log, *.ncu-rep; ~200 s a kernel)
# then `bash bench/gpu_hold.sh traces` (carry .whl .xfer/tmpl.gguf), prefixed by `hold.sh apply &&`.
# Each call applies the patches to the copy of the tree it runs in (the copy is fresh each call;
# a second hold.sh in the same call finds them applied). Results under $OUT.
set -u
# (HOLD_START, epoch seconds: where several hold.sh share one call, SECONDS counts from it)
SECONDS=$(( $(date +%s) - ${HOLD_START:-$(date +%s)} ))
out=${OUT:-/tmp/out}
here=bench/experiments/pending
patches=""
case ${1:-} in apply|tests|verify-micro|verify|api|prefill-split|dequant|l2-restore|attn|graph|gdn|fp8-gemm|sweep|ncu) ;;
  *) echo "usage: bash $here/hold.sh apply|tests|verify-micro|verify|api|prefill-split|dequant|l2-restore|attn|graph|gdn|fp8-gemm|sweep|ncu" >&2; exit 2 ;;
esac
mkdir -p "$out"
[ -e /tmp/site/trio ] || python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/root/cupycache PYTHONPATH=/tmp/site:$PWD

in_tree() {   # in_tree TREE CMD...: CMD run in TREE with its ninfer first (`python -m` puts the
  # working directory first on sys.path, ahead of PYTHONPATH: a tree's runs start in it)
  local tree=$1; shift
  (cd "$tree" && PYTHONPATH=/tmp/site:$tree "$@")
}

apply_check() {   # whether the last patch is applied here (a second hold.sh in the same call)
  local last=${patches##* }
  [ -n "$last" ] || return 1
  if command -v git > /dev/null; then git apply -R --check "$here/$last.patch" 2> /dev/null
  else patch -p1 -R -s -f --dry-run < "$here/$last.patch" > /dev/null 2>&1; fi
}

apply() {   # every patch here (git apply, else patch); skipped where they are applied already
  [ -n "$patches" ] || return 0
  apply_check && return 0
  for p in $patches; do
    if command -v git > /dev/null; then
      git apply "$here/$p.patch" 2> /dev/null || git apply -C1 "$here/$p.patch"
    else patch -p1 -s -F2 < "$here/$p.patch"; fi || { echo "hold: $p.patch does not apply"; exit 1; }
  done
  echo "hold: applied $patches"
}

# attn, graph, gdn and fp8-gemm time the tree before the patches too (a copy of it, made first)
case $1 in attn|graph|gdn|fp8-gemm) [ -e /tmp/attnbefore/ninfer ] && apply_check || {
  rm -rf /tmp/attnbefore && mkdir -p /tmp/attnbefore && cp -r ninfer bench tests /tmp/attnbefore/; } ;; esac
apply
case $1 in
  tests)   # a hung kernel ends its test (pytest-timeout's thread method), not the whole call
    tmo=$(python3 -c "import pytest_timeout" 2>/dev/null \
      && echo "--timeout 150 --timeout-method thread")
    timeout 500 python3 -m pytest -n 12 -q -rfE --tb=short -p no:cacheprovider $tmo \
      tests/kernels/test_cupy_ops.py tests/kernels/test_cupy_spec.py \
      tests/kernels/test_cupy_kv16.py tests/kernels/test_cupy_kv8.py \
      tests/kernels/test_cupy_kvrk.py -k "verify or rows or greedy or spec or attention" \
      2>&1 | tee "$out/t-ops.log" | tail -n 15 ;;
  verify-micro)
    for ctx in 32768 131072; do
      timeout 150 python3 $here/verify_attn_micro.py $ctx 2>&1 | tee -a "$out/micro.log" | tail -n 3
    done ;;
  verify)   # mtp3 rounds at 32K, the verify pass's attention reading each KV tile once for its
    # 4 rows, against once a row (2026-12-05: 23.0 ms both ways)
    for c in verify_shared_kv=true verify_shared_kv=false; do
      timeout 250 python3 bench/gpu_qwen35_decode.py --batches 1 --context 32768 \
        --long-contexts --mtp-rounds 6 --draft-tokens 3 --config $c > "$out/ver-$c.log" 2>&1
      grep -E "^decode b1|^mtp" "$out/ver-$c.log" | sed "s/^/$c /" | cut -c1-220
    done ;;
  api)   # the API and reuse tests on the GPU, where serve stores the KV cache as fp16 by default
    bash bench/gpu_hold.sh smol > /dev/null || exit 1
    NINFER_TEST_BACKEND=cupy timeout 560 python3 -m pytest -n 8 -q -rfE --tb=short \
      -p no:cacheprovider tests/api tests/engine/test_prefix_reuse.py tests/engine/test_spec_tiers.py \
      2>&1 | tee "$out/t-api.log" | tail -n 15 ;;
  prefill-split)   # is SmolLM2's 512-token pass (19.9 ms, ~19 fixed) the host's or an op's?
    bash bench/gpu_hold.sh smol > /dev/null || exit 1
    timeout 200 python3 bench/experiments/gpu_prefill_split.py --prefill 512,4096 \
      --json "$out/split.json" 2>&1 | tee "$out/split.log" | tail -n 30
    mkdir -p /tmp/before && tar -xzf .xfer/before.tgz -C /tmp/before   # HEAD's ninfer/
    for tree in $PWD /tmp/before; do   # SmolLM2's prefill rows, this tree then HEAD's
      in_tree $tree timeout 150 python3 -m ninfer bench prefill /root/keep/smol.gguf \
        --prefill 512,4096 --reps 5 --kv-dtype fp16 2>&1 | tail -n 4 | sed "s|^|$tree |"
    done ;;
  dequant)   # the prefill GEMMs' operands: the coalesced fp16 weight copy (in_proj's took
    # 0.213-0.216 ms a pass before, 1 TB/s), fp16 prologues and the residual in the epilogue;
    # the 27B prefill profile on this tree, then on HEAD's ninfer/ (.xfer/before.tgz, carried)
    timeout 200 python3 -m pytest -n 8 -q -rfE --tb=short -p no:cacheprovider \
      tests/kernels/test_cupy_ops.py -k "dequantize or fused_linear or prefill or rms_norm \
      or silu" 2>&1 | tee "$out/t-dequant.log" | tail -n 5
    for tree in new before; do
      pp=$PWD
      if [ $tree = before ]; then
        [ -e .xfer/before.tgz ] || break
        mkdir -p /tmp/before && tar -xzf .xfer/before.tgz -C /tmp/before && pp=/tmp/before:$PWD
      fi
      PYTHONPATH=/tmp/site:$pp timeout 190 python3 bench/experiments/gpu_qwen35_prefill_profile.py \
        --tokens 512 4096 --kv-dtype fp16 --json "$out/prefill-profile-$tree.json" 2>&1 \
        | tee "$out/prefill-profile-$tree.log" | grep -E -i "dequant|estimate|tok/s|mlp|proj" \
        | sed "s/^/$tree /" | cut -c1-160
    done ;;
  l2-restore)   # an L2 demotion (export_lane) and restore (import_lane), 27B shape
    timeout 150 python3 bench/experiments/gpu_l2_restore.py --tokens 5600 32768 \
      --json "$out/l2-restore.json" 2>&1 | tee "$out/l2-restore.log"
    NINFER_TEST_BACKEND=cupy timeout 200 python3 -m pytest -q -rfE --tb=short -p no:cacheprovider \
      tests/kernels/test_cupy_ops.py -k "continuation or round_trip" 2>&1 | tail -n 5 ;;
  attn)   # paged_attention at 2,048 tokens over 30,720: 10.31 ms a layer on an H100 (2026-12-05)
    timeout 200 python3 -m pytest -n 8 -q -rfE --tb=short -p no:cacheprovider \
      tests/kernels/test_cupy_ops.py tests/kernels/test_cupy_kv16.py -k "paged_attention or prefill" \
      2>&1 | tee "$out/t-attn.log" | tail -n 5
    for run in before:/tmp/attnbefore after:$PWD tiled:$PWD; do
      name=${run%%:*} tree=${run#*:}
      in_tree $tree timeout 100 python3 bench/experiments/gpu_qwen35_prefill_profile.py \
        --tokens 2048 --context 30720 --kv-dtype fp16 \
        $([ $name = tiled ] && echo --attn-tiling 32,false,2,4) --json "$out/attn-$name.json" \
        2>&1 | grep -E "paged_attention|estimate" | sed "s/^/$name /"
    done
    # the kernel alone: the default tiling before the patches, then five tilings after them
    in_tree /tmp/attnbefore timeout 120 python3 bench/experiments/attn_prefill_micro.py \
      --tilings 64,false,1,8 2>&1 | grep "^T=" | sed "s/^/before /"
    timeout 300 python3 bench/experiments/attn_prefill_micro.py --tilings 64,false,1,8 \
      32,false,2,4 16,false,2,4 32,false,1,8 64,false,1,4 --json "$out/attn-micro.json" 2>&1 \
      | grep "^T=" | sed "s/^/after /" ;;
  graph)   # SmolLM2's 512-token pass: ~12 ms of host issue time, the device idle behind it
    bash bench/gpu_hold.sh smol > /dev/null || exit 1
    timeout 200 python3 -m pytest -n 8 -q -rfE --tb=short -p no:cacheprovider \
      tests/kernels/test_cupy_ops.py -k "prefill_passes_replayed or graph or kept_fp16 or f16_are or prefill_linear" \
      2>&1 | tee "$out/t-graph.log" | tail -n 5
    timeout 150 python3 -m pytest -q -rfE --tb=short -p no:cacheprovider \
      tests/kernels/test_cupy_ops.py -m slow -k "server_on_the_gpu or greedy_gpu_equals_cpu" \
      2>&1 | tail -n 3
    for i in 1 2 3; do
      for run in before:/tmp/attnbefore after:$PWD; do
        in_tree ${run#*:} timeout 60 python3 -m ninfer bench prefill /root/keep/smol.gguf \
          --prefill 300,512,1500,4096 --reps 8 2>&1 | grep "^prefill [0-9]*:" \
          | sed "s/^/${run%%:*} /"
      done
    done
    timeout 100 python3 bench/experiments/gpu_prefill_split.py --prefill 512,4096 2>&1 \
      | grep "^prefill" ;;
  gdn)   # the delta rule: 2.91 ms a GDN layer at 8,192 tokens on an H100 (2026-12-06); main
    # (before the patches) and the patched tree, twice
    NINFER_TEST_BACKEND=cupy timeout 200 python3 -m pytest -n 4 -q -rfE --tb=short \
      -p no:cacheprovider tests/kernels/test_cupy_gdn_chunk.py tests/kernels/test_cupy_ops.py \
      -k "gated_delta or chunk" 2>&1 | tee "$out/t-gdn.log" | tail -n 4
    for run in before:/tmp/attnbefore after:$PWD before:/tmp/attnbefore after:$PWD; do
      in_tree ${run#*:} timeout 100 python3 bench/experiments/gpu_qwen35_prefill_profile.py \
        --tokens 8192 --kv-dtype fp16 2>&1 | grep -E "gated_delta_rule|gdn.mixer|estimate" \
        | sed "s/^/${run%%:*} /" | cut -c1-160
    done ;;
  fp8-gemm)   # the prefill GEMMs on fp8 (prefill_fp8): its tests, then the 27B profile at
    # 2,048 and 8,192 tokens on fp16, on fp8 before the patches and after them, twice
    # SmolLM2 where prep kept part.a and part.b is carried (else its test skips)
    if [ -e /root/keep/smol.gguf ] || { [ -e /root/keep/part.a ] && [ -e .xfer/part.b ]; }; then
      bash bench/gpu_hold.sh smol > /dev/null || exit 1
    fi
    NINFER_TEST_BACKEND=cupy timeout 150 python3 -m pytest -q -rfE --tb=short -s \
      -p no:cacheprovider tests/kernels/test_cupy_fp8.py 2>&1 | tee "$out/t-fp8.log" \
      | grep -E "rel|passed|failed|FAILED|Error" | tail -n 12   # (-s: the errors it prints)
    NINFER_TEST_BACKEND=cupy timeout 200 python3 -m pytest -n 4 -q -rfE --tb=short \
      -p no:cacheprovider tests/kernels/test_cupy_ops.py \
      -k "kept_fp16 or prefill_linear or fused_linear" 2>&1 | tail -n 3
    # fp16 GEMMs, fp8 as main has it (before the patches), fp8 with the patches; twice
    for run in fp16:$PWD:0 fp8:/tmp/attnbefore:1 fp8-patched:$PWD:1 fp16:$PWD:0 \
               fp8:/tmp/attnbefore:1 fp8-patched:$PWD:1; do
      IFS=: read -r name tree c <<< "$run"
      [ $name = fp16 ] && [ $SECONDS -gt 400 ] && break   # (a second round where there is time)
      in_tree $tree timeout 100 python3 bench/experiments/gpu_qwen35_prefill_profile.py \
        --tokens 2048 8192 --kv-dtype fp16 --config prefill_fp8=$c 2>&1 \
        | grep -E "mlp|in_proj \(|estimate" | sed "s/^/$name /" | cut -c1-170
    done ;;
  sweep)   # (the patches applied too: none touches the decode step)
    for c in gdn_col_split=4 gdn_col_split=8; do
      timeout 270 python3 bench/gpu_qwen35_decode.py --batches 1 8 --long-contexts \
        --mtp-rounds 4 --draft-tokens 3 --kv-dtype fp16 --config $c > "$out/sweep-$c.log" 2>&1
      grep -E "^decode b|^mtp" "$out/sweep-$c.log" | sed "s/^/$c /" | cut -c1-200
    done ;;
  ncu)   # (the patches applied: gdn-chunk-loads' kernels are the ones profiled)
    n=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    [ -n "$n" ] || { echo "hold: no ncu on this machine"; exit 1; }
    want=" ${*:2} "
    for run in "attn_prefill:1:gpu_qwen35_prefill_profile.py --tokens 2048 --context 30720 --kv-dtype fp16" \
               "gdn_chunk:3:gpu_qwen35_prefill_profile.py --tokens 8192 --kv-dtype fp16" \
               "gdn_step:1:gpu_qwen35_profile.py"; do
      k=${run%%:*} rest=${run#*:}
      [ "$want" = "  " ] || [[ $want == *" $k "* ]] || continue
      timeout 200 $n --clock-control none -k "regex:$k" -c ${rest%%:*} --set full -f -o "$out/$k" \
        python3 bench/experiments/${rest#*:} > "$out/ncu-$k.out" 2>&1
      $n --import "$out/$k.ncu-rep" --page details 2>&1 | tee -a "$out/ncu.log" | grep -E \
        "Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|Shared|Stall|Warp Cycles Per Issued|Issued Ipc|Achieved Occupancy|Registers Per|Bank" \
        | sed "s/^/$k /" | head -60
      # every metric (stall reasons, bank conflicts, L2 / shared-memory traffic) as CSV
      $n --import "$out/$k.ncu-rep" --page raw --csv > "$out/ncu-raw-$k.csv" 2>&1
    done ;;
esac
