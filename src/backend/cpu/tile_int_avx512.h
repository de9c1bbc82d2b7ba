#pragma once
// The AVX-512 prefill tile of the quantized types (internal to kernels_avx512.cc and
// kernels_avx512vnni.cc, built for AVX-512 and for AVX512-VNNI as well: include it from no
// other), instantiated there without and with VNNI.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "backend/cpu/kernels_avx512.h"

namespace shardserve::cpu::avx512 {

// The MR x 16 NP tile of a quantized matrix in integers (kernels.cc's MicroKernelInt) over NP
// panels of 16 tokens (1 or 2; the second's values q_next after the first's, its scales d_next
// after the first's, its outputs 16 after the first's): each group of G values' pair products
// summed in int32 (madd and add; kVnni: AVX512-VNNI's vpdpwssd, which does both in one
// instruction, with the same wrapping int32 sums), then converted and scaled into y. Two panels
// share each weight pair's broadcast and each factor's; each output's arithmetic is one panel's.
template <bool kVnni, int MR, int G, bool kMin, int NP>
void MicroKernelInt(int64_t kc, bool transposed, const int16_t* wq, const float* wf,
                    const float* wm, int64_t ld, const int16_t* xq, int64_t q_next, const float* xd,
                    const float* xds, int64_t d_next, float* y, int64_t ldy, bool accumulate) {
  static_assert(MR >= 1 && MR <= kMrInt && (G == 16 || G == 32) && (NP == 1 || NP == 2));
  if (!accumulate) {
    for (int i = 0; i < MR; ++i) {
      _mm512_storeu_ps(y + i * ldy, _mm512_setzero_ps());
      if constexpr (NP == 2) _mm512_storeu_ps(y + i * ldy + 16, _mm512_setzero_ps());
    }
  }
  // The rows' int32 sums of the group: lo the first panel's, hi the second's (NP == 2).
  __m512i lo[MR], hi[MR];
  // c + w . x for the weight pair at pair, broadcast. GCC 12 copies the accumulator of
  // _mm512_dpwssd_epi32 to a new register and back at every use (two moves a product, a frontend
  // bound); the instruction written out keeps it in place, and takes the pair from memory with
  // its broadcast ({1to16}), in place of a vpbroadcastd before the pair's products (Zen 4,
  // `bench kernels --threads 1`, 3 alternated runs at avx512: Q4_KX 144.5 / 153.8 / 150.9 ->
  // 157.7 / 163.8 / 156.5 GFLOP/s, Q8_0 153.8 / 162.9 / 165.7 -> 167.7 / 167.2 / 166.8).
  const auto dot = [](__m512i& c, const int16_t* pair, __m512i x) {
    if constexpr (kVnni) {
      using Pair [[gnu::may_alias]] = int32_t;  // the pair's 4 bytes, the memory operand
      asm("vpdpwssd %2%{1to16%}, %1, %0"
          : "+v"(c)
          : "v"(x), "m"(*reinterpret_cast<const Pair*>(pair)));
    } else {
      int32_t w;
      std::memcpy(&w, pair, 4);
      c = _mm512_add_epi32(c, _mm512_madd_epi16(_mm512_set1_epi32(w), x));
    }
  };
  // kernels.cc's PairAt: pair p of group g at transposed ? 16 p + 2 g : g G + 2 p.
  const int64_t step = transposed ? 16 : 2;
  for (int64_t g = 0; g < kc / G; ++g) {
    const int16_t* xg = xq + g * G * 16;
    const int16_t* wg = wq + (transposed ? 2 * g : g * G);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      lo[i] = _mm512_setzero_si512();
      if constexpr (NP == 2) hi[i] = _mm512_setzero_si512();
    }
    for (int p = 0; p < G / 2; ++p) {
      const __m512i x0 = _mm512_loadu_si512(xg + 32 * p);
      const __m512i x1 = NP == 2 ? _mm512_loadu_si512(xg + q_next + 32 * p) : x0;
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const int16_t* pair = wg + i * ld + step * p;
        dot(lo[i], pair, x0);
        if constexpr (NP == 2) dot(hi[i], pair, x1);
      }
    }
    const int64_t b = g * G / 32;
    // y += sum * factor * d (+ minimum * s), in the AVX2 tile's order.
    const auto scale = [&](__m512i c, float factor, float minimum, const float* d, const float* s,
                           float* out) {
      __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c),
                                 _mm512_mul_ps(_mm512_set1_ps(factor), _mm512_loadu_ps(d)),
                                 _mm512_loadu_ps(out));
      if constexpr (kMin) f = _mm512_fmadd_ps(_mm512_set1_ps(minimum), _mm512_loadu_ps(s), f);
      _mm512_storeu_ps(out, f);
    };
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const float factor = wf[i * (ld / 16) + g], minimum = kMin ? wm[i * (ld / 32) + b] : 0.f;
      scale(lo[i], factor, minimum, xd + b * 16, xds + b * 16, y + i * ldy);
      if constexpr (NP == 2) {
        scale(hi[i], factor, minimum, xd + d_next + b * 16, xds + d_next + b * 16,
              y + i * ldy + 16);
      }
    }
  }
}

// The tile for mr rows (1 to kMrInt) and `panels` panels (1 or 2).
template <bool kVnni, int G, bool kMin>
void IntTile(int64_t mr, int panels, int64_t kc, bool transposed, const int16_t* wq,
             const float* wf, const float* wm, int64_t ld, const int16_t* xq, int64_t q_next,
             const float* xd, const float* xds, int64_t d_next, float* y, int64_t ldy, bool acc) {
  using Fn =
      void (*)(int64_t, bool, const int16_t*, const float*, const float*, int64_t, const int16_t*,
               int64_t, const float*, const float*, int64_t, float*, int64_t, bool);
  constexpr Fn kOne[kMrInt] = {
      MicroKernelInt<kVnni, 1, G, kMin, 1>, MicroKernelInt<kVnni, 2, G, kMin, 1>,
      MicroKernelInt<kVnni, 3, G, kMin, 1>, MicroKernelInt<kVnni, 4, G, kMin, 1>,
      MicroKernelInt<kVnni, 5, G, kMin, 1>, MicroKernelInt<kVnni, 6, G, kMin, 1>,
      MicroKernelInt<kVnni, 7, G, kMin, 1>, MicroKernelInt<kVnni, 8, G, kMin, 1>};
  constexpr Fn kTwo[kMrInt] = {
      MicroKernelInt<kVnni, 1, G, kMin, 2>, MicroKernelInt<kVnni, 2, G, kMin, 2>,
      MicroKernelInt<kVnni, 3, G, kMin, 2>, MicroKernelInt<kVnni, 4, G, kMin, 2>,
      MicroKernelInt<kVnni, 5, G, kMin, 2>, MicroKernelInt<kVnni, 6, G, kMin, 2>,
      MicroKernelInt<kVnni, 7, G, kMin, 2>, MicroKernelInt<kVnni, 8, G, kMin, 2>};
  const int64_t at = mr < 1 ? 0 : mr > kMrInt ? kMrInt - 1 : mr - 1;
  (panels == 2 ? kTwo : kOne)[at](kc, transposed, wq, wf, wm, ld, xq, q_next, xd, xds, d_next, y,
                                  ldy, acc);
}

// MicroKernelIntAny's tile (kernels_avx512.h) for any mr, panels, g and has_min.
template <bool kVnni>
void IntTileAny(int64_t mr, int panels, int64_t kc, bool transposed, int g, bool has_min,
                const int16_t* wq, const float* wf, const float* wm, int64_t ld, const int16_t* xq,
                int64_t q_next, const float* xd, const float* xds, int64_t d_next, float* y,
                int64_t ldy, bool accumulate) {
  const auto tile = g == 16 ? (has_min ? IntTile<kVnni, 16, true> : IntTile<kVnni, 16, false>)
                            : (has_min ? IntTile<kVnni, 32, true> : IntTile<kVnni, 32, false>);
  tile(mr, panels, kc, transposed, wq, wf, wm, ld, xq, q_next, xd, xds, d_next, y, ldy, accumulate);
}

}  // namespace shardserve::cpu::avx512
