// CUDA backend and NCCL communicator against the CPU backend. Every test needs a GPU and skips
// cleanly without one; CI still compiles and links this binary.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "backend/cpu/kernels.h"
#include "backend/cuda/cuda_backend.h"
#include "comm/nccl/nccl_comm.h"
#include "comm/rendezvous.h"

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
