// Quantized linear layers: GEMV over packed groupwise int4 / int8 weights (decode), and
// dequantization into an fp16 scratch matrix for cuBLAS tensor-core GEMM (prefill).
//
// Weight layouts (ninfer/store/quant.py): row-major (N, K), groups of `group` elements along K.
//   q4: codes u8 (N, K/2), element 2i in the low nibble of byte i, 2i+1 in the high nibble;
//       scales f16 (N, K/group); mins f16 (N, K/group) or none.
//       x = s*q + m (with mins, GGUF Q4_1) or x = s*(q - 8) (without, GGUF Q4_0).
//   q8: codes i8 (N, K); scales f16 (N, K/group); x = s*q.
// (common.cuh is prepended by the Python loader.)

// ---------------------------------------------------------------------------------------------
// GEMV: out[t, n] = sum_k x[t, k] * W[n, k] for t < T (T small, a template parameter).
// One block (4 warps) computes R consecutive output rows; its 128 threads split K. In each step
// a warp covers 256 consecutive elements of K: lane l takes elements [8l, 8l + 8) of the span,
// i.e. one 4-byte word of q4 codes (8 bytes of q8 codes) per row, and reads its 8 activations
// per token row as two float4 loads, so both the code loads and the activation loads of a warp
// are contiguous (coalesced). The 4 warps' partial sums are added through shared memory.
// Steps are unrolled by two with the code loads issued first. 8 elements never straddle a
// group (group % 32 == 0), so a lane needs one scale (and min) per row per step.
//
// int4 -> float without an integer-to-float conversion: placing the nibble q in mantissa bits
// 19..22 of 1.0f gives exactly f = 1 + q/16. Then sum_j q_j x_j = 16 (sum_j f_j x_j - sum_j x_j),
// and the contribution of 8 elements of one group is
//   Q4_1: s * sum q x + m * sum x    = 16 s * F + (m - 16 s) * X
//   Q4_0: s * (sum q x - 8 * sum x)  = 16 s * F - 24 s * X
// with F = sum f x, X = sum x (X is shared by the R rows).

template <int T>
__device__ __forceinline__ void load_x8(const float* __restrict__ x, int K, int k,
                                        float (&xv)[T][8], float (&X)[T]) {
#pragma unroll
  for (int t = 0; t < T; ++t) {
    const float4* xp = reinterpret_cast<const float4*>(x + (size_t)t * K + k);
    const float4 a = __ldg(xp), b = __ldg(xp + 1);
    xv[t][0] = a.x; xv[t][1] = a.y; xv[t][2] = a.z; xv[t][3] = a.w;
    xv[t][4] = b.x; xv[t][5] = b.y; xv[t][6] = b.z; xv[t][7] = b.w;
    X[t] = ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w));
  }
}

// Sum acc over the 4 warps of a 128-thread block and store out[t, row0 + r].
template <int R, int T>
__device__ __forceinline__ void block_reduce_store(float (&acc)[R][T], float* __restrict__ out,
                                                   int ldo, int row0, int N) {
  __shared__ float part[4][R * T];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const float v = warp_sum(acc[r][t]);
      if (lane == 0) part[warp][r * T + t] = v;
    }
  __syncthreads();
  for (int i = threadIdx.x; i < R * T; i += blockDim.x) {
    const int r = i / T, t = i - (i / T) * T;
    if (row0 + r < N) out[(size_t)t * ldo + row0 + r] = part[0][i] + part[1][i] + part[2][i] + part[3][i];
  }
}

// U: steps whose code loads are issued together (R * U words in flight per thread).
template <int T, int R, bool MINS, int U>
__global__ void __launch_bounds__(128)
gemv_q4(const float* __restrict__ x, const unsigned int* __restrict__ codes,
        const unsigned short* __restrict__ scales, const unsigned short* __restrict__ mins,
        float* __restrict__ out, int ldo, int N, int K, int group) {
  const int row0 = blockIdx.x * R;
  const int words = K >> 3;  // 4-byte code words per row
  const int gpr = K / group;
  float acc[R][T];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < T; ++t) acc[r][t] = 0.f;
  int rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) rows[r] = min(row0 + r, N - 1);

  auto step = [&](int wd, const unsigned int (&c)[R]) {
    const int k = wd * 8;
    const int grp = k / group;
    float xv[T][8], X[T];
    load_x8<T>(x, K, k, xv, X);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float s = h2f(__ldg(scales + (size_t)rows[r] * gpr + grp));
      const float m = MINS ? h2f(__ldg(mins + (size_t)rows[r] * gpr + grp)) : 0.f;
      float F[T];
#pragma unroll
      for (int t = 0; t < T; ++t) F[t] = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const unsigned int sh = (i * 4 <= 19) ? (c[r] << (19 - i * 4)) : (c[r] >> (i * 4 - 19));
        const float f = __int_as_float((sh & 0x00780000u) | 0x3F800000u);
#pragma unroll
        for (int t = 0; t < T; ++t) F[t] = fmaf(f, xv[t][i], F[t]);
      }
      const float s16 = 16.f * s;
      const float cx = MINS ? (m - s16) : (-24.f * s);
#pragma unroll
      for (int t = 0; t < T; ++t) acc[r][t] += s16 * F[t] + cx * X[t];
    }
  };

  int wd = threadIdx.x;
  for (; wd + 128 * (U - 1) < words; wd += 128 * U) {
    unsigned int c[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r) c[u][r] = __ldg(codes + (size_t)rows[r] * words + wd + 128 * u);
#pragma unroll
    for (int u = 0; u < U; ++u) step(wd + 128 * u, c[u]);
  }
  for (; wd < words; wd += 128) {
    unsigned int c0[R];
#pragma unroll
    for (int r = 0; r < R; ++r) c0[r] = __ldg(codes + (size_t)rows[r] * words + wd);
    step(wd, c0);
  }
  block_reduce_store<R, T>(acc, out, ldo, row0, N);
}

// The same GEMV with every load of U steps issued before any arithmetic: codes, scales (and
// mins) and activations of all U steps are in flight together (the loop over K runs in chunks
// of U steps; steps past the end of K load zeros, which add nothing).
template <int T, int R, bool MINS, int U>
__global__ void __launch_bounds__(128)
gemv_q4p(const float* __restrict__ x, const unsigned int* __restrict__ codes,
         const unsigned short* __restrict__ scales, const unsigned short* __restrict__ mins,
         float* __restrict__ out, int ldo, int N, int K, int group) {
  const int row0 = blockIdx.x * R;
  const int words = K >> 3;
  const int gpr = K / group;
  float acc[R][T];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < T; ++t) acc[r][t] = 0.f;
  int rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) rows[r] = min(row0 + r, N - 1);
  const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);

  for (int base = threadIdx.x; base < words; base += 128 * U) {
    unsigned int c[U][R];
    unsigned short sc[U][R], mn[U][R];
    float4 xa[U][T], xb[U][T];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int wd = base + 128 * u;
      const bool ok = wd < words;
#pragma unroll
      for (int r = 0; r < R; ++r) c[u][r] = ok ? __ldg(codes + (size_t)rows[r] * words + wd) : 0u;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int wd = base + 128 * u;
      const bool ok = wd < words;
      const int grp = ok ? (wd * 8) / group : 0;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        sc[u][r] = ok ? __ldg(scales + (size_t)rows[r] * gpr + grp) : (unsigned short)0;
        mn[u][r] = (MINS && ok) ? __ldg(mins + (size_t)rows[r] * gpr + grp) : (unsigned short)0;
      }
#pragma unroll
      for (int t = 0; t < T; ++t) {
        const float4* xp = reinterpret_cast<const float4*>(x + (size_t)t * K + wd * 8);
        xa[u][t] = ok ? __ldg(xp) : zero4;
        xb[u][t] = ok ? __ldg(xp + 1) : zero4;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float xv[T][8], X[T];
#pragma unroll
      for (int t = 0; t < T; ++t) {
        const float4 a = xa[u][t], b = xb[u][t];
        xv[t][0] = a.x; xv[t][1] = a.y; xv[t][2] = a.z; xv[t][3] = a.w;
        xv[t][4] = b.x; xv[t][5] = b.y; xv[t][6] = b.z; xv[t][7] = b.w;
        X[t] = ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w));
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const unsigned int cw = c[u][r];
        float F[T];
#pragma unroll
        for (int t = 0; t < T; ++t) F[t] = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const unsigned int sh = (i * 4 <= 19) ? (cw << (19 - i * 4)) : (cw >> (i * 4 - 19));
          const float f = __int_as_float((sh & 0x00780000u) | 0x3F800000u);
#pragma unroll
          for (int t = 0; t < T; ++t) F[t] = fmaf(f, xv[t][i], F[t]);
        }
        const float s16 = 16.f * h2f(sc[u][r]);
        const float cx = MINS ? (h2f(mn[u][r]) - s16) : (-1.5f * s16);
#pragma unroll
        for (int t = 0; t < T; ++t) acc[r][t] += s16 * F[t] + cx * X[t];
      }
    }
  }
  block_reduce_store<R, T>(acc, out, ldo, row0, N);
}

// int8 codes: 8 elements = one 8-byte vector per lane per row.
template <int T, int R>
__global__ void __launch_bounds__(128)
gemv_q8(const float* __restrict__ x, const uint2* __restrict__ codes,
        const unsigned short* __restrict__ scales, float* __restrict__ out, int ldo, int N,
        int K, int group) {
  const int row0 = blockIdx.x * R;
  const int words = K >> 3;
  const int gpr = K / group;
  float acc[R][T];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < T; ++t) acc[r][t] = 0.f;
  int rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) rows[r] = min(row0 + r, N - 1);

  auto step = [&](int wd, const uint2 (&c)[R]) {
    const int k = wd * 8;
    float xv[T][8], X[T];
    load_x8<T>(x, K, k, xv, X);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float s = h2f(__ldg(scales + (size_t)rows[r] * gpr + k / group));
      float F[T];
#pragma unroll
      for (int t = 0; t < T; ++t) F[t] = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const unsigned int cw = i < 4 ? c[r].x : c[r].y;
        const float f = (float)(signed char)(cw >> (8 * (i & 3)));
#pragma unroll
        for (int t = 0; t < T; ++t) F[t] = fmaf(f, xv[t][i], F[t]);
      }
#pragma unroll
      for (int t = 0; t < T; ++t) acc[r][t] = fmaf(s, F[t], acc[r][t]);
    }
  };

  int wd = threadIdx.x;
  for (; wd + 128 < words; wd += 256) {
    uint2 c0[R], c1[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      c0[r] = __ldg(codes + (size_t)rows[r] * words + wd);
      c1[r] = __ldg(codes + (size_t)rows[r] * words + wd + 128);
    }
    step(wd, c0);
    step(wd + 128, c1);
  }
  if (wd < words) {
    uint2 c0[R];
#pragma unroll
    for (int r = 0; r < R; ++r) c0[r] = __ldg(codes + (size_t)rows[r] * words + wd);
    step(wd, c0);
  }
  block_reduce_store<R, T>(acc, out, ldo, row0, N);
}

// ---------------------------------------------------------------------------------------------
// Dequantization into an fp16 (N, K) scratch matrix (prefill GEMM operand). One thread per
// code byte (q4: two elements) or per element (q8); the value is computed in float32 exactly as
// quant.dequantize does, then rounded to fp16.

extern "C" __global__ void dequant_q4_f16(const unsigned char* __restrict__ codes,
                                          const unsigned short* __restrict__ scales,
                                          const unsigned short* __restrict__ mins,
                                          unsigned int* __restrict__ out, long long nbytes,
                                          int K, int group) {
  const int half_k = K >> 1;
  const int gpr = K / group;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < nbytes;
       i += (long long)gridDim.x * blockDim.x) {
    const long long row = i / half_k;
    const int k = (int)(i - row * half_k) * 2;
    const int g = k / group;
    const float s = h2f(scales[row * gpr + g]);
    const unsigned int b = codes[i];
    float lo, hi;
    if (mins != nullptr) {
      const float m = h2f(mins[row * gpr + g]);
      lo = s * (float)(b & 15u) + m;
      hi = s * (float)(b >> 4) + m;
    } else {
      lo = s * ((float)(b & 15u) - 8.f);
      hi = s * ((float)(b >> 4) - 8.f);
    }
    out[i] = (unsigned int)f2h(lo) | ((unsigned int)f2h(hi) << 16);
  }
}

extern "C" __global__ void dequant_q8_f16(const signed char* __restrict__ codes,
                                          const unsigned short* __restrict__ scales,
                                          unsigned short* __restrict__ out, long long n, int K,
                                          int group) {
  const int gpr = K / group;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const long long row = i / K;
    const int k = (int)(i - row * K);
    out[i] = f2h(h2f(scales[row * gpr + k / group]) * (float)codes[i]);
  }
}

// float32 activations -> fp16 (prefill GEMM operand).
extern "C" __global__ void f32_to_f16(const float* __restrict__ x, unsigned short* __restrict__ y,
                                      long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    y[i] = f2h(x[i]);
}
