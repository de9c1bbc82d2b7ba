// The CUDA backend: matrix products (a warp-per-row GEMV up to 8 rows, cuBLAS above), and the
// mixture-of-experts routing and expert products.
#include "backend/cuda/common.cuh"

namespace shardserve::cuda {
namespace {

// Sixteen bytes of weights as floats.
__device__ void Unpack(uint4 raw, float (&out)[4]) {
  out[0] = __uint_as_float(raw.x);
  out[1] = __uint_as_float(raw.y);
  out[2] = __uint_as_float(raw.z);
  out[3] = __uint_as_float(raw.w);
}
__device__ void Unpack(uint4 raw, float (&out)[8], __nv_bfloat16) {
  const uint32_t u[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(u[i] << 16);
    out[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
}
__device__ void Unpack(uint4 raw, float (&out)[8], __half) {
  const uint32_t u[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&u[i]));
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// Small batches (decode): Y[M][rows] = X[M][cols] W^T with one warp per output row, the row read
// once in 16-byte pieces for all M inputs, X kept in F32 (so no conversion pass, and the
// precision of the CPU's product). Needs cols and stride to be multiples of a piece and W and X
// 16-byte aligned (GemvFits).
template <typename T, int M>
__global__ void GemvKernel(GemvGroup g, int64_t cols, const float* __restrict__ x) {
  constexpr int kVec = 16 / sizeof(T);
  int i;
  int64_t row;
  if (!GroupRow(g, blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, &i, &row)) return;
  const int lane = threadIdx.x % 32;
  const uint4* wr =
      reinterpret_cast<const uint4*>(static_cast<const T*>(g.w[i]) + row * g.stride[i]);
  const int64_t pieces = cols / kVec;
  float acc[M] = {};
#pragma unroll 4
  for (int64_t p = lane; p < pieces; p += 32) {
    float wf[kVec];
    if constexpr (sizeof(T) == 4) {
      Unpack(__ldg(wr + p), wf);
    } else {
      Unpack(__ldg(wr + p), wf, T{});
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float4* xv = reinterpret_cast<const float4*>(x + m * cols + p * kVec);
#pragma unroll
      for (int j = 0; j < kVec / 4; ++j) {
        const float4 v = __ldg(xv + j);
        acc[m] += wf[4 * j] * v.x + wf[4 * j + 1] * v.y + wf[4 * j + 2] * v.z + wf[4 * j + 3] * v.w;
      }
    }
  }
  WriteWarpSums(acc, g.y[i], g.rows[i], row);
}

constexpr int kGemvWarps = 8;

bool GemvFits(const WeightMatrix& w, const float* x, int64_t M) {
  if (M > kGemvMaxRows || reinterpret_cast<uintptr_t>(x) % 16 != 0) return false;
  if (IsQuantized(w.dtype)) return RunsQuantized(w.dtype);  // whole blocks, as Upload keeps them
  const int64_t piece = 16 / static_cast<int64_t>(DTypeSize(w.dtype));
  return w.cols % piece == 0 && w.row_stride % piece == 0 &&
         reinterpret_cast<uintptr_t>(w.data) % 16 == 0;
}

template <typename T>
void LaunchGemv(const GemvGroup& g, int64_t cols, const float* x, int64_t m) {
  const unsigned blocks = static_cast<unsigned>((g.end[g.n - 1] + kGemvWarps - 1) / kGemvWarps);
  GemvRounds(g, cols, x, m, [&](auto rows, const GemvGroup& round, const float* xr) {
    GemvKernel<T, decltype(rows)::value><<<blocks, kGemvWarps * 32>>>(round, cols, xr);
  });
}

absl::Status LaunchGemvGroup(Context& ctx, const GemvGroup& g, DType dtype, int64_t cols,
                             const float* x, int64_t M) {
  switch (dtype) {
    case DType::kF32:
      LaunchGemv<float>(g, cols, x, M);
      break;
    case DType::kF16:
      LaunchGemv<__half>(g, cols, x, M);
      break;
    case DType::kBF16:
      LaunchGemv<__nv_bfloat16>(g, cols, x, M);
      break;
    default:
      return QuantGemvGroup(ctx, g, dtype, cols, x, M);
  }
  return Check(cudaGetLastError(), "Gemv launch");
}

template <typename T>
__global__ void ConvertKernel(const float* x, int64_t n, T* out) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = FromF32<T>(x[i]);
  }
}

// One thread per row: k rounds of "the best expert after the previous pick", then the softmax
// of the k logits (float, as the host).
__global__ void RouteKernel(const float* logits, int64_t rows, int64_t E, int64_t k, bool normalize,
                            int32_t* experts, float* weights) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  const float* l = logits + r * E;
  float pv = INFINITY;
  int64_t pi = -1;
  for (int64_t j = 0; j < k; ++j) {
    float bv = -INFINITY;
    int64_t bi = E;
    for (int64_t e = 0; e < E; ++e) {
      if (Before(pv, pi, l[e], e) && Before(l[e], e, bv, bi)) {
        bv = l[e];
        bi = e;
      }
    }
    experts[r * k + j] = static_cast<int32_t>(bi);
    weights[r * k + j] = bv;
    pv = bv;
    pi = bi;
  }
  const float mx = weights[r * k];  // the best of all E
  float sum = 0;
  if (normalize) {
    for (int64_t j = 0; j < k; ++j) sum += expf(weights[r * k + j] - mx);
  } else {
    for (int64_t e = 0; e < E; ++e) sum += expf(l[e] - mx);
  }
  for (int64_t j = 0; j < k; ++j) weights[r * k + j] = expf(weights[r * k + j] - mx) / sum;
}

// Grid (row blocks, slots); one warp per output row of the slot's expert.
template <typename T>
__global__ void ExpertMatVecKernel(const T* const* w, int64_t expert_begin, int64_t count,
                                   int64_t rows, int64_t cols, const int32_t* experts,
                                   const float* x, int64_t x_div, float* y) {
  const int64_t slot = blockIdx.y;
  const int64_t row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int64_t e = experts[slot] - expert_begin;
  float s = 0;
  if (e >= 0 && e < count) {
    const T* wr = w[e] + row * cols;
    const float* xs = x + (slot / x_div) * cols;
    for (int64_t c = threadIdx.x % 32; c < cols; c += 32) s += ToF32(wr[c]) * xs[c];
    for (int off = 16; off > 0; off /= 2) s += __shfl_down_sync(0xffffffff, s, off);
  }
  if (threadIdx.x % 32 == 0) y[slot * rows + row] = s;
}

// Backend::RouteGrouped, one thread per row, without scratch: the groups' scores (the sum of
// each group's two best), topk_groups rounds of "the best group after the previous pick" into a
// mask, then k rounds of "the best expert after the previous pick" inside the mask; in float as
// the host computes it.
__device__ __forceinline__ float ChoiceOf(const float* l, const float* bias, int64_t e) {
  return 1.f / (1.f + expf(-l[e])) + bias[e];
}

__global__ void RouteGroupedKernel(const float* logits, const float* bias, int64_t rows, int64_t E,
                                   int64_t k, int64_t groups, int64_t topk_groups, bool normalize,
                                   float scaling, int32_t* experts, float* weights) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  const float* l = logits + r * E;
  const int64_t per = E / groups;
  uint64_t kept = groups > 1 ? 0 : ~uint64_t{0};
  if (groups > 1) {
    float pv = INFINITY;
    int64_t pi = -1;
    for (int64_t j = 0; j < topk_groups; ++j) {
      float bv = -INFINITY;
      int64_t bi = groups;
      for (int64_t g = 0; g < groups; ++g) {
        float m0 = -INFINITY, m1 = -INFINITY;
        for (int64_t e = g * per; e < (g + 1) * per; ++e) {
          const float c = ChoiceOf(l, bias, e);
          if (c > m0) {
            m1 = m0;
            m0 = c;
          } else if (c > m1) {
            m1 = c;
          }
        }
        const float v = m0 + m1;
        if (Before(pv, pi, v, g) && Before(v, g, bv, bi)) {
          bv = v;
          bi = g;
        }
      }
      kept |= uint64_t{1} << bi;
      pv = bv;
      pi = bi;
    }
  }
  float pv = INFINITY, sum = 0;
  int64_t pi = -1;
  for (int64_t j = 0; j < k; ++j) {
    float bv = -INFINITY;
    int64_t bi = E;
    for (int64_t e = 0; e < E; ++e) {
      if (!((kept >> (e / per)) & 1)) continue;
      const float c = ChoiceOf(l, bias, e);
      if (Before(pv, pi, c, e) && Before(c, e, bv, bi)) {
        bv = c;
        bi = e;
      }
    }
    const float score = 1.f / (1.f + expf(-l[bi]));
    experts[r * k + j] = static_cast<int32_t>(bi);
    weights[r * k + j] = score;
    sum += score;
    pv = bv;
    pi = bi;
  }
  for (int64_t j = 0; j < k; ++j) {
    const float w = weights[r * k + j];
    weights[r * k + j] = (normalize ? w / (sum + 1e-20f) : w) * scaling;
  }
}

// Grid (rows, heads, output-row blocks); one warp per output n of head h.
template <typename T>
__global__ void HeadGemmKernel(const T* w, int64_t row_stride, int64_t N, int64_t K, const float* x,
                               int64_t ldx, int64_t x_head, float* y, int64_t ldy, int64_t y_head) {
  const int64_t r = blockIdx.x, h = blockIdx.y;
  const int64_t n = static_cast<int64_t>(blockIdx.z) * (blockDim.x / 32) + threadIdx.x / 32;
  if (n >= N) return;
  const T* wr = w + (h * N + n) * row_stride;
  const float* xs = x + r * ldx + h * x_head;
  float s = 0;
  for (int64_t c = threadIdx.x % 32; c < K; c += 32) s += ToF32(wr[c]) * xs[c];
  for (int off = 16; off > 0; off /= 2) s += __shfl_down_sync(0xffffffff, s, off);
  if (threadIdx.x % 32 == 0) y[r * ldy + h * y_head + n] = s;
}

__global__ void CombineSlotsKernel(const float* x, const float* weights, int64_t k, int64_t dim,
                                   float* y) {
  const int64_t r = blockIdx.x;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    float acc = 0;
    for (int64_t j = 0; j < k; ++j) acc += weights[r * k + j] * x[(r * k + j) * dim + d];
    y[r * dim + d] = acc;
  }
}

// LoRA's gathered product (Backend::LoraAdd), Punica's BGMV in two kernels: shrink, a warp per
// (row, j < max_rank): u[r][j] = scale * A_s[j] . x[r]; expand, a thread per (row, output n):
// y[r][n] += sum_j bt_s[j][n] u[r][j] (neighbouring threads read neighbouring columns). A row
// without an adapter (or past its slot's rank) does nothing.
__device__ __forceinline__ int64_t LoraRank(const LoraTable& t, const int32_t* row_slot,
                                            int64_t r) {
  const int32_t s = row_slot[r];
  return s >= 0 && s < t.slots ? t.rank[s] : 0;
}

__global__ void LoraShrinkKernel(LoraTable t, const int32_t* row_slot, int64_t rows, const float* x,
                                 float* u) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (item >= rows * t.max_rank) return;
  const int64_t r = item / t.max_rank, j = item % t.max_rank;
  if (j >= LoraRank(t, row_slot, r)) return;
  const int32_t s = row_slot[r];
  const float* a = t.a[s] + j * t.in;
  const float* xr = x + r * t.in;
  float acc = 0;
  for (int64_t k = threadIdx.x % 32; k < t.in; k += 32) acc += a[k] * xr[k];
  for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffff, acc, off);
  if (threadIdx.x % 32 == 0) u[item] = t.scale[s] * acc;
}

__global__ void LoraExpandKernel(LoraTable t, const int32_t* row_slot, const float* u, float* y) {
  const int64_t r = blockIdx.y;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t rank = LoraRank(t, row_slot, r);
  if (n >= t.out || rank == 0) return;
  const float* bt = t.bt[row_slot[r]] + n;
  const float* ur = u + r * t.max_rank;
  float acc = 0;
  for (int64_t j = 0; j < rank; ++j) acc += bt[j * t.out] * ur[j];
  y[r * t.out + n] += acc;
}

// Row-major Y[M][N] (row stride ldy) = X[M][K] W[N][K]^T (W's row stride lda; X dense), W and X
// of `type`, on cuBLAS with F32 accumulation. That is column-major Y^T = op(W) X^T with W read
// as a column-major K x N matrix transposed.
absl::Status BlasGemm(Context& ctx, const void* w, int64_t lda, const void* x, cudaDataType_t type,
                      int64_t M, int64_t N, int64_t K, float* y, int64_t ldy) {
  if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX || lda > INT32_MAX || ldy > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("a GEMM of ", M, "x", N, "x", K));
  }
  const float alpha = 1.f, beta = 0.f;
  const cublasStatus_t st = cublasGemmEx(
      ctx.impl()->blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(M),
      static_cast<int>(K), &alpha, w, type, static_cast<int>(lda), x, type, static_cast<int>(K),
      &beta, y, CUDA_R_32F, static_cast<int>(ldy), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (st != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("cublasGemmEx ", M, "x", N, "x", K, ": ", cublasGetStatusString(st)));
  }
  return absl::OkStatus();
}

// Prefill with quantized weights: x rounded to BF16 once, then tiles of W's rows (up to 64 MiB
// each) expanded into BF16 and multiplied on the tensor cores, each into its columns of y. No
// expanded copy of the matrix outlives the product.
absl::Status QuantGemm(Context& ctx, const WeightMatrix& w, const float* x, int64_t M, float* y) {
  const int64_t N = w.rows, K = w.cols;
  constexpr int64_t kTileBytes = int64_t{64} << 20;
  const int64_t tile = std::min(N, std::max<int64_t>(64, kTileBytes / (2 * K) / 64 * 64));
  const size_t x_bytes = (static_cast<size_t>(M * K) * 2 + 255) / 256 * 256;
  ASSIGN_OR_RETURN(void* scratch, ctx.Scratch(x_bytes + static_cast<size_t>(tile * K) * 2));
  auto* xb = static_cast<__nv_bfloat16*>(scratch);
  void* wt = static_cast<char*>(scratch) + x_bytes;
  ConvertKernel<<<Grid(M * K), 256>>>(x, M * K, xb);
  RETURN_IF_CUDA(cudaGetLastError(), "Gemm conversion launch");
  for (int64_t n0 = 0; n0 < N; n0 += tile) {
    const int64_t nt = std::min(tile, N - n0);
    RETURN_IF_ERROR(ExpandRows(w, n0, nt, wt));
    RETURN_IF_ERROR(BlasGemm(ctx, wt, K, xb, CUDA_R_16BF, M, nt, K, y + n0, N));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Gemm(Context& ctx, const WeightMatrix& w, const float* x, int64_t M, float* y) {
  if (M == 0 || w.rows == 0) return absl::OkStatus();
  const int64_t N = w.rows, K = w.cols;
  if (GemvFits(w, x, M)) {
    GemvGroup g;
    g.w[0] = w.data;
    g.stride[0] = w.row_stride;
    g.rows[0] = g.end[0] = w.rows;
    g.y[0] = y;
    g.n = 1;
    return LaunchGemvGroup(ctx, g, w.dtype, K, x, M);
  }
  if (IsQuantized(w.dtype)) return QuantGemm(ctx, w, x, M, y);
  const void* b = x;
  cudaDataType_t type = CUDA_R_32F;
  if (w.dtype != DType::kF32) {
    const size_t n = static_cast<size_t>(M * K);
    auto scratch = ctx.Scratch(n * 2);
    if (!scratch.ok()) return scratch.status();
    if (w.dtype == DType::kF16) {
      ConvertKernel<<<Grid(n), 256>>>(x, n, static_cast<__half*>(*scratch));
      type = CUDA_R_16F;
    } else {
      ConvertKernel<<<Grid(n), 256>>>(x, n, static_cast<__nv_bfloat16*>(*scratch));
      type = CUDA_R_16BF;
    }
    RETURN_IF_CUDA(cudaGetLastError(), "Gemm conversion launch");
    b = *scratch;
  }
  return BlasGemm(ctx, w.data, w.row_stride, b, type, M, N, K, y, N);
}

absl::Status GemmGroup(Context& ctx, const WeightMatrix* const* ws, float* const* ys, size_t n,
                       const float* x, int64_t M) {
  if (M == 0 || n == 0) return absl::OkStatus();
  bool one_launch = n <= static_cast<size_t>(kGemvMaxGroup);
  for (size_t i = 0; i < n && one_launch; ++i) {
    one_launch = ws[i]->dtype == ws[0]->dtype && ws[i]->rows > 0 && GemvFits(*ws[i], x, M);
  }
  if (!one_launch) {
    for (size_t i = 0; i < n; ++i) RETURN_IF_ERROR(Gemm(ctx, *ws[i], x, M, ys[i]));
    return absl::OkStatus();
  }
  GemvGroup g;
  int64_t end = 0;
  for (size_t i = 0; i < n; ++i) {
    g.w[i] = ws[i]->data;
    g.stride[i] = ws[i]->row_stride;
    g.rows[i] = ws[i]->rows;
    g.end[i] = end += ws[i]->rows;
    g.y[i] = ys[i];
  }
  g.n = static_cast<int>(n);
  return LaunchGemvGroup(ctx, g, ws[0]->dtype, ws[0]->cols, x, M);
}

absl::Status RouteTopK(const float* logits, int64_t rows, int64_t E, int64_t k, bool normalize,
                       int32_t* experts, float* weights) {
  if (rows == 0) return absl::OkStatus();
  if (k < 1 || k > E) return absl::InvalidArgumentError(absl::StrCat(k, " of ", E, " experts"));
  RouteKernel<<<Grid(rows, 128), 128>>>(logits, rows, E, k, normalize, experts, weights);
  return Check(cudaGetLastError(), "RouteTopK launch");
}

absl::Status RouteGrouped(const float* logits, const float* bias, int64_t rows, int64_t E,
                          int64_t k, int64_t groups, int64_t topk_groups, bool normalize,
                          float scaling, int32_t* experts, float* weights) {
  if (rows == 0) return absl::OkStatus();
  if (k < 1 || k > E || groups < 1 || groups > 64 || E % groups != 0 || topk_groups < 1 ||
      topk_groups > groups) {
    return absl::InvalidArgumentError(absl::StrCat("RouteGrouped: ", k, " of ", E, " experts in ",
                                                   topk_groups, " of ", groups, " groups"));
  }
  RouteGroupedKernel<<<Grid(rows, 128), 128>>>(logits, bias, rows, E, k, groups, topk_groups,
                                               normalize, scaling, experts, weights);
  return Check(cudaGetLastError(), "RouteGrouped launch");
}

absl::Status HeadGemm(const WeightMatrix& w, int64_t heads, const float* x, int64_t ldx,
                      int64_t x_head, int64_t rows, float* y, int64_t ldy, int64_t y_head) {
  if (rows == 0 || w.rows == 0) return absl::OkStatus();
  const int64_t N = w.rows / heads;
  constexpr int kWarps = 8;
  if (rows > INT32_MAX || heads > 65535 || (N + kWarps - 1) / kWarps > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("HeadGemm of ", rows, " rows x ", heads, " heads x ", N, " outputs"));
  }
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(heads),
                  static_cast<unsigned>((N + kWarps - 1) / kWarps));
  switch (w.dtype) {
    case DType::kF32:
      HeadGemmKernel<<<grid, kWarps * 32>>>(static_cast<const float*>(w.data), w.row_stride, N,
                                            w.cols, x, ldx, x_head, y, ldy, y_head);
      break;
    case DType::kF16:
      HeadGemmKernel<<<grid, kWarps * 32>>>(static_cast<const __half*>(w.data), w.row_stride, N,
                                            w.cols, x, ldx, x_head, y, ldy, y_head);
      break;
    case DType::kBF16:
      HeadGemmKernel<<<grid, kWarps * 32>>>(static_cast<const __nv_bfloat16*>(w.data), w.row_stride,
                                            N, w.cols, x, ldx, x_head, y, ldy, y_head);
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("HeadGemm takes F32, F16 or BF16 weights, not ", DTypeName(w.dtype)));
  }
  return Check(cudaGetLastError(), "HeadGemm launch");
}

absl::Status ExpertMatVec(const ExpertTable& w, const int32_t* experts, int64_t slots,
                          const float* x, int64_t x_div, float* y) {
  if (slots == 0 || w.rows == 0) return absl::OkStatus();
  if (slots > 65535) return absl::InvalidArgumentError(absl::StrCat(slots, " expert slots"));
  constexpr int kWarps = 8;
  const dim3 grid(static_cast<unsigned>((w.rows + kWarps - 1) / kWarps),
                  static_cast<unsigned>(slots));
  switch (w.dtype) {
    case DType::kF32:
      ExpertMatVecKernel<<<grid, kWarps * 32>>>(reinterpret_cast<const float* const*>(w.data),
                                                w.expert_begin, w.count, w.rows, w.cols, experts, x,
                                                x_div, y);
      break;
    case DType::kF16:
      ExpertMatVecKernel<<<grid, kWarps * 32>>>(reinterpret_cast<const __half* const*>(w.data),
                                                w.expert_begin, w.count, w.rows, w.cols, experts, x,
                                                x_div, y);
      break;
    case DType::kBF16:
      ExpertMatVecKernel<<<grid, kWarps * 32>>>(
          reinterpret_cast<const __nv_bfloat16* const*>(w.data), w.expert_begin, w.count, w.rows,
          w.cols, experts, x, x_div, y);
      break;
    default:
      return QuantExpertMatVec(w, experts, slots, x, x_div, y);
  }
  return Check(cudaGetLastError(), "ExpertMatVec launch");
}

absl::Status CombineSlots(const float* x, const float* weights, int64_t rows, int64_t k,
                          int64_t dim, float* y) {
  if (rows == 0) return absl::OkStatus();
  CombineSlotsKernel<<<static_cast<unsigned>(rows), 256>>>(x, weights, k, dim, y);
  return Check(cudaGetLastError(), "CombineSlots launch");
}

absl::Status LoraAdd(const LoraTable& t, const int32_t* row_slot, int64_t rows, const float* x,
                     float* y, float* scratch) {
  if (rows == 0 || t.slots == 0 || t.max_rank == 0) return absl::OkStatus();
  if (rows > 65535) return absl::InvalidArgumentError(absl::StrCat("LoraAdd of ", rows, " rows"));
  constexpr int kWarps = 8;
  const int64_t items = rows * t.max_rank;
  LoraShrinkKernel<<<static_cast<unsigned>((items + kWarps - 1) / kWarps), kWarps * 32>>>(
      t, row_slot, rows, x, scratch);
  RETURN_IF_CUDA(cudaGetLastError(), "LoraAdd shrink launch");
  const dim3 grid(static_cast<unsigned>((t.out + 255) / 256), static_cast<unsigned>(rows));
  LoraExpandKernel<<<grid, 256>>>(t, row_slot, scratch, y);
  return Check(cudaGetLastError(), "LoraAdd expand launch");
}

}  // namespace shardserve::cuda
