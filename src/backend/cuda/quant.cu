// The CUDA backend: block-quantized weights as GGUF files store them (Q8_0, Q4_0, Q4_1, Q4_K,
// Q5_K, Q6_K in ggml's layouts, kept on the device as the file has them), and FP8 checkpoints'
// weights in blocks of 128 values with an F32 scale (kF8_128, model/fp8.h). Decode reads the blocks
// (no expanded copy of a weight): a warp per output row copies 32 chunks of 32 values of its row at
// a time into shared memory (cp.async, 16-byte units, three rounds ahead of the one in use), then
// each lane expands one chunk and multiplies it with up to 8 F32 inputs. Prefill expands tiles of
// rows into BF16 for cuBLAS (gemm.cu).
#include <cuda_pipeline.h>

#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "backend/cuda/common.cuh"
#include "backend/cuda/quant_blocks.cuh"

namespace shardserve::cuda {
namespace {

constexpr int kQuantWarps = 4;  // output rows per block
// Rounds of 32 chunks a warp has in flight: the next kQuantStages - 1 rounds' bytes are on their
// way (cp.async into shared memory, no registers held) while one round is expanded.
constexpr int kQuantStages = 4;
// A round's bytes in 16-byte units: 32 chunks of 32 values, plus up to 15 bytes before a start
// that is not 16-byte aligned.
template <DType D>
constexpr int kStageUnits = static_cast<int>((BytesOf<D>(1024) + 15 + 15) / 16);
// A round's 1,024 inputs as float4s, chunk j's 8 at 9 j: a lane reads its own chunk's without
// bank conflicts (chunks 36 floats apart put a quarter-warp's 8 lanes on 8 different bank
// groups). Read straight from global memory, 32 lanes 128 bytes apart, the inputs took 32 L1
// wavefronts a load and bounded the GEMV (ncu: L1 76 % busy, DRAM 8 %; bench/cuda-notes.md).
constexpr int kXPitch = 9;
// A warp's share of the block's shared memory.
template <DType D>
struct WarpStages {
  uint4 w[kQuantStages * kStageUnits<D>];  // kQuantStages rounds of the row
  float4 x[32 * kXPitch];                  // one round of one input row
};

// The bytes of the round of 32 chunks from chunk c0 of a row sit `RoundShift` bytes into their
// stage: the round's start rounded down to 16 bytes is copied from.
template <DType D>
__device__ __forceinline__ int RoundShift(const uint8_t* row, int64_t c0) {
  return static_cast<int>(reinterpret_cast<uintptr_t>(row + BytesOf<D>(c0 * 32)) % 16);
}

// Starts the copy of that round into `stage` (16-byte units, the lanes taking them in turn). The
// last unit may reach up to 15 bytes past the row: Upload pads every matrix by 16.
template <DType D>
__device__ __forceinline__ void IssueRound(const uint8_t* row, int64_t c0, int64_t chunks, int lane,
                                           uint4* stage) {
  const int64_t n = chunks - c0 < 32 ? chunks - c0 : 32;
  const int shift = RoundShift<D>(row, c0);
  const uint4* src = reinterpret_cast<const uint4*>(row + BytesOf<D>(c0 * 32) - shift);
  const int units = static_cast<int>((shift + BytesOf<D>(n * 32) + 15) / 16);
  for (int u = lane; u < units; u += 32) __pipeline_memcpy_async(stage + u, src + u, 16);
}

// acc[m] += row . x[m] for m < M (x rows of `cols` floats at stride ldx), the row's `cols`
// values (a multiple of the block) read once, in rounds of 32 chunks: kQuantStages - 1 rounds
// ahead are copied while the lanes expand this round's chunks, one each, from shared memory, and
// multiply them with the inputs staged there.
template <DType D, int M>
__device__ void RowDot(const uint8_t* row, int64_t cols, const float* __restrict__ x, int64_t ldx,
                       WarpStages<D>& stages, float (&acc)[M]) {
  const int lane = threadIdx.x % 32;
  const int64_t chunks = cols / 32, rounds = (chunks + 31) / 32;
#pragma unroll
  for (int s = 0; s < kQuantStages - 1; ++s) {
    if (s < rounds) IssueRound<D>(row, 32 * s, chunks, lane, stages.w + s * kStageUnits<D>);
    __pipeline_commit();
  }
  for (int64_t k = 0; k < rounds; ++k) {
    // The stage of round k - 1 takes round k + kQuantStages - 1 once every lane has read it.
    __syncwarp();
    const int64_t ahead = k + kQuantStages - 1;
    if (ahead < rounds) {
      IssueRound<D>(row, 32 * ahead, chunks, lane,
                    stages.w + (ahead % kQuantStages) * kStageUnits<D>);
    }
    __pipeline_commit();
    __pipeline_wait_prior(kQuantStages - 1);  // this lane's copies of round k have landed
    __syncwarp();                             // and every lane's
    const int64_t c0 = 32 * k;
    const int n = chunks - c0 < 32 ? static_cast<int>(chunks - c0) : 32;
    float v[32];
    if (lane < n) {
      Blocks<D>::Chunk(
          reinterpret_cast<const uint8_t*>(stages.w + (k % kQuantStages) * kStageUnits<D>) +
              RoundShift<D>(row, c0),
          lane, v);
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float4* src = reinterpret_cast<const float4*>(x + m * ldx + c0 * 32);
#pragma unroll
      for (int i = 0; i < 8; ++i) {  // the round's inputs, coalesced, into the padded layout
        const int f = lane + 32 * i;
        if (f < 8 * n) stages.x[f / 8 * kXPitch + f % 8] = __ldg(src + f);
      }
      __syncwarp();
      if (lane < n) {
        float s = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float4 a = stages.x[lane * kXPitch + i];
          s += v[4 * i] * a.x + v[4 * i + 1] * a.y + v[4 * i + 2] * a.z + v[4 * i + 3] * a.w;
        }
        acc[m] += s;
      }
      __syncwarp();
    }
  }
}

// Decode: as gemm.cu's GemvKernel, one warp per output row numbered across the group's matrices.
template <DType D, int M>
__global__ void __launch_bounds__(kQuantWarps * 32, 6)
    QuantGemvKernel(GemvGroup g, int64_t cols, const float* __restrict__ x) {
  __shared__ WarpStages<D> stage[kQuantWarps];
  int i;
  int64_t row;
  if (!GroupRow(g, blockIdx.x * kQuantWarps + threadIdx.x / 32, &i, &row)) return;
  const uint8_t* w = static_cast<const uint8_t*>(g.w[i]) + row * BytesOf<D>(g.stride[i]);
  float acc[M] = {};
  RowDot<D, M>(w, cols, x, cols, stage[threadIdx.x / 32], acc);
  WriteWarpSums(acc, g.y[i], g.rows[i], row);
}

// The dp4a decode (SHARDSERVE_CUDA_QUANT_GEMV=dp4a): the inputs quantized once per product to
// int8 chunks of 32 (QuantizeChunk: a scale and the chunk's sum beside each), then a warp per
// output row whose lanes each take a chunk of the row at a time, read as integers (IntBlocks),
// and multiply it with four dp4a a half: no float expansion of the weights (llama.cpp's mmvq
// design). Accuracy: each input rounded to 1/254 of its chunk's largest magnitude.
__global__ void QuantizeInputsKernel(const float* __restrict__ x, int64_t chunks, int32_t* q,
                                     float* scale, int* sum) {
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < chunks;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v[32];
    const float4* src = reinterpret_cast<const float4*>(x + c * 32);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float4 f = __ldg(src + i);
      v[4 * i] = f.x, v[4 * i + 1] = f.y, v[4 * i + 2] = f.z, v[4 * i + 3] = f.w;
    }
    int32_t w[8];
    QuantizeChunk(v, w, scale + c, sum + c);
    int4* o = reinterpret_cast<int4*>(q + c * 8);
    o[0] = make_int4(w[0], w[1], w[2], w[3]);
    o[1] = make_int4(w[4], w[5], w[6], w[7]);
  }
}

template <DType D, int M>
__global__ void __launch_bounds__(kQuantWarps * 32)
    QuantGemvDp4aKernel(GemvGroup g, int64_t cols, const int32_t* __restrict__ qx,
                        const float* __restrict__ x_scale, const int* __restrict__ x_sum) {
  int i;
  int64_t row;
  if (!GroupRow(g, blockIdx.x * kQuantWarps + threadIdx.x / 32, &i, &row)) return;
  const uint8_t* w = static_cast<const uint8_t*>(g.w[i]) + row * BytesOf<D>(g.stride[i]);
  const int64_t chunks = cols / 32;
  constexpr int64_t per_block = Layout<D>::kBlock / 32;
  float acc[M] = {};
  for (int64_t c = threadIdx.x % 32; c < chunks; c += 32) {
    IntChunk wc;
    IntBlocks<D>::Chunk(w + BytesOf<D>(c / per_block * Layout<D>::kBlock),
                        static_cast<int>(c % per_block), wc);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const int4* xv = reinterpret_cast<const int4*>(qx + (m * chunks + c) * 8);
      const int4 a = __ldg(xv), b = __ldg(xv + 1);
      const int32_t xq[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      acc[m] += ChunkDot(wc, xq, __ldg(x_scale + m * chunks + c), __ldg(x_sum + m * chunks + c));
    }
  }
  WriteWarpSums(acc, g.y[i], g.rows[i], row);
}

// Rows [r0, r0 + n) of a quantized matrix expanded into BF16 [n][cols]: a thread per chunk.
template <DType D>
__global__ void ExpandKernel(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t n,
                             int64_t cols, __nv_bfloat16* out) {
  const int64_t chunks = cols / 32;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < n * chunks;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = t / chunks, c = t % chunks;
    constexpr int64_t per_block = Layout<D>::kBlock / 32;  // chunks per block
    float v[32];
    Blocks<D>::Chunk(w + (r0 + r) * row_bytes + BytesOf<D>(c / per_block * Layout<D>::kBlock),
                     static_cast<int>(c % per_block), v);
    uint4* o = reinterpret_cast<uint4*>(out + r * cols + c * 32);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t p[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(v[8 * i + 2 * k], v[8 * i + 2 * k + 1]);
        p[k] = *reinterpret_cast<const uint32_t*>(&h);
      }
      o[i] = make_uint4(p[0], p[1], p[2], p[3]);
    }
  }
}

// Vocab-parallel embedding from a quantized table: a block per id, a thread per chunk.
template <DType D>
__global__ void EmbedKernel(const uint8_t* table, int64_t row_bytes, int64_t cols,
                            const int32_t* ids, int64_t vocab_begin, int64_t vocab_end,
                            float* out) {
  const int64_t i = blockIdx.x;
  const int32_t id = ids[i];
  const bool mine = id >= vocab_begin && id < vocab_end;
  const uint8_t* row = table + (mine ? (id - vocab_begin) * row_bytes : 0);
  constexpr int64_t per_block = Layout<D>::kBlock / 32;
  for (int64_t c = threadIdx.x; c < cols / 32; c += blockDim.x) {
    float v[32];
    if (mine) {
      Blocks<D>::Chunk(row + BytesOf<D>(c / per_block * Layout<D>::kBlock),
                       static_cast<int>(c % per_block), v);
    } else {
#pragma unroll
      for (int k = 0; k < 32; ++k) v[k] = 0.f;
    }
    float4* o = reinterpret_cast<float4*>(out + i * cols + c * 32);
#pragma unroll
    for (int k = 0; k < 8; ++k)
      o[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
  }
}

// FP8 decode, direct (SHARDSERVE_CUDA_FP8_GEMV, the default): one warp per output row, as
// QuantGemvKernel, walking the row's F8_128 blocks (an F32 scale and 128 E4M3 bytes, 132 bytes,
// 4-byte aligned): lane l reads the block's bytes 4l .. 4l + 3 (the warp's 32 loads one 128-byte
// line) and the matching 4 inputs of each row of x, each value one rounding of byte x scale as
// Blocks<kF8_128>::Chunk gives. cols: a multiple of 128.
//
// Software-pipelined in groups of kFp8InFlight blocks: a group's weights are loaded before the
// group before it is summed, so that each lane has that group's loads in flight while it computes
// (one load at a time left 61 % of the warps' stalls waiting on L1TEX and the kernel at 54 % of
// copy bandwidth on an H200). The sums are taken in the order of the blocks, as before. Only for
// one row of x (batch 1, where it was measured: 1.02-1.03x a decode step on an H200): with more,
// each lane already has a load of x a row in flight beside the weights', and the pipelined kernel
// was not measured there (it took 64, 63 and 72 registers at 2, 4 and 8 rows); they compile to
// the loop as it was (the same instructions, 33, 40 and 80 registers, no stack).
constexpr int kFp8InFlight = 8;

template <int M>
__global__ void __launch_bounds__(kQuantWarps * 32)
    Fp8GemvKernel(GemvGroup g, int64_t cols, const float* __restrict__ x) {
  int i;
  int64_t row;
  if (!GroupRow(g, blockIdx.x * kQuantWarps + threadIdx.x / 32, &i, &row)) return;
  const uint8_t* w =
      static_cast<const uint8_t*>(g.w[i]) + row * BytesOf<DType::kF8_128>(g.stride[i]);
  const int lane = threadIdx.x % 32;
  const int64_t blocks = cols / 128;
  float acc[M] = {};
  // Block b's products, from the lane's 4 bytes u of it and its scale times 256.
  const auto dot = [&](int64_t b, uint32_t u, float s) {
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = F8AsHalfTimes256th(u >> (8 * e)) * s;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(x + m * cols + b * 128) + lane);
      acc[m] += v[0] * a.x + v[1] * a.y + v[2] * a.z + v[3] * a.w;
    }
  };
  int64_t b = 0;
  if constexpr (M == 1) {
    uint32_t u[kFp8InFlight];
    float s[kFp8InFlight];
    const auto load = [&](int64_t b0) {
#pragma unroll
      for (int j = 0; j < kFp8InFlight; ++j) {
        const uint8_t* block = w + (b0 + j) * 132;
        s[j] = __ldg(reinterpret_cast<const float*>(block));
        u[j] = __ldg(reinterpret_cast<const uint32_t*>(block + 4) + lane);
      }
    };
    if (blocks >= kFp8InFlight) load(0);
    for (; b + kFp8InFlight <= blocks; b += kFp8InFlight) {
      uint32_t cu[kFp8InFlight];
      float cs[kFp8InFlight];
#pragma unroll
      for (int j = 0; j < kFp8InFlight; ++j) cu[j] = u[j], cs[j] = s[j];
      if (b + 2 * kFp8InFlight <= blocks) load(b + kFp8InFlight);
#pragma unroll
      for (int j = 0; j < kFp8InFlight; ++j) dot(b + j, cu[j], cs[j] * 256.f);
    }
  }
#pragma unroll 4
  for (; b < blocks; ++b) {
    const uint8_t* block = w + b * 132;
    const float s = __ldg(reinterpret_cast<const float*>(block)) * 256.f;
    const uint32_t u = __ldg(reinterpret_cast<const uint32_t*>(block + 4) + lane);
    dot(b, u, s);
  }
  WriteWarpSums(acc, g.y[i], g.rows[i], row);
}

// Grid (row blocks, slots); one warp per output row of the slot's expert (gemm.cu's
// ExpertMatVecKernel for quantized experts).
template <DType D>
__global__ void __launch_bounds__(kQuantWarps * 32, 6)
    ExpertKernel(const uint8_t* const* w, int64_t expert_begin, int64_t count, int64_t rows,
                 int64_t cols, const int32_t* experts, const float* x, int64_t x_div, float* y) {
  __shared__ WarpStages<D> stage[kQuantWarps];
  const int64_t slot = blockIdx.y;
  const int64_t row = blockIdx.x * kQuantWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int64_t e = experts[slot] - expert_begin;
  float acc[1] = {0.f};
  if (e >= 0 && e < count) {
    RowDot<D, 1>(w[e] + row * BytesOf<D>(cols), cols, x + (slot / x_div) * cols, cols,
                 stage[threadIdx.x / 32], acc);
    for (int off = 16; off > 0; off /= 2) acc[0] += __shfl_down_sync(0xffffffff, acc[0], off);
  }
  if (threadIdx.x % 32 == 0) y[slot * rows + row] = acc[0];
}

// Calls f with the quantized dtype as a compile-time constant; an error for any other.
template <typename F>
absl::Status ForQuantized(DType dtype, const char* what, F f) {
  switch (dtype) {
    case DType::kQ8_0:
      f(std::integral_constant<DType, DType::kQ8_0>{});
      break;
    case DType::kQ4_0:
      f(std::integral_constant<DType, DType::kQ4_0>{});
      break;
    case DType::kQ4_1:
      f(std::integral_constant<DType, DType::kQ4_1>{});
      break;
    case DType::kQ4_K:
      f(std::integral_constant<DType, DType::kQ4_K>{});
      break;
    case DType::kQ5_K:
      f(std::integral_constant<DType, DType::kQ5_K>{});
      break;
    case DType::kQ6_K:
      f(std::integral_constant<DType, DType::kQ6_K>{});
      break;
    case DType::kF8_128:
      f(std::integral_constant<DType, DType::kF8_128>{});
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": no CUDA kernel for ", DTypeName(dtype), " weights"));
  }
  return Check(cudaGetLastError(), what);
}

}  // namespace

bool RunsQuantized(DType dtype) {
  switch (dtype) {
    case DType::kQ8_0:
    case DType::kQ4_0:
    case DType::kQ4_1:
    case DType::kQ4_K:
    case DType::kQ5_K:
    case DType::kQ6_K:
    case DType::kF8_128:
      return true;
    default:
      return false;
  }
}

absl::StatusOr<QuantGemvMode> QuantGemvNamed(std::string_view name) {
  if (name.empty() || name == "dp4a") return QuantGemvMode::kDp4a;
  if (name == "float") return QuantGemvMode::kFloat;
  return absl::InvalidArgumentError(absl::StrCat(
      "'", std::string(name),
      "' must be dp4a (int8 inputs, integer products, the default) or float (the blocks "
      "expanded to F32)"));
}

absl::StatusOr<Fp8GemvMode> Fp8GemvNamed(std::string_view name) {
  if (name.empty() || name == "direct") return Fp8GemvMode::kDirect;
  if (name == "staged") return Fp8GemvMode::kStaged;
  return absl::InvalidArgumentError(absl::StrCat(
      "'", std::string(name),
      "' must be direct (each block read straight by the warp, the default) or staged (chunks "
      "through shared memory)"));
}

absl::Status QuantGemvGroup(Context& ctx, const GemvGroup& g, DType dtype, int64_t cols,
                            const float* x, int64_t M) {
  const unsigned blocks = static_cast<unsigned>((g.end[g.n - 1] + kQuantWarps - 1) / kQuantWarps);
  if (dtype == DType::kF8_128 && ctx.kernels().fp8_gemv == Fp8GemvMode::kDirect &&
      cols % 128 == 0) {
    GemvRounds(g, cols, x, M, [&](auto rows, const GemvGroup& round, const float* xr) {
      Fp8GemvKernel<decltype(rows)::value><<<blocks, kQuantWarps * 32>>>(round, cols, xr);
    });
    return Check(cudaGetLastError(), "FP8 GEMV launch");
  }
  if (ctx.kernels().quant_gemv == QuantGemvMode::kDp4a && dtype != DType::kF8_128) {
    const int64_t chunks = M * cols / 32;
    ASSIGN_OR_RETURN(void* scratch, ctx.Scratch(static_cast<size_t>(chunks) * (32 + 8)));
    auto* q = static_cast<int32_t*>(scratch);
    auto* scale = reinterpret_cast<float*>(q + chunks * 8);
    auto* sum = reinterpret_cast<int*>(scale + chunks);
    QuantizeInputsKernel<<<Grid(chunks), 256>>>(x, chunks, q, scale, sum);
    RETURN_IF_ERROR(Check(cudaGetLastError(), "input quantization launch"));
    return ForQuantized(dtype, "dp4a GEMV launch", [&](auto d) {
      constexpr DType kD = decltype(d)::value;
      if constexpr (HasIntBlocks(kD)) {
        GemvRounds(g, cols, x, M, [&](auto rows, const GemvGroup& round, const float* xr) {
          const int64_t c0 = (xr - x) / 32;  // the round's first chunk
          QuantGemvDp4aKernel<kD, decltype(rows)::value>
              <<<blocks, kQuantWarps * 32>>>(round, cols, q + c0 * 8, scale + c0, sum + c0);
        });
      }
    });
  }
  return ForQuantized(dtype, "quantized GEMV launch", [&](auto d) {
    GemvRounds(g, cols, x, M, [&](auto rows, const GemvGroup& round, const float* xr) {
      QuantGemvKernel<decltype(d)::value, decltype(rows)::value>
          <<<blocks, kQuantWarps * 32>>>(round, cols, xr);
    });
  });
}

absl::Status ExpandRows(const WeightMatrix& w, int64_t r0, int64_t n, void* out) {
  if (n == 0) return absl::OkStatus();
  const int64_t row_bytes = static_cast<int64_t>(DTypeBytes(w.dtype, w.row_stride));
  return ForQuantized(w.dtype, "quantized expansion launch", [&](auto d) {
    ExpandKernel<decltype(d)::value>
        <<<Grid(n * (w.cols / 32)), 256>>>(static_cast<const uint8_t*>(w.data), row_bytes, r0, n,
                                           w.cols, static_cast<__nv_bfloat16*>(out));
  });
}

absl::Status QuantEmbed(const WeightMatrix& table, const int32_t* ids, int64_t n,
                        int64_t vocab_begin, int64_t vocab_end, float* out) {
  const int64_t row_bytes = static_cast<int64_t>(DTypeBytes(table.dtype, table.row_stride));
  return ForQuantized(table.dtype, "quantized Embed launch", [&](auto d) {
    EmbedKernel<decltype(d)::value>
        <<<static_cast<unsigned>(n), 128>>>(static_cast<const uint8_t*>(table.data), row_bytes,
                                            table.cols, ids, vocab_begin, vocab_end, out);
  });
}

absl::Status QuantExpertMatVec(const ExpertTable& w, const int32_t* experts, int64_t slots,
                               const float* x, int64_t x_div, float* y) {
  const dim3 grid(static_cast<unsigned>((w.rows + kQuantWarps - 1) / kQuantWarps),
                  static_cast<unsigned>(slots));
  return ForQuantized(w.dtype, "quantized ExpertMatVec launch", [&](auto d) {
    ExpertKernel<decltype(d)::value>
        <<<grid, kQuantWarps * 32>>>(reinterpret_cast<const uint8_t* const*>(w.data),
                                     w.expert_begin, w.count, w.rows, w.cols, experts, x, x_div, y);
  });
}

}  // namespace shardserve::cuda
