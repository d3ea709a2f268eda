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

// Two floats -> two e4m3 codes (lo in the low byte), round to nearest even, saturated to
// +-448 (the fp8 prefill GEMM's operands; sm_89 and newer).
__device__ __forceinline__ unsigned short e4m3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
#else
  __trap();
  return 0;
#endif
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
__device__ __forceinline__ typename kv_vec4<T>::type kv_zero4() {
  return typename kv_vec4<T>::type{};
}

// --kv-dtype int8: element type kvq8 (signed char). A (token, head) row of the cache is then
// kv_width<kvq8>(hd) = hd + hd / 32 bytes: the hd int8 codes, then one fp16 scale per 64-dim
// group (little-endian bits; the NumPy codec's rows, kernels/kv_codec.py), and element d reads
// as float(code) * float(scale of group d / 64), rounded once (the codec's decode). The paged
// kernels address a head row by its start (kv_width<T>(hd) elements a row) and read element d
// of it with kv_at / kv_load_row / kv_ld4r (for float and kvh: row[d]). Writes: q8_put_group
// (below), after the whole row is known (its groups' maxima).
typedef signed char kvq8;
// --kv-dtype rk8v4 / rk4v4 / rk4v4-e8 / rk2v4-e8: element type kvrk<KK> (a byte; KK: the K
// codec, RK_INT8, RK_INT4, RK_E8 or RK_E8ROOT; V is RK_INT4), rows of rotated codes (below).
template <int KK> struct kvrk { unsigned char b; };
#define RK_INT8 0
#define RK_INT4 1
#define RK_E8 2
#define RK_E8ROOT 3
template <typename T> struct kv_rk_kind { static constexpr int k = -1; };
template <int KK> struct kv_rk_kind<kvrk<KK>> { static constexpr int k = KK; };
template <typename T> constexpr bool kv_is_rk = kv_rk_kind<T>::k >= 0;
// the codec of K (ISV false) or V (true) rows of a rk element type
template <typename T, bool ISV> constexpr int rk_kind = ISV ? RK_INT4 : kv_rk_kind<T>::k;
// code bits per dim of a rk codec
__host__ __device__ constexpr int rk_bits(int c) { return c == RK_INT8 ? 8 : c == RK_E8ROOT ? 2 : 4; }
// elements of a K (ISV false) or V row of head dim hd (kvq8 and kvrk: bytes)
template <typename T, bool ISV = false>
__host__ __device__ constexpr int kv_width(int hd) {
  if constexpr (kv_is_rk<T>) return hd * rk_bits(rk_kind<T, ISV>) / 8 + hd / 32;
  else return sizeof(T) == 1 ? hd + hd / 32 : hd;
}
__device__ __forceinline__ unsigned short kv_q8_scale(const kvq8* row, int g, int hd) {
  return *reinterpret_cast<const unsigned short*>(row + hd + 2 * g);  // (hd even: aligned)
}
__device__ __forceinline__ float kv_q8(int code, float s) { return __fmul_rn((float)code, s); }
// (ISV: the row is a V row; only the rk types' K and V rows differ)
template <bool ISV = false>
__device__ __forceinline__ float kv_at(const float* row, int d, int) { return row[d]; }
template <bool ISV = false>
__device__ __forceinline__ float kv_at(const kvh* row, int d, int) { return h2f(row[d]); }
template <bool ISV = false>
__device__ __forceinline__ float kv_at(const kvq8* row, int d, int hd) {
  return kv_q8(row[d], h2f(kv_q8_scale(row, d >> 6, hd)));
}
// N elements d0 .. d0 + N - 1 of a head row (d0 a multiple of N; kvq8: N <= 64 and a row start
// aligned to N bytes, one group)
template <int N, bool ISV = false, typename T>
__device__ __forceinline__ void kv_load_row(const T* __restrict__ row, int d0, int,
                                            float (&x)[N]) {
  kv_load<N>(row + d0, x);
}
template <int N, bool ISV = false>
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
template <bool ISV = false, typename T>
__device__ __forceinline__ typename kv_vec4<T>::type kv_ld4r(const T* row, int d, int) {
  return kv_ld4(row + d);
}
template <bool ISV = false>
__device__ __forceinline__ float4 kv_ld4r(const kvq8* row, int d, int hd) {
  const float s = h2f(kv_q8_scale(row, d >> 6, hd));
  const unsigned a = *reinterpret_cast<const unsigned short*>(row + d);
  const unsigned b = *reinterpret_cast<const unsigned short*>(row + d + 2);
  return make_float4(kv_q8((signed char)(a & 0xffu), s), kv_q8((signed char)(a >> 8), s),
                     kv_q8((signed char)(b & 0xffu), s), kv_q8((signed char)(b >> 8), s));
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
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}
// N bytes (16, 8 or 4; dst and src aligned to N)
template <int N>
__device__ __forceinline__ void cp_async_n(void* dst, const void* src) {
  static_assert(N == 16 || N == 8 || N == 4, "cp_async_n: 16, 8 or 4 bytes");
  if constexpr (N == 16) cp_async16(dst, src);
  else if constexpr (N == 8) cp_async8(dst, src);
  else cp_async4(dst, src);
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// 16 bytes global -> shared by cp.async, or 16 zero bytes where !valid (src-size 0: src unread)
__device__ __forceinline__ void cp_async16_or_zero(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
               "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}

// mbarriers, sm_90+ (PTX ISA, "mbarrier"): phases completed by a count of arrivals (and, with
// expect_tx, of async copies' bytes). Below sm_90 they compile to nothing (never launched).
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// One arrival that also expects `bytes` more bytes of async copies on the barrier.
__device__ __forceinline__ void mbar_arrive_expect(unsigned long long* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
  mbar_arrive(smem_addr(bar));
}
// Wait until the barrier's phase of this parity has completed (bar: its shared-space address,
// smem_addr, or the pointer).
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n .reg .pred p;\n WAIT:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#endif
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  mbar_wait(smem_addr(bar), parity);
}

// An arrival on bar once every earlier cp.async of this thread has completed (its count must
// include it: .noinc)
__device__ __forceinline__ void cp_async_mbar_arrive(unsigned long long* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar))
               : "memory");
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
__device__ __forceinline__ float4 ld_f4(const float* p) {
  if constexpr (CG) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p) : "memory");
    return v;
  } else {
    return *reinterpret_cast<const float4*>(p);
  }
}
// 4 floats at p: one 16-byte load where p is 16-byte aligned (v4), else two of 8 bytes.
template <bool CG>
__device__ __forceinline__ float4 ld_f4_any(const float* p, bool v4) {
  if (v4) return ld_f4<CG>(p);
  const float2 lo = ld_f2<CG>(p), hi = ld_f2<CG>(p + 2);
  return make_float4(lo.x, lo.y, hi.x, hi.y);
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
// rk KV rows (element type kvrk<KK>): each 64-dim group of a head is rotated, y = H64 x
// (H64 = H / 8, the Sylvester-Hadamard matrix, symmetric and its own inverse), then coded as
// kernels/kv_codec.py does (its float32 operation order throughout, so codes and scales are
// NumPy's bit for bit): RK_INT8 / RK_INT4 codes clamp(rint(y / s), +-127 / +-7), s =
// fp16(max|y| / 127 or 7), int4 two a byte with the even dim in the low nibble; RK_E8 the
// nearest E8 point of y / s (per 8 dims) as int4 codes -8..7; RK_E8ROOT per 8 dims a root code
// byte and a (radius << 4 | axis) byte (ninfer/kernels/e8.py). A row: the codes, then the
// groups' fp16 scales. Reads give code x scale in the rotated domain: the attention rotates q
// and its output instead (H64 orthonormal: q.k = (H64 q).(H64 k)).

// the (exact) float32 constants of kernels/e8.py
#define RK_SQRT8 0x1.6a09e6p+1f
#define RK_INV_SQRT2 0x1.6a09e6p-1f
#define RK_RADIUS_FLOOR 0x1.47ae14p-4f
#define RK_TINY 0x1.5798eep-27f  // float32(1e-8)
__constant__ float rk_radius_scale[16] = {
    0.0f, 0x1.9652bep-4f, 0x1.0p-3f, 0x1.428f5cp-3f, 0x1.9652bep-3f, 0x1.0p-2f,
    0x1.428f5cp-2f, 0x1.966cf4p-2f, 0x1.0p-1f, 0x1.428f5cp-1f, 0x1.965fd8p-1f, 0x1.0p+0f,
    0x1.4288cep+0f, 0x1.965fd8p+0f, 0x1.0p+1f, 0x1.4288cep+1f};
__constant__ float rk_radius_bounds[14] = {
    0x1.c823e0p-3f, 0x1.1f59acp-2f, 0x1.6a09e6p-2f, 0x1.c823e0p-2f, 0x1.1f59acp-1f,
    0x1.6a09e6p-1f, 0x1.c823e0p-1f, 0x1.1f59acp+0f, 0x1.6a09e6p+0f, 0x1.c823e0p+0f,
    0x1.1f59acp+1f, 0x1.6a09e6p+1f, 0x1.c823e0p+1f, 0x1.1f59acp+2f};

// Dim d (0..7) of E8 root `code` (< 240) times 4 (e8.ROOTS4): codes 0..111 are +-e_i +-e_j,
// pairs (i < j) in lexicographic order, bit 1 the sign of i, bit 0 that of j; codes 112..239
// are 1/2 (+-1)^8, bit d of code - 112 the sign of dim d < 7, dim 7's making the minus count
// even.
__device__ __forceinline__ int rk_root4(int code, int d) {
  if (code < 112) {
    int i = 0, rem = code >> 2;
    while (rem >= 7 - i) { rem -= 7 - i; ++i; }
    const int j = i + 1 + rem;
    return d == i ? (code & 2 ? 4 : -4) : d == j ? (code & 1 ? 4 : -4) : 0;
  }
  const int bits = code - 112;
  if (d < 7) return (bits >> d) & 1 ? 2 : -2;
  return (__popc(bits) & 1) ? 2 : -2;  // (7 - popc minus signs among dims 0..6)
}
// The code of dim d (0..7) of an E8-root block (e8.root_decode): rint((4 root_d +- [d = axis])
// R_radius), 0 for radius 0 or a root code >= 240.
__device__ __forceinline__ int rk_root_code(int root, int ra, int d) {
  const int radius = ra >> 4;
  if (radius == 0 || root >= 240) return 0;
  int v = rk_root4(root, d);
  if (d == ((ra >> 1) & 7)) v += (ra & 1) ? -1 : 1;
  return q8_rint(__fmul_rn((float)v, rk_radius_scale[radius]));
}
// The code of dim d of a rk row of codec C (head dim hd)
template <int C>
__device__ __forceinline__ int rk_code(const unsigned char* row, int d) {
  if constexpr (C == RK_INT8) {
    return (signed char)row[d];
  } else if constexpr (C == RK_E8ROOT) {
    return rk_root_code(row[2 * (d >> 3)], row[2 * (d >> 3) + 1], d & 7);
  } else {
    const unsigned b = row[d >> 1];
    return (int)(((d & 1 ? b >> 4 : b) & 15u) ^ 8u) - 8;
  }
}
template <int C>
__device__ __forceinline__ float rk_scale(const unsigned char* row, int g, int hd) {
  return h2f(*reinterpret_cast<const unsigned short*>(row + hd * rk_bits(C) / 8 + 2 * g));
}
// N (<= 64) dims d0 .. d0 + N - 1 of one 64-dim group, code x scale rounded once (the codec's
// decode before its inverse rotation)
template <int C, int N>
__device__ __forceinline__ void rk_load(const unsigned char* row, int d0, int hd,
                                        float (&x)[N]) {
  const float s = rk_scale<C>(row, d0 >> 6, hd);
#pragma unroll
  for (int i = 0; i < N; ++i) x[i] = kv_q8(rk_code<C>(row, d0 + i), s);
}
template <bool ISV = false, int KK>
__device__ __forceinline__ float kv_at(const kvrk<KK>* row, int d, int hd) {
  float x[1];
  rk_load<rk_kind<kvrk<KK>, ISV>, 1>(reinterpret_cast<const unsigned char*>(row), d, hd, x);
  return x[0];
}
template <int N, bool ISV = false, int KK>
__device__ __forceinline__ void kv_load_row(const kvrk<KK>* __restrict__ row, int d0, int hd,
                                            float (&x)[N]) {
  rk_load<rk_kind<kvrk<KK>, ISV>, N>(reinterpret_cast<const unsigned char*>(row), d0, hd, x);
}
template <int KK> struct kv_vec4<kvrk<KK>> { typedef float4 type; };
template <bool ISV = false, int KK>
__device__ __forceinline__ float4 kv_ld4r(const kvrk<KK>* row, int d, int hd) {
  float x[4];
  rk_load<rk_kind<kvrk<KK>, ISV>, 4>(reinterpret_cast<const unsigned char*>(row), d, hd, x);
  return make_float4(x[0], x[1], x[2], x[3]);
}

// One warp: y = H64 x of the group whose dims L and L + 32 lane L holds in a and b, in place,
// with kv_codec.rotate's operations and order (stages h = 1 .. 32, (x_i + x_{i+h}, x_i -
// x_{i+h}) for i & h == 0, then times 0.125): the same float32 bits.
__device__ __forceinline__ void rk_hadamard(float& a, float& b) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int h = 1; h < 32; h <<= 1) {
    const float pa = __shfl_xor_sync(0xffffffffu, a, h);
    const float pb = __shfl_xor_sync(0xffffffffu, b, h);
    const bool hi = lane & h;
    a = hi ? __fsub_rn(pa, a) : __fadd_rn(a, pa);
    b = hi ? __fsub_rn(pb, b) : __fadd_rn(b, pb);
  }
  const float s = __fadd_rn(a, b), d = __fsub_rn(a, b);
  a = __fmul_rn(s, 0.125f);
  b = __fmul_rn(d, 0.125f);
}

// e8.octet_sum's order: ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
__device__ __forceinline__ float rk_octet_sum(const float (&x)[8]) {
  return __fadd_rn(__fadd_rn(__fadd_rn(x[0], x[1]), __fadd_rn(x[2], x[3])),
                   __fadd_rn(__fadd_rn(x[4], x[5]), __fadd_rn(x[6], x[7])));
}
// e8.d8_nearest: round; an odd sum moves the coordinate rounded worst (lowest index on ties)
// one step toward x (+1 where x equals it)
__device__ __forceinline__ void rk_d8_nearest(const float (&x)[8], float (&f)[8]) {
  int worst = 0, sum = 0;
  float wv = -1.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    f[i] = rintf(x[i]);
    const float e = fabsf(__fsub_rn(x[i], f[i]));
    if (e > wv) { wv = e; worst = i; }
    sum += (int)f[i];
  }
  if (sum & 1) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (i == worst) f[i] = __fadd_rn(f[i], x[i] >= f[i] ? 1.f : -1.f);
  }
}
// e8.e8_nearest of z (8 dims): D8 or D8 + 1/2, whichever is nearer (D8 on equal distance)
__device__ __forceinline__ void rk_e8_nearest(const float (&z)[8], float (&p)[8]) {
  float zh[8], c[8], e0[8], e1[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) zh[i] = __fsub_rn(z[i], 0.5f);
  rk_d8_nearest(z, p);
  rk_d8_nearest(zh, c);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    c[i] = __fadd_rn(c[i], 0.5f);
    const float d0 = __fsub_rn(z[i], p[i]), d1 = __fsub_rn(z[i], c[i]);
    e0[i] = __fmul_rn(d0, d0);
    e1[i] = __fmul_rn(d1, d1);
  }
  if (!(rk_octet_sum(e0) <= rk_octet_sum(e1)))
#pragma unroll
    for (int i = 0; i < 8; ++i) p[i] = c[i];
}
// e8.root_encode of one block y (8 rotated dims, unscaled) with its group scale s: root code and
// (radius << 4) | axis, (0, 0) for an empty block (radius 0)
__device__ __forceinline__ void rk_root_encode(const float (&y)[8], float s, int& root,
                                               int& ra) {
  float t[8], u[8], a[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) t[i] = __fmul_rn(y[i], y[i]);
  const float norm = __fsqrt_rn(rk_octet_sum(t));
  const float rel = __fdiv_rn(norm, __fadd_rn(__fmul_rn(s, RK_SQRT8), RK_TINY));
  int radius = 0;
  if (rel >= RK_RADIUS_FLOOR) {
    radius = 1;
#pragma unroll
    for (int k = 0; k < 14; ++k) radius += rel >= rk_radius_bounds[k];
  }
  const float inv = __fdiv_rn(1.f, __fadd_rn(norm, RK_TINY));
  // the largest |u| (top0), the second largest (top1) and the smallest, lowest index on ties
  int neg = 0, top0 = 0, top1 = 0, small = 0;
  float v0 = -1.f, v1 = -1.f, vs = 0.f;
#pragma unroll
  for (int d = 0; d < 8; ++d) {
    u[d] = __fmul_rn(y[d], inv);
    a[d] = fabsf(u[d]);
    neg += !(u[d] >= 0.f);  // (-0 counts as positive)
    if (a[d] > v0) { v0 = a[d]; top0 = d; }
    if (d == 0 || a[d] < vs) { vs = a[d]; small = d; }
  }
#pragma unroll
  for (int d = 0; d < 8; ++d)
    if (d != top0 && a[d] > v1) { v1 = a[d]; top1 = d; }
  // type A: +-e_i +-e_j on the two largest |u|
  const int i = min(top0, top1), j = max(top0, top1);
  bool pi = false, pj = false;
#pragma unroll
  for (int d = 0; d < 8; ++d) {  // (register picks: no local memory)
    if (d == i) pi = u[d] >= 0.f;
    if (d == j) pj = u[d] >= 0.f;
  }
  const float pair_score = __fadd_rn(v0, v1);
  const int pair_code = 4 * (i * (15 - i) / 2 + j - i - 1) + 2 * pi + pj;
  // type B: the signs of u, an odd minus count flipping the smallest |u|
  const bool odd = neg & 1;
  const float half_score = __fsub_rn(__fmul_rn(0.5f, rk_octet_sum(a)), odd ? vs : 0.f);
  int half_code = 112;
#pragma unroll
  for (int d = 0; d < 7; ++d)
    half_code += (int)((u[d] >= 0.f) ^ (odd && d == small)) << d;
  root = pair_score >= half_score ? pair_code : half_code;
  // the residual's largest |.| (lowest index on ties) and its sign
  float dir[8], r[8];
#pragma unroll
  for (int d = 0; d < 8; ++d) {
    dir[d] = __fmul_rn(__fmul_rn((float)rk_root4(root, d), 0.25f), RK_INV_SQRT2);
    t[d] = __fmul_rn(u[d], dir[d]);
  }
  const float dot = rk_octet_sum(t);
  int ax = 0;
  float axv = -1.f, axs = 0.f;
#pragma unroll
  for (int d = 0; d < 8; ++d) {
    r[d] = __fsub_rn(u[d], __fmul_rn(dot, dir[d]));
    if (fabsf(r[d]) > axv) { axv = fabsf(r[d]); ax = d; axs = r[d]; }
  }
  ra = radius ? (radius << 4) | (2 * ax + (axs < 0.f)) : 0;
  if (!radius) root = 0;
}

// One warp: the codes and fp16 scale of group g (the 64 floats at x, unrotated) of a rk row of
// codec C (`row`, head dim hd), as kv_codec encodes (see above; codes 0 where s is 0). Lane L
// takes dims L and L + 32; y0 / y1: their rotated values as the row now stores them (code x
// scale, rk_load's). (Unlike the codec, nothing is refused: a group beyond fp16's scale range
// gets scale inf.)
template <int C>
__device__ __forceinline__ void rk_put_group(const float* x, unsigned char* __restrict__ row,
                                             int g, int hd, float& y0, float& y1) {
  constexpr float QMAX = C == RK_INT8 ? 127.f : 7.f;
  const int lane = threadIdx.x & 31;
  float a = x[g * 64 + lane], b = x[g * 64 + lane + 32];
  rk_hadamard(a, b);
  const float amax = warp_max(fmaxf(fabsf(a), fabsf(b)));
  const unsigned short sh = f2h(__fdiv_rn(amax, QMAX));
  const float s = h2f(sh);
  const float inv = s > 0.f ? __fdiv_rn(1.f, s) : 0.f;
  const float za = __fmul_rn(a, inv), zb = __fmul_rn(b, inv);
  const int cb = hd * rk_bits(C) / 8;
  if (lane == 0) *reinterpret_cast<unsigned short*>(row + cb + 2 * g) = sh;
  if constexpr (C == RK_INT8) {
    const int qa = min(127, max(-127, q8_rint(za))), qb = min(127, max(-127, q8_rint(zb)));
    row[g * 64 + lane] = (unsigned char)qa;
    row[g * 64 + lane + 32] = (unsigned char)qb;
    y0 = kv_q8(qa, s);
    y1 = kv_q8(qb, s);
  } else if constexpr (C == RK_E8ROOT) {
    // lanes 8k .. 8k + 7 hold block k (dims 8k ..) in a and block 4 + k in b; every lane of
    // the octet encodes its blocks, the first writes the two bytes of each
    const int base = lane & ~7;
    float ya[8], yb[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      ya[i] = __shfl_sync(0xffffffffu, a, base + i);
      yb[i] = __shfl_sync(0xffffffffu, b, base + i);
    }
    int ra_, rra, rb_, rrb;
    rk_root_encode(ya, s, ra_, rra);
    rk_root_encode(yb, s, rb_, rrb);
    if (!(s > 0.f)) ra_ = rra = rb_ = rrb = 0;
    unsigned char* c = row + g * 16;
    if ((lane & 7) == 0) {
      c[2 * (lane >> 3)] = (unsigned char)ra_;
      c[2 * (lane >> 3) + 1] = (unsigned char)rra;
      c[8 + 2 * (lane >> 3)] = (unsigned char)rb_;
      c[8 + 2 * (lane >> 3) + 1] = (unsigned char)rrb;
    }
    y0 = kv_q8(rk_root_code(ra_, rra, lane & 7), s);
    y1 = kv_q8(rk_root_code(rb_, rrb, lane & 7), s);
  } else {
    int qa, qb;
    if constexpr (C == RK_E8) {  // the nearest E8 point of each 8 dims, as int4 codes -8..7
      const int base = lane & ~7;
      float za8[8], zb8[8], pa[8], pb[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        za8[i] = __shfl_sync(0xffffffffu, za, base + i);
        zb8[i] = __shfl_sync(0xffffffffu, zb, base + i);
      }
      rk_e8_nearest(za8, pa);
      rk_e8_nearest(zb8, pb);
      float pma = 0.f, pmb = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (i == (lane & 7)) { pma = pa[i]; pmb = pb[i]; }
      qa = min(7, max(-8, q8_rint(pma)));
      qb = min(7, max(-8, q8_rint(pmb)));
    } else {
      qa = min(7, max(-7, q8_rint(za)));
      qb = min(7, max(-7, q8_rint(zb)));
    }
    // two codes a byte, the even dim in the low nibble: even lanes write (dims L, L + 1)
    const int qa1 = __shfl_xor_sync(0xffffffffu, qa, 1);
    const int qb1 = __shfl_xor_sync(0xffffffffu, qb, 1);
    if (!(lane & 1)) {
      row[g * 32 + (lane >> 1)] = (unsigned char)((qa & 15) | (qa1 & 15) << 4);
      row[g * 32 + 16 + (lane >> 1)] = (unsigned char)((qb & 15) | (qb1 & 15) << 4);
    }
    y0 = kv_q8(qa, s);
    y1 = kv_q8(qb, s);
  }
}
// Every group of n consecutive rk head rows of codec C from the floats at x (hd dims each,
// contiguous), the block's warps taking groups in turn; rows[i] = row0 + i (row width).
template <int C>
__device__ __forceinline__ void rk_put_rows(const float* x, unsigned char* __restrict__ row0,
                                            int n, int hd) {
  const int gpr = hd >> 6, w = hd * rk_bits(C) / 8 + hd / 32;
  for (int gi = threadIdx.x >> 5; gi < n * gpr; gi += blockDim.x >> 5) {
    const int h = gi / gpr;
    float y0, y1;
    rk_put_group<C>(x + (size_t)h * hd, row0 + (size_t)h * w, gi - h * gpr, hd, y0, y1);
  }
}
// The K (ISV false) or V rows of kv_put_rows / kv_put_group for a KV element type T: rk_*
// for the rk types, q8_* for kvq8.
template <typename T, bool ISV>
__device__ __forceinline__ void kv_put_rows(const float* x, T* __restrict__ row0, int n,
                                            int hd) {
  if constexpr (kv_is_rk<T>)
    rk_put_rows<rk_kind<T, ISV>>(x, reinterpret_cast<unsigned char*>(row0), n, hd);
  else
    q8_put_rows(x, reinterpret_cast<kvq8*>(row0), n, hd);
}
template <typename T, bool ISV>
__device__ __forceinline__ void kv_put_group(const float* x, T* __restrict__ row, int g, int hd,
                                             float& y0, float& y1) {
  if constexpr (kv_is_rk<T>)
    rk_put_group<rk_kind<T, ISV>>(x, reinterpret_cast<unsigned char*>(row), g, hd, y0, y1);
  else
    q8_put_group(x, reinterpret_cast<kvq8*>(row), g, hd, y0, y1);
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
