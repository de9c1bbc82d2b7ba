#pragma once
// Element types of weights as stored in safetensors and GGUF files. Activations are always F32.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"

namespace shardserve {

// F32, F16, BF16 (safetensors, GGUF) and the block-quantized ggml types of GGUF files: blocks of
// 32 values with an F16 scale, Q8_0 (int8 values), Q4_0 (4-bit, offset 8), Q4_1 (4-bit with an
// F16 minimum); and the K-quants, super-blocks of 256 values in sub-blocks with their own
// quantized scales: Q4_K and Q5_K (8 x 32, 6-bit scales and minimums), Q6_K (16 x 16, int8
// scales). kQ4_KX, kQ4_1X and kQ6_KX are no file's: Q4_K, Q4_1 and Q6_K as the CPU backend keeps
// them, the quants of 8 blocks transposed for its decode kernel (backend/cpu/quant.h, RepackQ4K,
// RepackQ4_1 and RepackQ6K; Q4_KX with its scales and minimums a byte each).
// kF8E4M3 is the FP8 of fine-grained FP8 checkpoints (safetensors F8_E4M3: 1 sign, 4 exponent,
// 3 mantissa bits, no infinities): stored with a scale per block in a tensor beside it, it reaches
// no kernel; the model repacks each rank's slice into kF8_128, or where its blocks do not allow
// that expands it into the model's dtype at load (model/fp8.h).
// kF8_128 is no file's: FP8 as the backends compute with it, rows in blocks of 128 values, each
// an F32 scale and then 128 E4M3 bytes (value = scale * e4m3). An FP8 checkpoint whose scale
// blocks are 128 columns wide or wider (or one scale per tensor) is repacked into it at load
// (model/fp8.h, PackFp8): the weights stay one byte a value, plus 3 %.
// kU8 is raw bytes (safetensors U8): MXFP4's packed values and E8M0 scales, which the model
// likewise expands at load (model/mxfp4.h). kMXFP4 is the same format as ggml stores it in GGUF
// files (blocks of 32 values: an E8M0 byte, then 16 bytes of E2M1 codes), expanded alike.
enum class DType {
  kF32,
  kF16,
  kBF16,
  kQ8_0,
  kQ4_0,
  kQ4_1,
  kQ4_K,
  kQ5_K,
  kQ6_K,
  kQ4_KX,
  kQ4_1X,
  kQ6_KX,
  kF8E4M3,
  kF8_128,
  kU8,
  kMXFP4,
  // The CPU backend's layout of BF16 at KernelLevel::kAvx512Bf16 (cpu/kernels.h: RepackBf16Pairs):
  // 2 bytes a value, rows in groups of 16 whose pairs of values lie side by side.
  kBF16X
};

// Values per block (1 for the element types) and the bytes of one block.
constexpr int64_t DTypeBlock(DType t) {
  switch (t) {
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16:
    case DType::kBF16X:
    case DType::kF8E4M3:
    case DType::kU8:
      return 1;
    case DType::kQ8_0:
    case DType::kQ4_0:
    case DType::kQ4_1:
    case DType::kQ4_1X:
    case DType::kMXFP4:
      return 32;
    case DType::kF8_128:
      return 128;
    case DType::kQ4_K:
    case DType::kQ5_K:
    case DType::kQ6_K:
    case DType::kQ4_KX:
    case DType::kQ6_KX:
      return 256;
  }
  return 1;
}
constexpr size_t DTypeBlockBytes(DType t) {
  switch (t) {
    case DType::kF32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
    case DType::kBF16X:
      return 2;
    case DType::kF8E4M3:
    case DType::kU8:
      return 1;
    case DType::kQ8_0:
      return 34;  // F16 scale, 32 x int8
    case DType::kQ4_0:
      return 18;  // F16 scale, 32 x 4 bits
    case DType::kQ4_1:
    case DType::kQ4_1X:
      return 20;  // F16 scale, F16 minimum, 32 x 4 bits
    case DType::kQ4_K:
      return 144;  // F16 d, dmin; 12 bytes of 6-bit scales and minimums; 256 x 4 bits
    case DType::kQ4_KX:
      return 148;  // F16 d, dmin; 8 scales and 8 minimums, a byte each; 256 x 4 bits
    case DType::kQ5_K:
      return 176;  // as Q4_K, plus 32 bytes of fifth bits
    case DType::kQ6_K:
    case DType::kQ6_KX:
      return 210;  // 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, F16 d
    case DType::kMXFP4:
      return 17;  // E8M0 scale, 32 x 4 bits
    case DType::kF8_128:
      return 132;  // F32 scale, 128 x E4M3
  }
  return 0;
}
// Whether values of t reach no kernel: FP8 and MXFP4 bytes, expanded by the model at load.
constexpr bool IsStorageOnly(DType t) {
  return t == DType::kF8E4M3 || t == DType::kU8 || t == DType::kMXFP4;
}
// The block types the kernels compute with (GGUF's, and kF8_128).
constexpr bool IsQuantized(DType t) { return DTypeBlock(t) > 1 && !IsStorageOnly(t); }
// Bytes of n consecutive values of a row (n a multiple of the block).
inline size_t DTypeBytes(DType t, int64_t n) {
  return static_cast<size_t>(n / DTypeBlock(t)) * DTypeBlockBytes(t);
}
// Bytes of one value of an element type (F32, F16, BF16, F8_E4M3, U8).
inline size_t DTypeSize(DType t) {
  return t == DType::kF32 ? 4 : t == DType::kF8E4M3 || t == DType::kU8 ? 1 : 2;
}
const char* DTypeName(DType t);  // "F32", "F16", "BF16", "Q8_0", ..., "Q6_K" (ggml's names),
                                 // "Q4_KX", "Q4_1X", "Q6_KX", "F8_E4M3", "F8_128", "U8",
                                 // "MXFP4", "BF16X"
// A safetensors dtype (F32, F16, BF16, F8_E4M3, U8).
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
// F16ToF32 inline and exact, for loops of conversions: ARM's half type (one instruction,
// vectorized); elsewhere the exponent and mantissa moved under F32's and rebased by 2^112 in one
// multiply (subnormals included), infinities and NaNs rebuilt, the sign put back.
inline float HalfToF32(uint16_t v) {
#if defined(__aarch64__) && !defined(__CUDACC__)
  __fp16 h;
  __builtin_memcpy(&h, &v, 2);
  return static_cast<float>(h);
#else
  const uint32_t magnitude = (static_cast<uint32_t>(v) & 0x7fffu) << 13;
  float f;
  __builtin_memcpy(&f, &magnitude, 4);
  f *= 0x1p112f;
  uint32_t bits;
  __builtin_memcpy(&bits, &f, 4);
  if ((v & 0x7c00u) == 0x7c00u) bits = 0x7f800000u | magnitude;  // infinity, NaN
  bits |= (static_cast<uint32_t>(v) & 0x8000u) << 16;
  __builtin_memcpy(&f, &bits, 4);
  return f;
#endif
}
// An E4M3 (FN) byte's value: NaN for 0x7F and 0xFF, exact otherwise (|v| <= 448).
float F8E4M3ToF32(uint8_t v);
// The nearest E4M3 value (ties to even), saturated to +-448; NaN to 0x7F.
uint8_t F32ToF8E4M3(float f);

}  // namespace shardserve
