#pragma once
// MXFP4 (the OCP microscaling FP4 format) as gpt-oss checkpoints store their experts, which
// Hugging Face's `quantization_config` names `quant_method: mxfp4`: each [out][in] matrix as
// `_blocks` (U8 [..., out, in / 32, 16]: 32 E2M1 codes a block, two a byte, the low nibble first)
// and `_scales` (U8 [..., out, in / 32]: an E8M0 exponent a block, 2^(s - 127)). No backend
// computes in FP4 yet: each rank expands its experts' rows into the model's dtype at load, the
// code's value times its block's power of two, which is exact (what transformers' dequantization
// gives).
#include <cstdint>

#include "absl/status/status.h"
#include "backend/dtype.h"
#include "model/safetensors.h"

namespace shardserve {

inline constexpr int64_t kMxfp4Block = 32;  // values that share a scale

// The value of an E2M1 code (the low 4 bits of `code`): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives.
float Mxfp4Value(uint8_t code);

// Row `row` of the matrices `blocks` and `scales` hold (rows counted across the leading
// dimensions: expert e's row r is e * out + r), `cols` values, expanded into `to` (F32, F16 or
// BF16) at out. A scale of 255 (E8M0's NaN) or a value past `to`'s range is refused naming the
// tensor; shapes are the caller's to check.
absl::Status ExpandMxfp4Row(const TensorView& blocks, const TensorView& scales, int64_t row,
                            int64_t cols, DType to, uint8_t* out);

}  // namespace shardserve
