// The CUDA backend: the context, device memory and copies.
#include "backend/cuda/common.cuh"

// The runtime exports the profiler range; the CUDA wheels ship no cuda_profiler_api.h.
#if __has_include(<cuda_profiler_api.h>)
#include <cuda_profiler_api.h>
#else
extern "C" cudaError_t cudaProfilerStart();
extern "C" cudaError_t cudaProfilerStop();
#endif

namespace shardserve::cuda {

Context::Context(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Context::~Context() {
  if (impl_->blas != nullptr) cublasDestroy(impl_->blas);
  if (impl_->scratch != nullptr) cudaFree(impl_->scratch);
}

absl::StatusOr<std::unique_ptr<Context>> Context::Create(int device, KernelChoice kernels) {
  RETURN_IF_CUDA(cudaSetDevice(device), "cudaSetDevice");
  auto impl = std::make_unique<Impl>();
  impl->device = device;
  impl->kernels = kernels;
  if (cublasStatus_t st = cublasCreate(&impl->blas); st != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrCat("cublasCreate: ", cublasGetStatusString(st)));
  }
  return std::unique_ptr<Context>(new Context(std::move(impl)));
}

const KernelChoice& Context::kernels() const { return impl_->kernels; }

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

absl::Status ProfilerRange(bool start) {
  return start ? Check(cudaProfilerStart(), "cudaProfilerStart")
               : Check(cudaProfilerStop(), "cudaProfilerStop");
}

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

absl::Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                    size_t height) {
  if (width == 0 || height == 0) return absl::OkStatus();
  return Check(cudaMemcpy2D(dst, dst_pitch, src, src_pitch, width, height, cudaMemcpyDefault),
               "cudaMemcpy2D");
}

}  // namespace shardserve::cuda
