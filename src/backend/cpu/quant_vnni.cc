// quant.cc's decode loops built for AVX-512 with VNNI (quant_decode.h's DotAdd becomes vpdpwssd,
// and the loops get AVX-512VL's 32 vector registers), and their int8 path (vpdpbusd,
// KernelLevel::kAvx512Int8), with the weights' bytes for that level's prefill (UnpackBytes):
// called only where the CPU has VNNI.
#include "backend/cpu/quant_decode.h"

namespace shardserve::cpu {

void DecodeRowsVnni(const WeightMatrix& w, int64_t n0, int64_t n1, const QuantizedActivations& a,
                    int64_t M, float* y, int64_t ldy) {
  ForQuantized(w.dtype, [&](auto d) { DecodeRowsTyped<d.value>(w, n0, n1, a, M, y, ldy); });
}

void DecodeRowsInt8(const WeightMatrix& w, int64_t n0, int64_t n1, const QuantizedActivations& a,
                    int64_t M, float* y, int64_t ldy) {
  ForQuantized(w.dtype, [&](auto d) {
    if constexpr (DecodesOnInt8(d.value)) DecodeRowsTyped<d.value, true>(w, n0, n1, a, M, y, ldy);
  });
}

namespace {

// The 128 bytes of 8 blocks' quants transposed (RepackQ4K's layout) as UnpackBytes' quads: the
// layout's nibbles as they lie (Nibbles: block b's quad u at 32u + 4b) or, in_order, transposed
// back (block b's quad u at 32b + 4u); sum[b] the block's sum.
void TransposedBytes(const uint8_t* quants, bool in_order, int8_t* q, int32_t* sum) {
  const __m256i ones = _mm256_set1_epi8(1);
  __m256i pair_sums = _mm256_setzero_si256();  // int16 lanes: block b's in lanes 2b, 2b + 1
  __m256 quads[8];                             // quad u of the 8 blocks
  for (int c = 0; c < 4; ++c) {
    __m256i lo, hi;
    Nibbles(quants + 32 * c, &lo, &hi);
    quads[2 * c] = _mm256_castsi256_ps(lo);
    quads[2 * c + 1] = _mm256_castsi256_ps(hi);
    pair_sums = _mm256_add_epi16(pair_sums, _mm256_add_epi16(_mm256_maddubs_epi16(lo, ones),
                                                             _mm256_maddubs_epi16(hi, ones)));
  }
  if (in_order) Transpose8x8(quads);  // 32-bit lanes moved as they are
  for (int u = 0; u < 8; ++u) _mm256_storeu_ps(reinterpret_cast<float*>(q + 32 * u), quads[u]);
  if (sum == nullptr) return;
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(sum),
                      _mm256_madd_epi16(pair_sums, _mm256_set1_epi16(1)));
}

// The sum of 16 signed bytes: offset by 128, summed as unsigned ones (vpsadbw), less 16 x 128.
int32_t ByteSum(__m128i v) {
  const __m128i sad = _mm_sad_epu8(_mm_xor_si128(v, _mm_set1_epi8(-128)), _mm_setzero_si128());
  return static_cast<int32_t>(_mm_cvtsi128_si64(_mm_add_epi64(sad, _mm_unpackhi_epi64(sad, sad)))) -
         16 * 128;
}

}  // namespace

void UnpackBytes(DType dtype, const void* row, int64_t n, bool in_order, int8_t* q, int32_t* sum,
                 float* factor, float* min) {
  const auto* bytes = static_cast<const uint8_t*>(row);
  if (dtype == DType::kQ4_KX) {
    for (int64_t k = 0; k < n; k += 256, bytes += DTypeBlockBytes(dtype)) {
      const Unpacked<DType::kQ4_KX> u(bytes);
      std::memcpy(factor + k / 32, u.factor, sizeof(u.factor));
      std::memcpy(min + k / 32, u.min, sizeof(u.min));
      TransposedBytes(bytes + kQ4KXQuants, in_order, q + k,
                      sum != nullptr ? sum + k / 32 : nullptr);
    }
    return;
  }
  if (dtype == DType::kQ4_1X && UnpacksTransposed(dtype, n)) {  // a group: 8 factors, 8 minimums
    for (int i = 0; i < 2; ++i) {
      _mm256_storeu_ps(
          i == 0 ? factor : min,
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes) + i)));
    }
    return TransposedBytes(bytes + 32, in_order, q, sum);
  }
  if (dtype == DType::kQ6_KX) {  // the sub-blocks' bytes in order, 16 factors a super-block
    for (int64_t k = 0; k < n; k += 256, bytes += DTypeBlockBytes(dtype), q += 256) {
      const Unpacked<DType::kQ6_KX> u(bytes);
      for (int h = 0; h < 2; ++h) {
        SubBlocksQ6KX(bytes, h, [&](int L, __m128i v) {
          const int64_t sub = 8 * h + SubOfLane(L);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * sub), v);
          factor[k / 16 + sub] = u.factor[8 * h + L];
          if (sum != nullptr) sum[k / 16 + sub] = ByteSum(v);
        });
      }
    }
    return;
  }
  if (dtype == DType::kQ8_0) {  // the file's bytes
    for (int64_t b = 0; b < n / 32; ++b, bytes += DTypeBlockBytes(dtype), q += 32) {
      factor[b] = Half(bytes);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 2));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), v);
      if (sum != nullptr) {
        sum[b] = ByteSum(_mm256_castsi256_si128(v)) + ByteSum(_mm256_extracti128_si256(v, 1));
      }
    }
    return;
  }
  // The types in order: UnpackInts' values narrowed.
  thread_local std::vector<int16_t> storage;  // n is a tile's kc (256)
  storage.resize(static_cast<size_t>(n));
  const int16_t* v = storage.data();
  UnpackInts(dtype, row, n, storage.data(), factor, min);
  if (IntGroup(dtype) == 16) {  // Q6_K's sub-blocks
    for (int64_t g = 0; g < n / 16; ++g, v += 16, q += 16) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm256_cvtepi16_epi8(a));
      if (sum == nullptr) continue;
      sum[g] = _mm512_reduce_add_epi32(
          _mm512_zextsi256_si512(_mm256_madd_epi16(a, _mm256_set1_epi16(1))));
    }
    return;
  }
  for (int64_t g = 0; g < n / 32; ++g, v += 32, q += 32) {
    const __m512i a = _mm512_loadu_si512(v);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtepi16_epi8(a));
    if (sum == nullptr) continue;
    sum[g] = _mm512_reduce_add_epi32(_mm512_madd_epi16(a, _mm512_set1_epi16(1)));
  }
}

}  // namespace shardserve::cpu
