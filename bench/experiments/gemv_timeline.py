"""Where a one-row ``gemv_bulk``'s time goes: %globaltimer stamps inside it, by block.

`prefetch_overlap.py` found that out_proj (27B: K 6,144, N 5,120, int4, + residual) costs 6.4 us
after a 7 or 20 us spin against 9.0 us alone: a hidden launch saves ~2.5 us, the weights'
head start in the ring saves nothing. This compiles linear.cu with stamps (thread 0 of the
consumers, lane 0 of the producer; a ``__device__`` table per module, null = off) at:

  entry      the block began (before its ring's barriers are made)
  produced   the producer issued its last slot (it waits for free slots past the ring's NS)
  waited     the consumers' ``pdl_wait`` returned (the kernel ahead is done)
  staged     the activations are staged (int8 row, after the block barrier)
  loaded     the consumers' first loads of x had come (thread 0's segment max, first shuffle)
  all_waited the last consumer warp's ``pdl_wait`` returned
  all_quant  the last consumer warp finished its staging (before the block barrier)
  round1     with --twice: the last warp's end of the first staging
  first      slot 0 was full
  ring       the ring's last prefilled slot (min(NS, steps) - 1) was full
  done       the block's last group was written

and prints each as min / median / max over the blocks, in us after the earliest entry, for
out_proj alone (after another out_proj), after a one-block spin of --spin-us, and after the
real mixer (the decode's b1 order: in_proj, mixer, out_proj). If "ring" lands at "staged" after a
spin, the weights were there and the rest is the consumers; if it lands ~5 us after "waited",
the producer did not run (or its loads did not) while the spin did. With --no-bytes the
producer marks each slot full without loading it: what is left is the consumers' own time.

With --x-copies each block reads its own copy of x: whether the staging waits on 132
multiprocessors reading the same lines of L2 at once. --twice inline stages the row twice (its
code inlined twice), --twice loop twice by one copy of the code: is the staging slow once (the
loads' first trip, the code's first fetch) or every time.

Usage (GPU machine): PYTHONPATH=$PWD python bench/experiments/gemv_timeline.py [--spin-us 7]
[--no-bytes] [--x-copies] [--twice inline|loop]
"""
from __future__ import annotations

import argparse
import os
import sys

import cupy as cp
import numpy as np

sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..")]
from gpu_ops_profile import graph_seconds  # noqa: E402
from prefetch_overlap import SPIN, gdn_layer  # noqa: E402

import ninfer.kernels.gpu as gpu  # noqa: E402
from ninfer.kernels import get_ops  # noqa: E402
from ninfer.kernels.config import KernelConfig  # noqa: E402
from ninfer.kernels.gpu.launch import launch  # noqa: E402

NAMES = ("entry", "produced", "waited", "staged", "first", "ring", "done", "loaded",
         "all_waited", "all_quant", "round1")
NCOL = len(NAMES)
HEAD = r"""
__device__ long long* g_stamps;  // (blocks, NCOL), null: no stamps
__device__ int g_xstride;        // block b reads x + b g_xstride (its own copy; 0: all one x)
__device__ int g_zero;           // 0, unknown to the compiler (--twice: x loaded again)
__device__ __forceinline__ long long gtime() {
  long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void stamp(int i) {
  const long long t = gtime();
  if (g_stamps) g_stamps[blockIdx.x * NCOL + i] = t;
}
__device__ __forceinline__ void stamp_last(int i) {  // the latest of the warps that call it
  const long long t = gtime();
  if (g_stamps) atomicMax((unsigned long long*)&g_stamps[blockIdx.x * NCOL + i],
                          (unsigned long long)t);
}
""".replace("NCOL", str(NCOL))
# (text in linear.cu, what goes there, where: before / after / replace it, or end (before the
# closing brace of its function); "consume": the first occurrence inside bulk_consume, else the
# first in the file)
CONSUME = "bulk_consume(const float* __restrict__ x"
EDITS = [
    ("  using R = BulkRing<SCH, W, UPW>;\n  extern __shared__ uint4 bulk_smem[];",
     "  if (threadIdx.x == 0) stamp(0);\n", "before"),
    ("        bulk_produce<SCH, W, UPW, NS>(codes, scales, rt.x, (rt.y - rt.x) * spt, spt, KC, ring,\n"
     "                                      full, empty, gs, policy);\n      }\n",
     "      stamp(1);\n", "after"),
    ("      x, ldx, nw, eps, out, N, K, rt.x, rt.y, ring, full, empty, xs, gred, ssq, gs,\n",
     "      x + (size_t)blockIdx.x * g_xstride, ldx, nw, eps, out, N, K, rt.x, rt.y, ring, full,\n"
     "      empty, xs, gred, ssq, gs,\n", "replace"),
    ("  pdl_wait();  // consumers: x (and out with ACC) come from earlier kernels\n",
     "  if (threadIdx.x == 0) stamp(2);\n  if ((threadIdx.x & 31) == 0) stamp_last(8);\n",
     "after"),
    ("  float rs = 1.f;\n", "  if (threadIdx.x == 0) stamp(3);\n", "before consume"),
    # (each warp's staging done, before the block barrier: the first one in bulk_consume)
    ("  bar_sync_1(W * 32);\n", "  if ((threadIdx.x & 31) == 0) stamp_last(9);\n",
     "before consume"),
    ("    mbar_wait(full_a + 8 * slot, par);\n    const int so = slot * R::SLOT;\n",
     "    if (threadIdx.x == 0 && s == 0) stamp(4);\n"
     "    if (threadIdx.x == 0 && s == min(NS, steps) - 1) stamp(5);\n", "after consume"),
    ("  bulk_consume<SCH, PRO, ACC, Q8A, W, UPW, NS, false, SWIGLU, QIN, QOUT, TB",
     "  if (threadIdx.x == 0) stamp(6);\n", "end"),
    # (stage_q8_words; on amax, so that the stamp waits for the first loads of x)
    ("      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));\n",
     "      if (threadIdx.x == 0 && i == 0 && amax >= 0.f) stamp(7);\n", "after"),
]


NO_BYTES = ("    mbar_arrive_expect(full + slot, nch * (CB + SB));\n"
            "    bulk_load(ring + slot * R::SLOT, cp, nch * CB, full + slot, policy);\n"
            "    bulk_load(ring + slot * R::SLOT + CPS * CB, sp, nch * SB, full + slot, policy);\n")


STAGE = "    stage_q8<SCH, PRO, W, 4, CG>(x, ldx, nw, 1, K, KC, xs, KC * 16, meta, ssq);\n"


def stamped_linear(no_bytes: bool = False, twice: str | None = None) -> str:
    """linear.cu with the stamps; ``twice`` ("inline" or "loop"): the row staged twice (the same
    words), by two copies of the code or one run twice: is the staging slow every time, or once?"""
    src = gpu.source("linear")
    if twice == "inline":
        assert src.count(STAGE) == 1
        src = src.replace(STAGE, STAGE + "    if ((threadIdx.x & 31) == 0) stamp_last(10);\n"
                          + STAGE.replace("(x, ldx", "(x + g_zero, ldx"))
    elif twice == "loop":
        assert src.count(STAGE) == 1
        src = src.replace(STAGE, (
            "#pragma unroll 1\n    for (int r = 0; r < 2; ++r) {  // one copy of the code, run twice\n"
            + STAGE.replace("(x, ldx", "(x + r * g_zero, ldx")
            + "    if (r == 0 && (threadIdx.x & 31) == 0) stamp_last(10);\n    }\n"))
    if no_bytes:   # every slot "full" at once, its bytes whatever the ring held: the consumers alone
        assert src.count(NO_BYTES) == 1
        src = src.replace(NO_BYTES, "    mbar_arrive_expect(full + slot, 0);\n")
    for text, add, where in EDITS:
        where, _, scope = where.partition(" ")
        i = src.index(text, src.index(CONSUME) if scope == "consume" else 0)
        if where == "replace":
            src = src[:i] + add + src[i + len(text):]
        elif where == "before":
            src = src[:i] + add + src[i:]
        elif where == "after":
            src = src[:i + len(text)] + add + src[i + len(text):]
        else:   # before the closing brace of the function the text is in
            j = src.index("\n}\n", i) + 1
            src = src[:j] + add + src[j:]
    return HEAD + src


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spin-us", type=float, default=7.0)
    ap.add_argument("--twice", choices=("inline", "loop"),
                    help="stage the row twice, by two copies of the code or one run twice (its "
                    "instructions cached); round1: the last warp's end of the first time")
    ap.add_argument("--x-copies", action="store_true",
                    help="each block reads its own copy of x (no block shares x's lines)")
    ap.add_argument("--no-bytes", action="store_true",
                    help="the producer loads nothing (the consumers' own rate)")
    a = ap.parse_args()
    plain = gpu.source
    text = stamped_linear(a.no_bytes, a.twice)
    gpu.source = lambda name: text if name == "linear" else plain(name)
    ops = get_ops("cupy", KernelConfig())
    L = gdn_layer(ops)
    c, kv, b, slots, gdn, m, eps = L.c, L.kv, L.b, L.slots, L.gdn, L.m, L.eps
    h, p, o, x = L.h, L.p, L.o, L.x
    # x: random rows, one per block (--x-copies: each block reads its own; else all read row 0)
    xs_all = cp.random.default_rng(2).standard_normal((1024, o.shape[1]), dtype=cp.float32)
    o = xs_all[:1]
    out_proj = lambda: ops.fused_linear(o, m.out, residual=x)
    out_proj()
    cp.cuda.runtime.deviceSynchronize()
    # out_proj's module: the only compiled gemv_bulk with a residual and no norm
    mods = [(k[1][0], mod) for k, mod in gpu._MODULES.items()
            if k[0] == "linear" and k[1] and k[1][0].startswith("gemv_bulk<")]
    name, mod = next((n, md) for n, md in mods if n.split(",")[1:3] == ["0", "true"])
    stamps = cp.zeros((1024, NCOL), cp.int64)
    ptr = cp.ndarray((1,), cp.uint64, mod.get_global("g_stamps"))
    cp.ndarray((1,), cp.int32, mod.get_global("g_xstride"))[0] = o.shape[1] if a.x_copies else 0
    spin_mod = cp.RawModule(code=gpu.source("gdn") + SPIN, options=("--std=c++17",))
    sfn = spin_mod.get_function("spin_stamped")
    sst = cp.zeros(4, cp.int64)
    ns = np.int64(a.spin_us * 1e3)
    spin = lambda: launch(sfn, (1,), (32,), (ns, sst))
    mixer = lambda: ops.gdn_mixer(p, m.conv, m.A_log, m.dt_bias, m.norm, kv.conv[0], kv.ssm[0],
                                  b.cu_seqlens_q, slots, c.linear_key_head_dim ** -0.5, eps)
    in_proj = lambda: ops.fused_linear(h, m.in_proj, norm=gdn.input_norm, eps=eps)
    print(f"out_proj: {name}")
    for label, seq, spun in (("after out_proj", lambda: (out_proj(), out_proj()), False),
                             (f"after a {a.spin_us:g} us spin", lambda: (spin(), out_proj()), True),
                             ("after in_proj + mixer", lambda: (in_proj(), mixer(), out_proj()),
                              False)):
        stamps.fill(0)
        ptr[0] = 0
        us = graph_seconds(lambda i: seq(), 10) * 1e6
        ptr[0] = stamps.data.ptr   # stamps of the last replay's last out_proj only
        graph_seconds(lambda i: seq(), 1, replays=1)
        cp.cuda.runtime.deviceSynchronize()
        ptr[0] = 0
        s = cp.asnumpy(stamps).astype(np.float64)
        s = s[s[:, 0] > 0]
        t0 = s[:, 0].min()
        print(f"== {label}: {us:.2f} us a sequence; {len(s)} blocks; us after the first entry"
              + (f" (spin {(sst[0].get() - t0) / 1e3:+.2f} .. {(sst[1].get() - t0) / 1e3:+.2f})"
                 if spun else ""))
        for i, n in enumerate(NAMES):
            col = (s[:, i] - t0) / 1e3
            col = col[s[:, i] > 0]
            if len(col):
                print(f"  {n:9s} min {col.min():7.2f}  median {np.median(col):7.2f}  "
                      f"max {col.max():7.2f}")


if __name__ == "__main__":
    main()
