#include "backend/cpu/kernels_avx512.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/cpu_features.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/kernels_internal.h"
#include "backend/cpu/simd_x86.h"
#include "backend/cpu/tile_avx512.h"
#include "backend/cpu/tile_int_avx512.h"

namespace shardserve::cpu::avx512 {
namespace {

// The MR x 16 NP tile (MR <= 12) over NP panels of 16 tokens (1 or 2; the second `next` floats
// after the first, its outputs 16 after the first's): each row's weight broadcast into a register
// for every panel's FMA. Two panels make 24 FMAs for 14 loads, where one makes 12 for 13 and waits
// on the load ports. Each output sums the same products in the same order at either NP.
template <int MR, int NP>
void MicroKernel(int64_t kc, const float* a, int64_t lda, const float* panel, int64_t next,
                 float* y, int64_t ldy, bool accumulate) {
  static_assert(MR >= 1 && MR <= kMr && (NP == 1 || NP == 2));
  // A row's sums: lo the first panel's, hi the second's (NP == 2), both taken with the row's
  // broadcast (with every row's broadcast made first and kept live, GCC 12 spilled the sums).
  struct Sums {
    __m512 lo, hi;
  };
  Accumulators<MR, Sums> acc;
  acc.Rows([&](int i, Sums& c) {
    c.lo = accumulate ? _mm512_loadu_ps(y + i * ldy) : _mm512_setzero_ps();
    if constexpr (NP == 2)
      c.hi = accumulate ? _mm512_loadu_ps(y + i * ldy + 16) : _mm512_setzero_ps();
  });
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_load_ps(panel + k * 16);
    const __m512 b1 = NP == 2 ? _mm512_load_ps(panel + next + k * 16) : b0;
    acc.Rows([&](int i, Sums& c) {
      const __m512 w = _mm512_set1_ps(a[i * lda + k]);
      c.lo = _mm512_fmadd_ps(w, b0, c.lo);
      if constexpr (NP == 2) c.hi = _mm512_fmadd_ps(w, b1, c.hi);
    });
  }
  acc.Rows([&](int i, Sums& c) {
    _mm512_storeu_ps(y + i * ldy, c.lo);
    if constexpr (NP == 2) _mm512_storeu_ps(y + i * ldy + 16, c.hi);
  });
}

using TileFn = void (*)(int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t,
                        bool);
template <int NP>
constexpr TileFn kTiles[kMr] = {MicroKernel<1, NP>,  MicroKernel<2, NP>,  MicroKernel<3, NP>,
                                MicroKernel<4, NP>,  MicroKernel<5, NP>,  MicroKernel<6, NP>,
                                MicroKernel<7, NP>,  MicroKernel<8, NP>,  MicroKernel<9, NP>,
                                MicroKernel<10, NP>, MicroKernel<11, NP>, MicroKernel<12, NP>};

// Sixteen cached values as floats: kernels.cc's KvLoad<kT>::Load8 of values i and i + 8, in one
// register (E4M3 moved into F16's bit places, times 2^-8: kUnit folds the 2^8 back in).
template <DType kT>
struct KvLoad16 {
  static constexpr float kUnit = kT == DType::kF8E4M3 ? 256.f : 1.f;
  static __m512 Load(const void* base, int64_t i) {
    if constexpr (kT == DType::kF32) {
      return _mm512_loadu_ps(static_cast<const float*>(base) + i);
    } else if constexpr (kT == DType::kF8E4M3) {
      const __m256i b = _mm256_cvtepu8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(base) + i)));
      return _mm512_cvtph_ps(
          _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                          _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7)));
    } else {
      const __m256i h = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
      if constexpr (kT == DType::kF16) return _mm512_cvtph_ps(h);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
};

// The value pass of NH heads from g0 (NH * V16 <= 16 registers of outputs): out[g] = sum over
// positions of weight[g][p] * v[p], each output's FMAs in the order of positions, from zero.
template <int V16, int NH, DType kT>
void AttendValues(int64_t g0, const void* const* v_blocks, int64_t bs, int64_t begin, int64_t len,
                  const float* scores, const float* w, float* const* out) {
  constexpr int64_t hd = 16 * V16;
  __m512 acc[NH][V16], row[V16];
#pragma GCC unroll 16
  for (int h = 0; h < NH; ++h) {
#pragma GCC unroll 8
    for (int i = 0; i < V16; ++i) acc[h][i] = _mm512_setzero_ps();
  }
  for (int64_t p = begin; p < len; ++p) {
    if (p + kKvAhead < len)
      PrefetchKvRow(v_blocks, bs, p + kKvAhead, hd * static_cast<int64_t>(DTypeSize(kT)));
    const void* v = v_blocks[p / bs];
    const int64_t at = (p % bs) * hd;
#pragma GCC unroll 8
    for (int i = 0; i < V16; ++i) row[i] = KvLoad16<kT>::Load(v, at + 16 * i);
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) {
      const __m512 wp = _mm512_set1_ps(scores[(g0 + h) * len + p] * w[g0 + h]);
#pragma GCC unroll 8
      for (int i = 0; i < V16; ++i) acc[h][i] = _mm512_fmadd_ps(wp, row[i], acc[h][i]);
    }
  }
#pragma GCC unroll 16
  for (int h = 0; h < NH; ++h) {
#pragma GCC unroll 8
    for (int i = 0; i < V16; ++i) _mm512_storeu_ps(out[g0 + h] + 16 * i, acc[h][i]);
  }
}

// AttendGroup for hd = 16 * V16 (kernels.cc's AttendGroupFixed in registers of 16 floats: a
// score's low 8 lanes are its even 8-float chunks' sums, the high 8 its odd ones', as AVX2's two
// accumulators).
template <int V16, DType kT>
void AttendFixed(const float* const* q, int64_t G, const KvRows& kv, const void* const* k_blocks,
                 const void* const* v_blocks, int64_t bs, int64_t begin, int64_t len, float scale,
                 const float* sinks, float* scores, float* const* out) {
  using L = KvLoad16<kT>;
  constexpr int64_t hd = 16 * V16;
  std::vector<float> qs(G * hd), mx(G), w(G);
  const float qscale = scale * kv.k_scale * L::kUnit;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < hd; ++i) qs[g * hd + i] = q[g][i] * qscale;
    mx[g] = sinks != nullptr ? sinks[g] : -INFINITY;
  }
  std::vector<__m256> part(G * 8);  // as kernels.cc's
  __m512 row[V16];
  for (int64_t p0 = begin; p0 < len; p0 += 8) {
    const int64_t n = std::min<int64_t>(8, len - p0);
    for (int64_t j = 0; j < n; ++j) {
      if (p0 + j + kKvAhead < len)
        PrefetchKvRow(k_blocks, bs, p0 + j + kKvAhead, hd * static_cast<int64_t>(DTypeSize(kT)));
      const void* k = k_blocks[(p0 + j) / bs];
      const int64_t at = ((p0 + j) % bs) * hd;
#pragma GCC unroll 8
      for (int i = 0; i < V16; ++i) row[i] = L::Load(k, at + 16 * i);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qs.data() + g * hd;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), row[0]);
#pragma GCC unroll 8
        for (int i = 1; i < V16; ++i) a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * i), row[i], a);
        part[g * 8 + j] = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
      }
    }
    for (int64_t g = 0; g < G; ++g) ScoresOf(&part[g * 8], n, scores + g * len + p0, mx[g]);
  }
  for (int64_t g = 0; g < G; ++g) {
    const float sink = sinks != nullptr ? sinks[g] : -INFINITY;
    const float sum =
        ExpMinusMax(scores + g * len + begin, len - begin, mx[g]) + std::exp(sink - mx[g]);
    w[g] = kv.v_scale * L::kUnit / sum;
  }
  // Heads whose outputs stay in registers over the positions: 16 of the 32.
  constexpr int kHeads = 16 / V16;
  for (int64_t g0 = 0; g0 < G; g0 += kHeads) {
    const auto values = [&]<int NH>() {
      AttendValues<V16, NH, kT>(g0, v_blocks, bs, begin, len, scores, w.data(), out);
    };
    switch (std::min<int64_t>(kHeads, G - g0)) {
      case 1:
        values.template operator()<1>();
        break;
      case 2:
        values.template operator()<2>();
        break;
      case 3:
        if constexpr (kHeads >= 3) values.template operator()<3>();
        break;
      default:
        if constexpr (kHeads >= 4) values.template operator()<4>();
    }
  }
}

template <int V16>
void AttendOfDtype(const float* const* q, int64_t G, const KvRows& kv, const void* const* k_blocks,
                   const void* const* v_blocks, int64_t bs, int64_t begin, int64_t len, float scale,
                   const float* sinks, float* scores, float* const* out) {
  switch (kv.dtype) {
    case DType::kBF16:
      return AttendFixed<V16, DType::kBF16>(q, G, kv, k_blocks, v_blocks, bs, begin, len, scale,
                                            sinks, scores, out);
    case DType::kF16:
      return AttendFixed<V16, DType::kF16>(q, G, kv, k_blocks, v_blocks, bs, begin, len, scale,
                                           sinks, scores, out);
    case DType::kF8E4M3:
      return AttendFixed<V16, DType::kF8E4M3>(q, G, kv, k_blocks, v_blocks, bs, begin, len, scale,
                                              sinks, scores, out);
    default:
      return AttendFixed<V16, DType::kF32>(q, G, kv, k_blocks, v_blocks, bs, begin, len, scale,
                                           sinks, scores, out);
  }
}

}  // namespace

void AttendGroup(const float* const* q, int64_t G, const KvRows& kv, const void* const* k_blocks,
                 const void* const* v_blocks, int64_t bs, int64_t hd, int64_t begin, int64_t len,
                 float scale, const float* sinks, float* scores, float* const* out) {
  (hd == 128 ? AttendOfDtype<8> : AttendOfDtype<4>)(q, G, kv, k_blocks, v_blocks, bs, begin, len,
                                                    scale, sinks, scores, out);
}

void MicroKernelIntAny(int64_t mr, int panels, int64_t kc, bool transposed, int g, bool has_min,
                       const int16_t* wq, const float* wf, const float* wm, int64_t ld,
                       const int16_t* xq, int64_t q_next, const float* xd, const float* xds,
                       int64_t d_next, float* y, int64_t ldy, bool accumulate) {
  if (UsesVnni()) {
    return MicroKernelIntVnni(mr, panels, kc, transposed, g, has_min, wq, wf, wm, ld, xq, q_next,
                              xd, xds, d_next, y, ldy, accumulate);
  }
  IntTileAny<false>(mr, panels, kc, transposed, g, has_min, wq, nullptr, wf, wm, ld, xq, q_next, xd,
                    xds, d_next, y, ldy, accumulate);
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

void MicroKernelAny(int64_t mr, int panels, int64_t kc, const float* a, int64_t lda,
                    const float* panel, int64_t next, float* y, int64_t ldy, bool accumulate) {
  const int64_t at = mr < 1 ? 0 : mr > kMr ? kMr - 1 : mr - 1;
  (panels == 2 ? kTiles<2> : kTiles<1>)[at](kc, a, lda, panel, next, y, ldy, accumulate);
}

}  // namespace shardserve::cpu::avx512
