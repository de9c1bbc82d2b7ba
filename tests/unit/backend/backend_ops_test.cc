#include "backend_ops_test.h"

#include <gmock/gmock.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "backend/cpu/kernels.h"
#include "devtools/quantize_row.h"

namespace shardserve::testing {

void BackendOpsTest::SetUp() {
  be_ = GetParam().make();
  if (be_ == nullptr) GTEST_SKIP() << "no " << GetParam().name << " device on this machine";
}

double BackendOpsTest::ActivationRounding(DType dtype) const {
  return GetParam().activation_rounding ? GetParam().activation_rounding(dtype) : 0;
}

double BackendOpsTest::QuantizedInputSteps(DType dtype) const {
  return GetParam().quantized_input_steps ? GetParam().quantized_input_steps(dtype) : 32767;
}

namespace {

// A host copy in backend memory, kept with the test's other buffers.
class Mem {
 public:
  explicit Mem(Backend& be) : be_(be) {}
  template <typename T>
  T* Put(const std::vector<T>& v) {
    bufs_.push_back(be_.NewBuffer());
    Buffer& b = *bufs_.back();
    EXPECT_TRUE(b.Reserve(std::max<size_t>(1, v.size()) * sizeof(T)).ok());
    EXPECT_TRUE(be_.CopyFromHost(b.data(), v.data(), v.size() * sizeof(T)).ok());
    return b.as<T>();
  }
  template <typename T>
  T* Zeros(size_t n) {
    return Put(std::vector<T>(n));
  }
  template <typename T>
  std::vector<T> Get(const T* p, size_t n) {
    std::vector<T> v(n);
    EXPECT_TRUE(be_.CopyToHost(v.data(), p, n * sizeof(T)).ok());
    return v;
  }

 private:
  Backend& be_;
  std::vector<std::unique_ptr<Buffer>> bufs_;
};

// `values` stored as `dtype` (row-major), and the values as that dtype rounds them.
std::vector<uint8_t> Encode(DType dtype, std::vector<float>& values) {
  std::vector<uint8_t> out(values.size() * DTypeSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(&out[4 * i], &values[i], 4);
    } else {
      const uint16_t h = dtype == DType::kF16 ? F32ToF16(values[i]) : F32ToBf16(values[i]);
      std::memcpy(&out[2 * i], &h, 2);
      values[i] = dtype == DType::kF16 ? F16ToF32(h) : Bf16ToF32(h);
    }
  }
  return out;
}

// The KV cache formats the cache tests run in: each dtype, FP8 with a scale per layer (layer 1's
// K and V scaled apart) that puts the tests' values in E4M3's normal range.
std::vector<KvFormat> KvFormats() {
  std::vector<KvFormat> formats(4);
  formats[0].dtype = DType::kF32;
  formats[1].dtype = DType::kBF16;
  formats[2].dtype = DType::kF16;
  formats[3] = {DType::kF8E4M3, {1.f, 0.01f}, {1.f, 0.004f}};
  return formats;
}
std::string KvName(const KvFormat& f) { return DTypeName(f.dtype); }

// v as a cache in format f keeps it in layer `layer` (K: kv 0, V: kv 1): rounded by
// backend/dtype.h's scalar conversions (E4M3 under the layer's scale).
std::vector<float> AsCached(const KvFormat& f, int64_t layer, int kv, std::vector<float> v) {
  const float scale = kv == 0 ? f.KScale(layer) : f.VScale(layer);
  for (float& x : v) {
    switch (f.dtype) {
      case DType::kBF16:
        x = Bf16ToF32(F32ToBf16(x));
        break;
      case DType::kF16:
        x = F16ToF32(F32ToF16(x));
        break;
      case DType::kF8E4M3:
        x = F8E4M3ToF32(F32ToF8E4M3(x / scale)) * scale;
        break;
      default:
        break;
    }
  }
  return v;
}

// Every shape of the decode (GEMV) and prefill (GEMM) paths, in every dtype. Half weights: the
// GPU rounds activations to the weight's dtype for its tensor cores, hence the wider bound.
TEST_P(BackendOpsTest, GemmMatchesTheArithmetic) {
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int64_t M : {1, 3, 9, 33}) {
      const int64_t N = 37, K = 72;
      std::vector<float> w = Random(N * K, 1 + M), x = Random(M * K, 2 + M);
      Mem mem(*be_);
      const std::vector<uint8_t> bytes = Encode(dtype, w);
      auto dw = be_->Upload(WeightMatrix{dtype, bytes.data(), N, K, K});
      ASSERT_TRUE(dw.ok()) << dw.status();
      float* y = mem.Zeros<float>(M * N);
      ASSERT_TRUE(be_->Gemm(*dw, mem.Put(x), M, y).ok());
      const std::vector<float> got = mem.Get(y, M * N);
      const double tol = dtype == DType::kF32 ? 1e-4 : 5e-2;
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t n = 0; n < N; ++n) {
          double want = 0;
          for (int64_t k = 0; k < K; ++k) want += double(w[n * K + k]) * x[m * K + k];
          ASSERT_NEAR(got[m * N + n], want, tol) << DTypeName(dtype) << " M=" << M << " n=" << n;
        }
      }
    }
  }
}

// GemmGroup: matrices that read the same x, each into its own y, give what Gemm gives for each
// (decode and prefill sizes); matrices with different columns are refused.
TEST_P(BackendOpsTest, GemmGroupMatchesGemmForEach) {
  const int64_t K = 64;
  const std::vector<int64_t> rows = {37, 4, 4, 19};
  // Mixed dtypes, then one dtype (which a GPU runs as one launch at decode sizes).
  for (auto [M, mixed] : {std::pair{1, true},
                          {5, true},
                          {33, true},
                          {1, false},
                          {3, false},
                          {8, false},
                          {33, false}}) {
    auto dtype_of = [mixed = mixed](size_t i) {
      return mixed && i % 2 == 0 ? DType::kF32 : DType::kBF16;
    };
    Mem mem(*be_);
    std::vector<std::vector<uint8_t>> bytes;
    std::vector<WeightMatrix> ws;
    for (size_t i = 0; i < rows.size(); ++i) {
      std::vector<float> w = Random(rows[i] * K, 10 + i);
      bytes.push_back(Encode(dtype_of(i), w));
    }
    for (size_t i = 0; i < rows.size(); ++i) {
      auto dw = be_->Upload(WeightMatrix{dtype_of(i), bytes[i].data(), rows[i], K, K});
      ASSERT_TRUE(dw.ok()) << dw.status();
      ws.push_back(*dw);
    }
    const float* x = mem.Put(Random(M * K, 20 + M));
    std::vector<const WeightMatrix*> wp;
    std::vector<float*> grouped, single;
    for (size_t i = 0; i < ws.size(); ++i) {
      wp.push_back(&ws[i]);
      grouped.push_back(mem.Zeros<float>(M * rows[i]));
      single.push_back(mem.Zeros<float>(M * rows[i]));
      ASSERT_TRUE(be_->Gemm(ws[i], x, M, single[i]).ok());
    }
    ASSERT_TRUE(be_->GemmGroup(wp.data(), grouped.data(), wp.size(), x, M).ok());
    for (size_t i = 0; i < ws.size(); ++i) {
      EXPECT_EQ(mem.Get(grouped[i], M * rows[i]), mem.Get(single[i], M * rows[i]))
          << "matrix " << i << " M=" << M << (mixed ? " mixed" : " bf16");
    }
  }
  std::vector<float> a = Random(4 * 64, 1), b = Random(4 * 32, 2);
  Mem mem(*be_);
  auto wa = be_->Upload(WeightMatrix{DType::kF32, a.data(), 4, 64, 64});
  auto wb = be_->Upload(WeightMatrix{DType::kF32, b.data(), 4, 32, 32});
  ASSERT_TRUE(wa.ok() && wb.ok());
  const WeightMatrix* pair[] = {&*wa, &*wb};
  float* ys[] = {mem.Zeros<float>(4), mem.Zeros<float>(4)};
  const absl::Status s = be_->GemmGroup(pair, ys, 2, mem.Put(Random(64, 3)), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("32 columns")) << s;
}

// Weights in GGUF's block types and FP8 (F8_128: an F32 scale per 128 E4M3 values), as each
// backend keeps them (the CPU repacks some; the GPU keeps the file's blocks): decode sizes (up to 8
// rows, the GPU's GEMV over the blocks) and prefill sizes (the GPU expands tiles into BF16 for its
// tensor cores) against the exact products of the blocks' values (ToFloat), a slice's rows (row
// stride past its columns), a group of one type as one product, embedding rows and expert products.
// Tolerances: decode within 1e-3 plus the backend's rounding of the activations (BackendCase:
// the CPU's int16, kernels_test.cc states it; the GPU's dp4a GEMV's int8 per 32); prefill within
// 1e-3 plus 4 sigma of BF16 rounding of both operands (2^-8 relative each product).
TEST_P(BackendOpsTest, QuantizedWeightsMatchTheBlockValues) {
  // K: 18 FP8 blocks, so that the GPU's FP8 GEMV runs its groups of 8 blocks (one loaded while
  // the one before is summed) and its tail of 2.
  const int64_t N = 37, K = 2304, stride = 2560;
  for (DType dtype : {DType::kQ8_0, DType::kQ4_0, DType::kQ4_1, DType::kQ4_K, DType::kQ5_K,
                      DType::kQ6_K, DType::kF8_128}) {
    const std::vector<float> w = Random(N * stride, 50 + static_cast<int>(dtype));
    std::string bytes;
    for (int64_t n = 0; n < N; ++n) bytes += QuantizeRow(dtype, w.data() + n * stride, stride);
    std::vector<float> values(N * K);  // the first K values of each row
    std::vector<float> row(stride);
    for (int64_t n = 0; n < N; ++n) {
      cpu::ToFloat(dtype, bytes.data() + n * DTypeBytes(dtype, stride), stride, row.data());
      std::copy(row.begin(), row.begin() + K, values.begin() + n * K);
    }
    auto dw = be_->Upload(WeightMatrix{dtype, bytes.data(), N, K, stride});
    ASSERT_TRUE(dw.ok()) << DTypeName(dtype) << ": " << dw.status();
    // The inputs' rounding: within half a step, max |x| / steps (BackendCase).
    const double decode_steps = QuantizedInputSteps(dtype);
    for (int64_t M : {1, 3, 8, 9, 40}) {
      const std::vector<float> x = Random(M * K, 60 + M);
      Mem mem(*be_);
      float* y = mem.Zeros<float>(M * N);
      ASSERT_TRUE(be_->Gemm(*dw, mem.Put(x), M, y).ok()) << DTypeName(dtype);
      const std::vector<float> got = mem.Get(y, M * N);
      for (int64_t m = 0; m < M; ++m) {
        float amax = 0;
        for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[m * K + k]));
        for (int64_t n = 0; n < N; ++n) {
          double want = 0, abs_w = 0, sq = 0;
          for (int64_t k = 0; k < K; ++k) {
            const double p = double(values[n * K + k]) * x[m * K + k];
            want += p;
            abs_w += std::fabs(values[n * K + k]);
            sq += p * p;
          }
          const double tol = M <= 8 ? 1e-3 + abs_w * amax / decode_steps
                                    : 1e-3 + 4 * std::sqrt(sq) * std::ldexp(1.0, -8);
          ASSERT_NEAR(got[m * N + n], want, tol) << DTypeName(dtype) << " M=" << M << " n=" << n;
        }
      }
    }
    // q, k and v as one group (one launch on the GPU) equal each product alone.
    Mem mem(*be_);
    const float* x = mem.Put(Random(2 * K, 70));
    const WeightMatrix* group[] = {&*dw, &*dw, &*dw};
    float* ys[] = {mem.Zeros<float>(2 * N), mem.Zeros<float>(2 * N), mem.Zeros<float>(2 * N)};
    float* single = mem.Zeros<float>(2 * N);
    ASSERT_TRUE(be_->GemmGroup(group, ys, 3, x, 2).ok());
    ASSERT_TRUE(be_->Gemm(*dw, x, 2, single).ok());
    for (float* y : ys) EXPECT_EQ(mem.Get(y, 2 * N), mem.Get(single, 2 * N)) << DTypeName(dtype);
    // Embedding rows of the table [100, 100 + N), as the block values.
    const std::vector<int32_t> ids = {136, 100, 99, 117};
    float* out = mem.Put(Random(ids.size() * K, 71));
    ASSERT_TRUE(be_->Embed(*dw, mem.Put(ids), 4, 100, 100 + N, out).ok()) << DTypeName(dtype);
    const std::vector<float> rows = mem.Get(out, ids.size() * K);
    for (size_t i = 0; i < ids.size(); ++i) {
      for (int64_t k = 0; k < K; ++k) {
        const float want = ids[i] >= 100 ? values[(ids[i] - 100) * K + k] : 0.0f;
        ASSERT_NEAR(rows[i * K + k], want, 1e-6) << DTypeName(dtype) << " id " << ids[i];
      }
    }
    // Experts 3 and 4 of this stage: slots of expert 4, 3 and 7 (not local: zeros).
    const std::vector<const void*> ptrs = {dw->data, dw->data};
    const ExpertTable table{dw->dtype, mem.Put(ptrs), 3, 2, N, K};
    const std::vector<float> xs = Random(3 * K, 72);
    float* ey = mem.Zeros<float>(3 * N);
    ASSERT_TRUE(
        be_->ExpertMatVec(table, mem.Put(std::vector<int32_t>{4, 3, 7}), 3, mem.Put(xs), 1, ey)
            .ok());
    const std::vector<float> eg = mem.Get(ey, 3 * N);
    for (int64_t s = 0; s < 3; ++s) {
      for (int64_t n = 0; n < N; ++n) {
        double want = 0, abs_w = 0;
        for (int64_t k = 0; s < 2 && k < K; ++k) {
          want += double(values[n * K + k]) * xs[s * K + k];
          abs_w += std::fabs(values[n * K + k]);
        }
        // The decode's rounding of the inputs (|x| < 1), as above.
        ASSERT_NEAR(eg[s * N + n], want, 1e-3 + abs_w / decode_steps)
            << DTypeName(dtype) << " " << s;
      }
    }
  }
}

// A matrix that is a slice of a wider one (row stride > cols) uploads only its own columns.
TEST_P(BackendOpsTest, UploadTakesASlicesColumns) {
  const int64_t N = 4, K = 16, stride = 40;
  std::vector<float> wide = Random(N * stride, 3);
  Mem mem(*be_);
  auto dw = be_->Upload(WeightMatrix{DType::kF32, wide.data() + 8, N, K, stride});
  ASSERT_TRUE(dw.ok());
  const std::vector<float> x = Random(K, 4);
  float* y = mem.Zeros<float>(N);
  ASSERT_TRUE(be_->Gemm(*dw, mem.Put(x), 1, y).ok());
  const std::vector<float> got = mem.Get(y, N);
  for (int64_t n = 0; n < N; ++n) {
    double want = 0;
    for (int64_t k = 0; k < K; ++k) want += double(wide[n * stride + 8 + k]) * x[k];
    EXPECT_NEAR(got[n], want, 1e-4);
  }
}

// Rows of this rank's vocabulary slice [100, 110); other ids embed as zeros.
TEST_P(BackendOpsTest, EmbedTakesItsSlicesRows) {
  const int64_t V = 10, H = 24, begin = 100;
  std::vector<float> table = Random(V * H, 5);
  const std::vector<uint8_t> bytes = Encode(DType::kBF16, table);
  auto dt = be_->Upload(WeightMatrix{DType::kBF16, bytes.data(), V, H, H});
  ASSERT_TRUE(dt.ok());
  Mem mem(*be_);
  const std::vector<int32_t> ids = {100, 109, 99, 110, 104};
  float* out = mem.Put(Random(ids.size() * H, 6));  // stale values must not survive
  ASSERT_TRUE(be_->Embed(*dt, mem.Put(ids), 5, begin, begin + V, out).ok());
  const std::vector<float> got = mem.Get(out, ids.size() * H);
  for (size_t r = 0; r < ids.size(); ++r) {
    const bool mine = ids[r] >= begin && ids[r] < begin + V;
    for (int64_t c = 0; c < H; ++c) {
      ASSERT_EQ(got[r * H + c], mine ? table[(ids[r] - begin) * H + c] : 0.0f) << r << " " << c;
    }
  }
}

TEST_P(BackendOpsTest, ElementwiseOpsMatchTheArithmetic) {
  const int64_t rows = 3, cols = 50, n = rows * cols;
  const std::vector<float> x = Random(n, 7, -3, 3), y = Random(n, 8), w = Random(cols, 9),
                           bias = Random(cols, 10);
  Mem mem(*be_);
  float* dx = mem.Put(x);
  float* norm = mem.Zeros<float>(n);
  ASSERT_TRUE(be_->RmsNorm(dx, rows, cols, mem.Put(w), 1e-5f, norm).ok());
  const std::vector<float> got_norm = mem.Get(norm, n);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t c = 0; c < cols; ++c) ss += double(x[r * cols + c]) * x[r * cols + c];
    const double inv = 1 / std::sqrt(ss / cols + 1e-5);
    for (int64_t c = 0; c < cols; ++c) {
      ASSERT_NEAR(got_norm[r * cols + c], x[r * cols + c] * inv * w[c], 1e-5);
    }
  }
  ASSERT_TRUE(be_->AddBias(dx, rows, cols, mem.Put(bias)).ok());
  ASSERT_TRUE(be_->Add(dx, mem.Put(y), n).ok());
  float* dy = mem.Put(y);
  ASSERT_TRUE(be_->SiluMul(dy, mem.Put(x), n).ok());
  const std::vector<float> sum = mem.Get(dx, n), silu = mem.Get(dy, n);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(sum[i], x[i] + bias[i % cols] + y[i], 1e-5);
    ASSERT_NEAR(silu[i], y[i] / (1 + std::exp(-double(y[i]))) * x[i], 1e-5);
  }
}

// RmsNorm and AddRmsNorm at model widths (the GPU keeps a row in registers up to 8,192 floats
// whose count is a multiple of 4, and takes any other width another way): x += y is written
// back, out is the norm of the sum; RmsNorm leaves x alone, or writes over it in place.
TEST_P(BackendOpsTest, AddRmsNormAddsThenNormalizes) {
  for (int64_t dim : {50, 2048, 4100, 8196}) {
    const int64_t rows = 3, n = rows * dim;
    const std::vector<float> x = Random(n, 30 + dim, -3, 3), y = Random(n, 31), w = Random(dim, 32);
    Mem mem(*be_);
    float* dx = mem.Put(x);
    const float* dw = mem.Put(w);
    float* out = mem.Zeros<float>(n);
    ASSERT_TRUE(be_->RmsNorm(dx, rows, dim, dw, 1e-5f, out).ok());
    EXPECT_EQ(mem.Get(dx, n), x) << dim;
    float* in_place = mem.Put(x);  // as Qwen3's per-head q/k norms run it
    ASSERT_TRUE(be_->RmsNorm(in_place, rows, dim, dw, 1e-5f, in_place).ok());
    EXPECT_EQ(mem.Get(in_place, n), mem.Get(out, n)) << dim;
    ASSERT_TRUE(be_->AddRmsNorm(dx, mem.Put(y), rows, dim, dw, 1e-5f, out).ok());
    const std::vector<float> sum = mem.Get(dx, n), got = mem.Get(out, n);
    for (int64_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (int64_t c = 0; c < dim; ++c) {
        const float v = x[r * dim + c] + y[r * dim + c];
        ASSERT_EQ(sum[r * dim + c], v) << dim << " " << r << " " << c;
        ss += double(v) * v;
      }
      const double inv = 1 / std::sqrt(ss / dim + 1e-5);
      for (int64_t c = 0; c < dim; ++c) {
        ASSERT_NEAR(got[r * dim + c], sum[r * dim + c] * inv * w[c], 1e-5) << dim << " " << c;
      }
    }
  }
}

// rotate_half: dimension i pairs with i + head_dim / 2, at each row's own position.
TEST_P(BackendOpsTest, RopeRotatesEachRowAtItsPosition) {
  const int64_t rows = 3, heads = 2, hd = 16, half = hd / 2;
  const std::vector<int32_t> pos = {0, 5, 4000};
  std::vector<float> inv_freq(half);
  for (int64_t i = 0; i < half; ++i) inv_freq[i] = std::pow(10000.0f, -2.0f * i / hd);
  const std::vector<float> x = Random(rows * heads * hd, 11, -2, 2);
  Mem mem(*be_);
  float* dx = mem.Put(x);
  ASSERT_TRUE(be_->Rope(dx, rows, heads, hd, mem.Put(pos), mem.Put(inv_freq)).ok());
  const std::vector<float> got = mem.Get(dx, x.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* v = x.data() + (r * heads + h) * hd;
      const float* g = got.data() + (r * heads + h) * hd;
      for (int64_t i = 0; i < half; ++i) {
        const double a = double(float(pos[r]) * inv_freq[i]);
        EXPECT_NEAR(g[i], v[i] * std::cos(a) - v[i + half] * std::sin(a), 1e-4);
        EXPECT_NEAR(g[i + half], v[i + half] * std::cos(a) + v[i] * std::sin(a), 1e-4);
      }
    }
  }
}

// Causal attention of one query head (q, head_dim hd) over written rows [first, last] of k and v
// (rows of kvd floats, the KV head at column kh * hd), in double precision.
// `sink`: a logit in the denominator alone (-inf: none).
std::vector<double> AttentionOfOneHead(const float* q, const std::vector<float>& k,
                                       const std::vector<float>& v, int64_t kvd, int64_t kh,
                                       int64_t hd, int64_t first, int64_t last, float scale,
                                       double sink = -INFINITY) {
  std::vector<double> e;
  for (int64_t j = first; j <= last; ++j) {
    double dot = 0;
    for (int64_t d = 0; d < hd; ++d) dot += double(q[d]) * k[j * kvd + kh * hd + d];
    e.push_back(dot * scale);
  }
  const double mx = std::max(sink, *std::max_element(e.begin(), e.end()));
  double z = std::exp(sink - mx);
  for (double& x : e) z += (x = std::exp(x - mx));
  std::vector<double> out(hd);
  for (int64_t d = 0; d < hd; ++d) {
    for (int64_t j = first; j <= last; ++j) out[d] += e[j - first] / z * v[j * kvd + kh * hd + d];
  }
  return out;
}

// Two sequences in scattered blocks of two caches; rows written through WriteKv are what
// Attention reads, causally, for a TP rank's query heads over its KV head (GQA); in each KV format
// (what the format keeps of them: its rounding and scales, block_bytes its size).
TEST_P(BackendOpsTest, AttentionReadsWhatWriteKvWrote) {
  for (const KvFormat& format : KvFormats()) {
    const int64_t hd = 32, kv_heads = 2, bs = 4, layers = 2, heads = 2, group = 2;
    // This rank's query heads 2..3 read KV head 1, the second of its KV heads 0..1.
    const int64_t head0 = 2, kv_head0 = 0;
    const std::vector<int32_t> table = {5, 1, 3, 0, 4};  // sequence 0: 5 1 3; sequence 1: 0 4
    std::vector<int32_t> pos, offset;
    for (int32_t p = 0; p < 16; ++p) {
      pos.push_back(p < 10 ? p : p - 10);
      offset.push_back(p < 10 ? 0 : 3);
    }
    const int64_t rows = static_cast<int64_t>(pos.size()), kvd = kv_heads * hd;
    const std::vector<float> k = Random(rows * kvd, 12), v = Random(rows * kvd, 13),
                             q = Random(rows * heads * hd, 14, -2, 2);
    auto other = be_->AllocKv(layers, 6, kv_heads, bs, hd, format);  // a second cache stays apart
    auto kv = be_->AllocKv(layers, 6, kv_heads, bs, hd, format);
    ASSERT_TRUE(kv.ok() && other.ok());
    EXPECT_EQ((*kv)->owner, be_.get());
    EXPECT_EQ((*kv)->block_bytes(),
              static_cast<size_t>(kv_heads * bs * hd) * DTypeSize(format.dtype));
    const std::vector<float> kc = AsCached(format, 1, 0, k), vc = AsCached(format, 1, 1, v);
    Mem mem(*be_);
    const int32_t *dp = mem.Put(pos), *dt = mem.Put(table), *doff = mem.Put(offset);
    ASSERT_TRUE(be_->WriteKv(**kv, 1, mem.Put(k), mem.Put(v), rows, dp, dt, doff).ok());
    const std::vector<float> noise = Random(rows * kvd, 15);
    ASSERT_TRUE(be_->WriteKv(**other, 1, mem.Put(noise), mem.Put(noise), rows, dp, dt, doff).ok());
    float* out = mem.Zeros<float>(rows * heads * hd);
    const float scale = 1 / std::sqrt(float(hd));
    ASSERT_TRUE(be_->Attention(**kv, 1, mem.Put(q), rows, heads, head0, group, kv_head0, dp, dt,
                               doff, 10, scale, {}, out)
                    .ok());
    const std::vector<float> got = mem.Get(out, rows * heads * hd);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t first = r < 10 ? 0 : 10;  // the sequence's first row
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t kh = (head0 + h) / group - kv_head0;  // the local KV head
        const std::vector<double> want = AttentionOfOneHead(q.data() + (r * heads + h) * hd, kc, vc,
                                                            kvd, kh, hd, first, r, scale);
        for (int64_t d = 0; d < hd; ++d) {
          ASSERT_NEAR(got[(r * heads + h) * hd + d], want[d], 1e-5)
              << KvName(format) << " " << r << " " << h << " " << d;
        }
      }
    }
  }
}

// Attention at decode shapes: long sequences (the GPU splits them across blocks and merges),
// query heads sharing a KV head (read once for the group), a TP rank's heads that start past
// head 0, head sizes that are not a multiple of 4, and a prompt's rows (one split), against
// double-precision arithmetic; and each with gpt-oss's extras, a window of 37 positions and a
// sink logit per head; in each KV format.
TEST_P(BackendOpsTest, AttentionOverLongSequencesAndHeadGroups) {
  for (const KvFormat& format : KvFormats()) {
    struct Shape {
      int64_t hd, cache_kv_heads, heads, group, head0, kv_head0;
    };
    for (const Shape& sh : {Shape{64, 4, 32, 8, 0, 0}, Shape{128, 2, 8, 4, 8, 2},
                            Shape{34, 3, 3, 1, 3, 3}, Shape{64, 1, 12, 12, 12, 1}}) {
      const int64_t hd = sh.hd, kvh = sh.cache_kv_heads, kvd = kvh * hd, bs = 16;
      // Sequences of these lengths in scattered blocks; each is written whole.
      const std::vector<int64_t> lens = {701, 130, 1, 40};
      std::vector<int32_t> table, wpos, woff;
      std::vector<int64_t> first_block;
      int32_t next = 0;
      for (int64_t len : lens) {
        first_block.push_back(static_cast<int64_t>(table.size()));
        for (int64_t b = 0; b < (len + bs - 1) / bs; ++b) table.push_back(next++);
      }
      std::mt19937 rng(static_cast<uint32_t>(hd));
      std::shuffle(table.begin(), table.end(), rng);
      for (size_t s = 0; s < lens.size(); ++s) {
        for (int64_t p = 0; p < lens[s]; ++p) {
          wpos.push_back(static_cast<int32_t>(p));
          woff.push_back(static_cast<int32_t>(first_block[s]));
        }
      }
      const int64_t written = static_cast<int64_t>(wpos.size());
      const std::vector<float> k = Random(written * kvd, 40 + hd, -2, 2),
                               v = Random(written * kvd, 41 + hd);
      // One layer: FP8 under layer 1's scales.
      const KvFormat one{format.dtype, {format.KScale(1)}, {format.VScale(1)}};
      auto kv = be_->AllocKv(1, next, kvh, bs, hd, one);
      ASSERT_TRUE(kv.ok()) << kv.status();
      const std::vector<float> kc = AsCached(one, 0, 0, k), vc = AsCached(one, 0, 1, v);
      Mem mem(*be_);
      ASSERT_TRUE(be_->WriteKv(**kv, 0, mem.Put(k), mem.Put(v), written, mem.Put(wpos),
                               mem.Put(table), mem.Put(woff))
                      .ok());
      // Queries: each sequence's last position (decode), then every row of the 40-token prompt.
      std::vector<int32_t> qpos, qoff, qseq;
      for (size_t s = 0; s < lens.size(); ++s) {
        qpos.push_back(static_cast<int32_t>(lens[s] - 1));
        qoff.push_back(static_cast<int32_t>(first_block[s]));
        qseq.push_back(static_cast<int32_t>(s));
      }
      for (int32_t p = 0; p < 40; ++p) {
        qpos.push_back(p);
        qoff.push_back(static_cast<int32_t>(first_block[3]));
        qseq.push_back(3);
      }
      const int64_t all_rows = static_cast<int64_t>(qpos.size());
      const std::vector<float> q = Random(all_rows * sh.heads * hd, 42 + hd, -2, 2);
      const std::vector<float> sinks = Random(sh.heads, 43 + hd, -1, 3);
      const float scale = 1 / std::sqrt(float(hd));
      // The decode rows alone (few items: the GPU splits each head's positions more finely and
      // merges the splits, sinks included), then every row.
      for (const int64_t rows : {static_cast<int64_t>(lens.size()), all_rows})
        for (const AttentionExtras& extras :
             {AttentionExtras{}, AttentionExtras{37, mem.Put(sinks)}}) {
          float* out = mem.Zeros<float>(rows * sh.heads * hd);
          ASSERT_TRUE(be_->Attention(**kv, 0, mem.Put(q), rows, sh.heads, sh.head0, sh.group,
                                     sh.kv_head0, mem.Put(qpos), mem.Put(table), mem.Put(qoff), 701,
                                     scale, extras, out)
                          .ok());
          const std::vector<float> got = mem.Get(out, rows * sh.heads * hd);
          for (int64_t r = 0; r < rows; ++r) {
            int64_t base = 0;  // the sequence's first written row
            for (int32_t s = 0; s < qseq[r]; ++s) base += lens[s];
            const int64_t last = base + qpos[r];
            const int64_t first =
                extras.window > 0 ? std::max(base, last - extras.window + 1) : base;
            for (int64_t h = 0; h < sh.heads; ++h) {
              const int64_t kh = (sh.head0 + h) / sh.group - sh.kv_head0;
              const std::vector<double> want =
                  AttentionOfOneHead(q.data() + (r * sh.heads + h) * hd, kc, vc, kvd, kh, hd, first,
                                     last, scale, extras.sinks ? sinks[h] : -INFINITY);
              for (int64_t d = 0; d < hd; ++d) {
                ASSERT_NEAR(got[(r * sh.heads + h) * hd + d], want[d], 2e-5)
                    << KvName(format) << " hd " << hd << " group " << sh.group << " row " << r
                    << " head " << h << " d " << d << " window " << extras.window << " of " << rows
                    << " rows";
              }
            }
          }
        }
    }
  }
}

// gpt-oss's clamped SwiGLU against its definition, values on both sides of the limits.
TEST_P(BackendOpsTest, SwiGluClampedClampsThenGates) {
  const int64_t n = 300;
  const std::vector<float> a = Random(n, 61, -12, 12), b = Random(n, 62, -12, 12);
  Mem mem(*be_);
  float* da = mem.Put(a);
  const float alpha = 1.702f, limit = 7.0f;
  ASSERT_TRUE(be_->SwiGluClamped(da, mem.Put(b), n, alpha, limit).ok());
  const std::vector<float> got = mem.Get(da, n);
  for (int64_t i = 0; i < n; ++i) {
    const double g = std::min<double>(a[i], limit), u = std::clamp<double>(b[i], -limit, limit);
    const double want = (u + 1) * g / (1 + std::exp(-alpha * g));
    ASSERT_NEAR(got[i], want, 1e-5 * std::max(1.0, std::fabs(want))) << a[i] << " " << b[i];
  }
}

TEST_P(BackendOpsTest, RowGatherScatterAndCopies) {
  const int64_t dim = 5;
  const std::vector<float> x = Random(4 * dim, 16);
  const std::vector<int32_t> rows = {3, 0, 3};
  const std::vector<float> w = {0.5f, 2.0f, -1.0f};
  Mem mem(*be_);
  float* gathered = mem.Zeros<float>(rows.size() * dim);
  const int32_t* dr = mem.Put(rows);
  ASSERT_TRUE(be_->GatherRows(mem.Put(x), dim, dr, 3, gathered).ok());
  float* y = mem.Put(x);
  ASSERT_TRUE(be_->ScaleAddRows(gathered, dim, dr, mem.Put(w), 3, y).ok());
  const std::vector<float> g = mem.Get(gathered, rows.size() * dim), got = mem.Get(y, x.size());
  for (int64_t c = 0; c < dim; ++c) {
    EXPECT_EQ(g[c], x[3 * dim + c]);
    EXPECT_EQ(g[dim + c], x[c]);
    EXPECT_NEAR(got[c], x[c] + 2.0f * x[c], 1e-6);                         // row 0
    EXPECT_NEAR(got[3 * dim + c], x[3 * dim + c] * (1 + 0.5f - 1), 1e-6);  // row 3, twice
    EXPECT_EQ(got[dim + c], x[dim + c]);                                   // untouched
  }
  // Pitched copies both ways, and zeros.
  std::vector<float> m(21);
  std::iota(m.begin(), m.end(), 0.0f);
  float* d = mem.Zeros<float>(9);
  ASSERT_TRUE(be_->Copy2D(d, 3 * 4, m.data() + 2, 7 * 4, 3 * 4, 3).ok());
  EXPECT_EQ(mem.Get(d, 9), (std::vector<float>{2, 3, 4, 9, 10, 11, 16, 17, 18}));
  std::vector<float> back(8, -1);
  ASSERT_TRUE(be_->Copy2D(back.data(), 4 * 4, d, 3 * 4, 3 * 4, 2).ok());
  EXPECT_EQ(back, (std::vector<float>{2, 3, 4, -1, 9, 10, 11, -1}));
  ASSERT_TRUE(be_->Zero(d, 2 * 4).ok());
  EXPECT_EQ(mem.Get(d, 3), (std::vector<float>{0, 0, 4}));
}

// Top-k routing (ties to the lower expert), then both ways of running the experts: one product
// per (row, expert) slot and its weighted combination.
TEST_P(BackendOpsTest, MoeRoutingAndExpertProducts) {
  const int64_t rows = 3, E = 4, k = 2, H = 16, I = 8, begin = 1, count = 2;
  std::vector<float> router = Random(rows * E, 17, -2, 2);
  router[1 * E + 0] = router[1 * E + 3] = 5;  // a tie: expert 0 first
  Mem mem(*be_);
  int32_t* de = mem.Zeros<int32_t>(rows * k);
  float* dw = mem.Zeros<float>(rows * k);
  // The k weights renormalized (Mixtral), or their share of the softmax over all E (Qwen3-MoE
  // without norm_topk_prob).
  for (bool normalize : {false, true}) {
    ASSERT_TRUE(be_->RouteTopK(mem.Put(router), rows, E, k, normalize, de, dw).ok());
    const std::vector<int32_t> experts = mem.Get(de, rows * k);
    const std::vector<float> weights = mem.Get(dw, rows * k);
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<int32_t> order(E);
      std::iota(order.begin(), order.end(), 0);
      const float* l = router.data() + r * E;
      std::stable_sort(order.begin(), order.end(),
                       [&](int32_t a, int32_t b) { return l[a] > l[b]; });
      double z = 0;
      for (int64_t j = 0; j < (normalize ? k : E); ++j) z += std::exp(double(l[order[j]]));
      for (int64_t j = 0; j < k; ++j) {
        EXPECT_EQ(experts[r * k + j], order[j]) << r;
        EXPECT_NEAR(weights[r * k + j], std::exp(double(l[order[j]])) / z, 1e-6) << normalize;
      }
    }
  }
  const std::vector<int32_t> experts = mem.Get(de, rows * k);  // the normalized routes, last
  const std::vector<float> weights = mem.Get(dw, rows * k);
  // The two local experts' [I][H] matrices (BF16), a table of their pointers in backend memory.
  std::vector<std::vector<float>> mats(count);
  std::vector<std::vector<uint8_t>> bytes(count);
  std::vector<const void*> ptrs;
  DType kept = DType::kBF16;  // the layout the backend keeps them in (the CPU's BF16X)
  for (int64_t e = 0; e < count; ++e) {
    mats[e] = Random(I * H, 18 + e);
    bytes[e] = Encode(DType::kBF16, mats[e]);
    auto up = be_->Upload(WeightMatrix{DType::kBF16, bytes[e].data(), I, H, H});
    ASSERT_TRUE(up.ok());
    ptrs.push_back(up->data);
    kept = up->dtype;
  }
  const ExpertTable table{kept, mem.Put(ptrs), begin, count, I, H};
  const std::vector<float> x = Random(rows * H, 20);
  float* y = mem.Zeros<float>(rows * k * I);
  ASSERT_TRUE(be_->ExpertMatVec(table, de, rows * k, mem.Put(x), k, y).ok());
  const std::vector<float> got = mem.Get(y, rows * k * I);
  for (int64_t s = 0; s < rows * k; ++s) {
    const int64_t e = experts[s] - begin;  // not local: zeros
    for (int64_t i = 0; i < I; ++i) {
      double want = 0, magnitude = 0;
      for (int64_t c = 0; e >= 0 && e < count && c < H; ++c) {
        want += double(mats[e][i * H + c]) * x[(s / k) * H + c];
        magnitude += std::abs(double(mats[e][i * H + c]) * x[(s / k) * H + c]);
      }
      ASSERT_NEAR(got[s * I + i], want, 1e-4 + ActivationRounding(DType::kBF16) * magnitude)
          << s << " " << i;
    }
  }
  float* combined = mem.Zeros<float>(rows * I);
  ASSERT_TRUE(be_->CombineSlots(y, dw, rows, k, I, combined).ok());
  const std::vector<float> sum = mem.Get(combined, rows * I);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < I; ++i) {
      const double want =
          weights[r * k] * got[r * k * I + i] + weights[r * k + 1] * got[(r * k + 1) * I + i];
      ASSERT_NEAR(sum[r * I + i], want, 1e-5);
    }
  }
}

// DeepSeek-V3's routing against its definition in double precision: sigmoid scores, the
// correction bias choosing among the best groups (scored by their two best), the chosen scores
// normalized (or not) and scaled; a tie between two experts goes to the lower id.
TEST_P(BackendOpsTest, RouteGroupedChoosesInsideTheBestGroups) {
  const int64_t rows = 5, E = 16, k = 3;
  std::vector<float> logits = Random(rows * E, 31, -3, 3);
  const std::vector<float> bias = Random(E, 32, -0.3f, 0.3f);
  logits[2 * E + 4] = logits[2 * E + 5] = 2.5f;  // row 2: a tie inside a group
  Mem mem(*be_);
  const float *dl = mem.Put(logits), *db = mem.Put(bias);
  int32_t* de = mem.Zeros<int32_t>(rows * k);
  float* dw = mem.Zeros<float>(rows * k);
  struct Shape {
    int64_t groups, topk_groups;
    bool normalize;
    float scaling;
  };
  for (const Shape& sh : {Shape{1, 1, true, 2.5f}, Shape{4, 2, true, 1.0f},
                          Shape{8, 3, false, 2.5f}, Shape{4, 1, false, 1.0f}}) {
    ASSERT_TRUE(be_->RouteGrouped(dl, db, rows, E, k, sh.groups, sh.topk_groups, sh.normalize,
                                  sh.scaling, de, dw)
                    .ok());
    const std::vector<int32_t> experts = mem.Get(de, rows * k);
    const std::vector<float> weights = mem.Get(dw, rows * k);
    const int64_t per = E / sh.groups;
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<double> score(E), choice(E);
      for (int64_t e = 0; e < E; ++e) {
        score[e] = 1 / (1 + std::exp(-double(logits[r * E + e])));
        choice[e] = score[e] + bias[e];
      }
      std::vector<double> group(sh.groups);
      for (int64_t g = 0; g < sh.groups; ++g) {
        std::vector<double> m(choice.begin() + g * per, choice.begin() + (g + 1) * per);
        std::sort(m.rbegin(), m.rend());
        group[g] = per > 1 ? m[0] + m[1] : m[0];
      }
      std::vector<int64_t> gorder(sh.groups);
      std::iota(gorder.begin(), gorder.end(), 0);
      std::stable_sort(gorder.begin(), gorder.end(),
                       [&](int64_t a, int64_t b) { return group[a] > group[b]; });
      std::vector<bool> kept(sh.groups, sh.groups == 1);
      for (int64_t j = 0; j < sh.topk_groups; ++j) kept[gorder[j]] = true;
      std::vector<int64_t> order;
      for (int64_t e = 0; e < E; ++e) {
        if (kept[e / per]) order.push_back(e);
      }
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t a, int64_t b) { return choice[a] > choice[b]; });
      double sum = 0;
      for (int64_t j = 0; j < k; ++j) sum += score[order[j]];
      for (int64_t j = 0; j < k; ++j) {
        ASSERT_EQ(experts[r * k + j], order[j]) << r << " groups " << sh.groups;
        const double want = (sh.normalize ? score[order[j]] / sum : score[order[j]]) * sh.scaling;
        EXPECT_NEAR(weights[r * k + j], want, 1e-6) << r;
      }
    }
  }
}

// Per-head products (MLA's absorbed query and value projections): strided inputs and outputs,
// every weight dtype, against double-precision arithmetic.
TEST_P(BackendOpsTest, HeadGemmMultipliesEachHeadByItsRows) {
  const int64_t rows = 5, heads = 3, N = 7, K = 12;
  const int64_t ldx = heads * K + 4, ldy = heads * (N + 2) + 1, y_head = N + 2;
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    std::vector<float> w = Random(heads * N * K, 41);
    std::vector<uint8_t> bytes = Encode(dtype, w);
    auto up = be_->Upload(WeightMatrix{dtype, bytes.data(), heads * N, K, K});
    ASSERT_TRUE(up.ok()) << up.status();
    const std::vector<float> x = Random(rows * ldx, 42);
    Mem mem(*be_);
    float* y = mem.Put(std::vector<float>(rows * ldy, 7.0f));  // what it does not write stays
    ASSERT_TRUE(be_->HeadGemm(*up, heads, mem.Put(x), ldx, K, rows, y, ldy, y_head).ok());
    const std::vector<float> got = mem.Get(y, rows * ldy);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t n = 0; n < N; ++n) {
          double want = 0, magnitude = 0;
          for (int64_t c = 0; c < K; ++c) {
            want += double(w[(h * N + n) * K + c]) * x[r * ldx + h * K + c];
            magnitude += std::abs(double(w[(h * N + n) * K + c]) * x[r * ldx + h * K + c]);
          }
          ASSERT_NEAR(got[r * ldy + h * y_head + n], want,
                      1e-4 + ActivationRounding(dtype) * magnitude)
              << DTypeName(dtype);
        }
        EXPECT_EQ(got[r * ldy + h * y_head + N], 7.0f);
      }
    }
  }
  const std::vector<float> none(8);
  std::vector<uint8_t> q(1024);
  auto quant = be_->Upload(WeightMatrix{DType::kQ8_0, q.data(), 2, 32, 32});
  if (quant.ok()) {  // a backend that holds quantized weights refuses them here by name
    Mem mem(*be_);
    const absl::Status st = be_->HeadGemm(*quant, 2, mem.Put(std::vector<float>(64)), 64, 32, 1,
                                          mem.Zeros<float>(2), 2, 1);
    EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("F32, F16 or BF16"));
  }
}

// LoRA's gathered product: rows of three adapters of different ranks, the base (slot -1), a
// slot with no update of this projection (rank 0) and an out-of-range slot in one batch, against
// scale * B (A x) in double; rows of the base and of the empty slots keep what y held. Shapes
// wider than a warp and than a CPU chunk, and a decode batch of one row.
TEST_P(BackendOpsTest, LoraAddGathersEachRowsAdapter) {
  for (const auto& [rows, in, out] :
       {std::tuple<int64_t, int64_t, int64_t>{9, 70, 300}, {1, 33, 5}}) {
    const std::vector<int32_t> ranks = {4, 0, 16, 1};
    const std::vector<float> scales = {0.5f, 1.0f, 2.0f, -1.5f};
    const int64_t S = static_cast<int64_t>(ranks.size()), R = 16;
    Mem mem(*be_);
    std::vector<std::vector<float>> a(S), b(S);
    std::vector<const float*> ap(S), bp(S);
    for (int64_t s = 0; s < S; ++s) {
      a[s] = Random(std::max<int64_t>(1, ranks[s] * in), 60 + s);
      b[s] = Random(std::max<int64_t>(1, out * ranks[s]), 70 + s);  // [out][rank]
      std::vector<float> bt(b[s].size());
      for (int64_t n = 0; n < out; ++n) {
        for (int64_t j = 0; j < ranks[s]; ++j) bt[j * out + n] = b[s][n * ranks[s] + j];
      }
      ap[s] = mem.Put(a[s]);
      bp[s] = mem.Put(bt);
    }
    LoraTable t{mem.Put(ap), mem.Put(bp), mem.Put(ranks), mem.Put(scales), S, in, out, R};
    std::vector<int32_t> slot(rows);
    for (int64_t r = 0; r < rows; ++r) slot[r] = static_cast<int32_t>(r % 6) - 1;  // -1 .. 4
    const std::vector<float> x = Random(rows * in, 80);
    const std::vector<float> y0 = Random(rows * out, 81);
    float* y = mem.Put(y0);
    ASSERT_TRUE(
        be_->LoraAdd(t, mem.Put(slot), rows, mem.Put(x), y, mem.Zeros<float>(rows * R)).ok());
    const std::vector<float> got = mem.Get(y, rows * out);
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t s = slot[r];
      const int64_t rank = s >= 0 && s < S ? ranks[s] : 0;
      for (int64_t n = 0; n < out; ++n) {
        double want = y0[r * out + n];
        for (int64_t j = 0; j < rank; ++j) {
          double u = 0;
          for (int64_t k = 0; k < in; ++k) u += double(a[s][j * in + k]) * x[r * in + k];
          want += scales[s] * double(b[s][n * rank + j]) * u;
        }
        ASSERT_NEAR(got[r * out + n], want, 1e-4) << "row " << r << " slot " << s << " n " << n;
      }
    }
  }
}

// Latent attention against the expanded arithmetic: each head's score of a position is its
// latent query against the position's latent plus its rotated query against the rotated key;
// the output the softmax-weighted latents. Two sequences in shuffled blocks, a prompt's rows and
// a long decode row, a second cache that stays apart.
TEST_P(BackendOpsTest, LatentAttentionReadsWhatWriteLatentKvWrote) {
  for (const KvFormat& format : KvFormats()) {
    const int64_t L = 40, R = 8, D = L + R, bs = 4, heads = 3, layers = 2;
    std::vector<int32_t> pos, offset, table;
    for (int32_t b = 0; b < 40; ++b) table.push_back((b * 7) % 40);  // sequence 0: 30 blocks
    for (int32_t p = 0; p < 9; ++p) {                                // sequence 1: a prompt of 9
      pos.push_back(p);
      offset.push_back(30);
    }
    for (int32_t p = 0; p < 117; ++p) {  // sequence 0: 117 positions
      pos.push_back(p);
      offset.push_back(0);
    }
    const int64_t rows = static_cast<int64_t>(pos.size());
    const std::vector<float> lat = Random(rows * L, 51), rope = Random(rows * R, 52),
                             ql = Random(rows * heads * L, 53, -0.5f, 0.5f),
                             qr = Random(rows * heads * R, 54, -2, 2);
    auto kv = be_->AllocLatentKv(layers, 40, bs, L, R, format);
    auto other = be_->AllocLatentKv(layers, 40, bs, L, R, format);
    ASSERT_TRUE(kv.ok() && other.ok());
    EXPECT_EQ((*kv)->owner, be_.get());
    EXPECT_EQ((*kv)->block_bytes(), static_cast<size_t>(bs * D) * DTypeSize(format.dtype));
    // A latent row under layer 1's K scale.
    const std::vector<float> latc = AsCached(format, 1, 0, lat),
                             ropec = AsCached(format, 1, 0, rope);
    Mem mem(*be_);
    const int32_t *dp = mem.Put(pos), *dt = mem.Put(table), *doff = mem.Put(offset);
    ASSERT_TRUE(be_->WriteLatentKv(**kv, 1, mem.Put(lat), mem.Put(rope), rows, dp, dt, doff).ok());
    const std::vector<float> noise = Random(rows * D, 55);
    ASSERT_TRUE(
        be_->WriteLatentKv(**other, 1, mem.Put(noise), mem.Put(noise), rows, dp, dt, doff).ok());
    float* out = mem.Zeros<float>(rows * heads * L);
    const float scale = 0.3f;
    ASSERT_TRUE(be_->LatentAttention(**kv, 1, mem.Put(ql), mem.Put(qr), rows, heads, dp, dt, doff,
                                     117, scale, out)
                    .ok());
    const std::vector<float> got = mem.Get(out, rows * heads * L);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t first = r < 9 ? 0 : 9;  // the sequence's first row
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t item = r * heads + h;
        std::vector<double> score;
        double mx = -1e300;
        for (int64_t p = first; p <= r; ++p) {
          double s = 0;
          for (int64_t d = 0; d < L; ++d) s += double(ql[item * L + d]) * latc[p * L + d];
          for (int64_t d = 0; d < R; ++d) s += double(qr[item * R + d]) * ropec[p * R + d];
          score.push_back(s * scale);
          mx = std::max(mx, score.back());
        }
        double z = 0;
        for (double& s : score) z += (s = std::exp(s - mx));
        for (int64_t d = 0; d < L; ++d) {
          double want = 0;
          for (int64_t p = first; p <= r; ++p) want += score[p - first] / z * latc[p * L + d];
          ASSERT_NEAR(got[item * L + d], want, 1e-5)
              << KvName(format) << " " << r << " " << h << " " << d;
        }
      }
    }
  }
}

// The summaries VocabSummaries wrote (`got`) for K, against the host's: each row's max, sum of
// exp(logit - max), and its K best in order (ties to the lower id), -inf past the slice's n.
void ExpectSummaries(const std::vector<float>& logits, int64_t rows, int64_t ld, int64_t n,
                     int64_t begin, int64_t K, const std::vector<float>& got) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits.data() + r * ld;
    const float* rec = got.data() + r * (2 + 2 * K);
    std::vector<int32_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return row[a] > row[b]; });
    double z = 0;
    for (int64_t i = 0; i < n; ++i) z += std::exp(double(row[i]) - row[order[0]]);
    EXPECT_EQ(rec[0], row[order[0]]);
    EXPECT_NEAR(rec[1], z, 1e-5 * z);
    for (int64_t j = 0; j < K; ++j) {
      if (j < n) {
        EXPECT_EQ(rec[2 + 2 * j], row[order[j]]) << K << " " << j;
        EXPECT_EQ(rec[3 + 2 * j], float(begin + order[j])) << K << " " << j;
      } else {
        EXPECT_EQ(rec[2 + 2 * j], -INFINITY);
      }
    }
  }
}

// Summaries of a vocabulary slice: max, sum of exp, the K best (ties to the lower id) as global
// ids; a slice narrower than K pads with -inf.
TEST_P(BackendOpsTest, VocabSummariesOfASlice) {
  const int64_t rows = 2, ld = 40, n = 30, begin = 500;
  std::vector<float> logits = Random(rows * ld, 21, -4, 4);
  logits[1 * ld + 4] = logits[1 * ld + 9] = 9;
  Mem mem(*be_);
  const float* dl = mem.Put(logits);
  for (int64_t K : {1, 3, 35}) {
    std::vector<float> got(rows * (2 + 2 * K));
    ASSERT_TRUE(be_->VocabSummaries(dl, rows, ld, n, begin, K, got.data()).ok());
    ExpectSummaries(logits, rows, ld, n, begin, K, got);
  }
}

// A slice longer than one of the GPU's chunks (2,048 logits): the best of each chunk merged, a
// tie across chunks to the lower id, the sum over all of them.
TEST_P(BackendOpsTest, VocabSummariesAcrossChunks) {
  const int64_t rows = 2, n = 5000, ld = 5003, begin = 128;
  std::vector<float> logits = Random(rows * ld, 22, -4, 4);
  logits[0 * ld + 4500] = logits[0 * ld + 100] = 9;  // a tie: 100 first
  logits[1 * ld + 4999] = 8;
  logits[1 * ld + 2048] = 7.5f;
  Mem mem(*be_);
  const float* dl = mem.Put(logits);
  for (int64_t K : {1, 5}) {
    std::vector<float> got(rows * (2 + 2 * K));
    ASSERT_TRUE(be_->VocabSummaries(dl, rows, ld, n, begin, K, got.data()).ok());
    ExpectSummaries(logits, rows, ld, n, begin, K, got);
  }
}

// Sampling at the edges the draw decides: greedy; the draw 0 takes the best token and a draw
// near 1 the last one kept by top-k; top-p that keeps only the best. Log-probabilities are those
// of the raw logits.
TEST_P(BackendOpsTest, SampleRowsFollowsTheSpec) {
  const int64_t V = 50, K = 3;
  std::vector<float> base = Random(V, 22, -3, 3);
  base[7] = base[9] = 6;  // the best two, tied: 7 first
  base[20] = 5.5f;        // the third
  std::vector<float> logits;
  const std::vector<SampleSpec> specs = {{0.0f, 1.0f, 0, 0.0},
                                         {1.0f, 1.0f, 0, 0.0},
                                         {1.0f, 1.0f, 3, 0.9999},
                                         {1.0f, 1e-3f, 0, 0.9999},
                                         {0.5f, 1.0f, 2, 0.9999}};
  for (size_t s = 0; s < specs.size(); ++s) logits.insert(logits.end(), base.begin(), base.end());
  const int64_t rows = static_cast<int64_t>(specs.size());
  Mem mem(*be_);
  std::vector<int32_t> ids(rows), top_ids(rows * K);
  std::vector<float> lps(rows), top_lps(rows * K);
  ASSERT_TRUE(be_->SampleRows(mem.Put(logits), rows, V, specs.data(), K, ids.data(), lps.data(),
                              top_ids.data(), top_lps.data())
                  .ok());
  EXPECT_EQ(ids, (std::vector<int32_t>{7, 7, 20, 7, 9}));
  double z = 0;
  for (float l : base) z += std::exp(double(l) - 6);
  const double log_z = 6 + std::log(z);
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_NEAR(lps[r], base[ids[r]] - log_z, 1e-4) << r;
    EXPECT_EQ(std::vector<int32_t>(top_ids.begin() + r * K, top_ids.begin() + (r + 1) * K),
              (std::vector<int32_t>{7, 9, 20}));
    EXPECT_NEAR(top_lps[r * K + 2], base[20] - log_z, 1e-4);
  }
}

}  // namespace
}  // namespace shardserve::testing
