#include "model/fp8.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardserve {
namespace {

std::array<float, 256> DecodeTable() {
  std::array<float, 256> t{};
  for (int v = 0; v < 256; ++v) t[v] = F8E4M3ToF32(static_cast<uint8_t>(v));
  return t;
}
const std::array<float, 256>& Values() {
  static const std::array<float, 256> kValue = DecodeTable();
  return kValue;
}

// The scales of an FP8 weight, its grid checked against the blocks.
class Scales {
 public:
  static absl::StatusOr<Scales> Of(const TensorView& w, const Fp8Blocks& blocks) {
    const TensorView* s = w.scale;
    if (w.dtype != DType::kF8E4M3 || w.shape.size() != 2 || s == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", w.name, "' is not an F8_E4M3 matrix with its scales"));
    }
    if (blocks.per_tensor()) {
      if (s->numel() != 1 || s->shape.size() > 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor '", s->name, "' has shape ", s->ShapeString(),
                         "; with one scale per tensor (quantization_config.weight_block_size "
                         "null) it is [] or [1]"));
      }
      return Scales(s, blocks, 1);
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
    return Scales(s, blocks, grid_cols);
  }

  // The scale of row r, column c, checked finite.
  absl::StatusOr<float> At(int64_t r, int64_t c) const {
    const int64_t i = blocks_.per_tensor() ? 0 : (r / blocks_.rows) * grid_cols_ + c / blocks_.cols;
    float f;
    if (s_->dtype == DType::kF32) {
      std::memcpy(&f, static_cast<const uint8_t*>(s_->data) + 4 * i, 4);
    } else {
      uint16_t b;
      std::memcpy(&b, static_cast<const uint8_t*>(s_->data) + 2 * i, 2);
      f = Bf16ToF32(b);
    }
    if (!std::isfinite(f)) {
      return absl::DataLossError(absl::StrCat("tensor '", s_->name, "' holds a scale that is not ",
                                              "finite (for row ", r, ", column ", c,
                                              " of the weight)"));
    }
    return f;
  }
  // Columns [c, end) of row r lie under one scale, end <= limit.
  int64_t BlockEnd(int64_t c, int64_t limit) const {
    if (blocks_.per_tensor()) return limit;
    return std::min(limit, (c / blocks_.cols + 1) * blocks_.cols);
  }

 private:
  Scales(const TensorView* s, const Fp8Blocks& blocks, int64_t grid_cols)
      : s_(s), blocks_(blocks), grid_cols_(grid_cols) {}
  const TensorView* s_;
  Fp8Blocks blocks_;
  int64_t grid_cols_;
};

absl::Status NaNAt(const TensorView& w, int64_t r, int64_t c, uint8_t byte) {
  return absl::DataLossError(absl::StrCat("tensor '", w.name, "' holds a NaN (E4M3 0x",
                                          absl::Hex(byte), ") at row ", r, ", column ", c));
}

}  // namespace

bool Fp8Packs(const Fp8Blocks& blocks, int64_t c0, int64_t c1) {
  if (c0 % kFp8Group != 0 || (c1 - c0) % kFp8Group != 0) return false;
  return blocks.per_tensor() || blocks.cols % kFp8Group == 0;
}

absl::Status ExpandFp8(const TensorView& w, const Fp8Blocks& blocks, int64_t r0, int64_t r1,
                       int64_t c0, int64_t c1, DType to, uint8_t* out) {
  const std::array<float, 256>& value_of = Values();
  ASSIGN_OR_RETURN(const Scales scales, Scales::Of(w, blocks));
  if (to != DType::kF32 && to != DType::kF16 && to != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("FP8 weights expand into F32, F16 or BF16, not ", DTypeName(to)));
  }
  const int64_t cols = w.shape[1], width = c1 - c0;
  const size_t elem = DTypeSize(to);
  const auto* q = static_cast<const uint8_t*>(w.data);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = q + r * cols;
    uint8_t* dst = out + (r - r0) * width * elem;
    for (int64_t c = c0; c < c1;) {
      const int64_t block_end = scales.BlockEnd(c, c1);
      ASSIGN_OR_RETURN(const float scale, scales.At(r, c));
      for (; c < block_end; ++c) {
        const float value = value_of[row[c]];
        if (std::isnan(value)) return NaNAt(w, r, c, row[c]);
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

absl::Status PackFp8(const TensorView& w, const Fp8Blocks& blocks, int64_t r0, int64_t r1,
                     int64_t c0, int64_t c1, uint8_t* out) {
  ASSIGN_OR_RETURN(const Scales scales, Scales::Of(w, blocks));
  if (!Fp8Packs(blocks, c0, c1)) {
    return absl::InvalidArgumentError(absl::StrCat("columns [", c0, ", ", c1, ") of tensor '",
                                                   w.name, "' do not fall in groups of ", kFp8Group,
                                                   " under one scale each"));
  }
  const int64_t cols = w.shape[1];
  const size_t row_bytes = DTypeBytes(DType::kF8_128, c1 - c0);
  const auto* q = static_cast<const uint8_t*>(w.data);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = q + r * cols;
    uint8_t* dst = out + (r - r0) * row_bytes;
    for (int64_t c = c0; c < c1; c += kFp8Group, dst += DTypeBlockBytes(DType::kF8_128)) {
      ASSIGN_OR_RETURN(const float scale, scales.At(r, c));
      // The kernels multiply by scale x 256 (an E4M3 byte read as F16 is its value x 2^-8).
      if (!std::isfinite(scale * 256.0f)) {
        return absl::OutOfRangeError(absl::StrCat(
            "tensor '", w.name, "' has a scale of ", scale, " (for row ", r, ", column ", c,
            "): FP8 computes with scales of magnitude up to 1.3e36 (SHARDSERVE_FP8=expand "
            "expands it instead)"));
      }
      for (int64_t i = c; i < c + kFp8Group; ++i) {
        // E4M3's NaNs: 0x7F and 0xFF.
        if ((row[i] & 0x7F) == 0x7F) return NaNAt(w, r, i, row[i]);
      }
      std::memcpy(dst, &scale, 4);
      std::memcpy(dst + 4, row + c, kFp8Group);
    }
  }
  return absl::OkStatus();
}

}  // namespace shardserve
