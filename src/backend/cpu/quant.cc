// Block-quantized weights on the CPU. Q8_0, Q4_0, Q4_1: each block of 32 values is expanded in
// registers to F32 (AVX2 + F16C); the K-quants (Q4_K, Q5_K, Q6_K): each super-block of 256 values
// is expanded to an L1-resident buffer. Either is multiplied with F32 activations, accumulating
// in F32: the result equals the dot product with the dequantized weights up to F32 rounding.
#include "backend/cpu/quant.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace shardserve::cpu {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t DTypeBlockOf(DType d) {
  return d == DType::kQ4_K || d == DType::kQ5_K || d == DType::kQ6_K ? 256 : 32;
}

inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The 32 values of one block as four vectors of 8, in order.
template <DType D>
inline void Expand(const uint8_t* b, __m256 v[4]) {
  if constexpr (D == DType::kQ8_0) {
    const __m256 d = _mm256_set1_ps(Half(b));
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i));
      v[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
  } else {
    // Byte j holds value j in its low nibble and value j + 16 in its high one.
    const uint8_t* qs = b + (D == DType::kQ4_0 ? 2 : 4);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m256 d = _mm256_set1_ps(Half(b));
    const __m256 offset =
        _mm256_set1_ps(D == DType::kQ4_0 ? -8.0f * Half(b) : Half(b + 2));  // -8d, or the min
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), d, offset);
    }
  }
}

// The scale and minimum of sub-block j (of 8) of a Q4_K / Q5_K super-block: 6 bits each, packed
// in 12 bytes (j < 4: low 6 bits of bytes j and j + 4; j >= 4: a nibble of byte j + 4 and the top
// 2 bits of bytes j - 4 and j).
inline void ScaleMin(const uint8_t* sc, int j, int* scale, int* min) {
  if (j < 4) {
    *scale = sc[j] & 63;
    *min = sc[j + 4] & 63;
  } else {
    *scale = (sc[j + 4] & 0x0F) | ((sc[j - 4] >> 6) << 4);
    *min = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
  }
}

// One K-quant super-block as 256 F32 values.
template <DType D>
void ExpandK(const uint8_t* b, float* y) {
  if constexpr (D == DType::kQ6_K) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = Half(b + 208);
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, y += 128) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        y[l] = d * sc[is] * (((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
        y[l + 32] = d * sc[is + 2] * (((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
        y[l + 64] = d * sc[is + 4] * (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
        y[l + 96] = d * sc[is + 6] * (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
      }
    }
  } else {
    const float d = Half(b), dmin = Half(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;                                  // Q5_K: the fifth bits
    const uint8_t* q = b + (D == DType::kQ5_K ? 48 : 16);        // low 4 bits
    for (int chunk = 0; chunk < 4; ++chunk, q += 32, y += 64) {  // 64 values: 2 sub-blocks
      int s1, m1, s2, m2;
      ScaleMin(scales, 2 * chunk, &s1, &m1);
      ScaleMin(scales, 2 * chunk + 1, &s2, &m2);
      const float d1 = d * s1, o1 = dmin * m1, d2 = d * s2, o2 = dmin * m2;
      for (int l = 0; l < 32; ++l) {
        int lo = q[l] & 0xF, hi = q[l] >> 4;
        if constexpr (D == DType::kQ5_K) {
          lo += (qh[l] >> (2 * chunk)) & 1 ? 16 : 0;
          hi += (qh[l] >> (2 * chunk + 1)) & 1 ? 16 : 0;
        }
        y[l] = d1 * lo - o1;
        y[l + 32] = d2 * hi - o2;
      }
    }
  }
}

// Decode: rows [n0, n1) against M <= kMaxDecode tokens; each block is expanded once and used by
// every token.
constexpr int64_t kMaxDecode = 12;
template <DType D>
void DecodeRange(const WeightMatrix& w, int64_t n0, int64_t n1, const float* x, int64_t M,
                 int64_t ldx, float* y, int64_t ldy) {
  const int64_t blocks = w.cols / kBlock;
  const size_t bb = DTypeBlockBytes(D);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = RowPtr(w, n);
    __m256 acc[kMaxDecode];
    for (int64_t t = 0; t < M; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m256 v[4];
      Expand<D>(row + b * bb, v);
      for (int64_t t = 0; t < M; ++t) {
        const float* xt = x + t * ldx + b * kBlock;
        __m256 a = acc[t];
        a = _mm256_fmadd_ps(v[0], _mm256_loadu_ps(xt), a);
        a = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xt + 8), a);
        a = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xt + 16), a);
        acc[t] = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xt + 24), a);
      }
    }
    for (int64_t t = 0; t < M; ++t) y[t * ldy + n] = HSum(acc[t]);
  }
}

// The K-quants' decode: each super-block expanded once to a buffer, then used by every token.
template <DType D>
void DecodeRangeK(const WeightMatrix& w, int64_t n0, int64_t n1, const float* x, int64_t M,
                  int64_t ldx, float* y, int64_t ldy) {
  constexpr int64_t kSuper = 256;
  const int64_t blocks = w.cols / kSuper;
  alignas(32) float v[kSuper];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = RowPtr(w, n);
    __m256 acc[kMaxDecode];
    for (int64_t t = 0; t < M; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      ExpandK<D>(row + b * DTypeBlockBytes(D), v);
      for (int64_t t = 0; t < M; ++t) {
        const float* xt = x + t * ldx + b * kSuper;
        __m256 a0 = acc[t], a1 = _mm256_setzero_ps();
        for (int64_t i = 0; i < kSuper; i += 16) {
          a0 = _mm256_fmadd_ps(_mm256_load_ps(v + i), _mm256_loadu_ps(xt + i), a0);
          a1 = _mm256_fmadd_ps(_mm256_load_ps(v + i + 8), _mm256_loadu_ps(xt + i + 8), a1);
        }
        acc[t] = _mm256_add_ps(a0, a1);
      }
    }
    for (int64_t t = 0; t < M; ++t) y[t * ldy + n] = HSum(acc[t]);
  }
}

template <DType D>
void DequantizeTyped(const uint8_t* row, int64_t n, float* out) {
  if constexpr (DTypeBlockOf(D) == 256) {
    for (int64_t b = 0; b < n / 256; ++b) ExpandK<D>(row + b * DTypeBlockBytes(D), out + b * 256);
  } else {
    for (int64_t b = 0; b < n / kBlock; ++b) {
      __m256 v[4];
      Expand<D>(row + b * DTypeBlockBytes(D), v);
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + b * kBlock + 8 * i, v[i]);
    }
  }
}

}  // namespace

void Dequantize(DType dtype, const void* row, int64_t n, float* out) {
  const auto* p = static_cast<const uint8_t*>(row);
  switch (dtype) {
    case DType::kQ8_0:
      return DequantizeTyped<DType::kQ8_0>(p, n, out);
    case DType::kQ4_0:
      return DequantizeTyped<DType::kQ4_0>(p, n, out);
    case DType::kQ4_1:
      return DequantizeTyped<DType::kQ4_1>(p, n, out);
    case DType::kQ4_K:
      return DequantizeTyped<DType::kQ4_K>(p, n, out);
    case DType::kQ5_K:
      return DequantizeTyped<DType::kQ5_K>(p, n, out);
    case DType::kQ6_K:
      return DequantizeTyped<DType::kQ6_K>(p, n, out);
    default:
      return;
  }
}

void MatMulQuantized(const WeightMatrix& w, const float* x, int64_t M, int64_t ldx, float* y,
                     int64_t ldy, ThreadPool& pool,
                     const std::function<void(const WeightMatrix&, const float*, int64_t, int64_t,
                                              float*, int64_t)>& gemm_f32) {
  if (M <= kMaxDecode) {
    pool.ParallelFor(w.rows, 4, [&](int, int64_t b, int64_t e) {
      switch (w.dtype) {
        case DType::kQ8_0:
          return DecodeRange<DType::kQ8_0>(w, b, e, x, M, ldx, y, ldy);
        case DType::kQ4_0:
          return DecodeRange<DType::kQ4_0>(w, b, e, x, M, ldx, y, ldy);
        case DType::kQ4_1:
          return DecodeRange<DType::kQ4_1>(w, b, e, x, M, ldx, y, ldy);
        case DType::kQ4_K:
          return DecodeRangeK<DType::kQ4_K>(w, b, e, x, M, ldx, y, ldy);
        case DType::kQ5_K:
          return DecodeRangeK<DType::kQ5_K>(w, b, e, x, M, ldx, y, ldy);
        case DType::kQ6_K:
          return DecodeRangeK<DType::kQ6_K>(w, b, e, x, M, ldx, y, ldy);
        default:
          return;
      }
    });
    return;
  }
  // Prefill: groups of rows expanded to F32 once, then the F32 GEMM over all tokens.
  constexpr int64_t kRows = 64;
  pool.ParallelFor(w.rows, kRows, [&](int, int64_t b, int64_t e) {
    std::vector<float> rows(static_cast<size_t>(std::min(kRows, e - b) * w.cols));
    for (int64_t r0 = b; r0 < e; r0 += kRows) {
      const int64_t nr = std::min(kRows, e - r0);
      for (int64_t r = 0; r < nr; ++r)
        Dequantize(w.dtype, RowPtr(w, r0 + r), w.cols, &rows[r * w.cols]);
      const WeightMatrix f32{DType::kF32, rows.data(), nr, w.cols, w.cols};
      gemm_f32(f32, x, M, ldx, y + r0, ldy);
    }
  });
}

}  // namespace shardserve::cpu
