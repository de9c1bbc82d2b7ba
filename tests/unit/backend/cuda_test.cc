// CUDA backend and NCCL communicator against the CPU backend. Every test needs a GPU and skips
// cleanly without one; CI still compiles and links this binary.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "api/worker_env.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/kernels.h"
#include "backend/cuda/cuda_backend.h"
#include "backend_ops_test.h"
#include "comm/nccl/nccl_comm.h"
#include "comm/rendezvous.h"
#include "comm/world.h"
#include "common/status.h"
#include "model/config.h"
#include "model/kv_cache.h"
#include "model/rope.h"
#include "model/test_models.h"
#include "model/transformer.h"
#include "model/vocab_parallel.h"
#include "serve/rank_runtime.h"
#include "serve/stage_backend.h"

namespace shardserve {
namespace {

#define REQUIRE_GPU() \
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no GPU on this machine"

// The kernels this run forces, as a rank reads them from the worker contract
// (scripts/gpu-check.sh runs the suite under each SHARDSERVE_CUDA_ATTN_KERNEL and
// SHARDSERVE_CUDA_QUANT_GEMV).
cuda::KernelChoice ContractKernels() {
  absl::StatusOr<cuda::KernelChoice> k = []() -> absl::StatusOr<cuda::KernelChoice> {
    ASSIGN_OR_RETURN(const WorkerEnv env, WorkerEnv::FromEnv());
    return CudaKernelsOf(env);
  }();
  EXPECT_TRUE(k.ok()) << k.status();
  return k.value_or(cuda::KernelChoice{});
}

// The op conformance suite (backend_ops_test.h) on GPU 0.
std::unique_ptr<Backend> Gpu0() {
  if (cuda::DeviceCount() == 0) return nullptr;
  auto b = cuda::NewBackend(0, ContractKernels());
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? *std::move(b) : nullptr;
}
using testing::BackendCase;
using testing::BackendOpsTest;
// The dp4a GEMV (the default, SHARDSERVE_CUDA_QUANT_GEMV) rounds the GGUF types' inputs to int8
// per 32; FP8's blocks keep the float kernel (F32 inputs: no rounding beyond the CPU's int16).
double QuantizedInputSteps(DType dtype) {
  return ContractKernels().quant_gemv == cuda::QuantGemvMode::kDp4a && dtype != DType::kF8_128
             ? 254
             : 32767;
}
INSTANTIATE_TEST_SUITE_P(Cuda, BackendOpsTest,
                         ::testing::Values(BackendCase{"gpu0", Gpu0, nullptr, QuantizedInputSteps}),
                         testing::BackendCaseName);

// The kernel choices of the worker contract name a kernel or are unset; anything else is refused
// naming the variable (no GPU needed).
TEST(CudaBackendTest, KernelChoicesNameAKernelOrAreUnset) {
  using cuda::AttentionKernel;
  using cuda::QuantGemvMode;
  WorkerEnv env;
  ASSERT_TRUE(CudaKernelsOf(env).ok());
  EXPECT_EQ(CudaKernelsOf(env)->attention, AttentionKernel::kByShape);
  EXPECT_EQ(CudaKernelsOf(env)->quant_gemv, QuantGemvMode::kDp4a);
  EXPECT_EQ(CudaKernelsOf(env)->fp8_gemv, cuda::Fp8GemvMode::kDirect);
  for (const auto& [name, kernel] : {std::pair{"split", AttentionKernel::kSplit},
                                     std::pair{"split-batched", AttentionKernel::kSplitBatched},
                                     std::pair{"heads", AttentionKernel::kHeads}}) {
    env.cuda_attention_kernel = name;
    ASSERT_TRUE(CudaKernelsOf(env).ok()) << name;
    EXPECT_EQ(CudaKernelsOf(env)->attention, kernel) << name;
  }
  env.cuda_quant_gemv = "float";
  EXPECT_EQ(CudaKernelsOf(env)->quant_gemv, QuantGemvMode::kFloat);
  env.cuda_fp8_gemv = "staged";
  EXPECT_EQ(CudaKernelsOf(env)->fp8_gemv, cuda::Fp8GemvMode::kStaged);
  env.cuda_attention_kernel = "1";
  EXPECT_THAT(std::string(CudaKernelsOf(env).status().message()),
              ::testing::HasSubstr("environment variable SHARDSERVE_CUDA_ATTN_KERNEL='1' must be "
                                   "split, split-batched or heads"));
  env.cuda_attention_kernel = "";
  env.cuda_quant_gemv = "int4";
  EXPECT_THAT(std::string(CudaKernelsOf(env).status().message()),
              ::testing::HasSubstr("environment variable SHARDSERVE_CUDA_QUANT_GEMV='int4' must "
                                   "be dp4a"));
  env.cuda_quant_gemv = "";
  env.cuda_fp8_gemv = "fast";
  EXPECT_THAT(std::string(CudaKernelsOf(env).status().message()),
              ::testing::HasSubstr("environment variable SHARDSERVE_CUDA_FP8_GEMV='fast' must "
                                   "be direct"));
}

// LoRA's CUDA kernels can be switched off (SHARDSERVE_CUDA_LORA=off): a replica with adapters is
// then refused on the GPU, naming the variable, and never moved to the CPU unsaid; the CPU backend
// runs it as before.
TEST(CudaBackendTest, LoraOnTheGpuCanBeSwitchedOff) {
  RankConfig config;
  config.env.max_loras = 2;
  config.env.cuda_lora = false;
  const WorldConfig world = *WorldConfig::Create(1, 1, 0);
  config.env.backend = "cpu";
  EXPECT_TRUE(StageBackend::Choose(config, world).ok());
  config.env.backend = "cuda";
  const absl::Status refused = StageBackend::Choose(config, world).status();
  EXPECT_THAT(std::string(refused.message()),
              ::testing::HasSubstr(cuda::DeviceCount() > 0 ? "SHARDSERVE_CUDA_LORA=off"
                                                           : "no GPU is visible"));
}

TEST(CudaBackendTest, NcclLibraryLoads) {
  EXPECT_NE(nccl::Version(), "unknown");  // runs without a GPU: the library links and loads
}

TEST(CudaBackendTest, RmsNormMatchesCpu) {
  REQUIRE_GPU();
  const int64_t M = 3, D = 1000;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-2, 2);
  std::vector<float> x(M * D), w(D), want(M * D), got(M * D);
  for (float& v : x) v = u(rng);
  for (float& v : w) v = u(rng);
  cpu::RmsNorm(x.data(), M, D, w.data(), 1e-5f, want.data());
  auto dx = cuda::DeviceBuffer::Alloc(x.size() * 4), dw = cuda::DeviceBuffer::Alloc(D * 4),
       dout = cuda::DeviceBuffer::Alloc(x.size() * 4);
  ASSERT_TRUE(dx.ok() && dw.ok() && dout.ok());
  ASSERT_TRUE(dx->CopyFromHost(x.data(), x.size() * 4).ok());
  ASSERT_TRUE(dw->CopyFromHost(w.data(), D * 4).ok());
  ASSERT_TRUE(cuda::RmsNorm(static_cast<float*>(dx->data()), M, D, static_cast<float*>(dw->data()),
                            1e-5f, static_cast<float*>(dout->data()))
                  .ok());
  ASSERT_TRUE(dout->CopyToHost(got.data(), got.size() * 4).ok());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-4);
}

// Device copies of host vectors, and back.
template <typename T>
cuda::DeviceBuffer Upload(const std::vector<T>& v) {
  auto b = cuda::DeviceBuffer::Alloc(std::max<size_t>(1, v.size() * sizeof(T)));
  EXPECT_TRUE(b.ok());
  EXPECT_TRUE(b->CopyFromHost(v.data(), v.size() * sizeof(T)).ok());
  return *std::move(b);
}
template <typename T>
std::vector<T> Download(const cuda::DeviceBuffer& b, size_t n) {
  std::vector<T> v(n);
  EXPECT_TRUE(b.CopyToHost(v.data(), n * sizeof(T)).ok());
  return v;
}
template <typename T>
T* Ptr(const cuda::DeviceBuffer& b) {
  return static_cast<T*>(b.data());
}

using testing::Random;

// A weight of `dtype` with rows x cols values, stored with row stride `stride` >= cols.
std::vector<uint8_t> Weight(DType dtype, const std::vector<float>& values, int64_t rows,
                            int64_t cols, int64_t stride) {
  const size_t es = DTypeSize(dtype);
  std::vector<uint8_t> w(rows * stride * es, 0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float v = values[r * cols + c];
      uint8_t* at = &w[(r * stride + c) * es];
      if (dtype == DType::kF32) {
        std::memcpy(at, &v, 4);
      } else {
        const uint16_t h = dtype == DType::kF16 ? F32ToF16(v) : F32ToBf16(v);
        std::memcpy(at, &h, 2);
      }
    }
  }
  return w;
}

TEST(CudaBackendTest, GemmMatchesCpuForEveryDtypeAndBatch) {
  REQUIRE_GPU();
  auto ctx = cuda::Context::Create(0);
  ASSERT_TRUE(ctx.ok()) << ctx.status();
  ThreadPool pool(1);
  // M up to 8 takes the warp-per-row GEMV when the rows are whole 16-byte pieces (K 320,
  // stride 352), cuBLAS otherwise (K 203) and above 8 rows.
  const int64_t N = 96;
  for (auto [K, stride] : {std::pair<int64_t, int64_t>{320, 352}, {203, 203}})
    for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
      const std::vector<uint8_t> w = Weight(dtype, Random(N * K, 3), N, K, stride);
      for (int64_t M : {1, 3, 5, 8, 37}) {
        const std::vector<float> x = Random(M * K, 4 + M);
        std::vector<float> want(M * N);
        cpu::MatMul({dtype, w.data(), N, K, stride}, x.data(), M, K, want.data(), N, pool);
        auto dw = Upload(w);
        auto dx = Upload(x);
        auto dy = Upload(std::vector<float>(M * N));
        ASSERT_TRUE(
            cuda::Gemm(**ctx, {dtype, dw.data(), N, K, stride}, Ptr<float>(dx), M, Ptr<float>(dy))
                .ok());
        const std::vector<float> got = Download<float>(dy, M * N);
        // F32 exact up to summation order; half dtypes round x as well (tensor cores).
        const float tol = dtype == DType::kF32 ? 1e-3f : 5e-2f;
        for (int64_t i = 0; i < M * N; ++i) {
          ASSERT_NEAR(got[i], want[i], tol) << DTypeName(dtype) << " M=" << M << " i=" << i;
        }
      }
    }
}

TEST(CudaBackendTest, EmbedIsVocabParallel) {
  REQUIRE_GPU();
  const int64_t V = 50, H = 72;
  const std::vector<float> table = Random(V * H, 5);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const std::vector<uint8_t> w = Weight(dtype, table, V, H, H);
    const std::vector<int32_t> ids = {3, 49, 0, 20, 21};
    // This rank holds rows [20, 50): ids below come out as zeros.
    const int64_t begin = 20, end = 50;
    const std::vector<uint8_t> slice(w.begin() + begin * H * DTypeSize(dtype), w.end());
    auto dt = Upload(slice);
    auto di = Upload(ids);
    auto dout = Upload(std::vector<float>(ids.size() * H));
    ASSERT_TRUE(cuda::Embed({dtype, dt.data(), end - begin, H, H}, Ptr<int32_t>(di),
                            static_cast<int64_t>(ids.size()), begin, end, Ptr<float>(dout))
                    .ok());
    const std::vector<float> got = Download<float>(dout, ids.size() * H);
    for (size_t i = 0; i < ids.size(); ++i) {
      std::vector<float> want(H, 0.f);
      if (ids[i] >= begin) cpu::ToFloat(dtype, &w[ids[i] * H * DTypeSize(dtype)], H, want.data());
      for (int64_t d = 0; d < H; ++d) ASSERT_EQ(got[i * H + d], want[d]) << i << " " << d;
    }
  }
}

TEST(CudaBackendTest, ElementwiseOpsMatchCpu) {
  REQUIRE_GPU();
  ThreadPool pool(1);
  const int64_t rows = 7, cols = 300, n = rows * cols;
  const std::vector<float> a = Random(n, 6, -6, 6), b = Random(n, 7), bias = Random(cols, 8);
  auto da = Upload(a), db = Upload(b), dbias = Upload(bias);
  ASSERT_TRUE(cuda::SiluMul(Ptr<float>(da), Ptr<float>(db), n).ok());
  std::vector<float> want = a;
  cpu::SiluMul(want.data(), b.data(), n, pool);
  std::vector<float> got = Download<float>(da, n);
  for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(got[i], want[i], 1e-5f * (1 + std::fabs(want[i])));
  ASSERT_TRUE(cuda::AddBias(Ptr<float>(da), rows, cols, Ptr<float>(dbias)).ok());
  ASSERT_TRUE(cuda::Add(Ptr<float>(da), Ptr<float>(db), n).ok());
  got = Download<float>(da, n);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(got[i], want[i] + bias[i % cols] + b[i], 1e-4f * (1 + std::fabs(want[i])));
  }
}

TEST(CudaBackendTest, RopeMatchesTheReference) {
  REQUIRE_GPU();
  ModelConfig c;
  c.head_dim = 64;
  c.rope_theta = 500000;
  c.max_context = 8192;
  const std::vector<float> inv_freq = RopeInvFreq(c);
  const int64_t rows = 4, heads = 3, hd = 64;
  const std::vector<int32_t> pos = {0, 1, 777, 8000};
  const std::vector<float> x = Random(rows * heads * hd, 9, -3, 3);
  std::vector<float> want = x;
  ASSERT_TRUE(
      cpu::NewBackend(1)->Rope(want.data(), rows, heads, hd, pos.data(), inv_freq.data()).ok());
  auto dx = Upload(x), dp = Upload(pos), df = Upload(inv_freq);
  ASSERT_TRUE(cuda::Rope(Ptr<float>(dx), rows, heads, hd, Ptr<int32_t>(dp), Ptr<float>(df)).ok());
  const std::vector<float> got = Download<float>(dx, x.size());
  for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-5f) << i;
}

// Two sequences of different lengths in a block cache with scattered blocks; GQA (2 query
// heads per KV head) and a TP rank that holds query heads 2..3 (KV head 1).
TEST(CudaBackendTest, KvCacheAndAttentionMatchCpu) {
  REQUIRE_GPU();
  auto ctx = cuda::Context::Create(0);
  ASSERT_TRUE(ctx.ok());
  const int64_t hd = 64, kv_heads = 1, bs = 16, nblocks = 12, heads = 2, group = 2, head0 = 2,
                kv_head0 = 1;
  KvCache host(bs, nblocks);  // the block tables
  SequenceKv s0, s1;
  ASSERT_TRUE(host.Reserve(s0, 40).ok());
  ASSERT_TRUE(host.Reserve(s1, 7).ok());
  // Every position of both sequences is a row (a prefill of 40 and one of 7), written through
  // WriteKv on the device and on the CPU backend; each row points at its sequence's table.
  std::vector<int32_t> positions, offsets, table;
  for (const SequenceKv* s : {&s0, &s1}) {
    const int32_t offset = static_cast<int32_t>(table.size());
    table.insert(table.end(), s->blocks.begin(), s->blocks.end());
    for (int64_t p = 0; p < (s == &s0 ? 40 : 7); ++p) {
      positions.push_back(static_cast<int32_t>(p));
      offsets.push_back(offset);
    }
  }
  const int64_t rows = static_cast<int64_t>(positions.size());
  const std::vector<float> k = Random(rows * kv_heads * hd, 10),
                           v = Random(rows * kv_heads * hd, 11);
  const std::unique_ptr<Backend> cpu = cpu::NewBackend(2);
  auto storage = cpu->AllocKv(1, nblocks, kv_heads, bs, hd, KvFormat{});
  ASSERT_TRUE(storage.ok());
  ASSERT_TRUE(cpu->WriteKv(**storage, 0, k.data(), v.data(), rows, positions.data(), table.data(),
                           offsets.data())
                  .ok());
  auto dk = Upload(std::vector<float>(nblocks * kv_heads * bs * hd));
  auto dv = Upload(std::vector<float>(nblocks * kv_heads * bs * hd));
  auto dkin = Upload(k), dvin = Upload(v), dpos = Upload(positions), dtab = Upload(table),
       doff = Upload(offsets);
  const cuda::DeviceKv cache{Ptr<float>(dk), Ptr<float>(dv), kv_heads, bs, hd};
  ASSERT_TRUE(cuda::WriteKv(cache, Ptr<float>(dkin), Ptr<float>(dvin), rows, Ptr<int32_t>(dpos),
                            Ptr<int32_t>(dtab), Ptr<int32_t>(doff))
                  .ok());
  const std::vector<float> q = Random(rows * heads * hd, 12);
  auto dq = Upload(q), dout = Upload(std::vector<float>(rows * heads * hd));
  const float scale = 1.0f / 8.0f;
  ASSERT_TRUE(cuda::Attention(**ctx, cache, Ptr<float>(dq), rows, heads, head0, group, kv_head0,
                              Ptr<int32_t>(dpos), Ptr<int32_t>(dtab), Ptr<int32_t>(doff), 40, scale,
                              {}, Ptr<float>(dout))
                  .ok());
  const std::vector<float> got = Download<float>(dout, rows * heads * hd);
  std::vector<float> want(rows * heads * hd);
  ASSERT_TRUE(cpu->Attention(**storage, 0, q.data(), rows, heads, head0, group, kv_head0,
                             positions.data(), table.data(), offsets.data(), 40, scale, {},
                             want.data())
                  .ok());
  for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-4f) << i;
}

TEST(CudaBackendTest, VocabSummariesMatchTheHost) {
  REQUIRE_GPU();
  auto ctx = cuda::Context::Create();
  ASSERT_TRUE(ctx.ok());
  // A slice of 4000 ids from 1000 in rows of stride 4100, as a TP rank holds its logits.
  const int64_t rows = 3, ld = 4100, n = 4000, begin = 1000;
  for (int64_t top : {0, 1, 5}) {
    std::vector<float> logits = Random(rows * ld, 13, -8, 8);
    logits[1 * ld + 10] = logits[1 * ld + 20] = 30;  // a tie: the lower id first
    auto dl = Upload(logits);
    const int64_t width = SummaryWidth(top);
    std::vector<float> got(rows * width);
    ASSERT_TRUE(cuda::VocabSummaries(**ctx, Ptr<float>(dl), rows, ld, n, begin,
                                     SummaryCandidates(top), got.data())
                    .ok());
    const std::vector<float> want = VocabSummaries(logits.data(), rows, ld, begin, begin + n, top);
    for (int64_t r = 0; r < rows; ++r) {
      const float* g = got.data() + r * width;
      const float* w = want.data() + r * width;
      EXPECT_EQ(g[0], w[0]);
      EXPECT_NEAR(g[1], w[1], 1e-4 * w[1]);
      for (int64_t j = 2; j < width; ++j) EXPECT_EQ(g[j], w[j]) << r << " " << j;
    }
    EXPECT_EQ(got[1 * width + 3], begin + 10);
    if (top >= 2) {
      EXPECT_EQ(got[1 * width + 5], begin + 20);
    }
  }
}

// The device sampler against the host one: for each parameter set, twin generators from one
// seed, the same draws, the same tokens and log-probabilities.
TEST(CudaBackendTest, SampleRowsMatchesTheHostSampler) {
  REQUIRE_GPU();
  auto ctx = cuda::Context::Create();
  ASSERT_TRUE(ctx.ok());
  const int64_t rows = 4, V = 3000, K = 4;
  std::vector<float> logits = Random(rows * V, 21, -4, 4);
  logits[2 * V + 7] = logits[2 * V + 9] = 6;  // ties: the lower id first
  auto dl = Upload(logits);
  int checked = 0;
  for (float temperature : {0.0f, 0.7f, 1.5f}) {
    for (int64_t top_k : {0, 1, 50}) {
      for (float top_p : {1.0f, 0.9f, 0.3f}) {
        SamplingParams p;
        p.temperature = temperature;
        p.top_k = top_k;
        p.top_p = top_p;
        p.top_logprobs = K;
        std::vector<Sampler> host, twin;
        for (int64_t r = 0; r < rows; ++r) {
          p.seed = 100 + r;
          host.emplace_back(p);
          twin.emplace_back(p);
        }
        for (int draw = 0; draw < 8; ++draw) {
          std::vector<SampleSpec> specs(rows);
          for (int64_t r = 0; r < rows; ++r) specs[r] = twin[r].NextSpec();
          std::vector<int32_t> ids(rows), top_ids(rows * K);
          std::vector<float> lps(rows), top_lps(rows * K);
          ASSERT_TRUE(cuda::SampleRows(**ctx, Ptr<float>(dl), rows, V, specs.data(), K, ids.data(),
                                       lps.data(), top_ids.data(), top_lps.data())
                          .ok());
          for (int64_t r = 0; r < rows; ++r) {
            const SampledToken want = host[r].Sample(logits.data() + r * V, V);
            ASSERT_EQ(ids[r], want.id) << "T=" << temperature << " k=" << top_k << " p=" << top_p
                                       << " row " << r << " draw " << draw;
            EXPECT_NEAR(lps[r], want.logprob, 1e-4);
            for (int64_t j = 0; j < K; ++j) {
              EXPECT_EQ(top_ids[r * K + j], want.top[j].id);
              EXPECT_NEAR(top_lps[r * K + j], want.top[j].logprob, 1e-4);
            }
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, 27 * 8 * rows);
}

TEST(CudaBackendTest, Copy2DMovesOnlyTheSlice) {
  REQUIRE_GPU();
  // Columns [2, 5) of a 3 x 7 host matrix to a dense device matrix, and back with a pitch.
  std::vector<float> m(21);
  std::iota(m.begin(), m.end(), 0.f);
  auto d = cuda::DeviceBuffer::Alloc(9 * sizeof(float));
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(cuda::Copy2D(d->data(), 3 * 4, m.data() + 2, 7 * 4, 3 * 4, 3).ok());
  EXPECT_EQ(Download<float>(*d, 9), (std::vector<float>{2, 3, 4, 9, 10, 11, 16, 17, 18}));
  std::vector<float> back(12, -1);
  ASSERT_TRUE(cuda::Copy2D(back.data(), 4 * 4, d->data(), 3 * 4, 3 * 4, 3).ok());
  EXPECT_EQ(back, (std::vector<float>{2, 3, 4, -1, 9, 10, 11, -1, 16, 17, 18, -1}));
}

// MoE on the device: routing as the CPU backend's, then the decode path (one matrix-vector product
// per (row, expert)) and its combination, against host arithmetic. This rank owns experts 1..2 of
// 4; rows routed elsewhere contribute zeros (the TP all-reduce adds the other ranks' share).
TEST(CudaBackendTest, MoeRoutingAndExpertProductsMatchTheHost) {
  REQUIRE_GPU();
  const int64_t rows = 3, E = 4, k = 2, H = 40, I = 24, begin = 1, count = 2;
  std::vector<float> router = Random(rows * E, 5, -2, 2);
  router[1 * E + 0] = router[1 * E + 3] = 5;  // a tie: the lower expert first
  auto dr = Upload(router), de = Upload(std::vector<int32_t>(rows * k)),
       dw = Upload(std::vector<float>(rows * k));
  ASSERT_TRUE(
      cuda::RouteTopK(Ptr<float>(dr), rows, E, k, true, Ptr<int32_t>(de), Ptr<float>(dw)).ok());
  const std::vector<int32_t> experts = Download<int32_t>(de, rows * k);
  const std::vector<float> weights = Download<float>(dw, rows * k);
  std::vector<int32_t> want_experts(rows * k);
  std::vector<float> want_weights(rows * k);
  ASSERT_TRUE(
      cpu::NewBackend(1)
          ->RouteTopK(router.data(), rows, E, k, true, want_experts.data(), want_weights.data())
          .ok());
  EXPECT_EQ(experts, want_experts);
  for (int64_t i = 0; i < rows * k; ++i) EXPECT_NEAR(weights[i], want_weights[i], 1e-6) << i;
  EXPECT_EQ(experts[1 * k], 0);
  EXPECT_EQ(experts[1 * k + 1], 3);

  // BF16 gate matrices [I][H] of the two local experts, and x: rows x H.
  std::vector<std::vector<float>> gate(count);
  std::vector<std::vector<uint8_t>> raw(count);
  std::vector<cuda::DeviceBuffer> mats;
  std::vector<const void*> ptrs;
  for (int64_t e = 0; e < count; ++e) {
    gate[e] = Random(I * H, 30 + e);
    raw[e] = Weight(DType::kBF16, gate[e], I, H, H);
    mats.push_back(Upload(raw[e]));
    ptrs.push_back(mats.back().data());
    for (float& v : gate[e]) v = Bf16ToF32(F32ToBf16(v));
  }
  auto dptrs = Upload(ptrs);
  const std::vector<float> x = Random(rows * H, 40);
  auto dx = Upload(x), dy = Upload(std::vector<float>(rows * k * I));
  const ExpertTable table{
      DType::kBF16, static_cast<const void* const*>(dptrs.data()), begin, count, I, H};
  ASSERT_TRUE(
      cuda::ExpertMatVec(table, Ptr<int32_t>(de), rows * k, Ptr<float>(dx), k, Ptr<float>(dy))
          .ok());
  const std::vector<float> y = Download<float>(dy, rows * k * I);
  for (int64_t slot = 0; slot < rows * k; ++slot) {
    const int64_t e = experts[slot] - begin, r = slot / k;
    for (int64_t i = 0; i < I; ++i) {
      double want = 0;
      if (e >= 0 && e < count) {
        for (int64_t c = 0; c < H; ++c) want += gate[e][i * H + c] * x[r * H + c];
      }
      ASSERT_NEAR(y[slot * I + i], want, 1e-4) << slot << " " << i;
    }
  }
  // The weighted sum of each row's slots.
  auto dout = Upload(std::vector<float>(rows * I));
  ASSERT_TRUE(
      cuda::CombineSlots(Ptr<float>(dy), Ptr<float>(dw), rows, k, I, Ptr<float>(dout)).ok());
  const std::vector<float> out = Download<float>(dout, rows * I);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < I; ++i) {
      const float want =
          weights[r * k] * y[(r * k) * I + i] + weights[r * k + 1] * y[(r * k + 1) * I + i];
      ASSERT_NEAR(out[r * I + i], want, 1e-5);
    }
  }
}

// End to end: greedy generation on the GPU gives the CPU's tokens, on generated models of every
// architecture (prefill of a prompt, then decode steps of two sequences batched together).
class CudaGenerationTest : public ::testing::TestWithParam<std::pair<std::string, DType>> {
 protected:
  // The small generated model of this case's architecture and dtype, written under dir_.
  std::string WriteCaseModel() {
    const auto& [arch, dtype] = GetParam();
    options_ = testing::SmallModel(arch, dir_.Sub("m"));
    options_.dtype = dtype;
    return testing::WriteModel(options_);
  }
  testing::TempDir dir_;
  GenModelOptions options_;
};

// The model of `path` on GPU 0.
absl::StatusOr<std::unique_ptr<Transformer>> LoadOnGpu(const std::string& path,
                                                       const Transformer::Options& options) {
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> gpu, cuda::NewBackend(0, ContractKernels()));
  return Transformer::Load(path, options, std::move(gpu));
}

std::vector<std::vector<int32_t>> Greedy(
    const std::function<absl::Status(std::vector<SequenceChunk>&, std::vector<float>&)>& forward,
    KvCache& cache, int64_t V, int steps) {
  std::vector<SequenceKv> kv(2);
  std::vector<std::vector<int32_t>> out(2);
  std::vector<SequenceChunk> chunks = {{{5, 17, 42, 7, 99, 3}, &kv[0]}, {{8, 1}, &kv[1]}};
  std::vector<float> logits;
  for (int step = 0; step < steps; ++step) {
    EXPECT_TRUE(forward(chunks, logits).ok());
    for (size_t s = 0; s < chunks.size(); ++s) {
      const float* row = logits.data() + s * V;
      const int32_t next = static_cast<int32_t>(std::max_element(row, row + V) - row);
      out[s].push_back(next);
      chunks[s].tokens = {next};
    }
  }
  for (SequenceKv& s : kv) cache.Release(s);
  return out;
}

TEST_P(CudaGenerationTest, GreedyTokensMatchTheCpu) {
  REQUIRE_GPU();
  const DType dtype = GetParam().second;
  const std::string path = WriteCaseModel();
  auto cpu_model = Transformer::Load(path, {});
  ASSERT_TRUE(cpu_model.ok()) << cpu_model.status();
  auto gpu_model = LoadOnGpu(path, {});
  ASSERT_TRUE(gpu_model.ok()) << gpu_model.status();
  const int64_t V = (*cpu_model)->config().vocab_size;
  auto cpu_cache = (*cpu_model)->NewKvCache(256);
  auto gpu_cache = (*gpu_model)->NewKvCache(256);
  ASSERT_TRUE(cpu_cache.ok() && gpu_cache.ok()) << gpu_cache.status();
  const auto want =
      Greedy([&](std::vector<SequenceChunk>& c,
                 std::vector<float>& l) { return (*cpu_model)->Forward(c, **cpu_cache, l); },
             **cpu_cache, V, 12);
  const auto got =
      Greedy([&](std::vector<SequenceChunk>& c,
                 std::vector<float>& l) { return (*gpu_model)->Forward(c, **gpu_cache, l); },
             **gpu_cache, V, 12);
  if (dtype == DType::kF32) {
    EXPECT_EQ(got, want);  // F32 GEMMs: only the summation order differs
  } else {
    // Half weights: the GPU also rounds activations to the weight dtype for the tensor cores,
    // so tokens may part after a near tie; the first token of each sequence must agree.
    EXPECT_EQ(got[0][0], want[0][0]);
    EXPECT_EQ(got[1][0], want[1][0]);
  }
  // Prefill logits, element by element.
  std::vector<SequenceKv> a(1), b(1);
  std::vector<SequenceChunk> ca = {{{5, 17, 42, 7, 99, 3}, &a[0]}},
                             cb = {{{5, 17, 42, 7, 99, 3}, &b[0]}};
  std::vector<float> la, lb;
  ASSERT_TRUE((*cpu_model)->Forward(ca, **cpu_cache, la).ok());
  ASSERT_TRUE((*gpu_model)->Forward(cb, **gpu_cache, lb).ok());
  ASSERT_EQ(la.size(), lb.size());
  const float tol = dtype == DType::kF32 ? 1e-3f : 5e-2f;
  for (size_t i = 0; i < la.size(); ++i) ASSERT_NEAR(lb[i], la[i], tol) << i;
}

// The token choice on the device (greedy summaries, sampling) against the host's on the CPU
// model's logits, over a prefill and a batch of two decode steps.
TEST_P(CudaGenerationTest, DeviceTokenChoiceMatchesTheHost) {
  REQUIRE_GPU();
  if (GetParam().second != DType::kF32) {
    GTEST_SKIP() << "F32 weights: logits equal to 1e-3, so equal choices";
  }
  const std::string path = WriteCaseModel();
  auto cpu_model = Transformer::Load(path, {});
  auto gpu_model = LoadOnGpu(path, {});
  ASSERT_TRUE(cpu_model.ok() && gpu_model.ok());
  const int64_t V = (*cpu_model)->config().vocab_size;
  auto cpu_cache = (*cpu_model)->NewKvCache(256);
  auto gpu_cache = (*gpu_model)->NewKvCache(256);
  ASSERT_TRUE(cpu_cache.ok() && gpu_cache.ok());
  std::vector<SequenceKv> a(2), b(2);
  std::vector<SequenceChunk> ca = {{{5, 17, 42, 7}, &a[0]}, {{8, 1, 2}, &a[1]}},
                             cb = {{{5, 17, 42, 7}, &b[0]}, {{8, 1, 2}, &b[1]}};
  SamplingParams p;
  p.temperature = 0.9f;
  p.top_p = 0.95f;
  p.top_logprobs = 3;
  std::vector<Sampler> host, twin;
  for (uint64_t seed : {11u, 12u}) {
    p.seed = seed;
    host.emplace_back(p);
    twin.emplace_back(p);
  }
  for (int step = 0; step < 6; ++step) {
    std::vector<float> logits;
    ASSERT_TRUE((*cpu_model)->Forward(ca, **cpu_cache, logits).ok());
    ASSERT_TRUE((*gpu_model)->Run(cb, **gpu_cache).ok());
    auto want_greedy = GreedyFromVocabSlices(logits.data(), 2, V, 0, V, 3, nullptr);
    auto got_greedy = (*gpu_model)->Greedy(3, nullptr);
    ASSERT_TRUE(want_greedy.ok() && got_greedy.ok()) << got_greedy.status();
    auto got = (*gpu_model)->Sample({&twin[0], &twin[1]}, 3);
    ASSERT_TRUE(got.ok()) << got.status();
    for (int s = 0; s < 2; ++s) {
      EXPECT_EQ((*got_greedy)[s].id, (*want_greedy)[s].id) << "step " << step;
      EXPECT_NEAR((*got_greedy)[s].logprob, (*want_greedy)[s].logprob, 1e-3);
      ASSERT_EQ((*got_greedy)[s].top.size(), 3u);
      for (int j = 0; j < 3; ++j)
        EXPECT_EQ((*got_greedy)[s].top[j].id, (*want_greedy)[s].top[j].id);
      const SampledToken want = host[s].Sample(logits.data() + s * V, V);
      EXPECT_EQ((*got)[s].id, want.id) << "step " << step;
      EXPECT_NEAR((*got)[s].logprob, want.logprob, 1e-3);
      // Both continue with the sampled token.
      ca[s].tokens = {want.id};
      cb[s].tokens = {want.id};
    }
  }
}

// Pipeline stages on the device: stage 0's hidden states feed stage 1 (through host memory, as
// a link between ranks on one GPU goes), and the pair gives the whole model's logits; a later
// stage without its input is refused, naming the rows.
TEST_P(CudaGenerationTest, StagesChainToTheWholeModel) {
  REQUIRE_GPU();
  const std::string path = WriteCaseModel();
  Transformer::Options first, second;
  first.layer_end = 1;
  second.layer_begin = 1;
  auto whole = LoadOnGpu(path, {});
  auto s0 = LoadOnGpu(path, first);
  auto s1 = LoadOnGpu(path, second);
  ASSERT_TRUE(whole.ok() && s0.ok() && s1.ok());
  EXPECT_TRUE((*s0)->first_stage() && !(*s0)->last_stage());
  EXPECT_TRUE(!(*s1)->first_stage() && (*s1)->last_stage());
  auto cw = (*whole)->NewKvCache(64), c0 = (*s0)->NewKvCache(64), c1 = (*s1)->NewKvCache(64);
  ASSERT_TRUE(cw.ok() && c0.ok() && c1.ok());
  std::vector<SequenceKv> a(1), b0(1), b1(1);
  std::vector<SequenceChunk> cha = {{{5, 17, 42, 7}, &a[0]}}, ch0 = {{{5, 17, 42, 7}, &b0[0]}},
                             ch1 = {{{5, 17, 42, 7}, &b1[0]}};
  EXPECT_THAT(std::string((*s1)->Run(ch1, **c1).message()),
              ::testing::HasSubstr("needs the hidden states of its 4 rows (given: 0)"));
  std::vector<float> want, hidden, got;
  ASSERT_TRUE((*whole)->ForwardStage(cha, **cw, nullptr, want).ok());
  ASSERT_TRUE((*s0)->ForwardStage(ch0, **c0, nullptr, hidden).ok());
  ASSERT_EQ(hidden.size(), 4u * options_.hidden);
  ASSERT_TRUE((*s1)->ForwardStage(ch1, **c1, hidden.data(), got).ok());
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-4) << i;
}

INSTANTIATE_TEST_SUITE_P(Archs, CudaGenerationTest,
                         ::testing::Values(std::make_pair("llama", DType::kF32),
                                           std::make_pair("llama", DType::kBF16),
                                           std::make_pair("qwen2", DType::kF16),
                                           std::make_pair("mixtral", DType::kF32)));

// The NCCL id travels through the real rendezvous as a blob, as between ranks; a single-rank
// communicator then runs every operation of the interface on device memory.
TEST(CudaBackendTest, NcclCommunicatorFromTheRendezvous) {
  REQUIRE_GPU();
  auto id = nccl::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  auto server = RendezvousServer::Listen("127.0.0.1", 0, "nccl-test-secret-0123");
  ASSERT_TRUE(server.ok());
  auto world = WorldConfig::Create(1, 1, 0);
  auto info =
      server->Run(*world, {0, "127.0.0.1", 1}, {id->ToBlob()}, std::chrono::milliseconds(1000));
  ASSERT_TRUE(info.ok()) << info.status();
  auto handed = nccl::UniqueId::FromBlob(info->blobs.at(0));
  ASSERT_TRUE(handed.ok());
  auto comm = nccl::NcclCommunicator::Create(*handed, 1, 0, 0);
  ASSERT_TRUE(comm.ok()) << comm.status();
  Communicator& c = **comm;
  std::vector<float> v = {1, 2, 3, 4}, out(4);
  auto d = cuda::DeviceBuffer::Alloc(16), g = cuda::DeviceBuffer::Alloc(16);
  ASSERT_TRUE(d.ok() && g.ok());
  ASSERT_TRUE(d->CopyFromHost(v.data(), 16).ok());
  ASSERT_TRUE(c.AllReduceSum(static_cast<float*>(d->data()), 4).ok());  // identity on one rank
  ASSERT_TRUE(c.AllGather(static_cast<float*>(d->data()), 4, static_cast<float*>(g->data())).ok());
  ASSERT_TRUE(c.Broadcast(d->data(), 16, 0).ok());
  ASSERT_TRUE(c.Barrier().ok());
  ASSERT_TRUE(g->CopyToHost(out.data(), 16).ok());
  EXPECT_EQ(out, v);
  EXPECT_FALSE(nccl::UniqueId::FromBlob("short").ok());
}

// The watchdog on creation: a member that never joins is reported within the init timeout, not
// after NCCL's own (none: ncclCommInitRank would wait for ever).
TEST(CudaBackendTest, NcclCreationNamesAMemberThatNeverJoins) {
  REQUIRE_GPU();
  auto id = nccl::NewUniqueId();
  ASSERT_TRUE(id.ok());
  auto comm = nccl::NcclCommunicator::Create(*id, 2, 0, 0, std::chrono::milliseconds(1000),
                                             std::chrono::milliseconds(2000));
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kUnavailable) << comm.status();
  EXPECT_NE(comm.status().message().find("never joined"), std::string::npos) << comm.status();
  EXPECT_NE(comm.status().message().find("rank 0 of 2"), std::string::npos) << comm.status();
}

// The watchdog on operations, with two GPUs: one member joins, then stops answering; the other's
// all-reduce fails with Unavailable within the peer timeout, and later calls fail at once.
TEST(CudaBackendTest, NcclOperationNamesAPeerThatStoppedAnswering) {
  REQUIRE_GPU();
  if (cuda::DeviceCount() < 2) GTEST_SKIP() << "needs two GPUs (NCCL ranks need distinct GPUs)";
  auto id = nccl::NewUniqueId();
  ASSERT_TRUE(id.ok());
  absl::StatusOr<std::unique_ptr<nccl::NcclCommunicator>> c0, c1;
  std::thread t1(
      [&] { c1 = nccl::NcclCommunicator::Create(*id, 2, 1, 1, std::chrono::milliseconds(1000)); });
  c0 = nccl::NcclCommunicator::Create(*id, 2, 0, 0, std::chrono::milliseconds(1000));
  t1.join();
  ASSERT_TRUE(c0.ok() && c1.ok()) << c0.status() << " " << c1.status();
  // On GPU 0: this thread's device since its Create.
  auto d = cuda::DeviceBuffer::Alloc(4 * sizeof(float));
  ASSERT_TRUE(d.ok());
  // Member 1 never issues its all-reduce.
  const absl::Status s = (*c0)->AllReduceSum(static_cast<float*>(d->data()), 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("stopped answering"), std::string::npos) << s;
  EXPECT_FALSE((*c0)->Barrier().ok());
  c1->reset();  // member 1 leaves: its finalize finds no partner, so it aborts within the bound
}

}  // namespace
}  // namespace shardserve
