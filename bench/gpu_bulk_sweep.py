"""``gemv_bulk`` (batch-1 streaming GEMV, ``gpu/linear.cu``) at the Llama-3-8B shapes: device time
and share of copy bandwidth per ring shape, against the previous GEMVs (``off``), with the
prologue / epilogue each shape has in the model, and optionally without the math (the memory
pipeline alone).

Usage (GPU machine, sm_90+): python bench/gpu_bulk_sweep.py [--shapes off,16x2x5x1,8x4x3x2]
[--acts auto|q8|f16] [--modes model|plain,norm,silu_acc,acc] [--no-math] [--json OUT.json]

A shape is ``WxUPWxNSxBPS``: consumer warps, chunks per warp per slot, ring slots, blocks per
multiprocessor (``gpu.linear.BULK_SHAPE``). ``--modes model`` times each weight as the decode
step runs it (qkv, gate_up, lm_head with the RMSNorm prologue, o with the residual add, down
with SiLU * up and the residual add). ``--no-math`` compiles a copy of ``linear.cu`` whose
consumers skip the multiply (plain mode only), so the difference to the full kernel is the
math's share. Timing as ``gpu_gemv_sweep.py``: random packed Q4_0 weights in copies of >= 1 GiB,
a CUDA graph of launches cycling over them (PDL on), median of 5 replays; the per-token total
adds 32 layers of qkv + o + gate_up + down and the head.
"""
from __future__ import annotations

import argparse

import cupy as cp
import numpy as np

from ninfer.kernels import gpu, mma_layout
from ninfer.kernels.gpu import linear as glin
from ninfer.kernels.gpu.launch import NULL, launch
from benchutil import graph_seconds, report  # bench/ is on sys.path when run as a script
from gpu_decode import copy_bandwidth
from gpu_gemv_sweep import PER_TOKEN, SHAPES, time_variant, weights

MODES = {"plain": {}, "norm": {"norm": True}, "silu_acc": {"gated": True, "accumulate": True},
         "acc": {"accumulate": True}}
IN_MODEL = {"qkv": "norm", "o": "acc", "gate_up": "norm", "down": "silu_acc", "lm_head": "norm"}


def select(spec: str) -> None:
    """Route T = 1 GEMVs to gemv_bulk with this shape, or (``off``) to the previous kernels."""
    glin.BULK = spec != "off"
    if glin.BULK:
        glin.BULK_SHAPE["q8" if glin.bulk_q8() else "f16"] = tuple(
            int(v) for v in spec.split("x"))


def no_math_seconds(ws, x, out, reps: int, n: int, k: int) -> float:
    """Seconds per launch of the current gemv_bulk shape with the multiply compiled out."""
    _, cfg = glin.gemv_kernel(0, 1, k, glin.PRO["plain"], False, True, k, n)
    src = gpu.source("linear")
    patched = src.replace("for (int u = 0; u < UPW; ++u) {", "for (int u = 0; u < 0; ++u) {")
    assert patched != src, "gemv_bulk's consumer loop not found"
    w, upw, ns, _ = glin.BULK_SHAPE["q8" if glin.bulk_q8() else "f16"]
    fname = (f"gemv_bulk<0,0,false,{'true' if glin.bulk_q8() else 'false'},{w},{upw},{ns},"
             f"false,false,false,{cfg.tb}>")
    mod = cp.RawModule(code=patched, options=("--std=c++17",), name_expressions=[fname])
    f = mod.get_function(fname)
    f.max_dynamic_shared_size_bytes = cfg.smem

    def call(i: int) -> None:
        wt = ws[i % len(ws)]
        launch(f, (cfg.grid,), (cfg.threads,), (
            x, np.int32(k), x, np.float32(0), wt.codes, wt.scales, out, np.int32(n),
            np.int32(1), np.int32(n), np.int32(k), NULL, NULL, NULL, np.int32(0)),
            shared_mem=cfg.smem)
    return graph_seconds(call, reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="off,16x2x5x1,16x2x4x1,8x2x6x2")
    ap.add_argument("--acts", default="auto", choices=("auto", "q8", "f16"))
    ap.add_argument("--modes", default="model")
    ap.add_argument("--no-math", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    glin.ACTIVATIONS = a.acts
    bw = copy_bandwidth()
    specs, modes = a.shapes.split(","), a.modes.split(",")
    res = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "acts": a.acts,
           "copy_bw_GBs": round(bw / 1e9, 1), "shapes": {}, "per_token_us": {}}
    print("copy bandwidth GB/s", res["copy_bw_GBs"], flush=True)
    total = {s: 0.0 for s in specs}
    for name, (n, k) in SHAPES.items():
        ws, per = weights(n, k)
        out = cp.empty((1, n), dtype=cp.float32)
        reps = max(20, min(400, (8 << 30) // per // 8))
        rows = res["shapes"][name] = {}
        for mode in modes:
            m = IN_MODEL[name] if mode == "model" else mode
            kw = dict(MODES[m])
            x = cp.random.standard_normal((1, 2 * k if kw.get("gated") else k), dtype=cp.float32)
            if kw.get("norm"):
                kw = dict(kw, norm=cp.ones(k, dtype=cp.float32), eps=1e-5)
            for spec in specs:
                select(spec)
                sec = time_variant(ws, x, out, reps, **kw)
                if mode == modes[0]:
                    total[spec] += PER_TOKEN[name] * sec * 1e6
                row = {"us": round(sec * 1e6, 2), "of_copy_bw": round(per / sec / bw, 3)}
                if a.no_math and m == "plain" and spec != "off":
                    nm = no_math_seconds(ws, x, out, reps, n, k)
                    row["no_math_us"] = round(nm * 1e6, 2)
                    row["no_math_of_copy_bw"] = round(per / nm / bw, 3)
                rows[f"{m}:{spec}"] = row
                print(name, m, spec, row, flush=True)
        del ws
        cp.get_default_memory_pool().free_all_blocks()
    res["per_token_us"] = {s: round(v, 1) for s, v in total.items()}
    res["floor_us"] = round(sum(PER_TOKEN[s] * weights_bytes(*SHAPES[s]) for s in SHAPES)
                            / bw * 1e6, 1)
    print("per-token GEMV us", res["per_token_us"], "floor", res["floor_us"], flush=True)
    select("off")
    report(res, a.json)


def weights_bytes(n: int, k: int) -> int:
    """Packed Q4_0 bytes of an (n, k) weight (codes + fp16 scales), as ``weights`` counts."""
    n16, kc = mma_layout.padded(n, k)
    return n16 * kc * 32 * 16 + n16 * kc * 8 * 8


if __name__ == "__main__":
    main()
