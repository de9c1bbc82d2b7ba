#include "model/mxfp4.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace shardserve {

float Mxfp4Value(uint8_t code) {
  static constexpr float kValues[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                        -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  return kValues[code & 0x0F];
}

absl::Status ExpandMxfp4Row(const TensorView& blocks, const TensorView& scales, int64_t row,
                            int64_t cols, DType to, uint8_t* out) {
  const int64_t groups = cols / kMxfp4Block;
  const uint8_t* codes = static_cast<const uint8_t*>(blocks.data) + row * groups * 16;
  const uint8_t* exps = static_cast<const uint8_t*>(scales.data) + row * groups;
  for (int64_t g = 0; g < groups; ++g) {
    if (exps[g] == 0xFF) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", scales.name,
                                                     "': the scale of row ", row, ", block ", g,
                                                     " is 255, E8M0's NaN, not a power of two"));
    }
    const float scale = std::ldexp(1.0f, static_cast<int>(exps[g]) - 127);
    for (int64_t k = 0; k < kMxfp4Block; ++k) {
      const uint8_t byte = codes[g * 16 + k / 2];
      const float v = Mxfp4Value(k % 2 == 0 ? byte : byte >> 4) * scale;
      const int64_t c = g * kMxfp4Block + k;
      const uint16_t h = to == DType::kF16 ? F32ToF16(v) : F32ToBf16(v);
      if (!std::isfinite(v) ||
          (to != DType::kF32 && !std::isfinite(to == DType::kF16 ? F16ToF32(h) : Bf16ToF32(h)))) {
        return absl::InvalidArgumentError(absl::StrCat("tensor '", blocks.name, "': row ", row,
                                                       ", column ", c, " is past ", DTypeName(to),
                                                       "'s range"));
      }
      switch (to) {
        case DType::kF32:
          std::memcpy(out + 4 * c, &v, 4);
          break;
        case DType::kF16:
        case DType::kBF16:
          std::memcpy(out + 2 * c, &h, 2);
          break;
        default:
          return absl::InvalidArgumentError(
              absl::StrCat("MXFP4 expands into F32, F16 or BF16, not ", DTypeName(to)));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace shardserve
