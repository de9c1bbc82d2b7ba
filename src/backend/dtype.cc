#include "backend/dtype.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace shardserve {

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kQ8_0:
      return "Q8_0";
    case DType::kQ4_0:
      return "Q4_0";
    case DType::kQ4_1:
      return "Q4_1";
    case DType::kQ4_K:
      return "Q4_K";
    case DType::kQ5_K:
      return "Q5_K";
    case DType::kQ6_K:
      return "Q6_K";
    case DType::kQ4_KX:
      return "Q4_KX";
    case DType::kQ6_KX:
      return "Q6_KX";
    case DType::kQ4_1X:
      return "Q4_1X";
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  if (name == "F32") return DType::kF32;
  if (name == "F16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported dtype '", std::string(name), "' (supported: F32, F16, BF16)"));
}

uint16_t F32ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Through the compiler's _Float16 (IEEE binary16, round to nearest even): this file is built
// for the baseline ISA, the kernels convert with F16C themselves.
float F16ToF32(uint16_t v) {
  _Float16 h;
  std::memcpy(&h, &v, 2);
  return static_cast<float>(h);
}
uint16_t F32ToF16(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t v;
  std::memcpy(&v, &h, 2);
  return v;
}

}  // namespace shardserve
