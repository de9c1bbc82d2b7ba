#pragma once
// Quantized blocks written from floats (GGUF's block types and the backends' FP8 blocks): the GGUF
// converter's and the kernel tests' (no dependency beyond backend/dtype).
#include <cstdint>
#include <string>

#include "backend/dtype.h"

namespace shardserve {

// One row of n values (a multiple of the block) in a quantized type's blocks. Q8_0, Q4_0, Q4_1
// as llama.cpp's reference quantizers make them (Q8_0: scale max|x|/127; Q4_0: scale max/-8 of
// the value of largest magnitude, offset 8; Q4_1: scale (max-min)/15 and the minimum); the
// K-quants in their exact layout with plain rounding (llama.cpp searches for better scales; any
// scales are valid blocks). F8_128 (FP8 as the backends keep it): scale max|x|/448 per 128.
std::string QuantizeRow(DType type, const float* x, int64_t n);

}  // namespace shardserve
