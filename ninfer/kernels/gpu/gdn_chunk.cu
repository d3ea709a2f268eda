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
//   the chunk's starting state S_c out, V' = U - W S (written over U), S = e^gamma_C S +
//   (diag(e^(gamma_C - gamma)) K)^T V'. The only sequential part: two products a chunk.
// gdn_chunk_out, grid (chunks, Hv, ceil(dv / 64)): O = diag(scale e^gamma) Q S_c + P V'.
// The small products are register-tiled in float32 (4 x 4 or RI x 4 outputs a thread).
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

// Elements i .. i + 3 of a head row (zeros past dk, or for a padding row): one 16-byte load
// when vec (the caller checked alignment), else four.
__device__ __forceinline__ float4 row4(const float* __restrict__ p, int i, int dk, bool ok,
                                       bool vec) {
  if (!ok || i >= dk) return make_float4(0.f, 0.f, 0.f, 0.f);
  if (vec) return *reinterpret_cast<const float4*>(p + i);
  return make_float4(p[i], i + 1 < dk ? p[i + 1] : 0.f, i + 2 < dk ? p[i + 2] : 0.f,
                     i + 3 < dk ? p[i + 3] : 0.f);
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
  const bool vec = dk % 4 == 0 && ldk % 4 == 0 && ldq % 4 == 0 &&
                   ((reinterpret_cast<unsigned long long>(k) |
                     reinterpret_cast<unsigned long long>(q)) & 15) == 0;
  for (int m = tid; m < BT * (DK / 4); m += blockDim.x) {
    const int r = m / (DK / 4), i = 4 * (m % (DK / 4));
    const size_t row = (size_t)(start + (r < n ? r : 0));
    const float4 kv = row4(k + row * ldk + (size_t)hk * dk, i, dk, r < n, vec);
    const float4 qv = row4(q + row * ldq + (size_t)hk * dk, i, dk, r < n, vec);
    kt[i * LT + r] = kv.x; kt[(i + 1) * LT + r] = kv.y;
    kt[(i + 2) * LT + r] = kv.z; kt[(i + 3) * LT + r] = kv.w;
    qt[i * LT + r] = qv.x * scale; qt[(i + 1) * LT + r] = qv.y * scale;
    qt[(i + 2) * LT + r] = qv.z * scale; qt[(i + 3) * LT + r] = qv.w * scale;
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
    for (int r = 0; r < BT; ++r)   // (all loads first: one memory latency, not 64)
      x[r] = wcol ? beg[r] * kt[j * LT + r]
                  : (r < n ? bet[r] * vj[(size_t)(start + r) * ldv] : 0.f);
#pragma unroll
    for (int r = 1; r < BT; ++r) {
      float rhs = x[r];
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
gdn_chunk_scan(const float* __restrict__ k, int ldk, const float* __restrict__ wt,
               float* __restrict__ u, const float* __restrict__ gam_in,
               float* __restrict__ hs, const int* __restrict__ chunks, int nch,
               const int* __restrict__ seq_c0, float* __restrict__ state,
               const int* __restrict__ slots, int Hk, int Hv, int dk, int dv) {
  constexpr int BT = GDN_BT, LT = GDN_LT, CB = GDN_CB, RI = DK / 16, LK = DK + 4;
  extern __shared__ __align__(16) float sm[];
  float* ss = sm;              // [DK][CB] state columns j0..
  float* vn = ss + DK * CB;    // [BT][CB] V'
  float* ws = vn + BT * CB;    // [DK][LT] W^T
  float* ks = ws + DK * LT;    // [BT][LK] k
  float* ek = ks + BT * LK;    // [BT] e^(gamma_C - gamma)
  const int j0 = blockIdx.x * CB, h = blockIdx.y, s = blockIdx.z, tid = threadIdx.x;
  const int hk = h / (Hv / Hk);
  const int slot = slots[s];
  // k rows by 16-byte async copies where aligned (else plain loads)
  const bool k16 = (dk % 4 == 0) && (ldk % 4 == 0) &&
                   ((reinterpret_cast<unsigned long long>(k) & 15) == 0);
  float* st = slot >= 0 ? state + ((size_t)slot * Hv + h) * dk * dv : nullptr;
  for (int idx = tid; idx < DK * CB; idx += blockDim.x) {
    const int i = idx / CB, col = j0 + idx % CB;
    ss[idx] = (st && i < dk && col < dv) ? st[(size_t)i * dv + col] : 0.f;
  }
  const int tr = tid / 8, tc = tid % 8;   // V' tile: rows 4 tr.., columns 4 tc..
  const int ti = tid / 8;                 // S tile: rows RI ti.., columns 4 tc..
  for (int ch = seq_c0[s]; ch < seq_c0[s + 1]; ++ch) {
    const int start = chunks[ch], n = chunks[nch + ch];
    const size_t base = (size_t)ch * Hv + h;
    __syncthreads();   // the previous chunk is done with every buffer
    const float* w = wt + base * DK * BT;
    for (int m = tid; m < DK * BT / 4; m += blockDim.x)
      cp_async16(ws + (m / (BT / 4)) * LT + 4 * (m % (BT / 4)), w + 4 * m);
    for (int m = tid; m < BT * (DK / 4); m += blockDim.x) {
      const int r = m / (DK / 4), i = 4 * (m % (DK / 4));
      float* d = ks + r * LK + i;
      const float* src = k + (size_t)(start + r) * ldk + (size_t)hk * dk + i;
      if (r < n && i < dk && k16) {
        cp_async16(d, src);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) d[e] = (r < n && i + e < dk) ? src[e] : 0.f;
      }
    }
    cp_async_commit();
    // while the copies fly: U into the accumulators, the chunk's starting state out
    float acc[4][4];
#pragma unroll
    for (int x = 0; x < 4; ++x)
#pragma unroll
      for (int y = 0; y < 4; ++y) {
        const int col = j0 + 4 * tc + y;
        acc[x][y] = col < dv ? u[(base * BT + 4 * tr + x) * dv + col] : 0.f;
      }
#pragma unroll
    for (int a = 0; a < RI; ++a) {
      const int i = RI * ti + a;
      if (i >= dk) continue;
#pragma unroll
      for (int y = 0; y < 4; ++y) {
        const int col = j0 + 4 * tc + y;
        if (col < dv) hs[(base * dk + i) * dv + col] = ss[i * CB + 4 * tc + y];
      }
    }
    const float gc = gam_in[base * BT + n - 1];
    if (tid < BT) ek[tid] = expf(gc - gam_in[base * BT + tid]);
    cp_async_wait<0>();
    __syncthreads();
    // V' = U - W S (kept for the output kernel in place of U)
#pragma unroll 4
    for (int i = 0; i < DK; ++i) {
      float wv[4];
      unpack4(wv, ld4(ws + i * LT + 4 * tr));
      outer4<4, true>(acc, wv, ld4(ss + i * CB + 4 * tc));
    }
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      st4(vn + (4 * tr + x) * CB + 4 * tc, acc[x][0], acc[x][1], acc[x][2], acc[x][3]);
#pragma unroll
      for (int y = 0; y < 4; ++y) {
        const int col = j0 + 4 * tc + y;
        if (col < dv) u[(base * BT + 4 * tr + x) * dv + col] = acc[x][y];
      }
    }
    __syncthreads();
    // S = e^gamma_C S + (diag(e^(gamma_C - gamma)) K)^T V' (each thread its own entries)
    const float dec = expf(gc);
    float sn[RI][4];
#pragma unroll
    for (int a = 0; a < RI; ++a)
#pragma unroll
      for (int y = 0; y < 4; ++y) sn[a][y] = ss[(RI * ti + a) * CB + 4 * tc + y] * dec;
#pragma unroll 2
    for (int r = 0; r < BT; ++r) {
      float kv[RI];
      const float e = ek[r];
#pragma unroll
      for (int a = 0; a < RI; ++a) kv[a] = ks[r * LK + RI * ti + a] * e;
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

// gdn_chunk_out, grid (chunks, Hv, ceil(dv / 64)), 256 threads: O = diag(scale e^gamma) Q S_c
// + P V' for 64 columns of a chunk (S_c: the state the chunk started from, from the scan).
template <int DK>
__global__ void __launch_bounds__(256)
gdn_chunk_out(const float* __restrict__ q, int ldq, const float* __restrict__ vp,
              const float* __restrict__ pt, const float* __restrict__ gam_in,
              const float* __restrict__ hs, const int* __restrict__ chunks, int nch,
              float* __restrict__ o, int Hk, int Hv, int dk, int dv, float scale) {
  constexpr int BT = GDN_BT, LT = GDN_LT, CO = 64;
  extern __shared__ __align__(16) float sm[];
  float* qt = sm;              // [DK][LT] (scale e^gamma q)^T
  float* sc = qt + DK * LT;    // [DK][CO] S_c columns j0..
  float* vv = sc + DK * CO;    // [BT][CO] V'
  float* ps = vv + BT * CO;    // [BT][BT] P^T
  float* eg = ps + BT * BT;    // [BT]
  const int c = blockIdx.x, h = blockIdx.y, j0 = blockIdx.z * CO, tid = threadIdx.x;
  const int start = chunks[c], n = chunks[nch + c];
  const int hk = h / (Hv / Hk);
  const size_t base = (size_t)c * Hv + h;
  if (tid < BT) eg[tid] = expf(gam_in[base * BT + tid]);
  const float4* p4 = reinterpret_cast<const float4*>(pt + base * BT * BT);
  for (int m = tid; m < BT * BT / 4; m += blockDim.x) reinterpret_cast<float4*>(ps)[m] = p4[m];
  const bool v4 = dv % 4 == 0;   // (hs and vp rows are then 16-byte aligned)
  for (int m = tid; m < DK * CO / 4; m += blockDim.x) {
    const int i = m / (CO / 4), c4 = 4 * (m % (CO / 4));
    *reinterpret_cast<float4*>(sc + i * CO + c4) =
        row4(hs + (base * dk + (i < dk ? i : 0)) * dv + j0, c4, dv - j0, i < dk, v4);
  }
  for (int m = tid; m < BT * CO / 4; m += blockDim.x) {
    const int r = m / (CO / 4), c4 = 4 * (m % (CO / 4));
    *reinterpret_cast<float4*>(vv + r * CO + c4) =
        row4(vp + (base * BT + r) * dv + j0, c4, dv - j0, true, v4);
  }
  __syncthreads();
  const bool vec = dk % 4 == 0 && ldq % 4 == 0 &&
                   (reinterpret_cast<unsigned long long>(q) & 15) == 0;
  for (int m = tid; m < BT * (DK / 4); m += blockDim.x) {
    const int r = m / (DK / 4), i = 4 * (m % (DK / 4));
    const float4 qv = row4(q + (size_t)(start + (r < n ? r : 0)) * ldq + (size_t)hk * dk, i,
                           dk, r < n, vec);
    qt[i * LT + r] = qv.x * scale * eg[r]; qt[(i + 1) * LT + r] = qv.y * scale * eg[r];
    qt[(i + 2) * LT + r] = qv.z * scale * eg[r]; qt[(i + 3) * LT + r] = qv.w * scale * eg[r];
  }
  __syncthreads();
  const int tr = tid / 16, tc = tid % 16;   // rows 4 tr.., columns 4 tc..
  float ac[4][4] = {};
#pragma unroll 4
  for (int i = 0; i < DK; ++i) {
    float qv[4];
    unpack4(qv, ld4(qt + i * LT + 4 * tr));
    outer4<4>(ac, qv, ld4(sc + i * CO + 4 * tc));
  }
#pragma unroll 4
  for (int r = 0; r < BT; ++r) {
    float pr[4];
    unpack4(pr, ld4(ps + r * BT + 4 * tr));
    outer4<4>(ac, pr, ld4(vv + r * CO + 4 * tc));
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
}
