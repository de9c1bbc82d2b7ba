// Block-quantized weights on the CPU (Q8_0, Q4_0, Q4_1 in blocks of 32 values; the K-quants Q4_K,
// Q5_K, Q6_K in super-blocks of 256, which hold 8 blocks of 32 with their own scales).
//
// Every block of 32 weights is unpacked in registers to 32 small integers (int16), a factor and
// (Q4_0, Q4_1, Q4_K, Q5_K) a minimum: w = factor * q + min. Decode quantizes the activations per
// block of 32 to int16 with one F32 scale (max|x| / 32767) and takes integer dot products (AVX2
// madd; VNNI's vpdpwssd where the CPU has it: AVX512-VNNI's, quant_vnni.cc, or at kAvx2
// AVX-VNNI's, quant_avxvnni.cc), scaled and summed in F32;
// the minimum's term uses the exact block sum of the quantized activations. The only error beyond
// F32 rounding is the activations' rounding, at most half a step, 2^-16 of the block's largest
// magnitude, per value. (int8 activations, llama.cpp's choice for its maddubs kernels, are
// faster, 32 products an instruction, but move SmolLM2's logprobs by up to 0.6: its activations
// have outliers that take a block's whole int8 range. KernelLevel::kAvx512Int8 offers them, by
// name only, for the decode of the types DecodesOnInt8 and every type's prefill:
// QuantizeActivationRow<int8_t>, DecodeRange's int8 path and the GEMM's int8 tile (UnpackBytes,
// avx512::MicroKernelInt8), with vpdpbusd.) Blocks go in groups of 8, whose dot
// products are summed lane-wise and scaled once (quant_decode.h's DecodeRange). Prefill
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

#include "backend/cpu/cpu_features.h"
#include "backend/cpu/kernels_avx512.h"
#include "backend/cpu/quant_decode.h"
#include "backend/cpu/simd_x86.h"

namespace shardserve::cpu {
namespace {

// One row of K activations quantized per block of 32 to T (int16; int8 for
// KernelLevel::kAvx512Int8's int8 path): the scale max|x| / top (32767; 127), each value rounded to
// the nearest (even) step within +-top; interleaved: int16's values 0-7 with 16-23, 8-15 with
// 24-31 (Order::kInterleaved).
template <typename T>
void QuantizeActivationRow(const float* x, int64_t K, bool interleaved, T* q, float* d, float* ds) {
  constexpr int kTop = std::is_same_v<T, int8_t> ? 127 : 32767;
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
    const float scale = _mm_cvtss_f32(m) / static_cast<float>(kTop);
    const __m256 inv = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
    __m256i iv[4];
    // The largest magnitude may round to top + 1; clamped, so that the sum is the stored values'.
    const __m256i top = _mm256_set1_epi32(kTop), bottom = _mm256_set1_epi32(-kTop);
    for (int i = 0; i < 4; ++i) {
      iv[i] = _mm256_min_epi32(
          _mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)), bottom), top);
    }
    const __m256i sum =
        _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
    if constexpr (std::is_same_v<T, int8_t>) {
      // int32 -> int8: the packs leave dwords of values 0-3, 8-11, 16-19, 24-27, then 4-7,
      // 12-15, 20-23, 28-31; the permutation restores the order.
      const __m256i bytes =
          _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
      _mm256_storeu_si256(
          reinterpret_cast<__m256i*>(q),
          _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    } else {
      // int32 -> int16: the pack interleaves 128-bit lanes, the permutation restores the order
      // (values 0-15, 16-31; interleaved: 0-7 with 16-23, 8-15 with 24-31).
      for (int i = 0; i < 2; ++i) {
        const __m256i a = interleaved ? iv[i] : iv[2 * i],
                      c = interleaved ? iv[i + 2] : iv[2 * i + 1];
        const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * i), p);
      }
    }
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s = _mm_hadd_epi32(s, s);
    s = _mm_hadd_epi32(s, s);
    d[b] = scale;
    ds[b] = scale * static_cast<float>(_mm_cvtsi128_si32(s));
  }
}

// Quantized activations (int16 or int8, in order) into the transposed order (quant.h): in each
// 256 values, the quad of values 4u .. 4u + 3 of block k (at 32k + 4u) to 32u + 4k, an 8x8
// transpose of quads.
template <typename T>
void TransposeActivations(int64_t K, T* q) {
  using Quad = std::conditional_t<sizeof(T) == 1, uint32_t, uint64_t>;
  for (int64_t g = 0; g + 256 <= K; g += 256) {  // Q4_1X's last blocks stay in order
    Quad in[64], out[64];
    std::memcpy(in, q + g, sizeof(in));
    for (int k = 0; k < 8; ++k) {
      for (int u = 0; u < 8; ++u) out[8 * u + k] = in[8 * k + u];
    }
    std::memcpy(q + g, out, sizeof(out));
  }
}

// int8 activations (in order) into the int8 sub-transposed order (quant.h; Q6_KX's), and the
// sums of their 16-value sub-blocks in lane order: sum16[8 (g / 128) + L] of sub-block
// SubOfLane(L) of the 128 values from g.
void SubTransposeActivationsInt8(int64_t K, int8_t* q, int32_t* sum16) {
  for (int64_t g = 0; g + 128 <= K; g += 128, sum16 += 8) {
    int8_t in[128];
    std::memcpy(in, q + g, sizeof(in));
    for (int lane = 0; lane < 8; ++lane) {
      const int8_t* sub = in + 16 * SubOfLane(lane);
      int32_t sum = 0;
      for (int v = 0; v < 16; ++v) sum += sub[v];
      sum16[lane] = sum;
      for (int r = 0; r < 4; ++r) {
        for (int e = 0; e < 4; ++e) {
          q[g + 32 * r + 4 * lane + e] = sub[8 * (r / 2) + 2 * (r % 2) + 4 * (e / 2) + e % 2];
        }
      }
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
  // 8 blocks in the transposed layouts (UnpacksTransposed): chunk c's quads (Nibbles) as pairs,
  // each 128-bit half's 4 blocks' pairs 0 (values 0, 1 of the quad), then their pairs 1; the
  // permutation puts the 8 blocks' pairs 0 in the low half: pairs 4c .. 4c + 3 from 64c.
  const auto transposed = [&](const uint8_t* quants) {
    const __m256i pairs = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0,
                                           1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const auto store = [](int16_t* at, __m128i v) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), _mm256_cvtepu8_epi16(v));
    };
    for (int c = 0; c < 4; ++c) {
      __m256i quads[2];
      Nibbles(quants + 32 * c, &quads[0], &quads[1]);
      for (const __m256i& v : quads) {
        const __m256i p = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pairs), 0xD8);
        store(q, _mm256_castsi256_si128(p));
        store(q + 16, _mm256_extracti128_si256(p, 1));
        q += 32;
      }
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

int ActivationOrder(DType dtype) {
  if (ActiveKernelLevel() == KernelLevel::kAvx512Int8 && DecodesOnInt8(dtype)) {
    return OrderOf(dtype) == Order::kTransposed      ? kInt8Transposed
           : OrderOf(dtype) == Order::kSubTransposed ? kInt8SubTransposed
                                                     : kInt8InOrder;
  }
  return static_cast<int>(OrderOf(dtype));
}

namespace {
// 8 blocks' 128 bytes of quants transposed: byte 32c + 4k + e gets value 8c + e of block k in its
// low nibble, 8c + 4 + e in its high one (value(k, v)).
template <typename Value>
void Transpose8(Value value, uint8_t* dst) {
  for (int c = 0; c < 4; ++c) {
    for (int k = 0; k < 8; ++k) {
      for (int e = 0; e < 4; ++e) {
        dst[32 * c + 4 * k + e] =
            static_cast<uint8_t>(value(k, 8 * c + e) | value(k, 8 * c + 4 + e) << 4);
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
                         ThreadPool& pool, QuantizedActivations* a) {
  const int64_t blocks = K / kBlock;
  const bool int8 = order >= kInt8InOrder;
  if (int8) {
    a->q8.resize(static_cast<size_t>(M * K));
    if (order == kInt8SubTransposed) a->sum16.resize(static_cast<size_t>(M * (K / 16)));
  } else {
    a->q.resize(static_cast<size_t>(M * K));
  }
  a->d.resize(static_cast<size_t>(M * blocks));
  a->ds.resize(static_cast<size_t>(M * blocks));
  auto rows = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (int8) {
        int8_t* q = &a->q8[t * K];
        QuantizeActivationRow(x + t * ldx, K, false, q, &a->d[t * blocks], &a->ds[t * blocks]);
        if (order == kInt8Transposed) TransposeActivations(K, q);
        if (order == kInt8SubTransposed) SubTransposeActivationsInt8(K, q, &a->sum16[t * (K / 16)]);
        continue;
      }
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

void DecodeRows(const WeightMatrix& w, int64_t n0, int64_t n1, const QuantizedActivations& a,
                int64_t M, float* y, int64_t ldy) {
  // The int8 orders' activations: kAvx512Int8, whose CPU has VNNI (ChooseKernelLevel).
  if (ActivationOrder(w.dtype) >= kInt8InOrder) {
    return DecodeRowsInt8(w, n0, n1, a, M, y, ldy);
  }
  if (UsesVnni()) {
    return (ActiveKernelLevel() == KernelLevel::kAvx2 ? DecodeRowsAvxVnni : DecodeRowsVnni)(
        w, n0, n1, a, M, y, ldy);
  }
  ForQuantized(w.dtype, [&](auto d) { DecodeRowsTyped<d.value>(w, n0, n1, a, M, y, ldy); });
}

}  // namespace shardserve::cpu
