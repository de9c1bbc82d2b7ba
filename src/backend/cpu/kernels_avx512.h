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

// kernels.cc's ExpandRows for one row of 16-bit floats: kc values of `row` (BF16 when `bf16`,
// else F16) as F32 into out (64-byte aligned).
void ExpandHalves(const uint16_t* row, bool bf16, int64_t kc, float* out);

}  // namespace shardserve::cpu::avx512
