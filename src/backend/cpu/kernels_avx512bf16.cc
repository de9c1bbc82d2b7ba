// KernelLevel::kAvx512Bf16's kernels (kernels_avx512.h): BF16 pairs multiplied by vdpbf16ps.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <utility>

#include "backend/cpu/kernels_avx512.h"
#include "backend/cpu/tile_avx512.h"

namespace shardserve::cpu::avx512 {
namespace {

inline __m512bh AsBf16(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// The sum of a vector's 16 floats (GCC 12's _mm512_reduce_add_ps warns of an uninitialized
// variable in its own header).
inline float Sum16(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_extractf32x8_ps(v, 0), _mm512_extractf32x8_ps(v, 1));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_hadd_ps(q, q);
  q = _mm_hadd_ps(q, q);
  return _mm_cvtss_f32(q);
}

// R rows x MT tokens of BF16 dot products, 32 values an instruction; the last K % 32 values of
// a row through a masked load (zeros past K; the activations are zero there too).
template <int R, int MT>
inline void GemvTile(const uint16_t* const* rows, int64_t K, const uint16_t* x, int64_t ldx,
                     float* y, int64_t ldy) {
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < MT; ++t) acc[r][t] = _mm512_setzero_ps();
  const auto step = [&](int64_t k, __mmask32 mask) {
    __m512i b[MT];
    for (int t = 0; t < MT; ++t) b[t] = _mm512_loadu_si512(x + t * ldx + k);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_maskz_loadu_epi16(mask, rows[r] + k);
      for (int t = 0; t < MT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], AsBf16(a), AsBf16(b[t]));
    }
  };
  const int64_t k32 = K / 32 * 32;
  for (int64_t k = 0; k < k32; k += 32) step(k, ~__mmask32{0});
  if (k32 < K) step(k32, (__mmask32{1} << (K - k32)) - 1);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < MT; ++t) y[t * ldy + r] = Sum16(acc[r][t]);
}

template <int MT>
void GemvRange(const uint16_t* w, int64_t row_stride, int64_t K, int64_t n0, int64_t n1,
               const uint16_t* x, int64_t ldx, float* y, int64_t ldy) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const uint16_t* rows[4];
    for (int r = 0; r < 4; ++r) rows[r] = w + (n + r) * row_stride;
    GemvTile<4, MT>(rows, K, x, ldx, y + n, ldy);
  }
  for (; n < n1; ++n) {
    const uint16_t* row = w + n * row_stride;
    GemvTile<1, MT>(&row, K, x, ldx, y + n, ldy);
  }
}

// G groups of 16 rows of kBF16X (at w, `group` values apart) x T tokens: G x T accumulators,
// a group's 16 rows in one, named (Accumulators: an array is kept on the stack); `mask` keeps a
// ragged group's lanes (its pairs `stride` values apart). Each group's pairs are prefetched
// kPairsAhead cache lines ahead (decode reads them from memory, G streams at once; 0, 16, 32 and
// 64 lines measured alike on a Zen 4 VM, within its noise) into L2 (T1): into L1 (T0), one
// thread read 13-17 GB/s from memory there against 18-21 with T1 (a probe of this loop, 5
// alternating rounds), and `bench kernels` BF16X 15.9-19.2 against 19.5-22.1 (3 rounds each).
constexpr int64_t kPairsAhead = 32;
template <int G, int T>
void PairsTile(const uint16_t* w, int64_t group, int64_t stride, __mmask16 mask, int64_t kp,
               const uint16_t* x, int64_t ldx, float* y, int64_t ldy) {
  static_assert(G >= 1 && G <= 4);
  Accumulators<T, __m512> a0, a1, a2, a3;
  const auto groups = [&](auto&& f) {
    f(0, a0);
    if constexpr (G > 1) f(1, a1);
    if constexpr (G > 2) f(2, a2);
    if constexpr (G > 3) f(3, a3);
  };
  groups([&](int, Accumulators<T, __m512>& a) {
    a.Rows([](int, __m512& c) { c = _mm512_setzero_ps(); });
  });
  for (int64_t p = 0; p < kp; ++p) {
    __m512bh b[T];
    for (int t = 0; t < T; ++t) {
      int32_t pair;
      __builtin_memcpy(&pair, x + t * ldx + 2 * p, sizeof pair);
      b[t] = AsBf16(_mm512_set1_epi32(pair));
    }
    groups([&](int g, Accumulators<T, __m512>& a) {
      const uint16_t* at = w + g * group + p * stride;
      _mm_prefetch(reinterpret_cast<const char*>(at + kPairsAhead * 32), _MM_HINT_T1);
      const __m512bh v = AsBf16(_mm512_maskz_loadu_epi32(mask, at));
      a.Rows([&](int t, __m512& c) { c = _mm512_dpbf16_ps(c, v, b[t]); });
    });
  }
  groups([&](int g, Accumulators<T, __m512>& a) {
    a.Rows([&](int t, __m512& c) { _mm512_mask_storeu_ps(y + t * ldy + 16 * g, mask, c); });
  });
}

// The pairs tiles: up to kPairsGroups groups x kPairsTokens tokens.
constexpr int kPairsGroups = 4, kPairsTokens = 6;
using PairsFn = void (*)(const uint16_t*, int64_t, int64_t, __mmask16, int64_t, const uint16_t*,
                         int64_t, float*, int64_t);
template <int G, int... T>
constexpr std::array<PairsFn, sizeof...(T)> PairsRow(std::integer_sequence<int, T...>) {
  return {PairsTile<G, T + 1>...};
}
constexpr std::array<std::array<PairsFn, kPairsTokens>, kPairsGroups> kPairsTiles = {
    PairsRow<1>(std::make_integer_sequence<int, kPairsTokens>()),
    PairsRow<2>(std::make_integer_sequence<int, kPairsTokens>()),
    PairsRow<3>(std::make_integer_sequence<int, kPairsTokens>()),
    PairsRow<4>(std::make_integer_sequence<int, kPairsTokens>())};

// The MR x 16 tile (MR <= 12): each row's pair broadcast against the panel's 16 tokens' pairs.
template <int MR>
void MicroKernel(int64_t kp, const uint16_t* a, int64_t lda, const uint16_t* panel, float* y,
                 int64_t ldy, bool accumulate) {
  static_assert(MR >= 1 && MR <= kMr);
  Accumulators<MR, __m512> acc;
  acc.Rows([&](int, __m512& c) { c = _mm512_setzero_ps(); });
  if (accumulate) acc.Rows([&](int i, __m512& c) { c = _mm512_loadu_ps(y + i * ldy); });
  for (int64_t p = 0; p < kp; ++p) {
    const __m512bh b = AsBf16(_mm512_loadu_si512(panel + p * 32));
    acc.Rows([&](int i, __m512& c) {
      int32_t pair;
      __builtin_memcpy(&pair, a + i * lda + 2 * p, sizeof pair);
      c = _mm512_dpbf16_ps(c, AsBf16(_mm512_set1_epi32(pair)), b);
    });
  }
  acc.Rows([&](int i, __m512& c) { _mm512_storeu_ps(y + i * ldy, c); });
}

using TileFn = void (*)(int64_t, const uint16_t*, int64_t, const uint16_t*, float*, int64_t, bool);
constexpr TileFn kTiles[kMr] = {MicroKernel<1>, MicroKernel<2>,  MicroKernel<3>,  MicroKernel<4>,
                                MicroKernel<5>, MicroKernel<6>,  MicroKernel<7>,  MicroKernel<8>,
                                MicroKernel<9>, MicroKernel<10>, MicroKernel<11>, MicroKernel<12>};

}  // namespace

void RoundToBf16(const float* x, int64_t K, int64_t kp, uint16_t* out) {
  for (int64_t k = 0; k < kp; k += 16) {
    const int64_t n = std::clamp<int64_t>(K - k, 0, 16);
    const __m512 v = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), x + k);
    const __m256bh h = _mm512_cvtneps_pbh(v);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), reinterpret_cast<const __m256i&>(h));
  }
}

void GemvBf16(const uint16_t* rows, int64_t row_stride, int64_t K, int64_t n0, int64_t n1,
              const uint16_t* xb, int64_t ldx, int64_t M, float* y, int64_t ldy) {
  for (int64_t t = 0; t < M; t += 3) {
    const uint16_t* xt = xb + t * ldx;
    float* yt = y + t * ldy;
    switch (std::min<int64_t>(3, M - t)) {
      case 1:
        GemvRange<1>(rows, row_stride, K, n0, n1, xt, ldx, yt, ldy);
        break;
      case 2:
        GemvRange<2>(rows, row_stride, K, n0, n1, xt, ldx, yt, ldy);
        break;
      default:
        GemvRange<3>(rows, row_stride, K, n0, n1, xt, ldx, yt, ldy);
    }
  }
}

void MatMulBf16Pairs(const uint16_t* w, int64_t rows, int64_t K, int64_t g0, int64_t g1,
                     const uint16_t* xb, int64_t ldx, int64_t M, float* y, int64_t ldy) {
  const int64_t kp = K / 2, full = rows / 16, group = 16 * K;
  // Whole groups, kPairsGroups at a time against every token (the groups stay in L2 meanwhile).
  for (int64_t g = g0; g < std::min(g1, full); g += kPairsGroups) {
    const int64_t ng = std::min<int64_t>(kPairsGroups, std::min(g1, full) - g);
    for (int64_t t = 0; t < M; t += kPairsTokens) {
      const int64_t nt = std::min<int64_t>(kPairsTokens, M - t);
      kPairsTiles[ng - 1][nt - 1](w + g * group, group, 32, 0xffff, kp, xb + t * ldx, ldx,
                                  y + t * ldy + 16 * g, ldy);
    }
  }
  if (g1 > full && full * 16 < rows) {  // the ragged last group
    const int64_t lanes = rows - full * 16;
    for (int64_t t = 0; t < M; t += kPairsTokens) {
      const int64_t nt = std::min<int64_t>(kPairsTokens, M - t);
      kPairsTiles[0][nt - 1](w + full * group, group, 2 * lanes,
                             static_cast<__mmask16>((1u << lanes) - 1), kp, xb + t * ldx, ldx,
                             y + t * ldy + 16 * full, ldy);
    }
  }
}

void MicroKernelBf16Any(int64_t mr, int64_t kp, const uint16_t* a, int64_t lda,
                        const uint16_t* panel, float* y, int64_t ldy, bool accumulate) {
  kTiles[std::clamp<int64_t>(mr, 1, kMr) - 1](kp, a, lda, panel, y, ldy, accumulate);
}

void GemmBlockBf16(int64_t rows, int64_t kp, const uint16_t* a, int64_t lda, const uint16_t* panel,
                   float* y, int64_t ldy, bool accumulate) {
  int64_t r = 0;
  const int64_t kp16 = kp / 16 * 16;
  if (kp16 > 0 && UsesAmx()) {
    for (; r + 16 <= rows;) {
      const int tiles = static_cast<int>(std::min<int64_t>(3, (rows - r) / 16));
      MicroKernelBf16Amx(tiles, kp16, a + r * lda, lda, panel, y + r * ldy, ldy, accumulate);
      for (int64_t i = 0; i < 16 * tiles && kp16 < kp; i += kMr) {  // the last pairs
        MicroKernelBf16Any(std::min<int64_t>(kMr, 16 * tiles - i), kp - kp16,
                           a + (r + i) * lda + 2 * kp16, lda, panel + 32 * kp16, y + (r + i) * ldy,
                           ldy, true);
      }
      r += 16 * tiles;
    }
  }
  for (; r < rows; r += kMr) {
    MicroKernelBf16Any(std::min(kMr, rows - r), kp, a + r * lda, lda, panel, y + r * ldy, ldy,
                       accumulate);
  }
}

}  // namespace shardserve::cpu::avx512
