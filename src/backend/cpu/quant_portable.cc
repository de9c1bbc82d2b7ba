// Block-quantized weights in portable C++ (SHARDSERVE_PORTABLE_KERNELS; quant.cc is x86-64's):
// the same arithmetic as quant.cc's, read from the file's own layouts (KeptType keeps every type
// as the file has it). Each block of 32 weights unpacks to small integers, a factor (Q6_K: one
// per 16 values) and a minimum; the activations are quantized per block of 32 to int16 (scale
// max|x| / 32767) and multiplied as integers, summed in int32 (ARM: NEON's SMLAL), then scaled in
// F32 with the minimum's term from the activations' exact block sums. So a product differs from
// x86's only in the order F32 adds the blocks. (ARM's dot product
// extension multiplies int8, the activations' rounding quant.cc explains we do not take.)
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__ARM_NEON)
#include <arm_neon.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "backend/cpu/kernels.h"
#include "backend/cpu/quant.h"

namespace shardserve::cpu {
namespace {

constexpr int64_t kBlock = 32;

inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return HalfToF32(h);
}

// Q4_K's and Q5_K's 6-bit scale and minimum of block j (of 8) from their 12 packed bytes.
inline void ScaleMin(const uint8_t* s, int j, int* scale, int* min) {
  if (j < 4) {
    *scale = s[j] & 63;
    *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One block of file type D (32 values; a K-quant super-block, 256) as UnpackInts states it.
template <DType D>
inline void UnpackBlock(const uint8_t* b, int16_t* q, float* factor, float* min) {
  if constexpr (D == DType::kQ8_0) {
    factor[0] = Half(b);
    for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(b[2 + i]);
  } else if constexpr (D == DType::kQ4_0 || D == DType::kQ4_1) {
    // Byte i: value i in its low nibble, value i + 16 in its high one.
    factor[0] = Half(b);
    min[0] = D == DType::kQ4_0 ? -8.0f * factor[0] : Half(b + 2);
    const uint8_t* qs = b + (D == DType::kQ4_0 ? 2 : 4);
    for (int i = 0; i < 16; ++i) {
      q[i] = qs[i] & 0xF;
      q[i + 16] = qs[i] >> 4;
    }
  } else if constexpr (D == DType::kQ4_K || D == DType::kQ5_K) {
    // Chunk c of 64 values: block 2c the low nibbles of 32 bytes, block 2c + 1 the high ones.
    const float dd = Half(b), dmin = Half(b + 2);
    for (int j = 0; j < 8; ++j) {
      int scale, m;
      ScaleMin(b + 4, j, &scale, &m);
      factor[j] = dd * static_cast<float>(scale);
      min[j] = -dmin * static_cast<float>(m);
    }
    constexpr bool kFive = D == DType::kQ5_K;
    const uint8_t* qh = b + 16;  // Q5_K: bit j of byte l is value l of block j's fifth bit
    const uint8_t* qs = b + (kFive ? 48 : 16);
    for (int c = 0; c < 4; ++c) {
      for (int l = 0; l < 32; ++l) {
        const uint8_t byte = qs[32 * c + l];
        q[64 * c + l] = (byte & 0xF) | (kFive ? ((qh[l] >> (2 * c)) & 1) << 4 : 0);
        q[64 * c + 32 + l] = (byte >> 4) | (kFive ? ((qh[l] >> (2 * c + 1)) & 1) << 4 : 0);
      }
    }
  } else if constexpr (D == DType::kQ6_K) {  // ql[128], qh[64], int8 scales[16] (per 16), d
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const float dd = Half(b + 208);
    for (int s = 0; s < 16; ++s) {
      factor[s] = dd * static_cast<float>(static_cast<int8_t>(b[192 + s]));
    }
    for (int h = 0; h < 2; ++h) {
      int16_t* v = q + 128 * h;
      for (int l = 0; l < 32; ++l) {
        const uint8_t lo = ql[64 * h + l], hi = ql[64 * h + 32 + l], top = qh[32 * h + l];
        v[l] = static_cast<int16_t>(((lo & 0xF) | ((top & 3) << 4)) - 32);
        v[l + 32] = static_cast<int16_t>(((hi & 0xF) | (((top >> 2) & 3) << 4)) - 32);
        v[l + 64] = static_cast<int16_t>(((lo >> 4) | (((top >> 4) & 3) << 4)) - 32);
        v[l + 96] = static_cast<int16_t>(((hi >> 4) | (((top >> 6) & 3) << 4)) - 32);
      }
    }
  }
}

// The first n values of a row of D as UnpackInts states it.
template <DType D>
void UnpackRow(const uint8_t* b, int64_t n, int16_t* q, float* factor, float* min) {
  for (int64_t k = 0; k < n; k += DTypeBlock(D), b += DTypeBlockBytes(D)) {
    UnpackBlock<D>(b, q + k, factor + k / IntGroup(D), HasMin(D) ? min + k / kBlock : nullptr);
  }
}

using I32x4 = int32_t __attribute__((vector_size(16)));
using F4 = float __attribute__((vector_size(16)));

// acc plus the products of the 8 int16 pairs a[i] * b[i], spread over its 4 int32 lanes (which
// lane takes which product is the instruction's; the lanes' sum is the products'): NEON's
// SMLAL/SMLAL2; on x86-64 (a portable build there, to test it) SSE2's PMADDWD.
inline I32x4 MulAdd8(I32x4 acc, const int16_t* a, const int16_t* b) {
#if defined(__ARM_NEON)
  const int16x8_t x = vld1q_s16(a), y = vld1q_s16(b);
  return reinterpret_cast<I32x4>(vmlal_high_s16(
      vmlal_s16(reinterpret_cast<int32x4_t>(acc), vget_low_s16(x), vget_low_s16(y)), x, y));
#elif defined(__SSE2__)
  return acc + reinterpret_cast<I32x4>(
                   _mm_madd_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)),
                                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(b))));
#else
  for (int i = 0; i < 8; ++i) acc[i % 4] += static_cast<int32_t>(a[i]) * b[i];
  return acc;
#endif
}

// Rows [n0, n1) of D against the M tokens of a: each 256 values of a row (a super-block, or 8
// blocks of 32) unpacked once into L1 and multiplied with every token's, each group's integer
// sums kept in their 4 lanes, converted and scaled lane by lane into 4 float sums per token that
// are added once at the end; the minimums' term per token beside them.
template <DType D>
void DotRows(const WeightMatrix& w, int64_t n0, int64_t n1, const QuantizedActivations& a,
             int64_t M, float* y, int64_t ldy) {
  constexpr int64_t kChunk = 256, kGroup = IntGroup(D);
  const int64_t K = w.cols, blocks = K / kBlock;
  thread_local std::vector<F4> acc_storage;
  thread_local std::vector<float> min_storage;
  acc_storage.resize(M);
  min_storage.resize(M);
  F4* const acc = acc_storage.data();
  float* const mins = min_storage.data();
  alignas(16) int16_t q[kChunk];
  float factor[kChunk / 16], min[kChunk / kBlock];
  for (int64_t r = n0; r < n1; ++r) {
    std::fill_n(acc, M, F4{});
    std::fill_n(mins, M, 0.0f);
    const uint8_t* row = RowPtr(w, r);
    for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
      const int64_t n = std::min(kChunk, K - k0);
      UnpackRow<D>(row + DTypeBytes(D, k0), n, q, factor, min);
      for (int64_t t = 0; t < M; ++t) {
        const int16_t* aq = a.q.data() + t * K + k0;
        const float* ad = a.d.data() + t * blocks + k0 / kBlock;
        F4 sum = acc[t];
        for (int64_t g = 0; g < n / kGroup; ++g) {
          I32x4 s = {};
          for (int64_t i = 0; i < kGroup; i += 8)
            s = MulAdd8(s, q + g * kGroup + i, aq + g * kGroup + i);
          sum += __builtin_convertvector(s, F4) * (factor[g] * ad[g * kGroup / kBlock]);
        }
        acc[t] = sum;
        if constexpr (HasMin(D)) {
          const float* ads = a.ds.data() + t * blocks + k0 / kBlock;
          for (int64_t b = 0; b < n / kBlock; ++b) mins[t] += min[b] * ads[b];
        }
      }
    }
    for (int64_t t = 0; t < M; ++t) {
      y[t * ldy + r] = (acc[t][0] + acc[t][1]) + (acc[t][2] + acc[t][3]) + mins[t];
    }
  }
}

}  // namespace

int ActivationOrder(DType) { return kActivationsInOrder; }

void QuantizeActivations(const float* x, int64_t M, int64_t ldx, int64_t K, int order,
                         ThreadPool& pool, QuantizedActivations* a) {
  (void)order;  // one order here: every type reads its values in order
  const int64_t blocks = K / kBlock;
  a->q.resize(M * K);
  a->d.resize(M * blocks);
  a->ds.resize(M * blocks);
  pool.ParallelFor(M, 1, [&](int, int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        const float* v = x + m * ldx + b * kBlock;
        int16_t* q = a->q.data() + m * K + b * kBlock;
        float amax = 0;
        for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
        const float scale = amax / 32767.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < kBlock; ++i) {
          // Nearest, ties to even (the default rounding mode), within +-32767.
          q[i] = static_cast<int16_t>(std::clamp(std::nearbyint(v[i] * inv), -32767.0f, 32767.0f));
          sum += q[i];
        }
        a->d[m * blocks + b] = scale;
        a->ds[m * blocks + b] = scale * static_cast<float>(sum);
      }
    }
  });
}

void UnpackInts(DType dtype, const void* row, int64_t n, int16_t* q, float* factor, float* min) {
  ForQuantized(dtype, [&](auto d) {
    constexpr DType kD = decltype(d)::value;
    if constexpr (kD == FileType(kD)) {  // the kept layouts are x86's: none here
      UnpackRow<kD>(static_cast<const uint8_t*>(row), n, q, factor, min);
    }
  });
}

void Dequantize(DType dtype, const void* row, int64_t n, float* out) {
  // A row at a time (embedding rows, ToFloat): the unpacked row kept by the thread between calls.
  thread_local std::vector<int16_t> q;
  thread_local std::vector<float> factor, min;
  q.resize(n);
  factor.resize(n / 16 + 1);
  min.assign(n / kBlock + 1, 0.0f);
  UnpackInts(dtype, row, n, q.data(), factor.data(), min.data());
  const int64_t group = IntGroup(dtype);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = factor[i / group] * static_cast<float>(q[i]) + (HasMin(dtype) ? min[i / kBlock] : 0);
  }
}

void RepackRow(DType kept, const uint8_t* src, int64_t cols, uint8_t* dst) {
  std::memcpy(dst, src, DTypeBytes(kept, cols));  // KeptType is the file's type
}

void DecodeRows(const WeightMatrix& w, int64_t n0, int64_t n1, const QuantizedActivations& a,
                int64_t M, float* y, int64_t ldy) {
  ForQuantized(w.dtype, [&](auto d) {
    constexpr DType kD = decltype(d)::value;
    if constexpr (kD == FileType(kD)) DotRows<kD>(w, n0, n1, a, M, y, ldy);
  });
}

}  // namespace shardserve::cpu
