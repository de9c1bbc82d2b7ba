#include "model/mxfp4.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardserve {

float Mxfp4Value(uint8_t code) {
  static constexpr float kValues[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                        -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  return kValues[code & 0x0F];
}

namespace {

// One block of 32 values into `out` (the block's first value): `code(k)` is value k's E2M1 code,
// `exp` the block's E8M0 scale. Errors name the tensor of the scales and of the values.
template <typename Code>
absl::Status ExpandBlock(Code code, uint8_t exp, DType to, uint8_t* out,
                         const std::string& scale_name, const std::string& name, int64_t row,
                         int64_t block) {
  if (exp == 0xFF) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", scale_name, "': the scale of row ",
                                                   row, ", block ", block,
                                                   " is 255, E8M0's NaN, not a power of two"));
  }
  const float scale = std::ldexp(1.0f, static_cast<int>(exp) - 127);
  for (int64_t k = 0; k < kMxfp4Block; ++k) {
    const float v = Mxfp4Value(code(k)) * scale;
    const uint16_t h = to == DType::kF16 ? F32ToF16(v) : F32ToBf16(v);
    if (!std::isfinite(v) ||
        (to != DType::kF32 && !std::isfinite(to == DType::kF16 ? F16ToF32(h) : Bf16ToF32(h)))) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': row ", row, ", column ",
                                                     block * kMxfp4Block + k, " is past ",
                                                     DTypeName(to), "'s range"));
    }
    switch (to) {
      case DType::kF32:
        std::memcpy(out + 4 * k, &v, 4);
        break;
      case DType::kF16:
      case DType::kBF16:
        std::memcpy(out + 2 * k, &h, 2);
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("MXFP4 expands into F32, F16 or BF16, not ", DTypeName(to)));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ExpandMxfp4Row(const TensorView& blocks, const TensorView& scales, int64_t row,
                            int64_t cols, DType to, uint8_t* out) {
  const int64_t groups = cols / kMxfp4Block;
  const uint8_t* codes = static_cast<const uint8_t*>(blocks.data) + row * groups * 16;
  const uint8_t* exps = static_cast<const uint8_t*>(scales.data) + row * groups;
  const size_t block_bytes = kMxfp4Block * DTypeSize(to);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* b = codes + g * 16;
    auto code = [b](int64_t k) -> uint8_t { return k % 2 == 0 ? b[k / 2] : b[k / 2] >> 4; };
    RETURN_IF_ERROR(
        ExpandBlock(code, exps[g], to, out + g * block_bytes, scales.name, blocks.name, row, g));
  }
  return absl::OkStatus();
}

absl::Status ExpandGgmlMxfp4(const TensorView& t, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                             DType to, uint8_t* out) {
  const int64_t cols = t.shape[1];
  const size_t row_bytes = DTypeBytes(DType::kMXFP4, cols),
               block_bytes = kMxfp4Block * DTypeSize(to);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = static_cast<const uint8_t*>(t.data) + r * row_bytes;
    for (int64_t g = c0 / kMxfp4Block; g < c1 / kMxfp4Block; ++g) {
      const uint8_t* b = row + g * DTypeBlockBytes(DType::kMXFP4);
      auto code = [b](int64_t k) -> uint8_t { return k < 16 ? b[1 + k] : b[1 + k - 16] >> 4; };
      uint8_t* o = out + ((r - r0) * (c1 - c0) / kMxfp4Block + g - c0 / kMxfp4Block) * block_bytes;
      RETURN_IF_ERROR(ExpandBlock(code, b[0], to, o, t.name, t.name, r, g));
    }
  }
  return absl::OkStatus();
}

}  // namespace shardserve
