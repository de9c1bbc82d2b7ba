#pragma once
// The CPU kernels of KernelLevel::kAvx512 (backend/cpu/cpu_features.h), compiled for AVX-512
// (F, BW, VL, DQ) in their own source and called only where the CPU has them. Each computes what
// its AVX2 counterpart in kernels.cc does, in wider registers.
#include <cstdint>

namespace shardserve::cpu::avx512 {

// Rows of the prefill micro-kernel's tile: a row's accumulator is one register of 16 tokens, so
// the tile has twice the AVX2 tile's rows (12 x 16 against 6 x 16).
inline constexpr int64_t kMr = 12;

// kernels.cc's MicroKernelAny for mr <= kMr rows: y[i][j] (+)= sum over k < kc of a[i][k] *
// panel[k][j] for j < 16, a's rows at stride lda, panel 64-byte aligned ([kc][16]), y's rows at
// stride ldy.
void MicroKernelAny(int64_t mr, int64_t kc, const float* a, int64_t lda, const float* panel,
                    float* y, int64_t ldy, bool accumulate);

// Rows of the quantized prefill tile (16 tokens' int16 pairs are one register: twice AVX2's 4).
inline constexpr int64_t kMrInt = 8;

// kernels.cc's MicroKernelIntAny for mr <= kMrInt rows of a quantized matrix, groups of g (16 or
// 32) values, with minimums (has_min) or without; the rows' int16 values, factors and minimums
// at stride `ld` values (ld / 16 factors, ld / 32 minimums). The integer sums are exact and the
// float steps those of the AVX2 tile, in its order: the same bits.
void MicroKernelIntAny(int64_t mr, int64_t kc, bool transposed, int g, bool has_min,
                       const int16_t* wq, const float* wf, const float* wm, int64_t ld,
                       const int16_t* xq, const float* xd, const float* xds, float* y, int64_t ldy,
                       bool accumulate);

// kernels.cc's ExpandRows for one row of 16-bit floats: kc values of `row` (BF16 when `bf16`,
// else F16) as F32 into out (64-byte aligned).
void ExpandHalves(const uint16_t* row, bool bf16, int64_t kc, float* out);

}  // namespace shardserve::cpu::avx512
