"""Where the decode GDN mixer's ~10 us a layer go (27B shape: Hk 16, Hv 48, dk = dv = 128, conv
4): ``gdn_qk`` + ``gdn_step`` replayed from CUDA graphs (``graph_seconds``, 20 a graph) beside
variants that each leave one thing out: the state traffic (slots -1), one of the two kernels,
PDL; and floors: an empty PDL kernel a launch, and a kernel that only reads and writes the
lane's recurrent state as ``gdn_step`` does.

Usage (GPU machine): PYTHONPATH=$PWD python bench/experiments/gdn_step_micro.py [--seqs 1 8]
"""
from __future__ import annotations

import argparse
import os
import sys

import cupy as cp
import numpy as np

sys.path[:0] = [os.path.dirname(__file__)]
from gpu_ops_profile import graph_seconds  # noqa: E402

from ninfer.kernels.gpu import gdn, source  # noqa: E402
from ninfer.kernels.gpu.launch import launch  # noqa: E402

HK, HV, DK, DV, KC = 16, 48, 128, 128, 4
FLOORS = r"""
extern "C" __global__ void empty_pdl() { pdl_trigger(); pdl_wait(); }
// the lane's state columns read before pdl_wait and written after, as gdn_step's (RPT rows)
extern "C" __global__ void __launch_bounds__(512) touch_state(float* state, const int* slots,
                                                              int Hv, int dk, int dv) {
  pdl_trigger();
  const int h = blockIdx.x, s = blockIdx.y, cs = gridDim.z, cols = dv / cs, R = 2 * cs;
  const int jl = threadIdx.x % cols, part = threadIdx.x / cols, rows = dk / R;
  const int j = blockIdx.z * cols + jl, slot = slots[s];
  float* st = state + ((size_t)slot * Hv + h) * dk * dv + (size_t)part * rows * dv + j;
  float col[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) col[i] = i < rows ? st[(size_t)i * dv] : 0.f;
  pdl_wait();
#pragma unroll
  for (int i = 0; i < 16; ++i) if (i < rows) st[(size_t)i * dv] = col[i] * 0.999f;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 8])
    a = ap.parse_args()
    mod = cp.RawModule(code=source("gdn") + FLOORS, options=("--std=c++17",))
    empty, touch = mod.get_function("empty_pdl"), mod.get_function("touch_state")
    rng = np.random.default_rng(0)
    c = 2 * HK * DK + HV * DV
    width = c + HV * DV + 2 * HV
    for s in a.seqs:
        p = cp.asarray(rng.standard_normal((s, width), dtype=np.float32))
        cw = cp.asarray(rng.standard_normal((c, KC), dtype=np.float32) * 0.5)
        conv = cp.asarray(rng.standard_normal((s + 1, KC - 1, c), dtype=np.float32))
        state = cp.asarray(rng.standard_normal((s + 1, HV, DK, DV), dtype=np.float32) * 0.1)
        alog = cp.asarray(rng.standard_normal(HV, dtype=np.float32))
        dtb = cp.asarray(rng.standard_normal(HV, dtype=np.float32))
        nw = cp.asarray(rng.standard_normal(DV, dtype=np.float32))
        cu = cp.arange(s + 1, dtype=cp.int32)
        slots = cp.arange(1, s + 1, dtype=cp.int32)
        none = cp.full(s, -1, dtype=cp.int32)

        def pair(sl=slots, cs=4, pdl=True):
            return lambda i: gdn.gdn_step(p, cw, conv, alog, dtb, nw, state, cu, sl, s,
                                          DK ** -0.5, 1e-6, pdl=pdl, col_split=cs)

        def floor_empty(grid, block, cluster):
            return lambda i: launch(empty, grid, block, (), cluster=cluster)

        rows = {
            "gdn_qk + gdn_step (col_split 4, as decode)": pair(),
            "  col_split 1": pair(cs=1), "  col_split 2": pair(cs=2),
            "  col_split 8": pair(cs=8),
            "  no state (slots -1)": pair(sl=none),
            "  without PDL": pair(pdl=False),
            "empty PDL kernel, grid (16, S)": floor_empty((HK, s), (256,), 0),
            "empty PDL kernel, grid (48, S, 4), cluster 4": floor_empty((HV, s, 4), (256,), 4),
            "two empty PDL kernels (as the pair's grids)": lambda i: (
                floor_empty((HK, s), (256,), 0)(i), floor_empty((HV, s, 4), (256,), 4)(i)),
            "state read + write only (grid (48, S, 4))": lambda i: launch(
                touch, (HV, s, 4), (256,), (state, slots, np.int32(HV), np.int32(DK),
                                            np.int32(DV))),
        }
        print(f"\n## {s} lane(s): device time a call (graph of 20), us")
        for name, fn in rows.items():
            us = graph_seconds(fn, 20) * 1e6
            print(f"{name:48s} {us:8.2f}")
        # gdn_step alone: gdn_qk's launch dropped from the captured calls (qk from the warm-up)
        orig = gdn.launch
        skip = lambda fn, *args, **kw: None if fn is gdn._fn("gdn_qk") else orig(fn, *args, **kw)
        only = lambda fn, *args, **kw: orig(fn, *args, **kw) if fn is gdn._fn("gdn_qk") else None
        for name, patched in (("gdn_step alone", skip), ("gdn_qk alone", only)):
            gdn.launch = patched
            try:
                us = graph_seconds(pair(), 20) * 1e6
            finally:
                gdn.launch = orig
            print(f"{name:48s} {us:8.2f}")
        mb = 2 * s * HV * DK * DV * 4 / 1e6
        print(f"(state traffic {mb:.1f} MB a call: {mb / 3.0e6 * 1e6:.2f} us at 3.0 TB/s)")


if __name__ == "__main__":
    main()
