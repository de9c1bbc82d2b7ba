#pragma once
// Element types of weights as stored in safetensors files. Activations are always F32.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"

namespace shardserve {

enum class DType { kF32, kF16, kBF16 };

inline size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }
const char* DTypeName(DType t);  // "F32", "F16", "BF16" (safetensors spelling)
absl::StatusOr<DType> ParseDType(std::string_view name);

// Scalar conversions (the kernels use vectorized versions of the same).
inline float Bf16ToF32(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}
uint16_t F32ToBf16(float f);  // round to nearest even, NaN preserved
float F16ToF32(uint16_t v);
uint16_t F32ToF16(float f);

}  // namespace shardserve
