"""Does a decode GEMV's time follow its bytes, or the most row tiles one block holds?

``gemv_bulk`` (one row) and ``gemv_bulk_mt`` (2-8 rows) give each of their persistent blocks
(one a multiprocessor) whole 16-row tiles: the 27B's N = 5,120 projections (GDN out_proj,
attention o, the MLP's down) have 320 tiles, so on 132 multiprocessors 56 blocks take 3 and 76
take 2 (2.42 on average). If the GEMV lasts as long as its fullest block, those run at ~81 % of
what their bytes allow (the MLP as a whole, with gate_up's 1,088 units at 8.24 a block against 9,
at ~88 %: what the b1 step shows). This times the 27B's shapes against shapes whose tiles divide
evenly, at the same K, so that the answer is a measurement.

Usage (GPU machine): PYTHONPATH=$PWD python bench/experiments/gemv_balance.py [--rows 1 4]
    [--shapes 16,2,8,1 16,2,5,2]

``--shapes``: ``KernelConfig.bulk_shape["q8"]`` values to run each with (consumer warps, chunks a
warp a slot, ring slots, blocks a multiprocessor; the first is the default): two blocks a
multiprocessor split 320 tiles as 1-2 a block, and show whether a multiprocessor with two
blocks streams twice as fast.

Per (N, K, rows): device us a call (20 in one CUDA graph, ``gpu_ops_profile.graph_seconds``),
the weight's GB/s, the most tiles a block holds against the mean, and us per tile of the fullest
block. Equal us per fullest-block tile across N at one K means the split sets the time.
"""
from __future__ import annotations

import argparse
import os
import sys

import cupy as cp

sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..")]
from gpu_ops_profile import graph_seconds  # noqa: E402
from gpu_qwen35_decode import device_q4  # noqa: E402

from ninfer.kernels import get_ops  # noqa: E402
from ninfer.kernels.config import KernelConfig  # noqa: E402
from ninfer.kernels.gpu import linear as glin  # noqa: E402
from ninfer.kernels.gpu import sm_count  # noqa: E402

REPS = 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--shapes", nargs="+", default=["16,2,8,1", "16,2,5,2", "16,2,4,2"])
    a = ap.parse_args()
    sms = sm_count()
    rng = cp.random.RandomState(7)
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {sms} multiprocessors")
    for shape in a.shapes:
        q8 = tuple(int(v) for v in shape.split(","))
        print(f"== bulk_shape q8 {q8}", flush=True)
        run(get_ops("cupy", KernelConfig(bulk_shape={**KernelConfig().bulk_shape, "q8": q8})),
            sms, rng, a.rows)


def run(ops, sms: int, rng, rows) -> None:
    # (K, the 27B's N at that K, then N of exactly 2 and 3 tiles a block)
    for k, n27 in ((6144, 5120), (17408, 5120), (5120, 16480)):
        for n in sorted({n27, 2 * 16 * sms, 3 * 16 * sms}):
            w = device_q4((n, k), 32, rng)
            tiles = -(-n // 16)
            for t in rows:
                _, cfg = glin.gemv_kernel(ops.config, w.sch, t, k, glin.PRO["plain"], True,
                                          True, k, n, prestaged=glin.prestages(ops.config, t, k))
                grid = cfg.grid or sms
                most, mean = -(-tiles // grid), tiles / grid
                x = cp.random.default_rng(1).standard_normal((t, k), dtype=cp.float32)
                res = cp.zeros((t, n), cp.float32)
                us = graph_seconds(lambda i: ops.fused_linear(x, w, residual=res), REPS) * 1e6
                gbs = w.nbytes / us / 1e3
                tag = " (27B)" if n == n27 else ""
                print(f"K {k:6d} N {n:6d}{tag:6s} rows {t}: {us:7.2f} us, {gbs:7.1f} GB/s, "
                      f"{grid} blocks, tiles a block {most} (mean {mean:.2f}), {us / most:6.2f} "
                      f"us a tile of the fullest block", flush=True)


if __name__ == "__main__":
    main()
