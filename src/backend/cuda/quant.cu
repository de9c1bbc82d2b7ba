// The CUDA backend: block-quantized weights as GGUF files store them (Q8_0, Q4_0, Q4_1, Q4_K,
// Q5_K, Q6_K in ggml's layouts, kept on the device as the file has them). Decode reads the blocks
// (no expanded copy of a weight): a warp per output row loads 32 chunks of 32 values of its row at
// a time with coalesced 4-byte loads, all in flight at once, stages them in shared memory, then
// each lane expands one chunk and multiplies it with up to 8 F32 inputs. Prefill expands tiles of
// rows into BF16 for cuBLAS (gemm.cu).
#include <type_traits>

#include "backend/cuda/common.cuh"
#include "backend/cuda/quant_blocks.cuh"

namespace shardserve::cuda {
namespace {

constexpr int kQuantWarps = 8;  // output rows per block
// A warp's round: 32 chunks of 32 values, staged whole (plus up to 3 bytes before a 2-byte
// aligned start), in 16-byte units so that every warp's stage stays 16-byte aligned.
template <DType D>
constexpr int kStageWords = static_cast<int>((BytesOf<D>(1024) + 3 + 15) / 16 * 4);

// Loads the words of the round of 32 chunks from chunk c0 of a row into registers, all at once:
// lane l holds words l, l + 32, ... from the 4-byte boundary at or before the round's first
// byte, `shift` bytes before it; `nwords` of them are the round's.
template <DType D, int kPerLane>
__device__ __forceinline__ void FetchRound(const uint8_t* row, int64_t c0, int64_t chunks, int lane,
                                           uint32_t (&r)[kPerLane], int* shift, int* nwords) {
  const int n = chunks - c0 < 32 ? static_cast<int>(chunks - c0) : 32;
  const uintptr_t start = reinterpret_cast<uintptr_t>(row + BytesOf<D>(c0 * 32));
  *shift = static_cast<int>(start % 4);
  const uint32_t* words = reinterpret_cast<const uint32_t*>(start - *shift);
  *nwords = static_cast<int>((*shift + BytesOf<D>(n * 32) + 3) / 4);
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int i = lane + 32 * k;
    r[k] = i < *nwords ? __ldg(words + i) : 0u;
  }
}

// acc[m] += row . x[m] for m < M (x rows of `cols` floats at stride ldx), the row's `cols`
// values (a multiple of 32) read once: each round's bytes come into registers with one memory
// latency (the next round's while this one is expanded), then through the warp's stage in
// shared memory to the lanes that expand them.
template <DType D, int M>
__device__ void RowDot(const uint8_t* row, int64_t cols, const float* __restrict__ x, int64_t ldx,
                       uint32_t* stage, float (&acc)[M]) {
  constexpr int kPerLane = (kStageWords<D> + 31) / 32;
  const int lane = threadIdx.x % 32;
  const int64_t chunks = cols / 32;
  uint32_t r[kPerLane];
  int shift = 0, nwords = 0;
  FetchRound<D, kPerLane>(row, 0, chunks, lane, r, &shift, &nwords);
  for (int64_t c0 = 0; c0 < chunks; c0 += 32) {
    const int n = chunks - c0 < 32 ? static_cast<int>(chunks - c0) : 32;
    const int at = shift;
    __syncwarp();
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      if (lane + 32 * k < nwords) stage[lane + 32 * k] = r[k];
    }
    __syncwarp();
    if (c0 + 32 < chunks) FetchRound<D, kPerLane>(row, c0 + 32, chunks, lane, r, &shift, &nwords);
    if (lane < n) {
      float v[32];
      Blocks<D>::Chunk(reinterpret_cast<const uint8_t*>(stage) + at, lane, v);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float4* xv = reinterpret_cast<const float4*>(x + m * ldx + (c0 + lane) * 32);
        float s = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float4 a = __ldg(xv + i);
          s += v[4 * i] * a.x + v[4 * i + 1] * a.y + v[4 * i + 2] * a.z + v[4 * i + 3] * a.w;
        }
        acc[m] += s;
      }
    }
  }
}

// Decode: as gemm.cu's GemvKernel, one warp per output row numbered across the group's matrices.
template <DType D, int M>
__global__ void __launch_bounds__(kQuantWarps * 32)
    QuantGemvKernel(GemvGroup g, int64_t cols, const float* __restrict__ x) {
  __shared__ __align__(16) uint32_t stage[kQuantWarps][kStageWords<D>];
  int i;
  int64_t row;
  if (!GroupRow(g, blockIdx.x * kQuantWarps + threadIdx.x / 32, &i, &row)) return;
  const uint8_t* w = static_cast<const uint8_t*>(g.w[i]) + row * BytesOf<D>(g.stride[i]);
  float acc[M] = {};
  RowDot<D, M>(w, cols, x, cols, stage[threadIdx.x / 32], acc);
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

// Grid (row blocks, slots); one warp per output row of the slot's expert (gemm.cu's
// ExpertMatVecKernel for quantized experts).
template <DType D>
__global__ void __launch_bounds__(kQuantWarps * 32)
    ExpertKernel(const uint8_t* const* w, int64_t expert_begin, int64_t count, int64_t rows,
                 int64_t cols, const int32_t* experts, const float* x, int64_t x_div, float* y) {
  __shared__ __align__(16) uint32_t stage[kQuantWarps][kStageWords<D>];
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
      return true;
    default:
      return false;
  }
}

absl::Status QuantGemvGroup(const GemvGroup& g, DType dtype, int64_t cols, const float* x,
                            int64_t M) {
  const unsigned blocks = static_cast<unsigned>((g.end[g.n - 1] + kQuantWarps - 1) / kQuantWarps);
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
