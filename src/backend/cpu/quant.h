#pragma once
// Block-quantized weights on the CPU, and what the kernels share (internal to backend/cpu;
// kernels.h is the interface).
#include <immintrin.h>

#include <cstdint>

#include "backend/backend.h"
#include "common/thread_pool.h"

namespace shardserve::cpu {

// The sum of a vector's 8 floats.
inline float HSum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

// The first byte of row r of w (any dtype).
inline const uint8_t* RowPtr(const WeightMatrix& w, int64_t r) {
  return static_cast<const uint8_t*>(w.data) + DTypeBytes(w.dtype, r * w.row_stride);
}

// The first n values (a multiple of the block) of a quantized row as F32.
void Dequantize(DType dtype, const void* row, int64_t n, float* out);

// Up to this many tokens (decode batches) MatMul streams the weights once for all of them, each
// token's result independent of the batch (MatVecQuantized for quantized weights); beyond it the
// packed GEMM is faster (quantized weights expanded to its F32 panels by Dequantize).
constexpr int64_t kDecodeMaxTokens = 12;

// MatMul (kernels.h's contract) for a quantized w and M <= kDecodeMaxTokens tokens: the
// activations quantized per block of 32 to int16, integer dot products with each block unpacked
// once for all tokens (quant.cc states the accuracy).
void MatVecQuantized(const WeightMatrix& w, const float* x, int64_t M, int64_t ldx, float* y,
                     int64_t ldy, ThreadPool& pool);

}  // namespace shardserve::cpu
