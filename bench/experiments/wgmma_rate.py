"""The tensor cores' rate on chains of wgmma as the prefill attention issues them: each warpgroup
(64 rows) runs 16 m64nNk16 fp16 MMAs into one accumulator (a K of 256, S = Q K^T at head dim
256), commits and waits, ITERS times, 1 block an SM. Variants: N, A / B from shared memory by
descriptors (SS) or A from registers (RS), the no-swizzle canonical layout against the 128-byte
swizzle (FA3's, TMA's, attn_prefill_wgmma's), and 1-2 warpgroups a block. Prints the cycles a
wgmma and the TFLOP/s over all SMs, against the dense fp16 peak (4,096 FLOP a cycle an SM).

Usage (GPU machine): python bench/experiments/wgmma_rate.py [--iters 2000]
"""
from __future__ import annotations

import argparse

import numpy as np

SRC = r"""
extern "C" __global__ void __launch_bounds__(NWG * 128, 1) rate(int iters, long long* cyc) {
  extern __shared__ __align__(1024) unsigned char sm[];
  const int tid = threadIdx.x, wg = tid >> 7;
  // random fp16 in [-1, 1) over A (NWG x 64 x 256) and B (N x 256)
  unsigned* w = reinterpret_cast<unsigned*>(sm);
  for (int i = tid; i < (NWG * 64 + N) * 256 / 2; i += blockDim.x) {
    unsigned x = (i + 1) * 2654435761u ^ (blockIdx.x * 40503u);
    x ^= x >> 13; x *= 0x5bd1e995u; x ^= x >> 15;
    unsigned short a, b;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(a) : "f"(((x & 0xffff) / 32768.f) - 1.f));
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(b) : "f"(((x >> 16) / 32768.f) - 1.f));
    w[i] = (unsigned)a | ((unsigned)b << 16);
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const unsigned base = (unsigned)__cvta_generic_to_shared(sm);
  const unsigned a0 = base + wg * 64 * 512, b0 = base + NWG * 64 * 512;
  unsigned ra[4];
  for (int i = 0; i < 4; ++i) ra[i] = w[tid * 4 + i];
  float d[N / 2];
  for (int i = 0; i < N / 2; ++i) d[i] = 0.f;
  long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {
      const unsigned long long da = desc(a0, 64, kk), db = desc(b0, N, kk);
      MMA
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  }
  long long t1 = clock64();
  float s = 0.f;
  for (int i = 0; i < N / 2; ++i) s += d[i];
  if ((tid & 127) == 0) cyc[blockIdx.x * NWG + wg] = t1 - t0 + (s == 12345.f);
}
"""

DESC = {
    # core matrices of 8 rows x 16 bytes, 128 contiguous bytes; (row block i, 16-byte column c)
    # at (i * 32 + c) * 128: K-adjacent 128 bytes apart, row blocks 4,096
    "none": r"""
__device__ __forceinline__ unsigned long long desc(unsigned a, int rows, int kk) {
  return (unsigned long long)(((a + 256 * kk) & 0x3FFFFu) >> 4) |
         ((unsigned long long)(128 >> 4) << 16) | ((unsigned long long)(4096 >> 4) << 32);
}""",
    # 64-column chunks of rows x 128 bytes (8-row atoms of 1,024 bytes, swizzled); a k step of
    # 16 is 32 bytes into the chunk's rows
    "sw128": r"""
__device__ __forceinline__ unsigned long long desc(unsigned a, int rows, int kk) {
  const unsigned s = a + (kk >> 2) * rows * 128 + (kk & 3) * 32;
  return (unsigned long long)((s & 0x3FFFFu) >> 4) | (1ull << 16) |
         ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}""",
}


def mma(n: int, rs: bool) -> str:
    regs = ", ".join(f"%{i}" for i in range(n // 2))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n // 2))
    k = n // 2
    if rs:
        return (f'asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{k + 5}, 0;\\n"'
                f'"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {{{regs}}}, '
                f'{{%{k}, %{k + 1}, %{k + 2}, %{k + 3}}}, %{k + 4}, p, 1, 1, 0;\\n}}\\n"'
                f' : {outs} : "r"(ra[0]), "r"(ra[1]), "r"(ra[2]), "r"(ra[3]), "l"(db), '
                f'"r"(1));')
    return (f'asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{k + 2}, 0;\\n"'
            f'"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {{{regs}}}, %{k}, %{k + 1}, '
            f'p, 1, 1, 0, 0;\\n}}\\n" : {outs} : "l"(da), "l"(db), "r"(1));')


def source(n: int, swz: str, rs: bool, nwg: int) -> str:
    return (f"#define N {n}\n#define NWG {nwg}\n" + DESC[swz]
            + SRC.replace("MMA", mma(n, rs)))


def kernel(n: int, swz: str, rs: bool, nwg: int):
    from cupy_backends.cuda.libs import nvrtc

    src = source(n, swz, rs, nwg)
    prog = nvrtc.createProgram(src, "rate.cu", (), ())
    try:
        nvrtc.compileProgram(prog, ("--std=c++17", "-arch=sm_90a", "-ftz=true"))
    except nvrtc.NVRTCError as e:
        raise RuntimeError(nvrtc.getProgramLog(prog)) from e
    cubin = nvrtc.getCUBIN(prog)
    nvrtc.destroyProgram(prog)
    import cupy as cp

    from ninfer.kernels.gpu import set_max_dynamic_smem

    mod = cp.cuda.function.Module()
    mod.load(cubin)
    fn = mod.get_function("rate")
    smem = (nwg * 64 + n) * 512
    set_max_dynamic_smem(fn, smem)
    return fn, smem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    a = ap.parse_args()
    import cupy as cp

    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {sms} SMs")
    for nwg in (1, 2):
        for rs in (False, True):
            for n in (64, 80, 128, 256):
                for swz in ("none", "sw128"):
                    fn, smem = kernel(n, swz, rs, nwg)
                    cyc = cp.zeros(sms * nwg, cp.int64)
                    args = (np.int32(a.iters), cyc)
                    fn((sms,), (128 * nwg,), args, shared_mem=smem)
                    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
                    ev0.record()
                    fn((sms,), (128 * nwg,), args, shared_mem=smem)
                    ev1.record()
                    ev1.synchronize()
                    ms = cp.cuda.get_elapsed_time(ev0, ev1)
                    c = float(cyc.get().mean()) / (a.iters * 16)
                    flop = 2.0 * 64 * n * 16 * 16 * a.iters * nwg * sms
                    tf = flop / ms / 1e9
                    floor = n * nwg / 2   # cycles a warpgroup's wgmma at the peak, shared
                    print(f"{'RS' if rs else 'SS'} m64n{n:<3} {swz:>5} wg={nwg}: {c:7.1f} cycles "
                          f"a wgmma (floor {floor:5.1f}), {tf:6.1f} TFLOP/s, {ms:.3f} ms")


if __name__ == "__main__":
    main()
