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

// One block per (row, head): scores of every position into `scores` (max_len per item), the
// softmax, then the weighted sum of V with threads over head_dim.
__global__ void AttentionKernel(const float* kc, const float* vc, int64_t kv_heads, int64_t bs,
                                int64_t hd, const float* q, int64_t heads, int64_t head0,
                                int64_t group, int64_t kv_head0, const int32_t* positions,
                                const int32_t* blocks, const int32_t* block_offset, int64_t max_len,
                                float scale, float* scores, float* out) {
  __shared__ float shared[32];
  const int64_t item = blockIdx.x, r = item / heads, h = item % heads;
  const int64_t kh = (head0 + h) / group - kv_head0;
  const int64_t len = positions[r] + 1;
  const float* qh = q + (r * heads + h) * hd;
  float* sc = scores + item * max_len;
  float mx = -FLT_MAX;
  for (int64_t p = threadIdx.x; p < len; p += blockDim.x) {
    const float* k = kc + SlabOffset(blocks, block_offset[r], p, kv_heads, kh, bs, hd);
    float dot = 0;
    for (int64_t d = 0; d < hd; ++d) dot += qh[d] * k[d];
    sc[p] = dot * scale;
    mx = fmaxf(mx, sc[p]);
  }
  mx = BlockMax(mx, shared);
  float sum = 0;
  for (int64_t p = threadIdx.x; p < len; p += blockDim.x) {
    sc[p] = expf(sc[p] - mx);
    sum += sc[p];
  }
  sum = BlockSum(sum, shared);
  __syncthreads();  // every score written before any thread reads them all
  const float inv = 1.f / sum;
  for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0;
    for (int64_t p = 0; p < len; ++p) {
      acc += sc[p] * vc[SlabOffset(blocks, block_offset[r], p, kv_heads, kh, bs, hd) + d];
    }
    out[(r * heads + h) * hd + d] = acc * inv;
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
  auto scores = ctx.Scratch(static_cast<size_t>(rows * heads * max_len) * sizeof(float));
  if (!scores.ok()) return scores.status();
  AttentionKernel<<<static_cast<unsigned>(rows * heads), 128>>>(
      c.k, c.v, c.kv_heads, c.block_size, c.head_dim, q, heads, head0, group, kv_head0, positions,
      blocks, block_offset, max_len, scale, static_cast<float*>(*scores), out);
  return Check(cudaGetLastError(), "Attention launch");
}

}  // namespace shardserve::cuda
