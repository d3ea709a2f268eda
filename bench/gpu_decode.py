"""GPU (CuPy backend) decode and prefill throughput, and the memory-roofline fraction.

Usage (on the GPU machine):
    python bench/gpu_decode.py MODEL.gguf|.ninfer [--batches 1,8,32] [--prefill 512,4096]
        [--steps 64] [--context 64] [--megakernel on|off|force|WxUPW] [--swiglu-epilogue on|off]
        [--variants 'fattn=off;fattn=on,swiglu=on' [--rounds 2]]
        [--defines=-DNAME=VALUE,...] [--peer LLAMA_BENCH] [--json OUT.json]

Measures, in one process:
- device copy bandwidth: a 2 GiB device-to-device copy, bytes read + written over the median of
  10 event-timed copies;
- decode tok/s at each batch size B: B sequences with ``--context`` cached tokens each, then
  ``--steps`` timed decode passes after 3 warm-up passes, twice: plain (``model.forward`` +
  device argmax, the ids read back before the next pass is built: ``tok_s_plain``) and, with
  CUDA graphs, as the engine's greedy rounds run (``EngineConfig.decode_lookahead``: pass N + 1
  launched, its tokens fed on the device, before pass N's ids are read: ``tok_s``; its tokens
  must equal the plain ones, ``lookahead_tokens_match``);
- prefill tok/s at each length P: one sequence of P tokens in one forward pass (median of 3
  after a warm-up);
- batch-1 roofline fraction = bytes streamed per token (every packed weight once, except the
  embedding table unless tied to the output head, plus the K/V read at the mean context) x tok/s
  / copy bandwidth;
- with ``--peer``: llama.cpp's ``llama-bench`` (tg128, pp512) on the same GGUF, afterwards in the
  same process, printed next to ninfer's batch-1 decode (its roofline fraction with ninfer's bytes
  per token and this run's copy bandwidth) and prefill 512 (``bench/peer.py``).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

try:
    import cupy as cp
except ImportError:  # --help works without it; main() says what is missing
    cp = None

from ninfer.engine.models.llama import ForwardBatch, LlamaModel
from ninfer.kernels import get_ops
from ninfer.store.artifact import load_model_file
from benchutil import report  # bench/ is on sys.path when run as a script


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    a = cp.empty(nbytes // 4, dtype=cp.float32)
    a.fill(1.0)
    b = cp.empty_like(a)
    times = []
    for i in range(12):
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record()
        cp.copyto(b, a)
        e.record()
        e.synchronize()
        if i >= 2:
            times.append(cp.cuda.get_elapsed_time(s, e) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(times)


def weight_bytes(model: LlamaModel) -> int:
    """Device bytes one decode pass streams from the weights."""
    def nb(w):
        if isinstance(w, cp.ndarray):
            return int(w.nbytes)
        if hasattr(w, "parts"):
            return sum(nb(p) for p in w.parts)
        return int(w.nbytes)
    model = getattr(model, "model", model)
    total = nb(model.norm) + nb(model.lm_head)
    for layer in model.layers:
        total += sum(nb(getattr(layer, f)) for f in ("input_norm", "qkv", "o", "post_norm",
                                                      "gate_up", "down"))
    return total


def decode_bench(model, ops, kv, batch: int, context: int, steps: int, page_size: int = 16,
                 lookahead: bool = False):
    """Decode tok/s of ``batch`` lanes over ``kv`` (one cache shared by every batch size, so
    the graphs captured against it are reused) -> (tok/s, median step seconds, the tokens of
    lane 0, whether the lookahead ran: ``greedy`` declines batches that run eagerly). Plain: each step ``model.forward``, the device argmax and the ids read back before
    the next step is built. ``lookahead`` (the engine's greedy rounds,
    ``EngineConfig.decode_lookahead``; a ``CudaGraphDecoder`` only): step N + 1 is launched
    with the ids of step N fed on the device (``greedy(feed=True)``) before step N's ids are
    read; a step's time is then the interval between two reads."""
    c = model.config
    pages_per = -(-(context + steps + 8) // page_size)
    tables = [list(range(i * pages_per, (i + 1) * pages_per)) for i in range(batch)]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, c.vocab_size, size=context).tolist() for _ in range(batch)]
    # prefill each lane's context (batched in one ragged pass)
    logits = model.forward(ForwardBatch.from_sequences(prompts, [0] * batch, tables, page_size),
                           kv)
    last = ops.argmax(logits).tolist()
    out = [last[0]]
    n = context
    times = []
    greedy = getattr(model, "greedy", None) if lookahead else None
    pending = greedy and greedy(ForwardBatch.from_sequences([[t] for t in last], [n] * batch,
                                                            tables, page_size), kv)
    ran = pending is not None
    if ran:   # (None: this batch runs eagerly; then plain steps)
        t0 = time.perf_counter()
        for step in range(steps + 3):
            n += 1
            nxt = greedy(ForwardBatch.from_sequences([[0]] * batch, [n] * batch, tables,
                                                     page_size), kv, feed=True)
            out.append(int(pending()[0]))
            t1 = time.perf_counter()
            if step >= 3:
                times.append(t1 - t0)
            t0, pending = t1, nxt
        pending()
    else:
        for step in range(steps + 3):
            t0 = time.perf_counter()
            b = ForwardBatch.from_sequences([[t] for t in last], [n] * batch, tables, page_size)
            last = ops.argmax(model.forward(b, kv)).tolist()
            t1 = time.perf_counter()
            out.append(last[0])
            n += 1
            if step >= 3:
                times.append(t1 - t0)
    dt = sum(times)
    return batch * steps / dt, statistics.median(times), out, bool(ran)


def device_step(model, ops, reps: int = 64) -> float | None:
    """Seconds of device time per batch-1 decode step: the captured graph of the bucket of
    one (as decode_bench last filled it; it ends with the argmax of the logits), replayed
    ``reps`` times back to back between two events, no host work in between; None without a
    captured graph."""
    bk = getattr(model, "_b", {}).get(1)
    if bk is None or bk.graph is None:
        return None
    stream = cp.cuda.get_current_stream()
    for _ in range(3):
        bk.graph.launch(stream=stream)
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record(stream)
    for _ in range(reps):
        bk.graph.launch(stream=stream)
    e.record(stream)
    e.synchronize()
    return cp.cuda.get_elapsed_time(s, e) / 1e3 / reps


def prefill_bench(model, ops, length: int, page_size: int = 16):
    pages = -(-length // page_size)
    kv = model.new_kv_cache(pages, page_size)
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, size=length).tolist()
    b = ForwardBatch.from_sequences([ids], [0], [list(range(pages))], page_size)
    times = []
    for i in range(4):
        ops.synchronize()
        t0 = time.perf_counter()
        ops.argmax(model.forward(b, kv))
        t1 = time.perf_counter()
        if i:
            times.append(t1 - t0)
    return length / statistics.median(times)


def b1_again(model, ops, a, c, wbytes: int, bw: float) -> dict:
    """Batch-1 decode with a fresh CUDA-graph wrapper (new captures: the current kernel
    choices) -> tok/s, median step and roofline fraction."""
    from ninfer.kernels.gpu.graphs import CudaGraphDecoder
    m2 = CudaGraphDecoder(model.model, max_pages=model.max_pages, enabled=not a.no_cuda_graph)
    kv2 = m2.new_kv_cache(-(-(a.context + a.steps + 8) // 16), 16)
    tps, med, _, _ = decode_bench(m2, ops, kv2, 1, a.context, a.steps,
                                  lookahead=not a.no_cuda_graph and not a.no_lookahead)
    ctx = a.context + a.steps / 2
    kv_bytes = ctx * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4
    out = {"tok_s": round(tps, 1), "step_ms_median": round(med * 1e3, 3),
           "roofline_fraction": round((wbytes + kv_bytes) * tps / bw, 3)}
    dev = device_step(m2, ops)
    if dev:
        out["device_step_ms"] = round(dev * 1e3, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("model", help="a GGUF or .ninfer file")
    ap.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    ap.add_argument("--prefill", default="512,4096", help="prefill lengths ('' for none)")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per batch size")
    ap.add_argument("--context", type=int, default=64, help="cached tokens per lane at start")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--no-cuda-graph", action="store_true",
                    help="run the padded decode schedule eagerly")
    ap.add_argument("--no-lookahead", action="store_true",
                    help="time only plain decode steps (no round launched ahead with its "
                         "tokens fed on the device, as the engine's greedy rounds run)")
    ap.add_argument("--plain", action="store_true", help="plain model.forward (no wrapper)")
    ap.add_argument("--gemv-shapes", default="",
                    help="batch-1 decode again with each T = 1 GEMV shape RTxU, e.g. 1x4,2x4 "
                         "(gpu.linear.Q8A_SHAPE[True] with int8 activations, else MMA_SHAPE[1])")
    ap.add_argument("--gemv-activations", choices=("auto", "q8", "f16"), default="auto",
                    help="decode GEMV activations (gpu.linear.ACTIVATIONS): int8, fp16, or "
                         "auto (int8 in gemv_bulk only)")
    ap.add_argument("--gemv-stages", type=int, default=None,
                    help="gemv_mma weight-ring steps (gpu.linear.GEMV_STAGES; 0: registers)")
    ap.add_argument("--bulk-shapes", default="",
                    help="batch-1 decode again with each T = 1 gemv_bulk shape WxUPWxNSxBPS "
                         "(consumer warps, chunks per warp per slot, ring slots, blocks per "
                         "multiprocessor; gpu.linear.BULK_SHAPE), or off")
    ap.add_argument("--defines", default="",
                    help="comma-separated NVRTC defines for every kernel (experiments), e.g. "
                         "-DBULK_INFLIGHT_BYTES=65536")
    ap.add_argument("--peer", default=None, metavar="LLAMA_BENCH",
                    help="then run this llama.cpp llama-bench binary on the same GGUF (tg128, "
                         "pp512; bench/peer.py) and print both engines side by side")
    ap.add_argument("--swiglu-epilogue", choices=("on", "off"), default=None,
                    help="SiLU(gate) * up in gate_up's epilogue (gpu.linear.SWIGLU_EPILOGUE, on "
                         "by default) or in down's prologue (default: leave the module setting)")
    ap.add_argument("--variants", default="",
                    help="batch-1 decode again under each ';'-separated variant of knobs "
                         "(swiglu=on|off: gpu.linear.SWIGLU_EPILOGUE; shadow=on|off: "
                         "gpu.linear.Q8_SHADOW; shadowswiglu=on|off: Q8_SHADOW_SWIGLU; "
                         "fattn=on|off|auto: "
                         "cupy_ops.FUSED_DECODE_ATTENTION; shape=WxUPWxNSxBPS: "
                         "gpu.linear.BULK_SHAPE; minslots=N: gpu.linear.BULK_MIN_SLOTS; "
                         "budget=NxK:KiB[/BPS]+...: gpu.linear.BULK_BUDGET; shortbps=N: "
                         "gpu.linear.BULK_SHORT_BPS; "
                         "carveout=PCT: gpu.CARVEOUT (-1: none); "
                         "minpart=N: gpu.attention.MIN_PARTITION; "
                         "def=NAME+NAME: NVRTC defines of experiment "
                         "switches, e.g. BULK_FAKE_PRODUCER, BULK_NO_STAGE), e.g. "
                         "'fattn=off;fattn=on,swiglu=on;"
                         "shape=16x2x4x2', the list run --rounds times in turn (same-lease A/B "
                         "comparisons)")
    ap.add_argument("--rounds", type=int, default=2, help="passes over --variants")
    ap.add_argument("--megakernel", default=None,
                    help="batch-1 decode through gpu.megakernel where it applies (on, or a "
                         "WxUPW consumer shape; force: also small models), or the layers op by "
                         "op (off); default: as configured (NINFER_MEGAKERNEL, off)")
    a = ap.parse_args()
    if cp is None:
        ap.error("needs CuPy and an NVIDIA GPU (pip install cupy-cuda12x)")
    if a.peer and not str(a.model).endswith(".gguf"):  # before any measurement
        ap.error("--peer needs the GGUF file (llama-bench reads GGUF only)")
    from ninfer.kernels.gpu import linear as glin
    from ninfer.kernels import gpu
    from ninfer.kernels.gpu import megakernel
    from ninfer.kernels.gpu import attention as gattn
    gpu.DEFINES = tuple(d for d in a.defines.split(",") if d)
    if a.swiglu_epilogue is not None:
        glin.SWIGLU_EPILOGUE = a.swiglu_epilogue == "on"
    if a.megakernel is not None:
        megakernel.ENABLED = a.megakernel != "off"
        megakernel.FORCE = a.megakernel == "force"
    if a.megakernel and "x" in a.megakernel:
        megakernel.W, megakernel.UPW = (int(x) for x in a.megakernel.split("x"))
    glin.ACTIVATIONS = a.gemv_activations
    if a.gemv_stages is not None:
        glin.GEMV_STAGES = a.gemv_stages
    ops = get_ops("cupy")
    t0 = time.perf_counter()
    art = load_model_file(a.model)
    model = LlamaModel.from_artifact(art, ops)
    if not a.plain:
        from ninfer.kernels.gpu.graphs import CudaGraphDecoder
        need = max(4096, a.context + a.steps + 16, *(int(p) for p in a.prefill.split(",") if p))
        model = CudaGraphDecoder(model, max_pages=-(-need // 16), enabled=not a.no_cuda_graph)
    ops.synchronize()
    load_s = time.perf_counter() - t0
    bw = copy_bandwidth()
    c = model.config
    wbytes = weight_bytes(model)
    res = {"model": str(a.model),
           "mode": "plain" if a.plain else ("eager" if a.no_cuda_graph else "cuda_graph"), "gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
           "date": time.strftime("%Y-%m-%d"), "load_s": round(load_s, 1),
           "gemv_activations": a.gemv_activations, "gemv_stages": glin.GEMV_STAGES,
           "gemv_bulk": glin.BULK and glin.BULK_SHAPE["q8" if glin.bulk_q8() else "f16"],
           "attn_cluster": gattn.CLUSTER, "copy_bw_GBs": round(bw / 1e9, 1),
           "weight_bytes_per_token": wbytes,
           "decode": {}, "prefill": {}}
    sizes = [int(x) for x in a.batches.split(",") if x]
    kv = model.new_kv_cache(max(sizes) * -(-(a.context + a.steps + 8) // 16), 16)
    ahead = (callable(getattr(model, "greedy", None)) and not a.no_lookahead
             and not a.no_cuda_graph)
    for bsz in sizes:
        # plain steps first (each reads its ids before the next is built), then, where the
        # engine's greedy rounds run ahead (graph replays), the same decode with the lookahead:
        # its tokens must be the plain ones
        tps0, med0, toks0, _ = decode_bench(model, ops, kv, bsz, a.context, a.steps)
        entry = {"tok_s_plain": round(tps0, 1), "step_ms_median_plain": round(med0 * 1e3, 3)}
        tps, med = tps0, med0
        if ahead:
            tps, med, toks, ran = decode_bench(model, ops, kv, bsz, a.context, a.steps,
                                               lookahead=True)
            entry["lookahead"] = ran
            entry["lookahead_tokens_match"] = toks == toks0
            if toks != toks0:
                first = next(i for i, (x, y) in enumerate(zip(toks, toks0)) if x != y)
                print(f"decode batch {bsz}: the lookahead's tokens differ from the plain "
                      f"steps' from step {first}", flush=True)
        entry.update({"tok_s": round(tps, 1), "step_ms_median": round(med * 1e3, 3)})
        if bsz == 1:
            ctx = a.context + a.steps / 2
            kv_bytes = ctx * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4
            entry["bytes_per_token"] = int(wbytes + kv_bytes)
            entry["roofline_fraction"] = round((wbytes + kv_bytes) * tps / bw, 3)
            entry["roofline_fraction_plain"] = round((wbytes + kv_bytes) * tps0 / bw, 3)
            # launches from Python (eager passes, graph warm-ups and captures; replays of a
            # captured graph do not count): > 0 means the megakernel ran
            entry["megakernel_launches"] = megakernel.LAUNCHES
            dev = device_step(model, ops)
            if dev:  # the step's device time alone: the rest of step_ms_median is host time
                entry["device_step_ms"] = round(dev * 1e3, 3)
        res["decode"][bsz] = entry
        print(f"decode batch {bsz}: {entry}", flush=True)
    if a.gemv_shapes and not a.plain:
        from ninfer.kernels.gpu.graphs import CudaGraphDecoder
        table = glin.Q8A_SHAPE if a.gemv_activations == "q8" else glin.MMA_SHAPE
        key = True if a.gemv_activations == "q8" else 1
        default = table[key]
        res["decode_b1_by_gemv_shape"] = {}
        for spec in a.gemv_shapes.split(","):
            table[key] = tuple(int(v) for v in spec.split("x"))
            res["decode_b1_by_gemv_shape"][spec] = b1_again(model, ops, a, c, wbytes, bw)
            print(f"decode b1 gemv shape {spec}: {res['decode_b1_by_gemv_shape'][spec]}",
                  flush=True)
        table[key] = default
    if a.bulk_shapes and not a.plain:
        res["decode_b1_by_bulk_shape"] = {}
        saved = glin.BULK, dict(glin.BULK_SHAPE)
        for spec in a.bulk_shapes.split(","):
            if spec == "off":
                glin.BULK = False
            else:
                glin.BULK = True
                glin.BULK_SHAPE["q8" if glin.bulk_q8() else "f16"] = tuple(
                    int(x) for x in spec.split("x"))
            res["decode_b1_by_bulk_shape"][spec] = entry = b1_again(model, ops, a, c, wbytes, bw)
            print(f"decode b1 gemv_bulk {spec}: {entry}", flush=True)
        glin.BULK = saved[0]
        glin.BULK_SHAPE.update(saved[1])
    if a.variants and not a.plain:
        from ninfer.kernels import cupy_ops
        res["decode_b1_by_variant"] = {}
        saved = (glin.SWIGLU_EPILOGUE, cupy_ops.FUSED_DECODE_ATTENTION, glin.Q8_SHADOW,
                 glin.Q8_SHADOW_SWIGLU)
        min_slots = glin.BULK_MIN_SLOTS
        budgets = dict(glin.BULK_BUDGET)
        short_bps = glin.BULK_SHORT_BPS
        carveout = gpu.CARVEOUT
        shapes = dict(glin.BULK_SHAPE)
        defines = gpu.DEFINES
        min_part = gattn.MIN_PARTITION
        cluster, cap = gattn.CLUSTER, gattn.CLUSTER_PART_CAP

        def restore() -> None:   # every knob back to its value before the variants
            (glin.SWIGLU_EPILOGUE, cupy_ops.FUSED_DECODE_ATTENTION, glin.Q8_SHADOW,
             glin.Q8_SHADOW_SWIGLU) = saved
            glin.BULK_SHAPE.update(shapes)
            gpu.DEFINES = defines
            gattn.MIN_PARTITION = min_part
            gattn.CLUSTER, gattn.CLUSTER_PART_CAP = cluster, cap
            glin.BULK_MIN_SLOTS = min_slots
            glin.BULK_BUDGET.clear()
            glin.BULK_BUDGET.update(budgets)
            glin.BULK_SHORT_BPS = short_bps
            gpu.set_carveout(carveout)

        for r in range(a.rounds):
            for spec in a.variants.split(";"):
                restore()
                for knob in spec.split(","):
                    key, val = knob.split("=", 1)
                    if key == "fattn":
                        cupy_ops.FUSED_DECODE_ATTENTION = val
                    elif key == "shape":
                        glin.BULK_SHAPE["q8" if glin.bulk_q8() else "f16"] = tuple(
                            int(v) for v in val.split("x"))
                    elif key == "swiglu":
                        glin.SWIGLU_EPILOGUE = val == "on"
                    elif key == "shadow":  # q8 shadows (gpu.linear.Q8_SHADOW)
                        glin.Q8_SHADOW = val == "on"
                    elif key == "shadowswiglu":  # ... from the SwiGLU epilogue
                        glin.Q8_SHADOW_SWIGLU = val == "on"
                    elif key == "minslots":  # gpu.linear.BULK_MIN_SLOTS
                        glin.BULK_MIN_SLOTS = int(val)
                    elif key == "budget":  # gpu.linear.BULK_BUDGET
                        glin.BULK_BUDGET.update(glin.parse_bulk_budget(val))
                    elif key == "shortbps":  # gpu.linear.BULK_SHORT_BPS
                        glin.BULK_SHORT_BPS = int(val)
                    elif key == "carveout":  # gpu.CARVEOUT (percent; -1: no preference)
                        gpu.set_carveout(None if int(val) < 0 else int(val))
                    elif key == "minpart":  # gpu.attention.MIN_PARTITION (decode splits)
                        gattn.MIN_PARTITION = int(val)
                    elif key == "cluster":  # gpu.attention.CLUSTER (0: attn_merge)
                        gattn.CLUSTER = int(val)
                    elif key == "cap":  # gpu.attention.CLUSTER_PART_CAP
                        gattn.CLUSTER_PART_CAP = int(val)
                    elif key == "def":  # NVRTC defines of experiment switches, '+'-separated
                        gpu.DEFINES = tuple(f"-D{d}" for d in val.split("+") if d)
                    else:
                        raise SystemExit(f"--variants: unknown knob {key!r}")
                entry = b1_again(model, ops, a, c, wbytes, bw)
                res["decode_b1_by_variant"].setdefault(spec, []).append(entry)
                print(f"decode b1 variant {spec} (round {r}): {entry}", flush=True)
        restore()
    for p in [int(x) for x in a.prefill.split(",") if x]:
        res["prefill"][p] = round(prefill_bench(model, ops, p), 1)
        print(f"prefill {p}: {res['prefill'][p]} tok/s", flush=True)
    if a.peer:
        res["peer"] = run_peer(a.peer, a.model, res)
    report(res, a.json)


def run_peer(binary: str, model_path: str, res: dict) -> dict:
    """llama.cpp's llama-bench on ``model_path`` (a GGUF) in this run, next to ``res`` (batch-1
    decode against tg128 with ninfer's bytes per token, prefill 512 against pp512)."""
    import peer
    got = peer.llama_bench(binary, str(model_path))
    out = {"llama_bench": got}
    b1 = res["decode"].get(1)
    if b1 and got["tg"]:
        out["decode_b1"] = peer.side_by_side(b1["tok_s"], got["tg"]["tok_s"],
                                             b1["bytes_per_token"], res["copy_bw_GBs"] * 1e9)
        print(f"decode batch 1 vs llama.cpp tg{got['tg']['n']}: {out['decode_b1']}", flush=True)
    if 512 in res["prefill"] and got["pp"]:
        out["prefill_512"] = {"ninfer_tok_s": res["prefill"][512],
                              "peer_tok_s": round(got["pp"]["tok_s"], 1),
                              "speedup": round(res["prefill"][512] / got["pp"]["tok_s"], 3)}
        print(f"prefill 512 vs llama.cpp pp{got['pp']['n']}: {out['prefill_512']}", flush=True)
    return out


if __name__ == "__main__":
    main()
