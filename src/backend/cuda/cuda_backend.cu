#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "backend/cuda/cuda_backend.h"

namespace shardserve::cuda {
namespace {

absl::Status Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

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

}  // namespace

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device / no driver" error
    return 0;
  }
  return n;
}

absl::Status Synchronize() { return Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

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
