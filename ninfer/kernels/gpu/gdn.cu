// Gated DeltaNet ops (Qwen3.5 / Qwen3-Next linear-attention layers) and the gated-attention
// output gate: causal depthwise conv1d with carried per-slot state, L2 norm, gdn gates, the
// gated delta rule (sequential over each sequence's tokens, one block per (sequence, value
// head), each thread owning one state column in registers), gated RMSNorm and sigmoid_mul.
// Semantics are those of the NumPy reference ninfer/kernels/gdn.py and activation.sigmoid_mul;
// a slot < 0 (NO_SLOT) reads zero state and writes none.
// Head-shaped inputs are (T, R, d) with (R, d) contiguous and a row stride ld (elements)
// between tokens. (common.cuh is prepended by the Python loader.)

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
// The GDN gates' pieces (gdn_gates, gdn_step, gdn_verify): softplus with torch's threshold 20,
// and beta = sigmoid(b).
__device__ __forceinline__ float softplus20(float x) {
  return x > 20.f ? x : log1pf(expf(fminf(x, 20.f)));
}
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

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
    g[e] = -expf(A_log[h]) * softplus20(a[(size_t)t * lda + h] + dt_bias[h]);
    beta[e] = sigmoid_f(b[(size_t)t * ldb + h]);
  }
}

// x * sigmoid(gate) = x / (1 + exp(-gate)) over (T, N) rows; column c of the gate is element
// c % gd of its head c / gd (heads ghs apart, rows ldg: a head-strided view, read in place).
extern "C" __global__ void sigmoid_mul(const float* __restrict__ x, int ldx,
                                       const float* __restrict__ gate, int ldg, int ghs, int gd,
                                       float* __restrict__ y, int T, int N) {
  pdl_trigger();
  pdl_wait();  // launched with PDL (gpu/launch.py): x and gate come from earlier kernels
  const long long n = (long long)T * N;
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n;
       e += (long long)gridDim.x * blockDim.x) {
    const int t = (int)(e / N), c = (int)(e % N);
    const float g = gate[(size_t)t * ldg + (size_t)(c / gd) * ghs + c % gd];
    y[e] = x[(size_t)t * ldx + c] / (1.0f + expf(-g));
  }
}

// A token's record (gdn.py record_width): its deltas (Hv, dv), its k (Hk, dk), its decays
// (Hv); a verify pass writes them instead of moving the pool's state, and spec_commit advances
// each slot by the tokens it keeps. Row (s, i) of records (S, L, W).
__device__ __forceinline__ float* record_row(float* records, int s, int L, int i, int Hk, int Hv,
                                             int dk, int dv) {
  return records + ((size_t)s * L + i) * ((size_t)Hv * dv + Hk * dk + Hv);
}

// Gated delta rule, sequential over each sequence's tokens. Grid (Hv, S); 256 >= blockDim >= dv
// (a multiple of 32); thread j owns state column S[:, j] (dk <= DK values in registers).
// Per token (value head h, key head h / (Hv / Hk)):
//   S = exp(g) S; u = beta (v - S^T k); S += k u^T; o = S^T (scale q).
// records (optional, (S, L, W), record_row): each token's record; the pool is then left as it
// was.
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
      if (records) record_row(records, s, L, t - a, Hk, Hv, dk, dv)[h * dv + j] = delta;
    }
    if (records) {   // the key head's k (its first value head's block), the decay
      float* rec = record_row(records, s, L, t - a, Hk, Hv, dk, dv) + Hv * dv;
      if (h % (Hv / Hk) == 0)
        for (int i = j; i < dk; i += blockDim.x) rec[hk * dk + i] = ks[i];
      if (j == 0) rec[Hk * dk + h] = decay;
    }
  }
  if (st && own && !records) {
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

// The GDN mixer after the input projection for sequences of a few tokens each (a decode
// step, a speculative verify pass), in two kernels that read and write the conv and recurrent
// state once, each sequence's tokens in turn. p rows (stride ldp): [q k v (C) | z (Hv dv) |
// b (Hv) | a (Hv)], C = 2 Hk dk + Hv dv; sequence s is rows cu[s] .. cu[s + 1] - 1. A slot < 0
// starts from zero state and writes none. records (optional, (S, L, W), record_row): each
// token's record, the recurrent state left in the pool (as gdr_seq's; the conv state moves on).
//
// gdn_qk, grid (Hk, S), 2 dk threads: thread i < dk convolves q channel i of key head hk,
// thread dk + i k channel i (its conv history in registers), then the L2-normalised q (times
// scale) and k of each token go to qk (T, Hk, 2, dk).
// gdn_step, grid (Hv, S, cs), 2 dv threads (a multiple of 32), a thread block cluster of the cs
// blocks of a head when cs > 1: block z owns state columns [z dv / cs, (z + 1) dv / cs), 2 cs
// threads a column, each holding dk / (2 cs) of its rows in registers (see gdn_step below); the
// first of them convolves v channel j; gates, the delta rule and the gated RMSNorm over the
// head's dv outputs follow, per token. Output o (T, Hv dv).
// MIXER_STATE: gdn_qk and gdn_step read a lane's conv and recurrent state (and slots, cu)
// before pdl_wait, overlapping the kernel before them. Those are written only by this layer's
// mixer kernels of an earlier step (another graph replay, or in eager decode hundreds of PDL
// kernels back: they cannot all be resident at once, and each waits for the one before it),
// by the speculative commit of an earlier round, by other sequences' prefill (their own slots)
// or by host copies and plain launches (restores, slot maps), which PDL kernels after them
// never overlap.
constexpr int GDN_KC = 8;   // conv kernel widths up to this (gdn.py gdn_step_applies)
constexpr int GDN_STEP_DK = 128;   // key head dims gdn_step takes, up to this
constexpr int GDN_STEP_DV = 256;   // value head dims gdn_step takes, up to this

// The conv history of channel c (Kc - 1 inputs, oldest first) from its slot, or zeros.
__device__ __forceinline__ void conv_load(float (&hist)[GDN_KC], const float* __restrict__ cstate,
                                          int slot, int c, int C, int Kc) {
  const float* st = slot >= 0 ? cstate + (size_t)slot * (Kc - 1) * C + c : nullptr;
#pragma unroll
  for (int i = 0; i < GDN_KC; ++i) hist[i] = (st && i < Kc - 1) ? st[(size_t)i * C] : 0.f;
}

__device__ __forceinline__ void conv_store(const float (&hist)[GDN_KC], float* __restrict__ cstate,
                                           int slot, int c, int C, int Kc) {
  if (slot < 0) return;
  float* st = cstate + (size_t)slot * (Kc - 1) * C + c;
#pragma unroll
  for (int i = 0; i < GDN_KC; ++i)
    if (i < Kc - 1) st[(size_t)i * C] = hist[i];
}

// silu of input x convolved with the history (kernel row w, Kc taps); x joins the history.
__device__ __forceinline__ float conv_push(float (&hist)[GDN_KC], float x,
                                           const float* __restrict__ w, int Kc) {
  float acc = x * w[Kc - 1];
#pragma unroll
  for (int i = 0; i < GDN_KC; ++i)
    if (i < Kc - 1) acc = fmaf(hist[i], w[i], acc);
#pragma unroll
  for (int i = 0; i < GDN_KC - 1; ++i)
    if (i < Kc - 2) hist[i] = hist[i + 1];
#pragma unroll
  for (int i = 0; i < GDN_KC; ++i)
    if (i == Kc - 2) hist[i] = x;
  return silu_f(acc);
}

extern "C" __global__ void __launch_bounds__(256)
gdn_qk(const float* __restrict__ p, int ldp, const float* __restrict__ cw,
       float* __restrict__ cstate, const int* __restrict__ cu, const int* __restrict__ slots,
       float* __restrict__ qk, int Hk, int Hv, int dk, int dv, int Kc, float scale) {
  __shared__ float sq[256];
  pdl_trigger();  // gdn_step may start; it waits for this kernel before it reads qk
  const int hk = blockIdx.x, s = blockIdx.y, tid = threadIdx.x;
  const int kd = Hk * dk, C = 2 * kd + Hv * dv;
  const bool is_k = tid >= dk;
  const int i = is_k ? tid - dk : tid, c = (is_k ? kd : 0) + hk * dk + i;
  float hist[GDN_KC];
  conv_load(hist, cstate, slots[s], c, C, Kc);   // (before pdl_wait: see MIXER_STATE)
  pdl_wait();     // launched with PDL: p comes from the input projection
  // a head's sum of squares: per warp, then the warps' in order where whole warps hold q or k
  // (dk a multiple of 32), else one thread's serial sum
  const bool by_warp = dk % 32 == 0;
  const int wpr = dk / 32, w0 = is_k ? wpr : 0;   // warps a row, the first of this one's
  for (int t = cu[s]; t < cu[s + 1]; ++t) {
    const float y = conv_push(hist, p[(size_t)t * ldp + c], cw + (size_t)c * Kc, Kc);
    if (by_warp) {
      const float ws = warp_sum(y * y);
      if ((tid & 31) == 0) sq[tid >> 5] = ws;
    } else {
      sq[tid] = y * y;
    }
    __syncthreads();
    float tot = 0.f;
    if (by_warp)
      for (int w = 0; w < wpr; ++w) tot += sq[w0 + w];
    else
      for (int w = 0; w < dk; ++w) tot += sq[(is_k ? dk : 0) + w];
    qk[(((size_t)t * Hk + hk) * 2 + is_k) * dk + i] = y / sqrtf(tot + 1e-6f) * (is_k ? 1.f : scale);
    __syncthreads();   // (sq is the next token's)
  }
  conv_store(hist, cstate, slots[s], c, C, Kc);
}

// One thread's inputs of token t to gdn_step: q and k of row tid (< dk), its v channel's input,
// the head's a and b, its column's z.
struct StepIn {
  float q, k, v, a, b, z;
};
__device__ __forceinline__ StepIn step_inputs(const float* __restrict__ p, int ldp,
                                              const float* __restrict__ qk, int t, int Hk,
                                              int hk, int dk, int cv, int ia, int ib, int iz) {
  const float* pr = p + (size_t)t * ldp;
  const float* qkr = qk + ((size_t)t * Hk + hk) * 2 * dk;
  const int tid = threadIdx.x;
  return StepIn{tid < dk ? qkr[tid] : 0.f, tid < dk ? qkr[dk + tid] : 0.f, pr[cv], pr[ia], pr[ib],
                pr[iz]};
}

// The fused decode / verify step of one (sequence, value head): gridDim.z blocks (a thread
// block cluster along z when more than one) each own cols = dv / gridDim.z state columns;
// thread t takes column t % cols (consecutive threads, consecutive columns: whole sectors of
// each state row) and rows [part rows, (part + 1) rows) of it, part = t / cols, R = 2 gridDim.z
// parts of rows = dk / R (at most RPT, in registers), so a step keeps every multiprocessor
// streaming state even at batch 1. The parts' dot products meet in shared memory (added in part
// order); the gated RMSNorm's sum of squares over the head's dv outputs is added per block, then
// across the cluster through distributed shared memory (every block adds the partials in rank
// order: the same float in each).
template <int RPT, bool EXACT, int DK = 0, int DV = 0, int CS = 0>
__device__ __forceinline__ void gdn_step(const float* __restrict__ p, int ldp,
                                         const float* __restrict__ cw, float* __restrict__ cstate,
                                         const float* __restrict__ qk,
                                         const float* __restrict__ A_log,
                                         const float* __restrict__ dt_bias,
                                         const float* __restrict__ nw, float* __restrict__ state,
                                         const int* __restrict__ cu, const int* __restrict__ slots,
                                         float* __restrict__ o, float* __restrict__ records, int L,
                                         int Hk, int Hv, int dk, int dv, int Kc, float eps) {
  __shared__ float qs[GDN_STEP_DK], ks[GDN_STEP_DK], vs[GDN_STEP_DV], part_sum[2 * GDN_STEP_DV];
  __shared__ float red[16], cred[2];
  // DK, DV, CS when set: the head dims and the split fixed at compile time (EXACT, RPT = DK /
  // (2 CS)), so the part, warp and rank loops unroll and the state's strides are constants
  if constexpr (DK > 0) dk = DK;
  if constexpr (DV > 0) dv = DV;
  const int h = blockIdx.x, s = blockIdx.y, tid = threadIdx.x;
  const int cs = CS > 0 ? CS : (int)gridDim.z, R = 2 * cs;
  const int nwarps = DV > 0 ? 2 * DV / 32 : (int)(blockDim.x >> 5);
  const int cols = dv / cs, jl = tid % cols, part = tid / cols, hk = h / (Hv / Hk);
  const int j = blockIdx.z * cols + jl;
  pdl_trigger();  // the output projection may start loading its weights
  const float alog = expf(A_log[h]), dtb = dt_bias[h];   // weights: before pdl_wait
  // the states too (MIXER_STATE): their loads overlap gdn_qk
  const int C = 2 * Hk * dk + Hv * dv, slot = slots[s], cv = 2 * Hk * dk + h * dv + j;
  const int boff = C + Hv * dv, aoff = boff + Hv, a = cu[s];
  const int rows = dk / R, r0 = part * rows;   // this thread's rows r0 .. r0 + rows of column j
  float* st = slot >= 0 ? state + ((size_t)slot * Hv + h) * dk * dv + (size_t)r0 * dv + j : nullptr;
  float col[RPT];
#pragma unroll
  for (int i = 0; i < RPT; ++i) col[i] = (st && (EXACT || i < rows)) ? st[(size_t)i * dv] : 0.f;
  float hist[GDN_KC];
  if (!part) conv_load(hist, cstate, slot, cv, C, Kc);
  pdl_wait();     // launched with PDL: p and qk come from earlier kernels
  int par = 0;   // cred half this token's partial goes to (a peer may still read the other)
  const int end = cu[s + 1], zoff = C + h * dv + j;
  // this thread's inputs of a token, loaded one token ahead: the next token's are in flight
  // while this one's chain of barriers runs (a verify pass's tokens wait on no L2 round trip)
  StepIn in{};
  if (a < end) in = step_inputs(p, ldp, qk, a, Hk, hk, dk, cv, aoff + h, boff + h, zoff);
  for (int t = a; t < end; ++t) {
    const StepIn cur = in;
    __syncthreads();   // (qs, ks, vs, part_sum and red of the token before are read)
    if (tid < dk) {
      qs[tid] = cur.q;
      ks[tid] = cur.k;
    }
    const float* qkr = qk + ((size_t)t * Hk + hk) * 2 * dk;
    for (int i = tid + blockDim.x; i < dk; i += blockDim.x) {   // (dk above 2 dv threads)
      qs[i] = qkr[i];
      ks[i] = qkr[dk + i];
    }
    if (!part) vs[jl] = conv_push(hist, cur.v, cw + (size_t)cv * Kc, Kc);
    const float decay = expf(-alog * softplus20(cur.a + dtb));
    const float beta = sigmoid_f(cur.b);
    if (t + 1 < end) in = step_inputs(p, ldp, qk, t + 1, Hk, hk, dk, cv, aoff + h, boff + h, zoff);
    __syncthreads();
    float kv = 0.f;
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      col[i] *= decay;
      kv = fmaf(col[i], EXACT || i < rows ? ks[r0 + i] : 0.f, kv);
    }
    part_sum[tid] = kv;
    __syncthreads();
    kv = 0.f;
    for (int q = 0; q < R; ++q) kv += part_sum[q * cols + jl];
    const float delta = (vs[jl] - kv) * beta;
    float out = 0.f;
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      if (EXACT || i < rows) {
        col[i] = fmaf(ks[r0 + i], delta, col[i]);
        out = fmaf(col[i], qs[r0 + i], out);
      }
    }
    __syncthreads();   // (every part has read part_sum's dot products)
    part_sum[tid] = out;
    __syncthreads();
    out = 0.f;
    for (int q = 0; q < R; ++q) out += part_sum[q * cols + jl];
    float ss = warp_sum(part ? 0.f : out * out);
    if ((tid & 31) == 0) red[tid >> 5] = ss;
    __syncthreads();
    ss = 0.f;
    for (int w = 0; w < nwarps; ++w) ss += red[w];
    if (cs > 1) {   // the head's sum: every block's partial, in rank order
      if (tid == 0) cred[par] = ss;
      cluster_sync();
      ss = 0.f;
      for (int r = 0; r < cs; ++r) ss += ld_cluster(cluster_map(&cred[par], (unsigned)r));
      par ^= 1;
    }
    if (!part)
      o[(size_t)t * Hv * dv + h * dv + j] = out / sqrtf(ss / (float)dv + eps) * nw[j] * silu_f(cur.z);
    if (records) {   // (after the barrier, whose release would otherwise wait for the stores)
      float* rec = record_row(records, s, L, t - a, Hk, Hv, dk, dv);
      if (!part) rec[h * dv + j] = delta;
      if (blockIdx.z == 0) {   // the key head's k (its first value head's blocks), the decay
        if (h % (Hv / Hk) == 0)
          for (int i = tid; i < dk; i += blockDim.x) rec[Hv * dv + hk * dk + i] = ks[i];
        if (tid == 0) rec[Hv * dv + Hk * dk + h] = decay;
      }
    }
  }
  if (st && !records) {
#pragma unroll
    for (int i = 0; i < RPT; ++i)
      if (EXACT || i < rows) st[(size_t)i * dv] = col[i];
  }
  if (!part) conv_store(hist, cstate, slot, cv, C, Kc);
  if (cs > 1) cluster_sync();   // no block leaves while a peer may still read its cred
}
// The mixer's second kernel NAME (launch bound BOUND threads): the device function after them
// (gdn_step or gdn_verify, with its template arguments) over gdn.py's launch arguments.
#define GDN_MIXER(NAME, BOUND, ...)                                                            \
  extern "C" __global__ void __launch_bounds__(BOUND) NAME(                                    \
      const float* __restrict__ p, int ldp, const float* __restrict__ cw,                      \
      float* __restrict__ cstate, const float* __restrict__ qk,                                \
      const float* __restrict__ A_log, const float* __restrict__ dt_bias,                      \
      const float* __restrict__ nw, float* __restrict__ state, const int* __restrict__ cu,     \
      const int* __restrict__ slots, float* __restrict__ o, float* __restrict__ records, int L, \
      int Hk, int Hv, int dk, int dv, int Kc, float eps) {                                     \
    __VA_ARGS__(p, ldp, cw, cstate, qk, A_log, dt_bias, nw, state, cu, slots, o, records, L,   \
                Hk, Hv, dk, dv, Kc, eps);                                                      \
  }
// gdn_step_r<RPT>: up to RPT state rows a thread; gdn_step_x<RPT>: exactly RPT (dk = 2 cs RPT),
// whose row loops carry no bounds checks (each check was a compare and a branch a row).
#define GDN_STEP(NAME, ...) GDN_MIXER(NAME, 512, gdn_step<__VA_ARGS__>)
GDN_STEP(gdn_step_r4, 4, false)
GDN_STEP(gdn_step_r8, 8, false)
GDN_STEP(gdn_step_r16, 16, false)
GDN_STEP(gdn_step_r32, 32, false)
GDN_STEP(gdn_step_r64, 64, false)
GDN_STEP(gdn_step_x4, 4, true)
GDN_STEP(gdn_step_x8, 8, true)
GDN_STEP(gdn_step_x16, 16, true)
GDN_STEP(gdn_step_x32, 32, true)   // (x64 spills: 64 rows take the checked loops)
// gdn_step_h128_c<CS>: dk = dv = 128 (Qwen3.5 / Qwen3-Next) split over CS blocks a head (at
// one split, 64 rows a thread spill: the checked r64 runs)
GDN_STEP(gdn_step_h128_c2, 32, true, 128, 128, 2)
GDN_STEP(gdn_step_h128_c4, 16, true, 128, 128, 4)

// The fused verify step: gdn_step's math for a sequence's tokens LM at a time in the chunked
// (WY) form, so a chunk costs one round of partial sums and one cluster exchange instead of
// those of each token. With S0 the state before the chunk, G_t the decay through token t and
// D(t, i) the decays of tokens i + 1 .. t, a column's k_t . S0 and q_t . S0 (one reduction for
// all t) and the chunk's Gram products give, token after token in registers,
//   delta_t = beta_t (v_t - G_t k_t.S0 - sum_{i<t} D(t, i) (k_t.k_i) delta_i)
//   out_t   = G_t q_t.S0 + sum_{i<=t} D(t, i) (q_t.k_i) delta_i
// and the state is then decay_t S + k_t delta_t, as gdn_step makes it (with records: each
// token's delta, k and decay go to its record and the pool keeps its state).
// dk = dv = DK, CS blocks a value head (a cluster), 2 DV threads; arguments as gdn_step's.
template <int LM, int DK, int CS>
__device__ __forceinline__ void gdn_verify(const float* __restrict__ p, int ldp,
                                           const float* __restrict__ cw,
                                           float* __restrict__ cstate,
                                           const float* __restrict__ qk,
                                           const float* __restrict__ A_log,
                                           const float* __restrict__ dt_bias,
                                           const float* __restrict__ nw,
                                           float* __restrict__ state, const int* __restrict__ cu,
                                           const int* __restrict__ slots, float* __restrict__ o,
                                           float* __restrict__ records, int L, int Hk, int Hv,
                                           int, int, int Kc, float eps) {   // (dk = dv = DK)
  constexpr int DV = DK, R = 2 * CS, COLS = DV / CS, RPT = DK / R, NT = 2 * DV, NW = NT / 32;
  static_assert(COLS % 32 == 0 && DK <= NT, "whole warps a part, one thread a q / k row");
  __shared__ float qs[LM][DK], ks[LM][DK], vs[LM][COLS], pa[LM][NT], pb[LM][NT];
  __shared__ float gkk[LM][LM], gqk[LM][LM], red[LM][NW], cred[2][LM];
  const int h = blockIdx.x, s = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int jl = tid % COLS, part = tid / COLS, hk = h / (Hv / Hk), j = blockIdx.z * COLS + jl;
  pdl_trigger();  // the output projection may start loading its weights
  const float alog = expf(A_log[h]), dtb = dt_bias[h];
  const int C = 2 * Hk * DK + Hv * DV, slot = slots[s], cv = 2 * Hk * DK + h * DV + j;
  const int boff = C + Hv * DV, aoff = boff + Hv, zoff = C + h * DV + j, r0 = part * RPT;
  float* st = slot >= 0 ? state + ((size_t)slot * Hv + h) * DK * DV + (size_t)r0 * DV + j : nullptr;
  float col[RPT];
#pragma unroll
  for (int i = 0; i < RPT; ++i) col[i] = st ? st[(size_t)i * DV] : 0.f;
  float hist[GDN_KC];
  if (!part) conv_load(hist, cstate, slot, cv, C, Kc);
  pdl_wait();     // launched with PDL: p and qk come from earlier kernels
  const int a = cu[s], end = cu[s + 1];
  int par = 0;   // cred half this chunk's sums go to (a peer may still read the other)
  for (int c0 = a; c0 < end; c0 += LM) {
    const int n = min(LM, end - c0);
    float v[LM], z[LM], decay[LM], beta[LM], delta[LM], out[LM];
    __syncthreads();   // (the chunk before is done with the shared arrays)
#pragma unroll
    for (int t = 0; t < LM; ++t) {   // every load issued before any is used
      if (t >= n) break;
      const float* pr = p + (size_t)(c0 + t) * ldp;
      const float* qkr = qk + ((size_t)(c0 + t) * Hk + hk) * 2 * DK;
      if (tid < DK) {
        qs[t][tid] = qkr[tid];
        ks[t][tid] = qkr[DK + tid];
      }
      v[t] = pr[cv];
      z[t] = pr[zoff];
      decay[t] = pr[aoff + h];
      beta[t] = pr[boff + h];
    }
#pragma unroll
    for (int t = 0; t < LM; ++t) {
      if (t >= n) break;
      decay[t] = expf(-alog * softplus20(decay[t] + dtb));
      beta[t] = sigmoid_f(beta[t]);
      if (!part) vs[t][jl] = conv_push(hist, v[t], cw + (size_t)cv * Kc, Kc);
    }
    __syncthreads();
    // this thread's rows' share of k_t . S0 and q_t . S0, and the Gram products (a warp each)
#pragma unroll
    for (int t = 0; t < LM; ++t) {
      if (t >= n) break;
      float ka = 0.f, qb = 0.f;
#pragma unroll
      for (int i = 0; i < RPT; ++i) {
        ka = fmaf(col[i], ks[t][r0 + i], ka);
        qb = fmaf(col[i], qs[t][r0 + i], qb);
      }
      pa[t][tid] = ka;
      pb[t][tid] = qb;
    }
    for (int e = warp; e < 2 * n * n; e += NW) {
      const int m = e / (n * n), t = e / n % n, i = e % n;
      const float* x = m ? qs[t] : ks[t];
      float d = 0.f;
#pragma unroll
      for (int u = lane; u < DK; u += 32) d = fmaf(x[u], ks[i][u], d);
      d = warp_sum(d);
      if (lane == 0) (m ? gqk : gkk)[t][i] = d;
    }
    __syncthreads();
    float g = 1.f;   // G_t
#pragma unroll
    for (int t = 0; t < LM; ++t) {
      if (t >= n) break;
      float ka = 0.f, qb = 0.f;
      for (int q = 0; q < R; ++q) {
        ka += pa[t][q * COLS + jl];
        qb += pb[t][q * COLS + jl];
      }
      g *= decay[t];
      float kv = g * ka, ot = g * qb, dd = 1.f;
#pragma unroll
      for (int i = t - 1; i >= 0; --i) {
        dd *= decay[i + 1];
        kv = fmaf(dd * gkk[t][i], delta[i], kv);
      }
      delta[t] = (vs[t][jl] - kv) * beta[t];
      ot = fmaf(gqk[t][t], delta[t], ot);
      dd = 1.f;
#pragma unroll
      for (int i = t - 1; i >= 0; --i) {
        dd *= decay[i + 1];
        ot = fmaf(dd * gqk[t][i], delta[i], ot);
      }
      out[t] = ot;
      const float ss = warp_sum(part ? 0.f : ot * ot);
      if (lane == 0) red[t][warp] = ss;
    }
    __syncthreads();
    float ss[LM];
#pragma unroll
    for (int t = 0; t < LM; ++t) {
      ss[t] = 0.f;
      for (int w = 0; w < NW; ++w) ss[t] += red[t][w];
    }
    if constexpr (CS > 1) {   // the head's sums: every block's partials, in rank order
      if (tid == 0) {
#pragma unroll
        for (int t = 0; t < LM; ++t) cred[par][t] = ss[t];
      }
      cluster_sync();
#pragma unroll
      for (int t = 0; t < LM; ++t) {
        if (t >= n) break;
        ss[t] = 0.f;
        for (int r = 0; r < CS; ++r) ss[t] += ld_cluster(cluster_map(&cred[par][t], (unsigned)r));
      }
      par ^= 1;
    }
#pragma unroll
    for (int t = 0; t < LM; ++t) {
      if (t >= n) break;
      if (!part)
        o[(size_t)(c0 + t) * Hv * DV + h * DV + j] =
            out[t] / sqrtf(ss[t] / (float)DV + eps) * nw[j] * silu_f(z[t]);
      if (records) {   // the token's record (gdn_step's), the state moves on in registers
        float* rec = record_row(records, s, L, c0 + t - a, Hk, Hv, DK, DV);
        if (!part) rec[h * DV + j] = delta[t];
        if (blockIdx.z == 0) {
          if (h % (Hv / Hk) == 0 && tid < DK) rec[Hv * DV + hk * DK + tid] = ks[t][tid];
          if (tid == 0) rec[Hv * DV + Hk * DK + h] = decay[t];
        }
      }
#pragma unroll
      for (int i = 0; i < RPT; ++i) col[i] = fmaf(ks[t][r0 + i], delta[t], col[i] * decay[t]);
    }
  }
  if (st && !records) {
#pragma unroll
    for (int i = 0; i < RPT; ++i) st[(size_t)i * DV] = col[i];
  }
  if (!part) conv_store(hist, cstate, slot, cv, C, Kc);
  if (CS > 1) cluster_sync();   // no block leaves while a peer may still read its cred
}
// gdn_verify_h128_c<CS>: dk = dv = 128, 4 tokens a chunk (the k = 3 verify pass in one)
GDN_MIXER(gdn_verify_h128_c2, 256, gdn_verify<4, 128, 2>)
GDN_MIXER(gdn_verify_h128_c4, 256, gdn_verify<4, 128, 4>)
