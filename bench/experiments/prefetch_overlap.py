"""Does a decode GEMV stream its weights while the latency-bound kernel before it runs?

A b1 step's GDN block at one row costs the sum of its parts (in_proj 17.5 + mixer 7.4 +
out_proj 8.7 us against 33.9 us whole, `gpu_qwen35_profile.py`, H100): out_proj's producer warps
start before its `pdl_wait` and its ring holds its whole share of the weights, so its time after
the mixer should shrink to the tail. This times, from CUDA graphs (20 pairs a graph), out_proj
(27B shape: K 6,144, N 5,120, int4, + residual) after kernels of several footprints against
each alone:

- `spin`: waits for the kernel before (PDL), then spins for --spin-us; one block of 32 threads
  (nothing stands in the GEMV's way), or gdn_step's grid (48 x 4 blocks of 256 threads), with
  few registers or ~100 (gdn_step_h128_c4 has 100);
- the real mixer (`gdn_qk` + `gdn_step`) at splits 4, 2 and 1, and at split 4 with `gdn_step`
  held to 64 registers (two of its blocks and one of the GEMV's then fit a multiprocessor).

"pair - (a + b)" near -min(a, b) means the weights streamed during the first kernel; near 0,
they did not (then the footprint that stops it is the next change's target). First, whether a
PDL launch starts early at all, eagerly and from a graph: a one-block spin and a probe kernel
stamp %globaltimer when each began (the probe before its griddepcontrol.wait).

Usage (GPU machine): PYTHONPATH=$PWD python bench/experiments/prefetch_overlap.py [--spin-us 7]
"""
from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import cupy as cp
import numpy as np

sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..")]
from gpu_ops_profile import graph_seconds  # noqa: E402
from gpu_qwen35_decode import CFG_27B, patch_ops, synth_weights  # noqa: E402

from ninfer.engine.models.llama import ForwardBatch  # noqa: E402
from ninfer.engine.models.qwen35 import Qwen35Config, Qwen35Model  # noqa: E402
from ninfer.kernels import get_ops  # noqa: E402
from ninfer.kernels.config import KernelConfig  # noqa: E402
from ninfer.kernels.gpu import gdn as ggdn  # noqa: E402
from ninfer.kernels.gpu import source  # noqa: E402
from ninfer.kernels.gpu.launch import launch  # noqa: E402

SPIN = r"""
__device__ __forceinline__ long long gtime() {
  long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
// REGS floats live across the spin (never stored: sink holds no 1e30), so the kernel keeps
// about REGS registers a thread, like the mixer it stands in for
template <int REGS>
__device__ __forceinline__ void spin(long long ns, float* sink) {
  pdl_trigger();
  float r[REGS > 0 ? REGS : 1];
#pragma unroll
  for (int i = 0; i < REGS; ++i) r[i] = sink[(threadIdx.x + i * 37) & 1023];
  pdl_wait();
  const long long t0 = gtime();
  while (gtime() - t0 < ns) {
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < REGS; ++i) s += r[i] * r[(i + 1) % REGS];
  if (s == 1e30f) sink[threadIdx.x] = s;
}
extern "C" __global__ void __launch_bounds__(256) spin_light(long long ns, float* sink) {
  spin<0>(ns, sink);
}
// stamps[0, 1]: when the spin began and ended; a probe launched after it (PDL) stamps when it
// began (stamps[2], before its wait) and when its wait returned (stamps[3])
extern "C" __global__ void spin_stamped(long long ns, long long* stamps) {
  pdl_trigger();
  pdl_wait();
  const long long t0 = gtime();
  while (gtime() - t0 < ns) {
  }
  if (threadIdx.x == 0) {
    stamps[0] = t0;
    stamps[1] = gtime();
  }
}
// gdn_step_h128_c4 held to 64 registers (4 blocks of 256 threads a multiprocessor; ~68 bytes
// of spills under nvcc), so that two of its blocks and one of gemv_bulk's fit on one
extern "C" __global__ void __launch_bounds__(256, 4) gdn_step_h128_c4_r64(
    const float* __restrict__ p, int ldp, const float* __restrict__ cw,
    float* __restrict__ cstate, const float* __restrict__ qk, const float* __restrict__ A_log,
    const float* __restrict__ dt_bias, const float* __restrict__ nw, float* __restrict__ state,
    const int* __restrict__ cu, const int* __restrict__ slots, float* __restrict__ o,
    float* __restrict__ records, int L, int Hk, int Hv, int dk, int dv, int Kc, float eps) {
  gdn_step<16, true, 128, 128, 4>(p, ldp, cw, cstate, qk, A_log, dt_bias, nw, state, cu, slots,
                                  o, records, L, Hk, Hv, dk, dv, Kc, eps);
}
extern "C" __global__ void probe_stamped(long long* stamps) {
  const long long t = gtime();
  pdl_wait();
  if (threadIdx.x == 0) {
    stamps[2] = t;
    stamps[3] = gtime();
  }
}
extern "C" __global__ void __launch_bounds__(256) spin_heavy(long long ns, float* sink) {
  spin<88>(ns, sink);
}
"""


def gdn_layer(ops) -> SimpleNamespace:
    """A 4-layer 27B-shape model on ``ops`` (synthetic q4 weights) with 64 tokens prefilled in
    lane 0, and the first GDN layer's one-row operands: c, model, kv, b (the decode batch),
    slots, gdn (the block), m (its mixer), eps, h (its input), p (in_proj's output), o (the
    mixer's, zeros) and x (out_proj's residual)."""
    patch_ops(ops, 32)
    c = Qwen35Config.from_dict(dict(CFG_27B, num_hidden_layers=4))
    model = Qwen35Model(c, synth_weights(c, 32, False), ops)
    kv = model.new_kv_cache(16, 16, max_lanes=1)
    model.forward(ForwardBatch.from_sequences([[1] * 64], [0], [list(range(16))], 16, [0]), kv)
    b = ForwardBatch.from_sequences([[5]], [64], [list(range(16))], 16, [0])
    gdn = model.blocks[0]
    h = cp.random.default_rng(1).standard_normal((1, c.hidden_size), dtype=cp.float32)
    return SimpleNamespace(
        c=c, model=model, kv=kv, b=b, slots=np.asarray(b.state_slots, dtype=np.int64), gdn=gdn,
        m=gdn.mixer, eps=c.rms_norm_eps, h=h,
        p=ops.fused_linear(h, gdn.mixer.in_proj, norm=gdn.input_norm, eps=c.rms_norm_eps),
        o=cp.zeros((1, c.value_dim), cp.float32), x=h.copy())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spin-us", type=float, default=7.0)
    a = ap.parse_args()
    ops = get_ops("cupy", KernelConfig())
    L = gdn_layer(ops)
    c, kv, b, slots, m, eps, p, o, x = L.c, L.kv, L.b, L.slots, L.m, L.eps, L.p, L.o, L.x
    mod = cp.RawModule(code=source("gdn") + SPIN, options=("--std=c++17",))
    sink = cp.zeros(1024, cp.float32)
    ns = np.int64(a.spin_us * 1e3)

    def spin(name, grid):
        fn = mod.get_function(name)
        return lambda: launch(fn, grid, (256,) if grid != (1,) else (32,), (ns, sink))

    def mixer(cs):
        kops = get_ops("cupy", KernelConfig(gdn_col_split=cs))
        patch_ops(kops, 32)
        return lambda: kops.gdn_mixer(p, m.conv, m.A_log, m.dt_bias, m.norm, kv.conv[0],
                                      kv.ssm[0], b.cu_seqlens_q, slots,
                                      c.linear_key_head_dim ** -0.5, eps)

    def mixer_r64():   # the decode mixer with gdn_step_h128_c4_r64 in place of its kernel
        run, r64, orig = mixer(4), mod.get_function("gdn_step_h128_c4_r64"), ggdn._fn

        def call():
            ggdn._fn = lambda n: r64 if n == "gdn_step_h128_c4" else orig(n)
            try:
                run()
            finally:
                ggdn._fn = orig
        return call

    out_proj = lambda: ops.fused_linear(o, m.out, residual=x)
    firsts = {
        "spin, 1 block of 32 threads": spin("spin_light", (1,)),
        "spin, 48 x 4 blocks, light": spin("spin_light", (48, 1, 4)),
        "spin, 48 x 4 blocks, ~100 registers": spin("spin_heavy", (48, 1, 4)),
        "mixer, split 4 (decode's)": mixer(4),
        "mixer, split 4, gdn_step at 64 registers": mixer_r64(),
        "mixer, split 2": mixer(2),
        "mixer, split 1": mixer(1),
    }
    # does a PDL launch start before the kernel ahead of it ends, eagerly and in a graph?
    stamps = cp.zeros(4, cp.int64)
    sfn, pfn = mod.get_function("spin_stamped"), mod.get_function("probe_stamped")
    pair = lambda: (launch(sfn, (1,), (32,), (ns, stamps)), launch(pfn, (1,), (32,), (stamps,)))
    for how in ("eager", "graph"):
        if how == "eager":
            pair()
        else:
            graph_seconds(lambda i: pair(), 1, replays=1)
        cp.cuda.runtime.deviceSynchronize()
        t = cp.asnumpy(stamps).astype(np.float64)
        print(f"PDL {how}: the probe began {(t[2] - t[0]) / 1e3:+.2f} us after the spin began "
              f"(spin {(t[1] - t[0]) / 1e3:.2f} us), its wait returned {(t[3] - t[1]) / 1e3:+.2f} "
              f"us after the spin ended")
    us = lambda fn: graph_seconds(lambda i: fn(), 20) * 1e6
    t_out = us(out_proj)
    print(f"out_proj alone: {t_out:.2f} us")
    print(f"{'first kernel':40s} {'alone':>8s} {'+ out_proj':>11s} {'pair - sum':>11s}")
    for name, first in firsts.items():
        t1 = us(first)
        t2 = us(lambda: (first(), out_proj()))
        print(f"{name:40s} {t1:8.2f} {t2:11.2f} {t2 - t1 - t_out:11.2f}")


if __name__ == "__main__":
    main()
