#pragma once
// The AVX-512 prefill tile of the quantized types (internal to kernels_avx512.cc and
// kernels_avx512vnni.cc, built for AVX-512 and for AVX512-VNNI as well: include it from no
// other), instantiated there without and with VNNI.
#include <immintrin.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "backend/cpu/kernels_avx512.h"

namespace shardserve::cpu::avx512 {

// The MR x 16 NP tile of a quantized matrix in integers (kernels.cc's MicroKernelInt) over NP
// panels of 16 tokens (1 or 2; the second's values q_next after the first's, its scales d_next
// after the first's, its outputs 16 after the first's): each group of G values' pair products
// summed in int32 (madd and add; kVnni: AVX512-VNNI's vpdpwssd, which does both in one
// instruction, with the same wrapping int32 sums), then converted and scaled into y. Two panels
// share each weight pair's broadcast and each factor's; each output's arithmetic is one panel's.
// kBytes (KernelLevel::kAvx512Int8's prefill, with VNNI): the rows' values as signed bytes in
// quads (UnpackBytes' layout: quad u of group g at transposed ? 32 u + 4 g : g G + 4 u), their
// groups' sums in wsum (strided as the factors), against 16 tokens' quads of int8 values offset
// by 128 (vpdpbusd's unsigned operand; [kc / 4][16][4] bytes a panel): vpdpbusd multiplies a
// quad's 4 products for 16 tokens an instruction, and 128 times the group's sum takes the offset
// away (at most 32 products of 255 with 128: no overflow).
template <bool kBytes>
using IntWeight = std::conditional_t<kBytes, int8_t, int16_t>;
template <bool kBytes>
using IntToken = std::conditional_t<kBytes, uint8_t, int16_t>;
template <bool kVnni, int MR, int G, bool kMin, int NP, bool kBytes = false>
void MicroKernelInt(int64_t kc, bool transposed, const IntWeight<kBytes>* wq, const int32_t* wsum,
                    const float* wf, const float* wm, int64_t ld, const IntToken<kBytes>* xq,
                    int64_t q_next, const float* xd, const float* xds, int64_t d_next, float* y,
                    int64_t ldy, bool accumulate) {
  static_assert(!kBytes || kVnni);
  constexpr int kV = kBytes ? 4 : 2;  // values a dot product takes from a row and a token
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
  const auto dot = [](__m512i& c, const IntWeight<kBytes>* pair, __m512i x) {
    using Pair [[gnu::may_alias]] = int32_t;  // the pair's (quad's) 4 bytes, the memory operand
    if constexpr (kBytes) {
      asm("vpdpbusd %2%{1to16%}, %1, %0"
          : "+v"(c)
          : "v"(x), "m"(*reinterpret_cast<const Pair*>(pair)));
    } else if constexpr (kVnni) {
      asm("vpdpwssd %2%{1to16%}, %1, %0"
          : "+v"(c)
          : "v"(x), "m"(*reinterpret_cast<const Pair*>(pair)));
    } else {
      int32_t w;
      std::memcpy(&w, pair, 4);
      c = _mm512_add_epi32(c, _mm512_madd_epi16(_mm512_set1_epi32(w), x));
    }
  };
  // kernels.cc's PairAt (kBytes: UnpackBytes' quads): unit p of group g at transposed ? 8 kV p +
  // kV g : g G + kV p.
  const int64_t step = transposed ? 8 * kV : kV;
  for (int64_t g = 0; g < kc / G; ++g) {
    const IntToken<kBytes>* xg = xq + g * G * 16;
    const IntWeight<kBytes>* wg = wq + (transposed ? kV * g : g * G);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      lo[i] = _mm512_setzero_si512();
      if constexpr (NP == 2) hi[i] = _mm512_setzero_si512();
    }
    for (int p = 0; p < G / kV; ++p) {
      const __m512i x0 = _mm512_loadu_si512(xg + 16 * kV * p);
      const __m512i x1 = NP == 2 ? _mm512_loadu_si512(xg + q_next + 16 * kV * p) : x0;
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const IntWeight<kBytes>* pair = wg + i * ld + step * p;
        dot(lo[i], pair, x0);
        if constexpr (NP == 2) dot(hi[i], pair, x1);
      }
    }
    if constexpr (kBytes) {
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512i offset = _mm512_set1_epi32(128 * wsum[i * (ld / 16) + g]);
        lo[i] = _mm512_sub_epi32(lo[i], offset);
        if constexpr (NP == 2) hi[i] = _mm512_sub_epi32(hi[i], offset);
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
template <bool kVnni, int G, bool kMin, bool kBytes>
void IntTile(int64_t mr, int panels, int64_t kc, bool transposed, const IntWeight<kBytes>* wq,
             const int32_t* wsum, const float* wf, const float* wm, int64_t ld,
             const IntToken<kBytes>* xq, int64_t q_next, const float* xd, const float* xds,
             int64_t d_next, float* y, int64_t ldy, bool acc) {
  using Fn = void (*)(int64_t, bool, const IntWeight<kBytes>*, const int32_t*, const float*,
                      const float*, int64_t, const IntToken<kBytes>*, int64_t, const float*,
                      const float*, int64_t, float*, int64_t, bool);
  // tiles[np - 1][mr - 1]: MicroKernelInt for mr rows and np panels.
  constexpr auto tiles = []<int... R>(std::integer_sequence<int, R...>) {
    return std::array<std::array<Fn, kMrInt>, 2>{
        {{MicroKernelInt<kVnni, R + 1, G, kMin, 1, kBytes>...},
         {MicroKernelInt<kVnni, R + 1, G, kMin, 2, kBytes>...}}};
  }
  (std::make_integer_sequence<int, kMrInt>());
  const int64_t at = mr < 1 ? 0 : mr > kMrInt ? kMrInt - 1 : mr - 1;
  tiles[panels == 2 ? 1 : 0][at](kc, transposed, wq, wsum, wf, wm, ld, xq, q_next, xd, xds, d_next,
                                 y, ldy, acc);
}

// MicroKernelIntAny's tile (kernels_avx512.h; kBytes: MicroKernelInt8's) for any mr, panels, g and
// has_min.
template <bool kVnni, bool kBytes = false>
void IntTileAny(int64_t mr, int panels, int64_t kc, bool transposed, int g, bool has_min,
                const IntWeight<kBytes>* wq, const int32_t* wsum, const float* wf, const float* wm,
                int64_t ld, const IntToken<kBytes>* xq, int64_t q_next, const float* xd,
                const float* xds, int64_t d_next, float* y, int64_t ldy, bool accumulate) {
  const auto tile =
      g == 16 ? (has_min ? IntTile<kVnni, 16, true, kBytes> : IntTile<kVnni, 16, false, kBytes>)
              : (has_min ? IntTile<kVnni, 32, true, kBytes> : IntTile<kVnni, 32, false, kBytes>);
  tile(mr, panels, kc, transposed, wq, wsum, wf, wm, ld, xq, q_next, xd, xds, d_next, y, ldy,
       accumulate);
}

}  // namespace shardserve::cpu::avx512
