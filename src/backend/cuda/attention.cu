// The CUDA backend: rotary embeddings, the paged KV cache and attention.
#include "backend/cuda/common.cuh"

namespace shardserve::cuda {
namespace {

// One block per row; the angle in float as the reference computes it, its cosine and sine in
// double (as model/rope.cc), so both backends rotate alike.
__global__ void RopeKernel(float* x, int64_t heads, int64_t head_dim, const int32_t* positions,
                           const float* inv_freq) {
  const int64_t r = blockIdx.x, half = head_dim / 2;
  float* row = x + r * heads * head_dim;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    const float angle = static_cast<float>(positions[r]) * inv_freq[i];
    const float c = static_cast<float>(cos(static_cast<double>(angle)));
    const float sn = static_cast<float>(sin(static_cast<double>(angle)));
    for (int64_t h = 0; h < heads; ++h) {
      float* v = row + h * head_dim;
      const float a = v[i], b = v[i + half];
      v[i] = a * c - b * sn;
      v[i + half] = b * c + a * sn;
    }
  }
}

__device__ __forceinline__ int64_t SlabOffset(const int32_t* blocks, int32_t off, int64_t pos,
                                              int64_t kv_heads, int64_t kh, int64_t bs,
                                              int64_t hd) {
  const int64_t block = blocks[off + pos / bs];
  return ((block * kv_heads + kh) * bs + pos % bs) * hd;
}

// One block per row; threads over kv_heads * head_dim.
__global__ void WriteKvKernel(float* kc, float* vc, int64_t kv_heads, int64_t bs, int64_t hd,
                              const float* k, const float* v, const int32_t* positions,
                              const int32_t* blocks, const int32_t* block_offset) {
  const int64_t r = blockIdx.x;
  for (int64_t i = threadIdx.x; i < kv_heads * hd; i += blockDim.x) {
    const int64_t kh = i / hd, d = i % hd;
    const int64_t at = SlabOffset(blocks, block_offset[r], positions[r], kv_heads, kh, bs, hd) + d;
    kc[at] = k[r * kv_heads * hd + i];
    vc[at] = v[r * kv_heads * hd + i];
  }
}

constexpr int kAttnWarps = 4;
constexpr int64_t kAttnMaxHeadDim = 256;    // each lane holds head_dim / 32 of a row
constexpr int64_t kAttnTargetBlocks = 256;  // enough blocks to fill the GPU at batch 1

// Split-K decoding attention: grid (row x head, splits); a block takes a run of the row's
// positions, its warps one position at a time (lanes over head_dim, so K and V rows are read
// coalesced) with an online softmax. The block's (max, sum, unnormalized weighted V) go to
// `partial`, and AttentionCombineKernel merges the splits.
__global__ void AttentionSplitKernel(const float* kc, const float* vc, int64_t kv_heads, int64_t bs,
                                     int64_t hd, const float* q, int64_t heads, int64_t head0,
                                     int64_t group, int64_t kv_head0, const int32_t* positions,
                                     const int32_t* blocks, const int32_t* block_offset,
                                     int64_t per_split, float scale, float* partial) {
  constexpr int kPer = kAttnMaxHeadDim / 32;
  __shared__ float warp_max[kAttnWarps], warp_sum[kAttnWarps];
  __shared__ float warp_acc[kAttnWarps][kAttnMaxHeadDim];
  const int64_t item = blockIdx.x, r = item / heads, h = item % heads;
  const int64_t kh = (head0 + h) / group - kv_head0;
  const int64_t len = positions[r] + 1;
  const int64_t p0 = blockIdx.y * per_split, p1 = min(len, p0 + per_split);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float* qh = q + (r * heads + h) * hd;
  float qr[kPer], acc[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t d = lane + 32 * i;
    qr[i] = d < hd ? qh[d] : 0.f;
    acc[i] = 0.f;
  }
  float m = -FLT_MAX, l = 0.f;
  for (int64_t p = p0 + warp; p < p1; p += kAttnWarps) {
    const int64_t at = SlabOffset(blocks, block_offset[r], p, kv_heads, kh, bs, hd);
    const float *k = kc + at, *v = vc + at;
    float dot = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int64_t d = lane + 32 * i;
      if (d < hd) dot += qr[i] * k[d];
    }
    for (int off = 16; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffff, dot, off);
    const float s = dot * scale, mn = fmaxf(m, s);
    const float rescale = expf(m - mn), e = expf(s - mn);
    l = l * rescale + e;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int64_t d = lane + 32 * i;
      if (d < hd) acc[i] = acc[i] * rescale + e * v[d];
    }
    m = mn;
  }
  if (lane == 0) {
    warp_max[warp] = m;
    warp_sum[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t d = lane + 32 * i;
    if (d < hd) warp_acc[warp][d] = acc[i];
  }
  __syncthreads();
  float mx = -FLT_MAX, sum = 0.f;
  for (int w = 0; w < kAttnWarps; ++w) mx = fmaxf(mx, warp_max[w]);
  for (int w = 0; w < kAttnWarps; ++w) sum += warp_sum[w] * expf(warp_max[w] - mx);
  float* out = partial + (item * gridDim.y + blockIdx.y) * (hd + 2);
  for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float a = 0;
    for (int w = 0; w < kAttnWarps; ++w) a += warp_acc[w][d] * expf(warp_max[w] - mx);
    out[2 + d] = a;
  }
  if (threadIdx.x == 0) {
    out[0] = mx;
    out[1] = sum;
  }
}

// One block per (row, head): the splits' partial softmaxes merged, threads over head_dim.
__global__ void AttentionCombineKernel(const float* partial, int64_t splits, int64_t hd,
                                       float* out) {
  const int64_t item = blockIdx.x;
  const float* pr = partial + item * splits * (hd + 2);
  float mx = -FLT_MAX, sum = 0.f;
  for (int64_t s = 0; s < splits; ++s) mx = fmaxf(mx, pr[s * (hd + 2)]);
  for (int64_t s = 0; s < splits; ++s) sum += pr[s * (hd + 2) + 1] * expf(pr[s * (hd + 2)] - mx);
  const float inv = 1.f / sum;
  for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float a = 0;
    for (int64_t s = 0; s < splits; ++s)
      a += pr[s * (hd + 2) + 2 + d] * expf(pr[s * (hd + 2)] - mx);
    out[item * hd + d] = a * inv;
  }
}

}  // namespace

absl::Status Rope(float* x, int64_t rows, int64_t heads, int64_t head_dim, const int32_t* positions,
                  const float* inv_freq) {
  if (rows == 0) return absl::OkStatus();
  RopeKernel<<<static_cast<unsigned>(rows), 64>>>(x, heads, head_dim, positions, inv_freq);
  return Check(cudaGetLastError(), "Rope launch");
}

absl::Status WriteKv(const DeviceKv& c, const float* k, const float* v, int64_t rows,
                     const int32_t* positions, const int32_t* blocks, const int32_t* block_offset) {
  if (rows == 0) return absl::OkStatus();
  WriteKvKernel<<<static_cast<unsigned>(rows), 128>>>(
      c.k, c.v, c.kv_heads, c.block_size, c.head_dim, k, v, positions, blocks, block_offset);
  return Check(cudaGetLastError(), "WriteKv launch");
}

absl::Status Attention(Context& ctx, const DeviceKv& c, const float* q, int64_t rows, int64_t heads,
                       int64_t head0, int64_t group, int64_t kv_head0, const int32_t* positions,
                       const int32_t* blocks, const int32_t* block_offset, int64_t max_len,
                       float scale, float* out) {
  if (rows * heads == 0) return absl::OkStatus();
  if (c.head_dim > kAttnMaxHeadDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention on the CUDA backend takes head_dim up to ", kAttnMaxHeadDim,
                     ", not ", c.head_dim));
  }
  const int64_t items = rows * heads;
  const int64_t splits = std::clamp<int64_t>((kAttnTargetBlocks + items - 1) / items, 1,
                                             std::max<int64_t>(1, (max_len + 31) / 32));
  const int64_t per_split = (max_len + splits - 1) / splits;
  auto partial =
      ctx.Scratch(static_cast<size_t>(items * splits * (c.head_dim + 2)) * sizeof(float));
  if (!partial.ok()) return partial.status();
  float* pr = static_cast<float*>(*partial);
  AttentionSplitKernel<<<dim3(static_cast<unsigned>(items), static_cast<unsigned>(splits)),
                         kAttnWarps * 32>>>(c.k, c.v, c.kv_heads, c.block_size, c.head_dim, q,
                                            heads, head0, group, kv_head0, positions, blocks,
                                            block_offset, per_split, scale, pr);
  RETURN_IF_CUDA(cudaGetLastError(), "Attention launch");
  AttentionCombineKernel<<<static_cast<unsigned>(items), 128>>>(pr, splits, c.head_dim, out);
  return Check(cudaGetLastError(), "Attention launch");
}

}  // namespace shardserve::cuda
