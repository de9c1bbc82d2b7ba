// The CUDA backend: embeddings, norms, biases, activations and row moves.
#include "backend/cuda/common.cuh"

namespace shardserve::cuda {
namespace {

__global__ void RmsNormKernel(const float* x, int64_t dim, const float* w, float eps, float* out) {
  const float* row = x + blockIdx.x * dim;
  float* o = out + blockIdx.x * dim;
  __shared__ float partial[32];
  float s = 0;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) s += row[i] * row[i];
  for (int off = 16; off > 0; off /= 2) s += __shfl_down_sync(0xffffffff, s, off);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x < 32) {
    s = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.f;
    for (int off = 16; off > 0; off /= 2) s += __shfl_down_sync(0xffffffff, s, off);
    if (threadIdx.x == 0) partial[0] = rsqrtf(s / dim + eps);
  }
  __syncthreads();
  const float inv = partial[0];
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) o[i] = w[i] * (row[i] * inv);
}

template <typename T>
__global__ void EmbedKernel(const T* table, int64_t row_stride, int64_t dim, const int32_t* ids,
                            int64_t vocab_begin, int64_t vocab_end, float* out) {
  const int64_t i = blockIdx.x;
  const int32_t id = ids[i];
  float* o = out + i * dim;
  const bool mine = id >= vocab_begin && id < vocab_end;
  const T* row = table + (mine ? (id - vocab_begin) * row_stride : 0);
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) o[d] = mine ? ToF32(row[d]) : 0.f;
}

__global__ void AddBiasKernel(float* x, int64_t rows, int64_t cols, const float* bias) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < rows * cols;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] += bias[i % cols];
  }
}

__global__ void AddKernel(float* x, const float* y, int64_t n) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] += y[i];
  }
}

__global__ void SiluMulKernel(float* a, const float* b, int64_t n) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = a[i];
    a[i] = v / (1.f + expf(-v)) * b[i];
  }
}

__global__ void GatherRowsKernel(const float* x, int64_t dim, const int32_t* rows, float* out) {
  const int64_t i = blockIdx.x;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) out[i * dim + d] = x[rows[i] * dim + d];
}

// Rows may repeat only across calls (an expert's rows are distinct), so no atomics are needed.
__global__ void ScaleAddRowsKernel(const float* x, int64_t dim, const int32_t* rows,
                                   const float* weight, float* y) {
  const int64_t i = blockIdx.x;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    y[rows[i] * dim + d] += weight[i] * x[i * dim + d];
  }
}

}  // namespace

absl::Status Embed(const WeightMatrix& t, const int32_t* ids, int64_t n, int64_t vocab_begin,
                   int64_t vocab_end, float* out) {
  if (n == 0) return absl::OkStatus();
  const unsigned blocks = static_cast<unsigned>(n);
  switch (t.dtype) {
    case DType::kF32:
      EmbedKernel<<<blocks, 256>>>(static_cast<const float*>(t.data), t.row_stride, t.cols, ids,
                                   vocab_begin, vocab_end, out);
      break;
    case DType::kF16:
      EmbedKernel<<<blocks, 256>>>(static_cast<const __half*>(t.data), t.row_stride, t.cols, ids,
                                   vocab_begin, vocab_end, out);
      break;
    case DType::kBF16:
      EmbedKernel<<<blocks, 256>>>(static_cast<const __nv_bfloat16*>(t.data), t.row_stride, t.cols,
                                   ids, vocab_begin, vocab_end, out);
      break;
  }
  return Check(cudaGetLastError(), "Embed launch");
}

absl::Status AddBias(float* x, int64_t rows, int64_t cols, const float* bias) {
  if (rows * cols == 0) return absl::OkStatus();
  AddBiasKernel<<<Grid(rows * cols), 256>>>(x, rows, cols, bias);
  return Check(cudaGetLastError(), "AddBias launch");
}

absl::Status Add(float* x, const float* y, int64_t n) {
  if (n == 0) return absl::OkStatus();
  AddKernel<<<Grid(n), 256>>>(x, y, n);
  return Check(cudaGetLastError(), "Add launch");
}

absl::Status SiluMul(float* a, const float* b, int64_t n) {
  if (n == 0) return absl::OkStatus();
  SiluMulKernel<<<Grid(n), 256>>>(a, b, n);
  return Check(cudaGetLastError(), "SiluMul launch");
}

absl::Status GatherRows(const float* x, int64_t dim, const int32_t* rows, int64_t n, float* out) {
  if (n == 0) return absl::OkStatus();
  GatherRowsKernel<<<static_cast<unsigned>(n), 256>>>(x, dim, rows, out);
  return Check(cudaGetLastError(), "GatherRows launch");
}

absl::Status ScaleAddRows(const float* x, int64_t dim, const int32_t* rows, const float* weight,
                          int64_t n, float* y) {
  if (n == 0) return absl::OkStatus();
  ScaleAddRowsKernel<<<static_cast<unsigned>(n), 256>>>(x, dim, rows, weight, y);
  return Check(cudaGetLastError(), "ScaleAddRows launch");
}

absl::Status RmsNorm(const float* x, int64_t M, int64_t dim, const float* w, float eps,
                     float* out) {
  if (M == 0) return absl::OkStatus();
  RmsNormKernel<<<static_cast<unsigned>(M), 256>>>(x, dim, w, eps, out);
  return Check(cudaGetLastError(), "RmsNorm launch");
}

}  // namespace shardserve::cuda
