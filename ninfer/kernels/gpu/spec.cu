// A speculative round's glue on the device (semantics: ninfer/kernels/spec.py). Lane b's verify
// rows are b (k + 1) .. b (k + 1) + k; acc[b] = tokens it keeps (1 + accepted drafts); a lane
// or slot < 0 is padding and stores nothing. (common.cuh is prepended by the Python loader.)

// acc[b] = 1 + the leading drafts ids[b (k + 1) + i] (i >= 1) equal to targets[b (k + 1) + i - 1]
extern "C" __global__ void spec_accept(const int* __restrict__ ids, const int* __restrict__ tg,
                                       int* __restrict__ acc, int B, int k) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= B) return;
  const int* d = ids + (size_t)b * (k + 1);
  const int* t = tg + (size_t)b * (k + 1);
  int a = 0;
  while (a < k && d[a + 1] == t[a]) ++a;
  acc[b] = a + 1;
}

// out[b, :] = x[b (k + 1) + acc[b] - 1, :] (x rows ld elements apart), one block a lane
extern "C" __global__ void spec_rows(const float* __restrict__ x, int ld,
                                     const int* __restrict__ acc, float* __restrict__ out, int H,
                                     int k) {
  const int b = blockIdx.x;
  const float* r = x + (size_t)(b * (k + 1) + acc[b] - 1) * ld;
  for (int i = threadIdx.x; i < H; i += blockDim.x) out[(size_t)b * H + i] = r[i];
}

// The MTP head's chained pass j: position n + acc + j - 2, its KV slot and context length
extern "C" __global__ void spec_chain(const int* __restrict__ pos, const long long* __restrict__ sm,
                                      const int* __restrict__ acc, int j,
                                      const int* __restrict__ bt, int bt_stride, int page_size,
                                      int* __restrict__ out_pos, long long* __restrict__ out_slot,
                                      int* __restrict__ out_lens, int B, int k1) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= B) return;
  const int p = pos[(size_t)b * k1] + acc[b] + j - 2;
  const bool pad = sm[(size_t)b * k1] < 0;
  out_pos[b] = p;
  out_lens[b] = p + 1;
  out_slot[b] = pad ? -1LL
                    : (long long)bt[(size_t)b * bt_stride + p / page_size] * page_size
                          + p % page_size;
}

// rec (S, Kc - 1 + L, C): the slot's conv state (zeros for padding), then the sequence's rows
extern "C" __global__ void spec_record_conv(float* __restrict__ rec,
                                            const float* __restrict__ cstate,
                                            const float* __restrict__ x, int ldx,
                                            const int* __restrict__ cu,
                                            const int* __restrict__ slots, int S, int L, int C,
                                            int kc1) {
  const long long n = (long long)S * (kc1 + L) * C;
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n;
       e += (long long)gridDim.x * blockDim.x) {
    const int c = (int)(e % C);
    const int r = (int)((e / C) % (kc1 + L));
    const int s = (int)(e / ((long long)C * (kc1 + L)));
    if (r < kc1) {
      const int slot = slots[s];
      rec[e] = slot >= 0 ? cstate[((size_t)slot * kc1 + r) * C + c] : 0.f;
    } else if (r - kc1 < cu[s + 1] - cu[s]) {
      rec[e] = x[(size_t)(cu[s] + r - kc1) * ldx + c];
    }
  }
}

// Each slot's state moved to its first acc tokens, in every layer at once: layer z = blockIdx.z
// has tables[4 z .. 4 z + 3] = its ssm pool ((Hv, dk, dv) a slot), conv pool, ssm records
// (S, L, W: a token's deltas (Hv, dv), k (Hk, dk) and decays (Hv), gdn.cu record_row) and conv
// records (S, Kc - 1 + L, C). The ssm state, still the one from before the verify pass, is
// advanced by its first acc records, S = decay S + k delta^T a token (the float operations of
// the pass itself); conv = rec_conv[s, acc .. acc + Kc - 2].
extern "C" __global__ void spec_commit(const unsigned long long* __restrict__ tables,
                                       const int* __restrict__ slots, const int* __restrict__ acc,
                                       int S, int L, int Hk, int Hv, int dk, int dv, int kc1,
                                       int C) {
  const int s = blockIdx.y, slot = slots[s];
  if (slot < 0) return;
  const int a = min(acc[s], L);   // (the callers' acc is 1 .. L)
  const unsigned long long* tb = tables + 4 * blockIdx.z;
  float* ssm = reinterpret_cast<float*>(tb[0]);
  float* conv = reinterpret_cast<float*>(tb[1]);
  const float* rssm = reinterpret_cast<const float*>(tb[2]);
  const float* rconv = reinterpret_cast<const float*>(tb[3]);
  const size_t W = (size_t)Hv * dv + (size_t)Hk * dk + Hv;
  const float* rec0 = rssm + (size_t)s * L * W;
  const long long n4 = (long long)Hv * dk * dv / 4;   // (dv % 4 == 0: gpu/spec.py)
  float4* st = reinterpret_cast<float4*>(ssm + (size_t)slot * Hv * dk * dv);
  for (long long i4 = blockIdx.x * (long long)blockDim.x + threadIdx.x; i4 < n4;
       i4 += (long long)gridDim.x * blockDim.x) {
    const long long e = 4 * i4;
    const int c = (int)(e % dv), r = (int)((e / dv) % dk), h = (int)(e / ((long long)dk * dv));
    const int hk = h / (Hv / Hk);
    float4 v = st[i4];
    for (int i = 0; i < a; ++i) {
      const float* rec = rec0 + i * W;
      const float k = rec[(size_t)Hv * dv + hk * dk + r], dec = rec[(size_t)Hv * dv + Hk * dk + h];
      const float* d = rec + h * dv + c;
      v.x = fmaf(k, d[0], v.x * dec);
      v.y = fmaf(k, d[1], v.y * dec);
      v.z = fmaf(k, d[2], v.z * dec);
      v.w = fmaf(k, d[3], v.w * dec);
    }
    st[i4] = v;
  }
  const long long m = (long long)kc1 * C;
  const float* cs = rconv + ((size_t)s * (kc1 + L) + a) * C;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < m;
       i += (long long)gridDim.x * blockDim.x)
    conv[(size_t)slot * m + i] = cs[i];
}
