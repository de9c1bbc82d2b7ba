#pragma once
// Fine-grained FP8 checkpoints (Hugging Face's `quantization_config.quant_method: fp8`, as
// DeepSeek-V3 and the -FP8 releases ship them): each linear weight is F8_E4M3 with, beside it,
// `<name>_scale_inv`, one F32 (or BF16) scale per block of weight_block_size rows x columns
// (128 x 128; the last blocks of a dimension the block does not divide are partial). No backend
// computes in FP8 yet, so each rank expands its own slice of such a weight into the model's
// dtype at load: the value times its block's scale in F32, rounded once into the dtype — what
// transformers' dequantization (`dequantize=True`) gives, bit for bit.
#include <cstdint>

#include "absl/status/status.h"
#include "backend/dtype.h"
#include "model/safetensors.h"

namespace shardserve {

struct Fp8Blocks {
  int64_t rows = 128, cols = 128;
};

// Rows [r0, r1) x columns [c0, c1) of the F8_E4M3 weight `w` (whose `scale` WeightStore found)
// into `out` (row-major, (r1 - r0) x (c1 - c0) values of `to`: F32, F16 or BF16). Errors name the
// tensor: a scale grid other than the blocks give, a NaN (E4M3 0x7F, 0xFF) or a scale that is not
// finite.
absl::Status ExpandFp8(const TensorView& w, const Fp8Blocks& blocks, int64_t r0, int64_t r1,
                       int64_t c0, int64_t c1, DType to, uint8_t* out);

}  // namespace shardserve
