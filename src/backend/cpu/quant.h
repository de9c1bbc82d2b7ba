#pragma once
// Block-quantized weights on the CPU (internal to backend/cpu; kernels.h is the interface).
#include <cstdint>
#include <functional>

#include "backend/backend.h"
#include "common/thread_pool.h"

namespace shardserve::cpu {

// The first n values (a multiple of the block) of a quantized row as F32.
void Dequantize(DType dtype, const void* row, int64_t n, float* out);

// MatMul for a quantized w (kernels.h's contract). Up to 12 tokens each block is expanded once
// (in registers; a K-quant super-block to a buffer) for all of them; more tokens run `gemm_f32`
// (one thread's F32 GEMM over a row range) on groups of rows expanded to F32.
void MatMulQuantized(const WeightMatrix& w, const float* x, int64_t M, int64_t ldx, float* y,
                     int64_t ldy, ThreadPool& pool,
                     const std::function<void(const WeightMatrix&, const float*, int64_t, int64_t,
                                              float*, int64_t)>& gemm_f32);

}  // namespace shardserve::cpu
