#pragma once
// The AVX-512 prefill tile of the quantized types (internal to kernels_avx512.cc and
// kernels_avx512vnni.cc, built for AVX-512 and for AVX512-VNNI as well: include it from no
// other), instantiated there without and with VNNI.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "backend/cpu/kernels_avx512.h"
#include "backend/cpu/tile_avx512.h"

namespace shardserve::cpu::avx512 {

// The MR x 16 tile of a quantized matrix in integers (kernels.cc's MicroKernelInt): each group of
// G values' pair products summed in int32 (madd and add; kVnni: AVX512-VNNI's vpdpwssd, which
// does both in one instruction, with the same wrapping int32 sums), then converted and scaled
// into y.
template <bool kVnni, int MR, int G, bool kMin>
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
        if constexpr (kVnni) {
          c = _mm512_dpwssd_epi32(c, _mm512_set1_epi32(pair), xv);
        } else {
          c = _mm512_add_epi32(c, _mm512_madd_epi16(_mm512_set1_epi32(pair), xv));
        }
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

template <bool kVnni, int G, bool kMin>
void IntTile(int64_t mr, int64_t kc, bool transposed, const int16_t* wq, const float* wf,
             const float* wm, int64_t ld, const int16_t* xq, const float* xd, const float* xds,
             float* y, int64_t ldy, bool acc) {
  switch (mr) {
    case 8:
      return MicroKernelInt<kVnni, 8, G, kMin>(kc, transposed, wq, wf, wm, ld, xq, xd, xds, y, ldy,
                                               acc);
    case 7:
      return MicroKernelInt<kVnni, 7, G, kMin>(kc, transposed, wq, wf, wm, ld, xq, xd, xds, y, ldy,
                                               acc);
    case 6:
      return MicroKernelInt<kVnni, 6, G, kMin>(kc, transposed, wq, wf, wm, ld, xq, xd, xds, y, ldy,
                                               acc);
    case 5:
      return MicroKernelInt<kVnni, 5, G, kMin>(kc, transposed, wq, wf, wm, ld, xq, xd, xds, y, ldy,
                                               acc);
    case 4:
      return MicroKernelInt<kVnni, 4, G, kMin>(kc, transposed, wq, wf, wm, ld, xq, xd, xds, y, ldy,
                                               acc);
    case 3:
      return MicroKernelInt<kVnni, 3, G, kMin>(kc, transposed, wq, wf, wm, ld, xq, xd, xds, y, ldy,
                                               acc);
    case 2:
      return MicroKernelInt<kVnni, 2, G, kMin>(kc, transposed, wq, wf, wm, ld, xq, xd, xds, y, ldy,
                                               acc);
    default:
      return MicroKernelInt<kVnni, 1, G, kMin>(kc, transposed, wq, wf, wm, ld, xq, xd, xds, y, ldy,
                                               acc);
  }
}

// MicroKernelIntAny's tile (kernels_avx512.h) for any mr, g and has_min.
template <bool kVnni>
void IntTileAny(int64_t mr, int64_t kc, bool transposed, int g, bool has_min, const int16_t* wq,
                const float* wf, const float* wm, int64_t ld, const int16_t* xq, const float* xd,
                const float* xds, float* y, int64_t ldy, bool accumulate) {
  const auto tile = g == 16 ? (has_min ? IntTile<kVnni, 16, true> : IntTile<kVnni, 16, false>)
                            : (has_min ? IntTile<kVnni, 32, true> : IntTile<kVnni, 32, false>);
  tile(mr, kc, transposed, wq, wf, wm, ld, xq, xd, xds, y, ldy, accumulate);
}

}  // namespace shardserve::cpu::avx512
