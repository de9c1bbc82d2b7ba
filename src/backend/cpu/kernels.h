#pragma once
// CPU reference kernels (AVX2 + FMA + F16C). Activations are F32; weights stay in their file
// dtype (F32, F16, BF16) and are converted inside the kernels, accumulating in F32.
#include <cstdint>

#include "common/thread_pool.h"
#include "model/dtype.h"

namespace shardserve::cpu {

// A row-major weight matrix [rows][cols] (Hugging Face [out_features][in_features]) inside a
// mapped file, possibly a slice: row r starts at data + r * row_stride elements.
struct WeightMatrix {
  DType dtype = DType::kF32;
  const void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;
};

// y[m][n] = sum_k w[n][k] * x[m][k] for m < M, n < w.rows. x has row stride ldx, y has ldy.
// Splits output rows across the pool. M <= 12 (decode batches) streams the weights once, blocks
// of rows staying in L2 for groups of 3 tokens, and each token's result is independent of the
// batch; larger M packs weight panels to F32 and runs a register-blocked GEMM micro-kernel.
void MatMul(const WeightMatrix& w, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy,
            ThreadPool& pool);

// out[i] = float(w[i]) for i < n (a vector of any dtype, e.g. a norm weight or an embedding row).
void ToFloat(DType dtype, const void* data, int64_t n, float* out);

// RMSNorm of each of the M rows of x (dim elements, stride dim): out = x / rms(x) * weight.
void RmsNorm(const float* x, int64_t M, int64_t dim, const float* weight, float eps, float* out);

// a[i] = silu(a[i]) * b[i], split across the pool.
void SiluMul(float* a, const float* b, int64_t n, ThreadPool& pool);

float Dot(const float* a, const float* b, int64_t n);

// Causal scaled-dot-product attention of one query head (hd floats) over positions [0, len):
// the key of position p is at k_blocks[p / block_size] + (p % block_size) * hd, the value
// likewise in v_blocks. Writes softmax(q·K^T · scale) · V to out; `scores` holds len floats.
void AttendHead(const float* q, const float* const* k_blocks, const float* const* v_blocks,
                int64_t block_size, int64_t hd, int64_t len, float scale, float* scores,
                float* out);
// y[i] += alpha * x[i]
void Axpy(float alpha, const float* x, float* y, int64_t n);

}  // namespace shardserve::cpu
