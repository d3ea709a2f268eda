"""Where a batch-1 decode step goes inside the persistent decode kernel (``gpu.megakernel``).

Usage (on the GPU machine):
    python bench/gpu_megakernel_trace.py MODEL.gguf|.ninfer [--context 64] [--steps 4]

Runs ``--steps`` eager decode steps of one sequence after a ``--context``-token prefill with
``megakernel.TRACE`` set, and for the last step prints, per phase (qkv, attention, o, gate_up,
down; averaged over the layers, in microseconds): the span from the first block's start to the
last block's end, the median and slowest block's own time, the skew of the block starts after
the grid barrier, the barrier (last end to the next phase's first start), the longest wait of a
consumer warp for weight bytes, the producer's wait for a free slot and its time issuing the
copies (median over blocks),
next to the phase's bytes at the copy bandwidth. The megakernel is switched on here whatever
``NINFER_MEGAKERNEL`` says. Time in the GEMV phases that is neither waiting for bytes
nor streaming is the consumers' math, staging and tile reductions.
"""
from __future__ import annotations

import argparse

import cupy as cp
import numpy as np

from ninfer.engine.models.llama import ForwardBatch, LlamaModel
from ninfer.kernels import get_ops
from ninfer.kernels import gpu
from ninfer.kernels.gpu import megakernel as mk
from ninfer.store.artifact import load_model_file
from benchutil import report  # bench/ is on sys.path when run as a script
from gpu_decode import copy_bandwidth

PHASES = ("qkv", "attention", "o", "gate_up", "down")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--ring-slots", type=int, default=None,
                    help="ring depth to try (megakernel.RING_SLOTS: the deepest that fits)")
    ap.add_argument("--variants", default="base",
                    help="comma-separated variants to compare: '+'-joined NVRTC defines and "
                         "a WxUPW shape, e.g. base,16x2,16x4+-DMK_NOMATH (MK_NOMATH: the "
                         "consumers load the weights but skip the multiply; wrong results)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.ring_slots:
        mk.RING_SLOTS = (a.ring_slots,)
    mk.ENABLED = True
    default_shape = (mk.W, mk.UPW)
    ops = get_ops("cupy")
    model = LlamaModel.from_artifact(load_model_file(a.model), ops)
    res = {}
    for variant in a.variants.split(","):
        print(f"variant {variant}", flush=True)
        parts = variant.split("+")
        gpu.DEFINES = tuple(v for v in parts if v.startswith("-D"))
        shape = [v for v in parts if "x" in v]
        mk.W, mk.UPW = (int(x) for x in shape[0].split("x")) if shape else default_shape
        model.ops_cache.clear()
        res[variant] = trace(model, ops, a)
    report({"model": a.model, "variants": res}, a.json)


def trace(model, ops, a) -> dict:
    p = mk.plan(model)
    if p is None:
        raise SystemExit("the megakernel does not apply to this model here")
    bw = copy_bandwidth()
    c = model.config
    n_layers = len(model.layers)
    pages = -(-(a.context + a.steps + 4) // 16)
    kv = model.new_kv_cache(pages, 16)
    table = list(range(pages))
    ids = np.random.default_rng(0).integers(0, c.vocab_size, size=a.context).tolist()
    model.forward(ForwardBatch.from_sequences([ids], [0], [table], 16), kv)
    mk.TRACE = cp.zeros((n_layers, 5, p.grid, 6), dtype=cp.uint64)
    def timed_step(step: int) -> float:
        """One decode step at position context + step; its device time in microseconds."""
        b = ForwardBatch.from_sequences([[1 + step]], [a.context + step], [table], 16)
        t0, t1 = cp.cuda.Event(), cp.cuda.Event()
        t0.record()
        model.forward(b, kv)
        t1.record()
        t1.synchronize()
        return cp.cuda.get_elapsed_time(t0, t1) * 1e3

    for step in range(a.steps):
        mk.TRACE.fill(0)
        step_us = timed_step(step)
    tr = cp.asnumpy(mk.TRACE).astype(np.float64)   # (L, 5, G, 6)
    mk.TRACE = None
    untraced = [timed_step(step) for step in range(a.steps, a.steps + 3)]
    print(f"untraced step {np.median(untraced):.1f} us (events)", flush=True)
    khz = cp.cuda.Device().attributes["ClockRate"]
    cyc_us = khz / 1e3                              # cycles per microsecond
    start, end = tr[..., 0] / 1e3, tr[..., 1] / 1e3   # us
    nbytes = [model.layers[0].qkv.nbytes, 0, model.layers[0].o.nbytes,
              model.layers[0].gate_up.nbytes, model.layers[0].down.nbytes]
    rows = {}
    for ph, name in enumerate(PHASES):
        s, e = start[:, ph], end[:, ph]
        if ph < 4:
            nxt = start[:, ph + 1].min(axis=1)
        else:
            nxt = np.append(start[1:, 0].min(axis=1), np.nan)
        rows[name] = {
            "span_us": float(np.mean(e.max(axis=1) - s.min(axis=1))),
            "block_median_us": float(np.mean(np.median(e - s, axis=1))),
            "block_max_us": float(np.mean((e - s).max(axis=1))),
            "start_skew_us": float(np.mean(s.max(axis=1) - s.min(axis=1))),
            "barrier_us": float(np.nanmean(nxt - e.max(axis=1))),
            "consumer_wait_us": float(np.mean(np.median(tr[:, ph, :, 2], axis=1)) / cyc_us),
            "producer_wait_us": float(np.mean(np.median(tr[:, ph, :, 3], axis=1)) / cyc_us),
            "producer_issue_us": float(np.mean(np.median(tr[:, ph, :, 4], axis=1)) / cyc_us),
            "bytes_at_copy_bw_us": nbytes[ph] / bw * 1e6,
        }
        if name == "attention":  # sub-steps of the slowest block (megakernel.cu mk_attention)
            slow = (e - s).argmax(axis=1)
            sub = tr[np.arange(n_layers), ph, slow] / 1e3
            base = sub[:, 0]
            for f, what in ((2, "roped_us"), (3, "positions_us"), (4, "merged_us")):
                rows[name][what] = float(np.mean(sub[:, f] - base))
        print(f"{name:9s} " + " ".join(f"{k}={v:7.2f}" for k, v in rows[name].items()),
              flush=True)
    layers_us = float(end[-1, 4].max() - start[0, 0].min())
    print(f"step {step_us:.1f} us (events), layers {layers_us:.1f} us in the kernel, "
          f"{layers_us / n_layers:.2f} us per layer; weights per layer at copy bandwidth "
          f"{sum(nbytes) / bw * 1e6:.2f} us ({bw / 1e9:.0f} GB/s)", flush=True)
    return {"step_us": step_us, "untraced_step_us": float(np.median(untraced)),
            "layers_us": layers_us, "phases": rows, "copy_bw_GBs": bw / 1e9,
            "ring_slots": p.ring_slots, "shape": list(p.shape)}


if __name__ == "__main__":
    main()
