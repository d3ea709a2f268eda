"""Where a decode step's device time goes: the step replayed from a CUDA graph (as ``ninfer
serve`` runs it), then again with one op family knocked out at a time (replaced by a no-op that
returns an array of the right shape), so the difference is that family's share of the step,
inter-kernel gaps included.

Usage (GPU machine): python bench/gpu_step_profile.py MODEL.gguf [--batch 1] [--context 100]
    [--json OUT.json]

Timing: ``CudaGraphDecoder`` captured for one batch bucket; 30 replays after 5 warm-ups, each
synchronised; median host wall time per step (the host adds ~30-60 us of fill and launch).
Knocked-out passes compute garbage: only their time is meaningful.
"""
from __future__ import annotations

import argparse
import statistics
import time

import cupy as cp
import numpy as np

from ninfer.engine.models.llama import ForwardBatch, LlamaModel
from ninfer.kernels import get_ops
from ninfer.kernels.gpu import linear as glin
from ninfer.kernels.gpu.graphs import CudaGraphDecoder
from ninfer.store.artifact import load_model_file
from benchutil import report  # bench/ is on sys.path when run as a script


def step_time(model, kv, batch: int, context: int, max_pages: int) -> float:
    dec = CudaGraphDecoder(model, max_pages=max_pages, buckets=(batch,))
    dec.capture_all(kv)
    tables = [list(range(i * max_pages, (i + 1) * max_pages)) for i in range(batch)]
    ts = []
    for i in range(35):
        b = ForwardBatch.from_sequences([[7]] * batch, [context] * batch, tables, 16)
        t0 = time.perf_counter()
        dec.forward(b, kv)
        cp.cuda.get_current_stream().synchronize()
        if i >= 5:
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--json", default=None)
    ap.add_argument("--gemv-activations", choices=("auto", "q8", "f16"), default="auto",
                    help="decode GEMV activations (gpu.linear.ACTIVATIONS)")
    a = ap.parse_args()
    glin.ACTIVATIONS = a.gemv_activations
    from ninfer.kernels import cupy_ops
    # the three attention kernels, so that each knockout below removes its own
    cupy_ops.FUSED_DECODE_ATTENTION = "off"
    ops = get_ops("cupy")
    model = LlamaModel.from_artifact(load_model_file(a.model), ops)
    max_pages = 256  # 4,096 positions per sequence (the split count of the captured attention)
    kv = model.new_kv_cache(a.batch * max_pages, 16)
    c = model.config
    res = {"model": a.model, "batch": a.batch, "context": a.context, "steps_ms": {}}
    base = step_time(model, kv, a.batch, a.context, max_pages)
    res["steps_ms"]["full"] = round(base * 1e3, 3)
    print("full step ms", res["steps_ms"]["full"], flush=True)

    def attn(q, *args, **kw):
        return q
    knockouts = {
        "gemv": (glin, "gemv", lambda *args, **kw: None),
        "attention": (ops, "paged_attention", attn),
        "rope_write_kv": (ops, "rope_write_kv", lambda qkv, nq, nk, *args, **kw:
                          qkv[:, :nq * c.head_dim].reshape(len(qkv), nq, c.head_dim)),
        "embedding": (ops, "embedding", lambda w, ids: cp.zeros((len(ids), c.hidden_size),
                                                                cp.float32)),
    }
    for name, (obj, attr, fake) in knockouts.items():
        orig = getattr(obj, attr)
        setattr(obj, attr, fake)
        try:
            t = step_time(model, kv, a.batch, a.context, max_pages)
        finally:
            setattr(obj, attr, orig)
        res["steps_ms"][f"without_{name}"] = round(t * 1e3, 3)
        res.setdefault("share_ms", {})[name] = round((base - t) * 1e3, 3)
        print(f"without {name}: {t * 1e3:.3f} ms (share {1e3 * (base - t):.3f} ms)", flush=True)
    report(res, a.json)


if __name__ == "__main__":
    np.random.seed(0)
    main()
