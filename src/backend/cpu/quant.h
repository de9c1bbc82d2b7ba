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

// Whether MatVecQuantized takes M tokens (decode batches); larger M expand the weights to F32
// panels for the GEMM (Dequantize).
bool DecodesQuantized(int64_t M);
// MatMul (kernels.h's contract) for a quantized w and M tokens with DecodesQuantized(M): the
// activations quantized per block of 32 to int8, integer dot products with each block unpacked
// once for all tokens (quant.cc states the accuracy).
void MatVecQuantized(const WeightMatrix& w, const float* x, int64_t M, int64_t ldx, float* y,
                     int64_t ldy, ThreadPool& pool);

}  // namespace shardserve::cpu
