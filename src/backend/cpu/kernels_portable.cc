// The CPU kernels in portable C++ (SHARDSERVE_PORTABLE_KERNELS, cpu_features.h's kPortable): what
// every CPU that is not x86-64 builds (ARM servers and laptops), and what an x86-64 build can
// choose in their place to test them. The float dot products are written in GCC's vector types,
// four lanes at a time with four accumulators, which the compiler turns into the CPU's SIMD (ARM:
// NEON's FMLA); the quantized types multiply integers as the x86 kernels do (quant_portable.cc).
//
// One shape for every batch: each row's values are converted to F32 (or unpacked to integers) 256
// at a time, into L1, and multiplied there with every token's activations, each token's sums kept
// in vectors of its own: a row is read from memory once, and each token's result is the same
// whatever the batch (decode and prefill alike). Attention converts each cached row once for a GQA
// group (kernels_common.cc).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/kernels.h"
#include "backend/cpu/kernels_internal.h"
#include "backend/cpu/quant.h"

namespace shardserve::cpu {
namespace {

using F4 = float __attribute__((vector_size(16)));

inline F4 Load4(const float* p) {
  F4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Adds the products of a[0, n) and b[0, n) to 4 vectors of 4 sums (16 at a time, then 4) and,
// past the last 4, to *tail.
inline void AccumulateDot(F4* acc, const float* a, const float* b, int64_t n, float* tail) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 4; ++j) acc[j] += Load4(a + i + 4 * j) * Load4(b + i + 4 * j);
  }
  for (; i + 4 <= n; i += 4) acc[0] += Load4(a + i) * Load4(b + i);
  for (; i < n; ++i) *tail += a[i] * b[i];
}

// The sum of AccumulateDot's 4 vectors and its tail.
inline float SumDot(const F4* acc, float tail) {
  const F4 s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  return ((s[0] + s[1]) + (s[2] + s[3])) + tail;
}

// Values of a row converted (F16, BF16, FP8 blocks; quantized types: unpacked, quant_portable.cc)
// at a time into L1, where every token's activations meet them: the row is read from memory once.
constexpr int64_t kChunk = 256;
// Rows per piece of work for the pool.
constexpr int64_t kRowBlock = 8;

// Rows [b, e) of a float-dtype w (F32 read in place; F16, BF16, FP8 blocks converted kChunk values
// at a time) against the M tokens of x, each token's products in 4 vectors of 4 sums.
void FloatRows(const WeightMatrix& w, int64_t b, int64_t e, const float* x, int64_t ldx, int64_t M,
               float* y, int64_t ldy) {
  const int64_t K = w.cols;
  thread_local std::vector<F4> acc_storage;
  thread_local std::vector<float> tail_storage;
  acc_storage.resize(4 * M);
  tail_storage.resize(M);
  F4* const acc = acc_storage.data();
  float* const tail = tail_storage.data();
  alignas(16) float converted[kChunk];
  for (int64_t r = b; r < e; ++r) {
    std::fill_n(acc, 4 * M, F4{});
    std::fill_n(tail, M, 0.0f);
    const uint8_t* row = RowPtr(w, r);
    for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
      const int64_t n = std::min(kChunk, K - k0);
      const float* v = reinterpret_cast<const float*>(row) + k0;
      if (w.dtype != DType::kF32) {
        ToFloat(w.dtype, row + DTypeBytes(w.dtype, k0), n, converted);
        v = converted;
      }
      for (int64_t t = 0; t < M; ++t) AccumulateDot(acc + 4 * t, v, x + t * ldx + k0, n, &tail[t]);
    }
    for (int64_t t = 0; t < M; ++t) y[t * ldy + r] = SumDot(acc + 4 * t, tail[t]);
  }
}

}  // namespace

float Dot(const float* a, const float* b, int64_t n) {
  F4 acc[4] = {};
  float tail = 0;
  AccumulateDot(acc, a, b, n, &tail);
  return SumDot(acc, tail);
}

void Axpy(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

void SiluMul(float* a, const float* b, int64_t n, ThreadPool& pool) {
  pool.ParallelFor(n, 4096, [&](int, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float g = a[i];
      a[i] = g / (1.0f + std::exp(-g)) * b[i];
    }
  });
}

float ExpMinusMax(float* scores, int64_t len, float mx) {
  float sum = 0;
  for (int64_t p = 0; p < len; ++p) {
    scores[p] = std::exp(scores[p] - mx);
    sum += scores[p];
  }
  return sum;
}

void AttendGroup(const float* const* q, int64_t G, const KvRows& kv, const void* const* k_blocks,
                 const void* const* v_blocks, int64_t bs, int64_t hd, int64_t begin, int64_t len,
                 float scale, const float* sinks, float* scores, float* const* out) {
  AttendGroupRows(q, G, kv, k_blocks, v_blocks, bs, hd, begin, len, scale, sinks, scores, out);
}

void MatMulGroup(const MatMulTarget* targets, size_t n, const float* x, int64_t M, int64_t ldx,
                 ThreadPool& pool) {
  if (M <= 0) return;
  // The activations quantized once for every quantized target (the caller's storage, read by the
  // workers); the targets share K.
  thread_local QuantizedActivations quantized_storage;
  QuantizedActivations& quantized = quantized_storage;
  bool have_quantized = false;
  // The targets' rows end to end; the pool splits them in blocks of rows.
  std::vector<int64_t> offset(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    const WeightMatrix& w = *targets[i].w;
    offset[i + 1] = offset[i] + std::max<int64_t>(w.rows, 0);
    if (UnpacksToInts(w.dtype) && !have_quantized) {
      have_quantized = true;
      QuantizeActivations(x, M, ldx, w.cols, kActivationsInOrder, pool, &quantized);
    }
  }
  pool.ParallelFor(offset[n], kRowBlock, [&](int, int64_t b, int64_t e) {
    for (size_t i = 0; i < n; ++i) {
      const int64_t r0 = std::max(b, offset[i]) - offset[i];
      const int64_t r1 = std::min(e, offset[i + 1]) - offset[i];
      if (r0 >= r1) continue;
      const MatMulTarget& t = targets[i];
      if (UnpacksToInts(t.w->dtype)) {
        DecodeRows(*t.w, r0, r1, quantized, M, t.y, t.ldy);
      } else {
        FloatRows(*t.w, r0, r1, x, ldx, M, t.y, t.ldy);
      }
    }
  });
}

DType KeptLayout(DType file, int64_t) { return KeptType(file); }  // no BF16 dot products here

void MatMul(const WeightMatrix& w, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy,
            ThreadPool& pool) {
  const MatMulTarget target{&w, y, ldy};
  MatMulGroup(&target, 1, x, M, ldx, pool);
}

}  // namespace shardserve::cpu
