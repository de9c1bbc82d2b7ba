#include "backend/cpu/kernels.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <iostream>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_features.h"
#include "backend/cpu/kernels_avx512.h"
#include "backend/cpu/quant.h"
#include "backend_ops_test.h"
#include "devtools/quantize_row.h"

namespace shardserve::cpu {
namespace {

struct Weights {
  std::vector<uint8_t> bytes;
  std::vector<double> values;  // the exact values the kernel must see
};

Weights MakeWeights(DType dtype, int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1, 1);
  Weights w;
  w.bytes.resize(n * DTypeSize(dtype));
  for (int64_t i = 0; i < n; ++i) {
    const float v = dist(rng);
    if (dtype == DType::kF32) {
      std::memcpy(&w.bytes[4 * i], &v, 4);
      w.values.push_back(v);
    } else {
      const uint16_t h = dtype == DType::kF16 ? F32ToF16(v) : F32ToBf16(v);
      std::memcpy(&w.bytes[2 * i], &h, 2);
      w.values.push_back(dtype == DType::kF16 ? F16ToF32(h) : Bf16ToF32(h));
    }
  }
  return w;
}

// The kernel levels this CPU and this build run (cpu_features.h), narrowest first.
std::vector<KernelLevel> LevelsOfThisCpu() {
  std::vector<KernelLevel> levels;
  for (KernelLevel l : {KernelLevel::kAvx2, KernelLevel::kAvx512, KernelLevel::kAvx512Bf16,
                        KernelLevel::kAvx512Int8, KernelLevel::kPortable}) {
    if (ChooseKernelLevel(CpuFeatures::Detect(), KernelLevelName(l)).ok()) levels.push_back(l);
  }
  return levels;
}

// The activation a kernel of `level` multiplies a `dtype` weight by: x itself, but rounded to
// BF16 for BF16 weights at kAvx512Bf16 (the stated arithmetic of its dot products).
double ActivationAt(KernelLevel level, DType dtype, float x) {
  return level == KernelLevel::kAvx512Bf16 && dtype == DType::kBF16 ? Bf16ToF32(F32ToBf16(x)) : x;
}

// Whether a case of `level` and `dtype` runs its prefill with and without AMX's tiles (BF16 at
// kAvx512Bf16, where the CPU has AMX-BF16; said once a run where it lacks it): {true, false}, else
// {true} (UseAmx(true): whatever the CPU has).
std::vector<bool> AmxChoices(KernelLevel level, DType dtype) {
  if (level != KernelLevel::kAvx512Bf16 || dtype != DType::kBF16) return {true};
  if (CpuFeatures::Detect().amx_bf16) return {true, false};
  static bool said = false;
  if (!std::exchange(said, true)) {
    std::cout << "[ SKIPPED  ] AMX tiles of avx512bf16: this CPU lacks AMX-BF16\n";
  }
  return {true};
}

// Runs `level`'s kernels, AMX's tiles on or off (x86-64 builds).
void SetLevelAndAmx(KernelLevel level, bool amx) {
  SetKernelLevel(level);
#if !SHARDSERVE_PORTABLE_KERNELS
  avx512::UseAmx(amx);
#endif
}

// Gives back, however the test leaves (a failed ASSERT returns at once), the kernel level it
// found, with AMX's and VNNI's tiles in use where the CPU has them: the tests after it run the
// process's level.
class KernelLevelRestorer {
 public:
  KernelLevelRestorer() : before_(ActiveKernelLevel()) {}
  KernelLevelRestorer(const KernelLevelRestorer&) = delete;
  KernelLevelRestorer& operator=(const KernelLevelRestorer&) = delete;
  ~KernelLevelRestorer() {
    SetLevelAndAmx(before_, true);
#if !SHARDSERVE_PORTABLE_KERNELS
    UseVnni(true);
#endif
  }

 private:
  const KernelLevel before_;
};

// MatMul against a double-precision loop, for every dtype and the decode and prefill paths,
// including ragged shapes (N not a multiple of 16, K not a multiple of 8 or of the K block), at
// every kernel level this CPU runs (BF16 at kAvx512Bf16 with AMX's tiles and without): the loop
// multiplies what that level's arithmetic states (ActivationAt), so the bound stays that of F32
// sums.
TEST(KernelsTest, MatMulMatchesReference) {
  std::mt19937 rng(1);
  const KernelLevelRestorer restorer;
  for (const auto& [level, dtype, amx] : [] {
         std::vector<std::tuple<KernelLevel, DType, bool>> cases;
         for (KernelLevel l : LevelsOfThisCpu()) {
           for (DType d : {DType::kF32, DType::kF16, DType::kBF16}) {
             for (bool amx : AmxChoices(l, d)) cases.emplace_back(l, d, amx);
           }
         }
         return cases;
       }()) {
    SetLevelAndAmx(level, amx);
    for (int threads : {1, 3}) {
      ThreadPool pool(threads);
      // Prefill (M > 12): one token panel with a ragged edge, several panels, whole 8x8 blocks.
      for (int64_t M : {1, 2, 3, 4, 7, 12, 13, 33, 40}) {
        for (int64_t N : {1, 5, 16, 37, 150}) {
          for (int64_t K : {1, 8, 13, 300, 520}) {
            Weights w = MakeWeights(dtype, N * K, rng);
            std::vector<float> x(M * K), y(M * N, -1.f);
            for (float& v : x) v = std::uniform_real_distribution<float>(-1, 1)(rng);
            WeightMatrix wm{dtype, w.bytes.data(), N, K, K};
            MatMul(wm, x.data(), M, K, y.data(), N, pool);
            for (int64_t m = 0; m < M; ++m) {
              for (int64_t n = 0; n < N; ++n) {
                double ref = 0;
                for (int64_t k = 0; k < K; ++k) {
                  ref += w.values[n * K + k] * ActivationAt(level, dtype, x[m * K + k]);
                }
                ASSERT_NEAR(y[m * N + n], ref, 1e-4 * std::sqrt(K))
                    << DTypeName(dtype) << " M=" << M << " N=" << N << " K=" << K << " "
                    << KernelLevelName(level) << (amx ? "" : " without AMX");
              }
            }
          }
        }
      }
    }
  }
}

// Up to 12 tokens, a token's outputs do not depend on the other tokens of the batch: decoding
// sequences together gives bit-identical results to decoding them alone.
TEST(KernelsTest, SmallBatchesAreBatchInvariant) {
  std::mt19937 rng(2);
  ThreadPool pool(2);
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    const int64_t N = 200, K = 264;
    Weights w = MakeWeights(dtype, N * K, rng);
    WeightMatrix wm{dtype, w.bytes.data(), N, K, K};
    std::vector<float> x(12 * K);
    for (float& v : x) v = std::uniform_real_distribution<float>(-1, 1)(rng);
    std::vector<float> alone(12 * N);
    for (int64_t m = 0; m < 12; ++m)
      MatMul(wm, x.data() + m * K, 1, K, alone.data() + m * N, N, pool);
    for (int64_t M : {2, 3, 4, 5, 8, 12}) {
      std::vector<float> y(M * N);
      MatMul(wm, x.data(), M, K, y.data(), N, pool);
      for (int64_t i = 0; i < M * N; ++i) {
        ASSERT_EQ(y[i], alone[i]) << DTypeName(dtype) << " M=" << M << " at " << i;
      }
    }
  }
}

TEST(KernelsTest, MatMulHonoursRowStrideAndLeadingDimensions) {
  std::mt19937 rng(2);
  const int64_t M = 5, N = 9, K = 24, stride = 40, ldx = 30, ldy = 11;
  Weights w = MakeWeights(DType::kBF16, N * stride, rng);
  std::vector<float> x(M * ldx), y(M * ldy, 7.f);
  for (float& v : x) v = std::uniform_real_distribution<float>(-1, 1)(rng);
  ThreadPool pool(2);
  for (int64_t m : {int64_t{1}, M}) {
    MatMul({DType::kBF16, w.bytes.data(), N, K, stride}, x.data(), m, ldx, y.data(), ldy, pool);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t n = 0; n < N; ++n) {
        double ref = 0;
        for (int64_t k = 0; k < K; ++k) {
          ref += w.values[n * stride + k] *
                 ActivationAt(ActiveKernelLevel(), DType::kBF16, x[i * ldx + k]);
        }
        ASSERT_NEAR(y[i * ldy + n], ref, 1e-4);
      }
      EXPECT_EQ(y[i * ldy + N], 7.f) << "wrote past N";
    }
  }
}

TEST(KernelsTest, RmsNormSiluDotAxpy) {
  const std::vector<float> x = {1, -2, 3, -4}, w = {1, 0.5, 2, 1};
  std::vector<float> out(4);
  RmsNorm(x.data(), 1, 4, w.data(), 1e-6f, out.data());
  const double rms = std::sqrt((1 + 4 + 9 + 16) / 4.0 + 1e-6);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(out[i], w[i] * x[i] / rms, 1e-6);

  ThreadPool pool(3);
  std::vector<float> a(10000), b(10000, 2.0f);
  for (size_t i = 0; i < a.size(); ++i) a[i] = 0.001f * i - 5;
  SiluMul(a.data(), b.data(), a.size(), pool);
  for (size_t i = 0; i < a.size(); ++i) {
    const double g = 0.001 * i - 5;
    ASSERT_NEAR(a[i], g / (1 + std::exp(-g)) * 2, 1e-5) << i;
  }
  // The vector exp (libmvec) over the whole range, tails included: within a few ulp relative.
  std::vector<float> wide(20001), ones(wide.size(), 1.0f);
  for (size_t i = 0; i < wide.size(); ++i) wide[i] = 0.009f * i - 90;
  std::vector<float> silu = wide;
  SiluMul(silu.data(), ones.data(), silu.size(), pool);
  double worst = 0;
  for (size_t i = 0; i < wide.size(); ++i) {
    const double g = wide[i], want = g / (1 + std::exp(-g));
    // Below -88, e^-g overflows F32 and the product is 0 (as with std::exp in F32).
    worst = std::max(worst, std::fabs(silu[i] - want) / std::max(std::fabs(want), 1e-30));
    ASSERT_TRUE(std::isfinite(silu[i])) << wide[i];
  }
  EXPECT_LT(worst, 1e-6);
  std::vector<float> p(37), q(37);
  double dot = 0;
  for (int i = 0; i < 37; ++i) {
    p[i] = 0.1f * i;
    q[i] = 1.0f - 0.05f * i;
    dot += double(p[i]) * q[i];
  }
  EXPECT_NEAR(Dot(p.data(), q.data(), 37), dot, 1e-4);
  Axpy(2.0f, p.data(), q.data(), 37);
  EXPECT_NEAR(q[36], 1.0f - 0.05f * 36 + 2 * 3.6f, 1e-5);
}

// The value a cached element of `dtype` holds, by the scalar conversions of backend/dtype.h.
double CachedValue(DType dtype, const uint8_t* at) {
  uint16_t h;
  std::memcpy(&h, at, 2);
  switch (dtype) {
    case DType::kBF16:
      return Bf16ToF32(h);
    case DType::kF16:
      return F16ToF32(h);
    case DType::kF8E4M3:
      return F8E4M3ToF32(*at);
    default: {
      float f;
      std::memcpy(&f, at, 4);
      return f;
    }
  }
}

// AttendGroup against a double-precision softmax(q·K^T·scale)·V of each head, for the
// register-resident head sizes (64, 128) and the generic path, one head and GQA groups of three
// and eight (with sinks), over positions spread across blocks, for every KV cache dtype (rows
// written by FloatToKv, the reference reading them with the scalar conversions, so the vector
// loads of each dtype are checked value for value) with K and V scales, at every kernel level of
// this CPU; the AVX-512 kernels' scores and outputs bit for bit AVX2's.
TEST(KernelsTest, AttendGroupMatchesReference) {
  const std::vector<KernelLevel> levels = LevelsOfThisCpu();
  const KernelLevelRestorer restorer;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1, 1);
  for (const DType dtype : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3}) {
    const size_t es = DTypeSize(dtype);
    // FP8: values up to 3 under scales that put them in E4M3's normal and subnormal ranges.
    const float ks = dtype == DType::kF8E4M3 ? 0.02f : 1.f, vs = dtype == DType::kF8E4M3 ? 3 : 1;
    for (int64_t G : {1, 3, 8})
      for (int64_t hd : {64, 128, 24}) {
        for (int64_t len : {1, 5, 16, 37}) {
          const int64_t bs = 16, nblocks = (len + bs - 1) / bs, begin = len > 5 ? 2 : 0;
          std::vector<std::vector<uint8_t>> kb(nblocks, std::vector<uint8_t>(bs * hd * es)),
              vb(nblocks, std::vector<uint8_t>(bs * hd * es));
          std::vector<const void*> kp, vp;
          std::vector<float> row(bs * hd);
          for (int64_t b = 0; b < nblocks; ++b) {
            for (float& v : row) v = 3 * u(rng);
            FloatToKv(dtype, row.data(), bs * hd, ks, kb[b].data());
            for (float& v : row) v = 3 * u(rng);
            FloatToKv(dtype, row.data(), bs * hd, vs, vb[b].data());
            kp.push_back(kb[b].data());
            vp.push_back(vb[b].data());
          }
          auto value = [&](const std::vector<std::vector<uint8_t>>& blocks, int64_t p, int64_t i) {
            return CachedValue(dtype, blocks[p / bs].data() + ((p % bs) * hd + i) * es);
          };
          std::vector<float> q(G * hd), out(G * hd), scores(G * len), sinks(G);
          for (float& v : q) v = u(rng);
          for (float& v : sinks) v = u(rng);
          std::vector<const float*> qs;
          std::vector<float*> outs;
          for (int64_t g = 0; g < G; ++g) {
            qs.push_back(q.data() + g * hd);
            outs.push_back(out.data() + g * hd);
          }
          const float scale = 0.3f;
          const float* sink = G > 1 ? sinks.data() : nullptr;
          // Each head's reference outputs (ref[g * hd + i]), once for every level.
          std::vector<double> ref(G * hd, 0.0);
          for (int64_t g = 0; g < G; ++g) {
            std::vector<double> w(len);
            double mx = sink ? sink[g] : -1e30;
            for (int64_t p = begin; p < len; ++p) {
              double s = 0;
              for (int64_t i = 0; i < hd; ++i) s += double(q[g * hd + i]) * value(kb, p, i) * ks;
              w[p] = s * scale;
              mx = std::max(mx, w[p]);
            }
            double sum = sink ? std::exp(sink[g] - mx) : 0;
            for (int64_t p = begin; p < len; ++p) sum += (w[p] = std::exp(w[p] - mx));
            for (int64_t i = 0; i < hd; ++i) {
              for (int64_t p = begin; p < len; ++p) {
                ref[g * hd + i] += w[p] / sum * value(vb, p, i) * vs;
              }
            }
          }
          std::vector<float> avx2_out, avx2_scores;
          for (KernelLevel level : levels) {
            SetKernelLevel(level);
            std::fill(out.begin(), out.end(), NAN);
            std::fill(scores.begin(), scores.end(), NAN);
            AttendGroup(qs.data(), G, KvRows{dtype, ks, vs}, kp.data(), vp.data(), bs, hd, begin,
                        len, scale, sink, scores.data(), outs.data());
            const std::string where = absl::StrCat(DTypeName(dtype), " G=", G, " hd=", hd,
                                                   " len=", len, " ", KernelLevelName(level));
            if (level == KernelLevel::kAvx2) {
              avx2_out = out;
              avx2_scores = scores;
            } else if (!avx2_out.empty()) {
              ASSERT_EQ(std::memcmp(out.data(), avx2_out.data(), out.size() * sizeof(float)), 0)
                  << where;
              for (int64_t g = 0; g < G; ++g) {
                ASSERT_EQ(std::memcmp(scores.data() + g * len + begin,
                                      avx2_scores.data() + g * len + begin,
                                      (len - begin) * sizeof(float)),
                          0)
                    << where;
              }
            }
            for (int64_t i = 0; i < G * hd; ++i) {
              ASSERT_NEAR(out[i], ref[i], 3e-5) << where << " g=" << i / hd << " i=" << i % hd;
            }
          }
        }
      }
  }
}

// FloatToKv rounds to the nearest value of the dtype (E4M3: under its scale, saturated), which
// KvToFloat gives back times the scale.
TEST(KernelsTest, KvConversionsRoundToTheDtype) {
  const std::vector<float> x = {0.f, 1.f, -1.5f, 0.1f, 3.14159f, -1000.f, 1e-3f, 447.f, 65504.f};
  for (const DType dtype : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3}) {
    const float scale = dtype == DType::kF8E4M3 ? 0.5f : 1.f;
    std::vector<uint8_t> bytes(x.size() * DTypeSize(dtype));
    FloatToKv(dtype, x.data(), static_cast<int64_t>(x.size()), scale, bytes.data());
    std::vector<float> back(x.size());
    KvToFloat(dtype, bytes.data(), static_cast<int64_t>(x.size()), scale, back.data());
    for (size_t i = 0; i < x.size(); ++i) {
      const uint8_t* at = bytes.data() + i * DTypeSize(dtype);
      EXPECT_EQ(back[i], CachedValue(dtype, at) * scale) << DTypeName(dtype) << " " << x[i];
      // Within half a step of the dtype (relative: 2^-24, 2^-9, 2^-11, 2^-4), FP8 saturating at
      // 448 x scale.
      const double rel = dtype == DType::kF32    ? 1e-7
                         : dtype == DType::kBF16 ? 1.0 / 256
                         : dtype == DType::kF16  ? 1.0 / 1024
                                                 : 1.0 / 16;
      const double want = dtype == DType::kF8E4M3 ? std::clamp(x[i], -224.f, 224.f) : x[i];
      EXPECT_NEAR(back[i], want, std::abs(want) * rel + (dtype == DType::kF8E4M3 ? 1e-3 : 0))
          << DTypeName(dtype) << " " << x[i];
    }
  }
  uint8_t e4m3 = 0;
  const float big = 1e9f;
  FloatToKv(DType::kF8E4M3, &big, 1, 1.f, &e4m3);
  EXPECT_EQ(e4m3, 0x7E);  // 448, the largest finite E4M3
}

// Every F16 value converts exactly (normals, subnormals, zeros, infinities, NaNs): HalfToF32 (the
// loops' inline conversion) and F16ToF32 against the value the bits state.
TEST(KernelsTest, EveryHalfConvertsExactly) {
  for (uint32_t v = 0; v < 65536; ++v) {
    const int e = (v >> 10) & 31, m = v & 1023;
    const double sign = (v & 0x8000) ? -1 : 1;
    const float got = HalfToF32(static_cast<uint16_t>(v));
    ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(F16ToF32(v))) << v;
    if (e == 31) {
      ASSERT_TRUE(m == 0 ? std::isinf(got) && (got < 0) == (sign < 0) : std::isnan(got)) << v;
      continue;
    }
    const double want = sign * (e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25));
    ASSERT_EQ(static_cast<double>(got), want) << v;
    ASSERT_EQ(std::signbit(got), sign < 0) << v;
  }
}

TEST(KernelsTest, DtypeConversionsRoundTrip) {
  for (float v : {0.0f, 1.0f, -2.5f, 65504.0f, 1e-3f}) {
    EXPECT_EQ(F16ToF32(F32ToF16(v)), v == 1e-3f ? F16ToF32(F32ToF16(v)) : v);
    EXPECT_NEAR(Bf16ToF32(F32ToBf16(v)), v, std::fabs(v) / 128);
  }
  EXPECT_EQ(F32ToBf16(1.0f + 1.0f / 256), F32ToBf16(1.0f)) << "ties round to even";
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(std::nanf("")))));
}

// The blocks of a quantized row read independently of the kernels: value j of a block is
// d * q_j (Q8_0), d * (q_j - 8) (Q4_0) or d * q_j + m (Q4_1); a 4-bit block keeps value j in the
// low nibble of byte j and value j + 16 in its high nibble.
std::vector<double> Dequantized(DType dtype, const std::string& bytes, int64_t n) {
  std::vector<double> out;
  const auto* b = reinterpret_cast<const uint8_t*>(bytes.data());
  auto half = [](const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return static_cast<double>(F16ToF32(h));
  };
  for (int64_t blk = 0; blk < n / 32; ++blk, b += DTypeBlockBytes(dtype)) {
    const double d = half(b);
    if (dtype == DType::kQ8_0) {
      for (int j = 0; j < 32; ++j) out.push_back(d * static_cast<int8_t>(b[2 + j]));
      continue;
    }
    const uint8_t* q = b + (dtype == DType::kQ4_0 ? 2 : 4);
    const double m = dtype == DType::kQ4_1 ? half(b + 2) : -8 * d;
    for (int j = 0; j < 32; ++j) out.push_back(d * ((j < 16 ? q[j] : q[j - 16] >> 4) & 15) + m);
  }
  return out;
}

// The activations as the kernels of quantized weights multiply them: each block of 32 quantized
// to integers within +-top (int16: 32767; kAvx512Int8's int8 path: 127) with the scale
// max|x| / top, rounding to nearest even.
std::vector<double> BlockQuantized(const std::vector<float>& x, float top) {
  std::vector<double> out(x.size());
  for (size_t b = 0; b < x.size(); b += 32) {
    float amax = 0;
    for (size_t i = b; i < b + 32; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float scale = amax / top, inv = scale > 0 ? 1.0f / scale : 0.0f;
    for (size_t i = b; i < b + 32; ++i) {
      out[i] = double(scale) * std::clamp(std::nearbyint(x[i] * inv), -top, top);
    }
  }
  return out;
}

// Checks y = x · w^T for the M tokens of x and the N rows of `values` (the weights' exact values,
// [N][K]). Both paths (decode batches of up to 12 tokens, the prefill GEMM beyond) multiply
// integers: they must equal the products with the quantized activations (within +-top: int16's
// 32767, or int8's 127 where kAvx512Int8's int8 path rounds them) up to F32 rounding, and stay
// within the rounding's bound (sum |w| * scale / 2 per block) of the exact products.
void ExpectQuantizedProducts(const std::vector<double>& values, const std::vector<float>& x,
                             const std::vector<float>& y, int64_t M, int64_t N, int64_t K,
                             const std::string& what, float top = 32767) {
  const std::vector<double> xq = BlockQuantized(x, top);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      double exact = 0, quantized = 0, bound = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double v = values[n * K + k];
        exact += v * x[m * K + k];
        quantized += v * xq[m * K + k];
        bound += std::fabs(v * (xq[m * K + k] - x[m * K + k]));
      }
      const double got = y[m * N + n];
      ASSERT_NEAR(got, quantized, 1e-4) << what << " M=" << M << " n=" << n;
      ASSERT_LE(std::fabs(got - exact), bound + 1e-4) << what << " M=" << M << " n=" << n;
    }
  }
}

// Quantized weights: the decode (up to 12 tokens) and prefill paths, on every type, against the
// dot products with the block values; a slice of rows (row stride past its columns) reads only
// its own blocks; ToFloat expands a row; the quantizers' blocks round-trip within half a step.
TEST(KernelsTest, QuantizedMatMulMatchesTheBlockValues) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-1, 1);
  for (DType dtype : {DType::kQ8_0, DType::kQ4_0, DType::kQ4_1}) {
    // Each row: 11 blocks used of 13 stored (a group of 8, whose factors decode takes at once,
    // and 3 more).
    const int64_t N = 37, K = 352, stride = 416;
    std::vector<float> w(N * stride);
    for (float& v : w) v = dist(rng);
    std::string bytes;
    std::vector<double> values;
    for (int64_t n = 0; n < N; ++n) {
      const std::string row = QuantizeRow(dtype, w.data() + n * stride, stride);
      const std::vector<double> v = Dequantized(dtype, row, stride);
      for (int64_t k = 0; k < K; ++k) {
        const double step = dtype == DType::kQ8_0 ? 1.0 / 127 : 2.0 / 15;
        ASSERT_NEAR(v[k], w[n * stride + k], step) << DTypeName(dtype);
      }
      values.insert(values.end(), v.begin(), v.begin() + K);
      bytes += row;
    }
    std::vector<float> expanded(K);
    ToFloat(dtype, bytes.data(), K, expanded.data());
    for (int64_t k = 0; k < K; ++k) ASSERT_NEAR(expanded[k], values[k], 1e-6);
    const WeightMatrix wm{dtype, bytes.data(), N, K, stride};
    for (int threads : {1, 3}) {
      ThreadPool pool(threads);
      for (int64_t M : {1, 3, 12, 13, 40}) {
        std::vector<float> x(M * K), y(M * N, -1.f);
        for (float& v : x) v = dist(rng);
        MatMul(wm, x.data(), M, K, y.data(), N, pool);
        ExpectQuantizedProducts(values, x, y, M, N, K, DTypeName(dtype));
      }
    }
  }
}

// The K-quants (super-blocks of 256): quantized rows come back within a step of the values,
// ToFloat and both MatMul paths agree with the dot products of the expanded values.
TEST(KernelsTest, KQuantMatMulMatchesTheExpandedValues) {
  std::mt19937 rng(6);
  std::uniform_real_distribution<float> dist(-1, 1);
  for (auto [dtype, bound] :
       {std::pair{DType::kQ4_K, 0.2}, {DType::kQ5_K, 0.1}, {DType::kQ6_K, 0.06}}) {
    const int64_t N = 21, K = 512;
    std::vector<float> w(N * K);
    for (float& v : w) v = dist(rng);
    std::string bytes;
    for (int64_t n = 0; n < N; ++n) bytes += QuantizeRow(dtype, w.data() + n * K, K);
    ASSERT_EQ(bytes.size(), N * DTypeBytes(dtype, K));
    std::vector<float> values(N * K);
    for (int64_t n = 0; n < N; ++n) {
      ToFloat(dtype, bytes.data() + n * DTypeBytes(dtype, K), K, values.data() + n * K);
    }
    for (int64_t i = 0; i < N * K; ++i)
      ASSERT_NEAR(values[i], w[i], bound) << DTypeName(dtype) << i;
    const WeightMatrix wm{dtype, bytes.data(), N, K, K};
    ThreadPool pool(2);
    for (int64_t M : {1, 5, 12, 20}) {
      std::vector<float> x(M * K), y(M * N);
      for (float& v : x) v = dist(rng);
      MatMul(wm, x.data(), M, K, y.data(), N, pool);
      ExpectQuantizedProducts(std::vector<double>(values.begin(), values.end()), x, y, M, N, K,
                              DTypeName(dtype));
    }
  }
}

#if !SHARDSERVE_PORTABLE_KERNELS  // the portable kernels keep every type as the file has it
// Q4_KX, Q6_KX and Q4_1X, the layouts the CPU backend keeps Q4_K, Q6_K and Q4_1 in: their rows
// expand and multiply (decode batches, with the activations in their orders, and prefill) bit for
// bit as the rows they were repacked from, Q4_1X also where a row ends in blocks short of a group
// of 8 (K = 352, 576); the backend's Upload repacks those three types and copies the others.
TEST(KernelsTest, RepackedLayoutsComputeExactlyWhatTheirRowsDo) {
  std::mt19937 rng(8);
  std::uniform_real_distribution<float> dist(-1, 1);
  auto backend = NewBackend(2);
  for (auto [from, to, K] : {std::tuple{DType::kQ4_K, DType::kQ4_KX, int64_t{768}},
                             {DType::kQ6_K, DType::kQ6_KX, int64_t{768}},
                             {DType::kQ4_1, DType::kQ4_1X, int64_t{352}},
                             {DType::kQ4_1, DType::kQ4_1X, int64_t{576}},
                             {DType::kQ4_1, DType::kQ4_1X, int64_t{512}}}) {
    const std::string what = absl::StrCat(DTypeName(to), " K=", K);
    const int64_t N = 29, row_bytes = DTypeBytes(from, K), packed_bytes = DTypeBytes(to, K);
    std::vector<float> w(N * K);
    for (float& v : w) v = dist(rng);
    std::string plain;
    for (int64_t n = 0; n < N; ++n) plain += QuantizeRow(from, w.data() + n * K, K);
    std::string repacked(N * packed_bytes, '\0');
    for (int64_t n = 0; n < N; ++n) {
      const auto* src = reinterpret_cast<const uint8_t*>(plain.data() + n * row_bytes);
      auto* dst = reinterpret_cast<uint8_t*>(repacked.data() + n * packed_bytes);
      if (from == DType::kQ4_K) {
        RepackQ4K(src, K / 256, dst);
      } else if (from == DType::kQ6_K) {
        RepackQ6K(src, K / 256, dst);
      } else {
        RepackQ4_1(src, K / 32, dst);
      }
    }
    ASSERT_NE(plain, repacked) << what;
    std::vector<float> a(K), b(K);
    for (int64_t n = 0; n < N; ++n) {
      ToFloat(from, plain.data() + n * row_bytes, K, a.data());
      ToFloat(to, repacked.data() + n * packed_bytes, K, b.data());
      ASSERT_EQ(a, b) << what << " row " << n;
    }
    const WeightMatrix original{from, plain.data(), N, K, K};
    const WeightMatrix packed{to, repacked.data(), N, K, K};
    const absl::StatusOr<WeightMatrix> uploaded = backend->Upload(original);
    ASSERT_TRUE(uploaded.ok()) << uploaded.status();
    EXPECT_EQ(uploaded->dtype, to);
    EXPECT_EQ(std::string(static_cast<const char*>(uploaded->data), repacked.size()), repacked);
    for (int threads : {1, 2, 3}) {
      ThreadPool pool(threads);
      for (int64_t M : {1, 2, 3, 5, 12, 13, 40}) {
        std::vector<float> x(M * K), y0(M * N, NAN), y1(M * N, NAN), y2(M * N, NAN);
        for (float& v : x) v = dist(rng);
        MatMul(original, x.data(), M, K, y0.data(), N, pool);
        MatMul(packed, x.data(), M, K, y1.data(), N, pool);
        ASSERT_TRUE(backend->Gemm(*uploaded, x.data(), M, y2.data()).ok());
        ASSERT_EQ(y0, y1) << what << " M=" << M << " threads " << threads;
        ASSERT_EQ(y0, y2) << what << " M=" << M;
      }
    }
  }
  // The types kept as they are: copied into the backend's memory (the first 256 columns of rows
  // of 512), row by row, the host's bytes left free (BF16 where the level keeps its rows: but
  // where AMX multiplies BF16 it becomes BF16X, Bf16PairsGiveEveryBatchTheSameBits).
  for (DType kept : {DType::kBF16, DType::kQ8_0, DType::kQ4_0, DType::kQ5_K}) {
    if (KeptLayout(kept, 256) != kept) continue;
    std::string bytes(DTypeBytes(kept, 512) * 3, '\0');
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7 % 251);
    const WeightMatrix m{kept, bytes.data(), 3, 256, 512};
    const absl::StatusOr<WeightMatrix> copy = backend->Upload(m);
    ASSERT_TRUE(copy.ok());
    EXPECT_NE(copy->data, m.data) << DTypeName(kept);
    EXPECT_EQ(copy->dtype, kept);
    EXPECT_EQ(copy->row_stride, 256);
    const size_t row = DTypeBytes(kept, 256);
    for (int64_t r = 0; r < 3; ++r) {
      EXPECT_EQ(std::string(static_cast<const char*>(copy->data) + r * row, row),
                bytes.substr(r * DTypeBytes(kept, 512), row))
          << DTypeName(kept) << " row " << r;
    }
  }
}
#endif

// A group of matrices that read the same x (q, k, v; gate, up) gives, row for row, what MatMul
// gives for each: every dtype in one group (each quantized order, BF16's split input, F32), one
// matrix with no rows, and row counts whose split by bytes between threads falls inside
// matrices; decode batches (one pass of the pool) and prefill.
TEST(KernelsTest, MatMulGroupMatchesMatMulForEach) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1, 1);
  const int64_t K = 512;
  const std::vector<std::pair<DType, int64_t>> shapes = {
      {DType::kQ4_K, 37},  {DType::kQ6_K, 5},  {DType::kBF16, 0},  {DType::kQ8_0, 70},
      {DType::kF32, 9},    {DType::kQ5_K, 66}, {DType::kBF16, 13}, {DType::kQ4_1, 3},
      {DType::kQ4_KX, 11}, {DType::kQ6_KX, 7}, {DType::kQ4_1X, 9}, {DType::kF8_128, 21}};
  std::vector<std::string> storage;
  std::vector<WeightMatrix> ws;
  for (auto [kept, rows] : shapes) {
    // The CPU's own layouts (x86-64: all four activation orders in one group) repacked from their
    // files' (the portable kernels keep the files' layouts).
    const DType file = FileType(kept), dtype = KeptType(file);
    std::vector<float> w(std::max<int64_t>(rows, 1) * K);
    for (float& v : w) v = dist(rng);
    std::string bytes;
    for (int64_t n = 0; n < rows; ++n) {
      if (IsQuantized(dtype)) {
        std::string row = QuantizeRow(file, w.data() + n * K, K);
        if (file != dtype) {
          std::string packed(DTypeBytes(dtype, K), '\0');
          RepackRow(dtype, reinterpret_cast<const uint8_t*>(row.data()), K,
                    reinterpret_cast<uint8_t*>(packed.data()));
          row = packed;
        }
        bytes += row;
      } else {
        const Weights row = MakeWeights(dtype, K, rng);
        bytes.append(reinterpret_cast<const char*>(row.bytes.data()), row.bytes.size());
      }
    }
    storage.push_back(std::move(bytes));
    ws.push_back(WeightMatrix{dtype, storage.back().data(), rows, K, K});
  }
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    for (int64_t M : {1, 4, 12, 13}) {
      std::vector<float> x(M * K);
      for (float& v : x) v = dist(rng);
      std::vector<std::vector<float>> grouped(ws.size()), single(ws.size());
      std::vector<MatMulTarget> targets;
      for (size_t i = 0; i < ws.size(); ++i) {
        grouped[i].assign(M * ws[i].rows, NAN);
        single[i].assign(M * ws[i].rows, NAN);
        MatMul(ws[i], x.data(), M, K, single[i].data(), ws[i].rows, pool);
        targets.push_back({&ws[i], grouped[i].data(), ws[i].rows});
      }
      MatMulGroup(targets.data(), targets.size(), x.data(), M, K, pool);
      for (size_t i = 0; i < ws.size(); ++i) {
        for (int64_t j = 0; j < M * ws[i].rows; ++j) {
          ASSERT_EQ(grouped[i][j], single[i][j])
              << DTypeName(ws[i].dtype) << " matrix " << i << " value " << j << " M=" << M
              << " threads " << threads;
        }
      }
    }
  }
}

#if SHARDSERVE_PORTABLE_KERNELS
// The portable kernels run on any CPU, at their one level; the x86-64 levels are refused by name
// (this build does not carry them).
TEST(KernelsTest, ThePortableKernelsRunOnAnyCpu) {
  EXPECT_TRUE(CheckCpu().ok()) << CheckCpu();
  EXPECT_TRUE(CheckCpu(CpuFeatures{}).ok());
  EXPECT_EQ(*ChooseKernelLevel(CpuFeatures{}, ""), KernelLevel::kPortable);
  EXPECT_EQ(*ChooseKernelLevel(CpuFeatures{}, "auto"), KernelLevel::kPortable);
  EXPECT_EQ(*ChooseKernelLevel(CpuFeatures{}, "portable"), KernelLevel::kPortable);
  CpuFeatures x86{true, true, true};
  x86.avx512 = true;
  EXPECT_THAT(std::string(ChooseKernelLevel(x86, "avx2").status().message()),
              ::testing::HasSubstr(
                  "SHARDSERVE_CPU_KERNELS=avx2: this build carries the portable kernels only"));
  EXPECT_THAT(
      std::string(ChooseKernelLevel(x86, "sse4").status().message()),
      ::testing::HasSubstr("must be auto, avx2, avx512, avx512bf16, avx512int8 or portable"));
  EXPECT_THAT(DescribeKernels(), ::testing::StartsWith("portable"));
#if defined(__aarch64__)
  EXPECT_TRUE(CpuFeatures::Detect().neon) << "every AArch64 CPU has Advanced SIMD";
#endif
}
#else
// The kernels' instruction sets are checked before any runs: a CPU without them is refused naming
// what it lacks (this machine has them all).
TEST(KernelsTest, ACpuWithoutTheKernelsIsaIsRefusedByName) {
  EXPECT_TRUE(CheckCpu().ok()) << CheckCpu();
  EXPECT_TRUE(CheckCpu({true, true, true}).ok());
  const absl::Status s = CheckCpu({false, true, false});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("this CPU lacks AVX2, F16C"));
}
#endif

// The op conformance suite on the CPU backend, with one thread and with a pool that splits work.
using testing::BackendCase;
// FP8 as the CPU computes it (F8_128: an F32 scale per 128 E4M3 bytes, each byte read as F16
// bits): every finite byte, subnormals and negative zero included, is its value times the scale
// rounded once, and products equal those of the same values in F32, bit for bit, decode and
// prefill (the same float kernels read them).
TEST(KernelsTest, Fp8BlocksComputeAsTheirValuesInF32) {
  const int64_t N = 7, K = 512;
  std::vector<uint8_t> bytes(N * DTypeBytes(DType::kF8_128, K));
  std::vector<float> values(N * K);
  const float scales[] = {0.0123f, 3.5f, 1.0f, -0.75f, 1e-3f, 448.0f, 2.0e-5f};
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t b = 0; b < K / 128; ++b) {
      uint8_t* block = bytes.data() + n * DTypeBytes(DType::kF8_128, K) + b * 132;
      const float s = scales[(n + b) % 7];
      std::memcpy(block, &s, 4);
      for (int64_t j = 0; j < 128; ++j) {
        uint8_t v = static_cast<uint8_t>((n * 131 + b * 128 + j) % 256);
        if ((v & 0x7F) == 0x7F) v ^= 1;  // E4M3's NaNs are not in a checked block
        block[4 + j] = v;
        values[n * K + b * 128 + j] = F8E4M3ToF32(v) * s;
      }
    }
  }
  std::vector<float> row(K);
  for (int64_t n = 0; n < N; ++n) {
    ToFloat(DType::kF8_128, bytes.data() + n * DTypeBytes(DType::kF8_128, K), K, row.data());
    for (int64_t k = 0; k < K; ++k) ASSERT_EQ(row[k], values[n * K + k]) << n << "," << k;
  }
  const WeightMatrix f8{DType::kF8_128, bytes.data(), N, K, K};
  const WeightMatrix f32{DType::kF32, values.data(), N, K, K};
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-1, 1);
  ThreadPool pool(2);
  for (int64_t M : {1, 2, 5, 12, 13, 40}) {
    std::vector<float> x(M * K), a(M * N, NAN), b(M * N, NAN);
    for (float& v : x) v = dist(rng);
    MatMul(f8, x.data(), M, K, a.data(), N, pool);
    MatMul(f32, x.data(), M, K, b.data(), N, pool);
    EXPECT_EQ(a, b) << "M=" << M;
  }
}

#if !SHARDSERVE_PORTABLE_KERNELS  // x86-64's levels
// N rows of K values uniform in [-1, 1) quantized to dtype, as a file has them.
std::string QuantizedRows(DType dtype, int64_t N, int64_t K, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1, 1);
  std::vector<float> values(N * K);
  for (float& v : values) v = dist(rng);
  std::string bytes;
  for (int64_t n = 0; n < N; ++n) bytes += QuantizeRow(dtype, values.data() + n * K, K);
  return bytes;
}

// Every kernel level this CPU runs (cpu_features.h), forced as SHARDSERVE_CPU_KERNELS would,
// against AVX2's: the AVX-512 tiles compute the same arithmetic in the same order (the quantized
// prefill's AMX-INT8 tiles too, run with and without where the CPU has them: their int16
// activations split into bytes), so MatMul's outputs are bit for bit AVX2's, for every float and
// quantized dtype (the repacked layouts the backend keeps included), ragged tiles and thread split
// included; BF16 weights at kAvx512Bf16 (their activations rounded to BF16) are within the stated
// bound of AVX2's F32 products: 2^-8 of the sum of |w x| (BF16's rounding of each x), plus F32
// sums' 1e-4 sqrt(K); at kAvx512Int8 the decode of DecodesOnInt8's types and every quantized
// type's prefill multiply int8 activations (another arithmetic: Int8MultipliesTheInt8Activations),
// the rest is AVX2's bits. A level this CPU lacks is skipped by name.
TEST(KernelsTest, EveryKernelLevelComputesAvx2sResults) {
  const std::vector<KernelLevel> levels = LevelsOfThisCpu();
  if (levels.size() < 2) GTEST_SKIP() << "AVX-512 (F, BW, VL, DQ): this CPU lacks it";
  const auto runs = [&](KernelLevel l) {
    return std::find(levels.begin(), levels.end(), l) != levels.end();
  };
  if (!runs(KernelLevel::kAvx512Bf16)) {
    std::cout << "[ SKIPPED  ] kernel level avx512bf16: this CPU lacks AVX512-BF16\n";
  }
  if (!runs(KernelLevel::kAvx512Int8)) {
    std::cout << "[ SKIPPED  ] kernel level avx512int8: this CPU lacks AVX512-VNNI\n";
  }
  // The quantized types' prefill with AMX's tiles and without, where the CPU has AMX-INT8.
  std::vector<bool> amx_int8 = {true};
  if (CpuFeatures::Detect().amx_int8) {
    amx_int8.push_back(false);
  } else {
    std::cout << "[ SKIPPED  ] AMX-INT8 tiles of the quantized prefill: this CPU lacks AMX-INT8\n";
  }
  const KernelLevelRestorer restorer;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-1, 1);
  // MatMul at AVX2 and at `level` (F32 results into narrow and wide).
  const auto both = [](KernelLevel level, const WeightMatrix& w, const std::vector<float>& x,
                       int64_t M, ThreadPool& pool, std::vector<float>* narrow,
                       std::vector<float>* wide) {
    narrow->assign(M * w.rows, NAN);
    wide->assign(M * w.rows, NAN);
    SetKernelLevel(KernelLevel::kAvx2);
    MatMul(w, x.data(), M, w.cols, narrow->data(), w.rows, pool);
    SetKernelLevel(level);
    MatMul(w, x.data(), M, w.cols, wide->data(), w.rows, pool);
  };
  for (KernelLevel level : levels) {
    if (level == KernelLevel::kAvx2) continue;
    for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
      for (int threads : {1, 3}) {
        ThreadPool pool(threads);
        for (int64_t M : {1, 5, 13, 40, 100}) {
          for (int64_t N : {5, 37, 150}) {
            for (int64_t K : {13, 300, 520}) {
              for (bool amx : AmxChoices(level, dtype)) {
                avx512::UseAmx(amx);
                Weights w = MakeWeights(dtype, N * K, rng);
                std::vector<float> x(M * K), narrow, wide;
                for (float& v : x) v = dist(rng);
                both(level, {dtype, w.bytes.data(), N, K, K}, x, M, pool, &narrow, &wide);
                const std::string where =
                    absl::StrCat(DTypeName(dtype), " M=", M, " N=", N, " K=", K, " ",
                                 KernelLevelName(level), amx ? "" : " without AMX");
                if (level != KernelLevel::kAvx512Bf16 || dtype != DType::kBF16) {
                  ASSERT_EQ(std::memcmp(narrow.data(), wide.data(), narrow.size() * sizeof(float)),
                            0)
                      << where;
                  continue;
                }
                for (int64_t m = 0; m < M; ++m) {
                  for (int64_t n = 0; n < N; ++n) {
                    double magnitude = 0;
                    for (int64_t k = 0; k < K; ++k) {
                      magnitude += std::abs(w.values[n * K + k] * x[m * K + k]);
                    }
                    ASSERT_NEAR(wide[m * N + n], narrow[m * N + n],
                                0x1p-8 * magnitude + 1e-4 * std::sqrt(K))
                        << where;
                  }
                }
              }
              avx512::UseAmx(true);
            }
          }
        }
      }
    }
    auto backend = NewBackend(2);
    for (DType dtype :
         {DType::kQ8_0, DType::kQ4_0, DType::kQ4_1, DType::kQ4_K, DType::kQ5_K, DType::kQ6_K}) {
      for (int64_t K : {int64_t{768}, int64_t{512}}) {
        const int64_t N = 29;
        const std::string bytes = QuantizedRows(dtype, N, K, rng);
        // As the backend keeps it (Q4_1, Q4_K, Q6_K repacked: their transposed layouts).
        const absl::StatusOr<WeightMatrix> kept = backend->Upload({dtype, bytes.data(), N, K, K});
        ASSERT_TRUE(kept.ok()) << kept.status();
        for (int threads : {1, 3}) {
          ThreadPool pool(threads);
          for (int64_t M : {1, 2, 3, 13, 40}) {
            if (level == KernelLevel::kAvx512Int8 &&
                (DecodesOnInt8(kept->dtype) || M > kDecodeMaxTokens)) {
              continue;
            }
            // With and without VNNI (vpdpwssd, where the CPU has it): AVX-512's prefill tile, and
            // the decode loops (M up to kDecodeMaxTokens) built for VNNI (quant_vnni.cc); AVX2's
            // with AVX-VNNI where the CPU has that too (AvxVnniComputesAvx2sResults). The prefill
            // in AMX's tiles too where the CPU has AMX-INT8 (the int16 activations split into
            // bytes; at avx512int8 its int8 tile, Int8MultipliesTheInt8Activations).
            for (bool vnni : {true, false}) {
              for (bool amx : M > kDecodeMaxTokens ? amx_int8 : std::vector<bool>{true}) {
                UseVnni(vnni);
                avx512::UseAmx(amx);
                std::vector<float> x(M * K), narrow, wide;
                for (float& v : x) v = dist(rng);
                both(level, *kept, x, M, pool, &narrow, &wide);
                ASSERT_EQ(std::memcmp(narrow.data(), wide.data(), narrow.size() * sizeof(float)), 0)
                    << DTypeName(kept->dtype) << " M=" << M << " K=" << K << " threads " << threads
                    << " " << KernelLevelName(level) << (UsesVnni() ? " VNNI" : "")
                    << (M > kDecodeMaxTokens && avx512::UsesAmxInt8() ? " AMX-INT8" : "");
              }
            }
            UseVnni(true);
            avx512::UseAmx(true);
          }
        }
      }
    }
  }
}

// kAvx2 with AVX-VNNI's vpdpwssd (the decode loops of quant_avxvnni.cc, the GEMM's quantized
// tile) against kAvx2 without it (UseVnni(false)): the same integer sums, so the same bits, for
// every block-quantized type as the file has it and as the backend keeps it (Q4_1X's rows ending
// short of a group of 8 blocks: K = 352), decode (1, 2, 3 and 5 tokens) and prefill (13 and 40:
// ragged panels of 16), at 1 and 3 threads. Skipped by name where the CPU lacks AVX-VNNI (an
// AVX-512 CPU runs it too: the level is forced).
TEST(KernelsTest, AvxVnniComputesAvx2sResults) {
  if (!CpuFeatures::Detect().avx_vnni) {
    GTEST_SKIP() << "AVX-VNNI at kernel level avx2: this CPU lacks AVX-VNNI";
  }
  const KernelLevelRestorer restorer;
  SetKernelLevel(KernelLevel::kAvx2);
  UseVnni(true);
  ASSERT_TRUE(UsesVnni());
  UseVnni(false);
  ASSERT_FALSE(UsesVnni());
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-1, 1);
  auto backend = NewBackend(2);
  for (DType dtype :
       {DType::kQ8_0, DType::kQ4_0, DType::kQ4_1, DType::kQ4_K, DType::kQ5_K, DType::kQ6_K}) {
    for (int64_t K : {int64_t{768}, int64_t{352}}) {
      if (K % DTypeBlock(dtype) != 0) continue;
      const int64_t N = 37;
      const std::string bytes = QuantizedRows(dtype, N, K, rng);
      const absl::StatusOr<WeightMatrix> kept = backend->Upload({dtype, bytes.data(), N, K, K});
      ASSERT_TRUE(kept.ok()) << kept.status();
      for (const WeightMatrix& w : {WeightMatrix{dtype, bytes.data(), N, K, K}, *kept}) {
        for (int threads : {1, 3}) {
          ThreadPool pool(threads);
          for (int64_t M : {1, 2, 3, 5, 13, 40}) {
            std::vector<float> x(M * K), plain(M * N, NAN), vnni(M * N, NAN);
            for (float& v : x) v = dist(rng);
            UseVnni(false);
            MatMul(w, x.data(), M, K, plain.data(), N, pool);
            UseVnni(true);
            MatMul(w, x.data(), M, K, vnni.data(), N, pool);
            ASSERT_EQ(std::memcmp(plain.data(), vnni.data(), plain.size() * sizeof(float)), 0)
                << DTypeName(w.dtype) << " M=" << M << " K=" << K << " threads " << threads;
          }
        }
      }
    }
  }
}

// kAvx512Int8: the decode (up to kDecodeMaxTokens tokens) of DecodesOnInt8's types, and the
// prefill (the GEMM's int8 tile, panels of 16 tokens, ragged rows and panels: N = 37, M = 13, 40)
// of every quantized type, as the backend keeps them (Q4_K as Q4_KX, Q6_K as Q6_KX, Q4_1 as
// Q4_1X, whose rows may end short of a group of 8 blocks: K = 352) and as the files have them,
// multiply the activations quantized to int8 per block of 32 (scale max|x| / 127): the products
// of those up to F32 rounding, within their rounding's bound of the exact products; the other
// types' decode (Q5_K; the file's Q4_K and Q6_K, which the backend never keeps) is avx512's, bit
// for bit. The prefill in AMX's tiles (where the CPU has AMX-INT8; said where it lacks it) is bit
// for bit the vpdpbusd tile's (UseAmx(false)). Skipped by name without VNNI.
TEST(KernelsTest, Int8MultipliesTheInt8Activations) {
  if (!ChooseKernelLevel(CpuFeatures::Detect(), "avx512int8").ok()) {
    GTEST_SKIP() << "kernel level avx512int8: this CPU lacks AVX512-VNNI";
  }
  const KernelLevelRestorer restorer;
  const bool amx = CpuFeatures::Detect().amx_int8;
  if (!amx) std::cout << "[ SKIPPED  ] AMX tiles of avx512int8: this CPU lacks AMX-INT8\n";
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> dist(-1, 1);
  auto backend = NewBackend(2);
  for (auto [dtype, K] : {std::pair{DType::kQ8_0, int64_t{352}},
                          {DType::kQ4_0, int64_t{352}},
                          {DType::kQ4_1, int64_t{352}},
                          {DType::kQ4_1, int64_t{576}},
                          {DType::kQ4_K, int64_t{768}},
                          {DType::kQ5_K, int64_t{512}},
                          {DType::kQ6_K, int64_t{512}}}) {
    const int64_t N = 37;
    std::vector<float> w(N * K);
    for (float& v : w) v = dist(rng);
    std::string bytes;
    for (int64_t n = 0; n < N; ++n) bytes += QuantizeRow(dtype, w.data() + n * K, K);
    std::vector<float> expanded(N * K);
    for (int64_t n = 0; n < N; ++n) {
      ToFloat(dtype, bytes.data() + n * DTypeBytes(dtype, K), K, expanded.data() + n * K);
    }
    const std::vector<double> values(expanded.begin(), expanded.end());
    const absl::StatusOr<WeightMatrix> kept = backend->Upload({dtype, bytes.data(), N, K, K});
    ASSERT_TRUE(kept.ok()) << kept.status();
    for (const WeightMatrix& wm : {WeightMatrix{dtype, bytes.data(), N, K, K}, *kept}) {
      const std::string what = absl::StrCat(DTypeName(wm.dtype), " K=", K);
      for (int threads : {1, 3}) {
        ThreadPool pool(threads);
        for (int64_t M : {1, 2, 3, 5, 12, 13, 40}) {
          std::vector<float> x(M * K), y(M * N, NAN), wide(M * N, NAN);
          for (float& v : x) v = dist(rng);
          SetKernelLevel(KernelLevel::kAvx512Int8);
          MatMul(wm, x.data(), M, K, y.data(), N, pool);
          if (M <= kDecodeMaxTokens && !DecodesOnInt8(wm.dtype)) {
            SetKernelLevel(KernelLevel::kAvx512);
            MatMul(wm, x.data(), M, K, wide.data(), N, pool);
            ASSERT_EQ(std::memcmp(y.data(), wide.data(), y.size() * sizeof(float)), 0)
                << what << " M=" << M;
            continue;
          }
          ExpectQuantizedProducts(values, x, y, M, N, K, absl::StrCat(what, " M=", M), 127);
          if (M > kDecodeMaxTokens && amx) {  // AMX's tile: the vpdpbusd tile's bits
            avx512::UseAmx(false);
            MatMul(wm, x.data(), M, K, wide.data(), N, pool);
            avx512::UseAmx(true);
            ASSERT_EQ(std::memcmp(y.data(), wide.data(), y.size() * sizeof(float)), 0)
                << what << " M=" << M << " with AMX-INT8";
          }
        }
      }
    }
  }
}

// BF16 weights as the backend keeps them at kAvx512Bf16 where AMX is not used (DType::kBF16X,
// 16 rows' pairs side by side): every output summed pair by pair in one order, so a token's
// result is bit for bit the same in any batch, decode (M <= 12) or prefill, at any thread count;
// within kAvx512Bf16's bound of the F32 products (AVX2's); the layout read back (embedding rows,
// the rows in order) exactly; and at AVX2 (which keeps BF16 as kBF16X too), the prefill the rows'
// bits and the decode within F32's bound, a token's bits the same in any decode batch.
TEST(KernelsTest, Bf16PairsGiveEveryBatchTheSameBits) {
  if (!ChooseKernelLevel(CpuFeatures::Detect(), "avx512bf16").ok()) {
    GTEST_SKIP() << "kernel level avx512bf16: this CPU lacks AVX512-BF16";
  }
  const KernelLevelRestorer restorer;
  SetKernelLevel(KernelLevel::kAvx512Bf16);
  avx512::UseAmx(false);
  auto backend = NewBackend(2);
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-1, 1);
  for (int64_t N : {5, 16, 37, 150}) {
    for (int64_t K : {2, 300, 520}) {
      const std::string shape = absl::StrCat("N=", N, " K=", K);
      Weights w = MakeWeights(DType::kBF16, N * K, rng);
      const WeightMatrix rows{DType::kBF16, w.bytes.data(), N, K, K};
      const absl::StatusOr<WeightMatrix> kept = backend->Upload(rows);
      ASSERT_TRUE(kept.ok()) << kept.status();
      ASSERT_EQ(kept->dtype, DType::kBF16X) << shape;
      std::vector<uint16_t> back(N * K);
      UnpackBf16Pairs(*kept, back.data());
      ASSERT_EQ(std::memcmp(back.data(), w.bytes.data(), w.bytes.size()), 0) << shape;
      std::vector<float> row(K);
      for (int64_t n = 0; n < N; ++n) {
        Bf16PairsRow(*kept, n, row.data());
        for (int64_t k = 0; k < K; ++k) ASSERT_EQ(row[k], w.values[n * K + k]) << shape;
      }
      const int64_t M = 40;
      std::vector<float> x(M * K);
      for (float& v : x) v = dist(rng);
      // Each token alone (decode, 1 thread): the reference bits.
      std::vector<float> alone(M * N, NAN);
      ThreadPool one(1);
      for (int64_t m = 0; m < M; ++m) {
        MatMul(*kept, x.data() + m * K, 1, K, alone.data() + m * N, N, one);
      }
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t n = 0; n < N; ++n) {
          double magnitude = 0, exact = 0;
          for (int64_t k = 0; k < K; ++k) {
            magnitude += std::abs(w.values[n * K + k] * x[m * K + k]);
            exact += w.values[n * K + k] * x[m * K + k];
          }
          ASSERT_NEAR(alone[m * N + n], exact, 0x1p-8 * magnitude + 1e-4 * std::sqrt(K)) << shape;
        }
      }
      for (int threads : {1, 3}) {
        ThreadPool pool(threads);
        for (int64_t batch : {2, 5, 12, 13, 40}) {
          std::vector<float> y(M * N, NAN);
          for (int64_t m = 0; m < M; m += batch) {
            MatMul(*kept, x.data() + m * K, std::min(batch, M - m), K, y.data() + m * N, N, pool);
          }
          ASSERT_EQ(std::memcmp(y.data(), alone.data(), y.size() * sizeof(float)), 0)
              << shape << " batches of " << batch << ", threads " << threads;
        }
      }
      // At AVX2 (the level switched after the upload; AVX2 keeps BF16 as kBF16X too): the
      // prefill expands the pairs to the rows' F32 values, so its results are the rows' bit for
      // bit; the decode (GemvPairs) sums in F32 in its own order: within F32's bound of the exact
      // products, and a token's bits the same in any decode batch.
      SetKernelLevel(KernelLevel::kAvx2);
      ThreadPool pool(2);
      {
        std::vector<float> a(M * N, NAN), b(M * N, NAN);
        MatMul(*kept, x.data(), M, K, a.data(), N, pool);
        MatMul(rows, x.data(), M, K, b.data(), N, pool);
        ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << shape;
      }
      std::vector<float> single(M * N, NAN);
      for (int64_t m = 0; m < M; ++m) {
        MatMul(*kept, x.data() + m * K, 1, K, single.data() + m * N, N, pool);
        for (int64_t n = 0; n < N; ++n) {
          double magnitude = 0, exact = 0;
          for (int64_t k = 0; k < K; ++k) {
            magnitude += std::abs(w.values[n * K + k] * x[m * K + k]);
            exact += w.values[n * K + k] * x[m * K + k];
          }
          ASSERT_NEAR(single[m * N + n], exact, 1e-5 * magnitude + 1e-6) << shape;
        }
      }
      for (int64_t batch : {3, 12}) {
        std::vector<float> y(M * N, NAN);
        for (int64_t m = 0; m < M; m += batch) {
          MatMul(*kept, x.data() + m * K, std::min(batch, M - m), K, y.data() + m * N, N, pool);
        }
        ASSERT_EQ(std::memcmp(y.data(), single.data(), y.size() * sizeof(float)), 0)
            << shape << " AVX2 decode batches of " << batch;
      }
      SetKernelLevel(KernelLevel::kAvx512Bf16);
    }
  }
  // An embedding table kept as kBF16X: Embed's rows are the table's.
  Weights table = MakeWeights(DType::kBF16, 37 * 64, rng);
  const absl::StatusOr<WeightMatrix> kept =
      backend->Upload({DType::kBF16, table.bytes.data(), 37, 64, 64});
  ASSERT_TRUE(kept.ok()) << kept.status();
  const std::vector<int32_t> ids = {0, 36, 17, 16, 40};
  std::vector<float> out(ids.size() * 64, NAN);
  ASSERT_TRUE(backend->Embed(*kept, ids.data(), ids.size(), 0, 37, out.data()).ok());
  for (size_t i = 0; i < ids.size(); ++i) {
    for (int64_t k = 0; k < 64; ++k) {
      EXPECT_EQ(out[i * 64 + k], ids[i] < 37 ? table.values[ids[i] * 64 + k] : 0.0) << ids[i];
    }
  }
}

// The quantized decode loops prefetch their rows in software but on AMD's cores with AVX-512
// (cpu_features.h's DecodePrefetches), unless told (UseDecodePrefetch). A prefetch reads nothing
// the loops compute with, so no test of their results could tell the two apart; the kernel tests
// run the CPU's choice.
TEST(KernelsTest, TheDecodeLoopsPrefetchButOnAmdsAvx512Cores) {
  const CpuFeatures have = CpuFeatures::Detect();
  const bool by_cpu = DecodePrefetches();
  EXPECT_EQ(by_cpu, !(have.amd && have.avx512));
  UseDecodePrefetch(!by_cpu);
  EXPECT_EQ(DecodePrefetches(), !by_cpu);
  UseDecodePrefetch(by_cpu);
  EXPECT_EQ(DecodePrefetches(), by_cpu);
}

// SHARDSERVE_CPU_KERNELS: auto takes the widest level the CPU has whose arithmetic is F32's, or
// avx512bf16 on an AMD CPU with AVX512-BF16 and without AMX; a lower one may be forced; one the
// CPU lacks, or a name that is no level, is refused naming the variable.
TEST(KernelsTest, TheKernelLevelIsTheWidestTheCpuHasUnlessForced) {
  CpuFeatures avx2{true, true, true}, avx512 = avx2;
  avx512.avx512 = true;
  CpuFeatures bf16 = avx512;
  bf16.avx512_bf16 = true;
  EXPECT_EQ(*ChooseKernelLevel(avx2, ""), KernelLevel::kAvx2);
  EXPECT_EQ(*ChooseKernelLevel(avx512, "auto"), KernelLevel::kAvx512);
  EXPECT_EQ(*ChooseKernelLevel(bf16, "auto"), KernelLevel::kAvx512);  // Intel: F32 arithmetic
  CpuFeatures zen4 = bf16, amd_avx512 = avx512, amx = bf16;
  zen4.amd = amd_avx512.amd = amx.amd = true;
  amx.amx_bf16 = true;
  EXPECT_EQ(*ChooseKernelLevel(zen4, "auto"), KernelLevel::kAvx512Bf16);
  EXPECT_EQ(*ChooseKernelLevel(zen4, "avx512"), KernelLevel::kAvx512);
  EXPECT_EQ(*ChooseKernelLevel(amd_avx512, "auto"), KernelLevel::kAvx512);  // no BF16
  EXPECT_EQ(*ChooseKernelLevel(amx, "auto"), KernelLevel::kAvx512);
  EXPECT_EQ(*ChooseKernelLevel(avx512, "avx2"), KernelLevel::kAvx2);
  EXPECT_EQ(*ChooseKernelLevel(bf16, "avx512"), KernelLevel::kAvx512);
  EXPECT_EQ(*ChooseKernelLevel(bf16, "avx512bf16"), KernelLevel::kAvx512Bf16);
  // avx512int8 (int8 activations) only where asked for, on a CPU with AVX512-VNNI.
  CpuFeatures vnni = zen4;
  vnni.avx512_vnni = true;
  EXPECT_EQ(*ChooseKernelLevel(vnni, "auto"), KernelLevel::kAvx512Bf16);
  EXPECT_EQ(*ChooseKernelLevel(vnni, "avx512int8"), KernelLevel::kAvx512Int8);
  EXPECT_THAT(
      std::string(ChooseKernelLevel(zen4, "avx512int8").status().message()),
      ::testing::HasSubstr("SHARDSERVE_CPU_KERNELS=avx512int8: this CPU lacks AVX512-VNNI"));
  EXPECT_THAT(std::string(ChooseKernelLevel(avx2, "avx512").status().message()),
              ::testing::HasSubstr("SHARDSERVE_CPU_KERNELS=avx512: this CPU lacks AVX-512"));
  EXPECT_THAT(
      std::string(ChooseKernelLevel(avx512, "avx512bf16").status().message()),
      ::testing::HasSubstr("SHARDSERVE_CPU_KERNELS=avx512bf16: this CPU lacks AVX512-BF16"));
  EXPECT_THAT(std::string(ChooseKernelLevel(avx512, "sse4").status().message()),
              ::testing::HasSubstr("SHARDSERVE_CPU_KERNELS='sse4' must be auto, avx2, avx512, "
                                   "avx512bf16, avx512int8 or portable"));
  EXPECT_THAT(std::string(ChooseKernelLevel(avx512, "portable").status().message()),
              ::testing::HasSubstr("SHARDSERVE_CPU_KERNELS=portable: this x86-64 build carries"));
  EXPECT_THAT(DescribeKernels(), ::testing::StartsWith(KernelLevelName(ActiveKernelLevel())));
}
#endif

using testing::BackendOpsTest;
// A backend of `threads` threads at a kernel level: null (the tests skip) where this CPU lacks
// it.
std::function<std::unique_ptr<Backend>()> AtLevel(const char* level, int threads = 3) {
  return [level, threads]() -> std::unique_ptr<Backend> {
    absl::StatusOr<KernelLevel> l = ChooseKernelLevel(CpuFeatures::Detect(), level);
    if (!l.ok()) return nullptr;
    SetKernelLevel(*l);
    return NewBackend(threads);
  };
}
// The error BF16 weights' activations take at the active level (kAvx512Bf16 rounds them).
double ActivationRounding(DType weights) {
  return ActiveKernelLevel() == KernelLevel::kAvx512Bf16 && weights == DType::kBF16 ? 0x1p-8 : 0;
}
// kAvx512Int8's decode of the types kept in a layout DecodesOnInt8 rounds their activations to
// int8 per 32 (half a step: max |x| / 254); the others' to int16.
double Int8DecodeSteps(DType weights) { return DecodesOnInt8(KeptType(weights)) ? 254 : 32767; }
INSTANTIATE_TEST_SUITE_P(
    Cpu, BackendOpsTest,
    ::testing::Values(BackendCase{"threads1", AtLevel("auto", 1), ActivationRounding, nullptr},
                      BackendCase{"threads3", AtLevel("auto"), ActivationRounding, nullptr},
                      BackendCase{"avx2", AtLevel("avx2"), ActivationRounding, nullptr},
                      BackendCase{"avx512", AtLevel("avx512"), ActivationRounding, nullptr},
                      BackendCase{"avx512bf16", AtLevel("avx512bf16"), ActivationRounding, nullptr},
                      BackendCase{"avx512int8", AtLevel("avx512int8"), ActivationRounding,
                                  Int8DecodeSteps},
                      BackendCase{"portable", AtLevel("portable"), ActivationRounding, nullptr},
                      BackendCase{"auto", AtLevel("auto"), ActivationRounding, nullptr}),
    testing::BackendCaseName);

}  // namespace
}  // namespace shardserve::cpu
