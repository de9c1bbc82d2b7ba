// The CUDA backend: rotary embeddings, the paged KV cache and attention.
#include <cuda_fp8.h>

#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "backend/cuda/common.cuh"

namespace shardserve::cuda {
namespace {

// A KV cache's element types (Backend's KvFormat): F32, BF16, F16 and E4M3, read as floats (four
// consecutive, aligned, at once) and written rounded to nearest even (E4M3 saturated).
__device__ __forceinline__ float KvF(float x) { return x; }
__device__ __forceinline__ float KvF(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float KvF(__half x) { return __half2float(x); }
__device__ __forceinline__ float KvF(__nv_fp8_e4m3 x) { return static_cast<float>(x); }
template <typename T>
__device__ __forceinline__ T KvFrom(float x) {
  return T(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 KvFrom<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half KvFrom<__half>(float x) {
  return __float2half_rn(x);
}
__device__ __forceinline__ float4 KvLoad4(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ float4 KvLoad4(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ float4 KvLoad4(const __half* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ float4 KvLoad4(const __nv_fp8_e4m3* p) {
  __nv_fp8x4_e4m3 v;
  v.__x = *reinterpret_cast<const __nv_fp8x4_storage_t*>(p);
  return static_cast<float4>(v);
}

// Grid (rows, heads), a thread per rotated pair; the angle in float as the reference computes
// it, its cosine and sine in double (as model/rope.cc), so both backends rotate alike.
__global__ void RopeKernel(float* x, int64_t heads, int64_t head_dim, const int32_t* positions,
                           const float* inv_freq) {
  const int64_t r = blockIdx.x, h = blockIdx.y, half = head_dim / 2;
  float* v = x + (r * heads + h) * head_dim;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    const float angle = static_cast<float>(positions[r]) * inv_freq[i];
    const float c = static_cast<float>(cos(static_cast<double>(angle)));
    const float sn = static_cast<float>(sin(static_cast<double>(angle)));
    const float a = v[i], b = v[i + half];
    v[i] = a * c - b * sn;
    v[i + half] = b * c + a * sn;
  }
}

__device__ __forceinline__ int64_t SlabOffset(const int32_t* blocks, int32_t off, int64_t pos,
                                              int64_t kv_heads, int64_t kh, int64_t bs,
                                              int64_t hd) {
  const int64_t block = blocks[off + pos / bs];
  return ((block * kv_heads + kh) * bs + pos % bs) * hd;
}

// Grid (rows, kv_heads), threads over head_dim: the slot's place found once per block.
template <typename T>
__global__ void WriteKvKernel(T* kc, T* vc, int64_t kv_heads, int64_t bs, int64_t hd,
                              const float* k, const float* v, float k_inv, float v_inv,
                              const int32_t* positions, const int32_t* blocks,
                              const int32_t* block_offset) {
  const int64_t r = blockIdx.x, kh = blockIdx.y;
  const int64_t at = SlabOffset(blocks, block_offset[r], positions[r], kv_heads, kh, bs, hd);
  const int64_t from = (r * kv_heads + kh) * hd;
  for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
    kc[at + d] = KvFrom<T>(k[from + d] * k_inv);
    vc[at + d] = KvFrom<T>(v[from + d] * v_inv);
  }
}

constexpr int kAttnWarps = 4;
constexpr int64_t kAttnMaxHeadDim = 256;    // each lane holds head_dim / 32 of a row
constexpr int64_t kAttnMaxGroup = 16;       // query heads a block serves from one KV head
constexpr int64_t kAttnTargetBlocks = 528;  // four blocks for each of an H100/H200's 132 SMs
constexpr int64_t kAttnChunk = 32;          // positions a warp scores at once, a lane each

// Split-K decoding attention over the paged cache, GQA-aware: grid (row x KV head x head chunk,
// splits); a block serves up to kG query heads that share one KV head, so each K and V row is read
// once for all of them. Its warps take 32 positions at a time: a lane scores one position against
// every head (its K row in 16-byte loads), the warp updates each head's online softmax, then the
// lanes, now over head_dim, add the 32 weighted V rows (coalesced). The warps' states merge in
// shared memory; with one split the block writes the output, otherwise (max, sum, unnormalized
// weighted V) per (row, head, split) to `partial` for AttentionCombineKernel.
// kBatched: the K loop unrolled by 8 and the V rows loaded 8 at a time before they are used
// (more loads in flight for a warp; Attention chooses).
template <int kG, int kPer, bool kBatched, typename T>
__global__ void __launch_bounds__(kAttnWarps * 32)
    AttentionSplitKernel(const T* kc, const T* vc, int64_t kv_heads, int64_t bs, int64_t hd,
                         const float* q, int64_t heads, int64_t head0, int64_t group,
                         int64_t kv_head0, int64_t kv_first, int64_t kv_count, int64_t units,
                         const int32_t* positions, const int32_t* blocks,
                         const int32_t* block_offset, int64_t per_split, float scale, float v_scale,
                         float* partial, float* out) {
  constexpr int kDim = kPer * 32;
  __shared__ float qs[kG][kDim];
  __shared__ float es[kAttnWarps][kG][kAttnChunk];
  __shared__ float wacc[kAttnWarps][kDim];
  __shared__ float wm[kAttnWarps][kG], wl[kAttnWarps][kG];
  const int64_t unit = blockIdx.x % units, j = (blockIdx.x / units) % kv_count,
                r = blockIdx.x / units / kv_count;
  const int64_t kv_global = kv_first + j, kh = kv_global - kv_head0;
  // This block's query heads: those of KV head kv_global on this rank, kG at a time.
  const int64_t lo = max(int64_t{0}, kv_global * group - head0) + unit * kG;
  const int64_t hi = min(min(heads, (kv_global + 1) * group - head0), lo + kG);
  const int G = static_cast<int>(max(int64_t{0}, hi - lo));
  if (G == 0) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t i = threadIdx.x; i < static_cast<int64_t>(kG) * kDim; i += blockDim.x) {
    const int64_t g = i / kDim, d = i % kDim;
    qs[g][d] = g < G && d < hd ? q[(r * heads + lo + g) * hd + d] : 0.f;
  }
  __syncthreads();
  const int64_t len = positions[r] + 1;
  const int64_t p0 = blockIdx.y * per_split, p1 = min(len, p0 + per_split);
  const int32_t* row_blocks = blocks + block_offset[r];
  const bool vec = hd % 4 == 0;
  float m[kG], l[kG], acc[kG][kPer];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
    m[g] = -FLT_MAX;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) acc[g][i] = 0.f;
  }
  for (int64_t base = p0 + warp * kAttnChunk; base < p1; base += kAttnWarps * kAttnChunk) {
    const int64_t p = base + lane;
    const bool valid = p < p1;
    int64_t at = 0;
    float sc[kG];
#pragma unroll
    for (int g = 0; g < kG; ++g) sc[g] = 0.f;
    if (valid) {
      at = ((row_blocks[p / bs] * kv_heads + kh) * bs + p % bs) * hd;
      if (vec) {
#pragma unroll(kBatched ? 8 : 1)
        for (int64_t d4 = 0; d4 < hd / 4; ++d4) {
          const float4 kv = KvLoad4(kc + at + 4 * d4);
#pragma unroll
          for (int g = 0; g < kG; ++g) {
            const float4 qv = reinterpret_cast<const float4*>(qs[g])[d4];
            sc[g] += qv.x * kv.x + qv.y * kv.y + qv.z * kv.z + qv.w * kv.w;
          }
        }
      } else {
        for (int64_t d = 0; d < hd; ++d) {
          const float kv = KvF(kc[at + d]);
#pragma unroll
          for (int g = 0; g < kG; ++g) sc[g] += qs[g][d] * kv;
        }
      }
    }
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      const float s = valid ? sc[g] * scale : -FLT_MAX;
      float cmax = s;
      for (int off = 16; off > 0; off /= 2)
        cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffff, cmax, off));
      const float mn = fmaxf(m[g], cmax);
      const float rescale = expf(m[g] - mn), e = valid ? expf(s - mn) : 0.f;
      l[g] = l[g] * rescale + e;  // this lane's share; the warp's sum is taken at the end
#pragma unroll
      for (int i = 0; i < kPer; ++i) acc[g][i] *= rescale;
      m[g] = mn;
      es[warp][g][lane] = e;
    }
    __syncwarp();
    const int64_t n = min(kAttnChunk, p1 - base);
    // The weighted V rows, kU at a time, their loads issued before their use (kU positions past
    // n have e = 0 and read row 0).
    constexpr int kU = kBatched ? 8 : 1;  // divides kAttnChunk
    for (int64_t j0 = 0; j0 < n; j0 += kU) {
      float vv[kU][kPer];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t vat = __shfl_sync(0xffffffff, at, static_cast<int>(j0) + u);
        const bool ok = j0 + u < n;
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          const int64_t d = lane + 32 * i;
          vv[u][i] = ok && d < hd ? KvF(vc[vat + d]) : 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
#pragma unroll
        for (int g = 0; g < kG; ++g) {
          const float e = es[warp][g][j0 + u];
#pragma unroll
          for (int i = 0; i < kPer; ++i) acc[g][i] += e * vv[u][i];
        }
      }
    }
    __syncwarp();
  }
  // The warps' states, one head at a time: this split's (max, sum, weighted V).
  const int64_t splits = gridDim.y;
#pragma unroll
  for (int g = 0; g < kG; ++g) {
    if (g >= G) break;
    float lsum = l[g];
    for (int off = 16; off > 0; off /= 2) lsum += __shfl_xor_sync(0xffffffff, lsum, off);
    if (lane == 0) {
      wm[warp][g] = m[g];
      wl[warp][g] = lsum;
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) wacc[warp][lane + 32 * i] = acc[g][i];
    __syncthreads();
    float mx = -FLT_MAX, sum = 0.f;
    for (int w = 0; w < kAttnWarps; ++w) mx = fmaxf(mx, wm[w][g]);
    for (int w = 0; w < kAttnWarps; ++w) sum += wl[w][g] * expf(wm[w][g] - mx);
    const int64_t item = r * heads + lo + g;
    if (splits == 1) {
      const float inv = sum > 0.f ? v_scale / sum : 0.f;
      for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0;
        for (int w = 0; w < kAttnWarps; ++w) a += wacc[w][d] * expf(wm[w][g] - mx);
        out[item * hd + d] = a * inv;
      }
    } else {
      float* o = partial + (item * splits + blockIdx.y) * (hd + 2);
      for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0;
        for (int w = 0; w < kAttnWarps; ++w) a += wacc[w][d] * expf(wm[w][g] - mx);
        o[2 + d] = a * v_scale;
      }
      if (threadIdx.x == 0) {
        o[0] = mx;
        o[1] = sum;
      }
    }
    __syncthreads();
  }
}

// One block per (row, head): the splits' partial softmaxes merged (with the head's sink, when
// `sinks`, in the denominator), threads over head_dim.
__global__ void AttentionCombineKernel(const float* partial, int64_t splits, int64_t hd,
                                       int64_t heads, const float* sinks, float* out) {
  const int64_t item = blockIdx.x;
  const float* pr = partial + item * splits * (hd + 2);
  float mx = sinks != nullptr ? sinks[item % heads] : -FLT_MAX;
  for (int64_t s = 0; s < splits; ++s) mx = fmaxf(mx, pr[s * (hd + 2)]);
  float sum = sinks != nullptr ? expf(sinks[item % heads] - mx) : 0.f;
  for (int64_t s = 0; s < splits; ++s) sum += pr[s * (hd + 2) + 1] * expf(pr[s * (hd + 2)] - mx);
  const float inv = 1.f / sum;
  for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float a = 0;
    for (int64_t s = 0; s < splits; ++s)
      a += pr[s * (hd + 2) + 2 + d] * expf(pr[s * (hd + 2)] - mx);
    out[item * hd + d] = a * inv;
  }
}

// Decode attention for few (row, KV head) items, and attention with a sliding window or sinks
// (gpt-oss; Backend::AttentionExtras): grid (row x query head, splits of per_split positions),
// kHeadWarps warps that take kHeadUnroll positions at a time in turn, a lane holding every 32nd
// dim of the query and the output. A position's K and V rows are read coalesced by the warp, the
// kHeadUnroll positions' loads all in flight before their dot products, whose shuffle sums
// interleave. The split-K kernel above gives each lane a whole position, 32 at a time for every
// head of a group: at batch 1 its 16 blocks ran 4,500 dependent instructions a warp (33 us a
// layer at Llama-3-8B; ncu: 6 % occupancy, 0.7 % of memory throughput). Here a warp's chain is a
// few positions long and the grid is wide; each KV row is read once per query head (from L2).
// The warps' states merge in shared memory; one split writes the output (with the head's sink in
// the denominator), several write (max, sum, weighted V) for AttentionCombineKernel.
constexpr int kHeadWarps = 4;
constexpr int kHeadUnroll = 4;
constexpr int64_t kHeadPer = kAttnMaxHeadDim / 32;

template <int kPer, typename T>
__global__ void __launch_bounds__(kHeadWarps * 32)
    AttentionHeadKernel(const T* kc, const T* vc, int64_t kv_heads, int64_t bs, int64_t hd,
                        const float* q, int64_t heads, int64_t head0, int64_t group,
                        int64_t kv_head0, const int32_t* positions, const int32_t* blocks,
                        const int32_t* block_offset, int64_t per_split, float scale, float v_scale,
                        int64_t window, const float* sinks, float* partial, float* out) {
  __shared__ float wm[kHeadWarps], wl[kHeadWarps];
  __shared__ float wacc[kHeadWarps][kPer * 32];
  const int64_t item = blockIdx.x, r = item / heads, h = item % heads;
  const int64_t kh = (head0 + h) / group - kv_head0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float qv[kPer], acc[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t d = lane + 32 * i;
    qv[i] = d < hd ? q[item * hd + d] : 0.f;
    acc[i] = 0.f;
  }
  const int64_t len = positions[r] + 1;
  const int64_t begin = window > 0 ? max(int64_t{0}, len - window) : 0;
  const int64_t p0 = max(begin, static_cast<int64_t>(blockIdx.y) * per_split);
  const int64_t p1 = min(len, static_cast<int64_t>(blockIdx.y + 1) * per_split);
  const int32_t* row_blocks = blocks + block_offset[r];
  float m = -FLT_MAX, l = 0.f;
  for (int64_t base = p0 + warp * kHeadUnroll; base < p1; base += kHeadWarps * kHeadUnroll) {
    float kr[kHeadUnroll][kPer], vr[kHeadUnroll][kPer], s[kHeadUnroll];
#pragma unroll
    for (int u = 0; u < kHeadUnroll; ++u) {
      const int64_t p = base + u;
      const bool ok = p < p1;
      const int64_t at =
          ok ? ((static_cast<int64_t>(row_blocks[p / bs]) * kv_heads + kh) * bs + p % bs) * hd : 0;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int64_t d = lane + 32 * i;
        kr[u][i] = ok && d < hd ? KvF(kc[at + d]) : 0.f;
        vr[u][i] = ok && d < hd ? KvF(vc[at + d]) : 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kHeadUnroll; ++u) {
      s[u] = 0.f;
#pragma unroll
      for (int i = 0; i < kPer; ++i) s[u] += qv[i] * kr[u][i];
    }
    for (int off = 16; off > 0; off /= 2) {
#pragma unroll
      for (int u = 0; u < kHeadUnroll; ++u) s[u] += __shfl_xor_sync(0xffffffff, s[u], off);
    }
    float mn = m;
#pragma unroll
    for (int u = 0; u < kHeadUnroll; ++u) {
      s[u] = base + u < p1 ? s[u] * scale : -FLT_MAX;
      mn = fmaxf(mn, s[u]);
    }
    const float rescale = expf(m - mn);
    l *= rescale;
#pragma unroll
    for (int i = 0; i < kPer; ++i) acc[i] *= rescale;
#pragma unroll
    for (int u = 0; u < kHeadUnroll; ++u) {
      const float e = base + u < p1 ? expf(s[u] - mn) : 0.f;
      l += e;
#pragma unroll
      for (int i = 0; i < kPer; ++i) acc[i] += e * vr[u][i];
    }
    m = mn;
  }
  if (lane == 0) {
    wm[warp] = m;
    wl[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) wacc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  float mx = -FLT_MAX;
  for (int w = 0; w < kHeadWarps; ++w) mx = fmaxf(mx, wm[w]);
  float sum = 0.f;
  for (int w = 0; w < kHeadWarps; ++w) sum += wl[w] * expf(wm[w] - mx);
  if (gridDim.y == 1) {
    float factor = 1.f;  // the warps' terms against the sink's, when the head has one
    if (sinks != nullptr) {
      const float top = fmaxf(mx, sinks[h]);
      factor = expf(mx - top);
      sum = sum * factor + expf(sinks[h] - top);
    }
    for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
      float a = 0.f;
      for (int w = 0; w < kHeadWarps; ++w) a += wacc[w][d] * expf(wm[w] - mx);
      out[item * hd + d] = a * factor * v_scale / sum;
    }
    return;
  }
  float* o = partial + (item * gridDim.y + blockIdx.y) * (hd + 2);
  for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float a = 0.f;
    for (int w = 0; w < kHeadWarps; ++w) a += wacc[w][d] * expf(wm[w] - mx);
    o[2 + d] = a * v_scale;
  }
  if (threadIdx.x == 0) {
    o[0] = mx;
    o[1] = sum;
  }
}

// Multi-head latent attention (Backend::LatentAttention): grid (rows, heads), kLatentWarps warps
// that take positions in turn, a lane holding every 32nd of the query's dims and of the output
// latent; each warp keeps an online softmax, merged in shared memory at the end.
constexpr int kLatentWarps = 4;
constexpr int64_t kLatentPer = 16, kRopePer = 4;  // latent_dim up to 512, rope_dim up to 128

template <typename T>
__global__ void __launch_bounds__(kLatentWarps * 32)
    LatentAttentionKernel(const T* cache, int64_t bs, int64_t L, int64_t R, const float* q_latent,
                          const float* q_rope, int64_t heads, const int32_t* positions,
                          const int32_t* blocks, const int32_t* block_offset, float scale,
                          float v_scale, float* out) {
  __shared__ float wm[kLatentWarps], wl[kLatentWarps];
  __shared__ float wacc[kLatentWarps][kLatentPer * 32];
  const int64_t r = blockIdx.x, h = blockIdx.y, item = r * heads + h;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float ql[kLatentPer], qr[kRopePer], acc[kLatentPer];
#pragma unroll
  for (int i = 0; i < kLatentPer; ++i) {
    const int64_t d = lane + 32 * i;
    ql[i] = d < L ? q_latent[item * L + d] : 0.f;
    acc[i] = 0.f;
  }
#pragma unroll
  for (int i = 0; i < kRopePer; ++i) {
    const int64_t d = lane + 32 * i;
    qr[i] = d < R ? q_rope[item * R + d] : 0.f;
  }
  const int64_t len = positions[r] + 1, D = L + R;
  const int32_t* row_blocks = blocks + block_offset[r];
  float m = -FLT_MAX, l = 0.f;
  for (int64_t p = warp; p < len; p += kLatentWarps) {
    const T* row = cache + (static_cast<int64_t>(row_blocks[p / bs]) * bs + p % bs) * D;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kLatentPer; ++i) {
      const int64_t d = lane + 32 * i;
      if (d < L) s += ql[i] * KvF(row[d]);
    }
#pragma unroll
    for (int i = 0; i < kRopePer; ++i) {
      const int64_t d = lane + 32 * i;
      if (d < R) s += qr[i] * KvF(row[L + d]);
    }
    for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffff, s, off);
    s *= scale;
    const float mn = fmaxf(m, s), rescale = expf(m - mn), e = expf(s - mn);
    l = l * rescale + e;
#pragma unroll
    for (int i = 0; i < kLatentPer; ++i) {
      const int64_t d = lane + 32 * i;
      acc[i] = acc[i] * rescale + (d < L ? e * KvF(row[d]) : 0.f);
    }
    m = mn;
  }
  if (lane == 0) {
    wm[warp] = m;
    wl[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < kLatentPer; ++i) wacc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  float mx = -FLT_MAX;
  for (int w = 0; w < kLatentWarps; ++w) mx = fmaxf(mx, wm[w]);
  float total = 0.f;
  for (int w = 0; w < kLatentWarps; ++w) total += wl[w] * expf(wm[w] - mx);
  for (int64_t d = threadIdx.x; d < L; d += blockDim.x) {
    float v = 0.f;
    for (int w = 0; w < kLatentWarps; ++w) v += wacc[w][d] * expf(wm[w] - mx);
    out[item * L + d] = v * v_scale / total;
  }
}

// Grid rows, threads over the latent and rope dims of the row's slot.
template <typename T>
__global__ void WriteLatentKvKernel(T* cache, int64_t bs, int64_t L, int64_t R, const float* latent,
                                    const float* rope, float inv, const int32_t* positions,
                                    const int32_t* blocks, const int32_t* block_offset) {
  const int64_t r = blockIdx.x, p = positions[r];
  T* at = cache + (static_cast<int64_t>(blocks[block_offset[r] + p / bs]) * bs + p % bs) * (L + R);
  for (int64_t d = threadIdx.x; d < L + R; d += blockDim.x) {
    at[d] = KvFrom<T>((d < L ? latent[r * L + d] : rope[r * R + d - L]) * inv);
  }
}

// f(T{}) for the cache's element type T (a null pointer of it), f's status.
template <typename F>
absl::Status WithKvType(DType t, F&& f) {
  switch (t) {
    case DType::kF32:
      return f(static_cast<float*>(nullptr));
    case DType::kBF16:
      return f(static_cast<__nv_bfloat16*>(nullptr));
    case DType::kF16:
      return f(static_cast<__half*>(nullptr));
    case DType::kF8E4M3:
      return f(static_cast<__nv_fp8_e4m3*>(nullptr));
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("a KV cache on the CUDA backend cannot hold ", DTypeName(t)));
  }
}
template <typename P>
using Elem = std::remove_pointer_t<P>;

}  // namespace

absl::Status Rope(float* x, int64_t rows, int64_t heads, int64_t head_dim, const int32_t* positions,
                  const float* inv_freq) {
  if (rows == 0) return absl::OkStatus();
  if (rows > INT32_MAX || heads > 65535 || heads == 0) {
    return absl::InvalidArgumentError(absl::StrCat("Rope of ", rows, " rows of ", heads, " heads"));
  }
  const int threads = static_cast<int>(std::clamp<int64_t>((head_dim / 2 + 31) / 32 * 32, 32, 256));
  RopeKernel<<<dim3(static_cast<unsigned>(rows), static_cast<unsigned>(heads)), threads>>>(
      x, heads, head_dim, positions, inv_freq);
  return Check(cudaGetLastError(), "Rope launch");
}

absl::Status WriteKv(const DeviceKv& c, const float* k, const float* v, int64_t rows,
                     const int32_t* positions, const int32_t* blocks, const int32_t* block_offset) {
  if (rows == 0) return absl::OkStatus();
  if (c.kv_heads == 0) return absl::OkStatus();
  if (rows > INT32_MAX || c.kv_heads > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("WriteKv of ", rows, " rows of ", c.kv_heads, " KV heads"));
  }
  const int threads = static_cast<int>(std::clamp<int64_t>((c.head_dim + 31) / 32 * 32, 32, 256));
  return WithKvType(c.dtype, [&](auto tag) {
    using T = Elem<decltype(tag)>;
    WriteKvKernel<T>
        <<<dim3(static_cast<unsigned>(rows), static_cast<unsigned>(c.kv_heads)), threads>>>(
            static_cast<T*>(c.k), static_cast<T*>(c.v), c.kv_heads, c.block_size, c.head_dim, k, v,
            1.f / c.k_scale, 1.f / c.v_scale, positions, blocks, block_offset);
    return Check(cudaGetLastError(), "WriteKv launch");
  });
}

// AttentionSplitKernel<kG, kPer, batched, T> for the group size kg (1, 2, 4, 8 or 16) and
// kPer = per.
template <typename T>
void LaunchAttentionSplit(int kg, int per, bool batched, dim3 grid, const T* kc, const T* vc,
                          int64_t kv_heads, int64_t bs, int64_t hd, const float* q, int64_t heads,
                          int64_t head0, int64_t group, int64_t kv_head0, int64_t kv_first,
                          int64_t kv_count, int64_t units, const int32_t* positions,
                          const int32_t* blocks, const int32_t* block_offset, int64_t per_split,
                          float scale, float v_scale, float* partial, float* out) {
  auto launch = [&](auto kernel) {
    kernel<<<grid, kAttnWarps * 32>>>(kc, vc, kv_heads, bs, hd, q, heads, head0, group, kv_head0,
                                      kv_first, kv_count, units, positions, blocks, block_offset,
                                      per_split, scale, v_scale, partial, out);
  };
  auto with_group = [&](auto g) {
    constexpr int kG = decltype(g)::value;
    auto with_per = [&](auto p) {
      constexpr int kPer = decltype(p)::value;
      if (batched) {
        launch(AttentionSplitKernel<kG, kPer, true, T>);
      } else {
        launch(AttentionSplitKernel<kG, kPer, false, T>);
      }
    };
    if (per <= 2) {
      with_per(std::integral_constant<int, 2>{});
    } else if (per <= 4) {
      with_per(std::integral_constant<int, 4>{});
    } else {
      with_per(std::integral_constant<int, 8>{});
    }
  };
  switch (kg) {
    case 1:
      return with_group(std::integral_constant<int, 1>{});
    case 2:
      return with_group(std::integral_constant<int, 2>{});
    case 4:
      return with_group(std::integral_constant<int, 4>{});
    case 8:
      return with_group(std::integral_constant<int, 8>{});
    default:
      return with_group(std::integral_constant<int, 16>{});
  }
}

absl::StatusOr<AttentionKernel> AttentionKernelNamed(std::string_view name) {
  if (name.empty()) return AttentionKernel::kByShape;
  if (name == "split") return AttentionKernel::kSplit;
  if (name == "split-batched") return AttentionKernel::kSplitBatched;
  if (name == "heads") return AttentionKernel::kHeads;
  return absl::InvalidArgumentError(
      absl::StrCat("'", std::string(name),
                   "' must be split, split-batched or heads (the decode attention kernel to "
                   "force); unset, the shape chooses"));
}

namespace {

// AttentionHeadKernel over rows x heads items in splits of positions: enough splits to give the
// GPU kAttnTargetBlocks blocks, each at least kHeadWarps * kHeadUnroll * 2 positions (two
// rounds a warp).
absl::Status AttentionByHead(Context& ctx, const DeviceKv& c, const float* q, int64_t rows,
                             int64_t heads, int64_t head0, int64_t group, int64_t kv_head0,
                             const int32_t* positions, const int32_t* blocks,
                             const int32_t* block_offset, int64_t max_len, float scale,
                             const AttentionExtras& extras, float* out) {
  if (rows * heads > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention over ", rows, " rows x ", heads, " heads"));
  }
  constexpr int64_t kMinSplit = kHeadWarps * kHeadUnroll * 2;
  const int64_t items = rows * heads;
  const int64_t most = std::max<int64_t>(1, (max_len + kMinSplit - 1) / kMinSplit);
  const int64_t want = std::clamp<int64_t>((kAttnTargetBlocks + items - 1) / items, 1, most);
  const int64_t per_split = ((max_len + want - 1) / want + kMinSplit - 1) / kMinSplit * kMinSplit;
  const int64_t splits = std::max<int64_t>(1, (max_len + per_split - 1) / per_split);
  float* pr = nullptr;
  if (splits > 1) {
    auto partial =
        ctx.Scratch(static_cast<size_t>(items * splits * (c.head_dim + 2)) * sizeof(float));
    if (!partial.ok()) return partial.status();
    pr = static_cast<float*>(*partial);
  }
  const dim3 grid(static_cast<unsigned>(items), static_cast<unsigned>(splits));
  RETURN_IF_ERROR(WithKvType(c.dtype, [&](auto tag) {
    using T = Elem<decltype(tag)>;
    auto launch = [&](auto kernel) {
      kernel<<<grid, kHeadWarps * 32>>>(
          static_cast<const T*>(c.k), static_cast<const T*>(c.v), c.kv_heads, c.block_size,
          c.head_dim, q, heads, head0, group, kv_head0, positions, blocks, block_offset, per_split,
          scale * c.k_scale, c.v_scale, extras.window, extras.sinks, pr, out);
    };
    const int64_t per = (c.head_dim + 31) / 32;
    if (per <= 2) {
      launch(AttentionHeadKernel<2, T>);
    } else if (per <= 4) {
      launch(AttentionHeadKernel<4, T>);
    } else {
      launch(AttentionHeadKernel<kHeadPer, T>);
    }
    return Check(cudaGetLastError(), "Attention launch");
  }));
  if (splits == 1) return absl::OkStatus();
  AttentionCombineKernel<<<static_cast<unsigned>(items), 128>>>(pr, splits, c.head_dim, heads,
                                                                extras.sinks, out);
  return Check(cudaGetLastError(), "Attention launch");
}

}  // namespace

absl::Status Attention(Context& ctx, const DeviceKv& c, const float* q, int64_t rows, int64_t heads,
                       int64_t head0, int64_t group, int64_t kv_head0, const int32_t* positions,
                       const int32_t* blocks, const int32_t* block_offset, int64_t max_len,
                       float scale, const AttentionExtras& extras, float* out) {
  if (rows * heads == 0) return absl::OkStatus();
  if (c.head_dim > kAttnMaxHeadDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention on the CUDA backend takes head_dim up to ", kAttnMaxHeadDim,
                     ", not ", c.head_dim));
  }
  // The KV heads this rank's query heads read, and the blocks that serve each (kG heads a block).
  const int64_t kv_first = head0 / group, kv_count = (head0 + heads - 1) / group - kv_first + 1;
  const int64_t g = std::min<int64_t>(group, kAttnMaxGroup);
  const int kg = g <= 1 ? 1 : g <= 2 ? 2 : g <= 4 ? 4 : g <= 8 ? 8 : 16;
  const int64_t units = (std::min<int64_t>(group, heads) + kg - 1) / kg;
  const int64_t blocks_x = rows * kv_count * units;
  // The kernel (the context's KernelChoice may force one): per query head
  // for a window or sinks, and where few (row, KV head) items leave the split-K kernel's blocks
  // too few and too long (batch 1-8 at Llama-3-8B) over contexts short enough that reading each KV
  // row once per query head costs little; else the split-K kernel, batched where few blocks must
  // hide their own latency (on an H200, bench/cuda-notes.md: 3-13 % faster there and 9 % slower
  // at TinyLlama batch 32 after 128 tokens).
  const AttentionKernel force = ctx.kernels().attention;
  AttentionKernel kernel = force;
  if (extras.window > 0 || extras.sinks != nullptr) kernel = AttentionKernel::kHeads;
  if (kernel == AttentionKernel::kByShape) {
    kernel = blocks_x < 128 && max_len <= 2048 ? AttentionKernel::kHeads : AttentionKernel::kSplit;
  }
  if (kernel == AttentionKernel::kHeads) {
    return AttentionByHead(ctx, c, q, rows, heads, head0, group, kv_head0, positions, blocks,
                           block_offset, max_len, scale, extras, out);
  }
  if (blocks_x > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("attention over ", rows, " rows"));
  }
  // Splits of whole 128-position steps (a block's four warps), enough to fill the GPU: at most
  // kAttnTargetBlocks of them, so within the grid's y limit.
  const int64_t step = kAttnWarps * kAttnChunk;
  const int64_t steps = std::max<int64_t>(1, (max_len + step - 1) / step);
  const int64_t want = std::clamp<int64_t>((kAttnTargetBlocks + blocks_x - 1) / blocks_x, 1, steps);
  const int64_t per_split = (steps + want - 1) / want * step;
  const int64_t splits = std::max<int64_t>(1, (max_len + per_split - 1) / per_split);
  float* pr = nullptr;
  if (splits > 1) {
    auto partial =
        ctx.Scratch(static_cast<size_t>(rows * heads * splits * (c.head_dim + 2)) * sizeof(float));
    if (!partial.ok()) return partial.status();
    pr = static_cast<float*>(*partial);
  }
  const bool batched =
      force == AttentionKernel::kSplitBatched ||
      (force == AttentionKernel::kByShape && (blocks_x < 128 || per_split >= 2 * step));
  const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(splits));
  RETURN_IF_ERROR(WithKvType(c.dtype, [&](auto tag) {
    using T = Elem<decltype(tag)>;
    LaunchAttentionSplit<T>(kg, static_cast<int>((c.head_dim + 31) / 32), batched, grid,
                            static_cast<const T*>(c.k), static_cast<const T*>(c.v), c.kv_heads,
                            c.block_size, c.head_dim, q, heads, head0, group, kv_head0, kv_first,
                            kv_count, units, positions, blocks, block_offset, per_split,
                            scale * c.k_scale, c.v_scale, pr, out);
    return Check(cudaGetLastError(), "Attention launch");
  }));
  if (splits == 1) return absl::OkStatus();
  AttentionCombineKernel<<<static_cast<unsigned>(rows * heads), 128>>>(pr, splits, c.head_dim,
                                                                       heads, nullptr, out);
  return Check(cudaGetLastError(), "Attention launch");
}

absl::Status WriteLatentKv(const DeviceLatentKv& c, const float* latent, const float* rope,
                           int64_t rows, const int32_t* positions, const int32_t* blocks,
                           const int32_t* block_offset) {
  if (rows == 0) return absl::OkStatus();
  if (rows > INT32_MAX) return absl::InvalidArgumentError(absl::StrCat("WriteLatentKv of ", rows));
  return WithKvType(c.dtype, [&](auto tag) {
    using T = Elem<decltype(tag)>;
    WriteLatentKvKernel<T><<<static_cast<unsigned>(rows), 256>>>(
        static_cast<T*>(c.data), c.block_size, c.latent_dim, c.rope_dim, latent, rope,
        1.f / c.scale, positions, blocks, block_offset);
    return Check(cudaGetLastError(), "WriteLatentKv launch");
  });
}

absl::Status LatentAttention(const DeviceLatentKv& c, const float* q_latent, const float* q_rope,
                             int64_t rows, int64_t heads, const int32_t* positions,
                             const int32_t* blocks, const int32_t* block_offset, float scale,
                             float* out) {
  if (rows * heads == 0) return absl::OkStatus();
  if (c.latent_dim > kLatentPer * 32 || c.rope_dim > kRopePer * 32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "latent attention on the CUDA backend takes a latent of up to ", kLatentPer * 32,
        " and rope dims up to ", kRopePer * 32, ", not ", c.latent_dim, " and ", c.rope_dim));
  }
  if (rows > INT32_MAX || heads > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("latent attention over ", rows, " rows x ", heads, " heads"));
  }
  return WithKvType(c.dtype, [&](auto tag) {
    using T = Elem<decltype(tag)>;
    LatentAttentionKernel<T>
        <<<dim3(static_cast<unsigned>(rows), static_cast<unsigned>(heads)), kLatentWarps * 32>>>(
            static_cast<const T*>(c.data), c.block_size, c.latent_dim, c.rope_dim, q_latent, q_rope,
            heads, positions, blocks, block_offset, scale * c.scale, c.scale, out);
    return Check(cudaGetLastError(), "LatentAttention launch");
  });
}

}  // namespace shardserve::cuda
