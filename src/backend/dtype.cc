#include "backend/dtype.h"

#include <cmath>
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
    case DType::kF8E4M3:
      return "F8_E4M3";
    case DType::kF8_128:
      return "F8_128";
    case DType::kU8:
      return "U8";
    case DType::kMXFP4:
      return "MXFP4";
    case DType::kBF16X:
      return "BF16X";
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  if (name == "F32") return DType::kF32;
  if (name == "F16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  if (name == "F8_E4M3") return DType::kF8E4M3;
  if (name == "U8") return DType::kU8;
  return absl::InvalidArgumentError(absl::StrCat("unsupported dtype '", std::string(name),
                                                 "' (supported: F32, F16, BF16, F8_E4M3, U8)"));
}

float F8E4M3ToF32(uint8_t v) {
  const int exponent = (v >> 3) & 0xF, mantissa = v & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return __builtin_nanf("");
  // Subnormals (exponent 0): mantissa x 2^-9; normals: (8 + mantissa) x 2^(exponent - 10).
  const float magnitude = exponent == 0
                              ? std::ldexp(static_cast<float>(mantissa), -9)
                              : std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
  return (v & 0x80) ? -magnitude : magnitude;
}

uint8_t F32ToF8E4M3(float f) {
  if (std::isnan(f)) return 0x7F;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = std::fabs(f);
  if (a >= 448.0f) return sign | 0x7E;
  int e;
  std::frexp(a, &e);  // a = m x 2^e, m in [0.5, 1): a's leading bit is 2^(e - 1)
  // The spacing of E4M3 values around a: 2^(e - 4) for normals (3 mantissa bits), 2^-9 below 2^-6.
  const int step = std::max(e - 4, -9);
  const float units = std::nearbyint(std::ldexp(a, -step));  // ties to even (default rounding)
  const float value = std::ldexp(units, step);
  // Re-encode the rounded value (rounding may have carried into the next power of two).
  if (value == 0.0f) return sign;
  int e2;
  std::frexp(value, &e2);
  const int exponent = e2 - 1 + 7;  // biased
  if (exponent <= 0) {              // subnormal: value = mantissa x 2^-9
    return sign | static_cast<uint8_t>(std::ldexp(value, 9));
  }
  const int mantissa = static_cast<int>(std::ldexp(value, -(e2 - 1) + 3)) - 8;
  return sign | static_cast<uint8_t>(exponent << 3 | mantissa);
}

uint16_t F32ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float F16ToF32(uint16_t v) { return HalfToF32(v); }

// Through the compiler's half type (IEEE binary16, round to nearest even; ARM: __fp16, which GCC
// 12's C++ has in place of _Float16): this file is built for the baseline ISA, the x86 kernels
// convert with F16C themselves.
#if defined(__aarch64__) || defined(__arm__)
using HalfFloat = __fp16;
#else
using HalfFloat = _Float16;
#endif
uint16_t F32ToF16(float f) {
  const HalfFloat h = static_cast<HalfFloat>(f);
  uint16_t v;
  std::memcpy(&v, &h, 2);
  return v;
}

}  // namespace shardserve
