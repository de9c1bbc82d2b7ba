#include "backend/cpu/kernels_avx512.h"

#include <immintrin.h>

#include <cstring>

namespace shardserve::cpu::avx512 {
namespace {

// The MR x 16 tile (MR <= 12): each row's weight broadcast from memory into its FMA against the
// panel's 16 tokens. The accumulators are named variables (an array of them is kept on the stack).
template <int MR>
inline void MicroKernel(int64_t kc, const float* a, int64_t lda, const float* panel, float* y,
                        int64_t ldy, bool accumulate) {
  static_assert(MR >= 1 && MR <= kMr);
  const __m512 zero = _mm512_setzero_ps();
  __m512 c0 = zero, c1 = zero, c2 = zero, c3 = zero, c4 = zero, c5 = zero, c6 = zero, c7 = zero,
         c8 = zero, c9 = zero, c10 = zero, c11 = zero;
  const auto rows = [&](auto f) {
    f(0, c0);
    if constexpr (MR > 1) f(1, c1);
    if constexpr (MR > 2) f(2, c2);
    if constexpr (MR > 3) f(3, c3);
    if constexpr (MR > 4) f(4, c4);
    if constexpr (MR > 5) f(5, c5);
    if constexpr (MR > 6) f(6, c6);
    if constexpr (MR > 7) f(7, c7);
    if constexpr (MR > 8) f(8, c8);
    if constexpr (MR > 9) f(9, c9);
    if constexpr (MR > 10) f(10, c10);
    if constexpr (MR > 11) f(11, c11);
  };
  if (accumulate) rows([&](int i, __m512& c) { c = _mm512_loadu_ps(y + i * ldy); });
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b = _mm512_load_ps(panel + k * 16);
    rows([&](int i, __m512& c) { c = _mm512_fmadd_ps(_mm512_set1_ps(a[i * lda + k]), b, c); });
  }
  rows([&](int i, __m512& c) { _mm512_storeu_ps(y + i * ldy, c); });
}

template <int MR>
void Tile(int64_t kc, const float* a, int64_t lda, const float* panel, float* y, int64_t ldy,
          bool accumulate) {
  MicroKernel<MR>(kc, a, lda, panel, y, ldy, accumulate);
}

using TileFn = void (*)(int64_t, const float*, int64_t, const float*, float*, int64_t, bool);
constexpr TileFn kTiles[kMr] = {Tile<1>, Tile<2>, Tile<3>, Tile<4>,  Tile<5>,  Tile<6>,
                                Tile<7>, Tile<8>, Tile<9>, Tile<10>, Tile<11>, Tile<12>};

}  // namespace

void ExpandHalves(const uint16_t* row, bool bf16, int64_t kc, float* out) {
  int64_t k = 0;
  for (; k + 16 <= kc; k += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
    _mm512_store_ps(out + k,
                    bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                         : _mm512_cvtph_ps(h));
  }
  for (; k < kc; ++k) {
    if (bf16) {
      const uint32_t bits = static_cast<uint32_t>(row[k]) << 16;
      std::memcpy(out + k, &bits, 4);
    } else {
      out[k] = _cvtsh_ss(row[k]);
    }
  }
}

void MicroKernelAny(int64_t mr, int64_t kc, const float* a, int64_t lda, const float* panel,
                    float* y, int64_t ldy, bool accumulate) {
  kTiles[mr < 1 ? 0 : mr > kMr ? kMr - 1 : mr - 1](kc, a, lda, panel, y, ldy, accumulate);
}

}  // namespace shardserve::cpu::avx512
