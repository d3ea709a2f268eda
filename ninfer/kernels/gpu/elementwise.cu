// Row-wise and element-wise ops: RMSNorm, RoPE, SwiGLU core, embedding gather (float
// rows; packed rows in linear.cu), paged KV write. Semantics are those of the NumPy reference modules of the same names
// (ninfer/kernels/norm.py, rope.py, activation.py, embedding.py, attention.write_kv).
// (common.cuh is prepended by the Python loader.)

// RMSNorm: one block (256 threads) per row; float32 statistics.
// y = x / sqrt(sum(x^2)/H + eps) * (w or 1 + w).
extern "C" __global__ void __launch_bounds__(256)
rms_norm(const float* __restrict__ x, int ldx, const float* __restrict__ w,
         float* __restrict__ y, int H, float eps, int unit_offset) {
  __shared__ float red[8];
  const float* xr = x + (size_t)blockIdx.x * ldx;
  float ss = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.f;
    v = warp_sum(v);
    if (threadIdx.x == 0) red[0] = v;
  }
  __syncthreads();
  const float denom = sqrtf(red[0] * (1.0f / (float)H) + eps);
  float* yr = y + (size_t)blockIdx.x * H;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const float wi = unit_offset ? 1.0f + w[i] : w[i];
    yr[i] = (xr[i] / denom) * wi;
  }
}

// RMSNorm, vectorised (H % 4 == 0, 16-byte aligned rows): one block of up to 1024 threads per
// row, float4 loads, each thread's NV float4 kept in registers between the sum of squares and
// the scaling (one pass over memory instead of two, and 4x fewer load instructions).
// H16: y is fp16 (the prefill GEMM's operand, rounded as astype rounds), 4 halves a float4.
template <int NV, bool H16 = false>
__device__ __forceinline__ void rms_norm4_row(const float4* __restrict__ x, int ldx4,
                                              const float4* __restrict__ w,
                                              void* __restrict__ y, int H4, float eps,
                                              int unit_offset, float inv_h) {
  __shared__ float red[32];
  const float4* xr = x + (size_t)blockIdx.x * ldx4;
  float4 v[NV];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    v[j] = i < H4 ? xr[i] : make_float4(0.f, 0.f, 0.f, 0.f);
    ss = fmaf(v[j].x, v[j].x, fmaf(v[j].y, v[j].y, fmaf(v[j].z, v[j].z, fmaf(v[j].w, v[j].w, ss))));
  }
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float t = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.f;
    t = warp_sum(t);
    if (threadIdx.x == 0) red[0] = t;
  }
  __syncthreads();
  const float denom = sqrtf(red[0] * inv_h + eps);
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < H4) {
      float4 wi = w[i];
      if (unit_offset) { wi.x += 1.f; wi.y += 1.f; wi.z += 1.f; wi.w += 1.f; }
      const float4 o = make_float4((v[j].x / denom) * wi.x, (v[j].y / denom) * wi.y,
                                   (v[j].z / denom) * wi.z, (v[j].w / denom) * wi.w);
      if constexpr (H16)
        reinterpret_cast<uint2*>(y)[(size_t)blockIdx.x * H4 + i] =
            make_uint2(pack_h2(o.x, o.y), pack_h2(o.z, o.w));
      else
        reinterpret_cast<float4*>(y)[(size_t)blockIdx.x * H4 + i] = o;
    }
  }
}
#define RMS_NORM4(NV)                                                                          \
  extern "C" __global__ void __launch_bounds__(1024) rms_norm4_##NV(                          \
      const float4* __restrict__ x, int ldx4, const float4* __restrict__ w,                    \
      float4* __restrict__ y, int H4, float eps, int unit_offset, float inv_h) {              \
    rms_norm4_row<NV>(x, ldx4, w, y, H4, eps, unit_offset, inv_h);                             \
  }
RMS_NORM4(1)
RMS_NORM4(2)
RMS_NORM4(4)
#define RMS_NORM4H(NV)                                                                         \
  extern "C" __global__ void __launch_bounds__(1024) rms_norm4h_##NV(                         \
      const float4* __restrict__ x, int ldx4, const float4* __restrict__ w,                    \
      unsigned short* __restrict__ y, int H4, float eps, int unit_offset, float inv_h) {      \
    rms_norm4_row<NV, true>(x, ldx4, w, y, H4, eps, unit_offset, inv_h);                       \
  }
RMS_NORM4H(1)
RMS_NORM4H(2)
RMS_NORM4H(4)

// Row-wise argmax (first index on ties, NaN counts as the largest value and -0 equals +0, like
// NumPy's): grid (S, B), block b of row r takes the b-th of B equal column ranges of the row
// (row stride ld), every thread keeping AM_LOADS loads in flight. The candidates are ordered by
// one 64-bit key (am_key: the value's bits mapped to an unsigned order, then the inverted
// index), so the blocks' bests reduce with max. Each block writes its best to part[r B + b]; the
// last block of a row to arrive (counters[r], reset by it for the next launch; CUDA Programming
// Guide, "Memory Fence Functions") reduces them and writes the int64 index to out[r] (and, where
// out32 is not null, as int32 to out32[r]). One block per 2,048 columns: one block a row
// (one load in flight a thread) is latency-bound on a 128,256-wide vocabulary row.
constexpr int AM_THREADS = 256, AM_LOADS = 8;
__device__ __forceinline__ unsigned long long am_key(float v, int i) {
  unsigned u = __float_as_uint(v + 0.f);  // (-0 + 0 = +0)
  u = v != v ? 0xffffffffu : (u & 0x80000000u) ? ~u : u | 0x80000000u;
  return (unsigned long long)u << 32 | (0xffffffffu - (unsigned)i);
}
__device__ __forceinline__ unsigned long long am_block_max(unsigned long long k) {
  __shared__ unsigned long long sk[AM_THREADS / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long ok = __shfl_xor_sync(0xffffffffu, k, o);
    k = ok > k ? ok : k;
  }
  if ((threadIdx.x & 31) == 0) sk[threadIdx.x >> 5] = k;
  __syncthreads();
  k = 0;
#pragma unroll
  for (int w = 0; w < AM_THREADS / 32; ++w) k = sk[w] > k ? sk[w] : k;
  return k;  // (every thread)
}
extern "C" __global__ void __launch_bounds__(AM_THREADS)
argmax_rows(const float* __restrict__ x, long long ld, int V, long long* __restrict__ out,
            unsigned long long* __restrict__ part, unsigned* __restrict__ counters,
            int* __restrict__ out32) {
  const int r = blockIdx.x, b = blockIdx.y, nb = gridDim.y;
  const float* xr = x + (size_t)r * ld;
  const int span = (V + nb - 1) / nb, i0 = b * span, i1 = min(V, i0 + span);
  unsigned long long best = 0;  // (below every key: -inf's is 0x007fffff...)
  for (int i = i0 + threadIdx.x; i < i1; i += AM_LOADS * AM_THREADS) {
    float v[AM_LOADS];
#pragma unroll
    for (int u = 0; u < AM_LOADS; ++u) {
      const int j = i + u * AM_THREADS;
      v[u] = j < i1 ? __ldg(xr + j) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < AM_LOADS; ++u) {
      const int j = i + u * AM_THREADS;
      const unsigned long long k = am_key(v[u], j);
      if (j < i1 && k > best) best = k;
    }
  }
  best = am_block_max(best);
  if (nb > 1) {
    __shared__ bool last;
    if (threadIdx.x == 0) {
      part[(size_t)r * nb + b] = best;
      __threadfence();
      last = atomicAdd(counters + r, 1u) == (unsigned)nb - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    best = 0;
    for (int j = threadIdx.x; j < nb; j += AM_THREADS) {
      const unsigned long long k = __ldcg(part + (size_t)r * nb + j);
      best = k > best ? k : best;
    }
    best = am_block_max(best);
    if (threadIdx.x == 0) counters[r] = 0;  // for the next launch
  }
  if (threadIdx.x == 0) {
    const unsigned i = 0xffffffffu - (unsigned)best;
    out[r] = (long long)i;
    if (out32) out32[r] = (int)i;  // (a CUDA graph's token input: gpu/graphs.py)
  }
}

// (rope_head: common.cuh)

// RoPE: block per (token, head); thread per rotated pair (and pass-through dims >= r).
// x: (T, n, hd) with token stride ldx and head stride hd; out: contiguous (T, n, hd).
extern "C" __global__ void rope(const float* __restrict__ x, int ldx, const int* __restrict__ pos,
                                const float* __restrict__ inv_freq, float* __restrict__ out,
                                int n, int hd, int r, int style) {
  const int t = blockIdx.x / n, h = blockIdx.x - (blockIdx.x / n) * n;
  rope_head(x + (size_t)t * ldx + (size_t)h * hd, out + ((size_t)t * n + h) * hd, (float)pos[t],
            inv_freq, hd, r, style);
}

// RoPE of the q and k heads of a fused (T, (nq + nk + nk) hd) qkv row block and the paged KV
// write of k (rotated) and v, in one launch: block (token, head) for the nq + nk rotated heads,
// and block (token, nq + nk) copies the token's v row. q goes to q_out (T, nq, hd); k and v to
// the caches' slot (skipped when the slot is negative). Same arithmetic as rope + write_kv.
// T: the caches' element type (common.cuh, kv_put; kvq8 and the rk types: hd <= 512, each row
// quantized per 64-dim group by kv_put_rows once the block has rotated the whole k head).
template <typename T>
__global__ void rope_write_kv(const float* __restrict__ qkv, int ldx, const int* __restrict__ pos,
                              const float* __restrict__ inv_freq,
                              const long long* __restrict__ slots, float* __restrict__ q_out,
                              T* __restrict__ kc, T* __restrict__ vc, int nq, int nk, int hd,
                              int r, int style) {
  pdl_trigger();
  pdl_wait();  // launched with PDL (gpu/launch.py)
  const int t = blockIdx.x, h = blockIdx.y;
  const float* xr = qkv + (size_t)t * ldx;
  const long long slot = slots[t];
  const size_t kv_row = (size_t)nk * hd;
  if constexpr (sizeof(T) == 1) {  // int8 / rk rows
    __shared__ float ks[512];
    const size_t w = (size_t)kv_width<T>(hd);
    if (h == nq + nk) {
      if (slot >= 0)
        kv_put_rows<T, true>(xr + (size_t)(nq + nk) * hd,
                             vc + slot * nk * (size_t)kv_width<T, true>(hd), nk, hd);
    } else if (h < nq) {
      rope_head(xr + (size_t)h * hd, q_out + ((size_t)t * nq + h) * hd, (float)pos[t],
                inv_freq, hd, r, style);
    } else if (slot >= 0) {
      rope_head(xr + (size_t)h * hd, ks, (float)pos[t], inv_freq, hd, r, style);
      __syncthreads();
      kv_put_rows<T, false>(ks, kc + (slot * nk + (h - nq)) * w, 1, hd);
    }
  } else if (h == nq + nk) {  // v
    if (slot >= 0)
      for (int i = threadIdx.x; i < (int)kv_row; i += blockDim.x)
        kv_put(vc, slot * kv_row + i, xr[(size_t)(nq + nk) * hd + i]);
  } else if (h < nq) {
    rope_head(xr + (size_t)h * hd, q_out + ((size_t)t * nq + h) * hd, (float)pos[t], inv_freq,
              hd, r, style);
  } else if (slot >= 0) {
    rope_head(xr + (size_t)h * hd, kc + slot * kv_row + (size_t)(h - nq) * hd, (float)pos[t],
              inv_freq, hd, r, style);
  }
}

// Gated attention's heads of a fused qkv row block (Qwen3.5: with gq, q head h is columns
// h * 2 hd .. + hd, its output gate the next hd; k heads from kcol, then v): RMSNorm of each q and
// k head (weights qw / kw, hd), RoPE, q to q_out (T, nq, hd), k and v written at the caches' slot
// (skipped when negative), in one launch: block (token, head) for the nq + nk heads, block
// (token, nq + nk) copies v. The norm's sum runs over the block's warps (hd <= 512).
// T: the caches' element type (common.cuh, kv_put; kvq8 and the rk types: rows quantized by
// kv_put_rows once the block has the whole rotated k head).
template <typename T>
__global__ void __launch_bounds__(128)
norm_rope_write_kv(const float* __restrict__ qkv, int ldx, int gq, int kcol,
                   const float* __restrict__ qw, const float* __restrict__ kw, float eps,
                   const int* __restrict__ pos, const float* __restrict__ inv_freq,
                   const long long* __restrict__ slots, float* __restrict__ q_out,
                   T* __restrict__ kc, T* __restrict__ vc, int nq, int nk, int hd, int r,
                   int style) {
  __shared__ float xs[512], red[4];
  pdl_trigger();
  pdl_wait();  // launched with PDL (gpu/launch.py)
  const int t = blockIdx.x, h = blockIdx.y;
  const float* xr = qkv + (size_t)t * ldx;
  const long long slot = slots[t];
  const size_t kv_row = (size_t)nk * hd;
  if (h == nq + nk) {  // v
    if constexpr (sizeof(T) == 1) {
      if (slot >= 0)
        kv_put_rows<T, true>(xr + kcol + kv_row, vc + slot * nk * (size_t)kv_width<T, true>(hd),
                             nk, hd);
    } else if (slot >= 0) {
      for (int i = threadIdx.x; i < (int)kv_row; i += blockDim.x)
        kv_put(vc, slot * kv_row + i, xr[kcol + kv_row + i]);
    }
    return;
  }
  const bool is_q = h < nq;
  if (!is_q && slot < 0) return;
  const float* xh = is_q ? xr + (size_t)h * (gq ? 2 * hd : hd) : xr + kcol + (size_t)(h - nq) * hd;
  const float* w = is_q ? qw : kw;
  float ss = 0.f;
  for (int i = threadIdx.x; i < hd; i += blockDim.x) {
    const float x = xh[i];
    xs[i] = x;
    ss = fmaf(x, x, ss);
  }
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
  __syncthreads();
  ss = 0.f;
  for (int i = 0; i < (int)(blockDim.x >> 5); ++i) ss += red[i];
  const float rs = rsqrtf(ss / (float)hd + eps);
  for (int i = threadIdx.x; i < hd; i += blockDim.x) xs[i] = xs[i] * rs * w[i];
  __syncthreads();
  if (is_q) {
    rope_head(xs, q_out + ((size_t)t * nq + h) * hd, (float)pos[t], inv_freq, hd, r, style);
  } else if constexpr (sizeof(T) == 1) {
    __shared__ float ks[512];
    rope_head(xs, ks, (float)pos[t], inv_freq, hd, r, style);
    __syncthreads();
    kv_put_rows<T, false>(ks, kc + (slot * nk + (h - nq)) * (size_t)kv_width<T>(hd), 1, hd);
  } else {
    rope_head(xs, kc + slot * kv_row + (size_t)(h - nq) * hd, (float)pos[t], inv_freq, hd, r,
              style);
  }
}

// silu(gate) * up; gate/up rows with strides ldg/ldu; out contiguous (T, I), float32 or (OutT
// unsigned short) fp16 bits, the prefill GEMM's operand.
template <typename OutT>
__device__ __forceinline__ void silu_mul_rows(const float* __restrict__ gate, int ldg,
                                              const float* __restrict__ up, int ldu,
                                              OutT* __restrict__ out, int T, int I) {
  const long long n = (long long)T * I;
  for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < n;
       idx += (long long)gridDim.x * blockDim.x) {
    const long long t = idx / I;
    const int i = (int)(idx - t * I);
    const float g = gate[t * ldg + i];
    const float y = g / (1.0f + expf(-g)) * up[t * ldu + i];
    if constexpr (sizeof(OutT) == 2) out[idx] = f2h(y);
    else out[idx] = y;
  }
}
extern "C" __global__ void silu_mul(const float* __restrict__ gate, int ldg,
                                    const float* __restrict__ up, int ldu,
                                    float* __restrict__ out, int T, int I) {
  silu_mul_rows(gate, ldg, up, ldu, out, T, I);
}
extern "C" __global__ void silu_mul_h(const float* __restrict__ gate, int ldg,
                                      const float* __restrict__ up, int ldu,
                                      unsigned short* __restrict__ out, int T, int I) {
  silu_mul_rows(gate, ldg, up, ldu, out, T, I);
}

// fp16 rows (T, K), contiguous -> e4m3 codes (T, K) and a float32 scale a row, its largest
// |x| / 448 (1 for a row of zeros): x * (1 / scale) rounded to nearest even (the fp8 prefill
// GEMM's operand, gpu/gemm_fp8.py; K % 8 == 0, 16-byte aligned). A block a row.
// The block's row scale from each thread's largest |y| m: max over the block (red: a float a
// warp), written to scale[blockIdx.x] as max / 448 (1 for a row of zeros); returns 1 / scale.
__device__ __forceinline__ float e4m3_row_scale(float m, float* red, float* __restrict__ scale) {
  m = warp_max(m);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  m = red[0];
  for (int i = 1; i < (blockDim.x >> 5); ++i) m = fmaxf(m, red[i]);
  const float s = m > 0.f ? m / 448.f : 1.f;
  if (threadIdx.x == 0) scale[blockIdx.x] = s;
  return 1.0f / s;
}
extern "C" __global__ void __launch_bounds__(256)
quant_rows_e4m3(const unsigned short* __restrict__ x, unsigned char* __restrict__ q,
                float* __restrict__ scale, int K) {
  __shared__ float red[8];
  const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)blockIdx.x * K);
  const int K8 = K >> 3;
  float m = 0.f;
  for (int i = threadIdx.x; i < K8; i += blockDim.x) {
    const uint4 v = xr[i];
    const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int p = 0; p < 4; ++p)
      m = fmaxf(m, fmaxf(fabsf(h2f(u[p] & 0xFFFFu)), fabsf(h2f(u[p] >> 16))));
  }
  const float inv = e4m3_row_scale(m, red, scale);
  uint2* qr = reinterpret_cast<uint2*>(q + (size_t)blockIdx.x * K);
  for (int i = threadIdx.x; i < K8; i += blockDim.x) {
    const uint4 v = xr[i];
    const unsigned u[4] = {v.x, v.y, v.z, v.w};
    unsigned short c[4];
#pragma unroll
    for (int p = 0; p < 4; ++p)
      c[p] = e4m3x2(h2f(u[p] & 0xFFFFu) * inv, h2f(u[p] >> 16) * inv);
    qr[i] = make_uint2(c[0] | ((unsigned)c[1] << 16), c[2] | ((unsigned)c[3] << 16));
  }
}

// silu(gate) * up of bf16 rows gu (T, 2 I) (gate | up, gate_up's fp8 product) -> e4m3 codes
// (T, I) and a float32 scale a row, as quant_rows_e4m3 (down's operand, never written as
// floats: the row's largest |y| first, then its y quantized). I % 8 == 0, 16-byte aligned
// rows. A block a row.
__device__ __forceinline__ void silu_mul_bf16x2(unsigned g, unsigned u, float& y0, float& y1) {
  const float g0 = __uint_as_float(g << 16), g1 = __uint_as_float(g & 0xFFFF0000u);
  y0 = g0 / (1.0f + expf(-g0)) * __uint_as_float(u << 16);
  y1 = g1 / (1.0f + expf(-g1)) * __uint_as_float(u & 0xFFFF0000u);
}
constexpr int SMUL_KEEP = 5;   // 8-value groups a thread keeps between the passes (I <= 20,480)
extern "C" __global__ void __launch_bounds__(512, 1)   // (no spills: 72 registers)
silu_mul_e4m3(const unsigned short* __restrict__ gu, unsigned char* __restrict__ q,
              float* __restrict__ scale, int I) {
  __shared__ float red[16];
  const uint4* gr = reinterpret_cast<const uint4*>(gu + (size_t)blockIdx.x * 2 * I);
  const uint4* ur = gr + (I >> 3);
  uint2* qr = reinterpret_cast<uint2*>(q + (size_t)blockIdx.x * I);
  const int I8 = I >> 3, nt = blockDim.x, rest = threadIdx.x + SMUL_KEEP * nt;
  auto load = [&](int i, float (&y)[8]) {   // y at columns 8 i .. 8 i + 7
    const uint4 g = gr[i], u = ur[i];
    const unsigned gw[4] = {g.x, g.y, g.z, g.w}, uw[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int p = 0; p < 4; ++p) silu_mul_bf16x2(gw[p], uw[p], y[2 * p], y[2 * p + 1]);
  };
  auto amax = [](float m, const float (&y)[8]) {
#pragma unroll
    for (int e = 0; e < 8; ++e) m = fmaxf(m, fabsf(y[e]));
    return m;
  };
  // the row's y in registers (every load issued before the first is used); a row longer than
  // SMUL_KEEP groups a thread reads its rest twice
  float y[SMUL_KEEP][8], m = 0.f;
#pragma unroll
  for (int k = 0; k < SMUL_KEEP; ++k)
    if (threadIdx.x + k * nt < I8) load(threadIdx.x + k * nt, y[k]);
#pragma unroll
  for (int k = 0; k < SMUL_KEEP; ++k)
    if (threadIdx.x + k * nt < I8) m = amax(m, y[k]);
  for (int i = rest; i < I8; i += nt) {
    float v[8];
    load(i, v);
    m = amax(m, v);
  }
  const float inv = e4m3_row_scale(m, red, scale);
  auto store = [&](int i, const float (&v)[8]) {
    unsigned short c[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) c[p] = e4m3x2(v[2 * p] * inv, v[2 * p + 1] * inv);
    qr[i] = make_uint2(c[0] | ((unsigned)c[1] << 16), c[2] | ((unsigned)c[3] << 16));
  };
#pragma unroll
  for (int k = 0; k < SMUL_KEEP; ++k)
    if (threadIdx.x + k * nt < I8) store(threadIdx.x + k * nt, y[k]);
  for (int i = rest; i < I8; i += nt) {
    float v[8];
    load(i, v);
    store(i, v);
  }
}

// float32 rows (row stride ldx) -> contiguous fp16, rounded to nearest even as astype rounds
// (a prefill GEMM's operand where no prologue kernel wrote it: CuPy's astype costs ~60 us of
// host time a call, a launch of this ~10)
extern "C" __global__ void cast_h(const float* __restrict__ x, int ldx,
                                  unsigned short* __restrict__ out, int T, int I) {
  const long long n = (long long)T * I;
  for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < n;
       idx += (long long)gridDim.x * blockDim.x) {
    const long long t = idx / I;
    out[idx] = f2h(x[t * ldx + (idx - t * I)]);
  }
}

// Embedding gather of float32 rows, block per token (packed q4 / q8 rows: linear.cu embed_mma).
extern "C" __global__ void embed_f32(const float* __restrict__ w, const int* __restrict__ ids,
                                     float* __restrict__ out, int H) {
  const float* row = w + (size_t)ids[blockIdx.x] * H;
  for (int i = threadIdx.x; i < H; i += blockDim.x) out[(size_t)blockIdx.x * H + i] = row[i];
}

// Paged KV write: k/v (T, nkv*hd) rows (row = nkv hd floats) with token strides ldk/ldv; slot
// < 0 skipped. T: the caches' element type (common.cuh, kv_put; kvq8 and the rk types:
// kv_put_rows, a warp a 64-dim group).
template <typename T>
__global__ void write_kv(const float* __restrict__ k, int ldk, const float* __restrict__ v,
                         int ldv, const long long* __restrict__ slots, T* __restrict__ kc,
                         T* __restrict__ vc, int row, int hd) {
  const long long slot = slots[blockIdx.x];
  if (slot < 0) return;
  if constexpr (sizeof(T) == 1) {
    const int nk = row / hd;
    kv_put_rows<T, false>(k + (size_t)blockIdx.x * ldk, kc + slot * nk * (size_t)kv_width<T>(hd),
                          nk, hd);
    kv_put_rows<T, true>(v + (size_t)blockIdx.x * ldv,
                         vc + slot * nk * (size_t)kv_width<T, true>(hd), nk, hd);
  } else {
    for (int i = threadIdx.x; i < row; i += blockDim.x) {
      kv_put(kc, slot * row + i, k[(size_t)blockIdx.x * ldk + i]);
      kv_put(vc, slot * row + i, v[(size_t)blockIdx.x * ldv + i]);
    }
  }
}

// y = x w^T for float32 x (T, K) rows with stride ldx and a float32 weight w (N, K): one warp
// per output. The plain (unquantized) weights' product inside a CUDA-graph capture, where
// CuPy refuses cuBLAS; eager passes use cuBLAS.
extern "C" __global__ void __launch_bounds__(256)
matmul_f32_nt(const float* __restrict__ x, int ldx, const float* __restrict__ w,
              float* __restrict__ y, int T, int N, int K) {
  const long long o = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (o >= (long long)T * N) return;
  const int t = (int)(o / N), n = (int)(o % N);
  const float* xr = x + (size_t)t * ldx;
  const float* wr = w + (size_t)n * K;
  float acc = 0.f;
  for (int k = lane; k < K; k += 32) acc = fmaf(xr[k], wr[k], acc);
  acc = warp_sum(acc);
  if (lane == 0) y[o] = acc;
}
