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

// The same values as ggml stores them (DType::kMXFP4, GGUF type 39; llama.cpp's converter repacks
// gpt-oss's experts so): a block of 32 is its E8M0 byte, then 16 bytes whose low nibbles are
// values 0-15 and high nibbles values 16-31. Rows [r0, r1) x columns [c0, c1) (whole blocks) of
// the 2-D `t` into `out`, row-major in `to`; errors as above.
absl::Status ExpandGgmlMxfp4(const TensorView& t, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                             DType to, uint8_t* out);

}  // namespace shardserve
