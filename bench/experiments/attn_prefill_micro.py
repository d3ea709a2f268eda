"""The prefill attention alone at the 27B's shape (head dim 256, 24 query / 4 KV heads, an fp16
paged cache): T new tokens over D cached ones, for each ``attn_prefill_mma`` tiling given, device
time by CUDA events (median of 5 launches), TFLOP/s of the causal work, and each output's
largest difference from the first tiling's (a tiling that changes the result is wrong: they
compute the same sums in the same order per row).

A tiling of "wgmma" times ``prefill_attention="wgmma"`` (``attn_prefill_wgmma``) instead.

Usage (GPU machine): python bench/experiments/attn_prefill_micro.py [--tokens 2048]
    [--depth 30720] [--tilings 64,false,1,8 32,false,2,4 wgmma ...] [--json OUT]
"""
from __future__ import annotations

import argparse
import statistics

import cupy as cp
import numpy as np

from ninfer.bench.report import write_json
from ninfer.kernels.config import KernelConfig
from ninfer.kernels.cupy_ops import CupyOps

NH, NKV, HD, PAGE = 24, 4, 256, 16


def tiling(text: str) -> tuple:
    bc, qreg, minb, nw = text.split(",")
    return int(bc), qreg == "true", int(minb), int(nw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=30720)
    ap.add_argument("--tilings", nargs="+", default=["64,false,1,8", "32,false,2,4"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    t, n = a.tokens, a.tokens + a.depth
    pages = -(-n // PAGE)
    rng = cp.random.default_rng(0)
    k = rng.standard_normal((pages, PAGE, NKV, HD), dtype=cp.float32).astype(cp.float16)
    v = rng.standard_normal((pages, PAGE, NKV, HD), dtype=cp.float32).astype(cp.float16)
    q = rng.standard_normal((t, NH, HD), dtype=cp.float32)
    cu, lens = np.array([0, t], np.int32), np.array([n], np.int32)
    bt = np.arange(pages, dtype=np.int32)[None]
    # causal: row i sees depth + i + 1 positions; QK^T and PV, 2 flops a multiply-add
    flops = 4.0 * NH * HD * (t * a.depth + t * (t + 1) / 2)
    res, first = {"tokens": t, "depth": a.depth, "rows": {}}, None
    for text in a.tilings:
        ops = CupyOps(KernelConfig(prefill_attention="wgmma") if text == "wgmma" else
                      KernelConfig(prefill_attention="mma",
                                   prefill_mma_tiling={**KernelConfig().prefill_mma_tiling,
                                                       HD: tiling(text)}))
        out = ops.paged_attention(q, k, v, cu, lens, bt, HD ** -0.5, "fp16")
        cp.cuda.Device().synchronize()
        times = []
        for _ in range(5):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            ops.paged_attention(q, k, v, cu, lens, bt, HD ** -0.5, "fp16")
            e1.record()
            e1.synchronize()
            times.append(cp.cuda.get_elapsed_time(e0, e1))
        ms = statistics.median(times)
        diff = 0.0 if first is None else float(cp.abs(out - first).max())
        first = out if first is None else first
        res["rows"][text] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1),
                             "max_diff": diff, "finite": bool(cp.isfinite(out).all())}
        print(f"T={t} depth={a.depth} tiling {text}: {ms:.3f} ms, {flops / ms / 1e9:.1f} "
              f"TFLOP/s, max |diff| {diff:.2e}", flush=True)
    write_json(res, a.json)


if __name__ == "__main__":
    main()
