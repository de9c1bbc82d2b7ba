#pragma once
// Fine-grained FP8 checkpoints (Hugging Face's `quantization_config.quant_method: fp8`, as
// DeepSeek-V3 and the -FP8 releases ship them): each linear weight is F8_E4M3 with, beside it,
// `<name>_scale_inv`, one F32 (or BF16) scale per block of weight_block_size rows x columns
// (128 x 128; the last blocks of a dimension the block does not divide are partial), or with
// `weight_block_size: null` one scale for the whole tensor (shape [] or [1]).
// The backends compute with FP8 in their own layout, DType::kF8_128 (rows in blocks of 128
// values, each an F32 scale and 128 E4M3 bytes): a rank repacks its slice into it (PackFp8) when
// every 128 columns of the slice share a scale — blocks 128 or more columns wide that 128
// divides, or a scale per tensor; the values are then exactly value x scale in F32. Any other
// slice is expanded into the model's dtype (ExpandFp8): the value times its block's scale in
// F32, rounded once into the dtype — what transformers' dequantization (`dequantize=True`)
// gives, bit for bit.
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backend/dtype.h"
#include "model/safetensors.h"

namespace shardserve {

struct Fp8Blocks {
  int64_t rows = 128, cols = 128;  // 0 x 0: one scale for the whole tensor
  bool per_tensor() const { return rows == 0 || cols == 0; }
};

// The values of one block of DType::kF8_128.
inline constexpr int64_t kFp8Group = DTypeBlock(DType::kF8_128);

// Whether columns [c0, c1) of an FP8 weight in `blocks` repack into DType::kF8_128: each 128 of
// them (from c0) under one scale.
bool Fp8Packs(const Fp8Blocks& blocks, int64_t c0, int64_t c1);

// Rows [r0, r1) x columns [c0, c1) of the F8_E4M3 weight `w` (whose `scale` WeightStore found)
// into `out` (row-major, (r1 - r0) x (c1 - c0) values of `to`: F32, F16 or BF16). Errors name the
// tensor: a scale grid other than the blocks give, a NaN (E4M3 0x7F, 0xFF) or a scale that is not
// finite.
absl::Status ExpandFp8(const TensorView& w, const Fp8Blocks& blocks, int64_t r0, int64_t r1,
                       int64_t c0, int64_t c1, DType to, uint8_t* out);
// The same slice (Fp8Packs true) as DType::kF8_128 rows into `out` ((r1 - r0) rows of
// DTypeBytes(kF8_128, c1 - c0) bytes), checked as ExpandFp8 checks; a scale whose magnitude
// times 256 is not finite (past 1.3e36) is refused by name.
absl::Status PackFp8(const TensorView& w, const Fp8Blocks& blocks, int64_t r0, int64_t r1,
                     int64_t c0, int64_t c1, uint8_t* out);

}  // namespace shardserve
