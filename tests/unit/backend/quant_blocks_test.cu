// The GPU's reading of GGUF's quantized blocks and of FP8's (backend/cuda/quant_blocks.cuh), run on
// the host (no GPU needed): every chunk of 32 values, as the decode and prefill kernels expand it,
// equals the CPU backend's expansion of the same row (cpu::ToFloat), for rows quantized by our GGUF
// writer and for rows of random bytes (any scales and quants a file may hold).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/kernels.h"
#include "backend/cuda/quant_blocks.cuh"
#include "devtools/quantize_row.h"

namespace shardserve::cuda {
namespace {

template <DType D>
void ExpectChunksMatchTheCpu(const std::string& bytes, int64_t n, const std::string& what) {
  std::vector<float> want(n);
  cpu::ToFloat(D, bytes.data(), n, want.data());
  // The kernels read blocks at the alignment a device row has (cudaMalloc: 256 bytes).
  std::vector<uint4> aligned((bytes.size() + 15) / 16);
  std::memcpy(aligned.data(), bytes.data(), bytes.size());
  const auto* row = reinterpret_cast<const uint8_t*>(aligned.data());
  constexpr int64_t per_block = Layout<D>::kBlock / 32;
  for (int64_t c = 0; c < n / 32; ++c) {
    float v[32];
    Blocks<D>::Chunk(row + BytesOf<D>(c / per_block * Layout<D>::kBlock),
                     static_cast<int>(c % per_block), v);
    for (int i = 0; i < 32; ++i) {
      const float w = want[c * 32 + i];
      if (std::isnan(w)) continue;  // random bytes: an F16 scale may be NaN
      ASSERT_NEAR(v[i], w, 1e-6 * std::max(1.0f, std::fabs(w)))
          << DTypeName(D) << " " << what << ": chunk " << c << " value " << i;
    }
  }
}

// IntBlocks (the dp4a GEMV's reading): each chunk's d[i / 16] * q_i + m is the chunk's float
// value; ChunkDot with inputs quantized by QuantizeChunk is the float dot product within the
// inputs' rounding (half a step, max |x| / 254, times the weights' magnitudes).
template <DType D>
void ExpectIntChunksMatch(const std::string& bytes, int64_t n, const std::string& what) {
  if constexpr (HasIntBlocks(D)) {
    std::vector<uint4> aligned((bytes.size() + 15) / 16);
    std::memcpy(aligned.data(), bytes.data(), bytes.size());
    const auto* row = reinterpret_cast<const uint8_t*>(aligned.data());
    constexpr int64_t per_block = Layout<D>::kBlock / 32;
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> dist(-3, 3);
    for (int64_t c = 0; c < n / 32; ++c) {
      const uint8_t* block = row + BytesOf<D>(c / per_block * Layout<D>::kBlock);
      float v[32];
      Blocks<D>::Chunk(block, static_cast<int>(c % per_block), v);
      IntChunk ic;
      IntBlocks<D>::Chunk(block, static_cast<int>(c % per_block), ic);
      float x[32];
      for (float& e : x) e = dist(rng);
      int32_t xq[8];
      float x_scale;
      int x_sum;
      QuantizeChunk(x, xq, &x_scale, &x_sum);
      double want = 0, bound = 0;
      bool finite = true;
      for (int i = 0; i < 32; ++i) {
        const int q = static_cast<int8_t>(static_cast<uint32_t>(ic.q[i / 4]) >> (8 * (i % 4)));
        const float value = ic.d[i / 16] * static_cast<float>(q) + ic.m;
        if (std::isnan(v[i])) {  // random bytes: an F16 scale may be NaN
          finite = false;
          continue;
        }
        ASSERT_NEAR(value, v[i], 1e-6 * std::max(1.0f, std::fabs(v[i])))
            << DTypeName(D) << " " << what << ": chunk " << c << " value " << i;
        want += double(v[i]) * x[i];
        bound += std::fabs(v[i]) * x_scale / 2 * 1.001 + 1e-5;
      }
      if (!finite) continue;
      ASSERT_NEAR(ChunkDot(ic, xq, x_scale, x_sum), want, bound)
          << DTypeName(D) << " " << what << ": chunk " << c;
    }
  }
}

template <DType D>
void CheckType() {
  std::mt19937 rng(static_cast<uint32_t>(D) + 1);
  std::uniform_real_distribution<float> dist(-2, 2);
  const int64_t n = 1024;
  std::vector<float> x(n);
  for (float& v : x) v = dist(rng);
  ExpectChunksMatchTheCpu<D>(QuantizeRow(D, x.data(), n), n, "quantized row");
  ExpectIntChunksMatch<D>(QuantizeRow(D, x.data(), n), n, "quantized row");
  std::uniform_int_distribution<int> byte(0, 255);
  std::string random(DTypeBytes(D, n), '\0');
  for (char& b : random) b = static_cast<char>(byte(rng));
  // Finite F16 scales (exponent below 31): what the CPU and the GPU must agree on.
  for (size_t b = 0; b < random.size() / Layout<D>::kBytes; ++b) {
    char* blk = random.data() + b * Layout<D>::kBytes;
    for (int off : {D == DType::kQ6_K ? 209 : 1, D == DType::kQ6_K ? 209 : 3}) {
      blk[off] = static_cast<char>(blk[off] & 0x3f);  // the high byte of an F16: |value| < 2
    }
  }
  ExpectChunksMatchTheCpu<D>(random, n, "random bytes");
  ExpectIntChunksMatch<D>(random, n, "random bytes");
}

TEST(QuantBlocksTest, EveryChunkIsTheCpusExpansion) {
  CheckType<DType::kQ8_0>();
  CheckType<DType::kQ4_0>();
  CheckType<DType::kQ4_1>();
  CheckType<DType::kQ4_K>();
  CheckType<DType::kQ5_K>();
  CheckType<DType::kQ6_K>();
  CheckType<DType::kF8_128>();  // the random bytes' scales: byte 3 the F32's top (|scale| < 2)
}

}  // namespace
}  // namespace shardserve::cuda
