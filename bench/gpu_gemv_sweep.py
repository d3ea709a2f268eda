"""Quantized GEMV (``gemv_q8a`` with int8 activations, ``gemv_mma`` with fp16 ones; not
``gemv_bulk``, see ``gpu_bulk_sweep.py``) at the
Llama-3-8B shapes: device time and bandwidth of every (row tiles per block RT, chunks in flight
U, warps W) variant, for T token rows.

Usage (GPU machine): python bench/gpu_gemv_sweep.py [--json OUT.json] [--t 1,8,32]
[--acts q8,f16]

Weights are random Q4_0 (group 32, no mins), made on the device directly in the packed
tensor-core layout, in enough copies to exceed the L2 cache several times (>= 1 GiB per shape);
``reps`` GEMVs cycling over the copies are captured in one CUDA graph and the median of 5
replays is divided by ``reps``, so host launch cost is excluded and the inter-kernel gap of
graph replay included (as in decode). Bandwidth = packed bytes (codes + fp16 scales) / time;
the per-token estimate adds 32 layers of qkv + o + gate_up + down and the head. Copy bandwidth
(2 GiB device-to-device, read + write) is measured in the same run.
"""
from __future__ import annotations

import argparse
import json

import cupy as cp

from ninfer.kernels import mma_layout
from ninfer.kernels.gpu import linear as glin
from gpu_decode import copy_bandwidth  # bench/ is on sys.path when run as a script
from benchutil import graph_seconds  # bench/ is on sys.path when run as a script

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
PER_TOKEN = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}
# (row tiles per block RT, chunks in flight U, warps per block W; 0 = by K)
Q8A_VARIANTS = [(1, 4, 0), (1, 2, 0), (1, 8, 0), (2, 2, 0), (2, 4, 0), (1, 4, 4), (1, 4, 8),
                (1, 4, 16), (2, 4, 8)]
VARIANTS = {1: [(1, 4, 0), (1, 2, 0), (1, 4, 4), (1, 4, 8), (1, 4, 16), (1, 2, 16), (2, 2, 0)],
            2: [(1, 2, 0), (2, 2, 0), (1, 4, 0)], 4: [(1, 2, 0), (1, 1, 0), (2, 2, 0)]}
MODES = {"norm": dict(norm=True), "silu_acc": dict(gated=True, accumulate=True),
         "acc": dict(accumulate=True)}


def weights(n: int, k: int, min_total: int = 1 << 30):
    """Copies of one random packed Q4_0 (n, k) weight, at least ``min_total`` bytes together."""
    n16, kc = mma_layout.padded(n, k)
    per = n16 * kc * 32 * 16 + n16 * kc * 8 * 8
    copies = max(2, -(-min_total // per))
    codes = cp.random.randint(0, 2 ** 31, size=(copies, n16, kc, 32, 4), dtype=cp.int64)
    codes = codes.astype(cp.uint32)
    half = int(cp.asarray([0.01], dtype=cp.float16).view(cp.uint16)[0])
    scales = cp.full((copies, n16, kc, 8, 2), half | (half << 16), dtype=cp.uint32)
    return [glin.GpuWeight("q4", (n, k), 32, codes[i], scales[i]) for i in range(copies)], per


def time_variant(ws, x, out, reps: int, **kw) -> float:
    """Seconds per GEMV (graph of ``reps`` launches over the copies, median of 5 replays)."""
    return graph_seconds(lambda i: glin.gemv(x, ws[i % len(ws)], out, **kw), reps)


def _variants(acts: str, t: int):
    """(default shape, all shapes, a function that selects a shape) for these activations."""
    if acts == "q8" and t <= glin.Q8A_MAX_T:
        key = t == 1

        def select(v):
            glin.Q8A_SHAPE[key], glin.WARPS = v[:2], (v[2] or None)
        default = glin.Q8A_SHAPE[key] + (0,)
        return default, sorted(set([default] + Q8A_VARIANTS)), select
    nt = 1 if t <= 8 else 2 if t <= 16 else 4

    def select(v):
        glin.MMA_SHAPE[nt], glin.WARPS = v[:2], (v[2] or None)
        glin.MMA_SHAPE_T3_8 = None   # MMA_SHAPE[nt] for every T
    default = (glin.MMA_SHAPE_T3_8 if nt == 1 and t > 2 and glin.MMA_SHAPE_T3_8
               else glin.MMA_SHAPE[nt]) + (0,)
    return default, sorted(set([default] + VARIANTS[nt])), select


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--t", default="1")
    ap.add_argument("--acts", default="q8,f16")
    ap.add_argument("--stages", default=str(glin.GEMV_STAGES),
                    help="gemv_mma weight-ring steps to try (f16), e.g. 4,0 (0: registers)")
    a = ap.parse_args()
    glin.BULK = False   # T = 1 would go to gemv_bulk: bench/gpu_bulk_sweep.py times that one
    bw = copy_bandwidth()
    res = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
           "copy_bw_GBs": round(bw / 1e9, 1), "by_t": {}}
    print("copy bandwidth GB/s", res["copy_bw_GBs"], flush=True)
    saved = (glin.ACTIVATIONS, dict(glin.Q8A_SHAPE), dict(glin.MMA_SHAPE),
             glin.MMA_SHAPE_T3_8, glin.WARPS, glin.GEMV_STAGES)

    def restore():
        (glin.ACTIVATIONS, q8s, mmas, glin.MMA_SHAPE_T3_8, glin.WARPS,
         glin.GEMV_STAGES) = saved
        glin.Q8A_SHAPE.update(q8s)
        glin.MMA_SHAPE.update(mmas)
    runs = [(acts, int(st)) for acts in a.acts.split(",")
            for st in (a.stages.split(",") if acts == "f16" else [glin.GEMV_STAGES])]
    for acts, ring in runs:
        for t in [int(v) for v in a.t.split(",")]:
            restore()
            glin.ACTIVATIONS, glin.GEMV_STAGES = acts, ring
            default, variants, select = _variants(acts, t)
            shapes, ref_out = {}, {}
            for name, (n, k) in SHAPES.items():
                ws, per = weights(n, k)
                x = cp.random.standard_normal((t, k), dtype=cp.float32)
                out = cp.empty((t, n), dtype=cp.float32)
                row = {}
                reps = max(20, min(400, (8 << 30) // per // 8))
                for v in variants:
                    select(v)
                    sec = time_variant(ws, x, out, reps)
                    glin.gemv(x, ws[0], out)
                    if v == default:
                        ref_out[name] = out.copy()
                    err = float(cp.abs(out - ref_out[name]).max() / cp.abs(ref_out[name]).max()) \
                        if name in ref_out else None
                    fn, cfg = glin.gemv_kernel(0, t, k, 0, False, True, k, n)
                    row["x".join(map(str, v))] = {
                        "us": round(sec * 1e6, 2), "regs": fn.num_regs, "warps": cfg.w,
                        "GBs": round(per / sec / 1e9, 1), "of_copy_bw": round(per / sec / bw, 3),
                        "rel_diff_vs_default": err}
                    print(acts, ring, t, name, v, row["x".join(map(str, v))], flush=True)
                restore()
                glin.ACTIVATIONS, glin.GEMV_STAGES = acts, ring
                modes = {}
                for mname, kw in MODES.items():
                    xm = cp.random.standard_normal((t, 2 * k if kw.get("gated") else k),
                                                   dtype=cp.float32)
                    if kw.get("norm"):
                        kw = dict(kw, norm=cp.ones(k, dtype=cp.float32), eps=1e-5)
                    sec = time_variant(ws, xm, out, reps, **kw)
                    modes[mname] = {"us": round(sec * 1e6, 2),
                                    "of_copy_bw": round(per / sec / bw, 3)}
                print(acts, ring, t, name, "fused modes (default shape)", modes, flush=True)
                shapes[name] = {"bytes": per, "variants": row, "modes": modes}
                del ws
                cp.get_default_memory_pool().free_all_blocks()
            tot = {}
            for v in variants:
                key = "x".join(map(str, v))
                tot[key] = round(sum(PER_TOKEN[s] * shapes[s]["variants"][key]["us"]
                                     for s in SHAPES), 1)
            best = sum(PER_TOKEN[s] * min(r["us"] for r in shapes[s]["variants"].values())
                       for s in SHAPES)
            nbytes = sum(PER_TOKEN[s] * shapes[s]["bytes"] for s in SHAPES)
            res["by_t"][f"{acts}:ring{ring}:{t}"] = {"shapes": shapes, "per_token_us": tot,
                                          "per_token_us_best_per_shape": round(best, 1),
                                          "per_token_bytes": nbytes,
                                          "floor_us": round(nbytes / bw * 1e6, 1)}
            print(acts, "ring", ring, "T", t, "per-token GEMV us by variant", tot, "best/shape",
                  round(best, 1), "floor", round(nbytes / bw * 1e6, 1), flush=True)
    restore()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
