// Shared device helpers for ninfer's CUDA kernels (no CUDA headers needed: NVRTC-friendly).
#pragma once

// IEEE half bits -> float (exact) and float -> half bits (round to nearest even).
__device__ __forceinline__ float h2f(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ unsigned short f2h(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// Two floats -> fp16x2 bits (lo in the low half), round to nearest even.
__device__ __forceinline__ unsigned pack_h2(float lo, float hi) {
  unsigned d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// KV cache elements: the kernels that read or write the paged KV cache are templates over its
// element type T, float (--kv-dtype fp32) or kvh (fp16 bits, --kv-dtype fp16). A value is
// stored as float rounded to T (round to nearest even, as NumPy's astype(float16)) and read
// back as float; the arithmetic stays float32.
typedef unsigned short kvh;
__device__ __forceinline__ float kv_get(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float kv_get(const kvh* p, size_t i) { return h2f(p[i]); }
__device__ __forceinline__ void kv_put(float* p, size_t i, float x) { p[i] = x; }
__device__ __forceinline__ void kv_put(kvh* p, size_t i, float x) { p[i] = f2h(x); }
// x as the cache of element type T stores it (what kv_get returns after kv_put)
template <typename T>
__device__ __forceinline__ float kv_round(float x) {
  if constexpr (sizeof(T) == 2) return h2f(f2h(x));
  else return x;
}
// N consecutive elements at p (N a power of two <= 8, p aligned to N elements) as floats:
// kvh with one vector load
template <int N>
__device__ __forceinline__ void kv_load(const float* __restrict__ p, float (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) x[i] = p[i];
}
template <int N>
__device__ __forceinline__ void kv_load(const kvh* __restrict__ p, float (&x)[N]) {
  static_assert(N == 1 || N == 2 || N == 4 || N == 8, "kv_load: N of 1, 2, 4 or 8");
  if constexpr (N == 1) {
    x[0] = h2f(*p);
  } else {
    unsigned w[N / 2];
    if constexpr (N == 2) {
      w[0] = *reinterpret_cast<const unsigned*>(p);
    } else if constexpr (N == 4) {
      const uint2 u = *reinterpret_cast<const uint2*>(p);
      w[0] = u.x; w[1] = u.y;
    } else {
      const uint4 u = *reinterpret_cast<const uint4*>(p);
      w[0] = u.x; w[1] = u.y; w[2] = u.z; w[3] = u.w;
    }
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      x[2 * i] = h2f((unsigned short)(w[i] & 0xffffu));
      x[2 * i + 1] = h2f((unsigned short)(w[i] >> 16));
    }
  }
}
// Raw load of 4 consecutive elements (aligned to 4 elements) and their fp16x2 bits (lo, hi):
// float rounds to nearest even (pack_h2), kvh is taken as is.
template <typename T> struct kv_vec4;
template <> struct kv_vec4<float> { typedef float4 type; };
template <> struct kv_vec4<kvh> { typedef uint2 type; };
template <typename T>
__device__ __forceinline__ typename kv_vec4<T>::type kv_ld4(const T* p) {
  return *reinterpret_cast<const typename kv_vec4<T>::type*>(p);
}
__device__ __forceinline__ uint2 kv_h4(float4 v) {
  return make_uint2(pack_h2(v.x, v.y), pack_h2(v.z, v.w));
}
__device__ __forceinline__ uint2 kv_h4(uint2 v) { return v; }
template <typename T>
__device__ __forceinline__ typename kv_vec4<T>::type kv_zero4();
template <> __device__ __forceinline__ float4 kv_zero4<float>() {
  return make_float4(0.f, 0.f, 0.f, 0.f);
}
template <> __device__ __forceinline__ uint2 kv_zero4<kvh>() { return make_uint2(0u, 0u); }

// --kv-dtype int8: element type kvq8 (signed char). A (token, head) row of the cache is then
// kv_width<kvq8>(hd) = hd + hd / 32 bytes: the hd int8 codes, then one fp16 scale per 64-dim
// group (little-endian bits; the NumPy codec's rows, kernels/kv_codec.py), and element d reads
// as float(code) * float(scale of group d / 64), rounded once (the codec's decode). The paged
// kernels address a head row by its start (kv_width<T>(hd) elements a row) and read element d
// of it with kv_at / kv_load_row / kv_ld4r (for float and kvh: row[d]). Writes: q8_put_group
// (below), after the whole row is known (its groups' maxima).
typedef signed char kvq8;
template <typename T>
__host__ __device__ constexpr int kv_width(int hd) { return sizeof(T) == 1 ? hd + hd / 32 : hd; }
__device__ __forceinline__ unsigned short kv_q8_scale(const kvq8* row, int g, int hd) {
  return *reinterpret_cast<const unsigned short*>(row + hd + 2 * g);  // (hd even: aligned)
}
__device__ __forceinline__ float kv_q8(int code, float s) { return __fmul_rn((float)code, s); }
__device__ __forceinline__ float kv_at(const float* row, int d, int) { return row[d]; }
__device__ __forceinline__ float kv_at(const kvh* row, int d, int) { return h2f(row[d]); }
__device__ __forceinline__ float kv_at(const kvq8* row, int d, int hd) {
  return kv_q8(row[d], h2f(kv_q8_scale(row, d >> 6, hd)));
}
// N elements d0 .. d0 + N - 1 of a head row (d0 a multiple of N; kvq8: N <= 64 and a row start
// aligned to N bytes, one group)
template <int N, typename T>
__device__ __forceinline__ void kv_load_row(const T* __restrict__ row, int d0, int,
                                            float (&x)[N]) {
  kv_load<N>(row + d0, x);
}
template <int N>
__device__ __forceinline__ void kv_load_row(const kvq8* __restrict__ row, int d0, int hd,
                                            float (&x)[N]) {
  static_assert(N == 1 || N == 2 || N == 4 || N == 8, "kv_load_row: N of 1, 2, 4 or 8");
  const float s = h2f(kv_q8_scale(row, d0 >> 6, hd));
  const kvq8* p = row + d0;
  unsigned w[(N + 3) / 4];
  if constexpr (N == 1) w[0] = (unsigned char)p[0];
  else if constexpr (N == 2) w[0] = *reinterpret_cast<const unsigned short*>(p);
  else if constexpr (N == 4) w[0] = *reinterpret_cast<const unsigned*>(p);
  else {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    w[0] = u.x; w[1] = u.y;
  }
#pragma unroll
  for (int i = 0; i < N; ++i)
    x[i] = kv_q8((int)(signed char)((w[i >> 2] >> (8 * (i & 3))) & 0xffu), s);
}
// 4 consecutive elements d .. d + 3 of a head row (d a multiple of 4) as kv_ld4 loads them;
// kvq8: dequantized to a float4 (codes read as two 2-byte words: rows are 2-byte aligned)
template <> struct kv_vec4<kvq8> { typedef float4 type; };
template <typename T>
__device__ __forceinline__ typename kv_vec4<T>::type kv_ld4r(const T* row, int d, int) {
  return kv_ld4(row + d);
}
__device__ __forceinline__ float4 kv_ld4r(const kvq8* row, int d, int hd) {
  const float s = h2f(kv_q8_scale(row, d >> 6, hd));
  const unsigned a = *reinterpret_cast<const unsigned short*>(row + d);
  const unsigned b = *reinterpret_cast<const unsigned short*>(row + d + 2);
  return make_float4(kv_q8((signed char)(a & 0xffu), s), kv_q8((signed char)(a >> 8), s),
                     kv_q8((signed char)(b & 0xffu), s), kv_q8((signed char)(b >> 8), s));
}
template <> __device__ __forceinline__ float4 kv_zero4<kvq8>() {
  return make_float4(0.f, 0.f, 0.f, 0.f);
}

// d += a b on tensor cores: A (16 x 16 fp16, row) in a[4], B (16 x 8 fp16, col) in b0 b1, C / D
// (16 x 8) fp32. Fragment layouts: PTX ISA, "Matrix Fragments for mma.m16n8k16".
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Programmatic Dependent Launch (see gpu/launch.py): pdl_wait() blocks until the kernels this
// one depends on have completed and their memory is visible (a no-op unless launched with PDL);
// pdl_trigger() lets the next PDL-launched kernel start once every block of this one has
// triggered or exited. Before sm_90 both compile to nothing.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// The shared-memory (state space) address of a generic pointer into this block's shared memory.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// cp.async (sm_80+): global -> shared copies that bypass the registers, completed in groups
// (PTX ISA, "cp.async", "cp.async.commit_group", "cp.async.wait_group").
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Thread block clusters (sm_90+; PTX ISA, "barrier.cluster", "mapa", "ld.shared::cluster"):
// the block's rank in its cluster, a barrier of every thread of the cluster (release / acquire:
// shared-memory writes before it are visible to the cluster's blocks after it), and loads from
// another block's shared memory (distributed shared memory) at cluster_map's address. Every
// thread of every block of the cluster must reach each cluster_sync (.aligned: warp-uniform).
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return r;
}
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
               ::: "memory");
#endif
}
// the address of `p` (in this block's shared memory) in the shared memory of block `rank`
__device__ __forceinline__ unsigned cluster_map(const void* p, unsigned rank) {
  unsigned r = smem_addr(p);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(r), "r"(rank));
#endif
  return r;
}
__device__ __forceinline__ float ld_cluster(unsigned addr) {
  float v = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
#endif
  return v;
}

// Loads through L2 only (ld.global.cg, CG = true), for data that other blocks of the same kernel
// write: a plain or read-only load may hit a stale L1 line. Plain loads otherwise (CG = false).
template <bool CG>
__device__ __forceinline__ float2 ld_f2(const float* p) {
  if constexpr (CG) {
    float2 v;
    asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p) : "memory");
    return v;
  } else {
    return *reinterpret_cast<const float2*>(p);
  }
}
template <bool CG>
__device__ __forceinline__ float ld_f(const float* p) {
  if constexpr (CG) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
  } else {
    return *p;
  }
}

// The rotation of one RoPE pair, every product and sum rounded on its own (no FMA contraction,
// which the compiler may choose differently where it is inlined): the same float in every
// kernel that rotates (rope_pair, attn_decode's table form), and as NumPy's float32.
__device__ __forceinline__ void rope_rotate(float x1, float x2, float c, float s, float& o1,
                                            float& o2) {
  o1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
  o2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

// RoPE of pair i (< r / 2) of one head: xh -> o (hd floats each), position p, inv_freq (r/2,);
// style 0 = rotate-half (dim i pairs with i + r/2), 1 = adjacent (2i with 2i + 1).
// o: float (q rows) or a KV cache row of element type T (kv_put).
template <typename T>
__device__ __forceinline__ void rope_pair(const float* __restrict__ xh, T* __restrict__ o,
                                          float p, const float* __restrict__ inv_freq, int i,
                                          int half, int style) {
  const float ang = p * inv_freq[i];
  const float c = cosf(ang), s = sinf(ang);
  const int i1 = style == 0 ? i : 2 * i;
  const int i2 = style == 0 ? i + half : 2 * i + 1;
  float o1, o2;
  rope_rotate(xh[i1], xh[i2], c, s, o1, o2);
  kv_put(o, i1, o1);
  kv_put(o, i2, o2);
}

// Rotate one head: xh -> o, every pair (rope_pair) and dims >= r copied; the block's threads
// share the pairs.
template <typename T>
__device__ __forceinline__ void rope_head(const float* __restrict__ xh, T* __restrict__ o,
                                          float p, const float* __restrict__ inv_freq, int hd,
                                          int r, int style) {
  const int half = r >> 1;
  for (int i = threadIdx.x; i < half; i += blockDim.x)
    rope_pair(xh, o, p, inv_freq, i, half, style);
  for (int i = r + threadIdx.x; i < hd; i += blockDim.x) kv_put(o, i, xh[i]);
}

#define SCH_Q4 0   // q4, x = s * (q - 8)       (GGUF Q4_0)
#define SCH_Q4M 1  // q4 with mins, x = s q + m (GGUF Q4_1)
#define SCH_Q8 2   // q8, x = s * q             (GGUF Q8_0)

__device__ __forceinline__ int q8_rint(float v) {
  int q;
  asm("cvt.rni.s32.f32 %0, %1;" : "=r"(q) : "f"(v));
  return q;
}

// One warp: the int8 codes and fp16 scale of group g (the 64 floats at x) of the int8 KV head
// row `row` (kvq8, head dim hd), as kernels/kv_codec.py encodes: s = fp16(max|x| / 127)
// (float32 division, then round to nearest even), codes clamp(rint(x * (1 / s)), +-127) with
// rint to nearest even (0 where s is 0). Lane L takes dims L and L + 32; y0 / y1: their values
// as the cache now stores them (kv_at). (Unlike the codec, nothing is refused: a group beyond
// fp16's scale range gets scale inf and codes 0.)
__device__ __forceinline__ void q8_put_group(const float* x, kvq8* __restrict__ row, int g,
                                             int hd, float& y0, float& y1) {
  const int lane = threadIdx.x & 31;
  const float a = x[g * 64 + lane], b = x[g * 64 + lane + 32];
  const float amax = warp_max(fmaxf(fabsf(a), fabsf(b)));
  const unsigned short sh = f2h(__fdiv_rn(amax, 127.f));
  const float s = h2f(sh);
  const float inv = s > 0.f ? __fdiv_rn(1.f, s) : 0.f;
  const int qa = min(127, max(-127, q8_rint(__fmul_rn(a, inv))));
  const int qb = min(127, max(-127, q8_rint(__fmul_rn(b, inv))));
  row[g * 64 + lane] = (kvq8)qa;
  row[g * 64 + lane + 32] = (kvq8)qb;
  if (lane == 0) *reinterpret_cast<unsigned short*>(row + hd + 2 * g) = sh;
  y0 = kv_q8(qa, s);
  y1 = kv_q8(qb, s);
}
// Every group of n consecutive int8 head rows from the floats at x (hd dims each, contiguous),
// the block's warps taking groups in turn; rows[i] = row0 + i kv_width(hd).
__device__ __forceinline__ void q8_put_rows(const float* x, kvq8* __restrict__ row0, int n,
                                            int hd) {
  const int gpr = hd >> 6;
  for (int gi = threadIdx.x >> 5; gi < n * gpr; gi += blockDim.x >> 5) {
    const int h = gi / gpr;
    float y0, y1;
    q8_put_group(x + (size_t)h * hd, row0 + (size_t)h * kv_width<kvq8>(hd), gi - h * gpr, hd,
                 y0, y1);
  }
}

// ---------------------------------------------------------------------------------------------
// Pre-quantized activations ("q8 shadow"): the kernel that produces a vector of K columns (K a
// multiple of 64, KC = K / 64) may also write it in the form that gemv_bulk's Q8A staging
// builds (linear.cu), so that the next GEMV's blocks copy K + K / 4 bytes instead of reading,
// normalizing and quantizing K floats each (staging is a large fixed cost of a batch-1 decode
// GEMV). Layout, one contiguous buffer: KC * 16 words of int8
// codes in the staged order (linear.cu, stage_q8_words), KC * 4 floats of meta as staged ((d,
// dbias) of the chunk's two segments; dbias for the consumer's weight scheme), then KC * 2
// floats: each segment's sum of x^2 (for a consumer with RMSNorm, whose rstd the consumer forms
// from them). The codes, d and dbias are the very values stage_q8_words computes from the same
// floats (the same operations); only the RMSNorm's sum of squares is added in another order.
struct QShadow {
  const unsigned* in;        // the consumer's shadow (QIN), or null
  unsigned char* out;        // the shadow this kernel writes (QOUT), or null
  const float* nw;           // QOUT: the consumer's RMSNorm weight (codes of x * nw), or null
  int sch;                   // QOUT: the consumer's weight scheme (dbias)
};

// One warp, lane L holding column col0 + L (col0 a multiple of 32) of a K-column vector: v (the
// value to quantize: x, or x * nw) and x2 (x^2 for the segment's sum of squares, or 0): write
// its codes, (d, dbias) and sum of squares to the shadow q (see above).
__device__ __forceinline__ void q8_shadow_store(float v, float x2, int col0, int K, int sch,
                                                unsigned char* __restrict__ q) {
  const int lane = threadIdx.x & 31;
  const float amax = warp_max(fabsf(v));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  const int qi = q8_rint(v * inv);
  const int sq = __reduce_add_sync(0xffffffffu, qi);
  const float ss = warp_sum(x2);
  const int seg = col0 >> 5, chunk = col0 >> 6, sg = seg & 1;
  // lane = 16 h + 2 t + e + 8 f holds column c + (0, 8, 1, 9)[f + 2 e], c = 32 sg + 16 h + 2 t
  const int h = lane >> 4, r = lane & 15, tt = (r & 7) >> 1, e = r & 1, f = r >> 3;
  q[(size_t)chunk * 64 + (4 * tt + 2 * sg + h) * 4 + f + 2 * e] = (unsigned char)(qi & 255);
  if (lane == 0) {
    float* meta = reinterpret_cast<float*>(q + (size_t)(K >> 6) * 64);
    const float d = amax / 127.f;
    meta[chunk * 4 + 2 * sg] = d;
    meta[chunk * 4 + 2 * sg + 1] = sch == SCH_Q4 ? d * (-8.f * (float)sq)
                                   : sch == SCH_Q4M ? d * (float)sq : 0.f;
    meta[(K >> 6) * 4 + seg] = ss;
  }
}
