#pragma once
// AVX2 helpers the x86 kernels share (kernels.cc, quant.cc, kernels_avx512.cc). In an unnamed
// namespace, so that each source has its own copy compiled for its instruction set (one inline
// function of a named namespace would be one to the linker, which may keep the AVX-512 copy for
// the AVX2 callers).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace shardserve::cpu {
namespace {

// The sum of a vector's 8 floats.
inline float HSum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

// The sum of v's 8 floats in pairs: ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)), the order
// in which Sums8 sums each of its vectors, so that a result does not depend on which of the two
// sums it (a decode row, an attention score).
inline float PairwiseSum(__m256 v) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(v, v), v);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
// Lane i: PairwiseSum(v[i]).
inline __m256 Sums8(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// An attention head's scores of n <= 8 positions from each one's 8 partial sums (part[j]): summed
// by Sums8 for 8 at once, by PairwiseSum (the same order) for fewer, into s; mx takes their
// maximum.
inline void ScoresOf(const __m256 part[8], int64_t n, float* s, float& mx) {
  if (n == 8) {
    _mm256_storeu_ps(s, Sums8(part));
  } else {
    for (int64_t j = 0; j < n; ++j) s[j] = PairwiseSum(part[j]);
  }
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
}

// Attention's loops prefetch the cached row this many positions ahead: the rows of a block of
// positions are contiguous, but the blocks are anywhere, and the hardware prefetcher starts over
// at each.
inline constexpr int64_t kKvAhead = 16;
// Prefetches position p's cached row (row_bytes) of blocks of bs positions.
inline void PrefetchKvRow(const void* const* blocks, int64_t bs, int64_t p, int64_t row_bytes) {
  const char* row = static_cast<const char*>(blocks[p / bs]) + (p % bs) * row_bytes;
  for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch(row + o, _MM_HINT_T0);
}

// Transposes the 8x8 block r[0..7] in place: r[j] gets element j of each r[i] (the packing of
// weight rows for the GEMM; any 32-bit values, moved as floats).
inline void Transpose8x8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

}  // namespace
}  // namespace shardserve::cpu
