// requires: linear attention
// Persistent batch-1 decode of a Llama model's layers in one kernel ("megakernel": one launch
// for all layers, as Hazy Research's "No Bubbles" Llama-1B decode and Mirage's MPK). Why: at
// batch 1 a layer is four weight-streaming GEMVs plus attention, and with one kernel each, every
// boundary drains the weight stream (the next kernel's blocks wait for the previous one's to
// leave, then pay the first round trip) -- some 4 us per GEMV on the H200
// (bench/gpu_notes.md, session 7). Here the grid is persistent (one block per multiprocessor,
// all resident) and each block's producer thread streams its share of every weight of every
// layer through one ring of shared-memory slots (gemv_bulk's bulk copies and mbarriers,
// linear.cu), never waiting for the math: across the grid barriers between phases and during
// attention it keeps loading the next weight.
//
// Per layer, the W consumer warps of every block run five phases, separated by grid barriers:
//   1. qkv = W_qkv RMSNorm(h)            (bulk_consume, int8 activations)
//   2. attention: RoPE of q and k, the new k / v into the paged cache, split-K softmax over
//      the context (block = (KV head, split)); the last block of a KV head to finish merges
//      the splits (threadfence reduction, counter per KV head)
//   3. h += W_o att
//   4. gu = W_gate_up RMSNorm(h)
//   5. h += W_down (silu(gate) * up)
// Activations written by other blocks are read through L2 only (ld.global.cg): L1 is not
// coherent. Everything is T = 1, S = 1 (one sequence, one new token at position L - 1).
// (common.cuh, linear.cu and attention.cu are prepended by the Python loader: gpu.source.)

// A compile-time int as a value (template arguments through a generic lambda).
template <int V>
struct MkTag {
  static constexpr int value = V;
};

// Weights and caches of one layer (megakernel.py packs them as 12 int64 per layer).
struct MkLayer {
  const unsigned char* codes[4];   // qkv, o, gate_up, down: mma-layout codes ...
  const unsigned char* scales[4];  // ... and scale words
  const float* in_norm;            // (H,) RMSNorm weights
  const float* post_norm;
  float* kc;                       // (num_pages, page_size, nkv, HD) float32
  float* vc;
};

// (ld_acquire, grid_sync: linear.cu)

#define MK_ATTN_CHUNK 256

// The attention splits of a context of L positions: at least MK_ATTN_CHUNK positions each, at
// most grid / nkv of them (grid >= nkv: megakernel.plan).
__device__ __forceinline__ int mk_splits(int L, int nkv) {
  return min(max(1, (int)gridDim.x / nkv), (L + MK_ATTN_CHUNK - 1) / MK_ATTN_CHUNK);
}

// Prefetch to L2 the cached K / V rows that this block's attention split will read (positions
// [start, end) minus L - 1; at most MK_PREFETCH_ROWS per block), at the start of the layer: a
// demand load that misses L2 waits ~2 us behind the weight stream, once per batch of positions
// on the attention's critical path. (A layer ahead was too early: 66 MB of weights pass through
// L2 in between; bench/gpu_notes.md, session 9.)
#define MK_PREFETCH_ROWS 256
template <int HD, int NT>
__device__ __forceinline__ void mk_prefetch_kv(const float* kc, const float* vc, int nkv, int L,
                                               const int* __restrict__ bt, int page_size) {
  const int splits = mk_splits(L, nkv);
  if ((int)blockIdx.x >= nkv * splits) return;
  const int kvh = blockIdx.x % nkv, split = blockIdx.x / nkv;
  const int P = (L + splits - 1) / splits, start = split * P;
  const int end = min(min(L - 1, start + P), start + MK_PREFETCH_ROWS);
  constexpr int LINES = HD * 4 / 128;  // 128-byte lines per row
  for (int idx = threadIdx.x; idx < (end - start) * LINES * 2; idx += NT) {
    const int r = idx / (2 * LINES), li = idx - r * 2 * LINES;
    const size_t base = kv_row(bt, start + r, page_size, nkv, kvh, HD);
    const float* a = (li < LINES ? kc : vc) + base + (li % LINES) * 32;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
  }
}

// Phase 2 for one block: KV head kvh = b % nkv, split b / nkv of mk_splits (blocks past
// nkv * splits idle), positions [split P, min(L, (split + 1) P)), P = ceil(L / splits) (as
// mk_prefetch_kv); warp w takes every W-th. The new token (position
// L - 1) is read from the roped k / v in shared memory and written to the cache by the block
// whose range holds it, so no block reads a cache entry that this launch writes. Scratch sm:
// (G + 2) HD + W G (HD + 2) floats.
template <int HD, int G, int W>
__device__ __forceinline__ void mk_attention(const float* __restrict__ qkv,
                                             float* __restrict__ att, float* __restrict__ part,
                                             unsigned* __restrict__ cnt, float* kc, float* vc,
                                             int nkv, int L, int pos, long long slot,
                                             const int* __restrict__ bt, int page_size,
                                             const float* __restrict__ inv_freq, float scale,
                                             float* sm, unsigned long long* tr = nullptr) {
  constexpr int V = HD / 32, HALF = HD / 2, NT = W * 32;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // a short context is one block per KV head and needs no merge
  const int splits = mk_splits(L, nkv);
  if ((int)blockIdx.x >= nkv * splits) return;
  const int kvh = blockIdx.x % nkv, split = blockIdx.x / nkv, nq = nkv * G;
  const int P = (L + splits - 1) / splits;
  const int start = split * P, end = min(L, start + P);
  const bool cur = start <= L - 1 && L - 1 < end;
  float* qs = sm;               // G x HD: roped q * scale
  float* kcur = qs + G * HD;    // HD: roped k of the new token
  float* vcur = kcur + HD;      // HD
  float* sm_ml = vcur + HD;     // W x G x 2: (m, l) per warp and head
  float* sm_o = sm_ml + W * G * 2;  // W x G x HD
  // Warp w takes positions start + w + W (U b + u), U at a time (attn_steps). At 16 consumer
  // warps (96 registers a thread) U = 4 spills more than 2, so 2 there.
  constexpr int U = W <= 8 ? 4 : 2;
  float kv[U][V], vv[U][V];
  // this warp's first batch of cached rows, loaded before q / k / v (they do not depend on this
  // step): the two round trips overlap
  auto load_batch = [&](int j0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = j0 + u * W;
      if (j < end && j != L - 1) {
        const size_t base = kv_row(bt, j, page_size, nkv, kvh, HD) + lane * V;
#pragma unroll
        for (int i = 0; i < V; ++i) { kv[u][i] = kc[base + i]; vv[u][i] = vc[base + i]; }
      }
    }
  };
  load_batch(start + warp);
  for (int idx = tid; idx < (G + 1) * HALF; idx += NT) {  // RoPE ("half" pairs i, i + HD / 2)
    const int hh = idx / HALF, i = idx - hh * HALF;
    const float* src = qkv + (size_t)(hh < G ? kvh * G + hh : nq + kvh) * HD;
    const float ang = (float)pos * inv_freq[i];
    const float c = cosf(ang), s = sinf(ang);
    const float x1 = ld_f<true>(src + i), x2 = ld_f<true>(src + i + HALF);
    float o1, o2;
    rope_rotate(x1, x2, c, s, o1, o2);
    if (hh < G) {
      qs[hh * HD + i] = o1 * scale;
      qs[hh * HD + i + HALF] = o2 * scale;
    } else {
      kcur[i] = o1;
      kcur[i + HALF] = o2;
    }
  }
  for (int d = tid; d < HD; d += NT) vcur[d] = ld_f<true>(qkv + (size_t)(nq + nkv + kvh) * HD + d);
  bar_sync_1(NT);
  if (tr && tid == 0) tr[2] = globaltimer();  // trace: q, k, v loaded and roped
  if (cur && slot >= 0)
    for (int d = tid; d < HD; d += NT) {
      kc[((size_t)slot * nkv + kvh) * HD + d] = kcur[d];
      vc[((size_t)slot * nkv + kvh) * HD + d] = vcur[d];
    }

  float qv[G][V], acc[G][V], m[G], l[G];
#pragma unroll
  for (int h = 0; h < G; ++h) {
#pragma unroll
    for (int i = 0; i < V; ++i) { qv[h][i] = qs[h * HD + lane * V + i]; acc[h][i] = 0.f; }
    m[h] = NEG_INF;
    l[h] = 0.f;
  }
  for (int j0 = start + warp; j0 < end; j0 += W * U) {
    if (j0 != start + warp) load_batch(j0);
#pragma unroll
    for (int u = 0; u < U; ++u)  // the new token's k / v: from shared memory
      if (j0 + u * W == L - 1)
#pragma unroll
        for (int i = 0; i < V; ++i) { kv[u][i] = kcur[lane * V + i]; vv[u][i] = vcur[lane * V + i]; }
    attn_steps<HD, G, U>(qv, kv, vv, min(U, (end - j0 + W - 1) / W), acc, m, l);
  }
  if (tr && tid == 0) tr[3] = globaltimer();  // trace: warp 0's positions done
#pragma unroll
  for (int h = 0; h < G; ++h) {
    if (lane == 0) { sm_ml[(warp * G + h) * 2] = m[h]; sm_ml[(warp * G + h) * 2 + 1] = l[h]; }
#pragma unroll
    for (int i = 0; i < V; ++i) sm_o[(warp * G + h) * HD + lane * V + i] = acc[h][i];
  }
  bar_sync_1(NT);
  for (int idx = tid; idx < G * HD; idx += NT) {  // merge the warps (fixed order)
    const int h = idx / HD, d = idx - h * HD;
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < W; ++w) M = fmaxf(M, sm_ml[(w * G + h) * 2]);
    float lsum = 0.f, o = 0.f;
    if (M != NEG_INF)
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const float e = expf(sm_ml[(w * G + h) * 2] - M);
        lsum += e * sm_ml[(w * G + h) * 2 + 1];
        o += e * sm_o[(w * G + h) * HD + d];
      }
    const int head = kvh * G + h;
    if (splits == 1) {
      att[(size_t)head * HD + d] = o / lsum;
    } else {
      float* pp = part + ((size_t)(kvh * splits + split) * G + h) * (HD + 2);
      pp[d] = o;
      if (d == 0) { pp[HD] = M; pp[HD + 1] = lsum; }
    }
  }
  if (tr && tid == 0) tr[4] = globaltimer();  // trace: the warps merged
  if (splits == 1) return;
  // The last block of this KV head to get here merges the splits (in split order).
  __shared__ int last;
  __threadfence();
  bar_sync_1(NT);
  if (tid == 0) last = atomicAdd(cnt + kvh, 1u) == (unsigned)(splits - 1);
  bar_sync_1(NT);
  if (!last) return;
  __threadfence();
  for (int idx = tid; idx < G * HD; idx += NT) {
    const int h = idx / HD, d = idx - h * HD;
    const float* p0 = part + ((size_t)kvh * splits * G + h) * (HD + 2);
    const size_t ps = (size_t)G * (HD + 2);  // stride between splits
    float M = NEG_INF;
    for (int sp = 0; sp < splits; ++sp) M = fmaxf(M, ld_f<true>(p0 + sp * ps + HD));
    float lsum = 0.f, o = 0.f;
    for (int sp = 0; sp < splits; ++sp) {
      const float ms = ld_f<true>(p0 + sp * ps + HD);
      if (ms == NEG_INF) continue;
      const float e = expf(ms - M);
      lsum += e * ld_f<true>(p0 + sp * ps + HD + 1);
      o += e * ld_f<true>(p0 + sp * ps + d);
    }
    att[(size_t)(kvh * G + h) * HD + d] = o / lsum;
  }
  if (tid == 0) cnt[kvh] = 0u;  // every split has arrived: ready for the next layer
}

// Trace record of (layer, phase) for this block: [start ns, end ns (before the grid barrier),
// the most cycles a consumer warp waited for weights, the producer's cycles waiting for a free
// slot and issuing the copies while streaming this phase's weight, unused]; for attention,
// fields 2-4 are the ns when q / k / v were roped, warp 0's positions done, the warps merged.
// Phases: qkv, attention, o, gate_up, down.
__device__ __forceinline__ unsigned long long* mk_trace(unsigned long long* trace, int l, int ph) {
  return trace + ((size_t)(l * 5 + ph) * gridDim.x + blockIdx.x) * 6;
}

// The layers of one decode step of one sequence. h: (H,) float32, the embedding in, the last
// layer's residual stream out (in place). Scratch (float32): qkv ((nq + 2 nkv) HD), att (nq HD),
// gu (2 I), part (nkv * splits * G * (HD + 2)); sync: 1 + n_layers * nkv zeroed uint32 (barrier
// counter, then per layer and KV head the split counters; they are left zeroed). pos, ctx_lens,
// block_tables (row 0), slots: the sequence's position, context length L (new token included),
// pages and KV slot (negative: not written). Shared memory (dynamic): the ring (NS slots), 32 NS
// bytes of mbarriers, then the larger of the staged int8 row and the attention scratch. trace:
// null, or zeroed (n_layers, 5, G, 6) uint64 records (mk_trace).
template <int SCH, int HD, int G, int W, int UPW, int NS>
__global__ void __launch_bounds__((W + 1) * 32, 1)
decode_layers(const MkLayer* __restrict__ layers, int n_layers, int H, int I, int nkv,
              float eps, float scale, float* h, float* qkv, float* att, float* gu, float* part,
              unsigned* sync, const int* __restrict__ pos, const int* __restrict__ ctx_lens,
              const int* __restrict__ block_tables, const long long* __restrict__ slots,
              const float* __restrict__ inv_freq, int page_size,
              unsigned long long* __restrict__ trace) {
  pdl_trigger();
  using R = BulkRing<SCH, W, UPW>;
  extern __shared__ uint4 mk_smem[];
  unsigned char* ring;
  unsigned long long *full, *empty;
  unsigned* xs;
  bulk_smem_layout<SCH, W, UPW, NS>(mk_smem, ring, full, empty, xs);
  __shared__ float red[2][W][16];
  __shared__ float ssq[W][8];
  const int warp = threadIdx.x >> 5;
  const int nq = nkv * G;
  // (N, K) of qkv, o, gate_up, down
  auto gN = [&](int m) { return m == 0 ? (nq + 2 * nkv) * HD : m == 2 ? 2 * I : H; };
  auto gK = [&](int m) { return m == 1 ? nq * HD : m == 3 ? I : H; };
  bulk_ring_init<NS, W>(full, empty);
  int gs = 0;
  if (warp == W) {  // producer: every weight of every layer, in the consumers' order
    if ((threadIdx.x & 31) == 0) {
      const unsigned long long policy = evict_first_policy();
      for (int l = 0; l < n_layers; ++l)
#pragma unroll 1
        for (int m = 0; m < 4; ++m) {
          const int KC = (gK(m) + 63) >> 6, spt = (KC + R::CPS - 1) / R::CPS;
          const int2 rt = bulk_tiles((gN(m) + 15) >> 4, blockIdx.x, gridDim.x);
          bulk_produce<SCH, W, UPW, NS>(layers[l].codes[m], layers[l].scales[m], rt.x,
                                        (rt.y - rt.x) * spt, spt, KC, ring, full, empty, gs,
                                        policy, trace ? mk_trace(trace, l, m ? m + 1 : 0) + 3
                                                      : nullptr);
        }
    }
    return;
  }
  pdl_wait();  // h comes from the embedding kernel
  const int L = ctx_lens[0], p = pos[0];
  const long long slot = slots[0];
  unsigned* bar = sync;
  const bool tr = trace != nullptr && threadIdx.x == 0;
  auto mark = [&](int l, int ph, int field) {
    if (tr) mk_trace(trace, l, ph)[field] = globaltimer();
  };
  // Phase ph of layer l, then the grid barrier. GEMV phases: weight m (0 qkv, 1 o, 2 gate_up,
  // 3 down) with prologue PRO, accumulating into out with ACC (tags: MkTag<value>).
  auto gemv = [&](int l, int ph, auto pro, auto acc, int m, const float* x, int ldx,
                  const float* nw, float* out) {
    mark(l, ph, 0);
    const int2 rt = bulk_tiles((gN(m) + 15) >> 4, blockIdx.x, gridDim.x);
    bulk_consume<SCH, decltype(pro)::value, (bool)decltype(acc)::value, true, W, UPW, NS, true>(
        x, ldx, nw, eps, out, gN(m), gK(m), rt.x, rt.y, ring, full, empty, xs, &red[0][0][0],
        ssq, gs, trace ? mk_trace(trace, l, ph) + 2 : nullptr);
    mark(l, ph, 1);
    grid_sync<W>(bar);
  };
  for (int l = 0; l < n_layers; ++l) {
    const MkLayer& ly = layers[l];
#ifndef MK_NO_PREFETCH  // (experiment switch: gpu_megakernel_trace.py --variants)
    mk_prefetch_kv<HD, W * 32>(ly.kc, ly.vc, nkv, L, block_tables, page_size);
#endif
    gemv(l, 0, MkTag<PRO_NORM>(), MkTag<0>(), 0, h, H, ly.in_norm, qkv);
    mark(l, 1, 0);
    mk_attention<HD, G, W>(qkv, att, part, sync + 1 + l * nkv, ly.kc, ly.vc, nkv, L, p, slot,
                           block_tables, page_size, inv_freq, scale,
                           reinterpret_cast<float*>(xs), trace ? mk_trace(trace, l, 1) : nullptr);
    mark(l, 1, 1);
    grid_sync<W>(bar);
    gemv(l, 2, MkTag<PRO_PLAIN>(), MkTag<1>(), 1, att, nq * HD, nullptr, h);
    gemv(l, 3, MkTag<PRO_NORM>(), MkTag<0>(), 2, h, H, ly.post_norm, gu);
    gemv(l, 4, MkTag<PRO_SILU>(), MkTag<1>(), 3, gu, 2 * I, nullptr, h);
  }
}
