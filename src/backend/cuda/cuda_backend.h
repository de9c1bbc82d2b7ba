#pragma once
// The CUDA backend (built with SHARDSERVE_CUDA). This header exposes no CUDA types: device memory
// is an opaque pointer owned by DeviceBuffer. Kernels take device pointers and run on the current
// device's default stream; they return after the work is queued (Synchronize() waits).
#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "model/dtype.h"

namespace shardserve::cuda {

// Number of usable GPUs; 0 when there is no GPU or no driver.
int DeviceCount();
absl::Status Synchronize();

class DeviceBuffer {
 public:
  static absl::StatusOr<DeviceBuffer> Alloc(size_t bytes);
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  absl::Status CopyFromHost(const void* src, size_t bytes);
  absl::Status CopyToHost(void* dst, size_t bytes) const;
  void* data() const { return ptr_; }
  size_t size() const { return size_; }

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

// RMSNorm of M rows of dim floats: out = x / rms(x) * w (all device pointers, F32).
absl::Status RmsNorm(const float* x, int64_t M, int64_t dim, const float* w, float eps, float* out);
// y[r] = sum_k w[r][k] * x[k] for a row-major [rows][cols] weight of `dtype`, F32 accumulate.
absl::Status MatVec(DType dtype, const void* w, int64_t rows, int64_t cols, const float* x,
                    float* y);

}  // namespace shardserve::cuda
