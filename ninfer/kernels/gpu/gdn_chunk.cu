// The gated delta rule in chunks of GDN_BT tokens (WY form; the NumPy reference
// ninfer/kernels/gdn.py chunk_gated_delta_rule, after fla's chunk_gated_delta_rule_fwd), for
// prefill: the work inside a chunk is done for all chunks at once, and only the state carry is
// sequential, one chunk (not one token) a step. Per value head h and chunk (local index r,
// gamma_r = sum_{s<=r} g_s, Gamma_rs = exp(gamma_r - gamma_s) for r >= s, else 0):
//
// gdn_chunk_prep, grid (chunks, Hv), 256 threads: A_rs = beta_r (k_r . k_s) Gamma_rs (r > s),
//   P_rs = (scale q_r . k_s) Gamma_rs (r >= s); solves (I + A) [W | U] = [diag(beta e^gamma) K |
//   diag(beta) V] by forward substitution (thread j owns column j, its 64 rows in registers).
//   Writes W^T (DK, BT), U (BT, dv), P^T (BT, BT) and gamma (BT) per (chunk, head).
// gdn_chunk_scan, grid (ceil(dv / GDN_CB), Hv, S), 128 threads: the state columns
//   [j0, j0 + GDN_CB) of head h of sequence s (columns of the state never mix), chunk by chunk:
//   V' = U - W S; O = diag(scale e^gamma) Q S + P V'; S = e^gamma_C S + (diag(e^(gamma_C -
//   gamma)) K)^T V'. The small products are register-tiled in float32 (4 x 4 outputs a thread).
//
// Chunks start at each sequence's first token; padding rows past a short last chunk are zero
// (g = beta = 0), as in the reference. Every product accumulates in float32. A slot < 0 starts
// from zero state and writes none. chunks: int32 [start (nch) | length (nch)]; seq_c0: (S + 1)
// first chunk of each sequence. (common.cuh is prepended by the Python loader.)

constexpr int GDN_BT = 64;    // tokens a chunk (the reference's CHUNK_SIZE)
constexpr int GDN_CB = 32;    // state columns a scan block
constexpr int GDN_LT = GDN_BT + 4;   // row length of transposed (d, BT) tiles: float4-aligned

__device__ __forceinline__ float4 ld4(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ void st4(float* p, float a, float b, float c, float d) {
  *reinterpret_cast<float4*>(p) = make_float4(a, b, c, d);
}

// acc[x][y] += a[x] b[y] (sub: -=).
template <int RA, bool SUB = false>
__device__ __forceinline__ void outer4(float (&acc)[RA][4], const float (&a)[RA], float4 b) {
  const float bb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
  for (int x = 0; x < RA; ++x)
#pragma unroll
    for (int y = 0; y < 4; ++y) acc[x][y] = fmaf(SUB ? -a[x] : a[x], bb[y], acc[x][y]);
}

__device__ __forceinline__ void unpack4(float (&a)[4], float4 v) {
  a[0] = v.x; a[1] = v.y; a[2] = v.z; a[3] = v.w;
}

template <int DK>
__global__ void __launch_bounds__(256)
gdn_chunk_prep(const float* __restrict__ q, int ldq, const float* __restrict__ k, int ldk,
               const float* __restrict__ v, int ldv, const float* __restrict__ g, int ldg,
               const float* __restrict__ beta, int ldb, const int* __restrict__ chunks, int nch,
               float* __restrict__ wt, float* __restrict__ u, float* __restrict__ pt,
               float* __restrict__ gam_out, int Hk, int Hv, int dk, int dv, float scale) {
  constexpr int BT = GDN_BT, LT = GDN_LT;
  extern __shared__ __align__(16) float sm[];
  float* kt = sm;              // [DK][LT] k^T
  float* qt = kt + DK * LT;    // [DK][LT] (scale q)^T
  float* am = qt + DK * LT;    // [BT][LT] A, strictly lower
  float* gam = am + BT * LT;   // [BT] gamma
  float* bet = gam + BT;       // [BT] beta
  float* beg = bet + BT;       // [BT] beta e^gamma
  const int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int start = chunks[c], n = chunks[nch + c];
  const int hk = h / (Hv / Hk);
  for (int idx = tid; idx < BT * DK; idx += blockDim.x) {
    const int r = idx / DK, i = idx % DK;
    const bool ok = r < n && i < dk;
    const size_t row = (size_t)(start + (ok ? r : 0));
    kt[i * LT + r] = ok ? k[row * ldk + (size_t)hk * dk + i] : 0.f;
    qt[i * LT + r] = ok ? q[row * ldq + (size_t)hk * dk + i] * scale : 0.f;
  }
  if (tid < BT) {
    gam[tid] = tid < n ? g[(size_t)(start + tid) * ldg + h] : 0.f;
    bet[tid] = tid < n ? beta[(size_t)(start + tid) * ldb + h] : 0.f;
  }
  __syncthreads();
  if (tid == 0)   // (sequential, as the reference's float32 cumsum)
    for (int r = 1; r < BT; ++r) gam[r] += gam[r - 1];
  __syncthreads();
  if (tid < BT) beg[tid] = bet[tid] * expf(gam[tid]);
  // k k^T and (scale q) k^T: a 4 x 4 tile of (r, s) a thread
  const int tr = tid / 16, ts = tid % 16;
  float kk[4][4] = {}, qk[4][4] = {};
#pragma unroll 4
  for (int i = 0; i < DK; ++i) {
    float kr[4], qr[4];
    unpack4(kr, ld4(kt + i * LT + 4 * tr));
    unpack4(qr, ld4(qt + i * LT + 4 * tr));
    const float4 ks = ld4(kt + i * LT + 4 * ts);
    outer4<4>(kk, kr, ks);
    outer4<4>(qk, qr, ks);
  }
  const size_t base = (size_t)c * Hv + h;
  float pv[4][4];
#pragma unroll
  for (int x = 0; x < 4; ++x) {
    const int r = 4 * tr + x;
#pragma unroll
    for (int y = 0; y < 4; ++y) {
      const int s = 4 * ts + y;
      const float d = r >= s ? expf(gam[r] - gam[s]) : 0.f;
      am[r * LT + s] = r > s ? kk[x][y] * d * bet[r] : 0.f;
      pv[y][x] = qk[x][y] * d;
    }
  }
#pragma unroll
  for (int y = 0; y < 4; ++y)
    st4(pt + (base * BT + 4 * ts + y) * BT + 4 * tr, pv[y][0], pv[y][1], pv[y][2], pv[y][3]);
  if (tid < BT) gam_out[base * BT + tid] = gam[tid];
  __syncthreads();
  // (I + A) X = rhs, column j: j < DK a column of W, else column j - DK of U
  for (int j = tid; j < DK + dv; j += blockDim.x) {
    float x[BT];
    const bool wcol = j < DK;
    const float* vj = v + (size_t)h * dv + (j - DK);
#pragma unroll
    for (int r = 0; r < BT; ++r) {
      float rhs = wcol ? beg[r] * kt[j * LT + r]
                       : (r < n ? bet[r] * vj[(size_t)(start + r) * ldv] : 0.f);
#pragma unroll
      for (int s = 0; s < r; ++s) rhs = fmaf(-am[r * LT + s], x[s], rhs);
      x[r] = rhs;
    }
    if (wcol) {
      float* w = wt + (base * DK + j) * BT;
#pragma unroll
      for (int r = 0; r < BT; r += 4) st4(w + r, x[r], x[r + 1], x[r + 2], x[r + 3]);
    } else {
      float* uo = u + base * BT * dv + (j - DK);
#pragma unroll
      for (int r = 0; r < BT; ++r) uo[(size_t)r * dv] = x[r];
    }
  }
}

template <int DK>
__global__ void __launch_bounds__(128)
gdn_chunk_scan(const float* __restrict__ q, int ldq, const float* __restrict__ k, int ldk,
               const float* __restrict__ wt, const float* __restrict__ u,
               const float* __restrict__ pt, const float* __restrict__ gam_in,
               const int* __restrict__ chunks, int nch, const int* __restrict__ seq_c0,
               float* __restrict__ state, const int* __restrict__ slots, float* __restrict__ o,
               int Hk, int Hv, int dk, int dv, float scale) {
  constexpr int BT = GDN_BT, LT = GDN_LT, CB = GDN_CB, RI = DK / 16, LK = DK + 4;
  constexpr int XT = DK * LT > BT * LK ? DK * LT : BT * LK;
  extern __shared__ __align__(16) float sm[];
  float* ss = sm;              // [DK][CB] state columns j0..
  float* vn = ss + DK * CB;    // [BT][CB] V'
  float* xt = vn + BT * CB;    // [DK][LT] W^T, then (scale e^gamma q)^T; then [BT][LK] K~
  float* ps = xt + XT;         // [BT][BT] P^T
  float* eg = ps + BT * BT;    // [BT] e^gamma
  float* ek = eg + BT;         // [BT] e^(gamma_C - gamma)
  float* gm = ek + BT;         // [BT] gamma
  const int j0 = blockIdx.x * CB, h = blockIdx.y, s = blockIdx.z, tid = threadIdx.x;
  const int hk = h / (Hv / Hk);
  const int slot = slots[s];
  float* st = slot >= 0 ? state + ((size_t)slot * Hv + h) * dk * dv : nullptr;
  for (int idx = tid; idx < DK * CB; idx += blockDim.x) {
    const int i = idx / CB, col = j0 + idx % CB;
    ss[idx] = (st && i < dk && col < dv) ? st[(size_t)i * dv + col] : 0.f;
  }
  const int tr = tid / 8, tc = tid % 8;   // V' / O tile: rows 4 tr.., columns 4 tc..
  for (int ch = seq_c0[s]; ch < seq_c0[s + 1]; ++ch) {
    const int start = chunks[ch], n = chunks[nch + ch];
    const size_t base = (size_t)ch * Hv + h;
    __syncthreads();   // the previous chunk is done with every buffer
    const float4* w4 = reinterpret_cast<const float4*>(wt + base * DK * BT);
    for (int m = tid; m < DK * BT / 4; m += blockDim.x)
      *reinterpret_cast<float4*>(xt + (m / (BT / 4)) * LT + 4 * (m % (BT / 4))) = w4[m];
    const float4* p4 = reinterpret_cast<const float4*>(pt + base * BT * BT);
    for (int m = tid; m < BT * BT / 4; m += blockDim.x)
      reinterpret_cast<float4*>(ps)[m] = p4[m];
    if (tid < BT) gm[tid] = gam_in[base * BT + tid];
    __syncthreads();
    if (tid < BT) {
      eg[tid] = expf(gm[tid]);
      ek[tid] = expf(gm[n - 1] - gm[tid]);
    }
    // V' = U - W S
    float acc[4][4];
#pragma unroll
    for (int x = 0; x < 4; ++x)
#pragma unroll
      for (int y = 0; y < 4; ++y) {
        const int col = j0 + 4 * tc + y;
        acc[x][y] = col < dv ? u[(base * BT + 4 * tr + x) * dv + col] : 0.f;
      }
#pragma unroll 4
    for (int i = 0; i < DK; ++i) {
      float w[4];
      unpack4(w, ld4(xt + i * LT + 4 * tr));
      outer4<4, true>(acc, w, ld4(ss + i * CB + 4 * tc));
    }
#pragma unroll
    for (int x = 0; x < 4; ++x)
      st4(vn + (4 * tr + x) * CB + 4 * tc, acc[x][0], acc[x][1], acc[x][2], acc[x][3]);
    __syncthreads();
    for (int idx = tid; idx < BT * DK; idx += blockDim.x) {
      const int r = idx / DK, i = idx % DK;
      const bool ok = r < n && i < dk;
      xt[i * LT + r] = ok ? q[(size_t)(start + r) * ldq + (size_t)hk * dk + i] * scale * eg[r]
                          : 0.f;
    }
    __syncthreads();
    // O = (scale e^gamma Q) S + P V'
    float ac[4][4] = {};
#pragma unroll 4
    for (int i = 0; i < DK; ++i) {
      float qv[4];
      unpack4(qv, ld4(xt + i * LT + 4 * tr));
      outer4<4>(ac, qv, ld4(ss + i * CB + 4 * tc));
    }
#pragma unroll 4
    for (int r = 0; r < BT; ++r) {
      float pr[4];
      unpack4(pr, ld4(ps + r * BT + 4 * tr));
      outer4<4>(ac, pr, ld4(vn + r * CB + 4 * tc));
    }
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int r = 4 * tr + x;
      if (r >= n) continue;
#pragma unroll
      for (int y = 0; y < 4; ++y) {
        const int col = j0 + 4 * tc + y;
        if (col < dv) o[((size_t)(start + r) * Hv + h) * dv + col] = ac[x][y];
      }
    }
    __syncthreads();   // (xt and ss reads of this chunk are done)
    for (int idx = tid; idx < BT * DK; idx += blockDim.x) {
      const int r = idx / DK, i = idx % DK;
      const bool ok = r < n && i < dk;
      xt[r * LK + i] = ok ? k[(size_t)(start + r) * ldk + (size_t)hk * dk + i] * ek[r] : 0.f;
    }
    __syncthreads();
    // S = e^gamma_C S + K~^T V' (rows RI ti.., columns 4 tc..; each thread its own entries)
    const int ti = tid / 8;
    const float dec = expf(gm[n - 1]);
    float sn[RI][4];
#pragma unroll
    for (int a = 0; a < RI; ++a)
#pragma unroll
      for (int y = 0; y < 4; ++y) sn[a][y] = ss[(RI * ti + a) * CB + 4 * tc + y] * dec;
#pragma unroll 2
    for (int r = 0; r < BT; ++r) {
      float kv[RI];
#pragma unroll
      for (int a = 0; a < RI; ++a) kv[a] = xt[r * LK + RI * ti + a];
      outer4<RI>(sn, kv, ld4(vn + r * CB + 4 * tc));
    }
#pragma unroll
    for (int a = 0; a < RI; ++a)
#pragma unroll
      for (int y = 0; y < 4; ++y) ss[(RI * ti + a) * CB + 4 * tc + y] = sn[a][y];
  }
  __syncthreads();
  if (st)
    for (int idx = tid; idx < DK * CB; idx += blockDim.x) {
      const int i = idx / CB, col = j0 + idx % CB;
      if (i < dk && col < dv) st[(size_t)i * dv + col] = ss[idx];
    }
}
