"""Batch-1 q4 GEMV at the Llama-3-8B shapes: device time and bandwidth of every compiled
(rows per block R, steps in flight U, prefetch P) variant (``gpu.linear.Q4_VARIANTS``).

Usage (GPU machine): python bench/gpu_gemv_sweep.py [--json OUT.json] [--t 1]

Weights are random Q4_0 (group 32, no mins) made on the device, in enough copies to exceed
the L2 cache several times (>= 1 GiB per shape); ``reps`` GEMVs cycling over the copies are
captured in one CUDA graph and the median of 5 replays is divided by ``reps``, so host launch
cost is excluded and the inter-kernel gap of graph replay included (as in decode). Bandwidth =
packed bytes (codes + fp16 scales) / time; the per-token estimate adds 32 layers of
qkv + o + gate_up + down and the head. Copy bandwidth (2 GiB device-to-device, read + write) is
measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import statistics

import cupy as cp

from ninfer.kernels.gpu import linear as glin
from gpu_decode import copy_bandwidth  # bench/ is on sys.path when run as a script

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
PER_TOKEN = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}


def weights(n: int, k: int, min_total: int = 1 << 30):
    """Copies of one random Q4_0 (n, k) weight, at least ``min_total`` bytes together."""
    per = n * k // 2 + n * (k // 32) * 2
    copies = max(2, -(-min_total // per))
    codes = cp.random.randint(0, 256, size=(copies * n, k // 2), dtype=cp.uint8)
    scales = cp.full((copies * n, k // 32), 0.01, dtype=cp.float16)
    return [glin.GpuWeight("q4", (n, k), 32, codes[i * n:(i + 1) * n],
                           scales[i * n:(i + 1) * n]) for i in range(copies)], per


def time_variant(ws, x, out, reps: int) -> float:
    """Seconds per GEMV (graph of ``reps`` launches over the copies, median of 5 replays)."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for w in ws[:2]:
            glin.gemv(x, w, out)  # compile / load outside the capture
        stream.synchronize()
        stream.begin_capture()
        for i in range(reps):
            glin.gemv(x, ws[i % len(ws)], out)
        g = stream.end_capture()
        g.launch(stream=stream)
        stream.synchronize()
        ts = []
        for _ in range(5):
            s, e = cp.cuda.Event(), cp.cuda.Event()
            s.record(stream)
            g.launch(stream=stream)
            e.record(stream)
            e.synchronize()
            ts.append(cp.cuda.get_elapsed_time(s, e) / 1e3)
    return statistics.median(ts) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--t", type=int, default=1)
    a = ap.parse_args()
    t = a.t
    bw = copy_bandwidth()
    res = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
           "copy_bw_GBs": round(bw / 1e9, 1), "t": t, "shapes": {}}
    print("copy bandwidth GB/s", res["copy_bw_GBs"], flush=True)
    default = glin.Q4_SHAPE[t]
    variants = sorted(set([default] + glin.Q4_VARIANTS.get(t, [])))
    ref_out = {}
    for name, (n, k) in SHAPES.items():
        ws, per = weights(n, k)
        x = cp.random.standard_normal((t, k), dtype=cp.float32)
        out = cp.empty((t, n), dtype=cp.float32)
        row = {}
        for v in variants:
            glin.Q4_SHAPE[t] = v
            sec = time_variant(ws, x, out, reps=max(20, min(400, (8 << 30) // per // 8)))
            glin.gemv(x, ws[0], out)
            if v == default:
                ref_out[name] = out.copy()
            err = float(cp.abs(out - ref_out[name]).max() / cp.abs(ref_out[name]).max()) \
                if name in ref_out else None
            row["x".join(map(str, v))] = {"us": round(sec * 1e6, 2),
                                           "regs": glin._fn(glin._q4_name(t, v, False)).num_regs,
                                     "GBs": round(per / sec / 1e9, 1),
                                     "of_copy_bw": round(per / sec / bw, 3),
                                     "rel_diff_vs_default": err}
            print(name, v, row["x".join(map(str, v))], flush=True)
        glin.Q4_SHAPE[t] = default
        res["shapes"][name] = {"bytes": per, "variants": row}
        del ws
        cp.get_default_memory_pool().free_all_blocks()
    # per-token GEMV time with one variant everywhere, and with the best per shape
    tot, best = {}, 0.0
    for v in variants:
        key = "x".join(map(str, v))
        tot[key] = round(sum(PER_TOKEN[s] * res["shapes"][s]["variants"][key]["us"]
                             for s in SHAPES), 1)
    for s in SHAPES:
        best += PER_TOKEN[s] * min(r["us"] for r in res["shapes"][s]["variants"].values())
    nbytes = sum(PER_TOKEN[s] * res["shapes"][s]["bytes"] for s in SHAPES)
    res["per_token_us"] = tot
    res["per_token_us_best_per_shape"] = round(best, 1)
    res["per_token_bytes"] = nbytes
    res["floor_us"] = round(nbytes / bw * 1e6, 1)
    print(json.dumps(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
