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

// One decode step of a whole GDN mixer (every sequence one token), after the input projection:
// conv1d update + SiLU, L2-normed q / k, gates, the gated delta rule and the gated RMSNorm, the
// conv and recurrent state read and written once. p rows (stride ldp): [q k v (C) | z (Hv dv) |
// b (Hv) | a (Hv)], C = 2 Hk dk + Hv dv. Grid (Hk, S); R dv threads (R = Hv / Hk, dv a multiple
// of 32, 2 dk <= R dv <= GDN_STEP_THREADS): thread (r, j) owns value head h = hk R + r's state
// column j; threads < 2 dk also own the key head's q / k conv channels, so each conv channel and
// state column has one owner. A slot < 0 reads zero state and writes none. Output o (S, Hv dv).
#define GDN_STEP_THREADS 384
template <int DK>
__device__ __forceinline__ void gdn_step(const float* __restrict__ p, int ldp,
                                         const float* __restrict__ cw, float* __restrict__ cstate,
                                         const float* __restrict__ A_log,
                                         const float* __restrict__ dt_bias,
                                         const float* __restrict__ nw, float* __restrict__ state,
                                         const int* __restrict__ slots, float* __restrict__ o,
                                         int Hk, int Hv, int dk, int dv, int Kc, float scale,
                                         float eps) {
  __shared__ float qs[DK], ks[DK], red[2 + GDN_STEP_THREADS / 32];
  const int hk = blockIdx.x, s = blockIdx.y, tid = threadIdx.x;
  const int R = Hv / Hk, r = tid / dv, j = tid % dv, h = hk * R + r;
  const int kd = Hk * dk, C = 2 * kd + Hv * dv;
  const int slot = slots[s];
  const float* pr = p + (size_t)s * ldp;
  // conv of channel c at this token, the channel's state shifted by one input
  auto conv = [&](int c) -> float {
    const float x = pr[c];
    float* st = slot >= 0 ? cstate + (size_t)slot * (Kc - 1) * C + c : nullptr;
    float acc = x * cw[c * Kc + Kc - 1];
    for (int i = 0; i < Kc - 1; ++i) {
      const float u = st ? st[(size_t)i * C] : 0.f;
      acc = fmaf(u, cw[c * Kc + i], acc);
      if (st) st[(size_t)i * C] = i + 1 < Kc - 1 ? st[(size_t)(i + 1) * C] : x;
    }
    return silu_f(acc);
  };
  if (tid < dk) qs[tid] = conv(hk * dk + tid);
  else if (tid < 2 * dk) ks[tid - dk] = conv(kd + hk * dk + tid - dk);
  const float v = conv(2 * kd + h * dv + j);
  __syncthreads();
  if (tid < 64) {   // warp 0: |q|^2, warp 1: |k|^2
    const float* x = tid < 32 ? qs : ks;
    float ss = 0.f;
    for (int i = tid & 31; i < dk; i += 32) ss = fmaf(x[i], x[i], ss);
    ss = warp_sum(ss);
    if ((tid & 31) == 0) red[tid >> 5] = ss;
  }
  __syncthreads();
  const float qn = scale / sqrtf(red[0] + 1e-6f), kn = 1.0f / sqrtf(red[1] + 1e-6f);
  __syncthreads();
  if (tid < dk) qs[tid] *= qn;
  else if (tid < 2 * dk) ks[tid - dk] *= kn;
  __syncthreads();
  const int zoff = C, boff = C + Hv * dv, aoff = boff + Hv;
  const float xa = pr[aoff + h] + dt_bias[h];
  const float sp = xa > 20.f ? xa : log1pf(expf(fminf(xa, 20.f)));
  const float decay = expf(-expf(A_log[h]) * sp);
  const float beta = 1.0f / (1.0f + expf(-pr[boff + h]));
  float* st = slot >= 0 ? state + ((size_t)slot * Hv + h) * dk * dv + j : nullptr;
  float col[DK];
  float kv = 0.f;
#pragma unroll
  for (int i = 0; i < DK; ++i) {
    col[i] = (st && i < dk) ? st[(size_t)i * dv] * decay : 0.f;
    kv = fmaf(col[i], i < dk ? ks[i] : 0.f, kv);
  }
  const float delta = (v - kv) * beta;
  float out = 0.f;
#pragma unroll
  for (int i = 0; i < DK; ++i) {
    if (i < dk) {
      col[i] = fmaf(ks[i], delta, col[i]);
      out = fmaf(col[i], qs[i], out);
      if (st) st[(size_t)i * dv] = col[i];
    }
  }
  // gated RMSNorm over head h's dv outputs (dv / 32 warps)
  float ss = warp_sum(out * out);
  if ((tid & 31) == 0) red[2 + (tid >> 5)] = ss;
  __syncthreads();
  ss = 0.f;
  for (int w = 0; w < dv / 32; ++w) ss += red[2 + r * (dv / 32) + w];
  const float z = pr[zoff + h * dv + j];
  o[(size_t)s * Hv * dv + h * dv + j] = out / sqrtf(ss / (float)dv + eps) * nw[j] * silu_f(z);
}
#define GDN_STEP(DK)                                                                           \
  extern "C" __global__ void __launch_bounds__(GDN_STEP_THREADS) gdn_step_##DK(               \
      const float* __restrict__ p, int ldp, const float* __restrict__ cw,                      \
      float* __restrict__ cstate, const float* __restrict__ A_log,                             \
      const float* __restrict__ dt_bias, const float* __restrict__ nw,                         \
      float* __restrict__ state, const int* __restrict__ slots, float* __restrict__ o, int Hk, \
      int Hv, int dk, int dv, int Kc, float scale, float eps) {                                \
    gdn_step<DK>(p, ldp, cw, cstate, A_log, dt_bias, nw, state, slots, o, Hk, Hv, dk, dv, Kc,  \
                 scale, eps);                                                                  \
  }
GDN_STEP(32)
GDN_STEP(64)
GDN_STEP(128)
