// CUDA backend and NCCL communicator against the CPU backend. Every test needs a GPU and skips
// cleanly without one; CI still compiles and links this binary.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "backend/cpu/kernels.h"
#include "backend/cuda/cuda_backend.h"
#include "comm/nccl/nccl_comm.h"
#include "comm/rendezvous.h"
#include "model/config.h"
#include "model/cuda_transformer.h"
#include "model/kv_cache.h"
#include "model/rope.h"
#include "model/test_models.h"
#include "model/transformer.h"

namespace shardserve {
namespace {

#define REQUIRE_GPU() \
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no GPU on this machine"

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

TEST(CudaBackendTest, MatVecMatchesCpuForEveryDtype) {
  REQUIRE_GPU();
  ThreadPool pool(1);
  const int64_t N = 77, K = 515;
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> x(K);
  for (float& v : x) v = u(rng);
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    std::vector<uint8_t> w(N * K * DTypeSize(dtype));
    for (int64_t i = 0; i < N * K; ++i) {
      const float v = u(rng);
      if (dtype == DType::kF32) {
        std::memcpy(&w[4 * i], &v, 4);
      } else {
        const uint16_t h = dtype == DType::kF16 ? F32ToF16(v) : F32ToBf16(v);
        std::memcpy(&w[2 * i], &h, 2);
      }
    }
    std::vector<float> want(N), got(N);
    cpu::MatMul({dtype, w.data(), N, K, K}, x.data(), 1, K, want.data(), N, pool);
    auto dw = cuda::DeviceBuffer::Alloc(w.size()), dx = cuda::DeviceBuffer::Alloc(K * 4),
         dy = cuda::DeviceBuffer::Alloc(N * 4);
    ASSERT_TRUE(dw.ok() && dx.ok() && dy.ok());
    ASSERT_TRUE(dw->CopyFromHost(w.data(), w.size()).ok());
    ASSERT_TRUE(dx->CopyFromHost(x.data(), K * 4).ok());
    ASSERT_TRUE(cuda::MatVec(dtype, dw->data(), N, K, static_cast<float*>(dx->data()),
                             static_cast<float*>(dy->data()))
                    .ok());
    ASSERT_TRUE(dy->CopyToHost(got.data(), N * 4).ok());
    for (int64_t i = 0; i < N; ++i) ASSERT_NEAR(got[i], want[i], 1e-3) << DTypeName(dtype);
  }
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

std::vector<float> Random(size_t n, uint32_t seed, float lo = -1, float hi = 1) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

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
  const int64_t N = 96, K = 320, stride = 352;
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    const std::vector<uint8_t> w = Weight(dtype, Random(N * K, 3), N, K, stride);
    for (int64_t M : {1, 5, 37}) {
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
  const Rope rope(c);
  const int64_t rows = 4, heads = 3, hd = 64;
  const std::vector<int32_t> pos = {0, 1, 777, 8000};
  const std::vector<float> x = Random(rows * heads * hd, 9, -3, 3);
  std::vector<float> want = x;
  for (int64_t r = 0; r < rows; ++r) rope.Apply(want.data() + r * heads * hd, heads, pos[r]);
  auto dx = Upload(x), dp = Upload(pos), df = Upload(rope.inv_freq());
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
  KvCache host(1, kv_heads, hd, bs, nblocks);
  SequenceKv s0, s1;
  ASSERT_TRUE(host.Reserve(s0, 40).ok());
  ASSERT_TRUE(host.Reserve(s1, 7).ok());
  // Every position of both sequences is a row (a prefill of 40 and one of 7), written through
  // WriteKv on the device and by hand on the host; each row points at its sequence's table.
  std::vector<int32_t> positions, offsets, table;
  std::vector<const SequenceKv*> seqs;
  for (const SequenceKv* s : {&s0, &s1}) {
    const int32_t offset = static_cast<int32_t>(table.size());
    table.insert(table.end(), s->blocks.begin(), s->blocks.end());
    for (int64_t p = 0; p < (s == &s0 ? 40 : 7); ++p) {
      positions.push_back(static_cast<int32_t>(p));
      offsets.push_back(offset);
      seqs.push_back(s);
    }
  }
  const int64_t rows = static_cast<int64_t>(positions.size());
  const std::vector<float> k = Random(rows * kv_heads * hd, 10),
                           v = Random(rows * kv_heads * hd, 11);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t block = seqs[r]->blocks[positions[r] / bs], slot = positions[r] % bs;
    std::copy_n(k.data() + r * hd, hd, host.K(0, block, 0) + slot * hd);
    std::copy_n(v.data() + r * hd, hd, host.V(0, block, 0) + slot * hd);
  }
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
                              Ptr<float>(dout))
                  .ok());
  const std::vector<float> got = Download<float>(dout, rows * heads * hd);
  std::vector<float> scores(40), want(hd);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = positions[r] + 1;
    std::vector<const float*> kb, vb;
    for (int64_t b = 0; b < host.BlocksFor(len); ++b) {
      kb.push_back(host.K(0, seqs[r]->blocks[b], 0));
      vb.push_back(host.V(0, seqs[r]->blocks[b], 0));
    }
    for (int64_t h = 0; h < heads; ++h) {
      cpu::AttendHead(q.data() + (r * heads + h) * hd, kb.data(), vb.data(), bs, hd, len, scale,
                      scores.data(), want.data());
      for (int64_t d = 0; d < hd; ++d) {
        ASSERT_NEAR(got[(r * heads + h) * hd + d], want[d], 1e-4f) << r << " " << h << " " << d;
      }
    }
  }
}

TEST(CudaBackendTest, TopKLogprobsMatchesAHostLogSoftmax) {
  REQUIRE_GPU();
  const int64_t rows = 3, V = 5000, k = 5;
  std::vector<float> logits = Random(rows * V, 13, -8, 8);
  logits[1 * V + 10] = logits[1 * V + 20] = 30;  // a tie: the lower id first
  auto dl = Upload(logits), di = Upload(std::vector<int32_t>(rows * k)),
       dp = Upload(std::vector<float>(rows * k));
  ASSERT_TRUE(
      cuda::TopKLogprobs(Ptr<float>(dl), rows, V, k, Ptr<int32_t>(di), Ptr<float>(dp)).ok());
  const std::vector<int32_t> ids = Download<int32_t>(di, rows * k);
  const std::vector<float> lps = Download<float>(dp, rows * k);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits.data() + r * V;
    double mx = *std::max_element(row, row + V), sum = 0;
    for (int64_t i = 0; i < V; ++i) sum += std::exp(row[i] - mx);
    std::vector<int32_t> order(V);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return row[a] > row[b]; });
    for (int64_t j = 0; j < k; ++j) {
      EXPECT_EQ(ids[r * k + j], order[j]) << r << " " << j;
      EXPECT_NEAR(lps[r * k + j], row[order[j]] - mx - std::log(sum), 1e-4);
    }
  }
  EXPECT_EQ(ids[1 * k], 10);
  EXPECT_EQ(ids[1 * k + 1], 20);
}

// End to end: greedy generation on the GPU gives the CPU's tokens, on generated models of every
// architecture (prefill of a prompt, then decode steps of two sequences batched together).
class CudaGenerationTest : public ::testing::TestWithParam<std::pair<std::string, DType>> {};

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
  const auto& [arch, dtype] = GetParam();
  testing::TempDir dir;
  GenModelOptions o = testing::SmallModel(arch, dir.Sub("m"));
  o.dtype = dtype;
  const std::string path = testing::WriteModel(o);
  auto cpu_model = Transformer::Load(path, {});
  ASSERT_TRUE(cpu_model.ok()) << cpu_model.status();
  auto gpu_model = CudaTransformer::Load(path, {});
  ASSERT_TRUE(gpu_model.ok()) << gpu_model.status();
  const int64_t V = (*cpu_model)->config().vocab_size;
  auto cpu_cache = (*cpu_model)->NewKvCache(256);
  auto gpu_cache = (*gpu_model)->NewKvCache(256);
  ASSERT_TRUE(gpu_cache.ok()) << gpu_cache.status();
  const auto want =
      Greedy([&](std::vector<SequenceChunk>& c,
                 std::vector<float>& l) { return (*cpu_model)->Forward(c, *cpu_cache, l); },
             *cpu_cache, V, 12);
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
  ASSERT_TRUE((*cpu_model)->Forward(ca, *cpu_cache, la).ok());
  ASSERT_TRUE((*gpu_model)->Forward(cb, **gpu_cache, lb).ok());
  ASSERT_EQ(la.size(), lb.size());
  const float tol = dtype == DType::kF32 ? 1e-3f : 5e-2f;
  for (size_t i = 0; i < la.size(); ++i) ASSERT_NEAR(lb[i], la[i], tol) << i;
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
  auto server = RendezvousServer::Listen("127.0.0.1", 0);
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

}  // namespace
}  // namespace shardserve
