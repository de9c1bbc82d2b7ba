#pragma once
// What the CUDA backend's translation units share (memory.cu, gemm.cu, elementwise.cu,
// attention.cu, sampling.cu): error checks, dtype conversions on the device, block reductions,
// the sampler's candidate order, launch geometry and the context's state. Internal to
// backend/cuda.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "backend/cuda/cuda_backend.h"
#include "common/status.h"

namespace shardserve::cuda {
namespace {

absl::Status Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

#define RETURN_IF_CUDA(expr, what)                                  \
  do {                                                              \
    if (absl::Status s_ = Check((expr), what); !s_.ok()) return s_; \
  } while (0)

template <typename T>
__device__ float ToF32(T v);
template <>
__device__ float ToF32(float v) {
  return v;
}
template <>
__device__ float ToF32(__half v) {
  return __half2float(v);
}
template <>
__device__ float ToF32(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ T FromF32(float v);
template <>
__device__ __half FromF32(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __nv_bfloat16 FromF32(float v) {
  return __float2bfloat16_rn(v);
}

struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
template <typename T>
struct SumOp {
  __device__ T operator()(T a, T b) const { return a + b; }
};
struct MinOp {
  __device__ long long operator()(long long a, long long b) const { return a < b ? a : b; }
};

// A reduction over the block (blockDim.x a multiple of 32); every thread gets the result.
// `shared` holds 32 values of T.
template <typename T, typename Op>
__device__ T BlockReduce(T v, Op op, T identity, T* shared) {
  for (int off = 16; off > 0; off /= 2) v = op(v, __shfl_down_sync(0xffffffff, v, off));
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < blockDim.x / 32 ? shared[threadIdx.x] : identity;
    for (int off = 16; off > 0; off /= 2) v = op(v, __shfl_down_sync(0xffffffff, v, off));
    if (threadIdx.x == 0) shared[0] = v;
  }
  __syncthreads();
  const T out = shared[0];
  __syncthreads();
  return out;
}

// A logit and its id, ordered as the CPU sampler orders them: larger first, ties to the lower id.
struct Cand {
  float v;
  int32_t i;
};
__device__ __forceinline__ bool Before(float av, int64_t ai, float bv, int64_t bi) {
  return av > bv || (av == bv && ai < bi);
}

// The first of the threads' candidates in that order; every thread gets it. `shared` holds 32.
__device__ Cand BlockBest(Cand b, Cand* shared) {
  for (int off = 16; off > 0; off /= 2) {
    const float ov = __shfl_down_sync(0xffffffff, b.v, off);
    const int32_t oi = __shfl_down_sync(0xffffffff, b.i, off);
    if (Before(ov, oi, b.v, b.i)) b = {ov, oi};
  }
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = b;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) {
      if (Before(shared[w].v, shared[w].i, shared[0].v, shared[0].i)) shared[0] = shared[w];
    }
  }
  __syncthreads();
  const Cand out = shared[0];
  __syncthreads();
  return out;
}

// The first of row[0..n) in that order among those after `prev`; i == INT32_MAX if none.
// `shared` holds 32 candidates.
__device__ Cand BlockBestAfter(const float* row, int64_t n, Cand prev, Cand* shared) {
  Cand b{-INFINITY, INT32_MAX};
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = row[i];
    if (Before(prev.v, prev.i, v, i) && Before(v, i, b.v, b.i)) b = {v, static_cast<int32_t>(i)};
  }
  return BlockBest(b, shared);
}

// The warp's sums of acc[m], written by its lane 0 to y[m * rows + row].
template <int M>
__device__ __forceinline__ void WriteWarpSums(const float (&acc)[M], float* y, int64_t rows,
                                              int64_t row) {
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float s = acc[m];
    for (int off = 16; off > 0; off /= 2) s += __shfl_down_sync(0xffffffff, s, off);
    if (threadIdx.x % 32 == 0) y[m * rows + row] = s;
  }
}

unsigned Grid(int64_t n, int threads = 256) {
  return static_cast<unsigned>(std::min<int64_t>((n + threads - 1) / threads, 65535));
}

}  // namespace

// Up to kGemvMaxGroup matrices with the same cols that read the same x (a layer's q, k and v;
// gate and up), as one launch: output rows are numbered across the matrices, matrix i's rows
// ending at end[i] (strides in values).
constexpr int kGemvMaxGroup = 4;
struct GemvGroup {
  const void* w[kGemvMaxGroup];
  int64_t stride[kGemvMaxGroup];
  int64_t rows[kGemvMaxGroup];
  int64_t end[kGemvMaxGroup];
  float* y[kGemvMaxGroup];
  int n = 0;
};
constexpr int64_t kGemvMaxRows = 8;  // above this, cuBLAS's tensor-core GEMM

namespace {
// A group's output row `global_row`: its matrix `i` and the row in it; false past the end.
__device__ __forceinline__ bool GroupRow(const GemvGroup& g, int64_t global_row, int* i,
                                         int64_t* row) {
  if (global_row >= g.end[g.n - 1]) return false;
  *i = 0;
  while (global_row >= g.end[*i]) ++*i;
  *row = global_row - (*i == 0 ? 0 : g.end[*i - 1]);
  return true;
}

// Runs `launch(std::integral_constant<int, M>, group, x)` for the m rows of x in rounds: each
// a power of two M up to kGemvMaxRows (the kernels' row count is a template argument), the
// group's outputs moved past the rows done.
template <int M = kGemvMaxRows, typename Launch>
void GemvRounds(GemvGroup g, int64_t cols, const float* x, int64_t m, Launch launch) {
  if constexpr (M > 1) {
    if (m < M) return GemvRounds<M / 2>(g, cols, x, m, launch);
  }
  launch(std::integral_constant<int, M>{}, g, x);
  if (m > M) {
    for (int i = 0; i < g.n; ++i) g.y[i] += M * g.rows[i];
    GemvRounds<kGemvMaxRows>(g, cols, x + M * cols, m - M, launch);
  }
}
}  // namespace

// Block-quantized weights (quant.cu; RunsQuantized in cuda_backend.h says which).
// The decode product of a group of quantized matrices of one dtype (M <= kGemvMaxRows rows of x
// at a time; more run in rounds), cols a multiple of the block.
absl::Status QuantGemvGroup(Context& ctx, const GemvGroup& g, DType dtype, int64_t cols,
                            const float* x, int64_t M);
// Rows [r0, r0 + n) of quantized w expanded into BF16, [n][w.cols] at `out` (prefill's tiles).
absl::Status ExpandRows(const WeightMatrix& w, int64_t r0, int64_t n, void* out);
// Embed and ExpertMatVec (cuda_backend.h) of quantized tables and experts.
absl::Status QuantEmbed(const WeightMatrix& table, const int32_t* ids, int64_t n,
                        int64_t vocab_begin, int64_t vocab_end, float* out);
absl::Status QuantExpertMatVec(const ExpertTable& w, const int32_t* experts, int64_t slots,
                               const float* x, int64_t x_div, float* y);

struct Context::Impl {
  int device = 0;
  cublasHandle_t blas = nullptr;
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
  KernelChoice kernels;
};

}  // namespace shardserve::cuda
