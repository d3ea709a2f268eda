// Row-wise and element-wise ops: RMSNorm, RoPE, SwiGLU core, embedding gather (float / q8 / q4
// rows), paged KV write. Semantics are those of the NumPy reference modules of the same names
// (ninfer/kernels/norm.py, rope.py, activation.py, embedding.py, attention.write_kv).
// (common.cuh is prepended by the Python loader.)

// RMSNorm: one block (256 threads) per row; float32 statistics.
// y = x / sqrt(sum(x^2)/H + eps) * (w or 1 + w).
extern "C" __global__ void __launch_bounds__(256)
rms_norm(const float* __restrict__ x, int ldx, const float* __restrict__ w,
         float* __restrict__ y, int H, float eps, int unit_offset) {
  __shared__ float red[8];
  const float* xr = x + (size_t)blockIdx.x * ldx;
  float ss = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.f;
    v = warp_sum(v);
    if (threadIdx.x == 0) red[0] = v;
  }
  __syncthreads();
  const float denom = sqrtf(red[0] * (1.0f / (float)H) + eps);
  float* yr = y + (size_t)blockIdx.x * H;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const float wi = unit_offset ? 1.0f + w[i] : w[i];
    yr[i] = (xr[i] / denom) * wi;
  }
}

// RoPE: block per (token, head); thread per rotated pair (and pass-through dims >= r).
// x: (T, n, hd) with token stride ldx and head stride hd; out: contiguous (T, n, hd).
// style 0 = rotate-half (dim i pairs with i + r/2), 1 = adjacent (2i with 2i + 1).
extern "C" __global__ void rope(const float* __restrict__ x, int ldx, const int* __restrict__ pos,
                                const float* __restrict__ inv_freq, float* __restrict__ out,
                                int n, int hd, int r, int style) {
  const int t = blockIdx.x / n, h = blockIdx.x - (blockIdx.x / n) * n;
  const float* xr = x + (size_t)t * ldx + (size_t)h * hd;
  float* o = out + ((size_t)t * n + h) * hd;
  const float p = (float)pos[t];
  const int half = r >> 1;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const float ang = p * inv_freq[i];
    const float c = cosf(ang), s = sinf(ang);
    const int i1 = style == 0 ? i : 2 * i;
    const int i2 = style == 0 ? i + half : 2 * i + 1;
    const float x1 = xr[i1], x2 = xr[i2];
    o[i1] = x1 * c - x2 * s;
    o[i2] = x2 * c + x1 * s;
  }
  for (int i = r + threadIdx.x; i < hd; i += blockDim.x) o[i] = xr[i];
}

// silu(gate) * up; gate/up rows with strides ldg/ldu; out contiguous (T, I).
extern "C" __global__ void silu_mul(const float* __restrict__ gate, int ldg,
                                    const float* __restrict__ up, int ldu,
                                    float* __restrict__ out, int T, int I) {
  const long long n = (long long)T * I;
  for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < n;
       idx += (long long)gridDim.x * blockDim.x) {
    const long long t = idx / I;
    const int i = (int)(idx - t * I);
    const float g = gate[t * ldg + i];
    out[idx] = g / (1.0f + expf(-g)) * up[t * ldu + i];
  }
}

// Embedding gather: block per token; float32, q8 or q4 rows dequantized as quant.dequantize.
extern "C" __global__ void embed_f32(const float* __restrict__ w, const int* __restrict__ ids,
                                     float* __restrict__ out, int H) {
  const float* row = w + (size_t)ids[blockIdx.x] * H;
  for (int i = threadIdx.x; i < H; i += blockDim.x) out[(size_t)blockIdx.x * H + i] = row[i];
}

extern "C" __global__ void embed_q8(const signed char* __restrict__ codes,
                                    const unsigned short* __restrict__ scales,
                                    const int* __restrict__ ids, float* __restrict__ out, int H,
                                    int group) {
  const size_t id = (size_t)ids[blockIdx.x];
  const int gpr = H / group;
  for (int i = threadIdx.x; i < H; i += blockDim.x)
    out[(size_t)blockIdx.x * H + i] = (float)codes[id * H + i] * h2f(scales[id * gpr + i / group]);
}

extern "C" __global__ void embed_q4(const unsigned char* __restrict__ codes,
                                    const unsigned short* __restrict__ scales,
                                    const unsigned short* __restrict__ mins,
                                    const int* __restrict__ ids, float* __restrict__ out, int H,
                                    int group) {
  const size_t id = (size_t)ids[blockIdx.x];
  const int gpr = H / group;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const unsigned int b = codes[id * (H / 2) + i / 2];
    const float q = (float)((i & 1) ? (b >> 4) : (b & 15u));
    const float s = h2f(scales[id * gpr + i / group]);
    out[(size_t)blockIdx.x * H + i] =
        mins != nullptr ? s * q + h2f(mins[id * gpr + i / group]) : s * (q - 8.f);
  }
}

// Paged KV write: k/v (T, nkv*hd) rows with token strides ldk/ldv; slot < 0 skipped.
extern "C" __global__ void write_kv(const float* __restrict__ k, int ldk,
                                    const float* __restrict__ v, int ldv,
                                    const long long* __restrict__ slots,
                                    float* __restrict__ kc, float* __restrict__ vc, int row) {
  const long long slot = slots[blockIdx.x];
  if (slot < 0) return;
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    kc[slot * row + i] = k[(size_t)blockIdx.x * ldk + i];
    vc[slot * row + i] = v[(size_t)blockIdx.x * ldv + i];
  }
}
