// The CPU kernels written once for every kernel build (x86's kernels.cc and the portable
// kernels_portable.cc): conversions, norms, attention rows of any head size, MLA's shared rows,
// routing. Their inner loops are the per-build Dot, Axpy and ExpMinusMax.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <vector>

#include "backend/cpu/kernels.h"
#include "backend/cpu/kernels_internal.h"
#include "backend/cpu/quant.h"

namespace shardserve::cpu {

const float* E4M3Values() {
  static const auto* const kValues = [] {
    auto* v = new float[256];
    for (int b = 0; b < 256; ++b) v[b] = F8E4M3ToF32(static_cast<uint8_t>(b));
    return v;
  }();
  return kValues;
}

void ToFloat(DType dtype, const void* data, int64_t n, float* out) {
  if (UnpacksToInts(dtype)) return Dequantize(dtype, data, n, out);
  switch (dtype) {
    case DType::kF32:
      std::copy_n(static_cast<const float*>(data), n, out);
      return;
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i) out[i] = HalfToF32(static_cast<const uint16_t*>(data)[i]);
      return;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) out[i] = Bf16ToF32(static_cast<const uint16_t*>(data)[i]);
      return;
    case DType::kF8_128: {  // blocks of an F32 scale and 128 E4M3 bytes
      const auto* block = static_cast<const uint8_t*>(data);
      const float* value = E4M3Values();
      for (int64_t b = 0; b < n; b += 128, block += DTypeBlockBytes(DType::kF8_128)) {
        float s;
        std::memcpy(&s, block, 4);
        for (int64_t i = 0; i < std::min<int64_t>(128, n - b); ++i) {
          out[b + i] = value[block[4 + i]] * s;
        }
      }
      return;
    }
    default:
      return;
  }
}

namespace {
// f(pair p of row r as uint32 in the rows, the same pair's offset in the kBF16X layout, in pairs)
// for every pair of a rows x cols matrix.
template <typename F>
void ForPairs(int64_t rows, int64_t cols, F f) {
  const int64_t pairs = cols / 2;
  for (int64_t group = 0; group < rows; group += 16) {
    const int64_t lanes = std::min<int64_t>(16, rows - group);
    for (int64_t l = 0; l < lanes; ++l) {
      for (int64_t p = 0; p < pairs; ++p) f(group + l, p, group * pairs + p * lanes + l);
    }
  }
}
}  // namespace

void RepackBf16Pairs(const WeightMatrix& host, uint16_t* dst) {
  ForPairs(host.rows, host.cols, [&](int64_t r, int64_t p, int64_t at) {
    std::memcpy(dst + 2 * at, RowPtr(host, r) + 4 * p, 4);
  });
}

void UnpackBf16Pairs(const WeightMatrix& w, uint16_t* dst) {
  const auto* src = static_cast<const uint16_t*>(w.data);
  ForPairs(w.rows, w.cols, [&](int64_t r, int64_t p, int64_t at) {
    std::memcpy(dst + r * w.cols + 2 * p, src + 2 * at, 4);
  });
}

void Bf16PairsRow(const WeightMatrix& w, int64_t r, float* out) {
  const auto* src = static_cast<const uint16_t*>(w.data);
  const int64_t group = r / 16 * 16, lanes = std::min<int64_t>(16, w.rows - group);
  const uint16_t* pair = src + group * w.cols + 2 * (r - group);
  for (int64_t p = 0; p < w.cols / 2; ++p, pair += 2 * lanes) {
    out[2 * p] = Bf16ToF32(pair[0]);
    out[2 * p + 1] = Bf16ToF32(pair[1]);
  }
}

void RmsNorm(const float* x, int64_t M, int64_t dim, const float* weight, float eps, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * dim;
    float* o = out + m * dim;
    const float ms = Dot(xr, xr, dim) / static_cast<float>(dim);
    const float inv = 1.0f / std::sqrt(ms + eps);
    for (int64_t i = 0; i < dim; ++i) o[i] = weight[i] * (xr[i] * inv);
  }
}

void AttendGroupRows(const float* const* q, int64_t G, const KvRows& kv,
                     const void* const* k_blocks, const void* const* v_blocks, int64_t bs,
                     int64_t hd, int64_t begin, int64_t len, float scale, const float* sinks,
                     float* scores, float* const* out) {
  const size_t es = DTypeSize(kv.dtype);
  std::vector<float> row(hd), mx(G);
  auto at = [&](const void* const* blocks, int64_t p) {
    return static_cast<const uint8_t*>(blocks[p / bs]) + (p % bs) * hd * es;
  };
  for (int64_t g = 0; g < G; ++g) {
    mx[g] = sinks != nullptr ? sinks[g] : -INFINITY;
    std::fill_n(out[g], hd, 0.f);
  }
  for (int64_t p = begin; p < len; ++p) {
    KvToFloat(kv.dtype, at(k_blocks, p), hd, kv.k_scale, row.data());
    for (int64_t g = 0; g < G; ++g) {
      scores[g * len + p] = Dot(q[g], row.data(), hd) * scale;
      mx[g] = std::max(mx[g], scores[g * len + p]);
    }
  }
  std::vector<float> inv(G);
  for (int64_t g = 0; g < G; ++g) {
    const float sink = sinks != nullptr ? sinks[g] : -INFINITY;
    inv[g] =
        1.0f / (ExpMinusMax(scores + g * len + begin, len - begin, mx[g]) + std::exp(sink - mx[g]));
  }
  for (int64_t p = begin; p < len; ++p) {
    KvToFloat(kv.dtype, at(v_blocks, p), hd, kv.v_scale, row.data());
    for (int64_t g = 0; g < G; ++g) Axpy(scores[g * len + p] * inv[g], row.data(), out[g], hd);
  }
}

void KvToFloat(DType dtype, const void* src, int64_t n, float scale, float* out) {
  switch (dtype) {
    case DType::kF8E4M3: {
      const auto* b = static_cast<const uint8_t*>(src);
      const float* value = E4M3Values();
      for (int64_t i = 0; i < n; ++i) out[i] = value[b[i]] * scale;
      return;
    }
    case DType::kF32:
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<const float*>(src)[i] * scale;
      return;
    default:
      ToFloat(dtype, src, n, out);
      if (scale != 1.f) {
        for (int64_t i = 0; i < n; ++i) out[i] *= scale;
      }
  }
}

void FloatToKv(DType dtype, const float* x, int64_t n, float scale, void* dst) {
  switch (dtype) {
    case DType::kF32:
      std::copy_n(x, n, static_cast<float*>(dst));
      return;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = F32ToBf16(x[i]);
      return;
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = F32ToF16(x[i]);
      return;
    default: {  // kF8E4M3
      const float inv = 1.f / scale;
      for (int64_t i = 0; i < n; ++i) static_cast<uint8_t*>(dst)[i] = F32ToF8E4M3(x[i] * inv);
    }
  }
}

void AttendShared(const float* q, const KvRows& kv, const void* const* blocks, int64_t block_size,
                  int64_t dim, int64_t value_dim, int64_t len, float scale, float* scores,
                  float* out) {
  const size_t es = DTypeSize(kv.dtype);
  auto row_at = [&](int64_t p) {
    return static_cast<const uint8_t*>(blocks[p / block_size]) + (p % block_size) * dim * es;
  };
  std::vector<float> row(kv.dtype == DType::kF32 ? 0 : dim);
  auto row_of = [&](int64_t p) -> const float* {
    if (kv.dtype == DType::kF32) return reinterpret_cast<const float*>(row_at(p));
    KvToFloat(kv.dtype, row_at(p), dim, 1.f, row.data());
    return row.data();
  };
  float mx = -INFINITY;
  for (int64_t p = 0; p < len; ++p) {
    scores[p] = Dot(q, row_of(p), dim) * scale * kv.k_scale;
    mx = std::max(mx, scores[p]);
  }
  const float inv = kv.k_scale / ExpMinusMax(scores, len, mx);
  std::fill_n(out, value_dim, 0.f);
  for (int64_t p = 0; p < len; ++p) Axpy(scores[p] * inv, row_of(p), out, value_dim);
}

void RouteGroupedRow(const float* logits, const float* bias, int64_t E, int64_t k, int64_t groups,
                     int64_t topk_groups, bool normalize, float scaling, int32_t* experts,
                     float* weights) {
  std::vector<float> score(E), choice(E);
  for (int64_t e = 0; e < E; ++e) {
    score[e] = 1.0f / (1.0f + std::exp(-logits[e]));
    choice[e] = score[e] + bias[e];
  }
  auto before = [&](const std::vector<float>& v, int64_t a, int64_t b) {
    return v[a] > v[b] || (v[a] == v[b] && a < b);
  };
  if (groups > 1) {  // each group by its two best; the experts of all but the best groups out
    const int64_t per = E / groups;
    std::vector<float> group(groups);
    for (int64_t g = 0; g < groups; ++g) {
      std::vector<float> m(choice.begin() + g * per, choice.begin() + (g + 1) * per);
      std::partial_sort(m.begin(), m.begin() + 2, m.end(), std::greater<float>());
      group[g] = m[0] + m[1];
    }
    std::vector<int64_t> order(groups);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(),
              [&](int64_t a, int64_t b) { return before(group, a, b); });
    for (int64_t i = topk_groups; i < groups; ++i) {
      std::fill_n(choice.begin() + order[i] * per, per, -INFINITY);
    }
  }
  std::vector<int64_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int64_t a, int64_t b) { return before(choice, a, b); });
  float sum = 0;
  for (int64_t j = 0; j < k; ++j) sum += score[order[j]];
  for (int64_t j = 0; j < k; ++j) {
    experts[j] = static_cast<int32_t>(order[j]);
    weights[j] = (normalize ? score[order[j]] / (sum + 1e-20f) : score[order[j]]) * scaling;
  }
}

}  // namespace shardserve::cpu
