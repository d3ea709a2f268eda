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
// One warp computes R consecutive output rows; lane l walks the 32-element units
// u = l, l + 32, ... of K, so each load of a row's codes is one 16-byte vector per lane and a
// warp reads 512 contiguous bytes (q4) of a row per step. Each unit lies inside one group
// (group % 32 == 0), so a unit needs one scale (and min).
//
// int4 -> float without an integer-to-float conversion: placing the nibble q in mantissa bits
// 19..22 of 1.0f gives exactly f = 1 + q/16. Then sum_j q_j x_j = 16 (sum_j f_j x_j - sum_j x_j),
// and a unit's contribution is
//   Q4_1: s * sum q x + m * sum x    = 16 s * F + (m - 16 s) * X
//   Q4_0: s * (sum q x - 8 * sum x)  = 16 s * F - 24 s * X
// with F = sum f x, X = sum x over the unit (X is shared by the R rows).

template <int T, int R, bool MINS>
__global__ void __launch_bounds__(128)
gemv_q4(const float* __restrict__ x, const uint4* __restrict__ codes,
        const unsigned short* __restrict__ scales, const unsigned short* __restrict__ mins,
        float* __restrict__ out, int ldo, int N, int K, int group) {
  const int lane = threadIdx.x & 31;
  const int row0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
  if (row0 >= N) return;
  const int units = K >> 5;
  const int gpr = K / group;
  const int upg = group >> 5;
  float acc[R][T];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < T; ++t) acc[r][t] = 0.f;

  for (int u = lane; u < units; u += 32) {
    uint4 c[R];
    float s[R], m[R];
    const int grp = u / upg;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = min(row0 + r, N - 1);
      c[r] = __ldg(codes + (size_t)row * units + u);
      s[r] = h2f(__ldg(scales + (size_t)row * gpr + grp));
      m[r] = MINS ? h2f(__ldg(mins + (size_t)row * gpr + grp)) : 0.f;
    }
    float F[R][T], X[T];
#pragma unroll
    for (int t = 0; t < T; ++t) {
      X[t] = 0.f;
#pragma unroll
      for (int r = 0; r < R; ++r) F[r][t] = 0.f;
    }
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      float xv[T][8];
#pragma unroll
      for (int t = 0; t < T; ++t) {
        const float4* xp = reinterpret_cast<const float4*>(x + (size_t)t * K + u * 32 + w * 8);
        const float4 a = __ldg(xp), b = __ldg(xp + 1);
        xv[t][0] = a.x; xv[t][1] = a.y; xv[t][2] = a.z; xv[t][3] = a.w;
        xv[t][4] = b.x; xv[t][5] = b.y; xv[t][6] = b.z; xv[t][7] = b.w;
#pragma unroll
        for (int i = 0; i < 8; ++i) X[t] += xv[t][i];
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const unsigned int cw = w == 0 ? c[r].x : w == 1 ? c[r].y : w == 2 ? c[r].z : c[r].w;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const unsigned int sh = (i * 4 <= 19) ? (cw << (19 - i * 4)) : (cw >> (i * 4 - 19));
          const float f = __int_as_float((sh & 0x00780000u) | 0x3F800000u);
#pragma unroll
          for (int t = 0; t < T; ++t) F[r][t] = fmaf(f, xv[t][i], F[r][t]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float s16 = 16.f * s[r];
      const float cx = MINS ? (m[r] - s16) : (-24.f * s[r]);
#pragma unroll
      for (int t = 0; t < T; ++t) acc[r][t] += s16 * F[r][t] + cx * X[t];
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const float v = warp_sum(acc[r][t]);
      if (lane == 0 && row0 + r < N) out[(size_t)t * ldo + row0 + r] = v;
    }
}

// int8 codes: a 32-element unit is two 16-byte vectors per row.
template <int T, int R>
__global__ void __launch_bounds__(128)
gemv_q8(const float* __restrict__ x, const uint4* __restrict__ codes,
        const unsigned short* __restrict__ scales, float* __restrict__ out, int ldo, int N,
        int K, int group) {
  const int lane = threadIdx.x & 31;
  const int row0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * R;
  if (row0 >= N) return;
  const int units = K >> 5;
  const int gpr = K / group;
  const int upg = group >> 5;
  float acc[R][T];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < T; ++t) acc[r][t] = 0.f;

  for (int u = lane; u < units; u += 32) {
    uint4 c[R][2];
    float s[R];
    const int grp = u / upg;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = min(row0 + r, N - 1);
      const uint4* p = codes + ((size_t)row * units + u) * 2;
      c[r][0] = __ldg(p);
      c[r][1] = __ldg(p + 1);
      s[r] = h2f(__ldg(scales + (size_t)row * gpr + grp));
    }
    float F[R][T];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < T; ++t) F[r][t] = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      float xv[T][4];
#pragma unroll
      for (int t = 0; t < T; ++t) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(x + (size_t)t * K + u * 32 + w * 4));
        xv[t][0] = a.x; xv[t][1] = a.y; xv[t][2] = a.z; xv[t][3] = a.w;
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint4 v = c[r][w >> 2];
        const unsigned int cw = (w & 3) == 0 ? v.x : (w & 3) == 1 ? v.y : (w & 3) == 2 ? v.z : v.w;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float f = (float)(signed char)(cw >> (8 * i));
#pragma unroll
          for (int t = 0; t < T; ++t) F[r][t] = fmaf(f, xv[t][i], F[r][t]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < T; ++t) acc[r][t] = fmaf(s[r], F[r][t], acc[r][t]);
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const float v = warp_sum(acc[r][t]);
      if (lane == 0 && row0 + r < N) out[(size_t)t * ldo + row0 + r] = v;
    }
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
