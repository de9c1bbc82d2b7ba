// Block-quantized weights in portable C++ (SHARDSERVE_PORTABLE_KERNELS; quant.cc is x86-64's):
// the same arithmetic as quant.cc's, read from the file's own layouts (KeptType keeps every type
// as the file has it). Each block of 32 weights unpacks to small integers, a factor (Q6_K: one
// per 16 values) and a minimum; the activations are quantized per block of 32 to int16 (scale
// max|x| / 32767) and multiplied as integers, summed in int32 (the compiler's SIMD: ARM's
// SMLAL), then scaled in F32 with the minimum's term from the activations' exact block sums. So
// a product differs from x86's only in the order F32 adds the blocks. (ARM's dot product
// extension multiplies int8, the activations' rounding quant.cc explains we do not take.)
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/quant.h"

namespace shardserve::cpu {
namespace {

constexpr int64_t kBlock = 32;

inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return F16ToF32(h);
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

// One block of a file type (32 values; a K-quant super-block, 256) as UnpackInts states it.
void UnpackBlock(DType d, const uint8_t* b, int16_t* q, float* factor, float* min) {
  switch (d) {
    case DType::kQ8_0:
      factor[0] = Half(b);
      for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(b[2 + i]);
      return;
    case DType::kQ4_0:
    case DType::kQ4_1: {  // byte i: value i in its low nibble, value i + 16 in its high one
      factor[0] = Half(b);
      min[0] = d == DType::kQ4_0 ? -8.0f * factor[0] : Half(b + 2);
      const uint8_t* qs = b + (d == DType::kQ4_0 ? 2 : 4);
      for (int i = 0; i < 16; ++i) {
        q[i] = qs[i] & 0xF;
        q[i + 16] = qs[i] >> 4;
      }
      return;
    }
    case DType::kQ4_K:
    case DType::kQ5_K: {  // chunk c of 64: block 2c the low nibbles of 32 bytes, 2c + 1 the high
      const float dd = Half(b), dmin = Half(b + 2);
      for (int j = 0; j < 8; ++j) {
        int scale, m;
        ScaleMin(b + 4, j, &scale, &m);
        factor[j] = dd * static_cast<float>(scale);
        min[j] = -dmin * static_cast<float>(m);
      }
      const bool five = d == DType::kQ5_K;
      const uint8_t* qh = b + 16;  // Q5_K: bit j of byte l is value l of block j's fifth bit
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int c = 0; c < 4; ++c) {
        for (int l = 0; l < 32; ++l) {
          const uint8_t byte = qs[32 * c + l];
          q[64 * c + l] = (byte & 0xF) | (five ? ((qh[l] >> (2 * c)) & 1) << 4 : 0);
          q[64 * c + 32 + l] = (byte >> 4) | (five ? ((qh[l] >> (2 * c + 1)) & 1) << 4 : 0);
        }
      }
      return;
    }
    case DType::kQ6_K: {  // ql[128], qh[64], int8 scales[16] (one per 16 values), d
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const float dd = Half(b + 208);
      for (int s = 0; s < 16; ++s)
        factor[s] = dd * static_cast<float>(static_cast<int8_t>(b[192 + s]));
      for (int h = 0; h < 2; ++h) {
        for (int l = 0; l < 32; ++l) {
          const uint8_t lo = ql[64 * h + l], hi = ql[64 * h + 32 + l], top = qh[32 * h + l];
          int16_t* v = q + 128 * h;
          v[l] = static_cast<int16_t>(((lo & 0xF) | ((top & 3) << 4)) - 32);
          v[l + 32] = static_cast<int16_t>(((hi & 0xF) | (((top >> 2) & 3) << 4)) - 32);
          v[l + 64] = static_cast<int16_t>(((lo >> 4) | (((top >> 4) & 3) << 4)) - 32);
          v[l + 96] = static_cast<int16_t>(((hi >> 4) | (((top >> 6) & 3) << 4)) - 32);
        }
      }
      return;
    }
    default:
      return;
  }
}

// One row's dot product with token t's activations: its K values unpacked (q, factor per
// IntGroup G, min per block).
template <int G>
float RowDot(const int16_t* q, const float* factor, const float* min, bool has_min,
             const Q16Activations& a, int64_t t, int64_t K) {
  const int16_t* aq = a.q.data() + t * K;
  const float* ad = a.d.data() + t * (K / kBlock);
  const float* ads = a.ds.data() + t * (K / kBlock);
  float sum = 0;
  for (int64_t b = 0; b < K / kBlock; ++b) {
    float block = 0;
    for (int g = 0; g < kBlock / G; ++g) {
      const int64_t at = b * kBlock + g * G;
      int32_t s = 0;
      for (int i = 0; i < G; ++i) s += static_cast<int32_t>(q[at + i]) * aq[at + i];
      block += factor[at / G] * static_cast<float>(s);
    }
    sum += block * ad[b];
    if (has_min) sum += min[b] * ads[b];
  }
  return sum;
}

}  // namespace

int ActivationOrder(DType) { return kActivationsInOrder; }

void QuantizeActivations(const float* x, int64_t M, int64_t ldx, int64_t K, int order,
                         ThreadPool& pool, Q16Activations* a) {
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
  if (!UnpacksToInts(dtype) || dtype != FileType(dtype)) return;  // kept layouts are x86's
  const auto* b = static_cast<const uint8_t*>(row);
  const int64_t block = DTypeBlock(dtype);
  for (int64_t k = 0; k < n; k += block, b += DTypeBlockBytes(dtype)) {
    UnpackBlock(dtype, b, q + k, factor + k / IntGroup(dtype),
                HasMin(dtype) ? min + k / kBlock : nullptr);
  }
}

void Dequantize(DType dtype, const void* row, int64_t n, float* out) {
  std::vector<int16_t> q(n);
  std::vector<float> factor(n / 16 + 1), min(n / kBlock + 1, 0.0f);
  UnpackInts(dtype, row, n, q.data(), factor.data(), min.data());
  const int64_t group = IntGroup(dtype);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = factor[i / group] * static_cast<float>(q[i]) + (HasMin(dtype) ? min[i / kBlock] : 0);
  }
}

void RepackRow(DType kept, const uint8_t* src, int64_t cols, uint8_t* dst) {
  std::memcpy(dst, src, DTypeBytes(kept, cols));  // KeptType is the file's type
}

void DecodeRows(const WeightMatrix& w, int64_t n0, int64_t n1, const Q16Activations& a, int64_t M,
                float* y, int64_t ldy) {
  constexpr int64_t kRows = 8;  // rows unpacked at a time, each token's activations read once
  const int64_t K = w.cols, group = IntGroup(w.dtype);
  const bool has_min = HasMin(w.dtype);
  thread_local std::vector<int16_t> q;
  thread_local std::vector<float> factor, min;
  q.resize(kRows * K);
  factor.resize(kRows * (K / 16));
  min.resize(kRows * (K / kBlock));
  for (int64_t r0 = n0; r0 < n1; r0 += kRows) {
    const int64_t nr = std::min(kRows, n1 - r0);
    for (int64_t r = 0; r < nr; ++r) {
      UnpackInts(w.dtype, RowPtr(w, r0 + r), K, q.data() + r * K, factor.data() + r * (K / 16),
                 min.data() + r * (K / kBlock));
    }
    for (int64_t t = 0; t < M; ++t) {
      for (int64_t r = 0; r < nr; ++r) {
        const int16_t* qr = q.data() + r * K;
        const float* fr = factor.data() + r * (K / 16);
        const float* mr = min.data() + r * (K / kBlock);
        y[t * ldy + r0 + r] = group == 16 ? RowDot<16>(qr, fr, mr, has_min, a, t, K)
                                          : RowDot<32>(qr, fr, mr, has_min, a, t, K);
      }
    }
  }
}

}  // namespace shardserve::cpu
