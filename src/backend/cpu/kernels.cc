#include "backend/cpu/kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <vector>

#include "backend/cpu/cpu_features.h"
#include "backend/cpu/kernels_avx512.h"
#include "backend/cpu/kernels_internal.h"
#include "backend/cpu/quant.h"
#include "backend/cpu/simd_x86.h"

// glibc's vector expf (libmvec), the AVX2 variant of the x86-64 vector function ABI.
extern "C" __m256 _ZGVdN8v_expf(__m256 x);

namespace shardserve::cpu {
namespace {

// e^x for 8 floats (SiLU through it is within 2.6e-7 of double precision, relative; the unit
// test bounds it). SiLU and the attention's softmax: scalar std::exp was 3.5 % of a SmolLM2
// decode step at one thread.
inline __m256 Exp8(__m256 x) { return _ZGVdN8v_expf(x); }

// FP8 (DType::kF8_128): E4M3 bytes as F16 bits, sign to bit 15 and the other 7 bits to bits
// 13-7 (exponent and mantissa line up; subnormals too): the F16 is the E4M3 value times 2^-8,
// which the block's scale times 256 undoes exactly. So a weight is one rounding of value x
// scale, as FP8's expansion into F32 gives it (model/fp8.h). F8x8 puts each byte at the top of
// a 16-bit lane (s eeee mmm, then 8 zeros), shifts it right one place with its sign (s s eeee
// mmm 0...) and clears the second sign bit.
inline __m256 F8x8(const uint8_t* bytes) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
  const __m128i high = _mm_unpacklo_epi8(_mm_setzero_si128(), b);
  return _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(high, 1), _mm_set1_epi16(-0x4001)));
}
// The block of kF8_128 holding value idx of a row, and that value's place in it.
inline const uint8_t* F8Block(const void* base, int64_t idx) {
  return static_cast<const uint8_t*>(base) + idx / 128 * DTypeBlockBytes(DType::kF8_128);
}
inline float F8Scale256(const uint8_t* block) {
  float s;
  std::memcpy(&s, block, 4);
  return s * 256.0f;
}

template <DType D>
inline __m256 Load8(const void* base, int64_t idx) {
  if constexpr (D == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + idx);
  } else if constexpr (D == DType::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + idx)));
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + idx));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

template <DType D>
inline float LoadScalar(const void* base, int64_t idx) {
  if constexpr (D == DType::kF8_128) {
    const uint8_t* block = F8Block(base, idx);
    float s;
    std::memcpy(&s, block, 4);
    return F8E4M3ToF32(block[4 + idx % 128]) * s;
  } else if constexpr (D == DType::kF32) {
    return static_cast<const float*>(base)[idx];
  } else if constexpr (D == DType::kF16) {
    return F16ToF32(static_cast<const uint16_t*>(base)[idx]);
  } else {
    return Bf16ToF32(static_cast<const uint16_t*>(base)[idx]);
  }
}

// Decode path: R weight rows × MT tokens of dot products, weights read once from memory.
template <DType D, int R, int MT>
inline void GemvTile(const WeightMatrix& w, int64_t n, const float* x, int64_t ldx, float* y,
                     int64_t ldy) {
  const int64_t K = w.cols;
  const void* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = RowPtr(w, n + r);
  __m256 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < MT; ++t) acc[r][t] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 xv[MT];
    for (int t = 0; t < MT; ++t) xv[t] = _mm256_loadu_ps(x + t * ldx + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = Load8<D>(rows[r], k);
      for (int t = 0; t < MT; ++t) acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < MT; ++t) {
      float s = HSum(acc[r][t]);
      for (int64_t kk = k; kk < K; ++kk) s += LoadScalar<D>(rows[r], kk) * x[t * ldx + kk];
      y[t * ldy + n + r] = s;
    }
  }
}

// FP8 (kF8_128) decode path: GemvTile's, a block of 128 values at a time, its scale read once
// (each weight still value x scale rounded once, as Load8 gives it).
template <int R, int MT>
inline void GemvTileF8(const WeightMatrix& w, int64_t n, const float* x, int64_t ldx, float* y,
                       int64_t ldy) {
  constexpr int64_t kBytes = DTypeBlockBytes(DType::kF8_128);
  const int64_t blocks = w.cols / 128;
  const uint8_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = RowPtr(w, n + r);
  __m256 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < MT; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 scale[R];
    for (int r = 0; r < R; ++r) {
      scale[r] = _mm256_set1_ps(F8Scale256(rows[r] + b * kBytes));
      // Blocks ahead, fetched while these convert (the conversion is slow enough that the
      // hardware prefetcher alone left the rows waiting on memory).
      const char* ahead = reinterpret_cast<const char*>(rows[r] + (b + 4) * kBytes);
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
      _mm_prefetch(ahead + 128, _MM_HINT_T0);
    }
    for (int64_t k = 0; k < 128; k += 8) {
      __m256 xv[MT];
      for (int t = 0; t < MT; ++t) xv[t] = _mm256_loadu_ps(x + t * ldx + b * 128 + k);
      for (int r = 0; r < R; ++r) {
        const __m256 wv = _mm256_mul_ps(F8x8(rows[r] + b * kBytes + 4 + k), scale[r]);
        for (int t = 0; t < MT; ++t) acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < MT; ++t) y[t * ldy + n + r] = HSum(acc[r][t]);
  }
}

// BF16 decode path without shuffles: 16 BF16 weights are 8 32-bit lanes; `lane << 16` is the
// even element and `lane & 0xffff0000` the odd one, as F32. x arrives split into its even (xe)
// and odd (xo) elements, K/2 each, with row stride ldh. The tile's four streams alone leave one
// thread at 15 GB/s from memory on Zen 4 (28 GB/s read bandwidth): the next tile's rows (below
// `ahead`: the caller's rows past this block of them too) are prefetched into L2, a line each 32
// values, which brings it to 20-22 (past the block: 20.4 -> 21.7, medians of 5 alternating runs of
// `shardserve bench kernels`).
template <int R, int MT>
inline void GemvTileBf16(const WeightMatrix& w, int64_t n, int64_t ahead, const float* xe,
                         const float* xo, int64_t ldh, const float* x, int64_t ldx, float* y,
                         int64_t ldy) {
  const int64_t K = w.cols, K16 = K / 16 * 16;
  const uint16_t* rows[R];
  const char* next[R];
  for (int r = 0; r < R; ++r) {
    rows[r] = reinterpret_cast<const uint16_t*>(RowPtr(w, n + r));
    next[r] = n + R + r < ahead ? reinterpret_cast<const char*>(RowPtr(w, n + R + r)) : nullptr;
  }
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < MT; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K16; k += 16) {
    __m256 ve[MT], vo[MT];
    for (int t = 0; t < MT; ++t) {
      ve[t] = _mm256_loadu_ps(xe + t * ldh + k / 2);
      vo[t] = _mm256_loadu_ps(xo + t * ldh + k / 2);
    }
    if (k % 32 == 0) {
      for (int r = 0; r < R; ++r) {
        if (next[r] != nullptr) _mm_prefetch(next[r] + 2 * k, _MM_HINT_T1);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r] + k));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, mask));
      for (int t = 0; t < MT; ++t) {
        acc[r][t] = _mm256_fmadd_ps(even, ve[t], acc[r][t]);
        acc[r][t] = _mm256_fmadd_ps(odd, vo[t], acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < MT; ++t) {
      float s = HSum(acc[r][t]);
      for (int64_t kk = K16; kk < K; ++kk) s += Bf16ToF32(rows[r][kk]) * x[t * ldx + kk];
      y[t * ldy + n + r] = s;
    }
  }
}

// DType::kBF16X (kernels.h) at a level without BF16 dot products, in F32: a group's pair p, 16
// rows' values 2p and 2p + 1 side by side (64 bytes), times the token's x[2p] and x[2p + 1]
// broadcast, 16 rows a pass over one stream (GemvTileBf16's 4 rows read 4 streams, which Zen 4's
// prefetchers keep fed at 22-23 GB/s from memory where this one reads 24-28); four partial sums a
// row (pairs p % 4), summed at the end. A token at a time: each token's sums do not depend on
// its batch.
inline void GemvPairsGroup(const uint16_t* g, int64_t kp, const float* x, float* y) {
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 acc[4][2];
  for (auto& a : acc) a[0] = a[1] = _mm256_setzero_ps();
  const auto step = [&](int64_t p, __m256* a) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 32 * p));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 32 * p + 16));
    const __m256 xe = _mm256_broadcast_ss(x + 2 * p), xo = _mm256_broadcast_ss(x + 2 * p + 1);
    a[0] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)), xe, a[0]);
    a[1] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v1, 16)), xe, a[1]);
    a[0] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v0, mask)), xo, a[0]);
    a[1] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v1, mask)), xo, a[1]);
  };
  int64_t p = 0;
  for (; p + 4 <= kp; p += 4) {
    for (int j = 0; j < 4; ++j) step(p + j, acc[j]);
  }
  for (; p < kp; ++p) step(p, acc[0]);
  for (int h = 0; h < 2; ++h) {
    _mm256_storeu_ps(y + 8 * h, _mm256_add_ps(_mm256_add_ps(acc[0][h], acc[1][h]),
                                              _mm256_add_ps(acc[2][h], acc[3][h])));
  }
}

// Groups [g0, g1) of the kBF16X w against M tokens in F32 (GemvPairsGroup; the ragged last
// group's rows one at a time).
void GemvPairs(const WeightMatrix& w, int64_t g0, int64_t g1, const float* x, int64_t ldx,
               int64_t M, float* y, int64_t ldy) {
  const int64_t K = w.cols, kp = K / 2;
  const auto* data = static_cast<const uint16_t*>(w.data);
  std::vector<float> row;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t lanes = std::min<int64_t>(16, w.rows - 16 * g);
    for (int64_t t = 0; t < M; ++t) {
      if (lanes == 16) {
        GemvPairsGroup(data + 16 * g * K, kp, x + t * ldx, y + t * ldy + 16 * g);
        continue;
      }
      row.resize(K);
      for (int64_t r = 16 * g; r < w.rows; ++r) {
        Bf16PairsRow(w, r, row.data());
        y[t * ldy + r] = Dot(row.data(), x + t * ldx, K);
      }
    }
  }
}

template <int MT>
void GemvRangeBf16(const WeightMatrix& w, int64_t n0, int64_t n1, int64_t ahead, const float* xe,
                   const float* xo, int64_t ldh, const float* x, int64_t ldx, float* y,
                   int64_t ldy) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) GemvTileBf16<4, MT>(w, n, ahead, xe, xo, ldh, x, ldx, y, ldy);
  for (; n < n1; ++n) GemvTileBf16<1, MT>(w, n, ahead, xe, xo, ldh, x, ldx, y, ldy);
}

template <DType D, int MT>
void GemvRange(const WeightMatrix& w, int64_t n0, int64_t n1, const float* x, int64_t ldx, float* y,
               int64_t ldy) {
  int64_t n = n0;
  if constexpr (D == DType::kF8_128) {
    for (; n + 4 <= n1; n += 4) GemvTileF8<4, MT>(w, n, x, ldx, y, ldy);
    for (; n < n1; ++n) GemvTileF8<1, MT>(w, n, x, ldx, y, ldy);
  } else {
    for (; n + 4 <= n1; n += 4) GemvTile<D, 4, MT>(w, n, x, ldx, y, ldy);
    for (; n < n1; ++n) GemvTile<D, 1, MT>(w, n, x, ldx, y, ldy);
  }
}

// Prefill path: the tokens packed in panels of 16, the weights expanded a block of rows at a time
// and a micro-kernel that broadcasts them against a panel. Float dtypes: F32 panels ([k][16]),
// rows expanded to F32, 6 rows x 16 tokens of FMAs. Quantized dtypes: the activations quantized to
// int16 as decode does (pairs of values, [k / 2][16][2]), rows unpacked to int16 with their
// factors, 4 rows x 16 tokens of madd (two products an instruction, 16 an instruction against
// the FMA's 8: TinyLlama Q4_K_M prefill at 1 thread 40.8 -> 54 tok/s).
constexpr int64_t kNr = 16;
constexpr int64_t kMr = 6;
constexpr int64_t kKc = 256;
constexpr int64_t kNb = 48;  // weight rows expanded at a time: 8 micro-kernel tiles (AVX-512: 4)
// The integer micro-kernel (the quantized dtypes): 4 rows, 24 at a time (their int16 values,
// 12 KiB, and a panel of tokens, 8 KiB, stay in L1: 45.0 tok/s -> 48.5 against 48 at a time,
// TinyLlama Q4_K_M prefill at 1 thread).
constexpr int64_t kMrInt = 4;
constexpr int64_t kNbInt = 24;

// Packs rows [n, n + nr) x columns [k0, k0 + kc) of the F32 matrix x (row stride ldx) into
// panel[k][16] (rows past nr are zero), transposing 8x8 blocks in registers.
void PackPanel(const float* x, int64_t ldx, int64_t n, int64_t nr, int64_t k0, int64_t kc,
               float* panel) {
  const int64_t k8 = kc / 8 * 8;
  for (int64_t half = 0; half < kNr; half += 8) {
    const float* rows[8];
    for (int64_t i = 0; i < 8; ++i) rows[i] = half + i < nr ? x + (n + half + i) * ldx : nullptr;
    for (int64_t k = 0; k < k8; k += 8) {
      __m256 r[8];
      for (int64_t i = 0; i < 8; ++i) {
        r[i] = rows[i] != nullptr ? _mm256_loadu_ps(rows[i] + k0 + k) : _mm256_setzero_ps();
      }
      Transpose8x8(r);
      for (int64_t i = 0; i < 8; ++i) _mm256_store_ps(panel + (k + i) * kNr + half, r[i]);
    }
    for (int64_t k = k8; k < kc; ++k) {
      for (int64_t i = 0; i < 8; ++i) {
        panel[k * kNr + half + i] = rows[i] != nullptr ? rows[i][k0 + k] : 0.f;
      }
    }
  }
}

// ExpandRows of the kBF16X w (kernels.h; k0 and kc even): 8 rows' 8 pairs at a time, the 8
// loads of 8 rows' pair (32 bytes each, contiguous in a group) transposed as 32-bit values and
// each row's pairs split into F32 and interleaved back in order; the ragged last group's rows and
// a block's last pairs short of 8 one value at a time.
void ExpandPairs(const WeightMatrix& w, int64_t n, int64_t nr, int64_t k0, int64_t kc, float* out) {
  const int64_t K = w.cols;
  const auto* data = static_cast<const uint16_t*>(w.data);
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t r = 0; r < nr;) {
    const int64_t row = n + r, group = row / 16 * 16, lanes = std::min<int64_t>(16, w.rows - group);
    const uint16_t* g = data + group * K;
    if (lanes == 16 && row % 8 == 0 && r + 8 <= nr) {
      int64_t k = 0;
      for (; k + 16 <= kc; k += 16) {
        __m256 v[8];
        for (int i = 0; i < 8; ++i) {
          v[i] = _mm256_loadu_ps(
              reinterpret_cast<const float*>(g + 32 * ((k0 + k) / 2 + i) + 2 * (row - group)));
        }
        Transpose8x8(v);  // v[j]: row + j's pairs
        for (int j = 0; j < 8; ++j) {
          const __m256i u = _mm256_castps_si256(v[j]);
          const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
          const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(u, mask));
          const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
          float* o = out + (r + j) * kKc + k;
          _mm256_storeu_ps(o, _mm256_permute2f128_ps(lo, hi, 0x20));
          _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
        }
      }
      for (int j = 0; j < 8; ++j) {
        for (int64_t kk = k; kk < kc; ++kk) {
          out[(r + j) * kKc + kk] =
              Bf16ToF32(g[2 * lanes * ((k0 + kk) / 2) + 2 * (row + j - group) + (k0 + kk) % 2]);
        }
      }
      r += 8;
      continue;
    }
    for (int64_t kk = 0; kk < kc; ++kk) {
      out[r * kKc + kk] =
          Bf16ToF32(g[2 * lanes * ((k0 + kk) / 2) + 2 * (row - group) + (k0 + kk) % 2]);
    }
    ++r;
  }
}

// Rows [n, n + nr) x columns [k0, k0 + kc) of the float w as F32, row r at out + r * kKc; `wide`:
// 16-bit floats 16 at a time in AVX-512.
template <DType D>
void ExpandRows(const WeightMatrix& w, int64_t n, int64_t nr, int64_t k0, int64_t kc, float* out,
                bool wide) {
  if constexpr (D == DType::kBF16X) return ExpandPairs(w, n, nr, k0, kc, out);
  for (int64_t r = 0; r < nr; ++r, out += kKc) {
    const uint8_t* row = RowPtr(w, n + r);
    if (wide && (D == DType::kBF16 || D == DType::kF16)) {
      avx512::ExpandHalves(reinterpret_cast<const uint16_t*>(row) + k0, D == DType::kBF16, kc, out);
    } else if constexpr (D == DType::kF8_128) {  // k0 and kc multiples of 128: a block's scale once
      for (int64_t k = 0; k < kc; k += 128) {
        const uint8_t* block = F8Block(row, k0 + k);
        const __m256 scale = _mm256_set1_ps(F8Scale256(block));
        for (int64_t j = 0; j < 128; j += 8) {
          _mm256_store_ps(out + k + j, _mm256_mul_ps(F8x8(block + 4 + j), scale));
        }
      }
    } else {
      int64_t k = 0;
      for (; k + 8 <= kc; k += 8) _mm256_store_ps(out + k, Load8<D>(row, k0 + k));
      for (; k < kc; ++k) out[k] = LoadScalar<D>(row, k0 + k);
    }
  }
}

// The MR x 16 tile (MR <= 6): y[i][j] (+)= sum over k < kc of a[i][k] * panel[k][j], a's rows
// broadcast (row stride lda), y's rows at stride ldy. The accumulators are named variables: GCC
// keeps an array of them on the stack and stores every FMA result, which halves the speed.
template <int MR>
inline void MicroKernel(int64_t kc, const float* a, int64_t lda, const float* panel, float* y,
                        int64_t ldy, bool accumulate) {
  static_assert(MR >= 1 && MR <= 6);
  const __m256 zero = _mm256_setzero_ps();
  __m256 c00 = zero, c01 = zero, c10 = zero, c11 = zero, c20 = zero, c21 = zero, c30 = zero,
         c31 = zero, c40 = zero, c41 = zero, c50 = zero, c51 = zero;
  // Row i's accumulators: f(i, lo, hi) for each row of the tile.
  const auto rows = [&](auto f) {
    f(0, c00, c01);
    if constexpr (MR > 1) f(1, c10, c11);
    if constexpr (MR > 2) f(2, c20, c21);
    if constexpr (MR > 3) f(3, c30, c31);
    if constexpr (MR > 4) f(4, c40, c41);
    if constexpr (MR > 5) f(5, c50, c51);
  };
  if (accumulate) {
    rows([&](int i, __m256& lo, __m256& hi) {
      lo = _mm256_loadu_ps(y + i * ldy);
      hi = _mm256_loadu_ps(y + i * ldy + 8);
    });
  }
  const float* as[MR];
  for (int i = 0; i < MR; ++i) as[i] = a + i * lda;
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_load_ps(panel + k * kNr);
    const __m256 b1 = _mm256_load_ps(panel + k * kNr + 8);
    rows([&](int i, __m256& lo, __m256& hi) {
      const __m256 v = _mm256_broadcast_ss(as[i] + k);
      lo = _mm256_fmadd_ps(v, b0, lo);
      hi = _mm256_fmadd_ps(v, b1, hi);
    });
  }
  rows([&](int i, __m256& lo, __m256& hi) {
    _mm256_storeu_ps(y + i * ldy, lo);
    _mm256_storeu_ps(y + i * ldy + 8, hi);
  });
}

void MicroKernelAny(int64_t mr, int64_t kc, const float* a, int64_t lda, const float* panel,
                    float* y, int64_t ldy, bool acc) {
  switch (mr) {
    case 6:
      return MicroKernel<6>(kc, a, lda, panel, y, ldy, acc);
    case 5:
      return MicroKernel<5>(kc, a, lda, panel, y, ldy, acc);
    case 4:
      return MicroKernel<4>(kc, a, lda, panel, y, ldy, acc);
    case 3:
      return MicroKernel<3>(kc, a, lda, panel, y, ldy, acc);
    case 2:
      return MicroKernel<2>(kc, a, lda, panel, y, ldy, acc);
    default:
      return MicroKernel<1>(kc, a, lda, panel, y, ldy, acc);
  }
}

// The MR x 16 tile of a quantized matrix (MR <= 4) in integers: y[i][j] (+)= weight row i against
// token j over kc values. Row i: int16 values from wq + i * kKc (UnpackInts' layout: value pair
// p of group g at wq + PairAt(transposed, g, p)), a factor for each G values at
// wf + i * (kKc / 16), a minimum for each 32 at wm + i * (kKc / 32) (kMin). Token j: its pairs
// of int16 values in xq ([kc / 2][16][2]), its scale d and d * (the sum of its values) for each
// 32 in xd and xds ([kc / 32][16]). Each G values' products are summed in int32 (madd: two
// products an int32 lane; no overflow, at most 32 products of 2^15 with 2^8), then converted and
// scaled; a weight pair is broadcast against 16 tokens' pairs.
template <int G>
constexpr int64_t PairAt(bool transposed, int64_t g, int64_t p) {
  return transposed ? 16 * p + 2 * g : g * G + 2 * p;
}
// MicroKernelInt's 4-row loop: G / 2 steps of a pair of 16 tokens' values (ymm8, ymm9) against
// each row's pair broadcast (ymm10-13) into the accumulators, c += w x as DOT(x, w, c, scratch):
// madd and add, or AVX-VNNI's vpdpwssd (its VEX form, which the assembler takes by name whatever
// the source's target).
// clang-format off
#define SHARDSERVE_MADD(x, w, c, t) \
  "vpmaddwd " x ", " w ", " t "\n\t" \
  "vpaddd " t ", " c ", " c "\n\t"
#define SHARDSERVE_DPWSSD(x, w, c, t) "%{vex%} vpdpwssd " x ", " w ", " c "\n\t"
#define SHARDSERVE_INT_STEPS(DOT) \
  "1:\n\t" \
  "vmovdqu (%[x]), %%ymm8\n\t" \
  "vmovdqu 32(%[x]), %%ymm9\n\t" \
  "vpbroadcastd (%[w]), %%ymm10\n\t" \
  "vpbroadcastd %c[s1](%[w]), %%ymm11\n\t" \
  "vpbroadcastd %c[s2](%[w]), %%ymm12\n\t" \
  "vpbroadcastd %c[s3](%[w]), %%ymm13\n\t" \
  DOT("%%ymm8", "%%ymm10", "%[c00]", "%%ymm14") \
  DOT("%%ymm9", "%%ymm10", "%[c01]", "%%ymm15") \
  DOT("%%ymm8", "%%ymm11", "%[c10]", "%%ymm14") \
  DOT("%%ymm9", "%%ymm11", "%[c11]", "%%ymm15") \
  DOT("%%ymm8", "%%ymm12", "%[c20]", "%%ymm14") \
  DOT("%%ymm9", "%%ymm12", "%[c21]", "%%ymm15") \
  DOT("%%ymm8", "%%ymm13", "%[c30]", "%%ymm14") \
  DOT("%%ymm9", "%%ymm13", "%[c31]", "%%ymm15") \
  "add $64, %[x]\n\t" \
  "add %[ws], %[w]\n\t" \
  "dec %[n]\n\t" \
  "jnz 1b"
#define SHARDSERVE_INT_OPERANDS \
  [c00] "+x"(c00), [c01] "+x"(c01), [c10] "+x"(c10), [c11] "+x"(c11), [c20] "+x"(c20), \
  [c21] "+x"(c21), [c30] "+x"(c30), [c31] "+x"(c31), [x] "+r"(xp), [w] "+r"(wp), [n] "+r"(steps) \
  : [ws] "r"(wstep), [s1] "i"(2 * kKc), [s2] "i"(4 * kKc), [s3] "i"(6 * kKc) \
  : "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "cc", "memory"
// clang-format on
template <int MR, int G, bool kMin, bool kVnni>
void MicroKernelInt(int64_t kc, bool transposed, const int16_t* wq, const float* wf,
                    const float* wm, const int16_t* xq, const float* xd, const float* xds, float* y,
                    int64_t ldy, bool accumulate) {
  static_assert(MR >= 1 && MR <= 4 && (G == 16 || G == 32));
  if (!accumulate) {
    for (int i = 0; i < MR; ++i) {
      _mm256_storeu_ps(y + i * ldy, _mm256_setzero_ps());
      _mm256_storeu_ps(y + i * ldy + 8, _mm256_setzero_ps());
    }
  }
  // Named accumulators, as in MicroKernel (an array of them goes through the stack); the F32
  // results stay in y between groups.
  __m256i c00, c01, c10, c11, c20, c21, c30, c31;
  const auto rows = [&](auto f) {
    f(0, c00, c01);
    if constexpr (MR > 1) f(1, c10, c11);
    if constexpr (MR > 2) f(2, c20, c21);
    if constexpr (MR > 3) f(3, c30, c31);
  };
  const int64_t step = PairAt<G>(transposed, 0, 1);  // int16 values from one pair to the next
  for (int64_t g = 0; g < kc / G; ++g) {
    const int16_t* xg = xq + g * G * kNr;
    const int16_t* wg = wq + PairAt<G>(transposed, g, 0);
    rows([&](int, __m256i& lo, __m256i& hi) { lo = hi = _mm256_setzero_si256(); });
    if constexpr (MR == 4) {
      // In assembly: GCC holds the 8 products of a step in registers before adding them and
      // spills accumulators. The accumulators in ymm0-7, the step's values in ymm8-15.
      const int16_t* xp = xg;
      const int16_t* wp = wg;
      const int64_t wstep = 2 * step;  // bytes
      int64_t steps = G / 2;
      if constexpr (kVnni) {
        asm(SHARDSERVE_INT_STEPS(SHARDSERVE_DPWSSD) : SHARDSERVE_INT_OPERANDS);
      } else {
        asm(SHARDSERVE_INT_STEPS(SHARDSERVE_MADD) : SHARDSERVE_INT_OPERANDS);
      }
    } else {
      for (int p = 0; p < G / 2; ++p) {
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 32 * p));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 32 * p + 16));
        rows([&](int i, __m256i& lo, __m256i& hi) {
          int32_t pair;
          std::memcpy(&pair, wg + i * kKc + step * p, 4);
          const __m256i v = _mm256_set1_epi32(pair);
          lo = _mm256_add_epi32(lo, _mm256_madd_epi16(v, x0));
          hi = _mm256_add_epi32(hi, _mm256_madd_epi16(v, x1));
        });
      }
    }
    const int64_t b = g * G / 32;
    const __m256 d0 = _mm256_loadu_ps(xd + b * kNr), d1 = _mm256_loadu_ps(xd + b * kNr + 8);
    const __m256 s0 = _mm256_loadu_ps(xds + b * kNr), s1 = _mm256_loadu_ps(xds + b * kNr + 8);
    rows([&](int i, __m256i& lo, __m256i& hi) {
      const __m256 factor = _mm256_broadcast_ss(wf + i * (kKc / 16) + g);
      __m256 f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(factor, d0),
                                  _mm256_loadu_ps(y + i * ldy));
      __m256 f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(factor, d1),
                                  _mm256_loadu_ps(y + i * ldy + 8));
      if constexpr (kMin) {
        const __m256 min = _mm256_broadcast_ss(wm + i * (kKc / 32) + b);
        f0 = _mm256_fmadd_ps(min, s0, f0);
        f1 = _mm256_fmadd_ps(min, s1, f1);
      }
      _mm256_storeu_ps(y + i * ldy, f0);
      _mm256_storeu_ps(y + i * ldy + 8, f1);
    });
  }
}

template <int G, bool kMin, bool kVnni>
void MicroKernelIntAny(int64_t mr, int64_t kc, bool transposed, const int16_t* wq, const float* wf,
                       const float* wm, const int16_t* xq, const float* xd, const float* xds,
                       float* y, int64_t ldy, bool acc) {
  switch (mr) {
    case 4:
      return MicroKernelInt<4, G, kMin, kVnni>(kc, transposed, wq, wf, wm, xq, xd, xds, y, ldy,
                                               acc);
    case 3:
      return MicroKernelInt<3, G, kMin, kVnni>(kc, transposed, wq, wf, wm, xq, xd, xds, y, ldy,
                                               acc);
    case 2:
      return MicroKernelInt<2, G, kMin, kVnni>(kc, transposed, wq, wf, wm, xq, xd, xds, y, ldy,
                                               acc);
    default:
      return MicroKernelInt<1, G, kMin, kVnni>(kc, transposed, wq, wf, wm, xq, xd, xds, y, ldy,
                                               acc);
  }
}

// The tokens as the GEMM reads them: F32 panels of 16 ([M / 16 rounded up][K][16], PackTokens)
// for the float dtypes; for the quantized ones, quantized per block of 32 to int16 as decode does
// and packed in panels of 16 (PackQuantized): q [panel][K / 2][16][2] (a token's pair of values
// in each int32), d and ds [panel][K / 32][16]; for BF16 weights at KernelLevel::kAvx512Bf16,
// rounded to BF16 and packed as q is ([panel][kp / 2][16][2], K padded to kp). Tokens past M are
// zero. At KernelLevel::kAvx512Int8 (PrefillOnInt8) the quantized types' activations are int8
// (scale max|x| / 127) packed in quads, q8 [panel][K / 4][16][4], d and ds as q's: offset by 128
// (vpdpbusd's unsigned operand) unless amx (PrefillOnAmx: TDPBSSD multiplies signed bytes). In
// AMX's tiles at the int16 levels (amx, not PrefillOnInt8), the int16 values split into bytes,
// each packed as q8 is: q8 their high bytes (signed), q8_low their low bytes (unsigned).
struct PackedTokens {
  const float* f32 = nullptr;
  const int16_t* q = nullptr;
  const uint8_t* q8 = nullptr;
  const uint8_t* q8_low = nullptr;
  bool amx = false;
  const float* d = nullptr;
  const float* ds = nullptr;
  const uint16_t* bf16 = nullptr;
  int64_t kp = 0;
};

// Whether the quantized types' prefill multiplies int8 activations (avx512::MicroKernelInt8), and
// whether, at any AVX-512 level, in AMX's tiles (avx512::MicroKernelIntAmx: 16 rows a tile,
// GemmRange's blocks of kNbAmx; int8 activations without vpdpbusd's offset, int16 ones split
// into bytes).
bool PrefillOnInt8() { return ActiveKernelLevel() == KernelLevel::kAvx512Int8; }
bool PrefillOnAmx() { return ActiveKernelLevel() >= KernelLevel::kAvx512 && avx512::UsesAmxInt8(); }
constexpr int64_t kNbAmx = 32;
static_assert(kNbAmx % 16 == 0 && kNbAmx <= kNb);
// The rows GemmRange expands at a time for dtype (MatMulGroup's chunks), where amx =
// PrefillOnAmx().
constexpr int64_t BlockRows(DType dtype, bool amx) {
  return UnpacksToInts(dtype) ? (amx ? kNbAmx : kNbInt) : kNb;
}
// Whether BF16 weights take AVX512-BF16's dot products (their activations rounded to BF16).
bool Bf16Dot() { return ActiveKernelLevel() == KernelLevel::kAvx512Bf16; }
// K rounded up to 32: the length of a row of activations rounded to BF16.
constexpr int64_t Bf16Length(int64_t K) { return (K + 31) / 32 * 32; }

// Loop order (BLIS-style, the weights as the broadcast operand): for a block of kNb weight rows
// and kKc of K, expand the rows once (in L2, no transposition; F32, or the quantized types'
// int16 values with their factors), then for every token panel (in L1) run the micro-kernel on
// every 6 rows, into yt, the block's outputs transposed ([row][token], row stride mp), written
// to y once the block's K is done.
template <DType D>
void GemmRange(const WeightMatrix& w, int64_t n0, int64_t n1, const PackedTokens& x, int64_t M,
               float* y, int64_t ldy) {
  // Per-thread buffers on the heap: static thread-local storage of this size would sit on every
  // thread's stack, including small-stack threads of other libraries (civetweb's fail). The
  // quantized types' rows (kNb x kKc int16), factors and minimums fit in the F32 rows' space.
  thread_local std::vector<float> storage;
  const int64_t mp = (M + kNr - 1) / kNr * kNr, K = w.cols;
  storage.resize(kNb * kKc + kNb * mp + 16);
  float* wbuf = storage.data() + (16 - reinterpret_cast<uintptr_t>(storage.data()) / 4 % 16) % 16;
  float* yt = wbuf + kNb * kKc;
  int16_t* wq = reinterpret_cast<int16_t*>(wbuf);
  // Against activations in bytes (PrefillOnInt8, or AMX's): the rows' bytes (UnpackBytes) in the
  // first quarter, their groups' sums after; in AMX's tiles (amx) 16 rows at a time, the last
  // tile's rows past nr read from the buffer (kNb >= kNbAmx rows) and dropped.
  const bool int8 = UnpacksToInts(D) && x.q8 != nullptr;
  const bool amx = int8 && x.amx;
  int8_t* wq8 = reinterpret_cast<int8_t*>(wbuf);
  int32_t* wsum = reinterpret_cast<int32_t*>(wbuf + kNb * kKc / 4);
  float* wf = wbuf + kNb * kKc / 2;
  float* wm = wf + kNb * (kKc / 16);
  // The tiles in AVX-512 where the CPU runs it: 12 rows a float tile, 8 a quantized one, the same
  // arithmetic in the same order for each output (bit for bit the AVX2 tiles' results). BF16 at
  // kAvx512Bf16: the rows copied as they are (pairs of BF16, an odd kc's last pair padded with
  // zero) against the tokens' BF16 pairs, in AMX tiles where the CPU has them (GemmBlockBf16).
  const bool wide = ActiveKernelLevel() >= KernelLevel::kAvx512;
  // The AVX2 quantized tile with AVX-VNNI's vpdpwssd where the CPU has it: the same sums.
  const auto int_tile = !wide && UsesVnni() ? MicroKernelIntAny<IntGroup(D), HasMin(D), true>
                                            : MicroKernelIntAny<IntGroup(D), HasMin(D), false>;
  const bool bf16_dot = D == DType::kBF16 && x.bf16 != nullptr;
  uint16_t* wb = reinterpret_cast<uint16_t*>(wbuf);
  const int64_t nbr = BlockRows(D, amx);
  const int64_t mr = amx                ? 16
                     : UnpacksToInts(D) ? (wide ? avx512::kMrInt : kMrInt)
                                        : (wide ? avx512::kMr : kMr);
  for (int64_t nb = n0; nb < n1; nb += nbr) {
    const int64_t nr = std::min(nbr, n1 - nb);
    for (int64_t k0 = 0; k0 < K; k0 += kKc) {
      const int64_t kc = std::min(kKc, K - k0);
      if constexpr (UnpacksToInts(D)) {
        for (int64_t r = 0; r < nr; ++r) {
          const uint8_t* row = RowPtr(w, nb + r) + DTypeBytes(D, k0);
          if (int8) {
            UnpackBytes(D, row, kc, amx, wq8 + r * kKc, amx ? nullptr : wsum + r * (kKc / 16),
                        wf + r * (kKc / 16), wm + r * (kKc / 32));
          } else {
            UnpackInts(D, row, kc, wq + r * kKc, wf + r * (kKc / 16), wm + r * (kKc / 32));
          }
        }
      } else if (bf16_dot) {
        for (int64_t r = 0; r < nr; ++r) {
          std::memcpy(wb + r * kKc, RowPtr(w, nb + r) + DTypeBytes(D, k0), DTypeBytes(D, kc));
          if (kc % 2 != 0) wb[r * kKc + kc] = 0;
        }
      } else {
        ExpandRows<D>(w, nb, nr, k0, kc, wbuf, wide);
      }
      // The next block's weights, fetched from memory while the micro-kernel runs on these: rows
      // a kilobyte or more apart defeat the hardware prefetcher, and expanding would wait on
      // every line.
      const bool last = k0 + kKc >= K;
      const int64_t pn = last ? nb + nbr : nb, pk = last ? 0 : k0 + kKc;
      const int64_t pr = std::min(nbr, n1 - pn);
      const size_t bytes = DTypeBytes(D, std::min(kKc, K - pk));
      if constexpr (D == DType::kBF16X) {  // each group's columns [pk, pk + kKc): one range
        for (int64_t g = pn / 16; g < (pn + pr + 15) / 16; ++g) {
          const int64_t lanes = std::min<int64_t>(16, w.rows - 16 * g);
          const char* at = static_cast<const char*>(w.data) + 2 * (16 * g * K + lanes * pk);
          for (size_t o = 0; o < lanes * bytes; o += 64) _mm_prefetch(at + o, _MM_HINT_T1);
        }
      } else {
        for (int64_t r = 0; r < pr; ++r) {
          const char* row = reinterpret_cast<const char*>(RowPtr(w, pn + r)) + DTypeBytes(D, pk);
          for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(row + o, _MM_HINT_T1);
        }
      }
      for (int64_t t = 0; t < mp;) {
        if (bf16_dot) {  // the block's rows at once: AMX's tiles of 16 where the CPU has them
          avx512::GemmBlockBf16(nr, (kc + 1) / 2, wb, kKc, x.bf16 + (t / kNr * x.kp + k0) * kNr,
                                yt + t, mp, k0 > 0);
          t += kNr;
          continue;
        }
        // AVX-512's tiles take this panel and the next at once where there is a next.
        const bool pair = wide && !amx && t + kNr < mp;
        for (int64_t r = 0; r < nr; r += mr) {
          const int64_t rows = std::min(mr, nr - r);
          if constexpr (UnpacksToInts(D)) {
            const int64_t xb = (t / kNr * (K / 32) + k0 / 32) * kNr;
            if (amx) {
              const int64_t xq = (t / kNr * K + k0) * kNr;
              avx512::MicroKernelIntAmx(rows, kc, IntGroup(D), HasMin(D), wq8 + r * kKc,
                                        wf + r * (kKc / 16), wm + r * (kKc / 32), kKc,
                                        reinterpret_cast<const int8_t*>(x.q8) + xq,
                                        x.q8_low != nullptr ? x.q8_low + xq : nullptr, x.d + xb,
                                        x.ds + xb, yt + r * mp + t, mp, k0 > 0);
              continue;
            }
            if (int8) {
              avx512::MicroKernelInt8(rows, pair ? 2 : 1, kc, UnpacksTransposed(D, kc), IntGroup(D),
                                      HasMin(D), wq8 + r * kKc, wsum + r * (kKc / 16),
                                      wf + r * (kKc / 16), wm + r * (kKc / 32), kKc,
                                      x.q8 + (t / kNr * K + k0) * kNr, K * kNr, x.d + xb, x.ds + xb,
                                      K / 32 * kNr, yt + r * mp + t, mp, k0 > 0);
              continue;
            }
            if (wide) {
              avx512::MicroKernelIntAny(rows, pair ? 2 : 1, kc, UnpacksTransposed(D, kc),
                                        IntGroup(D), HasMin(D), wq + r * kKc, wf + r * (kKc / 16),
                                        wm + r * (kKc / 32), kKc, x.q + (t / kNr * K + k0) * kNr,
                                        K * kNr, x.d + xb, x.ds + xb, K / 32 * kNr, yt + r * mp + t,
                                        mp, k0 > 0);
              continue;
            }
            int_tile(rows, kc, UnpacksTransposed(D, kc), wq + r * kKc, wf + r * (kKc / 16),
                     wm + r * (kKc / 32), x.q + (t / kNr * K + k0) * kNr, x.d + xb, x.ds + xb,
                     yt + r * mp + t, mp, k0 > 0);
          } else if (wide) {
            avx512::MicroKernelAny(rows, pair ? 2 : 1, kc, wbuf + r * kKc, kKc,
                                   x.f32 + (t / kNr * K + k0) * kNr, K * kNr, yt + r * mp + t, mp,
                                   k0 > 0);
          } else {
            MicroKernelAny(rows, kc, wbuf + r * kKc, kKc, x.f32 + (t / kNr * K + k0) * kNr,
                           yt + r * mp + t, mp, k0 > 0);
          }
        }
        t += pair ? 2 * kNr : kNr;
      }
    }
    // yt to y in 8x8 blocks transposed in registers, the ragged edges one value at a time.
    const int64_t r8 = nr / 8 * 8, t8 = M / 8 * 8;
    for (int64_t r = 0; r < r8; r += 8) {
      for (int64_t t = 0; t < t8; t += 8) {
        __m256 v[8];
        for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(yt + (r + i) * mp + t);
        Transpose8x8(v);
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(y + (t + i) * ldy + nb + r, v[i]);
      }
    }
    for (int64_t r = 0; r < nr; ++r) {
      for (int64_t t = r < r8 ? t8 : 0; t < M; ++t) y[t * ldy + nb + r] = yt[r * mp + t];
    }
  }
}

// x packed for GemmRange: panels of 16 tokens, [M / 16 rounded up][K][16], tokens past M zero.
void PackTokens(const float* x, int64_t M, int64_t ldx, int64_t K, ThreadPool& pool,
                std::vector<float>* storage, float** xpack) {
  const int64_t panels = (M + kNr - 1) / kNr, kblocks = (K + kKc - 1) / kKc;
  storage->resize(panels * K * kNr + 16);
  *xpack = storage->data() + (16 - reinterpret_cast<uintptr_t>(storage->data()) / 4 % 16) % 16;
  float* out = *xpack;
  pool.ParallelFor(panels * kblocks, 1, [&](int, int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = i / kblocks * kNr, k0 = i % kblocks * kKc;
      PackPanel(x, ldx, t, std::min(kNr, M - t), k0, std::min(kKc, K - k0),
                out + (t / kNr * K + k0) * kNr);
    }
  });
}

// M rows of K 16-bit values (K a multiple of 16, row stride K) in panels of 16 rows, pairs of
// values side by side: out[panel][K / 2][16][2], rows past M zero; 8 rows' 8 pairs at a time
// transposed as 32-bit values. Run by the pool, a half panel a task.
void PackPairs(const int16_t* rows16, int64_t M, int64_t K, ThreadPool& pool, int16_t* out,
               const std::function<void(int64_t, int64_t)>& per_row = nullptr) {
  const int64_t panels = (M + kNr - 1) / kNr;
  pool.ParallelFor(panels * 2, 1, [&](int, int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t p = i / 2, half = i % 2 * 8;
      const int16_t* rows[8];
      for (int64_t j = 0; j < 8; ++j) {
        const int64_t t = p * kNr + half + j;
        rows[j] = t < M ? rows16 + t * K : nullptr;
        if (per_row) per_row(t, p * kNr + half + j);
      }
      int16_t* panel = out + p * K * kNr + 2 * half;
      for (int64_t k = 0; k < K; k += 16) {  // 8 pairs
        __m256 r[8];
        for (int j = 0; j < 8; ++j) {
          r[j] = rows[j] != nullptr ? _mm256_loadu_ps(reinterpret_cast<const float*>(rows[j] + k))
                                    : _mm256_setzero_ps();
        }
        Transpose8x8(r);
        for (int j = 0; j < 8; ++j) {
          _mm256_storeu_ps(reinterpret_cast<float*>(panel + (k / 2 + j) * 2 * kNr), r[j]);
        }
      }
    }
  });
}

// How PackQuantized packs the activations (PackedTokens): int16 pairs; int8 quads, offset by 128
// or signed; int16 values split into quads of high bytes and quads of low bytes (AMX's).
enum class Packing { kPairs, kInt8Offset, kInt8, kSplit };

// The M tokens of a (quantized in order, K values each) packed in PackedTokens' panels as
// `packing` says (kSplit: the high bytes' panels, then the low bytes'; each as many bytes as K / 2
// int16), their block scales beside them.
void PackQuantized(const QuantizedActivations& a, int64_t M, int64_t K, Packing packing,
                   ThreadPool& pool, std::vector<int16_t>* q, std::vector<float>* d,
                   std::vector<float>* ds) {
  const int64_t panels = (M + kNr - 1) / kNr, blocks = K / 32;
  q->resize(panels * K * kNr / (packing == Packing::kPairs || packing == Packing::kSplit ? 1 : 2));
  d->resize(panels * blocks * kNr);
  ds->resize(panels * blocks * kNr);
  // Token t's scales into place j of its panel (t / kNr).
  const auto scales = [&](int64_t t, int64_t j) {
    const int64_t p = j / kNr;
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const size_t at = (p * blocks + blk) * kNr + j % kNr;
      (*d)[at] = t < M ? a.d[t * blocks + blk] : 0.f;
      (*ds)[at] = t < M ? a.ds[t * blocks + blk] : 0.f;
    }
  };
  if (packing == Packing::kPairs) return PackPairs(a.q.data(), M, K, pool, q->data(), scales);
  // A quad of bytes is a pair of 16-bit values: the rows as K / 2 of those.
  if (packing == Packing::kInt8) {
    return PackPairs(reinterpret_cast<const int16_t*>(a.q8.data()), M, K / 2, pool, q->data(),
                     scales);
  }
  thread_local std::vector<uint8_t> bytes_storage;
  std::vector<uint8_t>& bytes = bytes_storage;
  const size_t n = static_cast<size_t>(M * K);
  if (packing == Packing::kInt8Offset) {
    bytes.resize(n);
    for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<uint8_t>(a.q8[i] ^ 0x80);
    return PackPairs(reinterpret_cast<const int16_t*>(bytes.data()), M, K / 2, pool, q->data(),
                     scales);
  }
  // kSplit: high bytes (arithmetic shift) and low bytes (truncation) of 32 values at a time.
  bytes.resize(2 * n);
  pool.ParallelFor(M, 1, [&](int, int64_t b, int64_t e) {
    const __m256i low = _mm256_set1_epi16(0xff);
    for (size_t i = b * K; i < static_cast<size_t>(e * K); i += 32) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.q[i]));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.q[i + 16]));
      // The packs work in 128-bit lanes: quadwords 0, 2, 1, 3 put them in order.
      const __m256i hi = _mm256_packs_epi16(_mm256_srai_epi16(v0, 8), _mm256_srai_epi16(v1, 8));
      const __m256i lo = _mm256_packus_epi16(_mm256_and_si256(v0, low), _mm256_and_si256(v1, low));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&bytes[i]),
                          _mm256_permute4x64_epi64(hi, 0xd8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&bytes[n + i]),
                          _mm256_permute4x64_epi64(lo, 0xd8));
    }
  });
  int16_t* high = q->data();
  PackPairs(reinterpret_cast<const int16_t*>(bytes.data()), M, K / 2, pool, high, scales);
  PackPairs(reinterpret_cast<const int16_t*>(bytes.data() + n), M, K / 2, pool,
            high + panels * K * kNr / 2);
}

// The M tokens of x rounded to BF16 (avx512::RoundToBf16) in PackedTokens' pair panels, K
// padded with zeros to kp (a multiple of 16).
void PackBf16(const float* x, int64_t M, int64_t ldx, int64_t K, int64_t kp, ThreadPool& pool,
              std::vector<uint16_t>* rounded, std::vector<int16_t>* out) {
  rounded->resize(M * kp);
  out->resize((M + kNr - 1) / kNr * kp * kNr);
  pool.ParallelFor(M, 1, [&](int, int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) avx512::RoundToBf16(x + t * ldx, K, kp, &(*rounded)[t * kp]);
  });
  PackPairs(reinterpret_cast<const int16_t*>(rounded->data()), M, kp, pool, out->data());
}

// Decode: rows [b, e) of an F32, F16 or BF16 w against M tokens, in groups of up to 3. BF16
// reads x split into even and odd elements (split: [M][K/2] even, then [M][K/2] odd) and
// prefetches rows below `ahead` (>= e: the rows the caller reads next).
template <DType D>
void GemvRows(const WeightMatrix& w, int64_t b, int64_t e, int64_t ahead, const float* x,
              int64_t ldx, const float* split, int64_t M, float* y, int64_t ldy) {
  const int64_t half = w.cols / 2;
  for (int64_t t = 0; t < M; t += 3) {
    const int64_t mt = std::min<int64_t>(3, M - t);
    const float* xt = x + t * ldx;
    float* yt = y + t * ldy;
    if constexpr (D == DType::kBF16) {
      const float* xe = split + t * half;
      const float* xo = split + (M + t) * half;
      // The last group's prefetches run ahead into the next block; the others' stay in this one
      // (the next group reads it again from L2).
      const int64_t limit = t + 3 >= M ? ahead : e;
      if (mt == 1) GemvRangeBf16<1>(w, b, e, limit, xe, xo, half, xt, ldx, yt, ldy);
      if (mt == 2) GemvRangeBf16<2>(w, b, e, limit, xe, xo, half, xt, ldx, yt, ldy);
      if (mt == 3) GemvRangeBf16<3>(w, b, e, limit, xe, xo, half, xt, ldx, yt, ldy);
    } else {
      if (mt == 1) GemvRange<D, 1>(w, b, e, xt, ldx, yt, ldy);
      if (mt == 2) GemvRange<D, 2>(w, b, e, xt, ldx, yt, ldy);
      if (mt == 3) GemvRange<D, 3>(w, b, e, xt, ldx, yt, ldy);
    }
  }
}

// Decode batches run in groups of up to 3 tokens over blocks of kGemvBlockRows weight rows: a
// block is read from memory once and stays in L2 for the other groups. Each token's dot products
// do not depend on the group it is in, so results are the same for every M up to
// kDecodeMaxTokens (quant.h).
constexpr int64_t kGemvBlockRows = 64;

void Decode(const MatMulTarget* targets, size_t n, const float* x, int64_t M, int64_t ldx,
            ThreadPool& pool) {
  // x as each dtype reads it, prepared once for all targets: BF16 split into even and odd
  // elements, quantized dtypes quantized per block in their order. The caller's thread-local
  // storage, which the workers read through these references.
  thread_local std::vector<float> split_storage;
  thread_local std::vector<uint16_t> bf16_storage;
  thread_local QuantizedActivations quantized_storage[kActivationOrders];
  std::vector<float>& split = split_storage;
  std::vector<uint16_t>& bf16 = bf16_storage;
  QuantizedActivations* const quantized = quantized_storage;
  bool have_split = false, have_quantized[kActivationOrders] = {};
  // BF16 weights at kAvx512Bf16: x rounded to BF16, rows of Bf16Length(K) values.
  const bool bf16_dot = Bf16Dot();
  // The targets' units (rows; kBF16X's groups of 16 rows) laid end to end by bytes: the pool
  // splits the bytes, so that a thread's share is the same amount of reading whatever the
  // dtypes; target i's unit u goes to the thread whose share holds the unit's first byte.
  std::vector<int64_t> offset(n + 1, 0), unit_bytes(n, 1), unit(n, 1);
  int64_t grain = 0;
  for (size_t i = 0; i < n; ++i) {
    const WeightMatrix& w = *targets[i].w;
    const int64_t K = w.cols;
    unit[i] = w.dtype == DType::kBF16X ? 16 : 1;
    unit_bytes[i] = unit[i] * static_cast<int64_t>(DTypeBytes(w.dtype, K));
    offset[i + 1] =
        offset[i] + (std::max<int64_t>(w.rows, 0) + unit[i] - 1) / unit[i] * unit_bytes[i];
    grain = std::max(grain, std::max<int64_t>(4, unit[i]) / unit[i] * unit_bytes[i]);
    if (bf16_dot && (w.dtype == DType::kBF16 || w.dtype == DType::kBF16X)) {
      if (!have_split) {
        have_split = true;
        bf16.resize(M * Bf16Length(K));
        for (int64_t t = 0; t < M; ++t) {
          avx512::RoundToBf16(x + t * ldx, K, Bf16Length(K), &bf16[t * Bf16Length(K)]);
        }
      }
    } else if (w.dtype == DType::kBF16 && !have_split) {
      have_split = true;
      const int64_t half = K / 2;
      split.resize(2 * M * half);
      for (int64_t t = 0; t < M; ++t) {
        for (int64_t j = 0; j < half; ++j) {
          split[t * half + j] = x[t * ldx + 2 * j];
          split[(M + t) * half + j] = x[t * ldx + 2 * j + 1];
        }
      }
    } else if (UnpacksToInts(w.dtype)) {
      const int order = ActivationOrder(w.dtype);
      if (!have_quantized[order]) {
        have_quantized[order] = true;
        QuantizeActivations(x, M, ldx, K, order, pool, &quantized[order]);
      }
    }
  }
  // Rows [b, e) of target i (kBF16X: groups), the thread's rows of it ending at `ahead` (a
  // prefetch's bound).
  const auto rows = [&](size_t i, int64_t b, int64_t e, int64_t ahead) {
    const MatMulTarget& t = targets[i];
    const WeightMatrix& w = *t.w;
    switch (w.dtype) {
      case DType::kF32:
        return GemvRows<DType::kF32>(w, b, e, ahead, x, ldx, nullptr, M, t.y, t.ldy);
      case DType::kF16:
        return GemvRows<DType::kF16>(w, b, e, ahead, x, ldx, nullptr, M, t.y, t.ldy);
      case DType::kBF16:
        if (bf16_dot) {
          return avx512::GemvBf16(static_cast<const uint16_t*>(w.data), w.row_stride, w.cols, b, e,
                                  bf16.data(), Bf16Length(w.cols), M, t.y, t.ldy);
        }
        return GemvRows<DType::kBF16>(w, b, e, ahead, x, ldx, split.data(), M, t.y, t.ldy);
      case DType::kF8_128:
        return GemvRows<DType::kF8_128>(w, b, e, ahead, x, ldx, nullptr, M, t.y, t.ldy);
      case DType::kBF16X:  // b and e: groups of 16 rows
        if (!bf16_dot) return GemvPairs(w, b, e, x, ldx, M, t.y, t.ldy);
        return avx512::MatMulBf16Pairs(static_cast<const uint16_t*>(w.data), w.rows, w.cols, b, e,
                                       bf16.data(), Bf16Length(w.cols), M, t.y, t.ldy);
      default:
        return DecodeRows(w, b, e, quantized[ActivationOrder(w.dtype)], M, t.y, t.ldy);
    }
  };
  pool.ParallelFor(offset[n], grain, [&](int, int64_t b, int64_t e) {
    for (size_t i = 0; i < n; ++i) {
      const int64_t ub = unit_bytes[i], block = kGemvBlockRows / unit[i];
      const int64_t count = (std::max<int64_t>(targets[i].w->rows, 0) + unit[i] - 1) / unit[i];
      // The first unit of target i whose first byte is at or after `at`.
      const auto first = [&](int64_t at) {
        return std::clamp<int64_t>((at - offset[i] + ub - 1) / ub, 0, count);
      };
      const int64_t u1 = first(e);
      for (int64_t nb = first(b); nb < u1; nb += block) rows(i, nb, std::min(u1, nb + block), u1);
    }
  });
}

}  // namespace

DType KeptLayout(DType file, int64_t cols) {
  // Where AMX multiplies BF16 in its tiles (GemmBlockBf16), BF16 stays in rows.
  if (file == DType::kBF16 && cols % 2 == 0 && !(Bf16Dot() && avx512::UsesAmx())) {
    return DType::kBF16X;
  }
  return KeptType(file);
}

void MatMulGroup(const MatMulTarget* targets, size_t n, const float* x, int64_t M, int64_t ldx,
                 ThreadPool& pool) {
  if (M <= 0) return;
  if (M <= kDecodeMaxTokens) return Decode(targets, n, x, M, ldx, pool);
  // The caller's; the workers read them through `packed`. The targets share K.
  thread_local std::vector<float> storage, d, ds;
  thread_local std::vector<int16_t> q, bf16;
  thread_local std::vector<uint16_t> rounded;
  thread_local QuantizedActivations quantized;
  thread_local std::vector<uint16_t> pairs_storage;
  std::vector<uint16_t>& pairs = pairs_storage;  // kBF16X's tokens: rows of Bf16Length(K) values
  PackedTokens packed;
  const bool bf16_dot = Bf16Dot();
  bool have_pairs = false;
  for (size_t i = 0; i < n; ++i) {
    const int64_t K = targets[i].w->cols;
    if (bf16_dot && targets[i].w->dtype == DType::kBF16X) {
      if (have_pairs) continue;
      have_pairs = true;
      pairs.resize(M * Bf16Length(K));
      pool.ParallelFor(M, 1, [&](int, int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
          avx512::RoundToBf16(x + t * ldx, K, Bf16Length(K), &pairs[t * Bf16Length(K)]);
        }
      });
    } else if (bf16_dot && targets[i].w->dtype == DType::kBF16) {
      if (packed.bf16 != nullptr) continue;
      packed.kp = (K + 15) / 16 * 16;
      PackBf16(x, M, ldx, K, packed.kp, pool, &rounded, &bf16);
      packed.bf16 = reinterpret_cast<const uint16_t*>(bf16.data());
    } else if (UnpacksToInts(targets[i].w->dtype) && packed.d == nullptr) {
      const bool int8 = PrefillOnInt8();
      QuantizeActivations(x, M, ldx, K, int8 ? kInt8InOrder : kActivationsInOrder, pool,
                          &quantized);
      packed.amx = PrefillOnAmx();
      const Packing packing = int8 ? (packed.amx ? Packing::kInt8 : Packing::kInt8Offset)
                                   : (packed.amx ? Packing::kSplit : Packing::kPairs);
      PackQuantized(quantized, M, K, packing, pool, &q, &d, &ds);
      if (packing == Packing::kPairs) {
        packed.q = q.data();
      } else {
        packed.q8 = reinterpret_cast<const uint8_t*>(q.data());
      }
      if (packing == Packing::kSplit) packed.q8_low = packed.q8 + (M + kNr - 1) / kNr * K * kNr;
      packed.d = d.data();
      packed.ds = ds.data();
    } else if (!UnpacksToInts(targets[i].w->dtype) && packed.f32 == nullptr) {
      float* xpack = nullptr;
      PackTokens(x, M, ldx, K, pool, &storage, &xpack);
      packed.f32 = xpack;
    }
  }
  // Rows [b, e) of target i (kBF16X: groups of 16 rows).
  const auto rows = [&](size_t i, int64_t b, int64_t e) {
    const WeightMatrix& w = *targets[i].w;
    float* y = targets[i].y;
    const int64_t ldy = targets[i].ldy;
    switch (w.dtype) {
      case DType::kF32:
        return GemmRange<DType::kF32>(w, b, e, packed, M, y, ldy);
      case DType::kF16:
        return GemmRange<DType::kF16>(w, b, e, packed, M, y, ldy);
      case DType::kBF16:
        return GemmRange<DType::kBF16>(w, b, e, packed, M, y, ldy);
      case DType::kQ8_0:
        return GemmRange<DType::kQ8_0>(w, b, e, packed, M, y, ldy);
      case DType::kQ4_0:
        return GemmRange<DType::kQ4_0>(w, b, e, packed, M, y, ldy);
      case DType::kQ4_1:
        return GemmRange<DType::kQ4_1>(w, b, e, packed, M, y, ldy);
      case DType::kQ4_K:
        return GemmRange<DType::kQ4_K>(w, b, e, packed, M, y, ldy);
      case DType::kQ5_K:
        return GemmRange<DType::kQ5_K>(w, b, e, packed, M, y, ldy);
      case DType::kQ6_K:
        return GemmRange<DType::kQ6_K>(w, b, e, packed, M, y, ldy);
      case DType::kQ4_KX:
        return GemmRange<DType::kQ4_KX>(w, b, e, packed, M, y, ldy);
      case DType::kQ4_1X:
        return GemmRange<DType::kQ4_1X>(w, b, e, packed, M, y, ldy);
      case DType::kQ6_KX:
        return GemmRange<DType::kQ6_KX>(w, b, e, packed, M, y, ldy);
      case DType::kF8_128:
        return GemmRange<DType::kF8_128>(w, b, e, packed, M, y, ldy);
      case DType::kBF16X:  // b and e: groups of 16 rows
        if (!bf16_dot)
          return GemmRange<DType::kBF16X>(w, 16 * b, std::min(w.rows, 16 * e), packed, M, y, ldy);
        return avx512::MatMulBf16Pairs(static_cast<const uint16_t*>(w.data), w.rows, w.cols, b, e,
                                       pairs.data(), Bf16Length(w.cols), M, y, ldy);
      case DType::kF8E4M3:  // never uploaded (CpuBackend::Upload refuses them)
      case DType::kU8:
      case DType::kMXFP4:
        return;
    }
  };
  // Every target's rows in chunks of GemmRange's block (kBF16X: 3 groups, the same 48 rows),
  // laid end to end and taken by whichever thread is free, so that the group needs one pass of
  // the pool and a thread slowed by something else does fewer chunks. A row's result does not
  // depend on its chunk or thread.
  std::vector<int64_t> first_chunk(n + 1, 0), units(n), chunk(n);
  for (size_t i = 0; i < n; ++i) {
    const WeightMatrix& w = *targets[i].w;
    const bool groups = w.dtype == DType::kBF16X;
    units[i] = std::max<int64_t>(groups ? (w.rows + 15) / 16 : w.rows, 0);
    chunk[i] = groups ? kNb / 16 : BlockRows(w.dtype, packed.amx);
    first_chunk[i + 1] = first_chunk[i] + (units[i] + chunk[i] - 1) / chunk[i];
  }
  pool.ParallelChunks(first_chunk[n], 1, [&](int, int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const size_t i =
          std::upper_bound(first_chunk.begin(), first_chunk.end(), c) - first_chunk.begin() - 1;
      const int64_t u0 = (c - first_chunk[i]) * chunk[i];
      rows(i, u0, std::min(units[i], u0 + chunk[i]));
    }
  });
}

void MatMul(const WeightMatrix& w, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy,
            ThreadPool& pool) {
  const MatMulTarget target{&w, y, ldy};
  MatMulGroup(&target, 1, x, M, ldx, pool);
}

void SiluMul(float* a, const float* b, int64_t n, ThreadPool& pool) {
  pool.ParallelFor(n, 4096, [&](int, int64_t begin, int64_t end) {
    int64_t i = begin;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= end; i += 8) {
      const __m256 g = _mm256_loadu_ps(a + i);
      const __m256 e = Exp8(_mm256_xor_ps(g, sign));
      _mm256_storeu_ps(
          a + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(b + i)));
    }
    for (; i < end; ++i) {
      const float g = a[i];
      a[i] = g / (1.0f + std::exp(-g)) * b[i];
    }
  });
}

float Dot(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  }
  float s = HSum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

float ExpMinusMax(float* scores, int64_t len, float mx) {
  const __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int64_t p = 0;
  for (; p + 8 <= len; p += 8) {
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + p), m));
    _mm256_storeu_ps(scores + p, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = HSum(acc);
  for (; p < len; ++p) {
    scores[p] = std::exp(scores[p] - mx);
    sum += scores[p];
  }
  return sum;
}

namespace {

// Eight cached values as floats, per dtype (KvFormat): F32; BF16 (the high half of an F32); F16
// (F16C); E4M3 moved into F16's bit places, sign to sign and exponent-mantissa under it, which
// gives every E4M3 value (subnormals too) times 2^-8 as an F16, kUnit folding the 2^8 back in.
template <DType kT>
struct KvLoad;
template <>
struct KvLoad<DType::kF32> {
  static constexpr float kUnit = 1.f;
  static __m256 Load8(const void* base, int64_t i) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  }
};
template <>
struct KvLoad<DType::kBF16> {
  static constexpr float kUnit = 1.f;
  static __m256 Load8(const void* base, int64_t i) {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};
template <>
struct KvLoad<DType::kF16> {
  static constexpr float kUnit = 1.f;
  static __m256 Load8(const void* base, int64_t i) {
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i)));
  }
};
template <>
struct KvLoad<DType::kF8E4M3> {
  static constexpr float kUnit = 256.f;
  static __m256 Load8(const void* base, int64_t i) {
    const __m128i b = _mm_cvtepu8_epi16(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(base) + i)));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
    return _mm256_cvtph_ps(h);
  }
};

// AttendGroup for hd = 8 * V8: each position's key and value rows converted once into registers
// for all G heads (scores: G rows of len), the outputs accumulated in place.
template <int V8, DType kT>
void AttendGroupFixed(const float* const* q, int64_t G, const void* const* k_blocks,
                      const void* const* v_blocks, int64_t bs, int64_t begin, int64_t len,
                      float scale, float k_scale, float v_scale, const float* sinks, float* scores,
                      float* const* out) {
  using L = KvLoad<kT>;
  constexpr int64_t hd = 8 * V8;
  const int64_t row_bytes = hd * static_cast<int64_t>(DTypeSize(kT));
  std::vector<float> qs(G * hd), mx(G);
  const float qscale = scale * k_scale * L::kUnit;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < hd; ++i) qs[g * hd + i] = q[g][i] * qscale;
    mx[g] = sinks != nullptr ? sinks[g] : -INFINITY;
    std::fill_n(out[g], hd, 0.f);
  }
  // A score's 8 partial sums wait in part (head g, position j of 8) until 8 positions are done:
  // ScoresOf then sums them in one tree a head.
  std::vector<__m256> part(G * 8);
  __m256 row[V8];
  for (int64_t p0 = begin; p0 < len; p0 += 8) {
    const int64_t n = std::min<int64_t>(8, len - p0);
    for (int64_t j = 0; j < n; ++j) {
      if (p0 + j + kKvAhead < len) PrefetchKvRow(k_blocks, bs, p0 + j + kKvAhead, row_bytes);
      const void* k = k_blocks[(p0 + j) / bs];
      const int64_t at = ((p0 + j) % bs) * hd;
      for (int i = 0; i < V8; ++i) row[i] = L::Load8(k, at + 8 * i);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qs.data() + g * hd;
        __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(qg), row[0]);
        __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(qg + 8), row[1]);
        for (int i = 2; i < V8; i += 2) {
          a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * i), row[i], a0);
          a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * i + 8), row[i + 1], a1);
        }
        part[g * 8 + j] = _mm256_add_ps(a0, a1);
      }
    }
    for (int64_t g = 0; g < G; ++g) ScoresOf(&part[g * 8], n, scores + g * len + p0, mx[g]);
  }
  std::vector<float> w(G);
  for (int64_t g = 0; g < G; ++g) {
    const float sink = sinks != nullptr ? sinks[g] : -INFINITY;
    const float sum =
        ExpMinusMax(scores + g * len + begin, len - begin, mx[g]) + std::exp(sink - mx[g]);
    w[g] = v_scale * L::kUnit / sum;
  }
  for (int64_t p = begin; p < len; ++p) {
    if (p + kKvAhead < len) PrefetchKvRow(v_blocks, bs, p + kKvAhead, row_bytes);
    const void* v = v_blocks[p / bs];
    const int64_t at = (p % bs) * hd;
    for (int i = 0; i < V8; ++i) row[i] = L::Load8(v, at + 8 * i);
    for (int64_t g = 0; g < G; ++g) {
      const __m256 wp = _mm256_set1_ps(scores[g * len + p] * w[g]);
      float* o = out[g];
      for (int i = 0; i < V8; ++i) {
        _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(wp, row[i], _mm256_loadu_ps(o + 8 * i)));
      }
    }
  }
}

template <DType kT>
void AttendGroupOf(const float* const* q, int64_t G, const void* const* k_blocks,
                   const void* const* v_blocks, int64_t bs, int64_t hd, int64_t begin, int64_t len,
                   float scale, float k_scale, float v_scale, const float* sinks, float* scores,
                   float* const* out) {
  if (hd == 64) {
    return AttendGroupFixed<8, kT>(q, G, k_blocks, v_blocks, bs, begin, len, scale, k_scale,
                                   v_scale, sinks, scores, out);
  }
  if (hd == 128) {
    return AttendGroupFixed<16, kT>(q, G, k_blocks, v_blocks, bs, begin, len, scale, k_scale,
                                    v_scale, sinks, scores, out);
  }
  AttendGroupRows(q, G, KvRows{kT, k_scale, v_scale}, k_blocks, v_blocks, bs, hd, begin, len, scale,
                  sinks, scores, out);
}

}  // namespace

void AttendGroup(const float* const* q, int64_t G, const KvRows& kv, const void* const* k_blocks,
                 const void* const* v_blocks, int64_t bs, int64_t hd, int64_t begin, int64_t len,
                 float scale, const float* sinks, float* scores, float* const* out) {
  if ((hd == 64 || hd == 128) && ActiveKernelLevel() >= KernelLevel::kAvx512) {
    return avx512::AttendGroup(q, G, kv, k_blocks, v_blocks, bs, hd, begin, len, scale, sinks,
                               scores, out);
  }
  switch (kv.dtype) {
    case DType::kBF16:
      return AttendGroupOf<DType::kBF16>(q, G, k_blocks, v_blocks, bs, hd, begin, len, scale,
                                         kv.k_scale, kv.v_scale, sinks, scores, out);
    case DType::kF16:
      return AttendGroupOf<DType::kF16>(q, G, k_blocks, v_blocks, bs, hd, begin, len, scale,
                                        kv.k_scale, kv.v_scale, sinks, scores, out);
    case DType::kF8E4M3:
      return AttendGroupOf<DType::kF8E4M3>(q, G, k_blocks, v_blocks, bs, hd, begin, len, scale,
                                           kv.k_scale, kv.v_scale, sinks, scores, out);
    default:
      return AttendGroupOf<DType::kF32>(q, G, k_blocks, v_blocks, bs, hd, begin, len, scale,
                                        kv.k_scale, kv.v_scale, sinks, scores, out);
  }
}

void Axpy(float alpha, const float* x, float* y, int64_t n) {
  const __m256 av = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace shardserve::cpu
