#pragma once
// quant.cc's decode loops (DecodeRowsTyped) and the block unpacking they share with its other
// kernels, for three sources only: quant.cc (built for AVX2), quant_avxvnni.cc (AVX2 with
// AVX-VNNI) and quant_vnni.cc (built for AVX-512 with VNNI as well). Their contents are in an
// unnamed namespace, so that each source has its own copy, compiled for its instruction set: an
// inline function of one named namespace in both would be one function to the linker, which may
// keep the AVX-512 copy for the AVX2 callers. Include it from no other source.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "backend/cpu/cpu_features.h"
#include "backend/cpu/quant.h"
#include "backend/cpu/simd_x86.h"

namespace shardserve::cpu {
namespace {

constexpr int64_t kBlock = 32;
// The decode loops prefetch the row this far ahead of the block they read where the CPU wants it
// (cpu_features.h's DecodePrefetches: on the AVX2 machine where this was measured the hardware
// prefetcher alone left a third of the bandwidth unused on one sequential stream per core).
// 4 KiB, but 1 KiB for Q4_1X, whose loop reads the fastest: from a 512 MiB matrix at 4 KiB it read
// 11.1-11.3 GB/s against 13.5-14.0 at 1 KiB (one thread), where Q4_KX and Q6_KX read 10 % slower
// at 1 KiB than at 4.
template <DType D>
inline void PrefetchAhead(const uint8_t* p, size_t bytes, bool on) {
  if (!on) return;
  constexpr size_t distance = D == DType::kQ4_1X ? 1024 : 4096;
  for (size_t o = 0; o < bytes; o += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p + distance + o), _MM_HINT_T0);
  }
}
// Whether a block's 32 values are laid out as two vectors of 16 int16 holding values 0-7 and
// 16-23, then 8-15 and 24-31 (the order unpacking 32 bytes to int16 in place gives, one
// instruction a vector: Q5_K, Q6_K), rather than 0-15 and 16-31 (widening 16 bytes from memory:
// the 32-value types, Q4_K). The activations are quantized in the same order (Q4_KX: in its own,
// kTransposed; Q6_KX: in its own, kSubTransposed).
enum class Order { kInOrder, kInterleaved, kTransposed, kSubTransposed };
static_assert(static_cast<int>(Order::kInOrder) == kActivationsInOrder);
constexpr Order OrderOf(DType d) {
  return d == DType::kQ5_K || d == DType::kQ6_K     ? Order::kInterleaved
         : d == DType::kQ4_KX || d == DType::kQ4_1X ? Order::kTransposed
         : d == DType::kQ6_KX                       ? Order::kSubTransposed
                                                    : Order::kInOrder;
}
constexpr bool Interleaved(DType d) { return OrderOf(d) == Order::kInterleaved; }
// Where a Q4_KX super-block's quants start (RepackQ4K): after d, dmin, 8 scales, 8 minimums.
constexpr size_t kQ4KXQuants = 20;
// Q6_KX (RepackQ6K): int32 lane L of a half super-block's dot products is 16-value sub-block
// SubOfLane(L) of that half's 8, the order of Q6_K's merged sums (Unpacked's SubFactor).
constexpr int SubOfLane(int lane) { return 2 * (lane % 4) + lane / 4; }

inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The 8 scales and 8 minimums of a Q4_K / Q5_K super-block, 6 bits each, packed in 12 bytes:
// for j < 4 the low 6 bits of bytes j (scale) and j + 4 (minimum); for j >= 4 the nibbles of byte
// j + 4 (scale low, minimum high) with the top 2 bits of bytes j - 4 and j as their bits 4-5.
// Returned as bytes 0-7 (scales) and 8-15 (minimums). Reads 16 bytes from sc.
inline __m128i ScalesMins(const uint8_t* sc) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
  // Bytes 0-3, 8-11, 4-7, 8-11: the low bits (6 of the first and third quarter, the second's low
  // nibbles, the fourth's high ones); bytes 0-3 and 4-7 again in the second and fourth quarter:
  // their top 2 bits, moved to bits 4-5.
  const __m128i low =
      _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i top =
      _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i nibble_hi = _mm_and_si128(_mm_srli_epi16(low, 4), _mm_set1_epi32(0x0F0F0F0F));
  const __m128i lows = _mm_blend_epi32(
      _mm_and_si128(low, _mm_setr_epi32(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0)), nibble_hi, 8);
  return _mm_or_si128(lows, _mm_srli_epi16(_mm_and_si128(top, _mm_set1_epi8(-64)), 2));
}

inline __m256i Load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline __m256i Widen(const uint8_t* p) {  // 16 bytes as 16 uint16
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i Low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi16(0x0F)); }

// Chunk c (32 bytes) of the transposed layouts' quants (RepackQ4K, RepackQ4_1) as its low nibbles
// (lo: int32 lane k holds values 8c .. 8c + 3 of block k, its quad 2c) and its high ones (hi:
// values 8c + 4 .. 8c + 7, quad 2c + 1), a byte each: the transposed order's 64 bytes from 64c.
inline void Nibbles(const uint8_t* chunk, __m256i* lo, __m256i* hi) {
  const __m256i bytes = Load32(chunk), mask = _mm256_set1_epi8(0x0F);
  *lo = _mm256_and_si256(bytes, mask);
  *hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
}

// 8 blocks' 128 bytes of quants in the transposed layouts (RepackQ4K, RepackQ4_1) as F32,
// factor[k] * q + min[k] for block k.
inline void StoreTransposed(const uint8_t* quants, const float* factor, const float* min,
                            float* out) {
  // Chunk c's two quads of each block side by side (interleaved by 32 bits): its values 8c ..
  // 8c + 7 as 8 bytes, blocks 0, 1, 4, 5 in q[c][0], 2, 3, 6, 7 in q[c][1]; through memory, so
  // that they widen from there as the other types' bytes do.
  alignas(32) uint8_t q[4][2][32];
  for (int c = 0; c < 4; ++c) {
    __m256i lo, hi;
    Nibbles(quants + 32 * c, &lo, &hi);
    _mm256_store_si256(reinterpret_cast<__m256i*>(q[c][0]), _mm256_unpacklo_epi32(lo, hi));
    _mm256_store_si256(reinterpret_cast<__m256i*>(q[c][1]), _mm256_unpackhi_epi32(lo, hi));
  }
  // Kept from being forwarded in registers, which costs a shuffle more per 8 values.
  asm volatile("" : : "r"(q) : "memory");
  for (int k = 0; k < 8; ++k) {
    const __m256 f = _mm256_set1_ps(factor[k]), m = _mm256_set1_ps(min[k]);
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
          reinterpret_cast<const __m128i*>(&q[c][k % 4 / 2][16 * (k / 4) + 8 * (k % 2)])));
      _mm256_storeu_ps(out + 32 * k + 8 * c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), f, m));
    }
  }
}

// A Q4_KX super-block's 8 factors (d times its scales) and 8 minimums (-dmin times its minimums,
// a byte each): d and dmin converted by one instruction, all in registers.
inline void FactorsQ4KX(const uint8_t* b, __m256* factor, __m256* min) {
  int dm_bits;
  std::memcpy(&dm_bits, b, 4);
  const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits));  // d, dmin
  const auto floats = [](const uint8_t* bytes) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes))));
  };
  *factor = _mm256_mul_ps(_mm256_broadcastss_ps(dm), floats(b + 4));
  const __m128 neg_dmin = _mm_xor_ps(_mm_movehdup_ps(dm), _mm_set1_ps(-0.0f));
  *min = _mm256_mul_ps(_mm256_broadcastss_ps(neg_dmin), floats(b + 12));
}

// One weight block of D (32 values, or a K-quant super-block holding 8 blocks of 32). Block j's
// weights are factor * q + min[j], with q the 32 integers Values(j) gives as two vectors of 16
// int16 (in D's order, Interleaved). The factor is factor[j], but Q6_K's scales hold for 16 values:
// factor[SubFactor(s)] for its values 16s .. 16s + 15.
template <DType D>
struct Unpacked {
  static constexpr DType kType = D;
  static constexpr int kSub = static_cast<int>(DTypeBlock(D) / kBlock);
  static constexpr int kFactors = FileType(D) == DType::kQ6_K ? 16 : kSub;
  const uint8_t* b;
  alignas(32) float factor[kFactors];
  alignas(32) float min[kSub];  // HasMin only

  // Q6_K's factors are kept in the order of DecodeRange's merged sums: the even 16-value
  // sub-blocks of the first half of the super-block, its odd ones, then the same for the second
  // half.
  static constexpr int SubFactor(int s) { return s / 8 * 8 + s % 2 * 4 + s % 8 / 2; }

  explicit Unpacked(const uint8_t* block) : b(block) {
    if constexpr (D == DType::kQ8_0) {
      factor[0] = Half(b);
    } else if constexpr (D == DType::kQ4_0) {  // d * (q - 8): the minimum -8d
      factor[0] = Half(b);
      min[0] = -8.0f * factor[0];
    } else if constexpr (D == DType::kQ4_1) {
      factor[0] = Half(b);
      min[0] = Half(b + 2);
    } else if constexpr (FileType(D) == DType::kQ6_K) {  // Q6_KX keeps them where Q6_K does
      const __m128i sc =
          _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)),
                           _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
      const __m256 d = _mm256_set1_ps(Half(b + 208));
      _mm256_store_ps(factor, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
      _mm256_store_ps(
          factor + 8,
          _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
    } else if constexpr (D == DType::kQ4_KX) {
      __m256 f, m;
      FactorsQ4KX(b, &f, &m);
      _mm256_storeu_ps(factor, f);
      _mm256_storeu_ps(min, m);
    } else {  // Q4_K, Q5_K
      const __m128i sm = ScalesMins(b + 4);
      const auto floats = [](__m128i bytes) {
        return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
      };
      _mm256_storeu_ps(factor, _mm256_mul_ps(_mm256_set1_ps(Half(b)), floats(sm)));
      _mm256_storeu_ps(min,
                       _mm256_mul_ps(_mm256_set1_ps(-Half(b + 2)), floats(_mm_srli_si128(sm, 8))));
    }
  }

  template <int j>
  void Values(__m256i* lo, __m256i* hi) const {
    if constexpr (D == DType::kQ8_0) {
      *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)));
      *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)));
    } else if constexpr (D == DType::kQ4_0 || D == DType::kQ4_1) {
      // Byte i holds value i in its low nibble and value i + 16 in its high one.
      const __m256i bytes = Widen(b + (D == DType::kQ4_0 ? 2 : 4));
      *lo = Low4(bytes);
      *hi = _mm256_srli_epi16(bytes, 4);
    } else if constexpr (D == DType::kQ6_K) {
      // Per half of 128 values: block 0 is the low nibbles of ql[0..31] with bits 0-1 of qh,
      // block 1 the low nibbles of ql[32..63] with bits 2-3, blocks 2 and 3 the high nibbles
      // with bits 4-5 and 6-7.
      constexpr int h = j / 4, i = j % 4;
      const __m256i l = Load32(b + 64 * h + 32 * (i % 2));
      const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
      const __m256i low = _mm256_and_si256(i < 2 ? l : _mm256_srli_epi16(l, 4), m4);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(Load32(b + 128 + 32 * h), 2 * i), m2);
      const __m256i q =
          _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
      const __m256i sign = _mm256_cmpgt_epi8(_mm256_setzero_si256(), q);
      *lo = _mm256_unpacklo_epi8(q, sign);
      *hi = _mm256_unpackhi_epi8(q, sign);
    } else if constexpr (D == DType::kQ4_K) {
      // Chunk c of 64 values: block 2c the low nibbles of its 32 bytes, 2c + 1 the high ones.
      const uint8_t* chunk = b + 16 + 32 * (j / 2);
      const __m256i first = Widen(chunk), second = Widen(chunk + 16);
      *lo = j % 2 == 0 ? Low4(first) : _mm256_srli_epi16(first, 4);
      *hi = j % 2 == 0 ? Low4(second) : _mm256_srli_epi16(second, 4);
    } else {
      // Q5_K: chunk c of 64 values: block 2c the low nibbles of its 32 bytes, 2c + 1 the high
      // ones, with bit j of qh the fifth bit of block j.
      const __m256i bytes = Load32(b + 48 + 32 * (j / 2));
      __m256i q = _mm256_and_si256(j % 2 == 0 ? bytes : _mm256_srli_epi16(bytes, 4),
                                   _mm256_set1_epi8(0x0F));
      const __m256i bit =
          _mm256_and_si256(_mm256_srli_epi16(Load32(b + 16), j), _mm256_set1_epi8(1));
      q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
      *lo = _mm256_unpacklo_epi8(q, _mm256_setzero_si256());
      *hi = _mm256_unpackhi_epi8(q, _mm256_setzero_si256());
    }
  }

  // The blocks as 32 F32 values each. The 4-bit types and Q8_0 widen 8 bytes at a time straight
  // to int32 (no int16 step): 0.48 -> 0.33 cycles a value for Q4_K.
  void Store(float* out) const {
    if constexpr (D == DType::kQ4_0 || D == DType::kQ4_1 || D == DType::kQ4_K) {
      // 8 bytes give 8 values of their low nibbles and 8 of their high ones: Q4_0, Q4_1 values
      // i and i + 16 of the block; Q4_K value i of blocks 2c and 2c + 1 of chunk c.
      const uint8_t* qs = b + (D == DType::kQ4_0 ? 2 : D == DType::kQ4_1 ? 4 : 16);
      constexpr int kChunks = D == DType::kQ4_K ? 4 : 1, kBytes = D == DType::kQ4_K ? 32 : 16;
      for (int c = 0; c < kChunks; ++c) {
        const int lo = kChunks == 1 ? 0 : 2 * c, hi = kChunks == 1 ? 0 : 2 * c + 1;
        const __m256 f_lo = _mm256_set1_ps(factor[lo]), m_lo = _mm256_set1_ps(min[lo]);
        const __m256 f_hi = _mm256_set1_ps(factor[hi]), m_hi = _mm256_set1_ps(min[hi]);
        float* lo_out = out + (kChunks == 1 ? 0 : lo * kBlock);
        float* hi_out = out + (kChunks == 1 ? 16 : hi * kBlock);
        for (int g = 0; g < kBytes; g += 8) {
          const __m256i v = _mm256_cvtepu8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + c * kBytes + g)));
          const __m256 low = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0F)));
          const __m256 high = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
          _mm256_storeu_ps(lo_out + g, _mm256_fmadd_ps(low, f_lo, m_lo));
          _mm256_storeu_ps(hi_out + g, _mm256_fmadd_ps(high, f_hi, m_hi));
        }
      }
    } else if constexpr (D == DType::kQ4_KX) {
      StoreTransposed(b + kQ4KXQuants, factor, min, out);
    } else if constexpr (D == DType::kQ8_0) {
      const __m256 f = _mm256_set1_ps(factor[0]);
      for (int g = 0; g < kBlock; g += 8) {
        const __m256i v =
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + g)));
        _mm256_storeu_ps(out + g, _mm256_mul_ps(_mm256_cvtepi32_ps(v), f));
      }
    } else {
      [&]<int... J>(std::integer_sequence<int, J...>) { (StoreBlock<J>(out + J * kBlock), ...); }
      (std::make_integer_sequence<int, kSub>());
    }
  }

  template <int j>
  void StoreBlock(float* out) const {
    __m256i parts[2];
    Values<j>(&parts[0], &parts[1]);
    for (int i = 0; i < 4; ++i) {  // values 8i .. 8i + 7
      const __m256 f =
          _mm256_set1_ps(D == DType::kQ6_K ? factor[SubFactor(2 * j + i / 2)] : factor[j]);
      const __m256i part = parts[Interleaved(D) ? i % 2 : i / 2];
      const bool upper = Interleaved(D) ? i >= 2 : i % 2 == 1;
      const __m128i half = upper ? _mm256_extracti128_si256(part, 1) : _mm256_castsi256_si128(part);
      const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(half));
      _mm256_storeu_ps(out + 8 * i, HasMin(D) ? _mm256_fmadd_ps(q, f, _mm256_set1_ps(min[j]))
                                              : _mm256_mul_ps(q, f));
    }
  }
};

// acc + the pair products of a and b (int16) summed in int32 lanes: AVX512-VNNI's vpdpwssd where
// the source is built for it (quant_vnni.cc), AVX-VNNI's (its VEX form) where built for that
// (quant_avxvnni.cc), else madd and add; the same sums (none overflows: the activations stay
// within +-32767).
inline __m256i DotAdd(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__)
  return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// acc + the products of the unsigned bytes u and the signed bytes v summed in fours into int32
// lanes: AVX512-VNNI's vpdpbusd (quant_vnni.cc alone: DecodeRange's int8 path).
#ifdef __AVX512VNNI__
inline __m256i DotAddBytes(__m256i acc, __m256i u, __m256i v) {
  return _mm256_dpbusd_epi32(acc, u, v);
}
#else
// quant.cc (AVX2) never instantiates DecodeRange's int8 path: declared for its name lookup only.
template <typename V>
V DotAddBytes(V acc, V u, V v);
#endif

// The 32 values of a block of a 32-value type as bytes, in order: Q8_0's signed, Q4_0's and
// Q4_1's unsigned (0-15; byte i holds value i in its low nibble, value i + 16 in its high one).
template <DType D>
inline __m256i BlockBytes(const uint8_t* b) {
  if constexpr (D == DType::kQ8_0) {
    return Load32(b + 2);
  } else {
    const __m128i v =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (D == DType::kQ4_0 ? 2 : 4)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
  }
}

// Half h (values 128h .. 128h + 127) of a Q6_KX super-block (RepackQ6K) as 4 vectors of 32
// signed values (q - 32; kCentered false: q, 0 .. 63): vector i's byte p holds value 4i + 2 (p %
// 16 / 8) + p % 2 of 16-value sub-block SubOfLane(L) of the half, L = (p % 8 + 8 (p / 16)) / 2:
// unpacked to int16 in place (with the sign), the pair in int32 lane L is that sub-block's.
template <bool kCentered = true>
inline void SixBitValues(const uint8_t* b, int h, __m256i v[4]) {
  const __m256i l0 = Load32(b + 64 * h), l1 = Load32(b + 64 * h + 32);
  const __m256i top = Load32(b + 128 + 32 * h);  // bits 2i, 2i + 1: vector i's top two bits
  const auto value = [](__m256i low, __m256i high) {
    const __m256i q = _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi8(0x0F)),
                                      _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
    return kCentered ? _mm256_sub_epi8(q, _mm256_set1_epi8(32)) : q;
  };
  v[0] = value(l0, _mm256_slli_epi16(top, 4));
  v[1] = value(l1, _mm256_slli_epi16(top, 2));
  v[2] = value(_mm256_srli_epi16(l0, 4), top);
  v[3] = value(_mm256_srli_epi16(l1, 4), _mm256_srli_epi16(top, 2));
}

// Half h (values 128h .. 128h + 127) of a Q6_KX super-block: f(L, bytes) for each lane L, with
// bytes the 16 signed values of the half's 16-value sub-block SubOfLane(L), in order.
template <typename F>
inline void SubBlocksQ6KX(const uint8_t* b, int h, F f) {
  __m256i v[4];
  SixBitValues(b, h, v);
  // Dword L of each 128-bit lane: values 4i .. 4i + 3 of sub-block SubOfLane(L); then those of
  // the 4 vectors side by side, sub-block SubOfLane(g + 4 lane) in vector g.
  const __m256i gather = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15, 0,
                                          1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
  for (__m256i& x : v) x = _mm256_shuffle_epi8(x, gather);
  const __m256i a = _mm256_unpacklo_epi32(v[0], v[1]), c = _mm256_unpacklo_epi32(v[2], v[3]);
  const __m256i e = _mm256_unpackhi_epi32(v[0], v[1]), g = _mm256_unpackhi_epi32(v[2], v[3]);
  const __m256i subs[4] = {_mm256_unpacklo_epi64(a, c), _mm256_unpackhi_epi64(a, c),
                           _mm256_unpacklo_epi64(e, g), _mm256_unpackhi_epi64(e, g)};
  for (int i = 0; i < 4; ++i) {
    f(i, _mm256_castsi256_si128(subs[i]));
    f(i + 4, _mm256_extracti128_si256(subs[i], 1));
  }
}

// The factors and minimums of 8 consecutive blocks of a 32-value type (Unpacked's, 8 at once;
// 32-byte aligned).
template <DType D>
inline void Factors8(const uint8_t* b, float* factor, float* min) {
  constexpr size_t bb = DTypeBlockBytes(D);
  const auto bits32 = [](const uint8_t* p) {
    int v;
    std::memcpy(&v, p, 4);
    return v;
  };
  if constexpr (D == DType::kQ4_1) {  // the F16 factor and minimum: one 32-bit load a block
    // Blocks p .. p + 3 as d0 m0 d1 m1 d2 m2 d3 m3.
    const auto pairs = [&](const uint8_t* p) {
      return _mm256_cvtph_ps(
          _mm_setr_epi32(bits32(p), bits32(p + bb), bits32(p + 2 * bb), bits32(p + 3 * bb)));
    };
    const __m256 a = pairs(b), c = pairs(b + 4 * bb);
    // The shuffles give blocks 0 1 4 5 2 3 6 7; the permutation restores the order.
    const auto order = [](__m256 v) {
      return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), 0xD8));
    };
    _mm256_store_ps(factor, order(_mm256_shuffle_ps(a, c, 0x88)));
    _mm256_store_ps(min, order(_mm256_shuffle_ps(a, c, 0xDD)));
  } else {  // Q8_0, Q4_0: the F16 factor first
    const auto half = [&](int i) {
      uint16_t h;
      std::memcpy(&h, b + i * bb, 2);
      return static_cast<short>(h);
    };
    const __m256 f = _mm256_cvtph_ps(
        _mm_setr_epi16(half(0), half(1), half(2), half(3), half(4), half(5), half(6), half(7)));
    _mm256_store_ps(factor, f);
    if constexpr (D == DType::kQ4_0) _mm256_store_ps(min, _mm256_mul_ps(f, _mm256_set1_ps(-8.0f)));
  }
}

// Lane-wise sums of 8 blocks' dot products (8 int32 lanes each, two halves of 4): Merge gives
// a's and b's lanes summed in pairs, alternating a, b; Merge64 of two of those, the four blocks'
// sums of each half, in order.
inline __m256i Merge(__m256i a, __m256i b) {
  return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}
inline __m256i Merge64(__m256i a, __m256i b) {
  return _mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
}

// Decode: rows [n0, n1) against tokens [t0, t0 + MT); each weight block is unpacked once for
// all of them. kInt8 (DecodesOnInt8's types, quant_vnni.cc): the activations' int8 orders, each
// block's values as bytes multiplied by vpdpbusd (Q8_0's signs moved onto the activations, as
// llama.cpp does: |w| times x with w's sign), 32 products an instruction against 16. Blocks go in
// groups of 8 (a K-quant super-block, or 8 blocks of a 32-value type): their integer dot products
// are summed lane-wise into one vector of the 8 blocks' sums, converted and scaled once (Q6_K: two
// vectors, of its 16-value sub-blocks). No sum can overflow: at most 32 products of 2^15 with 2^7
// (2^5 times the int8 scale for Q6_K's 16).
template <DType D, int MT, bool kInt8>
void DecodeRange(const WeightMatrix& w, int64_t n0, int64_t n1, const QuantizedActivations& a,
                 int64_t t0, float* y, int64_t ldy) {
  static_assert(!kInt8 || DecodesOnInt8(D));
  constexpr int kSub = Unpacked<D>::kSub;
  constexpr int kGroup = 8;
  constexpr size_t bb = DTypeBlockBytes(D);
  const int64_t K = w.cols, xblocks = K / kBlock, wblocks = K / DTypeBlock(D);
  const size_t row_bytes = static_cast<size_t>(w.row_stride / DTypeBlock(D)) * bb;
  const bool prefetch = DecodePrefetches();
  const int16_t* xq[MT];
  const int8_t* xq8[MT];
  const int32_t* xs16[MT];  // Q6_KX's int8 path: the sums of x's 16-value sub-blocks
  const float* xd[MT];
  const float* xs[MT];
  for (int t = 0; t < MT; ++t) {
    if constexpr (kInt8) {
      xq8[t] = &a.q8[(t0 + t) * K];
      if constexpr (D == DType::kQ6_KX) xs16[t] = &a.sum16[(t0 + t) * (K / 16)];
    } else {
      xq[t] = &a.q[(t0 + t) * K];
    }
    xd[t] = &a.d[(t0 + t) * xblocks];
    xs[t] = &a.ds[(t0 + t) * xblocks];
  }
  const auto each = [](auto f) {
    [&]<int... J>(std::integer_sequence<int, J...>) { (f.template operator()<J>(), ...); }
    (std::make_integer_sequence<int, kGroup>());
  };
  // Each row's sum vector waits in pending until 8 rows are done; their horizontal sums then take
  // one tree (Sums8), not a chain each.
  __m256 pending[MT][8];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = static_cast<const uint8_t*>(w.data) + n * row_bytes;
    __m256 acc[MT], mins[MT];
    float tail[MT] = {};  // the last blocks of a row that do not fill a group
    for (int t = 0; t < MT; ++t) acc[t] = mins[t] = _mm256_setzero_ps();
    // Token t's integer dot product of block j of u with activation block xb (8 lanes).
    const auto dots = [&]<int j>(const auto& u, int64_t xb, __m256i* out) {
      if constexpr (kInt8) {
        constexpr DType B = std::remove_cvref_t<decltype(u)>::kType;
        const __m256i v = BlockBytes<B>(u.b);
        const __m256i magnitude = B == DType::kQ8_0 ? _mm256_abs_epi8(v) : v;
        for (int t = 0; t < MT; ++t) {
          __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq8[t] + xb * kBlock));
          if constexpr (B == DType::kQ8_0) x = _mm256_sign_epi8(x, v);
          out[t] = DotAddBytes(_mm256_setzero_si256(), magnitude, x);
        }
      } else {
        __m256i lo, hi;
        u.template Values<j>(&lo, &hi);
        for (int t = 0; t < MT; ++t) {
          const auto* x = reinterpret_cast<const __m256i*>(xq[t] + xb * kBlock);
          out[t] =
              DotAdd(_mm256_madd_epi16(lo, _mm256_loadu_si256(x)), hi, _mm256_loadu_si256(x + 1));
        }
      }
    };
    // Q6_K's sums of its 16 sub-blocks (in SubFactor's order, two halves) scaled into acc[t].
    const auto sixteen = [&](int t, __m256i first, __m256i second, const float* factors,
                             int64_t xb) {
      const __m256 x = _mm256_loadu_ps(xd[t] + xb);
      const __m256 f0 = _mm256_mul_ps(_mm256_load_ps(factors), _mm256_permute2f128_ps(x, x, 0));
      const __m256 f1 =
          _mm256_mul_ps(_mm256_load_ps(factors + 8), _mm256_permute2f128_ps(x, x, 0x11));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(first), f0, acc[t]);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(second), f1, acc[t]);
    };
    // A group from activation block xb: block J's dot products (block<J>(out)) merged as they
    // come, then scaled by the factors (a vector of the 8 blocks', or Q6_K's 16 sub-blocks').
    const auto group = [&](auto block, const float* factors, const float* group_mins, int64_t xb) {
      __m256i first[MT], pair[MT], quad[MT][2];
      each([&]<int J>() {
        __m256i d[MT];
        block.template operator()<J>(d);
        for (int t = 0; t < MT; ++t) {
          if constexpr (J % 2 == 0) {
            first[t] = d[t];
          } else if constexpr (J % 4 == 1) {
            pair[t] = Merge(first[t], d[t]);
          } else {
            quad[t][J / 4] = Merge64(pair[t], Merge(first[t], d[t]));
          }
        }
      });
      for (int t = 0; t < MT; ++t) {
        if constexpr (D == DType::kQ6_K) {
          sixteen(t, quad[t][0], quad[t][1], factors, xb);
        } else {
          const __m256i sums =
              _mm256_add_epi32(_mm256_permute2x128_si256(quad[t][0], quad[t][1], 0x20),
                               _mm256_permute2x128_si256(quad[t][0], quad[t][1], 0x31));
          acc[t] = _mm256_fmadd_ps(
              _mm256_cvtepi32_ps(sums),
              _mm256_mul_ps(_mm256_loadu_ps(factors), _mm256_loadu_ps(xd[t] + xb)), acc[t]);
        }
        if constexpr (HasMin(D)) {
          mins[t] =
              _mm256_fmadd_ps(_mm256_loadu_ps(group_mins), _mm256_loadu_ps(xs[t] + xb), mins[t]);
        }
      }
    };
    // The transposed layouts (Q4_KX, Q4_1X): 8 blocks' integer dot products summed lane by lane
    // (lane k: block k's, by the layout), then scaled as a group's: no merging, and the same sums
    // as the group's of the layout they were repacked from. Four chains of sums: vpdpwssd's
    // latency (4-5 cycles) on two chains bounds one thread (Zen 4, `bench kernels --threads 1`,
    // medians of 3 alternating runs, in L2: Q4_KX 27.1 -> 28.4 GB/s, Q6_KX 25.3 -> 26.0); integer
    // sums, so the order changes nothing.
    const auto transposed = [&](const uint8_t* quants, __m256 factors, __m256 group_mins,
                                int64_t xb) {
      __m256i s[4][MT], sum[MT];
      for (int t = 0; t < MT; ++t) s[0][t] = s[1][t] = s[2][t] = s[3][t] = _mm256_setzero_si256();
      if constexpr (kInt8) {
        // Chunk c's nibbles as they lie: int32 lane k of lo and hi holds block k's quads 2c and
        // 2c + 1 (Nibbles), where the transposed order has x's.
        for (int c = 0; c < 4; ++c) {
          __m256i lo, hi;
          Nibbles(quants + 32 * c, &lo, &hi);
          for (int t = 0; t < MT; ++t) {
            const auto* x = reinterpret_cast<const __m256i*>(xq8[t] + xb * kBlock + 64 * c);
            s[2 * (c % 2)][t] = DotAddBytes(s[2 * (c % 2)][t], lo, _mm256_loadu_si256(x));
            s[2 * (c % 2) + 1][t] =
                DotAddBytes(s[2 * (c % 2) + 1][t], hi, _mm256_loadu_si256(x + 1));
          }
        }
        for (int t = 0; t < MT; ++t) {
          sum[t] = _mm256_add_epi32(_mm256_add_epi32(s[0][t], s[1][t]),
                                    _mm256_add_epi32(s[2][t], s[3][t]));
        }
      } else {
        // Chunk c's 16 bytes g (blocks 4g .. 4g + 3) widened: each block's quad (low nibbles: 2c,
        // high: 2c + 1) in two int32 lanes of pair products.
        for (int c = 0; c < 4; ++c) {
          for (int g = 0; g < 2; ++g) {
            const __m256i v = Widen(quants + 32 * c + 16 * g);
            const __m256i lo = Low4(v), hi = _mm256_srli_epi16(v, 4);
            for (int t = 0; t < MT; ++t) {
              const int16_t* x = xq[t] + xb * kBlock + 64 * c + 16 * g;
              s[2 * g][t] =
                  DotAdd(s[2 * g][t], lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
              s[2 * g + 1][t] =
                  DotAdd(s[2 * g + 1][t], hi,
                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32)));
            }
          }
        }
        for (int t = 0; t < MT; ++t) {
          // Pairs of lanes summed: blocks 0, 1, 4, 5, 2, 3, 6, 7, put in order.
          const __m256i first = _mm256_add_epi32(s[0][t], s[1][t]);
          const __m256i second = _mm256_add_epi32(s[2][t], s[3][t]);
          sum[t] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(first, second), 0xD8);
        }
      }
      for (int t = 0; t < MT; ++t) {
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]),
                                 _mm256_mul_ps(factors, _mm256_loadu_ps(xd[t] + xb)), acc[t]);
        mins[t] = _mm256_fmadd_ps(group_mins, _mm256_loadu_ps(xs[t] + xb), mins[t]);
      }
    };
    if constexpr (kSub == 1) {
      int64_t wb = 0;
      for (; wb + kGroup <= wblocks; wb += kGroup) {
        const uint8_t* g = row + wb * bb;
        if constexpr (D == DType::kQ4_1X) {  // 8 F16 factors, 8 minimums, 128 bytes transposed
          PrefetchAhead<D>(g, kGroup * bb, prefetch);
          const auto halves = [](const uint8_t* p) {
            return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
          };
          transposed(g + 32, halves(g), halves(g + 16), wb);
        } else {
          alignas(32) float factors[kGroup], group_mins[kGroup];
          Factors8<D>(g, factors, group_mins);
          group(
              [&]<int J>(__m256i* d) {
                PrefetchAhead<D>(g + J * bb, bb, prefetch);
                dots.template operator()<0>(Unpacked<D>(g + J * bb), wb + J, d);
              },
              factors, group_mins, wb);
        }
      }
      for (; wb < wblocks; ++wb) {  // Q4_1X's too are Q4_1 blocks as they were
        const Unpacked<FileType(D)> u(row + wb * bb);
        __m256i d[MT];
        dots.template operator()<0>(u, wb, d);
        for (int t = 0; t < MT; ++t) {
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[t]),
                                   _mm256_set1_ps(u.factor[0] * xd[t][wb]), acc[t]);
          if constexpr (HasMin(D)) tail[t] += u.min[0] * xs[t][wb];
        }
      }
    } else {
      for (int64_t wb = 0; wb < wblocks; ++wb) {
        PrefetchAhead<D>(row + wb * bb, bb, prefetch);
        const int64_t xb = wb * kSub;
        if constexpr (D == DType::kQ4_KX) {  // its factors in registers, not through Unpacked
          __m256 factors, mins;
          FactorsQ4KX(row + wb * bb, &factors, &mins);
          transposed(row + wb * bb + kQ4KXQuants, factors, mins, xb);
        } else {
          const Unpacked<D> u(row + wb * bb);
          if constexpr (D == DType::kQ6_KX && kInt8) {
            // The values as unsigned bytes (q, not q - 32), unpacked by 16 bits: int32 lane L of
            // each of the 4 holds 4 values of sub-block SubOfLane(L) (values 0, 1, 4, 5; 2, 3, 6,
            // 7; 8, 9, 12, 13; 10, 11, 14, 15), where the int8 sub-transposed order has x's; minus
            // 32 times the sub-block's sum of x (sum16) for the centering.
            __m256i sums[2][MT];
            for (int h = 0; h < 2; ++h) {
              __m256i v[4];
              SixBitValues<false>(u.b, h, v);
              const __m256i q[4] = {
                  _mm256_unpacklo_epi16(v[0], v[1]), _mm256_unpackhi_epi16(v[0], v[1]),
                  _mm256_unpacklo_epi16(v[2], v[3]), _mm256_unpackhi_epi16(v[2], v[3])};
              for (int t = 0; t < MT; ++t) {
                const auto* x = reinterpret_cast<const __m256i*>(xq8[t] + xb * kBlock + 128 * h);
                __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
                even = DotAddBytes(even, q[0], _mm256_loadu_si256(x));
                odd = DotAddBytes(odd, q[1], _mm256_loadu_si256(x + 1));
                even = DotAddBytes(even, q[2], _mm256_loadu_si256(x + 2));
                odd = DotAddBytes(odd, q[3], _mm256_loadu_si256(x + 3));
                const __m256i sum16 =
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs16[t] + 16 * wb + 8 * h));
                sums[h][t] =
                    _mm256_sub_epi32(_mm256_add_epi32(even, odd), _mm256_slli_epi32(sum16, 5));
              }
            }
            for (int t = 0; t < MT; ++t) sixteen(t, sums[0][t], sums[1][t], u.factor, xb);
          } else if constexpr (D == DType::kQ6_KX) {
            // Lane L of half h's sums: sub-block SubOfLane(L)'s (SixBitValues), as Q6_K's merged.
            // Two chains a half (low and high bytes), as the transposed layouts' four.
            __m256i sums[2][2][MT];
            for (int h = 0; h < 2; ++h) {
              __m256i v[4];
              SixBitValues(u.b, h, v);
              for (int t = 0; t < MT; ++t) sums[h][0][t] = sums[h][1][t] = _mm256_setzero_si256();
              for (int i = 0; i < 4; ++i) {
                const __m256i sign = _mm256_cmpgt_epi8(_mm256_setzero_si256(), v[i]);
                const __m256i lo = _mm256_unpacklo_epi8(v[i], sign);
                const __m256i hi = _mm256_unpackhi_epi8(v[i], sign);
                for (int t = 0; t < MT; ++t) {
                  const auto* x =
                      reinterpret_cast<const __m256i*>(xq[t] + xb * kBlock + 128 * h + 32 * i);
                  sums[h][0][t] = DotAdd(sums[h][0][t], lo, _mm256_loadu_si256(x));
                  sums[h][1][t] = DotAdd(sums[h][1][t], hi, _mm256_loadu_si256(x + 1));
                }
              }
            }
            for (int t = 0; t < MT; ++t) {
              sixteen(t, _mm256_add_epi32(sums[0][0][t], sums[0][1][t]),
                      _mm256_add_epi32(sums[1][0][t], sums[1][1][t]), u.factor, xb);
            }
          } else {
            group([&]<int J>(__m256i* d) { dots.template operator()<J>(u, xb + J, d); }, u.factor,
                  u.min, xb);
          }
        }
      }
    }
    for (int t = 0; t < MT; ++t) {
      const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[t], mins[t]),
                                       _mm256_set_ps(0, 0, 0, 0, 0, 0, 0, tail[t]));
      pending[t][(n - n0) % 8] = sum;
    }
    if ((n - n0) % 8 == 7) {
      for (int t = 0; t < MT; ++t) _mm256_storeu_ps(y + (t0 + t) * ldy + n - 7, Sums8(pending[t]));
    }
  }
  for (int64_t n = n0 + (n1 - n0) / 8 * 8; n < n1; ++n) {
    for (int t = 0; t < MT; ++t) y[(t0 + t) * ldy + n] = PairwiseSum(pending[t][(n - n0) % 8]);
  }
}

// Rows [n0, n1) against all tokens of a, in groups of up to 3 (the rows stay in L2 for the
// groups after the first).
template <DType D, bool kInt8 = false>
void DecodeRowsTyped(const WeightMatrix& w, int64_t n0, int64_t n1, const QuantizedActivations& a,
                     int64_t M, float* y, int64_t ldy) {
  for (int64_t t = 0; t < M; t += 3) {
    switch (std::min<int64_t>(3, M - t)) {
      case 1:
        DecodeRange<D, 1, kInt8>(w, n0, n1, a, t, y, ldy);
        break;
      case 2:
        DecodeRange<D, 2, kInt8>(w, n0, n1, a, t, y, ldy);
        break;
      default:
        DecodeRange<D, 3, kInt8>(w, n0, n1, a, t, y, ldy);
    }
  }
}

}  // namespace

// DecodeRows of quant.cc built with AVX512-VNNI (quant_vnni.cc); quant.cc's DecodeRows calls it
// where the level is AVX-512 and the CPU has VNNI (cpu_features.h's UsesVnni). The same bits.
void DecodeRowsVnni(const WeightMatrix& w, int64_t n0, int64_t n1, const QuantizedActivations& a,
                    int64_t M, float* y, int64_t ldy);
// DecodeRows of quant.cc built with AVX-VNNI (quant_avxvnni.cc): at kAvx2 where the CPU has it.
void DecodeRowsAvxVnni(const WeightMatrix& w, int64_t n0, int64_t n1, const QuantizedActivations& a,
                       int64_t M, float* y, int64_t ldy);
// The int8 path (quant_vnni.cc): DecodesOnInt8's types against activations in an int8 order.
void DecodeRowsInt8(const WeightMatrix& w, int64_t n0, int64_t n1, const QuantizedActivations& a,
                    int64_t M, float* y, int64_t ldy);

}  // namespace shardserve::cpu
