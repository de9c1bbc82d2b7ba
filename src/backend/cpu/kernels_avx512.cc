#include "backend/cpu/kernels_avx512.h"

#include <immintrin.h>

#include <cstring>

#include "backend/cpu/tile_avx512.h"

namespace shardserve::cpu::avx512 {
namespace {

// The MR x 16 tile (MR <= 12): each row's weight broadcast from memory into its FMA against the
// panel's 16 tokens.
template <int MR>
inline void MicroKernel(int64_t kc, const float* a, int64_t lda, const float* panel, float* y,
                        int64_t ldy, bool accumulate) {
  static_assert(MR >= 1 && MR <= kMr);
  Accumulators<MR, __m512> acc;
  acc.Rows([&](int, __m512& c) { c = _mm512_setzero_ps(); });
  if (accumulate) acc.Rows([&](int i, __m512& c) { c = _mm512_loadu_ps(y + i * ldy); });
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b = _mm512_load_ps(panel + k * 16);
    acc.Rows([&](int i, __m512& c) { c = _mm512_fmadd_ps(_mm512_set1_ps(a[i * lda + k]), b, c); });
  }
  acc.Rows([&](int i, __m512& c) { _mm512_storeu_ps(y + i * ldy, c); });
}

template <int MR>
void Tile(int64_t kc, const float* a, int64_t lda, const float* panel, float* y, int64_t ldy,
          bool accumulate) {
  MicroKernel<MR>(kc, a, lda, panel, y, ldy, accumulate);
}

using TileFn = void (*)(int64_t, const float*, int64_t, const float*, float*, int64_t, bool);
constexpr TileFn kTiles[kMr] = {Tile<1>, Tile<2>, Tile<3>, Tile<4>,  Tile<5>,  Tile<6>,
                                Tile<7>, Tile<8>, Tile<9>, Tile<10>, Tile<11>, Tile<12>};

// The MR x 16 tile of a quantized matrix in integers (kernels.cc's MicroKernelInt): each group of
// G values' pair products summed in int32 (madd), then converted and scaled into y.
template <int MR, int G, bool kMin>
void MicroKernelInt(int64_t kc, bool transposed, const int16_t* wq, const float* wf,
                    const float* wm, int64_t ld, const int16_t* xq, const float* xd,
                    const float* xds, float* y, int64_t ldy, bool accumulate) {
  static_assert(MR >= 1 && MR <= kMrInt && (G == 16 || G == 32));
  if (!accumulate) {
    for (int i = 0; i < MR; ++i) _mm512_storeu_ps(y + i * ldy, _mm512_setzero_ps());
  }
  Accumulators<MR, __m512i> acc;
  // kernels.cc's PairAt: pair p of group g at transposed ? 16 p + 2 g : g G + 2 p.
  const int64_t step = transposed ? 16 : 2;
  for (int64_t g = 0; g < kc / G; ++g) {
    const int16_t* xg = xq + g * G * 16;
    const int16_t* wg = wq + (transposed ? 2 * g : g * G);
    acc.Rows([&](int, __m512i& c) { c = _mm512_setzero_si512(); });
    for (int p = 0; p < G / 2; ++p) {
      const __m512i xv = _mm512_loadu_si512(xg + 32 * p);
      acc.Rows([&](int i, __m512i& c) {
        int32_t pair;
        std::memcpy(&pair, wg + i * ld + step * p, 4);
        c = _mm512_add_epi32(c, _mm512_madd_epi16(_mm512_set1_epi32(pair), xv));
      });
    }
    const int64_t b = g * G / 32;
    const __m512 d = _mm512_loadu_ps(xd + b * 16), s = _mm512_loadu_ps(xds + b * 16);
    acc.Rows([&](int i, __m512i& c) {
      const __m512 factor = _mm512_set1_ps(wf[i * (ld / 16) + g]);
      __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_mul_ps(factor, d),
                                 _mm512_loadu_ps(y + i * ldy));
      if constexpr (kMin) f = _mm512_fmadd_ps(_mm512_set1_ps(wm[i * (ld / 32) + b]), s, f);
      _mm512_storeu_ps(y + i * ldy, f);
    });
  }
}

template <int G, bool kMin>
void IntTile(int64_t mr, int64_t kc, bool transposed, const int16_t* wq, const float* wf,
             const float* wm, int64_t ld, const int16_t* xq, const float* xd, const float* xds,
             float* y, int64_t ldy, bool acc) {
  switch (mr) {
    case 8:
      return MicroKernelInt<8, G, kMin>(kc, transposed, wq, wf, wm, ld, xq, xd, xds, y, ldy, acc);
    case 7:
      return MicroKernelInt<7, G, kMin>(kc, transposed, wq, wf, wm, ld, xq, xd, xds, y, ldy, acc);
    case 6:
      return MicroKernelInt<6, G, kMin>(kc, transposed, wq, wf, wm, ld, xq, xd, xds, y, ldy, acc);
    case 5:
      return MicroKernelInt<5, G, kMin>(kc, transposed, wq, wf, wm, ld, xq, xd, xds, y, ldy, acc);
    case 4:
      return MicroKernelInt<4, G, kMin>(kc, transposed, wq, wf, wm, ld, xq, xd, xds, y, ldy, acc);
    case 3:
      return MicroKernelInt<3, G, kMin>(kc, transposed, wq, wf, wm, ld, xq, xd, xds, y, ldy, acc);
    case 2:
      return MicroKernelInt<2, G, kMin>(kc, transposed, wq, wf, wm, ld, xq, xd, xds, y, ldy, acc);
    default:
      return MicroKernelInt<1, G, kMin>(kc, transposed, wq, wf, wm, ld, xq, xd, xds, y, ldy, acc);
  }
}

}  // namespace

void MicroKernelIntAny(int64_t mr, int64_t kc, bool transposed, int g, bool has_min,
                       const int16_t* wq, const float* wf, const float* wm, int64_t ld,
                       const int16_t* xq, const float* xd, const float* xds, float* y, int64_t ldy,
                       bool accumulate) {
  const auto tile = g == 16 ? (has_min ? IntTile<16, true> : IntTile<16, false>)
                            : (has_min ? IntTile<32, true> : IntTile<32, false>);
  tile(mr, kc, transposed, wq, wf, wm, ld, xq, xd, xds, y, ldy, accumulate);
}

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
