// Prefill / mixed attention over fp16 KV pages on Hopper's warpgroup MMAs (sm_90a: wgmma; the
// PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"). The work split, causal
// rule and softmax are attn_prefill_mma's (attention.cu: FlashAttention-2's form, Q pre-scaled
// by scale * log2 e, P rounded to fp16); what changes is where the operands come from. There a
// warp's mma.sync takes each K / V fragment through its registers by ldmatrix, half an ldmatrix
// an MMA, which bounds it by shared-memory bandwidth (hd 256: ~150 TFLOP/s). Here a warpgroup
// (4 warps, 64 query rows) multiplies S = Q K^T with both operands read by the tensor cores from
// shared memory (descriptors), and O += P V with P from registers (S's accumulator layout is
// the A operand's) and V from shared memory, transposed (its rows are positions, the head
// dims contiguous). Two such warpgroups a block (BR = 128 rows), and a third that loads the KV
// tiles of BC = 64 positions a tile ahead of them, in two stages (attn_prefill_wgmma).
// Shared memory holds Q, K and V in the 128-byte swizzle (TMA's and FA3's): a tile of R rows
// is HD / 64 chunks of 64 columns, each R rows of 128 bytes, and a row's 16-byte unit u is
// stored at unit u ^ (row & 7); 8-row atoms of 1,024 bytes, 1,024-aligned. Q and K are K-major
// operands (a k step of 16 is 32 bytes into the rows); V, stored the same way, is MN-major (its
// rows the k index, a chunk 64 of N): both step 1,024 bytes from one 8-row group to the next.

// The byte offset of (row r, 16-byte column c) in a swizzled tile of R rows.
template <int R>
__device__ __forceinline__ unsigned sw_off(int r, int c) {
  return (unsigned)((c >> 3) * R * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// The shared-memory matrix descriptor of a 128-byte-swizzled operand at saddr: 8-row groups
// 1,024 bytes apart (the stride byte offset; the leading one, the stride between 64-column
// atoms of an MN-major operand, is not used at N = 64, and set the same).
__device__ __forceinline__ unsigned long long wg_desc(unsigned saddr) {
  return (unsigned long long)((saddr & 0x3FFFFu) >> 4) | (64ull << 16) | (64ull << 32) |
         (1ull << 62);
}
__device__ __forceinline__ void wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_wait0() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// shared memory written by the generic proxy (stores, cp.async) made visible to wgmma's reads
__device__ __forceinline__ void fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// keeps the compiler from moving accumulator accesses across a wgmma fence or wait
template <int N>
__device__ __forceinline__ void wg_hold(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The 32 float32 accumulators of an m64n64 wgmma: the asm operands %0-%31 and their list
#define WG_ACC32_REGS                                                                     \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_ACC32(d)                                                                        \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),     \
      "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),          \
      "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),       \
      "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),       \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),       \
      "+f"(d[31])

// D (+)= A B, A and B by descriptor, m64n64k16, fp16 in, float32 accumulators; accumulate 0:
// D = A B
__device__ __forceinline__ void wgmma_ss(float (&d)[32], unsigned long long da,
                                         unsigned long long db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
      WG_ACC32_REGS "}, "
      "%32, %33, p, 1, 1, 0, 0;\n}\n"
      : WG_ACC32(d)
      : "l"(da), "l"(db), "r"(accumulate));
}
// D += A B, A from registers (fp16 pairs in the accumulators' layout, as FlashAttention's P), B
// by descriptor, transposed (MN-major: a row a K index, its N elements contiguous)
__device__ __forceinline__ void wgmma_rs_t(float (&d)[32], const unsigned (&a)[4],
                                           unsigned long long db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
      WG_ACC32_REGS "}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : WG_ACC32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

#define WG_NEG_INF (-__int_as_float(0x7f800000))

// Q rows r0.. of tile (sequence s, KV head kvh) into Qs as fp16 pre-scaled by qscale, 8
// consecutive threads on 8 rows of a 16-byte column (conflict-free stores); `nthreads` share it.
template <int HD>
__device__ __forceinline__ void wg_stage_q(unsigned char* Qs, const float* __restrict__ q,
                                           int ldq, int qs, int r0, int nrows, int kvh, int G,
                                           float qscale, int tid, int nthreads) {
  constexpr int BR = 128, NC = HD / 8;
  for (int idx = tid; idx < BR * NC; idx += nthreads) {
    const int r = (idx / (8 * NC)) * 8 + (idx & 7), c = (idx >> 3) % NC;
    const int row = r0 + r;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (row < nrows) {
      const int i = row / G, hh = row - i * G;
      const float* src = q + (size_t)(qs + i) * ldq + (size_t)(kvh * G + hh) * HD + 8 * c;
      v.x = pack_h2(src[0] * qscale, src[1] * qscale);
      v.y = pack_h2(src[2] * qscale, src[3] * qscale);
      v.z = pack_h2(src[4] * qscale, src[5] * qscale);
      v.w = pack_h2(src[6] * qscale, src[7] * qscale);
    }
    *reinterpret_cast<uint4*>(Qs + sw_off<BR>(r, c)) = v;
  }
}

// One warpgroup's 64 query rows (q_a: their first row in Q's tile of 128) against the KV tile
// of positions kb.. (k_a / v_a, BC = 64 rows): S = Q K^T, the causal mask (only where a row may
// end inside the tile: kb + 63 > first, the least of the rows' limits), the running max / sum
// (m, l) and O (o) rescaled, then O += P V. A row's 4 threads are lanes 4 g .. 4 g + 3;
// sc[4 n + 2 h + e]: row g + 8 h of the warp's 16, position kb + 8 n + 2 t + e; lim[h]: that
// row's last visible position.
template <int HD>
__device__ __forceinline__ void wg_tile(unsigned q_a, unsigned k_a, unsigned v_a, int kb,
                                        int first, const int (&lim)[2], float (&m)[2],
                                        float (&l)[2], float (&o)[HD / 64][32], int t) {
  constexpr int BR = 128, BC = 64, NQ = HD / 64;
  float sc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) sc[i] = 0.f;
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk)
    wgmma_ss(sc, wg_desc(q_a + (kk >> 2) * BR * 128 + (kk & 3) * 32),
             wg_desc(k_a + (kk >> 2) * BC * 128 + (kk & 3) * 32), kk);
  wg_commit();
  wg_wait0();
  wg_hold(sc);

  const bool mask = kb + BC - 1 > first;
  float corr[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = WG_NEG_INF;
#pragma unroll
    for (int n = 0; n < BC / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = sc[4 * n + 2 * h + e];
        if (mask && kb + n * 8 + 2 * t + e > lim[h]) v = WG_NEG_INF;
        sc[4 * n + 2 * h + e] = v;
        mx = fmaxf(mx, v);
      }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mn = fmaxf(m[h], mx);
    const float mu = mn == WG_NEG_INF ? 0.f : mn;
    corr[h] = exp2f(m[h] - mu);
    float rs = 0.f;
#pragma unroll
    for (int n = 0; n < BC / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = exp2f(sc[4 * n + 2 * h + e] - mu);
        sc[4 * n + 2 * h + e] = p;
        rs += p;
      }
    }
    l[h] = l[h] * corr[h] + rs;
    m[h] = mn;
  }
  unsigned pa[BC / 16][4];
#pragma unroll
  for (int kk = 0; kk < BC / 16; ++kk) {
    pa[kk][0] = pack_h2(sc[8 * kk], sc[8 * kk + 1]);
    pa[kk][1] = pack_h2(sc[8 * kk + 2], sc[8 * kk + 3]);
    pa[kk][2] = pack_h2(sc[8 * kk + 4], sc[8 * kk + 5]);
    pa[kk][3] = pack_h2(sc[8 * kk + 6], sc[8 * kk + 7]);
  }
#pragma unroll
  for (int n = 0; n < NQ; ++n) {
#pragma unroll
    for (int i = 0; i < 32; i += 4) {
      o[n][i] *= corr[0]; o[n][i + 1] *= corr[0];
      o[n][i + 2] *= corr[1]; o[n][i + 3] *= corr[1];
    }
    wg_hold(o[n]);
  }
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < BC / 16; ++kk)
#pragma unroll
    for (int n = 0; n < NQ; ++n)   // positions 16 kk.. (rows of chunk n), dims 64 n..
      wgmma_rs_t(o[n], pa[kk], wg_desc(v_a + n * BC * 128 + kk * 16 * 128));
  wg_commit();
  wg_wait0();
#pragma unroll
  for (int n = 0; n < NQ; ++n) wg_hold(o[n]);
}

// O / l of this thread's two rows (row0 and row0 + 8, rows of the tile's sequence) into out.
template <int HD>
__device__ __forceinline__ void wg_store(const float (&o)[HD / 64][32], float (&l)[2], int row0,
                                         int nrows, int G, int qs, int kvh, int t,
                                         float* __restrict__ out, int ldo) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    const int row = row0 + 8 * h;
    if (row >= nrows) continue;
    const int i = row / G, hh = row - i * G;
    const float inv = 1.f / l[h];
    float* dst = out + (size_t)(qs + i) * ldo + (size_t)(kvh * G + hh) * HD + 2 * t;
#pragma unroll
    for (int n = 0; n < HD / 64; ++n)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        dst[64 * n + 8 * j] = o[n][4 * j + 2 * h] * inv;
        dst[64 * n + 8 * j + 1] = o[n][4 * j + 2 * h + 1] * inv;
      }
  }
}

// A warpgroup's rows rw0.. (64 of them) of a tile of nrows: each of its thread's two rows' last
// visible position (lim; -1 past nrows), the first position past every row's limit (end) and
// the least limit (first), for a sequence with L positions of which the last q_len are new.
struct WgRows {
  int lim[2], end, first;
  __device__ __forceinline__ WgRows(int rw0, int row0, int nrows, int L, int q_len, int G) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + 8 * h;
      lim[h] = row < nrows ? L - q_len + row / G : -1;
    }
    const int last = min(rw0 + 63, nrows - 1);
    end = rw0 < nrows ? L - q_len + last / G + 1 : 0;
    first = rw0 < nrows ? L - q_len + rw0 / G : 0;
  }
};

// Arguments as attn_prefill_mma's (its T = kvh). Warp-specialized (FA3's producer / consumer
// split): warpgroup 0 only loads, K / V tiles into a ring of two stages by cp.async, each
// announced on a "full" mbarrier; warpgroups 1 and 2 (64 query rows each) compute, and hand a
// stage back on its "empty" mbarrier. No block-wide barrier in the loop, so one warpgroup's
// softmax overlaps the other's MMAs; setmaxnreg moves registers from the producer to them.
template <int HD>
__global__ void __launch_bounds__(384, 1)   // (NT)
attn_prefill_wgmma(const float* __restrict__ q, int ldq, const kvh* __restrict__ kc,
                   const kvh* __restrict__ vc, const int* __restrict__ cu,
                   const int* __restrict__ ctx_lens, const int* __restrict__ block_tables,
                   int bt_stride, int page_size, int nkv, int G, float scale,
                   const int* __restrict__ tiles, float* __restrict__ out, int ldo) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // rows, KV positions a tile, threads (the loading warpgroup's first), the computing warps
  constexpr int BR = 128, BC = 64, NT = 384, CW = 8, NC = HD / 8, NQ = HD / 64;
  constexpr int TILE = BC * HD * 2;
  static_assert(HD % 64 == 0, "head dims of 64-column quarters");
  extern __shared__ __align__(1024) unsigned char wsm_[];
  // the swizzle's atoms 1,024-aligned (the host allots 1,024 bytes more)
  unsigned char* wsm = wsm_ + ((1024 - (smem_addr(wsm_) & 1023)) & 1023);
  unsigned char* Qs = wsm;                 // BR rows
  unsigned char* Ks = Qs + BR * HD * 2;    // 2 stages of BC rows
  unsigned char* Vs = Ks + 2 * TILE;       // 2 stages of BC rows
  unsigned long long* full = reinterpret_cast<unsigned long long*>(Vs + 2 * TILE);
  unsigned long long* empty = full + 2;
  const int s = tiles[2 * blockIdx.x], r0 = tiles[2 * blockIdx.x + 1];
  const int kvh = blockIdx.y;
  const int qs = cu[s], q_len = cu[s + 1] - qs, L = ctx_lens[s];
  const int nrows = q_len * G;
  const int tid = threadIdx.x, wg = tid >> 7;
  const int last_row = min(r0 + BR, nrows) - 1;
  const int kv_end = L - q_len + last_row / G + 1;

  wg_stage_q<HD>(Qs, q, ldq, qs, r0, nrows, kvh, G, scale * 1.4426950408889634f, tid, NT);
  if (tid == 0) {
    mbar_init(full, 128); mbar_init(full + 1, 128);   // the producer's threads
    mbar_init(empty, CW); mbar_init(empty + 1, CW);   // the consumers' warps
  }
  fence_async_smem();   // Q, stored by the generic proxy, visible to wgmma
  __syncthreads();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    // 8 consecutive threads on 8 rows: rows 8 k + r7 (r7 = tid & 7), 16-byte columns c0 + 16 i
    // (c0 = tid / 8; a warp: 8 rows x 4 units, swizzled apart: conflict-free). Under the swizzle
    // a thread's units keep their place in a row (r & 7 = r7), so its shared offsets are soff[i]
    // + 1,024 k; its positions' pages are stepped 8 positions at a time (no division a row).
    constexpr int NI = NC / 16;
    const int r7 = tid & 7, c0 = tid >> 3;
    unsigned soff[NI];
#pragma unroll
    for (int i = 0; i < NI; ++i) soff[i] = sw_off<BC>(r7, c0 + 16 * i);
    const int* bt = block_tables + (size_t)s * bt_stride;
    int page = r7 / page_size, in_page = r7 % page_size;   // of position kb + r7
    for (int kb = 0, it = 0; kb < kv_end; kb += BC, ++it) {
      const int b = it & 1;
      unsigned kv_row[BC / 8];   // the cache rows (page * page_size + in_page) of kb + 8 k + r7
#pragma unroll
      for (int k = 0; k < BC / 8; ++k) {
        kv_row[k] = kb + 8 * k + r7 < kv_end ? (unsigned)bt[page] * page_size + in_page : 0u;
        for (in_page += 8; in_page >= page_size; in_page -= page_size) ++page;
      }
      if (it >= 2) mbar_wait(empty + b, ((it >> 1) - 1) & 1);
#pragma unroll
      for (int k = 0; k < BC / 8; ++k) {
        const bool ok = kb + 8 * k + r7 < kv_end;
        const size_t row = ((size_t)kv_row[k] * nkv + kvh) * HD + 8 * c0;
#pragma unroll
        for (int i = 0; i < NI; ++i) {
          const unsigned off = b * TILE + soff[i] + 1024 * k;
          cp_async16_or_zero(Ks + off, kc + row + 128 * i, ok);
          cp_async16_or_zero(Vs + off, vc + row + 128 * i, ok);
        }
      }
      cp_async_mbar_arrive(full + b);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int cw = wg - 1, warp = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = r0 + 64 * cw + 16 * warp + g;   // this thread's rows: row0, row0 + 8
    const WgRows rows(r0 + 64 * cw, row0, nrows, L, q_len, G);
    const unsigned q_a = smem_addr(Qs) + 64 * cw * 128;
    const unsigned k_a = smem_addr(Ks), v_a = smem_addr(Vs);
    float o[NQ][32];
#pragma unroll
    for (int n = 0; n < NQ; ++n)
#pragma unroll
      for (int i = 0; i < 32; ++i) o[n][i] = 0.f;
    float m[2] = {WG_NEG_INF, WG_NEG_INF}, l[2] = {0.f, 0.f};
    for (int kb = 0, it = 0; kb < kv_end; kb += BC, ++it) {
      const int b = it & 1;
      mbar_wait(full + b, (it >> 1) & 1);
      fence_async_smem();   // the producer's cp.async writes, seen here, visible to wgmma
      if (kb < rows.end)
        wg_tile<HD>(q_a, k_a + b * TILE, v_a + b * TILE, kb, rows.first, rows.lim, m, l, o, t);
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + b);   // this warp's MMAs have read the stage
    }
    wg_store<HD>(o, l, row0, nrows, G, qs, kvh, t, out, ldo);
  }
#else
  __trap();   // sm_90a only (the host compiles this module for it)
#endif
}
