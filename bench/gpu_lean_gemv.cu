// Experiment (bench/gpu_lean_chain.py): a lean batch-1 Q4_0 GEMV that reads its weights with
// plain 16-byte loads straight into registers (no shared-memory ring, no slot handoffs) and
// multiplies them with dp4a against int8 activations. Question it answers: can a GEMV consumer
// run clearly faster than HBM when its weights are already in L2, and how short can a chain of
// 129 such GEMVs (the 8B shape's decode GEMVs) get under PDL with the weights prefetched into L2
// before each kernel's griddepcontrol.wait?
//
// Layout (GGUF Q4_0 blocks split in two arrays): codes N x (K/32) x 16 bytes, row-major (byte j
// of a block: weight j in the low nibble, weight j + 16 in the high one); scales N x (K/32) fp16.
// Activations are quantized per 32 columns as llama.cpp's q8_1: d = amax / 127,
// q = rint(x / d); the block's sum of q (sx) folds the -8 offset of the codes:
// y[n] = sum_b d_w[n, b] d_x[b] (dot(codes, q) - 8 sx[b]).
// Warp gw of the grid owns rows [gw N / TW, (gw + 1) N / TW) (TW warps in all); lane l takes the
// blocks s * 32 + l of each row (a warp load is 512 contiguous bytes). G (row, segment) items
// are loaded at once, then multiplied.

__device__ __forceinline__ float h2f_(unsigned short h) {
  float f;
  asm("{ .reg .f16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ void prefetch_l2_bulk(const void* p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ uint4 ldg_nc(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ int dot_block(uint4 c, uint4 x0, uint4 x1) {
  int d = 0;
  d = __dp4a((int)(c.x & 0x0F0F0F0Fu), (int)x0.x, d);
  d = __dp4a((int)(c.y & 0x0F0F0F0Fu), (int)x0.y, d);
  d = __dp4a((int)(c.z & 0x0F0F0F0Fu), (int)x0.z, d);
  d = __dp4a((int)(c.w & 0x0F0F0F0Fu), (int)x0.w, d);
  d = __dp4a((int)((c.x >> 4) & 0x0F0F0F0Fu), (int)x1.x, d);
  d = __dp4a((int)((c.y >> 4) & 0x0F0F0F0Fu), (int)x1.y, d);
  d = __dp4a((int)((c.z >> 4) & 0x0F0F0F0Fu), (int)x1.z, d);
  d = __dp4a((int)((c.w >> 4) & 0x0F0F0F0Fu), (int)x1.w, d);
  return d;
}

// WARPS warps per block; SEGS = K / 1024; G items (row, segment) loaded at once; ACC: y +=;
// PREF: the warp's whole weight range is prefetched into L2 (one bulk prefetch for its codes,
// one for its scales) before griddepcontrol.wait; the first group's loads are issued before it
// either way (weights are never written).
template <int WARPS, int SEGS, int G, bool ACC, bool PREF, int MINB>
__global__ void __launch_bounds__(WARPS * 32, MINB)
lean_q4(const uint4* __restrict__ codes, const unsigned short* __restrict__ scales,
        const float* __restrict__ x, float* __restrict__ y, int N) {
  constexpr int K = SEGS * 1024;
  constexpr int NB = K / 32;   // blocks per row
  __shared__ uint4 xq[NB * 2];
  __shared__ float dx[NB];
  __shared__ int sx[NB];
  pdl_trigger();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long tw = (long)gridDim.x * WARPS, gw = (long)blockIdx.x * WARPS + warp;
  const int r0 = (int)(gw * N / tw), r1 = (int)((gw + 1) * N / tw);
  const int items = (r1 - r0) * SEGS;
  if (PREF && lane == 0 && r1 > r0) {
    prefetch_l2_bulk(codes + (long)r0 * NB, (unsigned)((r1 - r0) * NB * 16));
    prefetch_l2_bulk(scales + (long)r0 * NB, (unsigned)((r1 - r0) * NB * 2));
  }
  uint4 c[G];
  unsigned short sc[G];
  // item i of this warp: row r0 + i / SEGS, segment i % SEGS; lane's block (i % SEGS) * 32 + lane
  auto load = [&](int i0) {
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int i = i0 + j;
      if (i < items) {
        const long b = (long)(r0 + i / SEGS) * NB + (i % SEGS) * 32 + lane;
        c[j] = ldg_nc(codes + b);
        sc[j] = __ldg(scales + b);
      }
    }
  };
  load(0);
  pdl_wait();
  // stage x: thread t quantizes block t (32 floats)
  for (int t = threadIdx.x; t < NB; t += WARPS * 32) {
    const float4* xp = reinterpret_cast<const float4*>(x + t * 32);
    float4 v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = xp[i];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i)
      amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v[i].x), fabsf(v[i].y)), fmaxf(fabsf(v[i].z), fabsf(v[i].w))));
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    unsigned w[8];
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int q0 = __float2int_rn(v[i].x * inv), q1 = __float2int_rn(v[i].y * inv);
      const int q2 = __float2int_rn(v[i].z * inv), q3 = __float2int_rn(v[i].w * inv);
      s += q0 + q1 + q2 + q3;
      w[i] = (q0 & 0xFF) | ((q1 & 0xFF) << 8) | ((q2 & 0xFF) << 16) | ((unsigned)(q3 & 0xFF) << 24);
    }
    xq[2 * t] = make_uint4(w[0], w[1], w[2], w[3]);
    xq[2 * t + 1] = make_uint4(w[4], w[5], w[6], w[7]);
    dx[t] = d;
    sx[t] = s;
  }
  __syncthreads();
  float acc = 0.f;
  for (int i0 = 0; i0 < items; i0 += G) {
    if (i0 > 0) load(i0);
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int i = i0 + j;
      if (i < items) {
        const int s = i % SEGS, blk = s * 32 + lane;
        const int dot = dot_block(c[j], xq[2 * blk], xq[2 * blk + 1]);
        acc += h2f_(sc[j]) * dx[blk] * (float)(dot - 8 * sx[blk]);
        if (s == SEGS - 1) {
          const float v = warp_sum(acc);
          if (lane == 0) {
            const int row = r0 + i / SEGS;
            if (ACC) y[row] += v; else y[row] = v;
          }
          acc = 0.f;
        }
      }
    }
  }
}

// A stand-in for the decode attention between qkv and o: NB blocks spin for `ns` nanoseconds
// (globaltimer) after griddepcontrol.wait, then one thread writes a flag.
__global__ void spin_kernel(float* flag, long long ns) {
  pdl_trigger();
  pdl_wait();
  const unsigned long long t0 = globaltimer();
  while ((long long)(globaltimer() - t0) < ns) { }
  if (threadIdx.x == 0) flag[blockIdx.x] = 1.f;
}

// Floors of the two ways to order dependent phases (session 15): a kernel that does nothing
// but the PDL handshake (a chain of them = the per-op path's kernel boundaries) ...
__global__ void empty_kernel(float* y) {
  pdl_trigger();
  pdl_wait();
  if (threadIdx.x == 0 && blockIdx.x == 0) y[0] += 1.f;
}

// ... and n grid-wide barriers in one persistent launch (the megakernel's scheme: block 0 adds
// 2^31 - (G - 1), the others 1; the counter's top bit flips once per barrier). With `stream`
// non-null, warp 0 of every block reads `stream` (bytes of HBM) in a loop until the barriers
// are done, as a weight stream would load the memory system; the other warps run the barriers.
__global__ void barrier_kernel(unsigned* bar, int n, const uint4* __restrict__ stream,
                               long long stream_words, unsigned* done, float* y) {
  pdl_trigger();
  pdl_wait();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nthreads = blockDim.x - (stream ? 32 : 0);
  if (stream && warp == 0) {
    uint4 acc = make_uint4(0, 0, 0, 0);
    const long long per = stream_words / gridDim.x;
    const uint4* p = stream + per * blockIdx.x;
    for (long long i = lane; ; i += 32 * 8) {
      if (*(volatile unsigned*)done) break;
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const uint4 v = ldg_nc(p + (i + u * 32) % per);
        acc.x ^= v.x; acc.y ^= v.y;
      }
    }
    if (acc.x == 0x12345678u && acc.y == 0x9abcdef0u) y[1] = 1.f;  // keep the loads
    return;
  }
  for (int k = 0; k < n; ++k) {
    asm volatile("bar.sync 1, %0;" :: "r"(nthreads));
    if (threadIdx.x == (stream ? 32 : 0)) {
      const unsigned add = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
      __threadfence();
      const unsigned old = atomicAdd(bar, add);
      unsigned cur;
      do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(cur) : "l"(bar) : "memory");
      } while (((old ^ cur) & 0x80000000u) == 0);
      __threadfence();
    }
    asm volatile("bar.sync 1, %0;" :: "r"(nthreads));
  }
  if (threadIdx.x == (stream ? 32 : 0) && blockIdx.x == 0) { y[0] += 1.f; *(volatile unsigned*)done = 1u; }
}
