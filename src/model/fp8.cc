#include "model/fp8.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace shardserve {
namespace {

std::array<float, 256> DecodeTable() {
  std::array<float, 256> t{};
  for (int v = 0; v < 256; ++v) t[v] = F8E4M3ToF32(static_cast<uint8_t>(v));
  return t;
}

float ScaleAt(const TensorView& s, int64_t i) {
  if (s.dtype == DType::kF32) {
    float f;
    std::memcpy(&f, static_cast<const uint8_t*>(s.data) + 4 * i, 4);
    return f;
  }
  uint16_t b;
  std::memcpy(&b, static_cast<const uint8_t*>(s.data) + 2 * i, 2);
  return Bf16ToF32(b);
}

}  // namespace

absl::Status ExpandFp8(const TensorView& w, const Fp8Blocks& blocks, int64_t r0, int64_t r1,
                       int64_t c0, int64_t c1, DType to, uint8_t* out) {
  static const std::array<float, 256> kValue = DecodeTable();
  const TensorView* s = w.scale;
  if (w.dtype != DType::kF8E4M3 || w.shape.size() != 2 || s == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", w.name, "' is not an F8_E4M3 matrix with its scales"));
  }
  const int64_t rows = w.shape[0], cols = w.shape[1];
  const int64_t grid_rows = (rows + blocks.rows - 1) / blocks.rows;
  const int64_t grid_cols = (cols + blocks.cols - 1) / blocks.cols;
  if (s->shape != std::vector<int64_t>{grid_rows, grid_cols}) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", s->name, "' has shape ", s->ShapeString(), "; the ", w.ShapeString(),
        " weight in blocks of ", blocks.rows, "x", blocks.cols,
        " (quantization_config.weight_block_size) needs [", grid_rows, ",", grid_cols, "]"));
  }
  if (to != DType::kF32 && to != DType::kF16 && to != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("FP8 weights expand into F32, F16 or BF16, not ", DTypeName(to)));
  }
  const int64_t width = c1 - c0;
  const size_t elem = DTypeSize(to);
  const auto* q = static_cast<const uint8_t*>(w.data);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = q + r * cols;
    uint8_t* dst = out + (r - r0) * width * elem;
    for (int64_t c = c0; c < c1;) {
      const int64_t block = c / blocks.cols, block_end = std::min(c1, (block + 1) * blocks.cols);
      const float scale = ScaleAt(*s, (r / blocks.rows) * grid_cols + block);
      if (!std::isfinite(scale)) {
        return absl::DataLossError(absl::StrCat("tensor '", s->name, "' holds a scale that is not ",
                                                "finite (for row ", r, ", column ", c,
                                                " of the weight)"));
      }
      for (; c < block_end; ++c) {
        const float value = kValue[row[c]];
        if (std::isnan(value)) {
          return absl::DataLossError(absl::StrCat("tensor '", w.name, "' holds a NaN (E4M3 0x",
                                                  absl::Hex(row[c]), ") at row ", r, ", column ",
                                                  c));
        }
        const float v = value * scale;
        uint8_t* p = dst + (c - c0) * elem;
        if (to == DType::kF32) {
          std::memcpy(p, &v, 4);
        } else {
          const uint16_t h = to == DType::kBF16 ? F32ToBf16(v) : F32ToF16(v);
          std::memcpy(p, &h, 2);
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace shardserve
