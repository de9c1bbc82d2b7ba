// The CUDA backend: embeddings, norms, biases, activations and row moves.
#include "backend/cuda/common.cuh"

namespace shardserve::cuda {
namespace {

// RMSNorm of one row per block, the row held in registers: each of kNormThreads threads loads
// kVecs float4s (all in flight at once), the block sums their squares, and the thread writes its
// part of the output. With `add`, x += add first (the residual) and the sum is written back to x:
// the layer's residual add and the next norm in one pass. Needs dim % 4 == 0 and 16-byte aligned
// rows; dim <= 4 * kNormThreads * kVecs.
constexpr int kNormThreads = 256;

template <int kVecs>
__global__ void __launch_bounds__(kNormThreads)
    RmsNormVecKernel(float* x, const float* add, int64_t dim, const float* w, float eps,
                     float* out) {
  __shared__ float partial[32];
  const int64_t n4 = dim / 4;
  float4* row = reinterpret_cast<float4*>(x + blockIdx.x * dim);
  const float4* a =
      add == nullptr ? nullptr : reinterpret_cast<const float4*>(add + blockIdx.x * dim);
  const float4* w4 = reinterpret_cast<const float4*>(w);
  float4 v[kVecs], g[kVecs];  // the norm's weights loaded with the row: one memory latency, not two
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kNormThreads;
    v[j] = i < n4 ? row[i] : make_float4(0.f, 0.f, 0.f, 0.f);
    g[j] = i < n4 ? w4[i] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (a != nullptr) {
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kNormThreads;
      if (i < n4) {
        const float4 b = a[i];
        v[j].x += b.x;
        v[j].y += b.y;
        v[j].z += b.z;
        v[j].w += b.w;
        row[i] = v[j];
      }
    }
  }
  float s = 0;
#pragma unroll
  for (int j = 0; j < kVecs; ++j)
    s += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
  s = BlockReduce(s, SumOp<float>{}, 0.f, partial);
  const float inv = rsqrtf(s / dim + eps);
  float4* o = reinterpret_cast<float4*>(out + blockIdx.x * dim);
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * kNormThreads;
    if (i < n4) {
      o[i] = make_float4(g[j].x * (v[j].x * inv), g[j].y * (v[j].y * inv), g[j].z * (v[j].z * inv),
                         g[j].w * (v[j].w * inv));
    }
  }
}

// Any dim: x += add (when given), then the norm in two passes over the row.
__global__ void RmsNormKernel(float* x, const float* add, int64_t dim, const float* w, float eps,
                              float* out) {
  float* row = x + blockIdx.x * dim;
  float* o = out + blockIdx.x * dim;
  __shared__ float partial[32];
  float s = 0;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    if (add != nullptr) row[i] += add[blockIdx.x * dim + i];
    s += row[i] * row[i];
  }
  s = BlockReduce(s, SumOp<float>{}, 0.f, partial);
  const float inv = rsqrtf(s / dim + eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) o[i] = w[i] * (row[i] * inv);
}

absl::Status LaunchRmsNorm(float* x, const float* add, int64_t M, int64_t dim, const float* w,
                           float eps, float* out) {
  if (M == 0) return absl::OkStatus();
  if (M > INT32_MAX) return absl::InvalidArgumentError(absl::StrCat(M, " rows to normalize"));
  const unsigned grid = static_cast<unsigned>(M);
  const bool aligned = dim % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(w) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(out) % 16 == 0 &&
                       (add == nullptr || reinterpret_cast<uintptr_t>(add) % 16 == 0);
  const int64_t vecs = (dim / 4 + kNormThreads - 1) / kNormThreads;
  if (aligned && vecs <= 1) {
    RmsNormVecKernel<1><<<grid, kNormThreads>>>(x, add, dim, w, eps, out);
  } else if (aligned && vecs <= 2) {
    RmsNormVecKernel<2><<<grid, kNormThreads>>>(x, add, dim, w, eps, out);
  } else if (aligned && vecs <= 4) {
    RmsNormVecKernel<4><<<grid, kNormThreads>>>(x, add, dim, w, eps, out);
  } else if (aligned && vecs <= 8) {
    RmsNormVecKernel<8><<<grid, kNormThreads>>>(x, add, dim, w, eps, out);
  } else {
    RmsNormKernel<<<grid, 256>>>(x, add, dim, w, eps, out);
  }
  return Check(cudaGetLastError(), "RmsNorm launch");
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

__global__ void SwiGluClampedKernel(float* a, const float* b, int64_t n, float alpha, float limit) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = fminf(a[i], limit), u = fminf(fmaxf(b[i], -limit), limit);
    a[i] = (u + 1.f) * (g / (1.f + expf(-alpha * g)));
  }
}

__global__ void GatherRowsKernel(const float* x, int64_t dim, const int32_t* rows, float* out) {
  const int64_t i = blockIdx.x;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) out[i * dim + d] = x[rows[i] * dim + d];
}

// A destination row may repeat within one call (the seam allows it), and its blocks then run at
// the same time: the additions are atomic, so none is lost. Where rows are distinct (an expert's
// rows) each element gets one addition and the result is that of a plain +=.
__global__ void ScaleAddRowsKernel(const float* x, int64_t dim, const int32_t* rows,
                                   const float* weight, float* y) {
  const int64_t i = blockIdx.x;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    atomicAdd(y + rows[i] * dim + d, weight[i] * x[i * dim + d]);
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
    default:
      return QuantEmbed(t, ids, n, vocab_begin, vocab_end, out);
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

absl::Status SwiGluClamped(float* a, const float* b, int64_t n, float alpha, float limit) {
  if (n == 0) return absl::OkStatus();
  SwiGluClampedKernel<<<Grid(n), 256>>>(a, b, n, alpha, limit);
  return Check(cudaGetLastError(), "SwiGluClamped launch");
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
  // Without `add` the kernels only read x.
  return LaunchRmsNorm(const_cast<float*>(x), nullptr, M, dim, w, eps, out);
}

absl::Status AddRmsNorm(float* x, const float* y, int64_t M, int64_t dim, const float* w, float eps,
                        float* out) {
  return LaunchRmsNorm(x, y, M, dim, w, eps, out);
}

}  // namespace shardserve::cuda
