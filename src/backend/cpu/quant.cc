// Block-quantized weights on the CPU (Q8_0, Q4_0, Q4_1 in blocks of 32 values; the K-quants Q4_K,
// Q5_K, Q6_K in super-blocks of 256, which hold 8 blocks of 32 with their own scales).
//
// Every block of 32 weights is unpacked in registers to 32 small integers (int16), a factor and
// (Q4_0, Q4_1, Q4_K, Q5_K) a minimum: w = factor * q + min. Decode quantizes the activations per
// block of 32 to int16 with one F32 scale (max|x| / 32767) and takes integer dot products (AVX2
// madd), scaled and summed in F32; the minimum's term uses the exact block sum of the quantized
// activations. The only error beyond F32 rounding is the activations' rounding, at most half a
// step, 2^-16 of the block's largest magnitude, per value. (int8 activations, llama.cpp's choice
// for its maddubs kernels, are faster, 32 products an instruction, but move SmolLM2's logprobs by
// up to 0.6: its activations have outliers that take a block's whole int8 range.) Blocks go in
// groups of 8, whose dot products are summed lane-wise and scaled once (DecodeRange). Prefill
// (kernels.cc's GEMM) multiplies the same int16 activations with the weights unpacked to int16
// rows (UnpackInts), so both paths have the same accuracy; Dequantize (to F32: embedding rows,
// ToFloat) reads the same layouts (the 4-bit types and Q8_0 widened straight to int32).
//
// A group's 8 blocks' dot products are 8 vectors to merge into one of their sums (14 shuffles,
// 15 % of the Q4_K kernel's time), so the CPU backend keeps Q4_K as Q4_KX, Q6_K as Q6_KX and Q4_1
// as Q4_1X (RepackQ4K, RepackQ6K, RepackQ4_1): each group's quants rearranged so that each int32
// lane of a product belongs to one block (Q6_K: 16-value sub-block), and the group's products are
// summed lane by lane. Their results are the file types', bit for bit. (Q8_0 the same way read
// faster from L2 but slower from memory, and is kept as it is.)
#include "backend/cpu/quant.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "backend/cpu/simd_x86.h"

namespace shardserve::cpu {
namespace {

constexpr int64_t kBlock = 32;
// The decode loops prefetch the row this far ahead of the block they read: the hardware
// prefetcher alone leaves a third of the bandwidth unused on one sequential stream per core.
// 4 KiB, but 1 KiB for Q4_1X, whose loop reads the fastest: from a 512 MiB matrix at 4 KiB it read
// 11.1-11.3 GB/s against 13.5-14.0 at 1 KiB (one thread), where Q4_KX and Q6_KX read 10 % slower
// at 1 KiB than at 4.
template <DType D>
inline void PrefetchAhead(const uint8_t* p, size_t bytes) {
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

// 8 blocks' 128 bytes of quants in the transposed layouts (RepackQ4K, RepackQ4_1) as F32,
// factor[k] * q + min[k] for block k.
inline void StoreTransposed(const uint8_t* quants, const float* factor, const float* min,
                            float* out) {
  // 32 bytes h (16 i = 2h, then 2h + 1): the unpacks put each block's values 4i .. 4i + 3
  // (RepackQ4K) side by side, the permutation its 8 values 8h .. 8h + 7; through memory, so
  // that they widen from there as the other types' bytes do.
  alignas(32) uint8_t q[4][2][32];  // [h][blocks 0-3, 4-7][block % 4 * 8 + value % 8]
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int h = 0; h < 4; ++h) {
    const __m256i bytes = Load32(quants + 32 * h), mask = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(bytes, mask);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
    _mm256_store_si256(reinterpret_cast<__m256i*>(q[h][0]),
                       _mm256_permutevar8x32_epi32(_mm256_unpacklo_epi16(lo, hi), order));
    _mm256_store_si256(reinterpret_cast<__m256i*>(q[h][1]),
                       _mm256_permutevar8x32_epi32(_mm256_unpackhi_epi16(lo, hi), order));
  }
  // Kept from being forwarded in registers, which costs a shuffle more per 8 values.
  asm volatile("" : : "r"(q) : "memory");
  for (int k = 0; k < 8; ++k) {
    const __m256 f = _mm256_set1_ps(factor[k]), m = _mm256_set1_ps(min[k]);
    for (int h = 0; h < 4; ++h) {
      const __m256i v = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(&q[h][k / 4][k % 4 * 8])));
      _mm256_storeu_ps(out + 32 * k + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), f, m));
    }
  }
}

// One weight block of D (32 values, or a K-quant super-block holding 8 blocks of 32). Block j's
// weights are factor * q + min[j], with q the 32 integers Values(j) gives as two vectors of 16
// int16 (in D's order, Interleaved). The factor is factor[j], but Q6_K's scales hold for 16 values:
// factor[SubFactor(s)] for its values 16s .. 16s + 15.
template <DType D>
struct Unpacked {
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
    } else if constexpr (D == DType::kQ4_KX) {  // the scales and minimums a byte each
      const auto floats = [](const uint8_t* bytes) {
        return _mm256_cvtepi32_ps(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes))));
      };
      _mm256_storeu_ps(factor, _mm256_mul_ps(_mm256_set1_ps(Half(b)), floats(b + 4)));
      _mm256_storeu_ps(min, _mm256_mul_ps(_mm256_set1_ps(-Half(b + 2)), floats(b + 12)));
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

void QuantizeActivationRow(const float* x, int64_t K, bool interleaved, int16_t* q, float* d,
                           float* ds) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / kBlock; ++b, x += kBlock, q += kBlock) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float scale = _mm_cvtss_f32(m) / 32767.0f;
    const __m256 inv = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
    __m256i iv[4];
    // The largest magnitude may round to 32768; clamped, so that the sum is the stored values'.
    const __m256i top = _mm256_set1_epi32(32767), bottom = _mm256_set1_epi32(-32767);
    for (int i = 0; i < 4; ++i) {
      iv[i] = _mm256_min_epi32(
          _mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)), bottom), top);
    }
    const __m256i sum =
        _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
    // int32 -> int16: the pack interleaves 128-bit lanes, the permutation restores the order
    // (values 0-15, 16-31; interleaved: 0-7 with 16-23, 8-15 with 24-31).
    for (int i = 0; i < 2; ++i) {
      const __m256i a = interleaved ? iv[i] : iv[2 * i],
                    b = interleaved ? iv[i + 2] : iv[2 * i + 1];
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * i), p);
    }
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s = _mm_hadd_epi32(s, s);
    s = _mm_hadd_epi32(s, s);
    d[b] = scale;
    ds[b] = scale * static_cast<float>(_mm_cvtsi128_si32(s));
  }
}

// Half h (values 128h .. 128h + 127) of a Q6_KX super-block (RepackQ6K) as 4 vectors of 32
// signed values (q - 32): vector i's byte p holds value 4i + 2 (p % 16 / 8) + p % 2 of 16-value
// sub-block SubOfLane(L) of the half, L = (p % 8 + 8 (p / 16)) / 2: unpacked to int16 in place
// (with the sign), the pair in int32 lane L is that sub-block's.
inline void SixBitValues(const uint8_t* b, int h, __m256i v[4]) {
  const __m256i l0 = Load32(b + 64 * h), l1 = Load32(b + 64 * h + 32);
  const __m256i top = Load32(b + 128 + 32 * h);  // bits 2i, 2i + 1: vector i's top two bits
  const auto value = [](__m256i low, __m256i high) {
    const __m256i q = _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi8(0x0F)),
                                      _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
    return _mm256_sub_epi8(q, _mm256_set1_epi8(32));
  };
  v[0] = value(l0, _mm256_slli_epi16(top, 4));
  v[1] = value(l1, _mm256_slli_epi16(top, 2));
  v[2] = value(_mm256_srli_epi16(l0, 4), top);
  v[3] = value(_mm256_srli_epi16(l1, 4), _mm256_srli_epi16(top, 2));
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

// The sum of v's 8 floats in pairs: ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)), the order
// in which Sums8 sums each of its vectors, so that a row's result does not depend on which of the
// two sums it.
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
// all of them. Blocks go in groups of 8 (a K-quant super-block, or 8 blocks of a 32-value type):
// their integer dot products are summed lane-wise into one vector of the 8 blocks' sums, converted
// and scaled once (Q6_K: two vectors, of its 16-value sub-blocks). No sum can overflow: at most
// 32 products of 2^15 with 2^7 (2^5 times the int8 scale for Q6_K's 16).
template <DType D, int MT>
void DecodeRange(const WeightMatrix& w, int64_t n0, int64_t n1, const Q16Activations& a, int64_t t0,
                 float* y, int64_t ldy) {
  constexpr int kSub = Unpacked<D>::kSub;
  constexpr int kGroup = 8;
  constexpr size_t bb = DTypeBlockBytes(D);
  const int64_t K = w.cols, xblocks = K / kBlock, wblocks = K / DTypeBlock(D);
  const size_t row_bytes = static_cast<size_t>(w.row_stride / DTypeBlock(D)) * bb;
  const int16_t* xq[MT];
  const float* xd[MT];
  const float* xs[MT];
  for (int t = 0; t < MT; ++t) {
    xq[t] = &a.q[(t0 + t) * K];
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
      __m256i lo, hi;
      u.template Values<j>(&lo, &hi);
      for (int t = 0; t < MT; ++t) {
        const auto* x = reinterpret_cast<const __m256i*>(xq[t] + xb * kBlock);
        out[t] = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(x)),
                                  _mm256_madd_epi16(hi, _mm256_loadu_si256(x + 1)));
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
    // as the group's of the layout they were repacked from.
    const auto transposed = [&](const uint8_t* quants, __m256 factors, __m256 group_mins,
                                int64_t xb) {
      __m256i s0[MT], s1[MT];
      for (int t = 0; t < MT; ++t) s0[t] = s1[t] = _mm256_setzero_si256();
      each([&]<int I>() {
        const __m256i v = Widen(quants + 16 * I);
        const __m256i lo = Low4(v), hi = _mm256_srli_epi16(v, 4);
        for (int t = 0; t < MT; ++t) {
          const auto* x = reinterpret_cast<const __m256i*>(xq[t] + xb * kBlock + 32 * I);
          s0[t] = _mm256_add_epi32(s0[t], _mm256_madd_epi16(lo, _mm256_loadu_si256(x)));
          s1[t] = _mm256_add_epi32(s1[t], _mm256_madd_epi16(hi, _mm256_loadu_si256(x + 1)));
        }
      });
      for (int t = 0; t < MT; ++t) {
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0[t], s1[t])),
                                 _mm256_mul_ps(factors, _mm256_loadu_ps(xd[t] + xb)), acc[t]);
        mins[t] = _mm256_fmadd_ps(group_mins, _mm256_loadu_ps(xs[t] + xb), mins[t]);
      }
    };
    if constexpr (kSub == 1) {
      int64_t wb = 0;
      for (; wb + kGroup <= wblocks; wb += kGroup) {
        const uint8_t* g = row + wb * bb;
        if constexpr (D == DType::kQ4_1X) {  // 8 F16 factors, 8 minimums, 128 bytes transposed
          PrefetchAhead<D>(g, kGroup * bb);
          const auto halves = [](const uint8_t* p) {
            return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
          };
          transposed(g + 32, halves(g), halves(g + 16), wb);
        } else {
          alignas(32) float factors[kGroup], group_mins[kGroup];
          Factors8<D>(g, factors, group_mins);
          group(
              [&]<int J>(__m256i* d) {
                PrefetchAhead<D>(g + J * bb, bb);
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
        PrefetchAhead<D>(row + wb * bb, bb);
        const Unpacked<D> u(row + wb * bb);
        const int64_t xb = wb * kSub;
        if constexpr (D == DType::kQ4_KX) {
          transposed(u.b + kQ4KXQuants, _mm256_loadu_ps(u.factor), _mm256_loadu_ps(u.min), xb);
        } else if constexpr (D == DType::kQ6_KX) {
          // Lane L of half h's sums: sub-block SubOfLane(L)'s (SixBitValues), as Q6_K's merged.
          __m256i sums[2][MT];
          for (int h = 0; h < 2; ++h) {
            __m256i v[4];
            SixBitValues(u.b, h, v);
            for (int t = 0; t < MT; ++t) sums[h][t] = _mm256_setzero_si256();
            for (int i = 0; i < 4; ++i) {
              const __m256i sign = _mm256_cmpgt_epi8(_mm256_setzero_si256(), v[i]);
              const __m256i lo = _mm256_unpacklo_epi8(v[i], sign);
              const __m256i hi = _mm256_unpackhi_epi8(v[i], sign);
              for (int t = 0; t < MT; ++t) {
                const auto* x =
                    reinterpret_cast<const __m256i*>(xq[t] + xb * kBlock + 128 * h + 32 * i);
                sums[h][t] = _mm256_add_epi32(
                    sums[h][t], _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(x)),
                                                 _mm256_madd_epi16(hi, _mm256_loadu_si256(x + 1))));
              }
            }
          }
          for (int t = 0; t < MT; ++t) sixteen(t, sums[0][t], sums[1][t], u.factor, xb);
        } else {
          group([&]<int J>(__m256i* d) { dots.template operator()<J>(u, xb + J, d); }, u.factor,
                u.min, xb);
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

// Quantized activations (in order) into the transposed order, in each 256: value 4i + e of block k
// (e < 2) at 32i + 2k + e, value 4i + 2 + e at 32i + 16 + 2k + e (RepackQ4K's layout). As pairs of
// values (int32), pair m = 2i + h of block k moves from 16k + m to 8m + k: two 8x8 transposes.
void TransposeActivations(int64_t K, int16_t* q) {
  for (int64_t g = 0; g + 256 <= K; g += 256) {  // Q4_1X's last blocks stay in order
    float* pairs = reinterpret_cast<float*>(q + g);
    __m256 r[2][8];
    for (int half = 0; half < 2; ++half) {
      for (int k = 0; k < 8; ++k) r[half][k] = _mm256_loadu_ps(pairs + 16 * k + 8 * half);
      Transpose8x8(r[half]);
    }
    for (int half = 0; half < 2; ++half) {
      for (int m = 0; m < 8; ++m) _mm256_storeu_ps(pairs + 8 * (8 * half + m), r[half][m]);
    }
  }
}

// Quantized activations (in order) into Q6_KX's order (SixBitValues'): in each 128 values, pair m
// of sub-block SubOfLane(L) (from 8 SubOfLane(L) + m) at 8m + L, one 8x8 transpose of pairs.
void TransposeSubBlocks(int64_t K, int16_t* q) {
  for (int64_t g = 0; g + 128 <= K; g += 128) {
    float* pairs = reinterpret_cast<float*>(q + g);
    __m256 r[8];
    for (int lane = 0; lane < 8; ++lane) r[lane] = _mm256_loadu_ps(pairs + 8 * SubOfLane(lane));
    Transpose8x8(r);
    for (int m = 0; m < 8; ++m) _mm256_storeu_ps(pairs + 8 * m, r[m]);
  }
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

// The 8 F16 factors and 8 minimums at the start of a Q4_1X group (RepackQ4_1), as F32.
inline void GroupFactorsQ4_1X(const uint8_t* group, float* factor, float* min) {
  for (int i = 0; i < 2; ++i) {
    _mm256_storeu_ps(
        i == 0 ? factor : min,
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 16 * i))));
  }
}

template <DType D>
void DequantizeTyped(const uint8_t* row, int64_t n, float* out) {
  if constexpr (D == DType::kQ4_1X) {  // groups of 8 blocks, then Q4_1 blocks (RepackQ4_1)
    constexpr size_t group = 8 * DTypeBlockBytes(D);
    int64_t k = 0;
    for (; k + 256 <= n; k += 256, row += group, out += 256) {
      alignas(32) float factor[8], min[8];
      GroupFactorsQ4_1X(row, factor, min);
      StoreTransposed(row + 32, factor, min, out);
    }
    return DequantizeTyped<DType::kQ4_1>(row, n - k, out);
  } else if constexpr (D == DType::kQ6_KX) {
    for (int64_t k = 0; k < n; k += 256, row += DTypeBlockBytes(D), out += 256) {
      const Unpacked<D> u(row);
      for (int h = 0; h < 2; ++h) {
        SubBlocksQ6KX(row, h, [&](int L, __m128i bytes) {
          const __m256 factor = _mm256_set1_ps(u.factor[8 * h + L]);  // SubFactor's order
          float* dst = out + 128 * h + 16 * SubOfLane(L);
          _mm256_storeu_ps(dst,
                           _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), factor));
          _mm256_storeu_ps(
              dst + 8,
              _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))),
                            factor));
        });
      }
    }
  } else {
    for (int64_t b = 0; b < n / DTypeBlock(D); ++b) {
      const Unpacked<D> u(row + b * DTypeBlockBytes(D));
      u.Store(out + b * DTypeBlock(D));
    }
  }
}

// UnpackInts for one dtype.
template <DType D>
void UnpackIntsTyped(const uint8_t* row, int64_t n, int16_t* q, float* factor, float* min) {
  constexpr size_t bb = DTypeBlockBytes(D);
  // 8 blocks in the transposed layouts, widened where they lie (UnpacksTransposed): bytes 16i ..
  // 16i + 15 hold pair 2i of each block in their low nibbles, pair 2i + 1 in their high ones.
  const auto transposed = [&](const uint8_t* quants) {
    for (int c = 0; c < 4; ++c, q += 64) {
      const __m256i bytes = Load32(quants + 32 * c), mask = _mm256_set1_epi8(0x0F);
      const __m256i lo = _mm256_and_si256(bytes, mask);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
      const auto store = [](int16_t* at, __m128i v) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), _mm256_cvtepu8_epi16(v));
      };
      store(q, _mm256_castsi256_si128(lo));
      store(q + 16, _mm256_castsi256_si128(hi));
      store(q + 32, _mm256_extracti128_si256(lo, 1));
      store(q + 48, _mm256_extracti128_si256(hi, 1));
    }
  };
  if constexpr (D == DType::kQ4_KX) {
    for (int64_t k = 0; k < n; k += 256, row += bb, factor += 8, min += 8) {
      const Unpacked<D> u(row);
      std::memcpy(factor, u.factor, sizeof(u.factor));
      std::memcpy(min, u.min, sizeof(u.min));
      transposed(row + kQ4KXQuants);
    }
  } else if constexpr (D == DType::kQ4_1X) {  // groups of 8 blocks, then Q4_1 blocks
    int64_t k = 0;
    for (; k + 256 <= n; k += 256, row += 8 * bb, factor += 8, min += 8) {
      GroupFactorsQ4_1X(row, factor, min);
      transposed(row + 32);
    }
    UnpackIntsTyped<DType::kQ4_1>(row, n - k, q, factor, min);
  } else if constexpr (D == DType::kQ6_KX) {  // 16 factors a super-block, of 16 values each
    for (int64_t k = 0; k < n; k += 256, row += bb, q += 256, factor += 16) {
      const Unpacked<D> u(row);
      for (int h = 0; h < 2; ++h) {
        SubBlocksQ6KX(row, h, [&](int L, __m128i bytes) {
          const int sub = 8 * h + SubOfLane(L);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * sub),
                              _mm256_cvtepi8_epi16(bytes));
          factor[sub] = u.factor[8 * h + L];
        });
      }
    }
  } else {
    constexpr int kSub = Unpacked<D>::kSub;
    for (int64_t b = 0; b < n / DTypeBlock(D); ++b, row += bb) {
      const Unpacked<D> u(row);
      [&]<int... J>(std::integer_sequence<int, J...>) {
        (
            [&] {
              __m256i lo, hi;
              u.template Values<J>(&lo, &hi);
              if constexpr (Interleaved(D)) {  // values 0-7 and 16-23, then 8-15 and 24-31
                const __m256i first = _mm256_permute2x128_si256(lo, hi, 0x20);
                hi = _mm256_permute2x128_si256(lo, hi, 0x31);
                lo = first;
              }
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), lo);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), hi);
              q += kBlock;
              if constexpr (FileType(D) == DType::kQ6_K) {
                *factor++ = u.factor[Unpacked<D>::SubFactor(2 * J)];
                *factor++ = u.factor[Unpacked<D>::SubFactor(2 * J + 1)];
              } else {
                *factor++ = u.factor[J];
              }
              if constexpr (HasMin(D)) *min++ = u.min[J];
            }(),
            ...);
      }
      (std::make_integer_sequence<int, kSub>());
    }
  }
}

// Rows [n0, n1) against all tokens of a, in groups of up to 3 (the rows stay in L2 for the
// groups after the first).
template <DType D>
void DecodeRowsTyped(const WeightMatrix& w, int64_t n0, int64_t n1, const Q16Activations& a,
                     int64_t M, float* y, int64_t ldy) {
  for (int64_t t = 0; t < M; t += 3) {
    switch (std::min<int64_t>(3, M - t)) {
      case 1:
        DecodeRange<D, 1>(w, n0, n1, a, t, y, ldy);
        break;
      case 2:
        DecodeRange<D, 2>(w, n0, n1, a, t, y, ldy);
        break;
      default:
        DecodeRange<D, 3>(w, n0, n1, a, t, y, ldy);
    }
  }
}

}  // namespace

void Dequantize(DType dtype, const void* row, int64_t n, float* out) {
  ForQuantized(dtype,
               [&](auto d) { DequantizeTyped<d.value>(static_cast<const uint8_t*>(row), n, out); });
}

void UnpackInts(DType dtype, const void* row, int64_t n, int16_t* q, float* factor, float* min) {
  ForQuantized(dtype, [&](auto d) {
    UnpackIntsTyped<d.value>(static_cast<const uint8_t*>(row), n, q, factor, min);
  });
}

int ActivationOrder(DType dtype) { return static_cast<int>(OrderOf(dtype)); }

namespace {
// 8 blocks' 128 bytes of quants transposed: byte 16i + 2k + e gets value 4i + e of block k in its
// low nibble, 4i + 2 + e in its high one (value(k, v)).
template <typename Value>
void Transpose8(Value value, uint8_t* dst) {
  for (int i = 0; i < 8; ++i) {
    for (int k = 0; k < 8; ++k) {
      for (int e = 0; e < 2; ++e) {
        dst[16 * i + 2 * k + e] =
            static_cast<uint8_t>(value(k, 4 * i + e) | value(k, 4 * i + 2 + e) << 4);
      }
    }
  }
}
}  // namespace

void RepackQ4K(const uint8_t* src, int64_t superblocks, uint8_t* dst) {
  for (int64_t s = 0; s < superblocks;
       ++s, src += DTypeBlockBytes(DType::kQ4_K), dst += DTypeBlockBytes(DType::kQ4_KX)) {
    std::memcpy(dst, src, 4);  // d, dmin
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 4), ScalesMins(src + 4));
    // Value v of block j: chunk j / 2's byte v, low nibble for even j, high for odd.
    Transpose8([&](int j, int v) { return (src[16 + 32 * (j / 2) + v] >> (4 * (j % 2))) & 15; },
               dst + kQ4KXQuants);
  }
}

void RepackQ6K(const uint8_t* src, int64_t superblocks, uint8_t* dst) {
  constexpr size_t bb = DTypeBlockBytes(DType::kQ6_K);
  for (int64_t s = 0; s < superblocks; ++s, src += bb, dst += bb) {
    // Value n of the super-block (ggml's layout): in half h, group g of 32 values has its low 4
    // bits in ql[64h + 32 (g % 2) + l] (low nibble for g < 2), its top 2 in bits 2g, 2g + 1 of
    // qh[32h + l].
    const auto value = [&](int n) {
      const int h = n / 128, g = n % 128 / 32, l = n % 32;
      const int low = src[64 * h + 32 * (g % 2) + l] >> (4 * (g / 2)) & 15;
      return low | (src[128 + 32 * h + l] >> (2 * g) & 3) << 4;
    };
    std::memset(dst, 0, 192);
    std::memcpy(dst + 192, src + 192, bb - 192);  // scales, d
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < 4; ++i) {
        for (int p = 0; p < 32; ++p) {  // SixBitValues' layout
          const int lane = (p % 8 + 8 * (p / 16)) / 2;
          const int q = value(128 * h + 16 * SubOfLane(lane) + 4 * i + 2 * (p % 16 / 8) + p % 2);
          dst[64 * h + 32 * (i % 2) + p] |= static_cast<uint8_t>((q & 15) << (4 * (i / 2)));
          dst[128 + 32 * h + p] |= static_cast<uint8_t>((q >> 4) << (2 * i));
        }
      }
    }
  }
}

void RepackQ4_1(const uint8_t* src, int64_t blocks, uint8_t* dst) {
  constexpr size_t bb = DTypeBlockBytes(DType::kQ4_1);
  int64_t b = 0;
  for (; b + 8 <= blocks; b += 8, src += 8 * bb, dst += 8 * bb) {
    for (int k = 0; k < 8; ++k) {
      std::memcpy(dst + 2 * k, src + k * bb, 2);           // factor
      std::memcpy(dst + 16 + 2 * k, src + k * bb + 2, 2);  // minimum
    }
    // Value v of block k: byte v % 16 of its quants, the low nibble for v < 16.
    Transpose8([&](int k, int v) { return (src[k * bb + 4 + v % 16] >> (v / 16 * 4)) & 15; },
               dst + 32);
  }
  std::memcpy(dst, src, (blocks - b) * bb);
}

void RepackRow(DType kept, const uint8_t* src, int64_t cols, uint8_t* dst) {
  switch (kept) {
    case DType::kQ4_KX:
      return RepackQ4K(src, cols / 256, dst);
    case DType::kQ6_KX:
      return RepackQ6K(src, cols / 256, dst);
    case DType::kQ4_1X:
      return RepackQ4_1(src, cols / 32, dst);
    default:
      std::memcpy(dst, src, DTypeBytes(kept, cols));
  }
}

void QuantizeActivations(const float* x, int64_t M, int64_t ldx, int64_t K, int order,
                         ThreadPool& pool, Q16Activations* a) {
  const int64_t blocks = K / kBlock;
  a->q.resize(static_cast<size_t>(M * K));
  a->d.resize(static_cast<size_t>(M * blocks));
  a->ds.resize(static_cast<size_t>(M * blocks));
  auto rows = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int16_t* q = &a->q[t * K];
      QuantizeActivationRow(x + t * ldx, K, order == static_cast<int>(Order::kInterleaved), q,
                            &a->d[t * blocks], &a->ds[t * blocks]);
      if (order == static_cast<int>(Order::kTransposed)) TransposeActivations(K, q);
      if (order == static_cast<int>(Order::kSubTransposed)) TransposeSubBlocks(K, q);
    }
  };
  if (M == 1) return rows(0, 1);
  pool.ParallelFor(M, 1, [&](int, int64_t b, int64_t e) { rows(b, e); });
}

void DecodeRows(const WeightMatrix& w, int64_t n0, int64_t n1, const Q16Activations& a, int64_t M,
                float* y, int64_t ldy) {
  ForQuantized(w.dtype, [&](auto d) { DecodeRowsTyped<d.value>(w, n0, n1, a, M, y, ldy); });
}

}  // namespace shardserve::cpu
