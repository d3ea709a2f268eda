"""One verify pass's attention (k + 1 rows of one sequence at depth) with and without
``verify_shared_kv``: device time by CUDA events, and the kernels each launches."""
from __future__ import annotations

import sys

import cupy as cp
import numpy as np

from ninfer.kernels.config import KernelConfig
from ninfer.kernels.cupy_ops import CupyOps
from ninfer.kernels.gpu import launch as glaunch


def main() -> None:
    ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    rows, nh, nkv, hd, ps = 4, 24, 4, 256, 16
    pages = ctx // ps
    rng = cp.random.default_rng(0)
    k = rng.standard_normal((pages, ps, nkv, hd), dtype=cp.float32)
    v = rng.standard_normal((pages, ps, nkv, hd), dtype=cp.float32)
    q = rng.standard_normal((rows, nh, hd), dtype=cp.float32)
    cu, lens = np.array([0, rows], np.int32), np.array([ctx], np.int32)
    bt = np.arange(pages, dtype=np.int32)[None]
    names = []
    real = glaunch.launch

    def spy(fn, *a, **kw):
        names.append(getattr(fn, "name", None) or getattr(getattr(fn, "kernel", fn), "name", "?"))
        return real(fn, *a, **kw)
    glaunch.launch = spy
    import ninfer.kernels.gpu.attention as ga
    ga.launch = spy
    outs = {}
    for vsk in (True, False):
        ops = CupyOps(KernelConfig(verify_shared_kv=vsk))
        names.clear()
        out = ops.paged_attention(q, k, v, cu, lens, bt, hd ** -0.5)
        cp.cuda.Device().synchronize()
        outs[vsk] = out
        launched = list(names)
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        for _ in range(20):
            ops.paged_attention(q, k, v, cu, lens, bt, hd ** -0.5)
        e1.record()
        e1.synchronize()
        us = cp.cuda.get_elapsed_time(e0, e1) / 20 * 1e3
        print(f"verify_shared_kv={vsk} ctx={ctx}: {us:.1f} us a pass; launches {launched}")
    print("max |diff|", float(cp.abs(outs[True] - outs[False]).max()))


if __name__ == "__main__":
    main()
