// Paged causal GQA attention (semantics of ninfer/kernels/attention.paged_attention).
//
// KV cache of one layer: (num_pages, page_size, nkv, HD) of element type T (float, or kvh: fp16
// bits; common.cuh's kv_get / kv_load / kv_put, arithmetic in float32), or int8 rows (kvq8:
// (num_pages, page_size, nkv, HD + HD / 32) bytes, codes times the group's fp16 scale, read by
// kv_at / kv_load_row / kv_ld4r straight from the pages), or rk rows (kvrk<KK>: rotated codes
// and scales, K and V rows of their own widths; read as code times scale in the rotated domain,
// the host rotating q before (kv_hadamard_rows) and the output after, the fused decode rotating
// its q in the kernel); KV position j of
// sequence s is in page block_tables[s, j / page_size] at offset j % page_size. Query head h
// reads KV head h / G. Softmax is the online (running max / running sum) form of Milakov & Gimelshein 2018,
// "Online normalizer calculation for softmax", as used by FlashAttention (Dao et al. 2022);
// decode splits the context into partitions whose partial results are merged afterwards
// (split-K, "flash-decoding").
// (common.cuh is prepended by the Python loader.)
// One file over 600 lines on purpose: NVRTC compiles one source per op family (gpu.module), and
// the decode, merge and prefill kernels share the softmax-merge helpers as inlined templates.

#define NEG_INF (-__int_as_float(0x7f800000))

// Offset (elements of T) of KV position j's row for KV head kvh in a paged cache (see above),
// bt the sequence's block-table row: rows of kv_width<T, ISV>(hd) elements (kvq8: hd codes and
// the groups' fp16 scales; the rk types: K rows (ISV false) and V rows of their codecs).
template <typename T, bool ISV = false>
__device__ __forceinline__ size_t kv_row(const int* __restrict__ bt, int j, int page_size,
                                         int nkv, int kvh, int hd) {
  return (((size_t)bt[j / page_size] * page_size + (j % page_size)) * nkv + kvh) *
         kv_width<T, ISV>(hd);
}

// Piece w (CPY bytes) of KV position j's K row then V row, by cp.async to dst (the position's
// RB = K + V row bytes in shared memory): the copies of attn_decode's and attn_verify's rings.
template <typename T, int HD, int CPY>
__device__ __forceinline__ void kv_piece_async(unsigned char* dst, const T* __restrict__ kc,
                                               const T* __restrict__ vc,
                                               const int* __restrict__ bt, int j, int page_size,
                                               int nkv, int kvh, int w) {
  constexpr int CK = kv_width<T, false>(HD) * sizeof(T) / CPY;
  const unsigned char* src =
      w < CK ? reinterpret_cast<const unsigned char*>(
                   kc + kv_row<T, false>(bt, j, page_size, nkv, kvh, HD)) + w * CPY
             : reinterpret_cast<const unsigned char*>(
                   vc + kv_row<T, true>(bt, j, page_size, nkv, kvh, HD)) + (w - CK) * CPY;
  cp_async_n<CPY>(dst + w * CPY, src);
}

// U KV positions of the online softmax of the G query heads of a KV head (q pre-scaled; this
// lane's V = HD / 32 dims of q, k, v; the first n >= 1 of the U positions are real): running
// max m, sum l and unnormalised output acc per head, one max / correction per batch. The U G
// warp reductions of the dot products are interleaved, so a batch waits for one reduction's
// latency instead of U G of them (one position at a time, the chain of shuffles and
// exponentials makes the loop latency-bound).
template <int HD, int G, int U>
__device__ __forceinline__ void attn_steps(const float (&qv)[G][HD / 32],
                                           const float (&kv)[U][HD / 32],
                                           const float (&vv)[U][HD / 32], int n,
                                           float (&acc)[G][HD / 32], float (&m)[G],
                                           float (&l)[G]) {
  constexpr int V = HD / 32;
  float d[U][G];
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int h = 0; h < G; ++h) {
      float x = 0.f;
#pragma unroll
      for (int i = 0; i < V; ++i) x = fmaf(qv[h][i], kv[u][i], x);
      d[u][h] = x;
    }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)  // butterfly: every lane gets every sum
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int h = 0; h < G; ++h) d[u][h] += __shfl_xor_sync(0xffffffffu, d[u][h], o);
#pragma unroll
  for (int h = 0; h < G; ++h) {
    float mn = m[h];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (u < n) mn = fmaxf(mn, d[u][h]);
    const float corr = expf(m[h] - mn);
    float p[U], ps = 0.f;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      p[u] = u < n ? expf(d[u][h] - mn) : 0.f;
      ps += p[u];
    }
    l[h] = l[h] * corr + ps;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      float a = acc[h][i] * corr;
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (u < n) a = fmaf(p[u], vv[u][i], a);  // (rows past n hold garbage, maybe NaN)
      acc[h][i] = a;
    }
    m[h] = mn;
  }
}

// Merge of split-K partials by one block: heads h < NG, head h's partials at p0 + h splits + i
// for the active splits i (at most MERGE_MAX_SPLITS), dims hd; output row o_row + h hd. The
// (m, l) pairs come in with one round of loads, then per head: the running max M, e_i =
// exp(m_i - M) and the rescaled sum of l in split order (a split with m = -inf is skipped);
// then every thread sums its dims' partials in split order, its loads issued ahead (each
// dependent load costs a round trip through a memory system that the weight stream keeps
// busy). Loads through L2: other blocks of the same kernel may have
// written the partials (attn_decode's merging block).
// `scratch`: shared memory of at least MERGE_SCRATCH(NG) floats, free for the block's use.
// qout (else null): each output also goes to this q8 shadow (common.cuh) of nh hd = qk columns,
// output idx at column qcol + idx (NG hd and qcol multiples of 32: whole warps store).
// gate (else null): each output times sigmoid(gate[h ghs + d]) (the gated attention's output
// gate, as sigmoid_mul: y / (1 + exp(-g))), before it is stored.
constexpr int MERGE_MAX_SPLITS = 64;
#define MERGE_SCRATCH(NG) (2 * (NG) * MERGE_MAX_SPLITS)
template <int NG>
__device__ __forceinline__ float merge_block(const float* __restrict__ part_o,
                                            const float* __restrict__ part_ml, size_t p0,
                                            int splits, int active, int hd,
                                            float* __restrict__ o_row, float* scratch,
                                            unsigned char* __restrict__ qout = nullptr,
                                            int qcol = 0, int qk = 0, int qsch = 0,
                                            const float* __restrict__ gate = nullptr,
                                            int ghs = 0) {
  constexpr float SKIP = -1.f;  // (an exponential is never negative)
  float(*se)[MERGE_MAX_SPLITS] = reinterpret_cast<float(*)[MERGE_MAX_SPLITS]>(scratch);
  float(*sl)[MERGE_MAX_SPLITS] = se + NG;
  __shared__ float slsum[NG];
  // a thread with one output (NG hd <= blockDim.x) and at most PRE active splits issues its
  // partials' loads with the (m, l) ones: one round trip instead of two
  constexpr int PRE = 8;
  float pre[PRE];
  const bool early = NG * hd <= (int)blockDim.x && active <= PRE && threadIdx.x < NG * hd;
  if (early) {
    const int h = threadIdx.x / hd, d = threadIdx.x - h * hd;
    const float* po = part_o + (p0 + (size_t)h * splits) * hd + d;
#pragma unroll
    for (int i = 0; i < PRE; ++i) pre[i] = i < active ? __ldcg(po + (size_t)i * hd) : 0.f;
  }
  for (int idx = threadIdx.x; idx < NG * active; idx += blockDim.x) {
    const int h = idx / active, i = idx - h * active;
    const size_t pi = p0 + (size_t)h * splits + i;
    se[h][i] = __ldcg(part_ml + pi * 2);
    sl[h][i] = __ldcg(part_ml + pi * 2 + 1);
  }
  __syncthreads();
  if (threadIdx.x < NG) {
    const int h = threadIdx.x;
    float M = NEG_INF;
    for (int i = 0; i < active; ++i) M = fmaxf(M, se[h][i]);
    float lsum = 0.f;
    for (int i = 0; i < active; ++i) {
      const float mi = se[h][i];
      float e = SKIP;
      if (mi != NEG_INF) {
        e = expf(mi - M);
        lsum += e * sl[h][i];
      }
      se[h][i] = e;
    }
    slsum[h] = lsum;
  }
  __syncthreads();
  float last = 0.f;
  for (int idx = threadIdx.x; idx < NG * hd; idx += blockDim.x) {
    const int h = idx / hd, d = idx - h * hd;
    const float* po = part_o + (p0 + (size_t)h * splits) * hd + d;
    float o = 0.f;
    if (early) {
#pragma unroll
      for (int i = 0; i < PRE; ++i) {
        const float e = i < active ? se[h][i] : SKIP;
        if (e != SKIP) o += e * pre[i];
      }
    } else {
#pragma unroll 8
      for (int i = 0; i < active; ++i) {
        const float x = __ldcg(po + (size_t)i * hd);
        const float e = se[h][i];
        if (e != SKIP) o += e * x;
      }
    }
    last = o / slsum[h];
    if (gate) last = last / (1.0f + expf(-gate[(size_t)h * ghs + d]));
    o_row[(size_t)h * hd + d] = last;
    if (qout) q8_shadow_store(last, 0.f, qcol + (idx & ~31), qk, qsch, qout);
  }
  return last;  // the thread's last output (its only one where NG hd <= blockDim.x)
}

// ---------------------------------------------------------------------------------------------
// Decode: every sequence has exactly one new token (q row cu[s]). Grid (S, nkv, splits), 4 warps.
// A block serves the G query heads of one KV head over KV positions
// [split * P, min(L, (split + 1) * P)) with P = max(part_len, ceil(L / splits)) computed from the
// sequence's actual length L on the device: the split count is fixed by the host (under CUDA
// graphs, for the longest context), and every split gets a share of a short context instead of
// the first partition doing all of it serially. Each warp takes every 4th position and
// each lane holds HD/32 dims of q, k, v. With one split the block writes the normalised output;
// otherwise it writes (m, l) and the unnormalised accumulator for attn_merge.
//
// ROPE (the Llama decode step's qkv GEMV -> attention -> o GEMV, one kernel instead of
// rope_write_kv, attn_decode and attn_merge): q is row cu[s] of the fused q | k | v rows `q`
// (ldq), rotated here (rope_pair, as rope_write_kv); the block of the split that holds position
// L - 1 (the new token, whose slot slots[s] must be that position's) also rotates its k head,
// takes k and v of that position from shared memory instead of the cache and writes them to the
// cache (kc_new / vc_new; with a negative slot nothing is written and the cache row is read).
// With several active splits, the last block of a (sequence, KV head) to finish
// (counters[s nkv + kvh], reset by it; one launch at a time may use them) merges the partials
// as attn_merge does, in the same order: the output is bit-identical to the three kernels'. Blocks
// of splits past the sequence's length return at once (no partial, no arrival).
// ROPE without MERGE: as ROPE, but every block writes its partial (splits > 1 as launched) and
// attn_merge, launched next, merges them (two kernels instead of three, and none of the merging
// block's fence, arrival and reloads on the way to the o GEMV).
// CL > 0 (with ROPE and MERGE; launched in thread block clusters of CL blocks along the splits,
// splits a multiple of CL): while partitions of at most part_cap positions in one cluster cover
// the context (L <= CL part_cap), the first cluster of each (sequence, KV head) takes the whole
// context (P = max(part_len, ceil(L / CL))), the other clusters return at once, and the partials
// are merged through distributed shared memory: each block keeps its partial in its shared
// memory, and after a cluster barrier block r merges outputs [r SL, (r + 1) SL) of the KV
// head's G HD (SL = G HD / CL) from every active block's partial, in split order with
// merge_block's arithmetic (bit-identical), and writes them, with the q8 shadow where qout is
// given. No global round trip for the partials, no arrival, no second kernel: the chain from
// the qkv GEMV to the o GEMV loses attn_merge's launch, its wait and its loads through L2. A
// longer context takes ceil(L / (CL part_cap)) clusters (at
// most splits / CL) and merges as MERGE does, the merging block also writing the shadow.
// The row layout (ROPE): q head h at columns h qhs of the row, the k heads from column kcol, the
// v heads after them (Llama: qhs = HD, kcol = nh HD; Qwen3.5's gated attention: qhs = 2 HD, each
// q head followed by its output gate). qw / kw (else null): each q head and the new k head is
// RMS-normalised before RoPE (weights qw / kw, eps; sums in norm_rope_write_kv's order, so q and
// k are its floats). gate (else null): output (head, d) is multiplied by sigmoid of
// gate[t ldq + head qhs + d] where it is stored (sigmoid_mul's expression).
template <typename T, int HD, int G, bool ROPE, bool MERGE = ROPE, int CL = 0>
__global__ void __launch_bounds__(128)
attn_decode(const float* __restrict__ q, int ldq, const T* __restrict__ kc,
            const T* __restrict__ vc, const int* __restrict__ cu,
            const int* __restrict__ ctx_lens, const int* __restrict__ block_tables,
            int bt_stride, int page_size, int nkv, float scale, int part_len, int splits,
            float* __restrict__ out, int ldo, float* __restrict__ part_o,
            float* __restrict__ part_ml, const int* __restrict__ pos,
            const float* __restrict__ inv_freq, int r, int style,
            const long long* __restrict__ slots, T* __restrict__ kc_new,
            T* __restrict__ vc_new, int* __restrict__ counters,
            unsigned char* __restrict__ qout, int qsch, int part_cap,
            const float* __restrict__ gate, int qhs, int kcol, const float* __restrict__ qw,
            const float* __restrict__ kw, float eps) {
  static_assert(CL == 0 || (ROPE && MERGE && (G * HD) % (32 * CL) == 0 && CL <= 16),
                "clusters: with ROPE and MERGE, whole warps of outputs per block");
  pdl_trigger();
  // Launched with PDL (gpu/launch.py). Without ROPE, q and the new token's cache row come from
  // the kernel before (rope_write_kv): wait at once. With ROPE only the q | k | v rows do: the
  // lengths, positions, slots, block tables and inv_freq are host uploads (memcpys, which PDL
  // never overlaps: before a CUDA graph's replay, or eagerly before layer 0's attention) and the
  // cached rows (positions before L - 1) were written by earlier passes, so the block first
  // loads its first batch of cached K / V rows and the RoPE angles, while the qkv GEMV still
  // runs, and waits after that. The invariant this needs: no PDL-launched kernel of the pass writes those buffers or those rows.
  if constexpr (!ROPE) pdl_wait();
  constexpr int V = HD / 32;
  constexpr int NW = 4;
  const int s = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = cu[s];
  const int L = ctx_lens[s];
  int nsp = splits;         // the splits that the context is spread over
  bool dsm = false;         // one cluster: partials merged through distributed shared memory
  if constexpr (CL > 0) {
    const int ncl = min(splits / CL, max(1, (L + CL * part_cap - 1) / (CL * part_cap)));
    nsp = ncl * CL;
    dsm = ncl == 1;
    if (split >= nsp) return;  // a cluster past those: each of its blocks returns here
  }
  const int P = max(part_len, (L + nsp - 1) / nsp);
  const int start = split * P;
  const int end = min(L, start + P);
  const int nh = nkv * G;
  const int active = min(nsp, (L + P - 1) / P);

  float qv[G][V], acc[G][V], m[G], l[G];
  // ROPE: the rotated q heads, then (last split only) the new token's rotated k and its v
  __shared__ float sx[ROPE ? G + 2 : 1][ROPE ? HD : 1];
  // the split holding position L - 1, when the new token's k / v go to the cache
  const bool last = ROPE && split == active - 1 && slots[s] >= 0;
  const int* bt = block_tables + (size_t)s * bt_stride;
  constexpr int U = 4;  // positions per warp at a time (attn_steps), loads issued together
  float kv[U][V], vv[U][V];
  // RING (fp16, int8, rk rows of 4-byte multiples): each warp's next NS - 1 batches of cached
  // rows come by cp.async into its ring of NS batches in dynamic shared memory while it computes
  // one (one batch of narrow rows in flight does not cover the memory latency), and a batch is
  // read from the ring; attention.py sizes the ring (decode_ring_bytes)
  constexpr int RKB = kv_width<T, false>(HD) * sizeof(T);   // bytes of a K row, of a V row
  constexpr int RVB = kv_width<T, true>(HD) * sizeof(T);
  constexpr int CPY = RKB % 16 == 0 && RVB % 16 == 0 ? 16 : RKB % 8 == 0 && RVB % 8 == 0 ? 8 : 4;
  constexpr bool RING = sizeof(T) < 4 && RKB % 4 == 0 && RVB % 4 == 0;
  constexpr int NS = 3, RB = RKB + RVB;   // batches in the ring, bytes of a position
  extern __shared__ __align__(16) unsigned char ring_sm[];
  unsigned char* ring = ring_sm + (size_t)warp * NS * U * RB;
  // whether row j of this warp's batches is read from the cache (position L - 1 of the `last`
  // block: from shared memory, later)
  auto cached = [&](int j) { return j < end && !(last && j == L - 1); };
  // RING: batch j0's rows into ring slot b, CPY bytes a copy, one commit group (even empty)
  auto issue = [&](int j0, int b) {
    constexpr int CR = RB / CPY;
    unsigned char* dst0 = ring + (size_t)b * U * RB;
    for (int idx = lane; idx < U * CR; idx += 32) {
      const int u = idx / CR, w = idx - u * CR, j = j0 + u * NW;
      if (cached(j))
        kv_piece_async<T, HD, CPY>(dst0 + u * RB, kc, vc, bt, j, page_size, nkv, kvh, w);
    }
    cp_async_commit();
  };
  // RING: the first NS - 1 batches of this warp
  auto prologue = [&]() {
#pragma unroll
    for (int b = 0; b < NS - 1; ++b) issue(start + warp + b * NW * U, b);
  };
  // batch j0 of cached rows into kv / vv (RING: from slot b, once its group has landed)
  auto load_batch = [&](int j0, int b) {
    if constexpr (RING) {
      cp_async_wait<NS - 2>();   // (groups commit in batch order: batch b's is done)
      __syncwarp();              // every lane's copies of it are visible
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = j0 + u * NW;
      if (cached(j)) {
        if constexpr (RING) {
          const unsigned char* r = ring + ((size_t)(b % NS) * U + u) * RB;
          kv_load_row<V, false>(reinterpret_cast<const T*>(r), lane * V, HD, kv[u]);
          kv_load_row<V, true>(reinterpret_cast<const T*>(r + RKB), lane * V, HD, vv[u]);
        } else {
          kv_load_row<V, false>(kc + kv_row<T, false>(bt, j, page_size, nkv, kvh, HD),
                                lane * V, HD, kv[u]);
          kv_load_row<V, true>(vc + kv_row<T, true>(bt, j, page_size, nkv, kvh, HD), lane * V,
                               HD, vv[u]);
        }
      }
    }
    // RING: the slot read in the batch before is free (every lane passed this batch's
    // __syncwarp after reading it): batch b + NS - 1 goes there
    if constexpr (RING) issue(j0 + (NS - 1) * NW * U, (b + NS - 1) % NS);
  };
  // ROPE: cos / sin of each rotated pair (the same expressions as rope_pair)
  __shared__ float rope_cs[ROPE ? HD / 2 : 1][2];
  if constexpr (ROPE) {
    // past the sequence's length: no partial, no arrival (in a merging cluster: an empty one)
    if (start >= end && !dsm) return;
    if constexpr (RING) prologue();
    else if (start < end) load_batch(start + warp, 0);
    const int half = r >> 1, nrot = last ? G + 1 : G;
    {  // the angles depend on the position only: before the wait, too
      const float p = (float)pos[t];
      for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float ang = p * inv_freq[i];
        rope_cs[i][0] = cosf(ang);
        rope_cs[i][1] = sinf(ang);
      }
    }
    __syncthreads();
    pdl_wait();
    const float* xr = q + (size_t)t * ldq;
    // head h's row: q head kvh G + h (h < G), else this KV head's k
    auto head_row = [&](int h) {
      return xr + (h < G ? (size_t)(kvh * G + h) * qhs : (size_t)kcol + (size_t)kvh * HD);
    };
    // qw: each rotated head's 1 / rms (norm_rope_write_kv's sums: a thread's dims, its warp,
    // then the warps in order)
    __shared__ float rms_part[ROPE ? G + 1 : 1][NW], rms_inv[ROPE ? G + 1 : 1];
    if (qw) {
      constexpr int NIT = (HD + 127) / 128;   // a thread's dims of a head (blockDim.x = 128)
      float ss[G + 1];
#pragma unroll
      for (int h = 0; h < G + 1; ++h) {   // (every head's loads issued together)
        ss[h] = 0.f;
        if (h < nrot)
#pragma unroll
          for (int k = 0; k < NIT; ++k)
            if (threadIdx.x + 128 * k < HD) {
              const float x = head_row(h)[threadIdx.x + 128 * k];
              ss[h] = fmaf(x, x, ss[h]);
            }
      }
#pragma unroll
      for (int h = 0; h < G + 1; ++h) {
        const float v = warp_sum(ss[h]);
        if (lane == 0 && h < nrot) rms_part[h][warp] = v;
      }
      __syncthreads();
      if (threadIdx.x < nrot) {
        float tot = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) tot += rms_part[threadIdx.x][w];
        rms_inv[threadIdx.x] = rsqrtf(__fadd_rn(__fdiv_rn(tot, (float)HD), eps));
      }
      __syncthreads();
    }
    // dim i of head h as RoPE takes it (normalised: (x / rms) w, norm_rope_write_kv's order)
    auto normed = [&](int h, int i, float x) {
      return qw ? x * rms_inv[h] * (h < G ? qw : kw)[i] : x;
    };
    // this thread's pairs (idx = tid + 128 k of nrot * half) and dims, loads issued together
    constexpr int RIT = ((G + 1) * (HD / 2) + 127) / 128;
    float x1v[RIT], x2v[RIT];
#pragma unroll
    for (int k = 0; k < RIT; ++k) {
      const int idx = threadIdx.x + 128 * k;
      if (idx < nrot * half) {
        const int h = idx / half, i = idx - h * half;
        const float* xh = head_row(h);
        x1v[k] = xh[style == 0 ? i : 2 * i];
        x2v[k] = xh[style == 0 ? i + half : 2 * i + 1];
      }
    }
    constexpr int VIT = (HD + 127) / 128;
    float vnew[VIT];
    if (last)
#pragma unroll
      for (int k = 0; k < VIT; ++k)
        if (threadIdx.x + 128 * k < HD)
          vnew[k] = xr[(size_t)kcol + (size_t)(nkv + kvh) * HD + threadIdx.x + 128 * k];
#pragma unroll
    for (int k = 0; k < RIT; ++k) {
      const int idx = threadIdx.x + 128 * k;
      if (idx < nrot * half) {
        const int h = idx / half, i = idx - h * half;
        const int i1 = style == 0 ? i : 2 * i, i2 = style == 0 ? i + half : 2 * i + 1;
        rope_rotate(normed(h, i1, x1v[k]), normed(h, i2, x2v[k]), rope_cs[i][0], rope_cs[i][1],
                    sx[h][i1], sx[h][i2]);
      }
    }
    for (int idx = threadIdx.x; idx < nrot * (HD - r); idx += blockDim.x) {
      const int h = idx / (HD - r), i = r + idx - h * (HD - r);
      sx[h][i] = normed(h, i, head_row(h)[i]);
    }
    if (last)
#pragma unroll
      for (int k = 0; k < VIT; ++k)
        if (threadIdx.x + 128 * k < HD) sx[G + 1][threadIdx.x + 128 * k] = vnew[k];
    __syncthreads();
    if constexpr (sizeof(T) == 1) {  // int8 / rk rows: a warp a 64-dim group of k, then of v
      if (last) {
        const size_t row = (size_t)slots[s] * nkv + kvh;
        for (int gi = warp; gi < 2 * (HD / 64); gi += NW) {
          const bool isv = gi >= HD / 64;
          const int g = isv ? gi - HD / 64 : gi;
          float* x = sx[isv ? G + 1 : G];
          float y0, y1;
          if (isv)
            kv_put_group<T, true>(x, vc_new + row * kv_width<T, true>(HD), g, HD, y0, y1);
          else
            kv_put_group<T, false>(x, kc_new + row * kv_width<T>(HD), g, HD, y0, y1);
          x[g * 64 + lane] = y0;  // attended to as stored (only this lane reads these two)
          x[g * 64 + lane + 32] = y1;
        }
      }
      if constexpr (kv_is_rk<T>)  // rk: q to the rotated domain of the pages, a warp a group
        for (int gi = warp; gi < G * (HD / 64); gi += NW) {
          float* x = sx[gi / (HD / 64)] + (gi % (HD / 64)) * 64;
          float a = x[lane], b = x[lane + 32];
          rk_hadamard(a, b);
          x[lane] = a;
          x[lane + 32] = b;
        }
    } else if (last) {
      const size_t row = ((size_t)slots[s] * nkv + kvh) * HD;
      for (int i = threadIdx.x; i < HD; i += blockDim.x) {
        // the attention reads the new k / v as the cache stores them (fp16: rounded)
        if constexpr (sizeof(T) != sizeof(float)) {
          sx[G][i] = kv_round<T>(sx[G][i]);
          sx[G + 1][i] = kv_round<T>(sx[G + 1][i]);
        }
        kv_put(kc_new, row + i, sx[G][i]);  // (the caches; no real lane reads this row from them)
        kv_put(vc_new, row + i, sx[G + 1][i]);
      }
    }
    if constexpr (sizeof(T) != sizeof(float)) __syncthreads();  // (the rounded rows: all lanes)
  }
#pragma unroll
  for (int h = 0; h < G; ++h) {
    const float* qp = ROPE ? sx[h] + lane * V
                           : q + (size_t)t * ldq + (size_t)(kvh * G + h) * HD + lane * V;
#pragma unroll
    for (int i = 0; i < V; ++i) { qv[h][i] = qp[i] * scale; acc[h][i] = 0.f; }
    m[h] = NEG_INF;
    l[h] = 0.f;
  }
  if constexpr (RING && !ROPE) prologue();
  for (int j0 = start + warp, b = 0; j0 < end; j0 += NW * U, ++b) {
    if (RING || !ROPE || j0 != start + warp) load_batch(j0, b);  // (ROPE: the first is loaded)
    if (last)
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (j0 + u * NW == L - 1)  // the new token: rotated in this block
#pragma unroll
          for (int i = 0; i < V; ++i) {
            kv[u][i] = sx[G][lane * V + i];
            vv[u][i] = sx[G + 1][lane * V + i];
          }
    attn_steps<HD, G, U>(qv, kv, vv, min(U, (end - j0 + NW - 1) / NW), acc, m, l);
  }
  if constexpr (RING) cp_async_wait<0>();   // (the ring's last groups are empty: none in flight)
  // merge the 4 warps
  __shared__ float sm_m[NW][G], sm_l[NW][G], sm_o[NW][G][HD];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    if (lane == 0) { sm_m[warp][h] = m[h]; sm_l[warp][h] = l[h]; }
#pragma unroll
    for (int i = 0; i < V; ++i) sm_o[warp][h][lane * V + i] = acc[h][i];
  }
  __syncthreads();
  // one split (as launched, or with the merge in this kernel as the sequence's length fills
  // them): the output
  const bool single = !dsm && (MERGE ? active == 1 : splits == 1);
  __shared__ float sm_ml[CL > 0 ? G : 1][2];  // dsm: the block's (m, l) per head
  // gate, where this block stores outputs: the gates of a thread's outputs come by cp.async to
  // gsm (sx: every warp is past its loop), one round trip landing while the thread merges
  float* gsm = &sx[0][0];
  const bool gated = ROPE && gate && (single || dsm);
  if constexpr (ROPE) {
    if (gated) {
      const int n = dsm ? G * HD / (CL > 0 ? CL : 1) : G * HD;
      const int o0 = CL > 0 && dsm ? (int)cluster_rank() * n : 0;  // (dsm: its slice)
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int idx = o0 + i;
        cp_async_n<4>(gsm + i, gate + (size_t)t * ldq + (size_t)(kvh * G + idx / HD) * qhs +
                                   idx % HD);
      }
      cp_async_commit();
    }
  }
  for (int idx = threadIdx.x; idx < G * HD; idx += blockDim.x) {
    const int h = idx / HD, d = idx - (idx / HD) * HD;
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, sm_m[w][h]);
    float lsum = 0.f, o = 0.f;
    if (M != NEG_INF) {
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float e = expf(sm_m[w][h] - M);
        lsum += e * sm_l[w][h];
        o += e * sm_o[w][h][d];
      }
    }
    const int head = kvh * G + h;
    if (CL > 0 && dsm) {  // (each (h, d) is this thread's alone: in place)
      sm_o[0][h][d] = o;
      if (d == 0) { sm_ml[h][0] = M; sm_ml[h][1] = lsum; }
    } else if (single) {  // (ROPE: + 0 as attn_merge's sums, so -0 comes out as +0 there too)
      float v = (MERGE ? __fadd_rn(o, 0.f) : o) / lsum;
      if (gated) {
        cp_async_wait<0>();   // (its own copies: no barrier)
        v = v / (1.0f + expf(-gsm[idx]));
      }
      out[(size_t)t * ldo + (size_t)head * HD + d] = v;
    } else {
      const size_t pi = ((size_t)s * nh + head) * splits + split;
      part_o[pi * HD + d] = o;
      if (d == 0) { part_ml[pi * 2] = M; part_ml[pi * 2 + 1] = lsum; }
    }
  }
  if constexpr (CL > 0) {
    if (dsm) {
      cluster_sync();  // every block's partial is in its shared memory
      constexpr int SL = G * HD / CL;
      const unsigned rank = cluster_rank();  // (= split: the first cluster)
      if (gated) cp_async_wait<0>();   // (its own copies: no barrier)
      for (int i = threadIdx.x; i < SL; i += blockDim.x) {
        const int idx = rank * SL + i, h = idx / HD, d = idx - h * HD;
        float mv[CL], lv[CL], ov[CL];
#pragma unroll
        for (int r = 0; r < CL; ++r)
          if (r < active) {  // (loads issued together: one round trip)
            mv[r] = ld_cluster(cluster_map(&sm_ml[h][0], r));
            lv[r] = ld_cluster(cluster_map(&sm_ml[h][1], r));
            ov[r] = ld_cluster(cluster_map(&sm_o[0][h][d], r));
          }
        float M = NEG_INF;
#pragma unroll
        for (int r = 0; r < CL; ++r)
          if (r < active) M = fmaxf(M, mv[r]);
        float lsum = 0.f, o = 0.f;  // (merge_block's sums, in split order)
#pragma unroll
        for (int r = 0; r < CL; ++r)
          if (r < active && mv[r] != NEG_INF) lsum += expf(mv[r] - M) * lv[r];
#pragma unroll
        for (int r = 0; r < CL; ++r)
          if (r < active && mv[r] != NEG_INF) o += expf(mv[r] - M) * ov[r];
        float v = o / lsum;
        if (gated) v = v / (1.0f + expf(-gsm[i]));
        out[(size_t)t * ldo + (size_t)kvh * G * HD + idx] = v;
        if (qout) q8_shadow_store(v, 0.f, kvh * G * HD + rank * SL + (i & ~31), nh * HD, qsch, qout);
      }
      cluster_sync();  // no block leaves while another reads its shared memory
      return;
    }
  }
  if (!MERGE || single) return;
  // the last of the active splits to get here merges (CUDA Programming Guide, "Memory Fence
  // Functions": the partials are fenced before the arrival that publishes them)
  __shared__ int merger;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) merger = atomicAdd(counters + s * nkv + kvh, 1) == active - 1;
  __syncthreads();
  if (!merger) return;
  __threadfence();
  static_assert(NW * G * HD >= MERGE_SCRATCH(G), "sm_o too small for merge_block");
  merge_block<G>(part_o, part_ml, ((size_t)s * nh + kvh * G) * splits, splits, active, HD,
                 out + (size_t)t * ldo + (size_t)kvh * G * HD, &sm_o[0][0][0],  // (sm_o: done)
                 qout, kvh * G * HD, nh * HD, qsch,
                 gate ? gate + (size_t)t * ldq + (size_t)kvh * G * qhs : nullptr, qhs);
  if (threadIdx.x == 0) counters[s * nkv + kvh] = 0;  // for the next launch
}

// Merge split-K partials: block per (sequence, head), thread per dim (merge_block). Only the
// splits that the sequence's own length filled are read (the same partition rule as
// attn_decode). qout (one sequence, blockDim.x = hd a multiple of 32, nh hd a multiple of 64;
// else null): the output row also goes to this q8 shadow (common.cuh) for a consumer GEMV of
// weight scheme qsch. gate (else null): the output times sigmoid of gate[row ldg + head ghs + d]
// (merge_block).
extern "C" __global__ void attn_merge(const float* __restrict__ part_o,
                                      const float* __restrict__ part_ml,
                                      const int* __restrict__ cu, const int* __restrict__ ctx_lens,
                                      float* __restrict__ out, int ldo, int nh, int hd,
                                      int splits, int part_len, unsigned char* qout, int qsch,
                                      const float* __restrict__ gate, int ldg, int ghs) {
  pdl_trigger();
  const int s = blockIdx.x, head = blockIdx.y;
  const int L = ctx_lens[s];  // (uploaded before the step: read before the wait)
  const int P = max(part_len, (L + splits - 1) / splits);
  const int active = min(splits, (L + P - 1) / P);
  const int row = cu[s];
  pdl_wait();  // launched with PDL (gpu/launch.py): the partials come from attn_decode
  __shared__ float scratch[MERGE_SCRATCH(1)];
  merge_block<1>(part_o, part_ml, ((size_t)s * nh + head) * splits, splits, active, hd,
                 out + (size_t)row * ldo + (size_t)head * hd, scratch, qout, head * hd, nh * hd,
                 qsch, gate ? gate + (size_t)row * ldg + (size_t)head * ghs : nullptr, ghs);
}

// A pass of a few query rows a sequence (a verify pass: k + 1 rows) as one-row sequences for
// attn_decode's split-K: row t of sequence s (cu[s] <= t < cu[s + 1]) becomes sequence t with
// cu_v[t] = t, its causal length lens[s] - (cu[s + 1] - 1 - t) and s's block table row. Block
// per row; the inputs are host uploads, the outputs read by attn_decode (launched with PDL).
extern "C" __global__ void attn_rows(const int* __restrict__ cu, const int* __restrict__ lens,
                                     const int* __restrict__ bt, int bt_stride, int S,
                                     int* __restrict__ cu_v, int* __restrict__ lens_v,
                                     int* __restrict__ bt_v) {
  pdl_trigger();
  pdl_wait();
  const int t = blockIdx.x;
  int s = 0;
  while (s + 1 < S && cu[s + 1] <= t) ++s;
  if (threadIdx.x == 0) {
    cu_v[t] = t;
    lens_v[t] = lens[s] - (cu[s + 1] - 1 - t);
    if (t == 0) cu_v[gridDim.x] = gridDim.x;
  }
  for (int i = threadIdx.x; i < bt_stride; i += blockDim.x)
    bt_v[(size_t)t * bt_stride + i] = bt[(size_t)s * bt_stride + i];
}

// A verify pass (n <= 8 query rows a sequence) in one read of the KV: block per (sequence, KV
// head, split), blockDim.x / 32 >= n warps, warp w attending row cu[s] + w's G heads. Its causal
// length is L_w = L - (n - 1 - w) and its partition the one attn_decode gives the one-row
// sequence of attn_rows ([split P_w, ...), P_w = max(part_len, ceil(L_w / splits))), so that
// attn_merge reads the partials as it does on that path; the block copies the union of its rows'
// partitions to shared memory by cp.async, VT positions a tile in a ring of VNS tiles (all
// threads copy; VNS - 1 tiles in flight while one is attended), and every warp runs attn_steps
// over the tile's positions inside its own range. Rows of 4-byte multiples (the host checks).
// Outputs as attn_decode's for sequence cu[s] + w: the normalised row with one split, else its
// (m, l) and unnormalised partial where the split holds positions of the row.
constexpr int VT = 16, VNS = 3;
template <typename T, int HD, int G>
__global__ void __launch_bounds__(256)
attn_verify(const float* __restrict__ q, int ldq, const T* __restrict__ kc,
            const T* __restrict__ vc, const int* __restrict__ cu,
            const int* __restrict__ ctx_lens, const int* __restrict__ block_tables,
            int bt_stride, int page_size, int nkv, float scale, int part_len, int splits,
            float* __restrict__ out, int ldo, float* __restrict__ part_o,
            float* __restrict__ part_ml) {
  pdl_trigger();
  pdl_wait();  // q and the pass's own KV rows come from the kernels before
  constexpr int V = HD / 32, U = 4;
  constexpr int RKB = kv_width<T, false>(HD) * sizeof(T), RVB = kv_width<T, true>(HD) * sizeof(T);
  constexpr int RB = RKB + RVB;
  constexpr int CPY = RKB % 16 == 0 && RVB % 16 == 0 ? 16 : RKB % 8 == 0 && RVB % 8 == 0 ? 8 : 4;
  // (instantiated for every KV type; launched only where both rows are 4-byte multiples)
  const int s = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row0 = cu[s], n = cu[s + 1] - row0, L = ctx_lens[s];
  const int nh = nkv * G;
  const int* bt = block_tables + (size_t)s * bt_stride;
  // row w's range [w_lo, w_hi) and whether this split holds any of it; the block's union
  auto range = [&](int w, int& lo, int& hi) {
    const int lw = L - (n - 1 - w);
    const int P = max(part_len, (lw + splits - 1) / splits);
    lo = split * P;
    hi = min(lw, lo + P);
  };
  int lo = 0, hi = 0;  // this warp's row
  if (warp < n) range(warp, lo, hi);
  int ulo = 1 << 30, uhi = 0;
  for (int w = 0; w < n; ++w) {
    int a, b;
    range(w, a, b);
    if (a < b) { ulo = min(ulo, a); uhi = max(uhi, b); }
  }
  if (ulo >= uhi) return;  // no row has positions in this split (none of its partials is read)
  extern __shared__ __align__(16) unsigned char vring[];
  // tile i's positions ulo + VT i .. into ring slot i % VNS, one commit group (even empty)
  auto issue = [&](int i) {
    constexpr int CR = RB / CPY;
    unsigned char* dst0 = vring + (size_t)(i % VNS) * VT * RB;
    const int j0 = ulo + i * VT;
    for (int idx = threadIdx.x; idx < VT * CR; idx += blockDim.x) {
      const int u = idx / CR, c = idx - u * CR, j = j0 + u;
      if (j >= uhi) break;  // (idx grows with u)
      kv_piece_async<T, HD, CPY>(dst0 + u * RB, kc, vc, bt, j, page_size, nkv, kvh, c);
    }
    cp_async_commit();
  };
  const int ntile = (uhi - ulo + VT - 1) / VT;
#pragma unroll
  for (int i = 0; i < VNS - 1; ++i) issue(i);
  float qv[G][V], acc[G][V], m[G], l[G];
  const int t = row0 + min(warp, n - 1);
#pragma unroll
  for (int h = 0; h < G; ++h) {
    const float* qp = q + (size_t)t * ldq + (size_t)(kvh * G + h) * HD + lane * V;
#pragma unroll
    for (int i = 0; i < V; ++i) { qv[h][i] = qp[i] * scale; acc[h][i] = 0.f; }
    m[h] = NEG_INF;
    l[h] = 0.f;
  }
  float kv[U][V], vv[U][V];
  for (int i = 0; i < ntile; ++i) {
    cp_async_wait<VNS - 2>();  // (groups commit in tile order: tile i's is done)
    __syncthreads();           // every thread's copies of tile i are visible, and tile i - 1
    issue(i + VNS - 1);        // is attended by all warps: its slot takes tile i + VNS - 1
    const unsigned char* tile = vring + (size_t)(i % VNS) * VT * RB;
    const int j0 = ulo + i * VT;
    const int a = max(lo, j0), b = min(hi, j0 + VT);  // this warp's positions of the tile
    for (int j = a; j < b; j += U) {
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (j + u < b) {
          const unsigned char* r = tile + (size_t)(j + u - j0) * RB;
          kv_load_row<V, false>(reinterpret_cast<const T*>(r), lane * V, HD, kv[u]);
          kv_load_row<V, true>(reinterpret_cast<const T*>(r + RKB), lane * V, HD, vv[u]);
        }
      attn_steps<HD, G, U>(qv, kv, vv, min(U, b - j), acc, m, l);
    }
  }
  cp_async_wait<0>();
  if (warp >= n || lo >= hi) return;
#pragma unroll
  for (int h = 0; h < G; ++h) {
    const int head = kvh * G + h;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int d = lane * V + i;
      if (splits == 1) {
        out[(size_t)t * ldo + (size_t)head * HD + d] = acc[h][i] / l[h];
      } else {
        const size_t pi = ((size_t)t * nh + head) * splits + split;
        part_o[pi * HD + d] = acc[h][i];
        if (d == 0) { part_ml[pi * 2] = m[h]; part_ml[pi * 2 + 1] = l[h]; }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Prefill / mixed: flash-style tiles. Sequence s's query rows, for one KV head, form a
// (q_len * G, HD) matrix with row r = token i * G + head-in-group (as the NumPy reference);
// a block takes BR = 32 such rows (work list `tiles`: (s, r0) pairs; grid (n_tiles, nkv)) and
// walks KV tiles of BC = 32 positions up to its last row's causal limit, with Q, K, V and P
// tiles in shared memory. 128 threads: thread (row = tid / 4, c = tid % 4) computes scores for
// keys c, c + 4, ... and output dims c, c + 4, ...
template <typename T, int HD>
__global__ void __launch_bounds__(128)
attn_prefill(const float* __restrict__ q, int ldq, const T* __restrict__ kc,
             const T* __restrict__ vc, const int* __restrict__ cu,
             const int* __restrict__ ctx_lens, const int* __restrict__ block_tables,
             int bt_stride, int page_size, int nkv, int G, float scale,
             const int* __restrict__ tiles, float* __restrict__ out, int ldo) {
  constexpr int BR = 32, BC = 32, QP = HD + 1;
  extern __shared__ float smem[];
  float* Qs = smem;               // BR x QP
  float* Ks = Qs + BR * QP;       // BC x QP
  float* Vs = Ks + BC * QP;       // BC x HD
  float* Ps = Vs + BC * HD;       // BR x (BC + 1)
  const int s = tiles[2 * blockIdx.x], r0 = tiles[2 * blockIdx.x + 1];
  const int kvh = blockIdx.y;
  const int qs = cu[s], q_len = cu[s + 1] - qs, L = ctx_lens[s];
  const int nrows = q_len * G;
  const int tid = threadIdx.x, my_r = tid >> 2, my_c = tid & 3;
  const int* bt = block_tables + (size_t)s * bt_stride;

  for (int idx = tid; idx < BR * HD; idx += blockDim.x) {
    const int r = idx / HD, d = idx - (idx / HD) * HD;
    const int row = r0 + r;
    float v = 0.f;
    if (row < nrows) {
      const int i = row / G, hh = row - (row / G) * G;
      v = q[(size_t)(qs + i) * ldq + (size_t)(kvh * G + hh) * HD + d] * scale;
    }
    Qs[r * QP + d] = v;
  }
  const int my_row = r0 + my_r;
  const bool valid = my_row < nrows;
  const int my_i = valid ? my_row / G : 0;
  const int limit = L - q_len + my_i;  // last KV position this row may see
  const int last_row = min(r0 + BR, nrows) - 1;
  const int kv_end = L - q_len + last_row / G + 1;

  float acc[HD / 4];
#pragma unroll
  for (int i = 0; i < HD / 4; ++i) acc[i] = 0.f;
  float m = NEG_INF, l = 0.f;

  for (int kb = 0; kb < kv_end; kb += BC) {
    __syncthreads();
    for (int idx = tid; idx < BC * HD; idx += blockDim.x) {
      const int c = idx / HD, d = idx - (idx / HD) * HD;
      const int j = kb + c;
      float kv = 0.f, vv = 0.f;
      if (j < kv_end) {
        kv = kv_at<false>(kc + kv_row<T, false>(bt, j, page_size, nkv, kvh, HD), d, HD);
        vv = kv_at<true>(vc + kv_row<T, true>(bt, j, page_size, nkv, kvh, HD), d, HD);
      }
      Ks[c * QP + d] = kv;
      Vs[c * HD + d] = vv;
    }
    __syncthreads();
    float sc[BC / 4];
    float tmax = NEG_INF;
#pragma unroll
    for (int jj = 0; jj < BC / 4; ++jj) {
      const int c = my_c + 4 * jj;
      float d = 0.f;
#pragma unroll 16
      for (int k = 0; k < HD; ++k) d = fmaf(Qs[my_r * QP + k], Ks[c * QP + k], d);
      if (!valid || kb + c > limit) d = NEG_INF;
      sc[jj] = d;
      tmax = fmaxf(tmax, d);
    }
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
    const float mn = fmaxf(m, tmax);
    const float mu = mn == NEG_INF ? 0.f : mn;
    const float corr = expf(m - mu);
    float rs = 0.f;
#pragma unroll
    for (int jj = 0; jj < BC / 4; ++jj) {
      const float p = expf(sc[jj] - mu);
      rs += p;
      Ps[my_r * (BC + 1) + my_c + 4 * jj] = p;
    }
    rs += __shfl_xor_sync(0xffffffffu, rs, 1);
    rs += __shfl_xor_sync(0xffffffffu, rs, 2);
    l = l * corr + rs;
    m = mn;
    __syncwarp();
#pragma unroll
    for (int dd = 0; dd < HD / 4; ++dd) {
      const int d = my_c + 4 * dd;
      float a = acc[dd] * corr;
#pragma unroll 8
      for (int c = 0; c < BC; ++c) a = fmaf(Ps[my_r * (BC + 1) + c], Vs[c * HD + d], a);
      acc[dd] = a;
    }
  }
  if (valid) {
    const int hh = my_row - my_i * G;
    float* o = out + (size_t)(qs + my_i) * ldo + (size_t)(kvh * G + hh) * HD;
#pragma unroll
    for (int dd = 0; dd < HD / 4; ++dd) o[my_c + 4 * dd] = acc[dd] / l;
  }
}

// ---------------------------------------------------------------------------------------------
// Prefill / mixed on tensor cores: the same work split and causal rule as attn_prefill, in
// FlashAttention-2's form (Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism
// and Work Partitioning", section 3: each warp owns 16 query rows, the softmax statistics stay
// in registers, K / V tiles are shared by the block's warps). A block takes BR = 16 NW rows (NW
// warps x 16: more rows a block, fewer reads of each K / V tile) and walks KV tiles of BC
// positions (64 or 32); QREG: the Q fragments stay in
// registers (else they are re-read from shared memory per tile, which frees registers for more
// resident blocks: MINB, the launch bound); Q (pre-scaled by scale * log2 e, so the
// exponentials are exp2), K and V are rounded to fp16 in shared memory, S = Q K^T and O += P V
// are mma.sync m16n8k16 with fp32 accumulation, P rounded to fp16 in registers (the S
// accumulator's layout is the A operand's, as in FlashAttention-2). Error against the float64
// reference: fp16 rounding of the inputs and of P (bound F16_ATTN in the GPU tests).
// Fragment layouts: PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"; the
// fragments come by ldmatrix (x4: two 8-column tiles or one 16 x 16 A tile an instruction), V's
// transposed by ldmatrix .trans from V rows stored as they are (a transposing store of 2-byte
// elements hit 16-way bank conflicts). Every KV row read is aligned to 4 elements (HD % 4 == 0
// and an aligned cache: the caller checks). K and V are rounded to fp16 anyway, so an fp16
// cache gives the same operands.
// Shared memory (fp16): Q BR x (HD + 8), then K and V, BC x (HD + 8) each (the paddings make
// ldmatrix conflict-free); attention.py's _prefill_mma_launch computes the size and picks MODE:
// 0: each tile loaded to registers and converted (float32 caches).
// 1 (1-byte caches, int8 and rk, whose rows are 4-byte multiples): BC raw K and V rows after V;
//   the next tile's bytes come by cp.async while this tile's MMAs run, and the convert to fp16
//   reads them from shared memory (a tile loaded and dequantized from global memory, nothing
//   else in flight, cost int8 and rk 40 % of the attention at 32K).
// 2 (fp16 caches): K and V twice (a ring of two tiles), the rows copied by cp.async straight
//   into the next tile's buffers while this tile's MMAs run; rows past the end are zeros.

// Four 8 x 8 matrices of 2-byte elements from shared memory (a shared-space address, smem_addr),
// lane l giving the address of row l & 7 of matrix l >> 3; .trans hands each thread the
// transposed elements (PTX ISA, "ldmatrix").
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], unsigned a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], unsigned a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

template <typename T, int HD, int BC, bool QREG, int MINB, int NW = 4, int MODE = 0>
__global__ void __launch_bounds__(32 * NW, MINB)
attn_prefill_mma(const float* __restrict__ q, int ldq, const T* __restrict__ kc,
                 const T* __restrict__ vc, const int* __restrict__ cu,
                 const int* __restrict__ ctx_lens, const int* __restrict__ block_tables,
                 int bt_stride, int page_size, int nkv, int G, float scale,
                 const int* __restrict__ tiles, float* __restrict__ out, int ldo) {
  constexpr int NT_ = 32 * NW, BR = 16 * NW, SP = HD + 8;  // fp16 row stride
  constexpr int KK = HD / 16, NT = BC / 8, DT = HD / 8;
  constexpr int LPT = BC * HD / 4 / NT_, UB = LPT < 4 ? LPT : 4;   // K / V float4s per thread
  constexpr int WK = kv_width<T, false>(HD), WV = kv_width<T, true>(HD);   // row elements
  static_assert(MODE == 0 || (MODE == 1 && sizeof(T) == 1 && WK % 4 == 0 && WV % 4 == 0) ||
                    (MODE == 2 && sizeof(T) == 2 && WK % 2 == 0 && WV % 2 == 0),
                "MODE 1: 1-byte rows of 4-byte multiples; MODE 2: 2-byte rows of 4-byte multiples");
  static_assert(NT % 2 == 0 && DT % 2 == 0, "ldmatrix x4: column tiles in pairs");
  constexpr int NB = MODE == 2 ? 2 : 1;   // K / V tile buffers
  constexpr int RK = WK * sizeof(T), RV = WV * sizeof(T);   // row bytes
  constexpr int CPY = RK % 16 == 0 && RV % 16 == 0 ? 16 : RK % 8 == 0 && RV % 8 == 0 ? 8 : 4;
  extern __shared__ __align__(16) unsigned short psm[];
  unsigned short* Qs = psm;                // BR x SP
  unsigned short* Kb = Qs + BR * SP;       // NB x BC x SP
  unsigned short* Vb = Kb + NB * BC * SP;  // NB x BC x SP: V[position][d]
  unsigned char* raw = reinterpret_cast<unsigned char*>(Vb + NB * BC * SP);   // MODE 1
  const int s = tiles[2 * blockIdx.x], r0 = tiles[2 * blockIdx.x + 1];
  const int kvh = blockIdx.y;
  const int qs = cu[s], q_len = cu[s + 1] - qs, L = ctx_lens[s];
  const int nrows = q_len * G;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int* bt = block_tables + (size_t)s * bt_stride;
  const float qscale = scale * 1.4426950408889634f;

  for (int idx = tid; idx < BR * HD / 2; idx += blockDim.x) {
    const int r = idx / (HD / 2), d = 2 * (idx - r * (HD / 2));
    const int row = r0 + r;
    float a = 0.f, b = 0.f;
    if (row < nrows) {
      const int i = row / G, hh = row - i * G;
      const float* src = q + (size_t)(qs + i) * ldq + (size_t)(kvh * G + hh) * HD + d;
      a = src[0] * qscale;
      b = src[1] * qscale;
    }
    *reinterpret_cast<unsigned*>(Qs + r * SP + d) = pack_h2(a, b);
  }
  // this thread's two rows: g and g + 8 of the warp's 16; limit = last KV position it may see
  int lim[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = r0 + warp * 16 + g + 8 * h;
    lim[h] = row < nrows ? L - q_len + row / G : -1;
  }
  const int last_row = min(r0 + BR, nrows) - 1;
  const int kv_end = L - q_len + last_row / G + 1;
  const int warp_lim = max(lim[0], lim[1]);   // (rows of a warp grow with g: max over the warp)
  const int warp_end = __reduce_max_sync(0xffffffffu, warp_lim) + 1;

  // ldmatrix row addresses of this lane (matrix mi = lane >> 3, its row lane & 7): A (Q rows
  // 0-7 / 8-15 of the warp, columns +0 / +8), B of S (K positions n8 + row of tiles n, n + 1,
  // dims +0 / +8) and B of O (V positions +0 / +8 of a 16, dims of tiles j, j + 1)
  // (shared-space byte addresses: 32-bit arithmetic, fewer registers than generic pointers)
  const int mi = lane >> 3, mr = lane & 7;
  const unsigned qw = smem_addr(Qs + (warp * 16 + (mi & 1) * 8 + mr) * SP + (mi >> 1) * 8);
  const unsigned k_a = smem_addr(Kb + ((mi >> 1) * 8 + mr) * SP + (mi & 1) * 8);
  const unsigned v_a = smem_addr(Vb + ((mi & 1) * 8 + mr) * SP + (mi >> 1) * 8);
  __syncthreads();

  unsigned qa[QREG ? KK : 1][4];
  if constexpr (QREG) {
#pragma unroll
    for (int kk = 0; kk < KK; ++kk) ldsm_x4(qa[kk], qw + 32 * kk);
  }
  float o[DT][4];
#pragma unroll
  for (int j = 0; j < DT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};

  // MODE 1: the raw K and V rows of positions kb0 .. kb0 + BC - 1 (those below kv_end) into
  // raw; MODE 2: the fp16 rows into buffer b's K and V tiles, V rows past kv_end zeroed (their
  // P is 0, and 0 x garbage could be NaN); CPY bytes a copy, consecutive threads on consecutive
  // chunks of a row; one commit group
  auto stage = [&](int kb0, int b) {
    constexpr int CK = RK / CPY, CR = (RK + RV) / CPY;   // chunks of a K row, of both rows
    for (int idx = tid; idx < BC * CR; idx += NT_) {
      const int c = idx / CR, w = idx - c * CR;
      unsigned char* dst = MODE == 2
          ? reinterpret_cast<unsigned char*>(w < CK ? Kb + (b * BC + c) * SP
                                                    : Vb + (b * BC + c) * SP) +
                (w < CK ? w : w - CK) * CPY
          : (w < CK ? raw + c * WK + w * CPY : raw + BC * WK + c * WV + (w - CK) * CPY);
      if (kb0 + c >= kv_end) {
        if (MODE != 2) break;   // (idx grows with c: the rest are past kv_end too)
        if constexpr (CPY == 16) *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
        else if constexpr (CPY == 8) *reinterpret_cast<uint2*>(dst) = make_uint2(0u, 0u);
        else *reinterpret_cast<unsigned*>(dst) = 0u;
        continue;
      }
      const unsigned char* src = w < CK
          ? reinterpret_cast<const unsigned char*>(kc + kv_row<T, false>(bt, kb0 + c, page_size,
                                                                          nkv, kvh, HD)) + w * CPY
          : reinterpret_cast<const unsigned char*>(vc + kv_row<T, true>(bt, kb0 + c, page_size,
                                                                         nkv, kvh, HD)) +
                (w - CK) * CPY;
      cp_async_n<CPY>(dst, src);
    }
    cp_async_commit();
  };
  if constexpr (MODE != 0) stage(0, 0);

  for (int kb = 0, it = 0; kb < kv_end; kb += BC, ++it) {
    const int b = MODE == 2 ? (it & 1) : 0;
    const unsigned kb_a = k_a + b * (2 * BC * SP), vb_a = v_a + b * (2 * BC * SP);   // bytes
    if constexpr (MODE != 0) cp_async_wait<0>();   // this thread's copies of the tile's rows
    __syncthreads();   // (and everyone's: the tile is complete; the last tile's MMAs are done)
    if constexpr (MODE == 2) {   // the other buffer is free: the next tile's rows, in flight
      if (kb + BC < kv_end) stage(kb + BC, b ^ 1);   // during this tile's MMAs
    } else {
      // UB rows of 4-element loads in flight per thread before any conversion
#pragma unroll
      for (int i0 = 0; i0 < LPT; i0 += UB) {
        typename kv_vec4<T>::type kv[UB], vv[UB];
#pragma unroll
        for (int u = 0; u < UB; ++u) {
          const int idx = tid + (i0 + u) * NT_;
          const int c = idx / (HD / 4), d = 4 * (idx - c * (HD / 4));
          kv[u] = vv[u] = kv_zero4<T>();
          if (kb + c < kv_end) {
            if constexpr (MODE == 1) {
              kv[u] = kv_ld4r<false>(reinterpret_cast<const T*>(raw + c * WK), d, HD);
              vv[u] = kv_ld4r<true>(reinterpret_cast<const T*>(raw + BC * WK + c * WV), d, HD);
            } else {
              kv[u] = kv_ld4r<false>(kc + kv_row<T, false>(bt, kb + c, page_size, nkv, kvh,
                                                            HD), d, HD);
              vv[u] = kv_ld4r<true>(vc + kv_row<T, true>(bt, kb + c, page_size, nkv, kvh, HD),
                                    d, HD);
            }
          }
        }
#pragma unroll
        for (int u = 0; u < UB; ++u) {
          const int idx = tid + (i0 + u) * NT_;
          const int c = idx / (HD / 4), d = 4 * (idx - c * (HD / 4));
          const uint2 kh = kv_h4(kv[u]), vh = kv_h4(vv[u]);
          *reinterpret_cast<uint2*>(Kb + c * SP + d) = kh;
          *reinterpret_cast<uint2*>(Vb + c * SP + d) = vh;
        }
      }
      __syncthreads();
      if constexpr (MODE == 1) {   // raw is free (every thread has converted it): the next
        if (kb + BC < kv_end) stage(kb + BC, 0);   // tile's rows
      }
    }
    if (kb >= warp_end) continue;   // every row of this warp is past its causal limit

    float sc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KK; ++kk) {
      unsigned a[4];
      if constexpr (QREG) {
        a[0] = qa[kk][0]; a[1] = qa[kk][1]; a[2] = qa[kk][2]; a[3] = qa[kk][3];
      } else {
        ldsm_x4(a, qw + 32 * kk);
      }
#pragma unroll
      for (int n = 0; n < NT; n += 2) {
        unsigned kf[4];   // B of tiles n (kf[0], kf[1]) and n + 1 (kf[2], kf[3])
        ldsm_x4(kf, kb_a + 2 * (n * 8 * SP + kk * 16));
        mma16816(sc[n], a, kf[0], kf[1]);
        mma16816(sc[n + 1], a, kf[2], kf[3]);
      }
    }
    // causal mask, running max / sum (a row's 4 threads: lanes 4g .. 4g + 3)
    float corr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = NEG_INF;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int pos = kb + n * 8 + 2 * t + e;
          float v = sc[n][2 * h + e];
          v = pos > lim[h] ? NEG_INF : v;
          sc[n][2 * h + e] = v;
          mx = fmaxf(mx, v);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mn = fmaxf(m[h], mx);
      const float mu = mn == NEG_INF ? 0.f : mn;
      corr[h] = exp2f(m[h] - mu);
      float rs = 0.f;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p = exp2f(sc[n][2 * h + e] - mu);
          sc[n][2 * h + e] = p;
          rs += p;
        }
      }
      l[h] = l[h] * corr[h] + rs;   // this thread's share of the row sum (summed at the end)
      m[h] = mn;
    }
#pragma unroll
    for (int j = 0; j < DT; ++j) {
      o[j][0] *= corr[0]; o[j][1] *= corr[0];
      o[j][2] *= corr[1]; o[j][3] *= corr[1];
    }
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      const unsigned pa[4] = {pack_h2(sc[2 * kk][0], sc[2 * kk][1]),
                              pack_h2(sc[2 * kk][2], sc[2 * kk][3]),
                              pack_h2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                              pack_h2(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
      for (int j = 0; j < DT; j += 2) {
        unsigned vf[4];   // B of dim tiles j (vf[0], vf[1]) and j + 1 (vf[2], vf[3])
        ldsm_x4_t(vf, vb_a + 2 * (kk * 16 * SP + j * 8));
        mma16816(o[j], pa, vf[0], vf[1]);
        mma16816(o[j + 1], pa, vf[2], vf[3]);
      }
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    const int row = r0 + warp * 16 + g + 8 * h;
    if (row >= nrows) continue;
    const int i = row / G, hh = row - i * G;
    const float inv = 1.f / l[h];
    float* dst = out + (size_t)(qs + i) * ldo + (size_t)(kvh * G + hh) * HD + 2 * t;
#pragma unroll
    for (int j = 0; j < DT; ++j) {
      dst[j * 8] = o[j][2 * h] * inv;
      dst[j * 8 + 1] = o[j][2 * h + 1] * inv;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The rk modes' rotation of attention rows: y = H64 x per 64-dim group (common.cuh,
// rk_hadamard; H64 is its own inverse, so this also rotates back), x rows of `width` floats with
// stride ldx, y rows with stride ldy (y may be x: each warp rewrites the group it read). Block
// per row, a warp a group.
extern "C" __global__ void __launch_bounds__(128)
kv_hadamard_rows(const float* __restrict__ x, int ldx, float* __restrict__ y, int ldy,
                 int width) {
  pdl_trigger();
  pdl_wait();  // launched with PDL (gpu/launch.py): x comes from the kernel before
  const int lane = threadIdx.x & 31;
  const float* xr = x + (size_t)blockIdx.x * ldx;
  float* yr = y + (size_t)blockIdx.x * ldy;
  for (int g = threadIdx.x >> 5; g < width / 64; g += blockDim.x >> 5) {
    float a = xr[g * 64 + lane], b = xr[g * 64 + lane + 32];
    rk_hadamard(a, b);
    yr[g * 64 + lane] = a;
    yr[g * 64 + lane + 32] = b;
  }
}
