"""Device time of each non-GEMV op of one Llama-3-8B-shape decode layer at batch 1, replayed
from a CUDA graph as decode runs it (so host launch cost is excluded, the inter-kernel gap of
graph replay included).

Usage (GPU machine): python bench/experiments/gpu_ops_profile.py [--json OUT.json]

Each op is captured ``REPS`` times in one graph over the same inputs (they are L2-resident,
as in decode) and the median of 5 replays is divided by ``REPS``. Attention is captured the
way ``CudaGraphDecoder`` captures it: the split count fixed for a 4,096-position context, the
actual context 100 positions. The per-layer sum times 32 layers estimates what a decode step
spends outside the GEMVs.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import cupy as cp
import numpy as np

from ninfer.bench.report import write_json
from ninfer.kernels import get_ops
from ninfer.kernels.gpu import attention as gattn

REPS = 200
H, NH, NKV, HD, INTER, V = 4096, 32, 8, 128, 14336, 128256


def graph_seconds(step: Callable[[int], None], reps: int, replays: int = 5) -> float:
    """Device seconds per call of ``step(i)``: ``step(0)``, ``step(1)`` run once eagerly (compile,
    caches), then ``step(0) .. step(reps - 1)`` are captured in one CUDA graph on a private
    stream and the median of ``replays`` event-timed replays is divided by ``reps`` (host launch
    cost excluded, the inter-kernel gaps of graph replay included, as in decode)."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for i in range(min(2, reps)):
            step(i)
        stream.synchronize()
        stream.begin_capture()
        for i in range(reps):
            step(i)
        g = stream.end_capture()
        g.launch(stream=stream)
        stream.synchronize()
        ts = []
        for _ in range(replays):
            s, e = cp.cuda.Event(), cp.cuda.Event()
            s.record(stream)
            g.launch(stream=stream)
            e.record(stream)
            e.synchronize()
            ts.append(cp.cuda.get_elapsed_time(s, e) / 1e3)
    return statistics.median(ts) / reps


def graph_time(fn) -> float:
    """Seconds per call of ``fn`` (REPS calls captured in one graph, median of 5 replays)."""
    return graph_seconds(lambda i: fn(), REPS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    ops = get_ops("cupy")
    rng = cp.random.default_rng(0)
    x = rng.standard_normal((1, H), dtype=cp.float32)
    w = rng.standard_normal(H, dtype=cp.float32)
    qkv = rng.standard_normal((1, (NH + 2 * NKV) * HD), dtype=cp.float32)
    pos = np.array([100], dtype=np.int32)
    pages = 256
    kc = cp.zeros((pages, 16, NKV, HD), dtype=cp.float32)
    vc = cp.zeros_like(kc)
    slots = np.array([100], dtype=np.int64)
    q = rng.standard_normal((1, NH, HD), dtype=cp.float32)
    k = rng.standard_normal((1, NKV, HD), dtype=cp.float32)
    v = rng.standard_normal((1, NKV, HD), dtype=cp.float32)
    gu = rng.standard_normal((1, 2 * INTER), dtype=cp.float32)
    logits = rng.standard_normal((1, V), dtype=cp.float32)
    h = rng.standard_normal((1, H), dtype=cp.float32)
    cu = np.array([0, 1], dtype=np.int32)
    bt = np.arange(pages, dtype=np.int32).reshape(1, pages)
    cu_d, lens_d, bt_d = cp.asarray(cu), cp.asarray(np.array([100], np.int32)), cp.asarray(bt)
    cap_lens = np.array([pages * 16], dtype=np.int32)

    def rope():
        qk = qkv[:, :(NH + NKV) * HD].reshape(1, NH + NKV, HD)
        ops.rope(qk, pos, 500000.0, "half")

    cases = {
        "rms_norm": lambda: ops.rms_norm(x, w, 1e-5),
        "rope(q+k)": rope,
        "write_kv": lambda: ops.write_kv(kc, vc, k, v, slots),
        "attention(split-K+merge)": lambda: gattn.paged_attention(
            q, kc, vc, cu, cap_lens, cu_d, lens_d, bt_d, HD ** -0.5),
        "residual add (h += o)": lambda: h.__iadd__(x),
        "silu_mul": lambda: ops.silu_mul(gu[:, :INTER], gu[:, INTER:]),
        "argmax(logits)": lambda: cp.argmax(logits, axis=-1),
    }
    res = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "us": {}}
    for name, fn in cases.items():
        res["us"][name] = round(graph_time(fn) * 1e6, 2)
        print(name, res["us"][name], "us", flush=True)
    per_layer = sum(res["us"][n] for n in ("rms_norm", "rope(q+k)", "write_kv",
                                           "attention(split-K+merge)", "silu_mul")) \
        + res["us"]["rms_norm"] + 2 * res["us"]["residual add (h += o)"]
    res["per_layer_non_gemv_us"] = round(per_layer, 1)
    res["per_token_non_gemv_us_32_layers"] = round(32 * per_layer, 1)
    print(json.dumps(res))
    write_json(res, a.json)


if __name__ == "__main__":
    main()
