#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <climits>

#include "absl/strings/str_cat.h"
#include "backend/cuda/cuda_backend.h"
#include "common/status.h"

namespace shardserve::cuda {
namespace {

absl::Status Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

#define RETURN_IF_CUDA(expr, what)                                  \
  do {                                                              \
    if (absl::Status s_ = Check((expr), what); !s_.ok()) return s_; \
  } while (0)

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
__device__ float ToF32(T v);
template <>
__device__ float ToF32(float v) {
  return v;
}
template <>
__device__ float ToF32(__half v) {
  return __half2float(v);
}
template <>
__device__ float ToF32(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

// One warp per output row.
template <typename T>
__global__ void MatVecKernel(const T* w, int64_t rows, int64_t cols, const float* x, float* y) {
  const int64_t row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const T* wr = w + row * cols;
  float s = 0;
  for (int64_t k = threadIdx.x % 32; k < cols; k += 32) s += ToF32(wr[k]) * x[k];
  for (int off = 16; off > 0; off /= 2) s += __shfl_down_sync(0xffffffff, s, off);
  if (threadIdx.x % 32 == 0) y[row] = s;
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

template <typename T>
__device__ T FromF32(float v);
template <>
__device__ __half FromF32(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __nv_bfloat16 FromF32(float v) {
  return __float2bfloat16_rn(v);
}

template <typename T>
__global__ void ConvertKernel(const float* x, int64_t n, T* out) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = FromF32<T>(x[i]);
  }
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

__device__ float BlockMax(float v, float* shared) {
  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_down_sync(0xffffffff, v, off));
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < blockDim.x / 32 ? shared[threadIdx.x] : -FLT_MAX;
    for (int off = 16; off > 0; off /= 2) v = fmaxf(v, __shfl_down_sync(0xffffffff, v, off));
    if (threadIdx.x == 0) shared[0] = v;
  }
  __syncthreads();
  const float out = shared[0];
  __syncthreads();
  return out;
}

__device__ float BlockSum(float v, float* shared) {
  for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffff, v, off);
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < blockDim.x / 32 ? shared[threadIdx.x] : 0.f;
    for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffff, v, off);
    if (threadIdx.x == 0) shared[0] = v;
  }
  __syncthreads();
  const float out = shared[0];
  __syncthreads();
  return out;
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

// One block per row: log-sum-exp, then k rounds of "the largest below the previous pick" (ties
// broken towards the lower id, as the CPU sampler orders them).
__global__ void TopKKernel(const float* logits, int64_t V, int64_t k, int32_t* ids,
                           float* logprobs) {
  __shared__ float shared[32];
  __shared__ float best_v[32];
  __shared__ int32_t best_i[32];
  const float* row = logits + blockIdx.x * V;
  float mx = -FLT_MAX;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) mx = fmaxf(mx, row[i]);
  mx = BlockMax(mx, shared);
  float sum = 0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) sum += expf(row[i] - mx);
  sum = BlockSum(sum, shared);
  const float lse = mx + logf(sum);
  float prev_v = FLT_MAX;
  int32_t prev_i = -1;
  for (int64_t j = 0; j < k; ++j) {
    float bv = -FLT_MAX;
    int32_t bi = INT32_MAX;
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
      const float v = row[i];
      const bool after = v < prev_v || (v == prev_v && i > prev_i);  // not yet picked
      if (after && (v > bv || (v == bv && i < bi))) {
        bv = v;
        bi = static_cast<int32_t>(i);
      }
    }
    for (int off = 16; off > 0; off /= 2) {
      const float ov = __shfl_down_sync(0xffffffff, bv, off);
      const int32_t oi = __shfl_down_sync(0xffffffff, bi, off);
      if (ov > bv || (ov == bv && oi < bi)) {
        bv = ov;
        bi = oi;
      }
    }
    if (threadIdx.x % 32 == 0) {
      best_v[threadIdx.x / 32] = bv;
      best_i[threadIdx.x / 32] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) {
        if (best_v[w] > best_v[0] || (best_v[w] == best_v[0] && best_i[w] < best_i[0])) {
          best_v[0] = best_v[w];
          best_i[0] = best_i[w];
        }
      }
      ids[blockIdx.x * k + j] = best_i[0];
      logprobs[blockIdx.x * k + j] = best_v[0] - lse;
    }
    __syncthreads();
    prev_v = best_v[0];
    prev_i = best_i[0];
    __syncthreads();
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

unsigned Grid(int64_t n, int threads = 256) {
  return static_cast<unsigned>(std::min<int64_t>((n + threads - 1) / threads, 65535));
}

}  // namespace

struct Context::Impl {
  int device = 0;
  cublasHandle_t blas = nullptr;
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
};

Context::Context(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Context::~Context() {
  if (impl_->blas != nullptr) cublasDestroy(impl_->blas);
  if (impl_->scratch != nullptr) cudaFree(impl_->scratch);
}

absl::StatusOr<std::unique_ptr<Context>> Context::Create(int device) {
  RETURN_IF_CUDA(cudaSetDevice(device), "cudaSetDevice");
  auto impl = std::make_unique<Impl>();
  impl->device = device;
  if (cublasStatus_t st = cublasCreate(&impl->blas); st != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrCat("cublasCreate: ", cublasGetStatusString(st)));
  }
  return std::unique_ptr<Context>(new Context(std::move(impl)));
}

absl::StatusOr<void*> Context::Scratch(size_t bytes) {
  if (bytes <= impl_->scratch_bytes) return impl_->scratch;
  if (impl_->scratch != nullptr) cudaFree(impl_->scratch);
  impl_->scratch = nullptr;
  impl_->scratch_bytes = 0;
  if (cudaError_t e = cudaMalloc(&impl_->scratch, bytes); e != cudaSuccess) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cudaMalloc of ", bytes, " scratch bytes: ", cudaGetErrorString(e)));
  }
  impl_->scratch_bytes = bytes;
  return impl_->scratch;
}

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device / no driver" error
    return 0;
  }
  return n;
}

absl::Status Synchronize() { return Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

absl::StatusOr<double> CopyBandwidth(size_t bytes, int reps) {
  ASSIGN_OR_RETURN(DeviceBuffer a, DeviceBuffer::Alloc(bytes));
  ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Alloc(bytes));
  cudaEvent_t start, stop;
  RETURN_IF_CUDA(cudaEventCreate(&start), "cudaEventCreate");
  RETURN_IF_CUDA(cudaEventCreate(&stop), "cudaEventCreate");
  float best_ms = 1e30f;
  for (int i = 0; i < reps + 1; ++i) {  // the first is a warm-up
    RETURN_IF_CUDA(cudaEventRecord(start), "cudaEventRecord");
    RETURN_IF_CUDA(cudaMemcpy(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy");
    RETURN_IF_CUDA(cudaEventRecord(stop), "cudaEventRecord");
    RETURN_IF_CUDA(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    RETURN_IF_CUDA(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    if (i > 0) best_ms = std::min(best_ms, ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return 2.0 * static_cast<double>(bytes) / (best_ms / 1e3);
}

absl::Status Zero(void* p, size_t bytes) { return Check(cudaMemset(p, 0, bytes), "cudaMemset"); }

absl::StatusOr<DeviceBuffer> DeviceBuffer::Alloc(size_t bytes) {
  DeviceBuffer b;
  if (cudaError_t e = cudaMalloc(&b.ptr_, bytes); e != cudaSuccess) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cudaMalloc of ", bytes, " bytes: ", cudaGetErrorString(e)));
  }
  b.size_ = bytes;
  return b;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), size_(o.size_) {
  o.ptr_ = nullptr;
  o.size_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = o.ptr_;
    size_ = o.size_;
    o.ptr_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

absl::Status DeviceBuffer::CopyFromHost(const void* src, size_t bytes) {
  if (bytes > size_) return absl::InvalidArgumentError("copy larger than the device buffer");
  return Check(cudaMemcpy(ptr_, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to device");
}

absl::Status DeviceBuffer::CopyToHost(void* dst, size_t bytes) const {
  if (bytes > size_) return absl::InvalidArgumentError("copy larger than the device buffer");
  return Check(cudaMemcpy(dst, ptr_, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
}

absl::Status Gemm(Context& ctx, const DeviceWeight& w, const float* x, int64_t M, float* y) {
  if (M == 0 || w.rows == 0) return absl::OkStatus();
  const int64_t N = w.rows, K = w.cols;
  const void* b = x;
  cudaDataType_t type = CUDA_R_32F;
  if (w.dtype != DType::kF32) {
    const size_t n = static_cast<size_t>(M * K);
    auto scratch = ctx.Scratch(n * 2);
    if (!scratch.ok()) return scratch.status();
    if (w.dtype == DType::kF16) {
      ConvertKernel<<<Grid(n), 256>>>(x, n, static_cast<__half*>(*scratch));
      type = CUDA_R_16F;
    } else {
      ConvertKernel<<<Grid(n), 256>>>(x, n, static_cast<__nv_bfloat16*>(*scratch));
      type = CUDA_R_16BF;
    }
    RETURN_IF_CUDA(cudaGetLastError(), "Gemm conversion launch");
    b = *scratch;
  }
  // Row-major Y[M][N] = X[M][K] W[N][K]^T is column-major Y^T = op(W) X^T with W read as a
  // column-major K x N matrix (lda = row_stride) transposed.
  const float alpha = 1.f, beta = 0.f;
  const cublasStatus_t st =
      cublasGemmEx(ctx.impl()->blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N),
                   static_cast<int>(M), static_cast<int>(K), &alpha, w.data, type,
                   static_cast<int>(w.row_stride), b, type, static_cast<int>(K), &beta, y,
                   CUDA_R_32F, static_cast<int>(N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (st != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("cublasGemmEx ", M, "x", N, "x", K, ": ", cublasGetStatusString(st)));
  }
  return absl::OkStatus();
}

absl::Status Embed(const DeviceWeight& t, const int32_t* ids, int64_t n, int64_t vocab_begin,
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

absl::Status TopKLogprobs(const float* logits, int64_t rows, int64_t V, int64_t k, int32_t* ids,
                          float* logprobs) {
  if (rows == 0 || k == 0) return absl::OkStatus();
  if (k > V) return absl::InvalidArgumentError(absl::StrCat("top ", k, " of ", V, " logits"));
  TopKKernel<<<static_cast<unsigned>(rows), 256>>>(logits, V, k, ids, logprobs);
  return Check(cudaGetLastError(), "TopKLogprobs launch");
}

absl::Status RmsNorm(const float* x, int64_t M, int64_t dim, const float* w, float eps,
                     float* out) {
  if (M == 0) return absl::OkStatus();
  RmsNormKernel<<<static_cast<unsigned>(M), 256>>>(x, dim, w, eps, out);
  return Check(cudaGetLastError(), "RmsNorm launch");
}

absl::Status MatVec(DType dtype, const void* w, int64_t rows, int64_t cols, const float* x,
                    float* y) {
  if (rows == 0) return absl::OkStatus();
  constexpr int kWarps = 8;
  const unsigned blocks = static_cast<unsigned>((rows + kWarps - 1) / kWarps);
  switch (dtype) {
    case DType::kF32:
      MatVecKernel<<<blocks, kWarps * 32>>>(static_cast<const float*>(w), rows, cols, x, y);
      break;
    case DType::kF16:
      MatVecKernel<<<blocks, kWarps * 32>>>(static_cast<const __half*>(w), rows, cols, x, y);
      break;
    case DType::kBF16:
      MatVecKernel<<<blocks, kWarps * 32>>>(static_cast<const __nv_bfloat16*>(w), rows, cols, x, y);
      break;
  }
  return Check(cudaGetLastError(), "MatVec launch");
}

}  // namespace shardserve::cuda
