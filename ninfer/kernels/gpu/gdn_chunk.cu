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
// gdn_chunk_scan, grid (ceil(dv / GDN_CB), Hv, S), 256 threads: the state columns
//   [j0, j0 + GDN_CB) of head h of sequence s (columns of the state never mix), chunk by chunk:
//   V' = U - W S_c and O = diag(scale e^gamma) Q S_c from the chunk's starting state S_c, then
//   S = e^gamma_C S_c + (diag(e^(gamma_C - gamma)) K)^T V' and O += P V'; O's columns written.
//   The sequential part is the state's two products a chunk; O rides on their B fragments, so
//   neither S_c nor V' goes through memory.
// The scan's products run on the tensor cores in 3xTF32 (each float32 operand split into two
// tf32 terms, three mma.sync m16n8k8 a product: float32's accuracy, as CUTLASS's fast-accurate
// mode), as do the prep's k k^T and q k^T (rows of GDN_LT: 2-way, kept for its forward
// substitution's column reads); the substitution runs a column a thread in float32. Transposed
// tiles are filled with consecutive threads on consecutive tokens, so the transposing stores
// do not fall into a few shared-memory banks.
//
// Chunks start at each sequence's first token; padding rows past a short last chunk are zero
// (g = beta = 0), as in the reference. Every product accumulates in float32. A slot < 0 starts
// from zero state and writes none. chunks: int32 [start (nch) | length (nch)]; seq_c0: (S + 1)
// first chunk of each sequence. (common.cuh is prepended by the Python loader.)

constexpr int GDN_BT = 64;    // tokens a chunk (the reference's CHUNK_SIZE)
constexpr int GDN_CB = 64;    // state columns a scan block
constexpr int GDN_LT = GDN_BT + 4;   // row length of transposed (d, BT) tiles: float4-aligned

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

// tf32 tensor-core products (sm_80+; PTX ISA, "mma.m16n8k8" with .tf32): d += a b, lane (g =
// lane >> 2, t = lane & 3) holding a: A[g][t], A[g + 8][t], A[g][t + 4], A[g + 8][t + 4]; b:
// B[t][g], B[t + 4][g]; d: D[g][2t], D[g][2t + 1], D[g + 8][2t], D[g + 8][2t + 1].
__device__ __forceinline__ unsigned tf32_rna(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// x = big + small, both tf32 (x - big is exact in float32)
template <int N>
struct Tf32Split {
  unsigned big[N], small[N];
  __device__ __forceinline__ Tf32Split() {}
  __device__ __forceinline__ explicit Tf32Split(const float (&x)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      big[i] = tf32_rna(x[i]);
      small[i] = tf32_rna(x[i] - __uint_as_float(big[i]));
    }
  }
};
// d += a b in 3xTF32: a_small b_big + a_big b_small + a_big b_big (the small x small term is
// below float32's rounding)
__device__ __forceinline__ void mma_3xtf32(float (&d)[4], const Tf32Split<4>& a,
                                           const Tf32Split<2>& b) {
  mma_tf32(d, a.small, b.big[0], b.big[1]);
  mma_tf32(d, a.big, b.small[0], b.small[1]);
  mma_tf32(d, a.big, b.big[0], b.big[1]);
}
// The A fragment of rows r0.. and columns k0.. of a matrix stored transposed (element (r, k) at
// m[k * ld + r]), times f (columns k0 + t, k0 + t + 4: f0, f1); the B fragment of columns n0..
// and rows k0.. of a matrix stored as is (element (k, n) at m[k * ld + n]).
__device__ __forceinline__ Tf32Split<4> a_frag_t(const float* m, int ld, int r0, int k0, int g,
                                                 int t, float f0 = 1.f, float f1 = 1.f) {
  const float a[4] = {m[(k0 + t) * ld + r0 + g] * f0, m[(k0 + t) * ld + r0 + g + 8] * f0,
                      m[(k0 + t + 4) * ld + r0 + g] * f1, m[(k0 + t + 4) * ld + r0 + g + 8] * f1};
  return Tf32Split<4>(a);
}
__device__ __forceinline__ Tf32Split<2> b_frag(const float* m, int ld, int n0, int k0, int g,
                                               int t) {
  const float b[2] = {m[(k0 + t) * ld + n0 + g], m[(k0 + t + 4) * ld + n0 + g]};
  return Tf32Split<2>(b);
}

// Rows of a chunk's q or k head (BT tokens x DK dims; zeros past n tokens or dk dims) into dst
// transposed, dst[i * ld + r] = f(r) x[r][i], by NTH threads: thread m takes token r = m % BT
// and dims 4 (m / BT).. (one 16-byte load a thread where vec), so a warp's stores go to
// consecutive words; each thread issues all its loads before its first store (one memory
// latency a fill, not one a row).
template <int DK, int NTH, typename F>
__device__ __forceinline__ void fill_transposed(float* dst, int ld, const float* __restrict__ x,
                                                int ldx, int start, int n, int dk, bool vec,
                                                F f) {
  constexpr int BT = GDN_BT, PER = BT * (DK / 4) / NTH;
  static_assert(BT * (DK / 4) % NTH == 0, "whole rounds of the block's threads");
  float4 xv[PER];
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int m = threadIdx.x + u * NTH, r = m % BT, i = 4 * (m / BT);
    xv[u] = row4(x + (size_t)(start + (r < n ? r : 0)) * ldx, i, dk, r < n, vec);
  }
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int m = threadIdx.x + u * NTH, r = m % BT, i = 4 * (m / BT);
    const float fr = f(r);
    dst[i * ld + r] = xv[u].x * fr;
    dst[(i + 1) * ld + r] = xv[u].y * fr;
    dst[(i + 2) * ld + r] = xv[u].z * fr;
    dst[(i + 3) * ld + r] = xv[u].w * fr;
  }
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
  float* am = qt + DK * LT;    // [BT][LT] A^T (A strictly lower: row s holds A's column s)
  float* gam = am + BT * LT;   // [BT] gamma
  float* bet = gam + BT;       // [BT] beta
  float* beg = bet + BT;       // [BT] beta e^gamma
  const int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int start = chunks[c], n = chunks[nch + c];
  const int hk = h / (Hv / Hk);
  const bool vec = dk % 4 == 0 && ldk % 4 == 0 && ldq % 4 == 0 &&
                   ((reinterpret_cast<unsigned long long>(k) |
                     reinterpret_cast<unsigned long long>(q)) & 15) == 0;
  fill_transposed<DK, 256>(kt, LT, k + (size_t)hk * dk, ldk, start, n, dk, vec,
                           [](int) { return 1.f; });
  fill_transposed<DK, 256>(qt, LT, q + (size_t)hk * dk, ldq, start, n, dk, vec,
                           [=](int) { return scale; });
  if (tid < BT) {
    gam[tid] = tid < n ? g[(size_t)(start + tid) * ldg + h] : 0.f;
    bet[tid] = tid < n ? beta[(size_t)(start + tid) * ldb + h] : 0.f;
  }
  __syncthreads();
  if (tid == 0) {   // (sequential, as the reference's float32 cumsum; in registers)
    float4 gv[BT / 4];
#pragma unroll
    for (int i = 0; i < BT / 4; ++i) gv[i] = reinterpret_cast<const float4*>(gam)[i];
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < BT / 4; ++i) {
      gv[i].x = acc += gv[i].x;
      gv[i].y = acc += gv[i].y;
      gv[i].z = acc += gv[i].z;
      gv[i].w = acc += gv[i].w;
    }
#pragma unroll
    for (int i = 0; i < BT / 4; ++i) reinterpret_cast<float4*>(gam)[i] = gv[i];
  }
  __syncthreads();
  if (tid < BT) beg[tid] = bet[tid] * expf(gam[tid]);
  // k k^T and (scale q) k^T on the tensor cores (3xTF32): warp w the rows 16 (w % 4).. and
  // columns 32 (w / 4).. (4 n-tiles) of both
  const int warp = tid >> 5, lane = tid & 31, lg = lane >> 2, lt = lane & 3;   // (g: the gates)
  const int r0 = 16 * (warp & 3), s0 = 32 * (warp >> 2);
  float kk[4][4] = {}, qk[4][4] = {};
#pragma unroll 4
  for (int k0 = 0; k0 < DK; k0 += 8) {
    const Tf32Split<4> ak = a_frag_t(kt, LT, r0, k0, lg, lt);
    const Tf32Split<4> aq = a_frag_t(qt, LT, r0, k0, lg, lt);
#pragma unroll
    for (int nn = 0; nn < 4; ++nn) {
      const Tf32Split<2> bk = b_frag(kt, LT, s0 + 8 * nn, k0, lg, lt);
      mma_3xtf32(kk[nn], ak, bk);
      mma_3xtf32(qk[nn], aq, bk);
    }
  }
  const size_t base = (size_t)c * Hv + h;
#pragma unroll
  for (int nn = 0; nn < 4; ++nn)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = r0 + lg + 8 * (e >> 1), s = s0 + 8 * nn + 2 * lt + (e & 1);
      const float d = r >= s ? expf(gam[r] - gam[s]) : 0.f;
      am[s * LT + r] = r > s ? kk[nn][e] * d * bet[r] : 0.f;
      pt[(base * BT + s) * BT + r] = qk[nn][e] * d;
    }
  if (tid < BT) gam_out[base * BT + tid] = gam[tid];
  __syncthreads();
  // (I + A) X = rhs, column j: j < DK a column of W, else column j - DK of U. Column-oriented
  // substitution: once x_s is final it is taken out of every later row (A's column s read
  // from A^T's row s four rows a load); each row sees the same fmas in the same order as a
  // row-by-row substitution, and the rows' updates of one step are independent
  for (int j = tid; j < DK + dv; j += blockDim.x) {
    float x[BT];
    const bool wcol = j < DK;
    const float* vj = v + (size_t)h * dv + (j - DK);
#pragma unroll
    for (int r = 0; r < BT; ++r)   // (all loads first: one memory latency, not 64)
      x[r] = wcol ? beg[r] * kt[j * LT + r]
                  : (r < n ? bet[r] * vj[(size_t)(start + r) * ldv] : 0.f);
#pragma unroll
    for (int s = 0; s < BT - 1; ++s) {
      const float xs = x[s];
#pragma unroll
      for (int r4 = (s + 1) & ~3; r4 < BT; r4 += 4) {
        const float4 a = *reinterpret_cast<const float4*>(am + s * LT + r4);
        if (r4 > s) x[r4] = fmaf(-a.x, xs, x[r4]);
        if (r4 + 1 > s) x[r4 + 1] = fmaf(-a.y, xs, x[r4 + 1]);
        if (r4 + 2 > s) x[r4 + 2] = fmaf(-a.z, xs, x[r4 + 2]);
        x[r4 + 3] = fmaf(-a.w, xs, x[r4 + 3]);
      }
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

// Warp w of the scan: chunk rows 16 (w & 3).. of V' and O, columns 32 (w >> 2).. of the block's
// (4 n-tiles), and the state's m-tiles MT (w & 3).. (those below M2) over the same columns.
template <int DK>
struct ScanTiles {
  static constexpr int M2 = DK / 16;          // state m-tiles (16 rows)
  static constexpr int MT = (M2 + 3) / 4;     // m-tiles a warp
};

// The A fragment of rows r0.. and columns k0.. of a matrix stored as is (element (r, k) at
// m[r * ld + k]; ld = 4 (mod 32): a warp's loads hit 32 banks).
__device__ __forceinline__ Tf32Split<4> a_frag(const float* m, int ld, int r0, int k0, int g,
                                               int t) {
  const float* p = m + (r0 + g) * ld + k0 + t;
  const float a[4] = {p[0], p[8 * ld], p[4], p[8 * ld + 4]};
  return Tf32Split<4>(a);
}

template <int DK>
__global__ void __launch_bounds__(256, 1)
gdn_chunk_scan(const float* __restrict__ q, int ldq, const float* __restrict__ k, int ldk,
               const float* __restrict__ wt, const float* __restrict__ u,
               const float* __restrict__ pt, const float* __restrict__ gam_in,
               const int* __restrict__ chunks, int nch, const int* __restrict__ seq_c0,
               float* __restrict__ state, const int* __restrict__ slots, float* __restrict__ o,
               int Hk, int Hv, int dk, int dv, float scale) {
  constexpr int BT = GDN_BT, CB = GDN_CB;
  // row strides 8 (mod 32) words past a multiple of 32 for the tiles read by columns (a_frag_t,
  // b_frag), 4 for q (a_frag): a warp's fragment loads hit 32 banks
  constexpr int LS = CB + 8, LW = BT + 8, LK = DK + 8, LQ = DK + 4;
  static_assert(CB == 64, "two warp columns of 4 n-tiles");
  using SC = ScanTiles<DK>;
  extern __shared__ __align__(16) float sm[];
  float* ss = sm;              // [DK][LS] the chunk's starting state, columns j0..
  float* vn = ss + DK * LS;    // [BT][LS] V'
  float* ws = vn + BT * LS;    // [DK][LW] W^T
  float* ps = ws + DK * LW;    // [BT][LW] P^T
  float* ks = ps + BT * LW;    // [BT][LK] k
  float* qs = ks + BT * LK;    // [BT][LQ] q
  float* ek = qs + BT * LQ;    // [BT] e^(gamma_C - gamma)
  float* eg = ek + BT;         // [BT] scale e^gamma
  const int j0 = blockIdx.x * CB, h = blockIdx.y, s = blockIdx.z, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wr = warp & 3, r0 = 16 * wr, c0 = 32 * (warp >> 2);
  const int hk = h / (Hv / Hk);
  const int slot = slots[s];
  // q and k rows by 16-byte async copies where aligned (else plain loads)
  const auto al16 = [](const float* p, int ld) {
    return ld % 4 == 0 && (reinterpret_cast<unsigned long long>(p) & 15) == 0;
  };
  const bool k16 = dk % 4 == 0 && al16(k, ldk), q16 = dk % 4 == 0 && al16(q, ldq);
  float* st = slot >= 0 ? state + ((size_t)slot * Hv + h) * dk * dv : nullptr;
  // the state in the accumulators: sa[m][n] holds rows 16 (MT wr + m) + g (+ 8), columns
  // j0 + c0 + 8 n + 2 t (+ 1); m-tiles past M2 stay zero
  float sa[SC::MT][4][4] = {};
  auto each_state = [&](auto f) {   // f(row i, column col, its element of sa)
#pragma unroll
    for (int m = 0; m < SC::MT; ++m) {
      if (SC::MT * wr + m >= SC::M2) break;   // uniform over the warp
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          f(16 * (SC::MT * wr + m) + g + 8 * (e >> 1), j0 + c0 + 8 * n + 2 * t + (e & 1),
            sa[m][n][e]);
    }
  };
  each_state([&](int i, int col, float& v) {
    v = (st && i < dk && col < dv) ? st[(size_t)i * dv + col] : 0.f;
  });
  // a chunk's q or k head rows into dst (rows of ld floats; zeros past its n tokens or dk)
  auto load_rows = [&](float* dst, int ld, const float* x, int ldx, int start, int n, bool v16) {
    for (int m = tid; m < BT * (DK / 4); m += blockDim.x) {
      const int r = m / (DK / 4), i = 4 * (m % (DK / 4));
      float* d = dst + r * ld + i;
      const float* src = x + (size_t)(start + r) * ldx + (size_t)hk * dk + i;
      if (r < n && i < dk && v16) {
        cp_async16(d, src);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) d[e] = (r < n && i + e < dk) ? src[e] : 0.f;
      }
    }
  };
  // a (rows x BT) float tile of the workspace into rows of LW floats
  auto load_ws = [&](float* dst, const float* src, int rows) {
    for (int m = tid; m < rows * BT / 4; m += blockDim.x)
      cp_async16(dst + (m / (BT / 4)) * LW + 4 * (m % (BT / 4)), src + 4 * m);
  };
  // what the first product of chunk ch reads (W^T, q), then what the second reads (k, P^T):
  // one commit group each
  auto load_wq = [&](int ch) {
    load_ws(ws, wt + ((size_t)ch * Hv + h) * DK * BT, DK);
    load_rows(qs, LQ, q, ldq, chunks[ch], chunks[nch + ch], q16);
    cp_async_commit();
  };
  auto load_kp = [&](int ch) {
    load_rows(ks, LK, k, ldk, chunks[ch], chunks[nch + ch], k16);
    load_ws(ps, pt + ((size_t)ch * Hv + h) * BT * BT, BT);
    cp_async_commit();
  };
  // U's rows of chunk ch (this warp's rows and columns), gamma_C and gamma of row tid: loaded a
  // chunk ahead, into registers
  float un[4][4], gcn = 0.f, gn = 0.f;
  auto load_u = [&](int ch) {
    const size_t base = (size_t)ch * Hv + h;
#pragma unroll
    for (int nn = 0; nn < 4; ++nn)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = r0 + g + 8 * (e >> 1), col = j0 + c0 + 8 * nn + 2 * t + (e & 1);
        un[nn][e] = col < dv ? u[(base * BT + r) * dv + col] : 0.f;
      }
    gcn = gam_in[base * BT + chunks[nch + ch] - 1];
    if (tid < BT) gn = gam_in[base * BT + tid];
  };
  // Each chunk's copies are issued a step ahead of their use: W^T and q of chunk ch + 1 once
  // the first product of chunk ch is done with their buffers, k and P^T once the second is; U
  // and gamma while the products run. The state carry then waits on no memory round trip.
  const int cb = seq_c0[s], ce = seq_c0[s + 1];
  if (cb < ce) {
    load_wq(cb);
    load_kp(cb);
    load_u(cb);
  }
  for (int ch = cb; ch < ce; ++ch) {
    const int start = chunks[ch], n = chunks[nch + ch];
    // the starting state to shared memory (ss: last read by the chunk before's first product,
    // two barriers ago)
#pragma unroll
    for (int m = 0; m < SC::MT; ++m) {
      if (SC::MT * wr + m >= SC::M2) break;   // uniform over the warp
#pragma unroll
      for (int nn = 0; nn < 4; ++nn)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          *reinterpret_cast<float2*>(ss + (16 * (SC::MT * wr + m) + g + 8 * hh) * LS + c0 +
                                     8 * nn + 2 * t) =
              make_float2(sa[m][nn][2 * hh], sa[m][nn][2 * hh + 1]);
    }
    float va[4][4];
#pragma unroll
    for (int nn = 0; nn < 4; ++nn)
#pragma unroll
      for (int e = 0; e < 4; ++e) va[nn][e] = un[nn][e];
    const float gc = gcn;
    if (tid < BT) {   // (ek, eg: last read before the chunk before's last barrier)
      ek[tid] = expf(gc - gn);
      eg[tid] = scale * expf(gn);
    }
    if (ch + 1 < ce) load_u(ch + 1);
    cp_async_wait<1>();   // W^T and q of this chunk (k and P^T may still fly)
    __syncthreads();
    // V' = U - W S and O = Q S, both from the state's B fragments
    float oa[4][4] = {};
#pragma unroll 4
    for (int k0 = 0; k0 < DK; k0 += 8) {
      const Tf32Split<4> aw = a_frag_t(ws, LW, r0, k0, g, t, -1.f, -1.f);
      const Tf32Split<4> aq = a_frag(qs, LQ, r0, k0, g, t);
#pragma unroll
      for (int nn = 0; nn < 4; ++nn) {
        const Tf32Split<2> b = b_frag(ss, LS, c0 + 8 * nn, k0, g, t);
        mma_3xtf32(va[nn], aw, b);
        mma_3xtf32(oa[nn], aq, b);
      }
    }
#pragma unroll
    for (int nn = 0; nn < 4; ++nn)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = r0 + g + 8 * hh, c = c0 + 8 * nn + 2 * t;
        *reinterpret_cast<float2*>(vn + r * LS + c) =
            make_float2(va[nn][2 * hh], va[nn][2 * hh + 1]);
        const float f = eg[r];   // O's rows: diag(scale e^gamma) Q S
        oa[nn][2 * hh] *= f;
        oa[nn][2 * hh + 1] *= f;
      }
    cp_async_wait<0>();   // k and P^T of this chunk
    __syncthreads();      // V', k and P^T in shared memory; every warp done with ws and qs
    if (ch + 1 < ce) load_wq(ch + 1);
    // S = e^gamma_C S + (diag(e^(gamma_C - gamma)) K)^T V' (the product in accumulators of its
    // own, added to the state in float32: the carry across chunks never goes through the
    // tensor cores' accumulation), and O += P V', both from V''s B fragments
    const float dec = expf(gc);
    float du[SC::MT][4][4] = {};
#pragma unroll 2
    for (int k0 = 0; k0 < BT; k0 += 8) {
      const float e0 = ek[k0 + t], e1 = ek[k0 + t + 4];
      Tf32Split<2> b[4];
#pragma unroll
      for (int nn = 0; nn < 4; ++nn) b[nn] = b_frag(vn, LS, c0 + 8 * nn, k0, g, t);
      const Tf32Split<4> ap = a_frag_t(ps, LW, r0, k0, g, t);
#pragma unroll
      for (int nn = 0; nn < 4; ++nn) mma_3xtf32(oa[nn], ap, b[nn]);
#pragma unroll
      for (int m = 0; m < SC::MT; ++m) {
        if (SC::MT * wr + m >= SC::M2) break;   // uniform over the warp
        const Tf32Split<4> a = a_frag_t(ks, LK, 16 * (SC::MT * wr + m), k0, g, t, e0, e1);
#pragma unroll
        for (int nn = 0; nn < 4; ++nn) mma_3xtf32(du[m][nn], a, b[nn]);
      }
    }
#pragma unroll
    for (int m = 0; m < SC::MT; ++m)
#pragma unroll
      for (int nn = 0; nn < 4; ++nn)
#pragma unroll
        for (int e = 0; e < 4; ++e) sa[m][nn][e] = fmaf(sa[m][nn][e], dec, du[m][nn][e]);
#pragma unroll
    for (int nn = 0; nn < 4; ++nn)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {   // (a float2 where both columns are in and aligned)
        const int r = r0 + g + 8 * hh, col = j0 + c0 + 8 * nn + 2 * t;
        float* op = o + ((size_t)(start + r) * Hv + h) * dv + col;
        if (r >= n || col >= dv) continue;
        if (dv % 2 == 0)
          *reinterpret_cast<float2*>(op) = make_float2(oa[nn][2 * hh], oa[nn][2 * hh + 1]);
        else {
          op[0] = oa[nn][2 * hh];
          if (col + 1 < dv) op[1] = oa[nn][2 * hh + 1];
        }
      }
    __syncthreads();      // every warp done with ks, ps, vn, ek and eg
    if (ch + 1 < ce) load_kp(ch + 1);
  }
  if (st)
    each_state([&](int i, int col, float& v) {
      if (i < dk && col < dv) st[(size_t)i * dv + col] = v;
    });
}
