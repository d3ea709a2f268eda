// Gated DeltaNet ops (Qwen3.5 / Qwen3-Next linear-attention layers) and the gated-attention
// output gate: causal depthwise conv1d with carried per-slot state, L2 norm, gdn gates, the
// gated delta rule (sequential over each sequence's tokens, one block per (sequence, value
// head), each thread owning one state column in registers), gated RMSNorm and sigmoid_mul.
// Semantics are those of the NumPy reference ninfer/kernels/gdn.py and activation.sigmoid_mul;
// a slot < 0 (NO_SLOT) reads zero state and writes none.
// Head-shaped inputs are (T, R, d) with (R, d) contiguous and a row stride ld (elements)
// between tokens. (common.cuh is prepended by the Python loader.)

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

// Causal conv, one thread per (token, channel). tok_seq[t] = sequence of token t; u(i) is the
// sequence's i-th input (i >= 0: x row cu[s] + i) or, for i < 0, state row Kc - 1 + i.
extern "C" __global__ void conv1d_fwd(const float* __restrict__ x, int ldx,
                                      const float* __restrict__ w, const float* __restrict__ state,
                                      const int* __restrict__ cu, const int* __restrict__ slots,
                                      const int* __restrict__ tok_seq, float* __restrict__ y,
                                      int T, int C, int Kc, int act) {
  const long long n = (long long)T * C;
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n;
       e += (long long)gridDim.x * blockDim.x) {
    const int t = (int)(e / C), c = (int)(e % C);
    const int s = tok_seq[t];
    const int i = t - cu[s];
    const float* st = slots[s] >= 0 ? state + (size_t)slots[s] * (Kc - 1) * C : nullptr;
    float acc = 0.f;
    for (int j = 0; j < Kc; ++j) {
      const int src = i - (Kc - 1) + j;
      const float u = src >= 0 ? x[(size_t)(cu[s] + src) * ldx + c]
                               : (st ? st[(size_t)(Kc - 1 + src) * C + c] : 0.f);
      acc = j == 0 ? u * w[c * Kc] : fmaf(u, w[c * Kc + j], acc);
    }
    y[(size_t)t * C + c] = act ? silu_f(acc) : acc;
  }
}

// New conv state after the pass (launched after conv1d_fwd): one thread per (sequence,
// channel); rows in increasing order, so row r reads old row r + len before it is overwritten.
extern "C" __global__ void conv1d_state(const float* __restrict__ x, int ldx,
                                        float* __restrict__ state, const int* __restrict__ cu,
                                        const int* __restrict__ slots, int S, int C, int Kc) {
  const long long n = (long long)S * C;
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n;
       e += (long long)gridDim.x * blockDim.x) {
    const int s = (int)(e / C), c = (int)(e % C);
    const int len = cu[s + 1] - cu[s];
    if (slots[s] < 0) continue;
    float* st = state + (size_t)slots[s] * (Kc - 1) * C;
    for (int r = 0; r < Kc - 1; ++r) {
      const int src = len - (Kc - 1) + r;
      st[(size_t)r * C + c] = src >= 0 ? x[(size_t)(cu[s] + src) * ldx + c]
                                       : st[(size_t)(Kc - 1 + src) * C + c];
    }
  }
}

// One warp per row of d elements: mode 0 = l2 norm x / sqrt(sum x^2 + eps);
// mode 1 = gated RMSNorm x / sqrt(sum x^2 / d + eps) * w * silu(z).
extern "C" __global__ void __launch_bounds__(256)
row_norm(const float* __restrict__ x, int ldx, const float* __restrict__ z, int ldz,
         const float* __restrict__ w, float* __restrict__ y, int rows, int R, int d, float eps,
         int mode) {
  const int row = blockIdx.x * 8 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const int t = row / R, r = row % R;
  const float* xr = x + (size_t)t * ldx + (size_t)r * d;
  float ss = 0.f;
  for (int i = lane; i < d; i += 32) ss = fmaf(xr[i], xr[i], ss);
  ss = warp_sum(ss);
  float* yr = y + (size_t)row * d;
  if (mode == 0) {
    const float den = sqrtf(ss + eps);
    for (int i = lane; i < d; i += 32) yr[i] = xr[i] / den;
  } else {
    const float den = sqrtf(ss * (1.0f / (float)d) + eps);
    const float* zr = z + (size_t)t * ldz + (size_t)r * d;
    for (int i = lane; i < d; i += 32) yr[i] = (xr[i] / den) * w[i] * silu_f(zr[i]);
  }
}

// g = -exp(A_log) * softplus(a + dt_bias) (threshold 20), beta = sigmoid(b); (T, H) rows.
extern "C" __global__ void gdn_gates(const float* __restrict__ a, int lda,
                                     const float* __restrict__ b, int ldb,
                                     const float* __restrict__ A_log,
                                     const float* __restrict__ dt_bias, float* __restrict__ g,
                                     float* __restrict__ beta, int T, int H) {
  const int n = T * H;
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x) {
    const int t = e / H, h = e % H;
    const float xa = a[(size_t)t * lda + h] + dt_bias[h];
    const float sp = xa > 20.f ? xa : log1pf(expf(fminf(xa, 20.f)));
    g[e] = -expf(A_log[h]) * sp;
    beta[e] = 1.0f / (1.0f + expf(-b[(size_t)t * ldb + h]));
  }
}

// x * sigmoid(gate) = x / (1 + exp(-gate)) over (T, N) rows.
extern "C" __global__ void sigmoid_mul(const float* __restrict__ x, int ldx,
                                       const float* __restrict__ gate, int ldg,
                                       float* __restrict__ y, int T, int N) {
  const long long n = (long long)T * N;
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n;
       e += (long long)gridDim.x * blockDim.x) {
    const int t = (int)(e / N), c = (int)(e % N);
    y[e] = x[(size_t)t * ldx + c] / (1.0f + expf(-gate[(size_t)t * ldg + c]));
  }
}

// Gated delta rule, sequential over each sequence's tokens. Grid (Hv, S); 256 >= blockDim >= dv
// (a multiple of 32); thread j owns state column S[:, j] (dk <= DK values in registers).
// Per token (value head h, key head h / (Hv / Hk)):
//   S = exp(g) S; u = beta (v - S^T k); S += k u^T; o = S^T (scale q).
// records (optional, (S, L, Hv, dk, dv)): the state after each token of the sequence.
template <int DK>
__device__ __forceinline__ void gdr_seq(const float* __restrict__ q, int ldq,
                                        const float* __restrict__ k, int ldk,
                                        const float* __restrict__ v, int ldv,
                                        const float* __restrict__ g, int ldg,
                                        const float* __restrict__ beta, int ldb,
                                        float* __restrict__ state, const int* __restrict__ cu,
                                        const int* __restrict__ slots, float* __restrict__ o,
                                        float* __restrict__ records, int L, int Hk, int Hv,
                                        int dk, int dv, float scale) {
  __shared__ float qs[DK], ks[DK];
  const int h = blockIdx.x, s = blockIdx.y, j = threadIdx.x;
  const int hk = h / (Hv / Hk);
  const bool own = j < dv;
  float* st = slots[s] >= 0 ? state + ((size_t)slots[s] * Hv + h) * dk * dv : nullptr;
  float col[DK];
#pragma unroll
  for (int i = 0; i < DK; ++i) col[i] = (st && own && i < dk) ? st[(size_t)i * dv + j] : 0.f;
  const int a = cu[s], b = cu[s + 1];
  for (int t = a; t < b; ++t) {
    __syncthreads();
    for (int i = j; i < dk; i += blockDim.x) {
      qs[i] = q[(size_t)t * ldq + (size_t)hk * dk + i] * scale;
      ks[i] = k[(size_t)t * ldk + (size_t)hk * dk + i];
    }
    __syncthreads();
    const float decay = expf(g[(size_t)t * ldg + h]);
    const float bt = beta[(size_t)t * ldb + h];
    float kv = 0.f;
#pragma unroll
    for (int i = 0; i < DK; ++i) {
      if (i < dk) {
        col[i] *= decay;
        kv = fmaf(col[i], ks[i], kv);
      }
    }
    if (own) {
      const float delta = (v[(size_t)t * ldv + (size_t)h * dv + j] - kv) * bt;
      float out = 0.f;
#pragma unroll
      for (int i = 0; i < DK; ++i) {
        if (i < dk) {
          col[i] = fmaf(ks[i], delta, col[i]);
          out = fmaf(col[i], qs[i], out);
        }
      }
      o[((size_t)t * Hv + h) * dv + j] = out;
      if (records) {
        float* rec = records + (((size_t)s * L + (t - a)) * Hv + h) * dk * dv;
#pragma unroll
        for (int i = 0; i < DK; ++i)
          if (i < dk) rec[(size_t)i * dv + j] = col[i];
      }
    }
  }
  if (st && own) {
#pragma unroll
    for (int i = 0; i < DK; ++i)
      if (i < dk) st[(size_t)i * dv + j] = col[i];
  }
}
#define GDR(DK)                                                                                \
  extern "C" __global__ void __launch_bounds__(256) gdr_##DK(                                \
      const float* __restrict__ q, int ldq, const float* __restrict__ k, int ldk,              \
      const float* __restrict__ v, int ldv, const float* __restrict__ g, int ldg,              \
      const float* __restrict__ beta, int ldb, float* __restrict__ state,                      \
      const int* __restrict__ cu, const int* __restrict__ slots, float* __restrict__ o,        \
      float* __restrict__ records, int L, int Hk, int Hv, int dk, int dv, float scale) {       \
    gdr_seq<DK>(q, ldq, k, ldk, v, ldv, g, ldg, beta, ldb, state, cu, slots, o, records, L,    \
                Hk, Hv, dk, dv, scale);                                                        \
  }
GDR(32)
GDR(64)
GDR(128)
GDR(256)
