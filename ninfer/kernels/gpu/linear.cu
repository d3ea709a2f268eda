// Quantized linear layers over the tensor-core ("mma") layout of ninfer/kernels/mma_layout.py:
// a GEMV for decode-sized T (<= 32 token rows) that reads the packed int4 / int8 codes once
// and multiplies them on the tensor cores, with RMSNorm, SiLU*up and the residual add fused
// into it; element gathers (embedding rows) and an fp16 dequantization (prefill GEMM operand).
// Fragment layout and packing: see mma_layout.py (PTX ISA, "Matrix Fragments for
// mma.m16n8k16 with floating point type"; nibble -> fp16 by OR-ing into the mantissa of 1024,
// as in FasterTransformer / Marlin).
// (common.cuh is prepended by the Python loader.)
// One file over 600 lines on purpose: NVRTC compiles one source per op family (gpu.module),
// and the GEMV kernels share their staging, fragment and ring helpers as inlined templates.

// (SCH_Q4, SCH_Q4M, SCH_Q8: weight schemes, in common.cuh)
#define PRO_PLAIN 0  // activations x (T, K)
#define PRO_NORM 1   // RMSNorm(x) * w folded in: out = rstd(x) * (x * w) @ W^T
#define PRO_SILU 2   // x = (T, 2K) gate | up: activations silu(gate) * up

// d = a * b (C = 0)
__device__ __forceinline__ void mma16816_z(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                           unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%10,%10,%10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));
}
__device__ __forceinline__ unsigned hsub2(unsigned a, unsigned b) {
  unsigned d;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ unsigned hfma2(unsigned a, unsigned b, unsigned c) {
  unsigned d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
// (cp_async16 / cp_async8 / cp_async_commit / cp_async_wait: common.cuh)

// bulk (TMA, one-dimensional) copies, sm_90+ (PTX ISA, "cp.async.bulk"): one thread moves a
// contiguous global range into shared memory, the bytes counted on an mbarrier (common.cuh) that
// the consumers wait on (the async-proxy pipeline of CUTLASS's PipelineTmaAsync, without tensor
// maps). Below sm_90 they compile to nothing (never launched).
// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global src to shared dst,
// completing on bar. The weights are read once per pass: evict them from L2 first.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes,
                                          unsigned long long* bar, unsigned long long policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
      "[%0], [%1], %2, [%3], %4;" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes),
      "r"(smem_addr(bar)), "l"(policy)
      : "memory");
#endif
}
__device__ __forceinline__ unsigned long long evict_first_policy() {
  unsigned long long p = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
#endif
  return p;
}
// v, opaque to the compiler: computed once and kept in a register (not rematerialized).
__device__ __forceinline__ unsigned opaque(unsigned v) {
  asm volatile("mov.b32 %0, %0;" : "+r"(v));
  return v;
}
__device__ __forceinline__ int opaque(int v) { return (int)opaque((unsigned)v); }
// Barrier among the first `threads` threads of the block (named barrier 1).
__device__ __forceinline__ void bar_sync_1(int threads) {
  asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory");
}

// (lo, hi) floats -> f16x2 (lo in the low half).
__device__ __forceinline__ float h2_lo(unsigned w) { return h2f((unsigned short)(w & 0xFFFFu)); }
__device__ __forceinline__ float h2_hi(unsigned w) { return h2f((unsigned short)(w >> 16)); }

// One 32-bit q4 word -> the 4 A registers (fp16 pairs of q - 8, or q with mins). Exact.
template <bool MINS>
__device__ __forceinline__ void dq4(unsigned w, unsigned (&a)[4]) {
  const unsigned lo_bias = MINS ? 0x64006400u : 0x64086408u;  // 1024 | 1032
  const unsigned hi_bias = MINS ? 0xD400D400u : 0xD480D480u;  // -64 | -72
  const unsigned w2 = w >> 8;
  a[0] = hsub2((w & 0x000F000Fu) | 0x64006400u, lo_bias);
  a[1] = hfma2((w & 0x00F000F0u) | 0x64006400u, 0x2C002C00u, hi_bias);  // (1024+16q)/16 - 64|72
  a[2] = hsub2((w2 & 0x000F000Fu) | 0x64006400u, lo_bias);
  a[3] = hfma2((w2 & 0x00F000F0u) | 0x64006400u, 0x2C002C00u, hi_bias);
}
// Two 32-bit q8 words (columns 2t.. and 2t+8..) -> the 4 A registers. Exact.
__device__ __forceinline__ void dq8(unsigned w0, unsigned w1, unsigned (&a)[4]) {
  const unsigned x0 = w0 ^ 0x80808080u, x1 = w1 ^ 0x80808080u;
  a[0] = hsub2(__byte_perm(x0, 0x64646464u, 0x4140), 0x64806480u);  // 1024 + (b + 128) - 1152
  a[1] = hsub2(__byte_perm(x0, 0x64646464u, 0x4342), 0x64806480u);
  a[2] = hsub2(__byte_perm(x1, 0x64646464u, 0x4140), 0x64806480u);
  a[3] = hsub2(__byte_perm(x1, 0x64646464u, 0x4342), 0x64806480u);
}

// silu(g) * u, silu(g) = g / (1 + e^-g): the one expression of the SiLU prologues and of
// gemv_bulk's SwiGLU epilogue, so that both give the same float for the same (g, u).
__device__ __forceinline__ float silu_mul1(float g, float u) { return g / (1.f + __expf(-g)) * u; }

// Two consecutive activations (columns k, k+1) of token row `tok`, after the prologue.
template <int PRO>
__device__ __forceinline__ float2 act2(const float* __restrict__ x, int ldx, int tok, int k,
                                       int K, const float* __restrict__ nw, float& ss) {
  const float* row = x + (size_t)tok * ldx;
  float2 v = *reinterpret_cast<const float2*>(row + k);
  if (PRO == PRO_NORM) {
    ss = fmaf(v.x, v.x, fmaf(v.y, v.y, ss));
    const float2 w = *reinterpret_cast<const float2*>(nw + k);
    v.x *= w.x;
    v.y *= w.y;
  } else if (PRO == PRO_SILU) {
    const float2 u = *reinterpret_cast<const float2*>(row + K + k);
    v.x = silu_mul1(v.x, u.x);
    v.y = silu_mul1(v.y, u.y);
  }
  return v;
}

// ---------------------------------------------------------------------------------------------
// GEMV: out[t, n] (=, or += with ACC) sum_k a[t, k] W[n, k] for t < T <= 8 NT, a = x after the
// prologue PRO. Block = W warps; RT row tiles of 16 rows per block; the warps split K: in each
// step warp w takes chunks kb + W u + w (u < U), whose code and scale loads (one 16-byte load
// per lane per row tile; q8: two) are issued together, one step ahead of the math. Per 32-column segment and
// row tile the segment's code*x sums are made with two mma into a fresh accumulator, then
// scaled by the row's scale in float32 (and, with mins, min * sum x, the sum x taken by an
// mma with an A of ones). The activations enter the B fragments as fp16 (float32
// accumulation):
// - STAGE: the block first converts the T activation rows (prologue applied) into fp16 in
//   shared memory (row stride Kp/2 + 4 words: the 8 token
//   rows of a B fragment fall in distinct banks), while the first step's code loads are in
//   flight; B fragments are then read from shared memory. For RMSNorm the staging also sums
//   x^2 per token; the result is scaled by rstd in the epilogue.
// - otherwise (rows too long for shared memory) each lane loads its float32 activations from
//   global memory (L2) per chunk.
// The W warps' partial sums (and, for PRO_NORM without STAGE, sum x^2) are added through
// shared memory in a fixed order (deterministic).
// Position, within a chunk's 32 words of staged fp16 pairs, of the pair of columns (2w, 2w+1):
// word w = 8 j + 4 h + t (k-tile j, B register h, lane-in-group t) goes to 8 t + 2 j + h, so a
// lane's eight B registers of a chunk are two 16-byte shared-memory loads.
__device__ __forceinline__ int frag_word(int w) {
  return (w & 3) * 8 + (w >> 3) * 2 + ((w >> 2) & 1);
}

// Stage the T activation rows into shared memory as fp16 pairs (prologue applied: RMSNorm
// weight, or silu(gate) * up), zero past K. For PRO_NORM each warp's sum of x^2 per token goes
// to ssq[warp][tok] (rstd is applied in the epilogue).
template <int PRO, int W, int NT>
__device__ __forceinline__ void stage_rows(const float* __restrict__ x, int ldx,
                                           const float* __restrict__ nw, int T, int K, int Kp,
                                           unsigned* __restrict__ xs, int xs_stride,
                                           float (&ssq)[W][NT * 8]) {
  const int K4 = Kp >> 2;
  for (int tok = 0; tok < T; ++tok) {
    const float* row = x + (size_t)tok * ldx;
    float ss = 0.f;
#pragma unroll 4
    for (int c4 = threadIdx.x; c4 < K4; c4 += W * 32) {
      const int k = c4 * 4;
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (k < K) {
        v = *reinterpret_cast<const float4*>(row + k);
        if (PRO == PRO_NORM) {
          ss = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss))));
          const float4 w = *reinterpret_cast<const float4*>(nw + k);
          v.x *= w.x; v.y *= w.y; v.z *= w.z; v.w *= w.w;
        } else if (PRO == PRO_SILU) {
          const float4 u = *reinterpret_cast<const float4*>(row + K + k);
          v.x = silu_mul1(v.x, u.x);
          v.y = silu_mul1(v.y, u.y);
          v.z = silu_mul1(v.z, u.z);
          v.w = silu_mul1(v.w, u.w);
        }
      }
      unsigned* dst = xs + tok * xs_stride + (k >> 6) * 32;
      const int w0 = (k & 63) >> 1;  // word of the pair (k, k+1) within its chunk
      dst[frag_word(w0)] = pack_h2(v.x, v.y);
      dst[frag_word(w0 + 1)] = pack_h2(v.z, v.w);
    }
    if (PRO == PRO_NORM) {
      ss = warp_sum(ss);
      if ((threadIdx.x & 31) == 0) ssq[threadIdx.x >> 5][tok] = ss;
    }
  }
}

// B fragments (fp16 activations) of chunk kc's 4 k-tiles for each 8-token column tile: lane
// (g, t) holds token n * 8 + g's columns 2t, 2t+1 (register 0) and 2t+8, 2t+9 (register 1) of
// each k-tile; tokens >= T are zero. From the staged rows (two 16-byte shared loads per tile):
template <int NT>
__device__ __forceinline__ void b_staged(const unsigned* __restrict__ xs, int xs_stride, int kc,
                                         int g, int t, int T, unsigned (&b)[NT][4][2]) {
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int tok = n * 8 + g;
    uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;
    if (tok < T) {
      const uint4* src = reinterpret_cast<const uint4*>(xs + tok * xs_stride + kc * 32 + t * 8);
      lo = src[0];
      hi = src[1];
    }
    b[n][0][0] = lo.x; b[n][0][1] = lo.y; b[n][1][0] = lo.z; b[n][1][1] = lo.w;
    b[n][2][0] = hi.x; b[n][2][1] = hi.y; b[n][3][0] = hi.z; b[n][3][1] = hi.w;
  }
}
// ... or from global memory (float32, prologue applied here; PRO_NORM adds x^2 to ss).
template <int PRO, int NT>
__device__ __forceinline__ void b_global(const float* __restrict__ x, int ldx,
                                         const float* __restrict__ nw, int kc, int g, int t,
                                         int T, int K, unsigned (&b)[NT][4][2], float (&ss)[NT]) {
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int tok = n * 8 + g;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int k = kc * 64 + 16 * j + 2 * t;
      if (tok < T && kc * 64 + 16 * j < K) {
        const float2 v0 = act2<PRO>(x, ldx, tok, k, K, nw, ss[n]);
        const float2 v1 = act2<PRO>(x, ldx, tok, k + 8, K, nw, ss[n]);
        b[n][j][0] = pack_h2(v0.x, v0.y);
        b[n][j][1] = pack_h2(v1.x, v1.y);
      } else {
        b[n][j][0] = 0u;
        b[n][j][1] = 0u;
      }
    }
  }
}

// With mins: per segment, the sum of x of token columns 2t, 2t+1 (an mma with an A of ones).
template <int NT>
__device__ __forceinline__ void segment_xsum(const unsigned (&b)[NT][4][2],
                                             float (&xsum)[NT][2][4]) {
  const unsigned ones[4] = {0x3C003C00u, 0x3C003C00u, 0x3C003C00u, 0x3C003C00u};
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int sg = 0; sg < 2; ++sg) {
#pragma unroll
      for (int i = 0; i < 4; ++i) xsum[n][sg][i] = 0.f;
      mma16816(xsum[n][sg], ones, b[n][2 * sg][0], b[n][2 * sg][1]);
      mma16816(xsum[n][sg], ones, b[n][2 * sg + 1][0], b[n][2 * sg + 1][1]);
    }
}

// acc (C fragments of one row tile, NT token tiles) += one chunk of packed weights (code words
// q_: this lane's CW 16-byte loads; scale words sw: S of lane group g) times the B fragments b:
// per 32-column segment two mma (fp16 operands, fresh float32 accumulator), then scaled by the
// row's scale in float32; with mins (Q4_1) plus min * the segment's sum x (xsum, from
// segment_xsum; unused otherwise).
template <int SCH, int NT>
__device__ __forceinline__ void mma_chunk(float (&acc)[NT][4], const uint4* q_,
                                          const unsigned* sw, const unsigned (&b)[NT][4][2],
                                          const float (&xsum)[NT][2][4]) {
  constexpr int S = SCH == SCH_Q4M ? 4 : 2;
#pragma unroll
  for (int sg = 0; sg < 2; ++sg) {
    float part[NT][4];
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      const int j = 2 * sg + jj;
      unsigned a[4];
      if (SCH == SCH_Q8) {
        const uint4 q = q_[j >> 1];
        if (j & 1) dq8(q.z, q.w, a); else dq8(q.x, q.y, a);
      } else {
        const uint4 q = q_[0];
        const unsigned w = j == 0 ? q.x : j == 1 ? q.y : j == 2 ? q.z : q.w;
        dq4<SCH == SCH_Q4M>(w, a);
      }
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        if (jj == 0) mma16816_z(part[n], a, b[n][j][0], b[n][j][1]);
        else mma16816(part[n], a, b[n][j][0], b[n][j][1]);
      }
    }
    const float s_lo = h2_lo(sw[sg]), s_hi = h2_hi(sw[sg]);
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      acc[n][0] = fmaf(s_lo, part[n][0], acc[n][0]);
      acc[n][1] = fmaf(s_lo, part[n][1], acc[n][1]);
      acc[n][2] = fmaf(s_hi, part[n][2], acc[n][2]);
      acc[n][3] = fmaf(s_hi, part[n][3], acc[n][3]);
    }
    if (SCH == SCH_Q4M) {
      const unsigned mw = sw[S > 2 ? 2 + sg : 0];
      const float m_lo = h2_lo(mw), m_hi = h2_hi(mw);
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        acc[n][0] = fmaf(m_lo, xsum[n][sg][0], acc[n][0]);
        acc[n][1] = fmaf(m_lo, xsum[n][sg][1], acc[n][1]);
        acc[n][2] = fmaf(m_hi, xsum[n][sg][2], acc[n][2]);
        acc[n][3] = fmaf(m_hi, xsum[n][sg][3], acc[n][3]);
      }
    }
  }
}

// Code and scale words of a block's RT row tiles for U chunks per warp: warp w of W takes
// chunks kb + W u + w (one 16-byte code load per lane per row tile, q8: two; scale words of
// lane group g). Chunks past KC read as zero.
template <int SCH, int RT, int U, int W>
struct ChunkLoader {
  static constexpr int S = SCH == SCH_Q4M ? 4 : 2;  // scale words per (chunk, g)
  static constexpr int CW = SCH == SCH_Q8 ? 2 : 1;  // 16-byte code loads per (chunk, tile, lane)
  const uint4* cbase[RT];
  const unsigned* sbase[RT];
  int KC, warp;

  __device__ __forceinline__ ChunkLoader(const uint4* __restrict__ codes,
                                         const unsigned* __restrict__ scales, int rt0, int N16,
                                         int KC_, int warp_, int lane)
      : KC(KC_), warp(warp_) {
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      const int rt = min(rt0 + r, N16 - 1);
      cbase[r] = codes + ((size_t)rt * KC + warp) * (CW * 32) + lane;
      sbase[r] = scales + ((size_t)rt * KC + warp) * (8 * S) + (lane >> 2) * S;
    }
  }
  __device__ __forceinline__ void load(int kb, uint4 (&c_)[U][RT][CW],
                                       unsigned (&s_)[U][RT][S]) const {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int off = kb + W * u;  // chunk kb + W u + warp
      const bool ok = off + warp < KC;
#pragma unroll
      for (int r = 0; r < RT; ++r) {
#pragma unroll
        for (int c = 0; c < CW; ++c)
          c_[u][r][c] = ok ? __ldg(cbase[r] + off * (CW * 32) + c * 32) : make_uint4(0, 0, 0, 0);
        const unsigned* sp = sbase[r] + off * (8 * S);
        if constexpr (S == 4) {
          const uint4 v = ok ? __ldg(reinterpret_cast<const uint4*>(sp)) : make_uint4(0, 0, 0, 0);
          s_[u][r][0] = v.x; s_[u][r][1] = v.y; s_[u][r][2] = v.z; s_[u][r][3] = v.w;
        } else {
          const uint2 v = ok ? __ldg(reinterpret_cast<const uint2*>(sp)) : make_uint2(0, 0);
          s_[u][r][0] = v.x; s_[u][r][1] = v.y;
        }
      }
    }
  }

  // The prefetched step becomes the current one (register pipeline).
  __device__ __forceinline__ static void advance(uint4 (&c_)[U][RT][CW], unsigned (&s_)[U][RT][S],
                                                 const uint4 (&nc)[U][RT][CW],
                                                 const unsigned (&ns)[U][RT][S]) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < RT; ++r) {
#pragma unroll
        for (int c = 0; c < CW; ++c) c_[u][r][c] = nc[u][r][c];
#pragma unroll
        for (int c = 0; c < S; ++c) s_[u][r][c] = ns[u][r][c];
      }
  }

  // Shared-memory ring (gemv_mma with STAGES > 0): one step of U chunks is STEP_BYTES per
  // warp: per (u, r) the lanes' code words ([c][lane] 16 bytes each), then their scale words.
  // Each lane copies and later reads back only its own bytes, so the thread's own
  // cp.async.wait_group orders them (no barrier). Chunks past KC are not copied (never read).
  static constexpr int SLOT = CW * 32 * 16 + 32 * S * 4;
  static constexpr int STEP_BYTES = U * RT * SLOT;
  __device__ __forceinline__ void issue(int kb, unsigned char* dst, int lane) const {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int off = kb + W * u;
      if (off + warp >= KC) continue;
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        unsigned char* d = dst + (u * RT + r) * SLOT;
#pragma unroll
        for (int c = 0; c < CW; ++c)
          cp_async16(d + (c * 32 + lane) * 16, cbase[r] + off * (CW * 32) + c * 32);
        const unsigned* sp = sbase[r] + off * (8 * S);
        if constexpr (S == 4) cp_async16(d + CW * 512 + lane * 16, sp);
        else cp_async8(d + CW * 512 + lane * 8, sp);
      }
    }
  }
  __device__ __forceinline__ void read(const unsigned char* src, int lane,
                                       uint4 (&c_)[U][RT][CW], unsigned (&s_)[U][RT][S]) const {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        const unsigned char* d = src + (u * RT + r) * SLOT;
#pragma unroll
        for (int c = 0; c < CW; ++c)
          c_[u][r][c] = *reinterpret_cast<const uint4*>(d + (c * 32 + lane) * 16);
        if constexpr (S == 4) {
          const uint4 v = *reinterpret_cast<const uint4*>(d + CW * 512 + lane * 16);
          s_[u][r][0] = v.x; s_[u][r][1] = v.y; s_[u][r][2] = v.z; s_[u][r][3] = v.w;
        } else {
          const uint2 v = *reinterpret_cast<const uint2*>(d + CW * 512 + lane * 8);
          s_[u][r][0] = v.x; s_[u][r][1] = v.y;
        }
      }
  }
};

// Add the W warps' partial sums acc (warps 1..W-1 through shared memory in a fixed order,
// warp 0 finishes: deterministic) and write out[tok, row] (=, or += with ACC); with PRO_NORM
// each token's sum x^2 (ssq, per warp) gives the rstd applied here.
template <int NT, int RT, int W, int PRO, bool ACC>
__device__ __forceinline__ void gemv_finish(const float (&acc)[RT][NT][4],
                                            const float (&ssq)[W][NT * 8], int rt0, int N16,
                                            int N, int T, int K, float eps,
                                            float* __restrict__ out, int ldo) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  __shared__ float red[W - 1][RT * NT * 4][32];
  if (warp > 0) {
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[warp - 1][(r * NT + n) * 4 + i][lane] = acc[r][n][i];
  }
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    float rs[2] = {1.f, 1.f};
    if (PRO == PRO_NORM) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = n * 8 + 2 * t + e;
        float sum = 0.f;
        if (c < T)
#pragma unroll
          for (int w = 0; w < W; ++w) sum += ssq[w][c];
        rs[e] = rsqrtf(sum / (float)K + eps);
      }
    }
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      if (rt0 + r >= N16) continue;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int idx = (r * NT + n) * 4 + i;
        float v = acc[r][n][i];
#pragma unroll
        for (int w = 0; w < W - 1; ++w) v += red[w][idx][lane];
        const int row = (rt0 + r) * 16 + g + (i >= 2 ? 8 : 0);
        const int tok = n * 8 + 2 * t + (i & 1);
        if (row < N && tok < T) {
          float* o = out + (size_t)tok * ldo + row;
          const float y = v * rs[i & 1];
          if (ACC) *o += y; else *o = y;
        }
      }
    }
  }
}

template <int SCH, int NT, int RT, int W, int U, int PRO, bool ACC, bool STAGE, int STAGES>
__global__ void __launch_bounds__(W * 32)
gemv_mma(const float* __restrict__ x, int ldx, const float* __restrict__ nw, float eps,
         const uint4* __restrict__ codes, const unsigned* __restrict__ scales,
         float* __restrict__ out, int ldo, int T, int N, int K) {
  pdl_trigger();  // the next kernel may start (it waits for this one)
  constexpr int S = SCH == SCH_Q4M ? 4 : 2;       // scale words per (chunk, g)
  constexpr int CW = SCH == SCH_Q8 ? 2 : 1;       // 16-byte code loads per (chunk, tile, lane)
  extern __shared__ unsigned smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int KC = (K + 63) >> 6, N16 = (N + 15) >> 4, Kp = KC * 64;
  const int xs_stride = Kp / 2 + 4;
  unsigned* xs = smem;                          // STAGE: T rows of fp16 pairs
  __shared__ float ssq[W][NT * 8];              // PRO_NORM: per-warp sum x^2 per token
  const int rt0 = blockIdx.x * RT;

  float acc[RT][NT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][n][i] = 0.f;
  float ss[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) ss[n] = 0.f;

  // code / scale loads of one step (U chunks); the next step's are issued before this step's
  // math (software pipelining: two steps of loads in flight per warp)
  // With STAGES > 0 the steps go through a per-warp shared-memory ring of STAGES steps
  // (cp.async, STAGES - 1 steps in flight ahead of the math, no registers held for them);
  // otherwise through registers, one step ahead.
  using LD = ChunkLoader<SCH, RT, U, W>;
  const LD ld(codes, scales, rt0, N16, KC, warp, lane);
  uint4 cw[U][RT][CW], nc[U][RT][CW];
  unsigned sw[U][RT][S], ns[U][RT][S];
  [[maybe_unused]] unsigned char* ring = reinterpret_cast<unsigned char*>(
      smem + (STAGE ? ((T * xs_stride + 3) & ~3) : 0)) + warp * (STAGES * LD::STEP_BYTES);
  // weights: not written by any kernel, so loaded before pdl_wait
  if constexpr (STAGES > 0) {
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
      ld.issue(st * W * U, ring + st * LD::STEP_BYTES, lane);
      cp_async_commit();
    }
  } else {
    ld.load(0, cw, sw);
  }
  pdl_wait();
  if (STAGE) {  // while the first steps' loads are in flight
    stage_rows<PRO, W, NT>(x, ldx, nw, T, K, Kp, xs, xs_stride, ssq);
    __syncthreads();
  }
  [[maybe_unused]] int slot = 0;
  for (int kb = 0; kb < KC; kb += W * U) {
    const bool more = kb + W * U < KC;  // uniform over the block
    if constexpr (STAGES > 0) {
      const int kn = kb + (STAGES - 1) * W * U;
      if (kn < KC)  // into the slot read in the previous step (its registers already used)
        ld.issue(kn, ring + (slot == 0 ? STAGES - 1 : slot - 1) * LD::STEP_BYTES, lane);
      cp_async_commit();
      cp_async_wait<STAGES - 1>();
      ld.read(ring + slot * LD::STEP_BYTES, lane, cw, sw);
      slot = slot + 1 == STAGES ? 0 : slot + 1;
    } else if (more) {
      ld.load(kb + W * U, nc, ns);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kc = kb + W * u + warp;
      if (kc >= KC) break;  // uniform over the warp
      unsigned b[NT][4][2];
      if constexpr (STAGE) b_staged<NT>(xs, xs_stride, kc, g, t, T, b);
      else b_global<PRO, NT>(x, ldx, nw, kc, g, t, T, K, b, ss);
      float xsum[NT][2][4];
      if (SCH == SCH_Q4M) segment_xsum<NT>(b, xsum);
#pragma unroll
      for (int r = 0; r < RT; ++r) mma_chunk<SCH, NT>(acc[r], cw[u][r], sw[u][r], b, xsum);
    }
    if (STAGES == 0 && more) ld.advance(cw, sw, nc, ns);
  }

  if (PRO == PRO_NORM && !STAGE) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      float v = ss[n];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      if (t == 0) ssq[warp][n * 8 + g] = v;
    }
  }
  gemv_finish<NT, RT, W, PRO, ACC>(acc, ssq, rt0, N16, N, T, K, eps, out, ldo);
}

// ---------------------------------------------------------------------------------------------
// GEMV with int8 activations ("q8a"), for decode (T <= 8 token rows): the activations (prologue
// applied) are quantized per 32-column segment to int8 (d = amax / 127, q = rint(a * 127 /
// amax), as llama.cpp's q8_1 for its mmvq kernels), and the codes are multiplied on the integer
// tensor cores with mma.sync m16n8k32 (u8 q4 codes or s8 q8 codes times s8 activations, int32
// accumulation: exact), one mma per row tile and segment, scaled in float32 by the weight
// scale and d. This halves the per-weight work of gemv_mma (2 lop3 per 8 q4 codes, no fp16
// conversion, k = 32 per mma) at the cost of rounding the activations to 8 bits.
// k order: the packed q4 word of k-tile j (mma_layout.py) holds, for row g, the codes of columns
// 2t, 2t+8, 2t+1, 2t+9 in nibbles 0, 2, 4, 6 and for row g+8 in nibbles 1, 3, 5, 7, so
// w & 0x0F0F0F0F is an A register of row g (4 u8 codes) and w & 0xF0F0F0F0 one of row g+8
// (u8 16 q: its scale is divided by 16). The mma's k index 4t + b (b < 4) of a segment stands
// for column (2t, 2t+8, 2t+1, 2t+9)[b] of its first k-tile and 16 + 4t + b for the same of its
// second; q8 words are permuted into that order with prmt; the staged activations are stored
// in it (word 4t + 2 sg + h of a chunk: segment sg, k-tile half h).
// Shared memory: T rows (stride xs_stride words, = 16 mod 32: conflict-free B loads) of KC * 16
// words of int8 activations, then per (chunk, token) 4 floats: segment 0's d and dbias,
// segment 1's (dbias = -8 d sum q for Q4_0, d sum q for Q4_1 (times the mins), 0 for q8).
#define IMMA_ASM asm volatile
template <int SCH>
__device__ __forceinline__ void imma16832(int (&d)[4], const unsigned (&a)[4], unsigned b0,
                                          unsigned b1) {
  if constexpr (SCH == SCH_Q8) {
    IMMA_ASM(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%10,%10,%10};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
  } else {
    IMMA_ASM(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%10,%10,%10};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
  }
}

// Quantize and stage the staged words [w_begin, w_end) (multiples of 16: whole chunks) of token
// row `tok` (see above). Four lanes take a 32-column segment s (chunk s / 2, segment s % 2),
// lane quarter r its 8 contiguous columns 8 r .. 8 r + 7 (two 16-byte loads where the rows are
// 16-byte aligned, else four of 8), so that a load instruction reads whole lines; the segment's
// max and code sum take two shuffles each. A word (columns 2t, 2t + 8, 2t + 1, 2t + 9 of half
// h = r / 2) holds codes of lanes 2h and 2h + 1: one shuffle swaps their halves, the even lane
// writes words t = 0, 1 and the odd one t = 2, 3; lane 0 the segment's meta. A warp's pass
// covers 8 segments and the W warps share the passes, U of them with their loads issued
// together (registers: 4 for plain rows, 2 with a prologue's second operand, 1 where UNR = 1);
// PRO_NORM adds this thread's x^2 to ss. The words and meta do not depend on the split.
template <int SCH, int PRO, int W, int UNR, bool CG = false>
__device__ __forceinline__ void stage_q8_words(const float* __restrict__ row,
                                               const float* __restrict__ nw, int K, int T,
                                               int tok, int w_begin, int w_end,
                                               unsigned* __restrict__ xrow,
                                               float* __restrict__ meta, float& ss) {
  constexpr bool AUX = PRO == PRO_NORM || PRO == PRO_SILU;
  constexpr bool ACG = CG && PRO == PRO_SILU;  // the norm weight: a plain load (never written)
  constexpr int U = UNR == 1 ? 1 : AUX ? 2 : 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r = lane & 3;
  const int s_begin = w_begin >> 3, s_end = w_end >> 3;
  // 16-byte loads where every lane's 8 floats are 16-byte aligned (the same for the block)
  const size_t al = reinterpret_cast<size_t>(row) |
                    (PRO == PRO_NORM ? reinterpret_cast<size_t>(nw) : 0) |
                    (PRO == PRO_SILU ? (size_t)K * 4 : 0);
  const bool v4 = (al & 15) == 0;
  for (int sb = s_begin + warp * 8; sb < s_end; sb += W * 8 * U) {  // uniform over the warp
    float4 raw[U][2], aux[AUX ? U : 1][2];  // x's 8 columns; the norm weight or up
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const int s = sb + i * W * 8 + (lane >> 2), c = 32 * s + 8 * r;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        raw[i][j] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (AUX) aux[i][j] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
      if (s < s_end && c < K) {
        const float* a = PRO == PRO_NORM ? nw + c : row + K + c;  // (AUX only)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          raw[i][j] = ld_f4_any<CG>(row + c + 4 * j, v4);
          if (AUX) aux[i][j] = ld_f4_any<ACG>(a + 4 * j, v4);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < U; ++i) {
      if (sb + i * W * 8 >= s_end) break;  // uniform over the warp
      const int s = sb + i * W * 8 + (lane >> 2);
      float v[8] = {raw[i][0].x, raw[i][0].y, raw[i][0].z, raw[i][0].w,
                    raw[i][1].x, raw[i][1].y, raw[i][1].z, raw[i][1].w};
      if constexpr (AUX) {
        const float u[8] = {aux[i][0].x, aux[i][0].y, aux[i][0].z, aux[i][0].w,
                            aux[i][1].x, aux[i][1].y, aux[i][1].z, aux[i][1].w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (PRO == PRO_NORM) {
            ss = fmaf(v[j], v[j], ss);
            v[j] *= u[j];
          } else {
            v[j] = silu_mul1(v[j], u[j]);
          }
        }
      }
      float amax = fabsf(v[0]);  // (from a value, not 0: an all-NaN segment stays NaN, as before)
#pragma unroll
      for (int j = 1; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int q[8], sq = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        q[j] = q8_rint(v[j] * inv);
        sq += q[j];
      }
      if (SCH != SCH_Q8) {
        sq += __shfl_xor_sync(0xffffffffu, sq, 1);
        sq += __shfl_xor_sync(0xffffffffu, sq, 2);
      }
      // codes of columns 0-3 and 4-7 of this lane's 8; the even lane of a half keeps its
      // 0-3 and takes the odd one's, the odd lane its 4-7 and the even one's
      const unsigned p0 = (unsigned)(q[0] & 255) | (unsigned)(q[1] & 255) << 8 |
                          (unsigned)(q[2] & 255) << 16 | (unsigned)(q[3] & 255) << 24;
      const unsigned p1 = (unsigned)(q[4] & 255) | (unsigned)(q[5] & 255) << 8 |
                          (unsigned)(q[6] & 255) << 16 | (unsigned)(q[7] & 255) << 24;
      const bool odd = r & 1;
      const unsigned other = __shfl_xor_sync(0xffffffffu, odd ? p0 : p1, 1);
      const unsigned a = odd ? other : p0, b = odd ? p1 : other;  // columns 2t.. and 2t + 8..
      if (s < s_end) {
        unsigned* wp = xrow + (s >> 1) * 16 + (odd ? 8 : 0) + 2 * (s & 1) + (r >> 1);
        wp[0] = __byte_perm(a, b, 0x5140);  // a0 b0 a1 b1: word t (0 or 2)
        wp[4] = __byte_perm(a, b, 0x7362);  // a2 b2 a3 b3: word t + 1
        if (r == 0) {
          const float d = amax / 127.f;
          const float db = SCH == SCH_Q4 ? d * (-8.f * (float)sq)
                           : SCH == SCH_Q4M ? d * (float)sq : 0.f;
          float* m = meta + ((size_t)(s >> 1) * T + tok) * 4 + 2 * (s & 1);
          m[0] = d;
          m[1] = db;
        }
      }
    }
  }
}

// Quantize and stage the T activation rows (see above), UNR passes' loads at once; for
// PRO_NORM each warp's sum of x^2 per token goes to ssq[warp][tok]. CG: x through L2 only.
template <int SCH, int PRO, int W, int UNR, bool CG = false>
__device__ __forceinline__ void stage_q8(const float* __restrict__ x, int ldx,
                                         const float* __restrict__ nw, int T, int K, int KC,
                                         unsigned* __restrict__ xs, int xs_stride,
                                         float* __restrict__ meta, float (&ssq)[W][8]) {
  for (int tok = 0; tok < T; ++tok) {
    float ss = 0.f;
    stage_q8_words<SCH, PRO, W, UNR, CG>(x + (size_t)tok * ldx, nw, K, T, tok, 0, KC * 16,
                                xs + tok * xs_stride, meta, ss);
    if (PRO == PRO_NORM) {
      ss = warp_sum(ss);
      if ((threadIdx.x & 31) == 0) ssq[threadIdx.x >> 5][tok] = ss;
    }
  }
}

// gemv_bulk_mt's staged rows, made once for all its blocks (PREQ): block `tok` quantizes token
// row tok into pre (T rows of xs_stride words, then the (chunk, token) meta, then T floats: each
// token's RMSNorm rstd, 1 without PRO_NORM) with the W warps and passes gemv_bulk_mt's own
// staging uses, so the words, meta and rstd are the same bits it would stage itself.
template <int SCH, int PRO, int W>
__global__ void __launch_bounds__(W * 32)
stage_rows_q8(const float* __restrict__ x, int ldx, const float* __restrict__ nw, float eps,
              int T, int K, unsigned* __restrict__ pre) {
  pdl_trigger();  // gemv_bulk_mt may start streaming its weights (it waits for this kernel)
  pdl_wait();     // launched with PDL: x comes from earlier kernels
  __shared__ float ssq[W];
  const int tok = blockIdx.x, KC = (K + 63) >> 6;
  const int xs_stride = KC * 16 + ((KC & 1) ? 0 : 16);
  float* meta = reinterpret_cast<float*>(pre + T * xs_stride);
  float ss = 0.f;
  stage_q8_words<SCH, PRO, W, 4>(x + (size_t)tok * ldx, nw, K, T, tok, 0, KC * 16,
                                 pre + tok * xs_stride, meta, ss);
  if (PRO == PRO_NORM) {
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) ssq[threadIdx.x >> 5] = ss;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    float rs = 1.f;
    if (PRO == PRO_NORM) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < W; ++w) sum += ssq[w];
      rs = rsqrtf(sum / (float)K + eps);
    }
    meta[(size_t)KC * T * 4 + tok] = rs;
  }
}

// The A fragment of segment sg (32 columns) of one chunk of packed weights (code words q_: this
// lane's CW 16-byte loads): int8 codes, or for q4 the low nibbles (row g) and the high nibbles
// in place (row g + 8, 16 q: its sums are scaled by 1 / 16).
template <int SCH>
__device__ __forceinline__ void q8a_fragment(const uint4* q_, int sg, unsigned (&a)[4]) {
  if constexpr (SCH == SCH_Q8) {
    const uint4 q = q_[sg];
    a[0] = __byte_perm(q.x, q.y, 0x5140); a[1] = __byte_perm(q.x, q.y, 0x7362);
    a[2] = __byte_perm(q.z, q.w, 0x5140); a[3] = __byte_perm(q.z, q.w, 0x7362);
  } else {
    const uint4 q = q_[0];
    const unsigned w0 = sg ? q.z : q.x, w1 = sg ? q.w : q.y;
    a[0] = w0 & 0x0F0F0F0Fu; a[1] = w0 & 0xF0F0F0F0u;
    a[2] = w1 & 0x0F0F0F0Fu; a[3] = w1 & 0xF0F0F0F0u;
  }
}

// acc (C fragment of one row tile) += one chunk of packed weights (code words q_: this lane's
// CW 16-byte loads; scale words sw: S of lane group g) times int8 activations: bq = this lane's
// B words (segment 0: x, y; segment 1: z, w), md[e] = (d, dbias) of segments 0, 1 for token
// column 2t + e. T1: every column is token 0's (only e = 0 is used).
template <int SCH, bool T1>
__device__ __forceinline__ void q8a_chunk(float (&acc)[4], const uint4* q_, const unsigned* sw,
                                          uint4 bq, const float4 (&md)[2]) {
#pragma unroll
  for (int sg = 0; sg < 2; ++sg) {
    unsigned a[4];
    q8a_fragment<SCH>(q_, sg, a);
    int c[4];
    imma16832<SCH>(c, a, sg ? bq.z : bq.x, sg ? bq.w : bq.y);
    const float s_lo = h2_lo(sw[sg]), s_hi = h2_hi(sw[sg]);
    float m_lo = 0.f, m_hi = 0.f;
    if constexpr (SCH == SCH_Q4M) {
      m_lo = h2_lo(sw[2 + sg]);
      m_hi = h2_hi(sw[2 + sg]);
    }
#pragma unroll
    for (int e = 0; e < (T1 ? 1 : 2); ++e) {
      const float d = sg ? md[e].z : md[e].x, db = sg ? md[e].w : md[e].y;
      if constexpr (SCH == SCH_Q4M) {  // row g+8 holds 16 q
        acc[e] = fmaf(s_lo, (float)c[e] * d, fmaf(m_lo, db, acc[e]));
        acc[2 + e] = fmaf(s_hi, (float)c[2 + e] * (d * 0.0625f), fmaf(m_hi, db, acc[2 + e]));
      } else if constexpr (SCH == SCH_Q4) {
        acc[e] = fmaf(s_lo, fmaf((float)c[e], d, db), acc[e]);
        acc[2 + e] = fmaf(s_hi, fmaf((float)c[2 + e], d * 0.0625f, db), acc[2 + e]);
      } else {
        acc[e] = fmaf(s_lo, (float)c[e] * d, acc[e]);
        acc[2 + e] = fmaf(s_hi, (float)c[2 + e] * d, acc[2 + e]);
      }
    }
  }
}

// gemv_bulk's chunk (T = 1): q8a_chunk<SCH, true> with its float scale math done once per (row,
// segment) instead of by all four lanes t of a row (with T = 1 every C column holds the same
// value): lane t takes row g + 8 (t & 1) of segment t >> 1, so acc is this lane's partial of
// that row over the segments of its parity (bulk_tile_partials adds lanes t and t ^ 2): about
// a third fewer instructions a chunk. Not bit-identical to q8a_chunk (another order of the
// float sums).
template <int SCH>
__device__ __forceinline__ void q8a_chunk_split(float& acc, const uint4* q_, unsigned sw,
                                                unsigned mw, uint4 bq, float2 md, float hf,
                                                bool hi, int s1) {
  // sw, mw: this lane's scale (and min) in the low half; md: (d, dbias) of its segment; hf:
  // 1 / 16 for row g + 8 (16 q), else 1
  int c[2][4];
#pragma unroll
  for (int sg = 0; sg < 2; ++sg) {
    unsigned a[4];
    q8a_fragment<SCH>(q_, sg, a);
    imma16832<SCH>(c[sg], a, sg ? bq.z : bq.x, sg ? bq.w : bq.y);
  }
  const int c_lo = s1 ? c[1][0] : c[0][0], c_hi = s1 ? c[1][2] : c[0][2];
  const float ci = (float)(hi ? c_hi : c_lo), s = h2_lo(sw), d = md.x * hf;
  if constexpr (SCH == SCH_Q4M) {
    acc = fmaf(s, ci * d, fmaf(h2_lo(mw), md.y, acc));
  } else if constexpr (SCH == SCH_Q4) {
    acc = fmaf(s, fmaf(ci, d, md.y), acc);
  } else {
    acc = fmaf(s, ci * d, acc);
  }
}

// out[t, n] (=, or += with ACC) sum_k a[t, k] W[n, k] for t < T <= 8 with int8 activations (see
// above). Block = W warps, RT row tiles of 16 rows; warps split K as in gemv_mma, loads one step
// ahead of the math. T1: T = 1 (every B column and every lane's meta is token 0's).
template <int SCH, int RT, int W, int U, int PRO, bool ACC, bool T1>
__global__ void __launch_bounds__(W * 32)
gemv_q8a(const float* __restrict__ x, int ldx, const float* __restrict__ nw, float eps,
         const uint4* __restrict__ codes, const unsigned* __restrict__ scales,
         float* __restrict__ out, int ldo, int T, int N, int K) {
  pdl_trigger();  // the next kernel may start (it waits for this one)
  using LD = ChunkLoader<SCH, RT, U, W>;
  constexpr int S = LD::S, CW = LD::CW;
  extern __shared__ unsigned smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int KC = (K + 63) >> 6, N16 = (N + 15) >> 4;
  const int xs_stride = KC * 16 + ((KC & 1) ? 0 : 16);  // = 16 (mod 32)
  unsigned* xs = smem;
  const float* meta = reinterpret_cast<const float*>(smem + T * xs_stride);
  __shared__ float ssq[W][8];
  const int rt0 = blockIdx.x * RT;
  float acc[RT][1][4];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[r][0][i] = 0.f;

  const LD ld(codes, scales, rt0, N16, KC, warp, lane);
  uint4 cw[U][RT][CW], nc[U][RT][CW];
  unsigned sw[U][RT][S], ns[U][RT][S];
  ld.load(0, cw, sw);  // weights: not written by any kernel, so before pdl_wait
  pdl_wait();
  stage_q8<SCH, PRO, W, 1>(x, ldx, nw, T, K, KC, xs, xs_stride,
                        reinterpret_cast<float*>(smem + T * xs_stride), ssq);
  __syncthreads();
  const int tb = T1 ? 0 : min(g, T - 1);  // token of this lane's B column
  const int te[2] = {T1 ? 0 : min(2 * t, T - 1), T1 ? 0 : min(2 * t + 1, T - 1)};
  for (int kb = 0; kb < KC; kb += W * U) {
    const bool more = kb + W * U < KC;  // uniform over the block
    if (more) ld.load(kb + W * U, nc, ns);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kc = kb + W * u + warp;
      if (kc >= KC) break;  // uniform over the warp
      const uint4 bq = *reinterpret_cast<const uint4*>(xs + tb * xs_stride + kc * 16 + 4 * t);
      float4 md[2];  // (d, dbias) of segments 0, 1 for token columns 2t, 2t + 1
      md[0] = *reinterpret_cast<const float4*>(meta + ((size_t)kc * T + te[0]) * 4);
      if (!T1) md[1] = *reinterpret_cast<const float4*>(meta + ((size_t)kc * T + te[1]) * 4);
#pragma unroll
      for (int r = 0; r < RT; ++r) q8a_chunk<SCH, T1>(acc[r][0], cw[u][r], sw[u][r], bq, md);
    }
    if (more) ld.advance(cw, sw, nc, ns);
  }
  gemv_finish<1, RT, W, PRO, ACC>(acc, ssq, rt0, N16, N, T, K, eps, out, ldo);
}

// ---------------------------------------------------------------------------------------------
// Streaming GEMV for one token row (batch-1 decode), sm_90+: out[n] (=, or += with ACC)
// sum_k a[k] W[n, k], a = x after the prologue PRO. Built for the memory roofline: a
// persistent grid (one or two blocks per multiprocessor) in which block b owns the contiguous
// 16-row tiles [b N16 / G, (b + 1) N16 / G) (G = gridDim.x), so its codes and scales are two
// contiguous byte ranges. One producer thread (warp W) streams them through a ring of NS
// shared-memory slots with bulk copies (cp.async.bulk, CPS = W * UPW chunks of one tile per
// slot, NS - 1 slots in flight: the bytes in flight that a load-per-lane GEMV lacks), from the
// kernel's start (weights are never written, so before pdl_wait). W consumer warps stage the
// activations (fp16 for mma_chunk, or int8 for q8a_chunk with Q8A) and multiply: warp w takes
// chunks w + W u of each slot; after a tile's last slot the warps' partial sums are added in a
// fixed order and written (deterministic). (The whole row is staged first: staging it slot by slot
// costs one L2 round trip a slot.)
// Slots are announced through "full" mbarriers (transaction bytes) and handed back through
// "empty" ones (one arrival per consumer warp). Shared memory (dynamic): the ring (NS * SLOT
// bytes), 2 NS mbarriers (in 32 NS bytes), the staged activations; linear.bulk_config may
// request more, to limit the blocks per multiprocessor.
template <int SCH, int W, int UPW>
struct BulkRing {
  static constexpr int S = SCH == SCH_Q4M ? 4 : 2;   // scale words per (chunk, g)
  static constexpr int CW = SCH == SCH_Q8 ? 2 : 1;   // 16-byte code words per (chunk, lane)
  static constexpr int CPS = W * UPW;                 // chunks per slot
  static constexpr int CB = CW * 512, SB = 8 * S * 4; // code / scale bytes per chunk
  static constexpr int SLOT = CPS * (CB + SB);
};

// The dynamic shared memory of gemv_bulk: the ring's NS slots, its 2 NS mbarriers ("full", then
// "empty": 32 NS bytes), then the staged row.
template <int SCH, int W, int UPW, int NS>
__device__ __forceinline__ void bulk_smem_layout(void* base, unsigned char*& ring,
                                                 unsigned long long*& full,
                                                 unsigned long long*& empty, unsigned*& xs) {
  ring = static_cast<unsigned char*>(base);
  full = reinterpret_cast<unsigned long long*>(ring + NS * BulkRing<SCH, W, UPW>::SLOT);
  empty = full + NS;
  xs = reinterpret_cast<unsigned*>(ring + NS * BulkRing<SCH, W, UPW>::SLOT + 32 * NS);
}

// The ring's mbarriers: "full" (one arrival, the producer's, plus the bulk copies' bytes) and
// "empty" (one arrival per consumer warp) per slot; then a block barrier.
template <int NS, int W>
__device__ __forceinline__ void bulk_ring_init(unsigned long long* full,
                                               unsigned long long* empty) {
  if (threadIdx.x == 0)
    for (int i = 0; i < NS; ++i) {
      mbar_init(full + i, 1);
      mbar_init(empty + i, W);
    }
  __syncthreads();
}

// Row tiles [begin, end) of block b of G in the static split of N16 tiles.
__device__ __forceinline__ int2 bulk_tiles(int N16, int b, int G) {
  return make_int2((int)((long long)b * N16 / G), (int)((long long)(b + 1) * N16 / G));
}

// Producer side (one thread): the slots of row tiles [rt_begin, rt_begin + steps / spt) of one
// weight, ring step numbers continuing from gs (slot gs % NS, phase gs / NS), so that one
// producer can stream several weights back to back (a SwiGLU gate tile, then its up tile).
template <int SCH, int W, int UPW, int NS>
__device__ __forceinline__ void bulk_produce(const unsigned char* __restrict__ codes,
                                             const unsigned char* __restrict__ scales,
                                             int rt_begin, int steps, int spt, int KC,
                                             unsigned char* ring, unsigned long long* full,
                                             unsigned long long* empty, int& gs,
                                             unsigned long long policy) {
  using R = BulkRing<SCH, W, UPW>;
  constexpr int CPS = R::CPS, CB = R::CB, SB = R::SB;
  // ring position and (row tile, slot of the tile) kept as counters: no division per slot
  int slot = gs % NS, j = 0;
  unsigned par = ((gs / NS) & 1) ^ 1;  // parity of the empty phase to wait for
  const unsigned char* cp = codes + (size_t)rt_begin * KC * CB;
  const unsigned char* sp = scales + (size_t)rt_begin * KC * SB;
  for (int s = 0; s < steps; ++s, ++gs) {
    if (gs >= NS) mbar_wait(empty + slot, par);
    const int kc0 = j * CPS, nch = min(CPS, KC - kc0);
    mbar_arrive_expect(full + slot, nch * (CB + SB));
    bulk_load(ring + slot * R::SLOT, cp, nch * CB, full + slot, policy);
    bulk_load(ring + slot * R::SLOT + CPS * CB, sp, nch * SB, full + slot, policy);
    cp += nch * CB;  // a row tile's chunks are contiguous, and so are the tiles
    sp += nch * SB;
    if (++j == spt) j = 0;
    if (++slot == NS) { slot = 0; par ^= 1; }
  }
}

// The end of a group of gn row tiles in gemv_bulk (tiles gt0 .. gt0 + gn - 1 of the block's
// order, bulk_consume): red holds each warp's partial sums of each tile ([gn][W][16]); the W
// warps add them (the same order as one warp would: w = 0, 1, ...) and write the rows: y * rs,
// plus the residual with ACC (resid: this thread's row of the block's first group, loaded
// early), or silu(gate) * up with SWIGLU (tiles gate, up of each pair in turn). QOUT: warp w
// quantizes the 32 rows it wrote (the group's segment w; qnw: this thread's norm weight in the
// first group) into the shadow.
template <bool ACC, int W, bool CG, bool SWIGLU, bool QOUT>
__device__ __forceinline__ void bulk_group_out(const float* red, int gt0, int gn, float rs,
                                               float resid, float qnw, float* __restrict__ out,
                                               int N, int rt_begin, QShadow qs) {
  const int tid = threadIdx.x, lane = tid & 31, r = tid & 15;
  const int nrow = SWIGLU ? gn * 8 : gn * 16;  // rows written by the group
  if (tid >= ((nrow + 31) & ~31)) return;  // whole warps stay (the shadow's shuffles)
  const bool mine = tid < nrow;
  float val = 0.f;
  int col = 0;  // this thread's row of out
  if constexpr (SWIGLU) {
    const int ul = tid >> 4;  // pair of the group
    const float* gr = red + 2 * ul * W * 16 + r;
    if (mine) {
      float vg = 0.f, vu = 0.f;
#pragma unroll
      for (int w = 0; w < W; ++w) vg += gr[w * 16];
#pragma unroll
      for (int w = 0; w < W; ++w) vu += gr[(W + w) * 16];
      col = (rt_begin + gt0 / 2) * 16 + tid;
      val = silu_mul1(vg * rs, vu * rs);
      out[col] = val;
    }
  } else {
    const float* gr = red + (tid >> 4) * W * 16 + r;
    col = (rt_begin + gt0) * 16 + tid;
    if (mine && col < N) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < W; ++w) v += gr[w * 16];
      const float y = v * rs;
      val = ACC ? (gt0 == 0 ? resid : ld_f<CG>(out + col)) + y : y;
      out[col] = val;
    }
  }
  if constexpr (QOUT) {
    const int n = SWIGLU ? N / 2 : N;
    // warp w: rows col - lane .. col - lane + 31, one whole segment
    const float nwv = !qs.nw ? 1.f : !SWIGLU && gt0 == 0 ? qnw : qs.nw[col];
    q8_shadow_store(qs.nw ? val * nwv : val, qs.nw ? val * val : 0.f, col - lane, n, qs.sch,
                    qs.out);
  }
}

// A warp's partial sums of one row tile (T = 1) -> pr[16]. Q8A (q8a_chunk_split): lane t holds
// row g + 8 (t & 1) over the segments of parity t >> 1; lanes t and t ^ 2 are added. Else (C
// fragment acc of lane (g, t)): token 0 = C column 0, c0 (row g) and c2 (row g + 8) of the lanes
// t = 0.
template <bool Q8A>
__device__ __forceinline__ void bulk_tile_partials(float* pr, float (&acc)[4], int g, int t) {
  if constexpr (Q8A) {
    acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], 2);
    if (t < 2) pr[g + 8 * t] = acc[0];
  } else if (t == 0) {
    pr[g] = acc[0];
    pr[g + 8] = acc[2];
  }
}

// Consumer side (the W warps): stage the activations (int8 with Q8A, else fp16; CG: x and, with
// ACC, out read through L2 only), then multiply the slots of row tiles [rt_begin, rt_end) as
// bulk_produce streams them (ring steps from gs) and write the tiles in groups of TB
// (bulk_group_out: one block barrier a group rather than one a tile; the partial sums
// double-buffered in red, [2][TB][W][16] floats).
// SWIGLU (a gate | up weight, N = 2 I with I a multiple of 16; not with ACC): [rt_begin,
// rt_end) are pairs q of row tiles, gate tile q then up tile q + N / 32, in that order in the
// ring, and out (I,) gets silu(gate) * up of rows 16 q .. 16 q + 15 (silu_mul1: the same float
// as the PRO_SILU prologue of the next GEMV would compute from the two rows).
// QIN (Q8A, T = 1): the activations are copied from the shadow qs.in instead of staged from x (a
// PRO_NORM's rstd from its sums of squares). QOUT (N, or I with SWIGLU, a multiple of 64;
// [rt_begin, rt_end) in whole 32-row segments: 16-row units, tiles or gate / up tile pairs, in
// pairs): the written rows also go to the shadow qs.out (q8_shadow_store), quantized for a
// consumer of scheme qs.sch with RMSNorm weight qs.nw.
template <int SCH, int PRO, bool ACC, bool Q8A, int W, int UPW, int NS, bool CG,
          bool SWIGLU = false, bool QIN = false, bool QOUT = false, int TB = 16>
__device__ __forceinline__ void bulk_consume(const float* __restrict__ x, int ldx,
                                             const float* __restrict__ nw, float eps,
                                             float* __restrict__ out, int N, int K,
                                             int rt_begin, int rt_end, const unsigned char* ring,
                                             unsigned long long* full, unsigned long long* empty,
                                             unsigned* xs, float* red,
                                             float (&ssq)[W][8], int& gs,
                                             QShadow qs = QShadow{}) {
  using R = BulkRing<SCH, W, UPW>;
  constexpr int S = R::S, CPS = R::CPS, CB = R::CB, SB = R::SB;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int KC = (K + 63) >> 6;
  static_assert(!(SWIGLU && (ACC || PRO == PRO_SILU)), "SwiGLU epilogue: no residual or gating");
  static_assert(!QIN || (Q8A && PRO != PRO_SILU), "shadow input: int8 activations, no gating");
  static_assert(TB > 0, "tiles in groups");
  static_assert(TB % 4 == 0, "groups of whole segments (SWIGLU: pairs of pairs)");
  static_assert(TB * 16 <= W * 32, "bulk_group_out: one consumer thread a row");
  const int spt = (KC + CPS - 1) / CPS;  // slots per row tile
  const int ntiles = (rt_end - rt_begin) * (SWIGLU ? 2 : 1), steps = ntiles * spt;
  const int xs_stride = KC * 32 + 4;  // fp16: T = 1, one row
  float* meta = reinterpret_cast<float*>(xs + KC * 16);  // Q8A: (d, dbias) per segment
  // ACC: the residual rows of the first group (row rt_begin * 16 + thread), loaded before the
  // staging, so that the sums of a block's last tiles (the kernel's end) do not wait for an L2
  // round trip. QOUT with an RMSNorm consumer (not SWIGLU): the first group's norm weights,
  // likewise
  float resid = 0.f, qnw = 1.f;
  {
    const int first = min(TB, ntiles) * 16, row = rt_begin * 16 + threadIdx.x;
    if (ACC && threadIdx.x < first && row < N) resid = ld_f<CG>(out + row);
    if (QOUT && !SWIGLU && qs.nw && threadIdx.x < first) qnw = qs.nw[row];
  }
  if constexpr (QIN) {
    // the codes and meta (KC * 80 bytes) as they are, and the segments' sums of squares: every
    // load issued before any is used (one round trip)
    constexpr int NT = W * 32;
    const uint4* src = reinterpret_cast<const uint4*>(qs.in);
    uint4* dst = reinterpret_cast<uint4*>(xs);
    const float* sq = reinterpret_cast<const float*>(qs.in + KC * 20);
    const int n4 = KC * 5, tid = threadIdx.x;
    float s2[2] = {0.f, 0.f};
    // (CG: through L2 only, the shadow written by other blocks of this kernel)
    auto ld4 = [](const uint4* p) { return CG ? __ldcg(p) : *p; };
#pragma unroll
    for (int j = 0; j < 2; ++j)
      if (PRO == PRO_NORM && tid + j * NT < 2 * KC) s2[j] = ld_f<CG>(sq + tid + j * NT);
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (tid + u * NT < n4) v[u] = ld4(src + tid + u * NT);
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (tid + u * NT < n4) dst[tid + u * NT] = v[u];
    for (int i = tid + 4 * NT; i < n4; i += NT) dst[i] = ld4(src + i);  // K > 26,000 or so
    if (PRO == PRO_NORM) {
      float ss = s2[0] + s2[1];
      for (int i = tid + 2 * NT; i < 2 * KC; i += NT) ss += ld_f<CG>(sq + i);
      ss = warp_sum(ss);
      if (lane == 0) ssq[warp][0] = ss;
    }
  } else if constexpr (Q8A) {
    stage_q8<SCH, PRO, W, 4, CG>(x, ldx, nw, 1, K, KC, xs, KC * 16, meta, ssq);
  } else {
    stage_rows<PRO, W, 1>(x, ldx, nw, 1, K, KC * 64, xs, xs_stride, ssq);
  }
  bar_sync_1(W * 32);
  float rs = 1.f;
  if (PRO == PRO_NORM) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) sum += ssq[w][0];
    rs = rsqrtf(sum / (float)K + eps);
  }

  float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
  // ring position and slot of the row tile kept as counters (no division per slot)
  int slot = gs % NS, j = 0;
  // the group's first tile, its size, tiles done in it, buffer
  int gt0 = 0, gn = min(TB, ntiles), ti = 0, gb = 0;
  unsigned par = (gs / NS) & 1;
  // the barriers' shared-space addresses, this lane's words of the slot (code words and scale
  // words of chunk ci = W u + warp) and of the staged row (Q8A: B words and meta of chunk kc0 +
  // warp), all set up once: the loop then does no generic-address arithmetic per slot
  // (opaque: kept in registers, not recomputed from threadIdx in every slot as the compiler
  // otherwise chooses to)
  const unsigned full_a = opaque(smem_addr(full)), empty_a = opaque(smem_addr(empty));
  const unsigned char* cbase = ring + opaque(warp * CB + lane * 16);
  const unsigned char* sbase = ring + opaque(CPS * CB + warp * SB + g * S * 4);
  const unsigned* xq = xs + opaque(warp * 16 + 4 * t);
  const float* mq = meta + opaque(warp * 4);
  // Q8A (q8a_chunk_split): lane t takes row g + 8 (t & 1) of segment t >> 1 (its scale and meta)
  const bool hi = t & 1;
  const int s1 = opaque(t >> 1);
  // q4: row g + 8 holds 16 q
  const float hf = __uint_as_float(opaque(__float_as_uint(hi && SCH != SCH_Q8 ? 0.0625f : 1.f)));
  const unsigned hsel = opaque(hi ? 0x3232u : 0x1010u);
  for (int s = 0; s < steps; ++s) {
    const int kc0 = j * CPS, nch = min(CPS, KC - kc0);
    mbar_wait(full_a + 8 * slot, par);
    const int so = slot * R::SLOT;
    // chunk ci = W u + warp of the slot (kc = kc0 + ci)
    auto chunk = [&](int u) {
      const int kc = kc0 + W * u + warp;
      uint4 q[R::CW];
#pragma unroll
      for (int c = 0; c < R::CW; ++c)
        q[c] = *reinterpret_cast<const uint4*>(cbase + so + u * W * CB + c * 512);
      const unsigned char* sp = sbase + so + u * W * SB;
      if constexpr (Q8A) {
        const uint4 bq = *reinterpret_cast<const uint4*>(xq + (kc0 + W * u) * 16);
        const float2 md = *reinterpret_cast<const float2*>(mq + (kc0 + W * u) * 4 + 2 * s1);
        const unsigned sw = *reinterpret_cast<const unsigned*>(sp + 4 * s1);
        const unsigned mw = S == 4 ? *reinterpret_cast<const unsigned*>(sp + 8 + 4 * s1) : 0u;
        q8a_chunk_split<SCH>(acc[0][0], q, __byte_perm(sw, 0, hsel), __byte_perm(mw, 0, hsel),
                             bq, md, hf, hi, s1);
      } else {
        unsigned sw[S];
        if constexpr (S == 4) {
          const uint4 v = *reinterpret_cast<const uint4*>(sp);
          sw[0] = v.x; sw[1] = v.y; sw[2] = v.z; sw[3] = v.w;
        } else {
          const uint2 v = *reinterpret_cast<const uint2*>(sp);
          sw[0] = v.x; sw[1] = v.y;
        }
        unsigned b[1][4][2];
        b_staged<1>(xs, xs_stride, kc, g, t, 1, b);
        float xsum[1][2][4];
        if (SCH == SCH_Q4M) segment_xsum<1>(b, xsum);
        mma_chunk<SCH, 1>(acc, q, sw, b, xsum);
      }
    };
    if (nch == CPS) {  // a full slot: no bounds checks (the compiler may then hoist the loads)
#pragma unroll
      for (int u = 0; u < UPW; ++u) chunk(u);
    } else {
#pragma unroll
      for (int u = 0; u < UPW; ++u) {
        if (W * u + warp >= nch) break;  // uniform over the warp
        chunk(u);
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty_a + 8 * slot);  // this warp is done with the slot
    if (++slot == NS) { slot = 0; par ^= 1; }
    if (++j == spt) {  // the row tile's last slot
      j = 0;
      // the warps' partial sums of the tile go to the group's buffer; at the group's end
      // (one block barrier) the whole block adds and writes its tiles
      bulk_tile_partials<Q8A>(red + ((gb * TB + ti) * W + warp) * 16, acc[0], g, t);
      if (++ti == gn) {
        bar_sync_1(W * 32);
        bulk_group_out<ACC, W, CG, SWIGLU, QOUT>(red + gb * TB * W * 16, gt0, gn, rs, resid,
                                                 qnw, out, N, rt_begin, qs);
        gb ^= 1;
        gt0 += gn;
        ti = 0;
        gn = min(TB, ntiles - gt0);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[0][i] = 0.f;
    }
  }
  gs += steps;
}

// The arguments of gemv_mma (one launch path in linear.gemv; T = 1, so ldo and T are unused),
// then the shadows' (bulk_consume: QIN, QOUT). SWIGLU: see bulk_consume (out is (N / 2,)).
// With QOUT the blocks split whole 32-row segments of the output. TB: row tiles added and
// written a group at a time (bulk_consume; linear.bulk_config picks it, 2 W at most).
template <int SCH, int PRO, bool ACC, bool Q8A, int W, int UPW, int NS, bool SWIGLU = false,
          bool QIN = false, bool QOUT = false, int TB = 16>
__global__ void __launch_bounds__((W + 1) * 32, 2)
gemv_bulk(const float* __restrict__ x, int ldx, const float* __restrict__ nw, float eps,
          const unsigned char* __restrict__ codes, const unsigned char* __restrict__ scales,
          float* __restrict__ out, int ldo, int T, int N, int K, const unsigned* qin,
          unsigned char* qout, const float* qnw, int qsch) {
  pdl_trigger();  // the next kernel may start (it waits for this one)
  using R = BulkRing<SCH, W, UPW>;
  extern __shared__ uint4 bulk_smem[];
  unsigned char* ring;
  unsigned long long *full, *empty;
  unsigned* xs;  // the staged activations
  bulk_smem_layout<SCH, W, UPW, NS>(bulk_smem, ring, full, empty, xs);
  __shared__ float gred[2 * TB * W * 16];  // bulk_consume's group sums
  __shared__ float ssq[W][8];
  const int warp = threadIdx.x >> 5;
  const int KC = (K + 63) >> 6;
  const int N16 = (N + 15) >> 4;
  // SWIGLU: the block's share of row-tile pairs (gate tile q, up tile q + N16 / 2)
  // QOUT: whole segments (a segment is quantized by the block that wrote it; for gate_up a
  // block may then take one gate / up pair more than an even split)
  const int units = QOUT ? (SWIGLU ? N16 / 2 : N16) / 2 : SWIGLU ? N16 / 2 : N16;
  int2 rt = bulk_tiles(units, blockIdx.x, gridDim.x);
  if constexpr (QOUT) {
    rt.x *= 2;
    rt.y *= 2;
  }
  bulk_ring_init<NS, W>(full, empty);
  int gs = 0;
  if (warp == W) {  // producer: weights are never written, so before pdl_wait
    if ((threadIdx.x & 31) == 0) {
      const int spt = (KC + R::CPS - 1) / R::CPS;
      const unsigned long long policy = evict_first_policy();
      if constexpr (SWIGLU) {
        for (int q = rt.x; q < rt.y; ++q) {
          bulk_produce<SCH, W, UPW, NS>(codes, scales, q, spt, spt, KC, ring, full, empty, gs,
                                        policy);
          bulk_produce<SCH, W, UPW, NS>(codes, scales, q + N16 / 2, spt, spt, KC, ring, full,
                                        empty, gs, policy);
        }
      } else {
        bulk_produce<SCH, W, UPW, NS>(codes, scales, rt.x, (rt.y - rt.x) * spt, spt, KC, ring,
                                      full, empty, gs, policy);
      }
    }
    return;
  }
  pdl_wait();  // consumers: x (and out with ACC) come from earlier kernels
  bulk_consume<SCH, PRO, ACC, Q8A, W, UPW, NS, false, SWIGLU, QIN, QOUT, TB>(
      x, ldx, nw, eps, out, N, K, rt.x, rt.y, ring, full, empty, xs, gred, ssq, gs,
      QShadow{qin, qout, qnw, qsch});
}

// ---------------------------------------------------------------------------------------------
// Streaming GEMV for 2 <= T <= MT token rows (batched decode, a speculative verify pass), sm_90+:
// gemv_bulk's persistent grid, producer and ring, so each chunk of weights is read once for all
// T rows; the consumers stage the T rows as int8 (stage_q8, per-token meta) and multiply each
// chunk with the integer MMA, whose 8 B columns are the tokens (lane group g's column = token g,
// q8a_chunk as gemv_q8a does). A tile's warp partials go to red ([tile][warp][token][16 rows]);
// every TB tiles (TB * MT = 16) one block barrier, then the block adds and writes T rows of them
// (y * rstd of each token, plus out with ACC). Dynamic shared memory: the ring, its mbarriers,
// then the T staged rows (stride KC * 16 + pad words) and their meta (float4 per chunk and token).
// SWIGLU (a gate | up weight, N = 2 I with I a multiple of 16; not with ACC): as gemv_bulk's,
// the blocks split pairs of row tiles (gate q, then up q + N / 32, in the ring), and out (T, I)
// gets silu_mul1(gate, up) of each token's sums: the same floats as the plain kernel's two halves.
// PREQ: the rows come made by stage_rows_q8 in pre (gemv_bulk's shadow-in argument; its other
// shadow arguments are unused): the consumers copy them, words and meta, then the rstd.
template <int SCH, int PRO, bool ACC, int W, int UPW, int NS, int MT, bool SWIGLU = false,
          bool PREQ = false>
__global__ void __launch_bounds__((W + 1) * 32, 1)
gemv_bulk_mt(const float* __restrict__ x, int ldx, const float* __restrict__ nw, float eps,
             const unsigned char* __restrict__ codes, const unsigned char* __restrict__ scales,
             float* __restrict__ out, int ldo, int T, int N, int K,
             const unsigned* __restrict__ pre, unsigned char*, const float*, int) {
  pdl_trigger();  // the next kernel may start (it waits for this one)
  using R = BulkRing<SCH, W, UPW>;
  constexpr int S = R::S, CPS = R::CPS, CB = R::CB, SB = R::SB;
  constexpr int TB = 16 / MT;
  static_assert(MT == 2 || MT == 4 || MT == 8, "2, 4 or 8 token columns");
  static_assert(!(SWIGLU && (ACC || PRO == PRO_SILU)), "SwiGLU epilogue: no residual or gating");
  extern __shared__ uint4 bulk_smem[];
  unsigned char* ring;
  unsigned long long *full, *empty;
  unsigned* xs;
  bulk_smem_layout<SCH, W, UPW, NS>(bulk_smem, ring, full, empty, xs);
  __shared__ float red[2 * TB * W * 16 * MT];
  __shared__ float ssq[W][8];
  __shared__ float srs[8];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int KC = (K + 63) >> 6, N16 = (N + 15) >> 4;
  // SWIGLU: the block's share of row-tile pairs (gate tile q, up tile q + N16 / 2)
  const int2 rt = bulk_tiles(SWIGLU ? N16 / 2 : N16, blockIdx.x, gridDim.x);
  const int spt = (KC + CPS - 1) / CPS;  // slots per row tile
  bulk_ring_init<NS, W>(full, empty);
  if (warp == W) {  // producer: weights are never written, so before pdl_wait
    if (lane == 0) {
      int gs = 0;
      const unsigned long long policy = evict_first_policy();
      if constexpr (SWIGLU) {
        for (int q = rt.x; q < rt.y; ++q) {
          bulk_produce<SCH, W, UPW, NS>(codes, scales, q, spt, spt, KC, ring, full, empty, gs,
                                        policy);
          bulk_produce<SCH, W, UPW, NS>(codes, scales, q + N16 / 2, spt, spt, KC, ring, full,
                                        empty, gs, policy);
        }
      } else {
        bulk_produce<SCH, W, UPW, NS>(codes, scales, rt.x, (rt.y - rt.x) * spt, spt, KC, ring,
                                      full, empty, gs, policy);
      }
    }
    return;
  }
  pdl_wait();  // consumers: x, pre (and out with ACC) come from earlier kernels
  const int xs_stride = KC * 16 + ((KC & 1) ? 0 : 16);  // = 16 (mod 32)
  float* meta = reinterpret_cast<float*>(xs + T * xs_stride);
  if constexpr (PREQ) {   // words then meta, contiguous in both (multiples of 4 words)
    // async copies, all in flight at once: one L2 round trip, not one a pass of the block
    const int n4 = (T * xs_stride + KC * T * 4) >> 2;
    const uint4* src = reinterpret_cast<const uint4*>(pre);
    uint4* dst = reinterpret_cast<uint4*>(xs);
    for (int i = threadIdx.x; i < n4; i += W * 32) cp_async16(dst + i, src + i);
    cp_async_commit();
    cp_async_wait<0>();
  } else {
    stage_q8<SCH, PRO, W, 4>(x, ldx, nw, T, K, KC, xs, xs_stride, meta, ssq);
  }
  bar_sync_1(W * 32);
  if (threadIdx.x < T) {
    float rs = 1.f;
    if (PREQ) {
      rs = __ldcg(reinterpret_cast<const float*>(pre) + T * xs_stride + KC * T * 4
                  + threadIdx.x);
    } else if (PRO == PRO_NORM) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < W; ++w) sum += ssq[w][threadIdx.x];
      rs = rsqrtf(sum / (float)K + eps);
    }
    srs[threadIdx.x] = rs;
  }
  const int tb = min(g, T - 1);  // token of this lane's B column
  const int te0 = min(2 * t, T - 1), te1 = min(2 * t + 1, T - 1);
  const unsigned* xb = xs + tb * xs_stride + 4 * t;
  const unsigned char* cbase = ring + warp * CB + lane * 16;
  const unsigned char* sbase = ring + CPS * CB + warp * SB + g * S * 4;
  const int ntiles = (rt.y - rt.x) * (SWIGLU ? 2 : 1), steps = ntiles * spt;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  int slot = 0, j = 0, gt0 = 0, gn = min(TB, ntiles), ti = 0, gb = 0;
  unsigned par = 0;
  const unsigned full_a = smem_addr(full), empty_a = smem_addr(empty);
  for (int s = 0; s < steps; ++s) {
    const int kc0 = j * CPS, nch = min(CPS, KC - kc0);
    mbar_wait(full_a + 8 * slot, par);
    const int so = slot * R::SLOT;
#pragma unroll
    for (int u = 0; u < UPW; ++u) {
      if (W * u + warp >= nch) break;  // uniform over the warp
      const int kc = kc0 + W * u + warp;
      uint4 q[R::CW];
#pragma unroll
      for (int c = 0; c < R::CW; ++c)
        q[c] = *reinterpret_cast<const uint4*>(cbase + so + u * W * CB + c * 512);
      const unsigned* sp = reinterpret_cast<const unsigned*>(sbase + so + u * W * SB);
      unsigned sw[S];
#pragma unroll
      for (int i = 0; i < S; ++i) sw[i] = sp[i];
      const uint4 bq = *reinterpret_cast<const uint4*>(xb + kc * 16);
      const float4 md[2] = {*reinterpret_cast<const float4*>(meta + ((size_t)kc * T + te0) * 4),
                            *reinterpret_cast<const float4*>(meta + ((size_t)kc * T + te1) * 4)};
      q8a_chunk<SCH, false>(acc, q, sw, bq, md);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty_a + 8 * slot);  // this warp is done with the slot
    if (++slot == NS) { slot = 0; par ^= 1; }
    if (++j == spt) {  // the row tile's last slot: C columns 2t, 2t + 1 are tokens
      j = 0;
      float* pr = red + ((gb * TB + ti) * W + warp) * 16 * MT;
      if (2 * t < T) {
        pr[2 * t * 16 + g] = acc[0];
        pr[2 * t * 16 + g + 8] = acc[2];
      }
      if (2 * t + 1 < T) {
        pr[(2 * t + 1) * 16 + g] = acc[1];
        pr[(2 * t + 1) * 16 + g + 8] = acc[3];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] = 0.f;
      if (++ti == gn) {  // the group's end: add the warps' sums, write T rows of its tiles
        bar_sync_1(W * 32);
        if constexpr (SWIGLU) {  // gn even (TB is): tiles gate, up of each pair in turn
          const int rows = gn * 8;
          for (int i = threadIdx.x; i < rows * T; i += W * 32) {
            const int tok = i / rows, r = i - tok * rows, col = (rt.x + gt0 / 2) * 16 + r;
            const float* gr =
                red + ((gb * TB + 2 * (r >> 4)) * W) * 16 * MT + tok * 16 + (r & 15);
            float vg = 0.f, vu = 0.f;  // (the up tile's sums follow the gate tile's W warps)
#pragma unroll
            for (int w = 0; w < W; ++w) vg += gr[w * 16 * MT];
#pragma unroll
            for (int w = 0; w < W; ++w) vu += gr[(W + w) * 16 * MT];
            out[(size_t)tok * ldo + col] = silu_mul1(vg * srs[tok], vu * srs[tok]);
          }
        } else {
          const int rows = gn * 16;
          for (int i = threadIdx.x; i < rows * T; i += W * 32) {
            const int tok = i / rows, r = i - tok * rows, col = (rt.x + gt0) * 16 + r;
            const float* gr = red + ((gb * TB + (r >> 4)) * W) * 16 * MT + tok * 16 + (r & 15);
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < W; ++w) v += gr[w * 16 * MT];
            if (col < N) {
              float* o = out + (size_t)tok * ldo + col;
              const float y = v * srs[tok];
              *o = ACC ? *o + y : y;
            }
          }
        }
        gb ^= 1;
        gt0 += gn;
        ti = 0;
        gn = min(TB, ntiles - gt0);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Element (row, col) of a packed weight, dequantized in float32 exactly as quant.dequantize.
template <int SCH>
__device__ __forceinline__ float mma_get(const unsigned* __restrict__ codes,
                                         const unsigned* __restrict__ scales, int KC, int row,
                                         int col) {
  constexpr int S = SCH == SCH_Q4M ? 4 : 2;
  const int rt = row >> 4, rr = row & 15, h = rr >> 3, g = rr & 7;
  const int kc = col >> 6, cc = col & 63, j = cc >> 4, c16 = cc & 15;
  const int c = c16 >> 3, t = (c16 & 7) >> 1, e = c16 & 1;
  const size_t tile = (size_t)rt * KC + kc;
  const unsigned sw = scales[(tile * 8 + g) * S + (cc >> 5)];
  const float s = h ? h2_hi(sw) : h2_lo(sw);
  if (SCH == SCH_Q8) {
    const unsigned w = codes[((tile * 2 + (j >> 1)) * 32 + g * 4 + t) * 4 + 2 * (j & 1) + c];
    return s * (float)(signed char)((w >> (8 * (e + 2 * h))) & 0xFFu);
  }
  const unsigned w = codes[(tile * 32 + g * 4 + t) * 4 + j];
  const float q = (float)((w >> (4 * (h + 2 * c + 4 * e))) & 15u);
  if (SCH == SCH_Q4M) {
    const unsigned mw = scales[(tile * 8 + g) * S + 2 + (cc >> 5)];
    return s * q + (h ? h2_hi(mw) : h2_lo(mw));
  }
  return s * (q - 8.f);
}

// Rows ids[t] of a packed (V, H) weight -> out (T, H) float32. Grid T, block >= 32 threads.
template <int SCH>
__global__ void embed_mma(const unsigned* __restrict__ codes, const unsigned* __restrict__ scales,
                          const int* __restrict__ ids, float* __restrict__ out, int H) {
  pdl_trigger();  // the first GEMV of the step may start loading its weights
  const int KC = (H + 63) >> 6;
  const int row = ids[blockIdx.x];
  for (int col = threadIdx.x; col < H; col += blockDim.x)
    out[(size_t)blockIdx.x * H + col] = mma_get<SCH>(codes, scales, KC, row, col);
}

// One lane's codes of one (row tile, chunk) tile of a packed weight: rows g and g + 8 (h = 0,
// 1) of the tile by columns 16 j + 8 c + 2 t + e (j < 4, c, e < 2), loaded with one 16-byte load
// (q8: two) and the lane's scale words; value() decodes as mma_get does (the same floats).
template <int SCH>
struct TileLane {
  static constexpr int S = SCH == SCH_Q4M ? 4 : 2;
  unsigned w[SCH == SCH_Q8 ? 8 : 4];   // q4: word j; q8: word (j >> 1) * 4 + 2 (j & 1) + c
  unsigned sw[S];                      // scales of segments 0, 1[, mins of 0, 1]
  __device__ __forceinline__ TileLane(const unsigned* __restrict__ codes,
                                      const unsigned* __restrict__ scales, size_t tile, int g,
                                      int t) {
#pragma unroll
    for (int p = 0; p < (SCH == SCH_Q8 ? 2 : 1); ++p) {
      const uint4 v = *reinterpret_cast<const uint4*>(
          codes + (((SCH == SCH_Q8 ? tile * 2 + p : tile) * 32) + g * 4 + t) * 4);
      w[4 * p] = v.x; w[4 * p + 1] = v.y; w[4 * p + 2] = v.z; w[4 * p + 3] = v.w;
    }
#pragma unroll
    for (int i = 0; i < S; ++i) sw[i] = scales[(tile * 8 + g) * S + i];
  }
  __device__ __forceinline__ float value(int h, int j, int c, int e) const {
    const float s = h ? h2_hi(sw[j >> 1]) : h2_lo(sw[j >> 1]);
    if constexpr (SCH == SCH_Q8) {
      const unsigned x = w[(j >> 1) * 4 + 2 * (j & 1) + c];
      return s * (float)(signed char)((x >> (8 * (e + 2 * h))) & 0xFFu);
    } else {
      const float q = (float)((w[j] >> (4 * (h + 2 * c + 4 * e))) & 15u);
      if constexpr (SCH == SCH_Q4M) {
        const unsigned m2 = sw[2 + (j >> 1)];
        return s * q + (h ? h2_hi(m2) : h2_lo(m2));
      } else {
        return s * (q - 8.f);
      }
    }
  }
};

constexpr int DQ_WARPS = 8;   // warps a block of the tile walks below (gemm.walk_tiles)

// Calls f(tl, rt, kc) for each 16 x 64 tile (row tile rt, K chunk kc) of an (N, K) packed
// weight that this warp takes (a warp a tile, the grid's warps striding over the tiles); tl is
// the lane's TileLane (rows g and g + 8 of the tile, g = lane / 4, t = lane % 4).
template <int SCH, typename F>
__device__ __forceinline__ void for_each_tile(const unsigned* __restrict__ codes,
                                              const unsigned* __restrict__ scales, int N, int K,
                                              F&& f) {
  const int KC = (K + 63) >> 6, tiles = ((N + 15) >> 4) * KC, lane = threadIdx.x & 31;
  for (int tile = blockIdx.x * DQ_WARPS + (threadIdx.x >> 5); tile < tiles;
       tile += gridDim.x * DQ_WARPS) {
    const int rt = tile / KC;
    f(TileLane<SCH>(codes, scales, tile, lane >> 2, lane & 3), rt, tile - rt * KC);
  }
}

// A warp's staged 16 x 64 tile (st: 16 rows of E-byte values, LD bytes apart) out to rows
// rt * 16 .. of the (N, K) C-order matrix out at K chunk kc, in 16-byte runs (4 E lanes a row);
// the warp's lanes sync before (the puts) and after (the next tile's puts reuse st).
template <int E, int LD>
__device__ __forceinline__ void store_tile(const void* st, void* out, int rt, int kc, int N,
                                           int K) {
  constexpr int LPR = 4 * E, RPP = 32 / LPR;   // lanes a row, rows a pass
  const int lane = threadIdx.x & 31, ch = lane % LPR;
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 16 / RPP; ++i) {
    const int r = RPP * i + lane / LPR, row = rt * 16 + r;
    if (row < N && kc * 64 + 16 / E * ch < K)   // (K is a multiple of 32: whole chunks)
      *reinterpret_cast<uint4*>(static_cast<unsigned char*>(out) +
                                ((size_t)row * K + kc * 64) * E + 16 * ch) =
          *reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(st) + r * LD +
                                          16 * ch);
  }
  __syncwarp();
}

// The whole (N, K) weight as fp16, C order (prefill GEMM operand): a warp a 16 x 64 tile, each
// lane its TileLane's 32 values into shared memory, then the tile's rows out as 128-byte runs
// (16 bytes a lane). Writing the lanes' fp16 pairs straight out touched 8 rows an instruction.
constexpr int DQ_LD = 36;   // words a staged row: 32 + 4 (conflict-free puts)
template <int SCH>
__global__ void __launch_bounds__(32 * DQ_WARPS)
dequant_mma_f16(const unsigned* __restrict__ codes, const unsigned* __restrict__ scales,
                unsigned short* __restrict__ out, int N, int K) {
  __shared__ __align__(16) unsigned stage[DQ_WARPS][16 * DQ_LD];
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  unsigned* st = stage[threadIdx.x >> 5];
  for_each_tile<SCH>(codes, scales, N, K, [&](const TileLane<SCH>& tl, int rt, int kc) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c)   // cols 16 j + 8 c + 2 t (and + 1) of row g + 8 h
          st[(g + 8 * h) * DQ_LD + 8 * j + 4 * c + t] =
              pack_h2(tl.value(h, j, c, 0), tl.value(h, j, c, 1));
    store_tile<2, 4 * DQ_LD>(st, out, rt, kc, N, K);
  });
}

// The whole (N, K) weight as e4m3 codes, C order, each row divided by its scale (the fp8
// prefill GEMM's operand, gpu/gemm_fp8.py): dequant_mma_f16's walk, a byte a value.
constexpr int DQ8_LD = 40;   // 2-byte words a staged row: 32 + 8 (16-byte aligned rows)
template <int SCH>
__global__ void __launch_bounds__(32 * DQ_WARPS)
dequant_mma_e4m3(const unsigned* __restrict__ codes, const unsigned* __restrict__ scales,
                 const float* __restrict__ row_scale, unsigned char* __restrict__ out, int N,
                 int K) {
  __shared__ __align__(16) unsigned short stage[DQ_WARPS][16 * DQ8_LD];
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  unsigned short* st = stage[threadIdx.x >> 5];
  for_each_tile<SCH>(codes, scales, N, K, [&](const TileLane<SCH>& tl, int rt, int kc) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = rt * 16 + g + 8 * h;
      const float inv = row < N ? 1.0f / row_scale[row] : 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c)   // cols 16 j + 8 c + 2 t (and + 1) of row g + 8 h
          st[(g + 8 * h) * DQ8_LD + 8 * j + 4 * c + t] =
              e4m3x2(tl.value(h, j, c, 0) * inv, tl.value(h, j, c, 1) * inv);
    }
    store_tile<1, 2 * DQ8_LD>(st, out, rt, kc, N, K);
  });
}

// Each row's largest |value| of a packed weight, as float bits by atomicMax into amax (zeroed
// first; non-negative floats order as their bits): its e4m3 copy's scale (gemm_fp8.row_scales).
template <int SCH>
__global__ void __launch_bounds__(32 * DQ_WARPS)
row_absmax(const unsigned* __restrict__ codes, const unsigned* __restrict__ scales,
           unsigned* __restrict__ amax, int N, int K) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  for_each_tile<SCH>(codes, scales, N, K, [&](const TileLane<SCH>& tl, int rt, int kc) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (kc * 64 + 16 * j + 8 * c + 2 * t + e < K)
              m = fmaxf(m, fabsf(tl.value(h, j, c, e)));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      const int row = rt * 16 + g + 8 * h;
      if (t == 0 && row < N) atomicMax(amax + row, __float_as_uint(m));
    }
  });
}
