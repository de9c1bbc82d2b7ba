#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

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

__global__ void RmsNormKernel(const float* x, int64_t dim, const float* w, float eps, float* out) {
  const float* row = x + blockIdx.x * dim;
  float* o = out + blockIdx.x * dim;
  __shared__ float partial[32];
  float s = 0;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) s += row[i] * row[i];
  for (int off = 16; off > 0; off /= 2) s += __shfl_down_sync(0xffffffff, s, off);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x < 32) {
    s = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.f;
    for (int off = 16; off > 0; off /= 2) s += __shfl_down_sync(0xffffffff, s, off);
    if (threadIdx.x == 0) partial[0] = rsqrtf(s / dim + eps);
  }
  __syncthreads();
  const float inv = partial[0];
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) o[i] = w[i] * (row[i] * inv);
}

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

// One warp per output row.
template <typename T>
__global__ void MatVecKernel(const T* w, int64_t rows, int64_t cols, const float* x, float* y) {
  const int64_t row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const T* wr = w + row * cols;
  float s = 0;
  for (int64_t k = threadIdx.x % 32; k < cols; k += 32) s += ToF32(wr[k]) * x[k];
  for (int off = 16; off > 0; off /= 2) s += __shfl_down_sync(0xffffffff, s, off);
  if (threadIdx.x % 32 == 0) y[row] = s;
}

template <typename T>
__global__ void EmbedKernel(const T* table, int64_t row_stride, int64_t dim, const int32_t* ids,
                            int64_t vocab_begin, int64_t vocab_end, float* out) {
  const int64_t i = blockIdx.x;
  const int32_t id = ids[i];
  float* o = out + i * dim;
  const bool mine = id >= vocab_begin && id < vocab_end;
  const T* row = table + (mine ? (id - vocab_begin) * row_stride : 0);
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) o[d] = mine ? ToF32(row[d]) : 0.f;
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

template <typename T>
__global__ void ConvertKernel(const float* x, int64_t n, T* out) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = FromF32<T>(x[i]);
  }
}

__global__ void AddBiasKernel(float* x, int64_t rows, int64_t cols, const float* bias) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < rows * cols;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] += bias[i % cols];
  }
}

__global__ void AddKernel(float* x, const float* y, int64_t n) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] += y[i];
  }
}

__global__ void SiluMulKernel(float* a, const float* b, int64_t n) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = a[i];
    a[i] = v / (1.f + expf(-v)) * b[i];
  }
}

// One block per row; the angle in float as the reference computes it, its cosine and sine in
// double (as model/rope.cc), so both backends rotate alike.
__global__ void RopeKernel(float* x, int64_t heads, int64_t head_dim, const int32_t* positions,
                           const float* inv_freq) {
  const int64_t r = blockIdx.x, half = head_dim / 2;
  float* row = x + r * heads * head_dim;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    const float angle = static_cast<float>(positions[r]) * inv_freq[i];
    const float c = static_cast<float>(cos(static_cast<double>(angle)));
    const float sn = static_cast<float>(sin(static_cast<double>(angle)));
    for (int64_t h = 0; h < heads; ++h) {
      float* v = row + h * head_dim;
      const float a = v[i], b = v[i + half];
      v[i] = a * c - b * sn;
      v[i + half] = b * c + a * sn;
    }
  }
}

__device__ __forceinline__ int64_t SlabOffset(const int32_t* blocks, int32_t off, int64_t pos,
                                              int64_t kv_heads, int64_t kh, int64_t bs,
                                              int64_t hd) {
  const int64_t block = blocks[off + pos / bs];
  return ((block * kv_heads + kh) * bs + pos % bs) * hd;
}

// One block per row; threads over kv_heads * head_dim.
__global__ void WriteKvKernel(float* kc, float* vc, int64_t kv_heads, int64_t bs, int64_t hd,
                              const float* k, const float* v, const int32_t* positions,
                              const int32_t* blocks, const int32_t* block_offset) {
  const int64_t r = blockIdx.x;
  for (int64_t i = threadIdx.x; i < kv_heads * hd; i += blockDim.x) {
    const int64_t kh = i / hd, d = i % hd;
    const int64_t at = SlabOffset(blocks, block_offset[r], positions[r], kv_heads, kh, bs, hd) + d;
    kc[at] = k[r * kv_heads * hd + i];
    vc[at] = v[r * kv_heads * hd + i];
  }
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

__device__ float BlockMax(float v, float* shared) {
  return BlockReduce(v, MaxOp{}, -FLT_MAX, shared);
}
__device__ float BlockSum(float v, float* shared) {
  return BlockReduce(v, SumOp<float>{}, 0.f, shared);
}

// A logit and its id, ordered as the CPU sampler orders them: larger first, ties to the lower id.
struct Cand {
  float v;
  int32_t i;
};
__device__ __forceinline__ bool Before(float av, int64_t ai, float bv, int64_t bi) {
  return av > bv || (av == bv && ai < bi);
}

// The first of row[0..n) in that order among those after `prev`; i == INT32_MAX if none.
// `shared` holds 32 candidates.
__device__ Cand BlockBestAfter(const float* row, int64_t n, Cand prev, Cand* shared) {
  Cand b{-INFINITY, INT32_MAX};
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = row[i];
    if (Before(prev.v, prev.i, v, i) && Before(v, i, b.v, b.i)) b = {v, static_cast<int32_t>(i)};
  }
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

// One block per (row, head): scores of every position into `scores` (max_len per item), the
// softmax, then the weighted sum of V with threads over head_dim.
__global__ void AttentionKernel(const float* kc, const float* vc, int64_t kv_heads, int64_t bs,
                                int64_t hd, const float* q, int64_t heads, int64_t head0,
                                int64_t group, int64_t kv_head0, const int32_t* positions,
                                const int32_t* blocks, const int32_t* block_offset, int64_t max_len,
                                float scale, float* scores, float* out) {
  __shared__ float shared[32];
  const int64_t item = blockIdx.x, r = item / heads, h = item % heads;
  const int64_t kh = (head0 + h) / group - kv_head0;
  const int64_t len = positions[r] + 1;
  const float* qh = q + (r * heads + h) * hd;
  float* sc = scores + item * max_len;
  float mx = -FLT_MAX;
  for (int64_t p = threadIdx.x; p < len; p += blockDim.x) {
    const float* k = kc + SlabOffset(blocks, block_offset[r], p, kv_heads, kh, bs, hd);
    float dot = 0;
    for (int64_t d = 0; d < hd; ++d) dot += qh[d] * k[d];
    sc[p] = dot * scale;
    mx = fmaxf(mx, sc[p]);
  }
  mx = BlockMax(mx, shared);
  float sum = 0;
  for (int64_t p = threadIdx.x; p < len; p += blockDim.x) {
    sc[p] = expf(sc[p] - mx);
    sum += sc[p];
  }
  sum = BlockSum(sum, shared);
  __syncthreads();  // every score written before any thread reads them all
  const float inv = 1.f / sum;
  for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0;
    for (int64_t p = 0; p < len; ++p) {
      acc += sc[p] * vc[SlabOffset(blocks, block_offset[r], p, kv_heads, kh, bs, hd) + d];
    }
    out[(r * heads + h) * hd + d] = acc * inv;
  }
}

// One block per row: max, sum of exp(logit - max) (double, as the host), then K rounds of "the
// best after the previous pick".
__global__ void VocabSummaryKernel(const float* logits, int64_t ld, int64_t n, int64_t vocab_begin,
                                   int64_t K, float* out) {
  __shared__ float fsh[32];
  __shared__ double dsh[32];
  __shared__ Cand csh[32];
  const float* row = logits + blockIdx.x * ld;
  float* rec = out + blockIdx.x * (2 + 2 * K);
  float mx = -INFINITY;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, row[i]);
  mx = BlockReduce(mx, MaxOp{}, -INFINITY, fsh);
  double sum = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    sum += exp(static_cast<double>(row[i] - mx));
  sum = BlockReduce(sum, SumOp<double>{}, 0.0, dsh);
  if (threadIdx.x == 0) {
    rec[0] = mx;
    rec[1] = static_cast<float>(sum);
  }
  Cand prev{INFINITY, -1};
  for (int64_t j = 0; j < K; ++j) {
    const Cand c = BlockBestAfter(row, n, prev, csh);
    if (threadIdx.x == 0) {
      const bool found = c.i != INT32_MAX;
      rec[2 + 2 * j] = found ? c.v : -INFINITY;
      rec[3 + 2 * j] = found ? static_cast<float>(vocab_begin + c.i) : -INFINITY;
    }
    prev = c;
  }
}

__global__ void IotaRowsKernel(int32_t* ids, int64_t rows, int64_t V, int32_t* offsets) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < rows * V;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    ids[i] = static_cast<int32_t>(i % V);
    if (i % V == 0) offsets[i / V] = static_cast<int32_t>(i);
    if (i == rows * V - 1) offsets[rows] = static_cast<int32_t>(rows * V);
  }
}

constexpr int kSampleThreads = 256;
using SampleScan = cub::BlockScan<double, kSampleThreads>;

// The first i < limit whose inclusive prefix sum of weight(i) satisfies `past` (a predicate that
// stays true once true), and that prefix sum; limit if none. All threads of the block call it.
template <typename Weight, typename Past>
__device__ int64_t FirstPast(int64_t limit, Weight weight, Past past, double* prefix,
                             SampleScan::TempStorage& scan, long long* lsh, double* dsh) {
  double carry = 0;
  for (int64_t base = 0; base < limit; base += kSampleThreads) {
    const int64_t i = base + threadIdx.x;
    const double w = i < limit ? weight(i) : 0.0;
    double incl, tile;
    SampleScan(scan).InclusiveSum(w, incl, tile);
    incl += carry;
    const bool hit = i < limit && past(incl);
    const long long first =
        BlockReduce(static_cast<long long>(hit ? i : LLONG_MAX), MinOp{}, LLONG_MAX, lsh);
    if (first != LLONG_MAX) {
      if (i == first) dsh[0] = incl;
      __syncthreads();
      *prefix = dsh[0];
      __syncthreads();
      return first;
    }
    carry += tile;
  }
  *prefix = carry;
  return limit;
}

// One block per row of sorted logits (descending, ties to the lower id) and their ids.
__global__ void __launch_bounds__(kSampleThreads)
    SampleKernel(const float* sorted, const int32_t* sorted_ids, int64_t V, const SampleSpec* specs,
                 int64_t K, int32_t* chosen, float* chosen_lp, int32_t* top_ids, float* top_lp) {
  __shared__ SampleScan::TempStorage scan;
  __shared__ double dsh[32];
  __shared__ long long lsh[32];
  const int64_t r = blockIdx.x;
  const float* l = sorted + r * V;
  const int32_t* id = sorted_ids + r * V;
  const SampleSpec sp = specs[r];
  double z = 0;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) z += exp(static_cast<double>(l[i] - l[0]));
  z = BlockReduce(z, SumOp<double>{}, 0.0, dsh);
  const float log_z = l[0] + static_cast<float>(log(z));
  for (int64_t j = threadIdx.x; j < K; j += blockDim.x) {
    top_ids[r * K + j] = id[j];
    top_lp[r * K + j] = l[j] - log_z;
  }
  int64_t pick = 0;
  if (sp.temperature > 0) {
    const int64_t keep = sp.top_k > 0 && sp.top_k < V ? sp.top_k : V;
    const double inv_t = 1.0 / sp.temperature, best = l[0];
    auto weight = [&](int64_t i) { return exp((static_cast<double>(l[i]) - best) * inv_t); };
    double total = 0;
    for (int64_t i = threadIdx.x; i < keep; i += blockDim.x) total += weight(i);
    total = BlockReduce(total, SumOp<double>{}, 0.0, dsh);
    int64_t n = keep;
    if (sp.top_p < 1.0f) {  // the nucleus: the shortest prefix holding top_p of the weight
      const double need = static_cast<double>(sp.top_p) * total;
      double upto;
      const int64_t last = FirstPast(
          keep, weight, [&](double c) { return c >= need; }, &upto, scan, lsh, dsh);
      if (last < keep) {
        n = last + 1;
        total = upto;
      }
    }
    const double target = sp.u * total;
    double unused;
    pick = FirstPast(
        n, weight, [&](double c) { return target < c; }, &unused, scan, lsh, dsh);
    if (pick == n) pick = n - 1;
  }
  if (threadIdx.x == 0) {
    chosen[r] = id[pick];
    chosen_lp[r] = l[pick] - log_z;
  }
}

// One thread per row: k rounds of "the best expert after the previous pick", then the softmax
// of the k logits (float, as the host).
__global__ void RouteKernel(const float* logits, int64_t rows, int64_t E, int64_t k,
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
  const float mx = weights[r * k];
  float sum = 0;
  for (int64_t j = 0; j < k; ++j) sum += expf(weights[r * k + j] - mx);
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

__global__ void CombineSlotsKernel(const float* x, const float* weights, int64_t k, int64_t dim,
                                   float* y) {
  const int64_t r = blockIdx.x;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    float acc = 0;
    for (int64_t j = 0; j < k; ++j) acc += weights[r * k + j] * x[(r * k + j) * dim + d];
    y[r * dim + d] = acc;
  }
}

__global__ void GatherRowsKernel(const float* x, int64_t dim, const int32_t* rows, float* out) {
  const int64_t i = blockIdx.x;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) out[i * dim + d] = x[rows[i] * dim + d];
}

// Rows may repeat only across calls (an expert's rows are distinct), so no atomics are needed.
__global__ void ScaleAddRowsKernel(const float* x, int64_t dim, const int32_t* rows,
                                   const float* weight, float* y) {
  const int64_t i = blockIdx.x;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    y[rows[i] * dim + d] += weight[i] * x[i * dim + d];
  }
}

unsigned Grid(int64_t n, int threads = 256) {
  return static_cast<unsigned>(std::min<int64_t>((n + threads - 1) / threads, 65535));
}

}  // namespace

struct Context::Impl {
  int device = 0;
  cublasHandle_t blas = nullptr;
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
};

Context::Context(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Context::~Context() {
  if (impl_->blas != nullptr) cublasDestroy(impl_->blas);
  if (impl_->scratch != nullptr) cudaFree(impl_->scratch);
}

absl::StatusOr<std::unique_ptr<Context>> Context::Create(int device) {
  RETURN_IF_CUDA(cudaSetDevice(device), "cudaSetDevice");
  auto impl = std::make_unique<Impl>();
  impl->device = device;
  if (cublasStatus_t st = cublasCreate(&impl->blas); st != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrCat("cublasCreate: ", cublasGetStatusString(st)));
  }
  return std::unique_ptr<Context>(new Context(std::move(impl)));
}

absl::StatusOr<void*> Context::Scratch(size_t bytes) {
  if (bytes <= impl_->scratch_bytes) return impl_->scratch;
  if (impl_->scratch != nullptr) cudaFree(impl_->scratch);
  impl_->scratch = nullptr;
  impl_->scratch_bytes = 0;
  if (cudaError_t e = cudaMalloc(&impl_->scratch, bytes); e != cudaSuccess) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cudaMalloc of ", bytes, " scratch bytes: ", cudaGetErrorString(e)));
  }
  impl_->scratch_bytes = bytes;
  return impl_->scratch;
}

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device / no driver" error
    return 0;
  }
  return n;
}

absl::Status Synchronize() { return Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

absl::StatusOr<double> CopyBandwidth(size_t bytes, int reps) {
  ASSIGN_OR_RETURN(DeviceBuffer a, DeviceBuffer::Alloc(bytes));
  ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Alloc(bytes));
  cudaEvent_t start, stop;
  RETURN_IF_CUDA(cudaEventCreate(&start), "cudaEventCreate");
  RETURN_IF_CUDA(cudaEventCreate(&stop), "cudaEventCreate");
  float best_ms = 1e30f;
  for (int i = 0; i < reps + 1; ++i) {  // the first is a warm-up
    RETURN_IF_CUDA(cudaEventRecord(start), "cudaEventRecord");
    RETURN_IF_CUDA(cudaMemcpy(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy");
    RETURN_IF_CUDA(cudaEventRecord(stop), "cudaEventRecord");
    RETURN_IF_CUDA(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    RETURN_IF_CUDA(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    if (i > 0) best_ms = std::min(best_ms, ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return 2.0 * static_cast<double>(bytes) / (best_ms / 1e3);
}

absl::Status Zero(void* p, size_t bytes) { return Check(cudaMemset(p, 0, bytes), "cudaMemset"); }

absl::StatusOr<DeviceBuffer> DeviceBuffer::Alloc(size_t bytes) {
  DeviceBuffer b;
  if (cudaError_t e = cudaMalloc(&b.ptr_, bytes); e != cudaSuccess) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cudaMalloc of ", bytes, " bytes: ", cudaGetErrorString(e)));
  }
  b.size_ = bytes;
  return b;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), size_(o.size_) {
  o.ptr_ = nullptr;
  o.size_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = o.ptr_;
    size_ = o.size_;
    o.ptr_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

absl::Status DeviceBuffer::CopyFromHost(const void* src, size_t bytes) {
  if (bytes > size_) return absl::InvalidArgumentError("copy larger than the device buffer");
  return Check(cudaMemcpy(ptr_, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to device");
}

absl::Status DeviceBuffer::CopyToHost(void* dst, size_t bytes) const {
  if (bytes > size_) return absl::InvalidArgumentError("copy larger than the device buffer");
  return Check(cudaMemcpy(dst, ptr_, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
}

absl::Status Gemm(Context& ctx, const DeviceWeight& w, const float* x, int64_t M, float* y) {
  if (M == 0 || w.rows == 0) return absl::OkStatus();
  const int64_t N = w.rows, K = w.cols;
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
  // Row-major Y[M][N] = X[M][K] W[N][K]^T is column-major Y^T = op(W) X^T with W read as a
  // column-major K x N matrix (lda = row_stride) transposed.
  const float alpha = 1.f, beta = 0.f;
  const cublasStatus_t st =
      cublasGemmEx(ctx.impl()->blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N),
                   static_cast<int>(M), static_cast<int>(K), &alpha, w.data, type,
                   static_cast<int>(w.row_stride), b, type, static_cast<int>(K), &beta, y,
                   CUDA_R_32F, static_cast<int>(N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (st != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("cublasGemmEx ", M, "x", N, "x", K, ": ", cublasGetStatusString(st)));
  }
  return absl::OkStatus();
}

absl::Status Embed(const DeviceWeight& t, const int32_t* ids, int64_t n, int64_t vocab_begin,
                   int64_t vocab_end, float* out) {
  if (n == 0) return absl::OkStatus();
  const unsigned blocks = static_cast<unsigned>(n);
  switch (t.dtype) {
    case DType::kF32:
      EmbedKernel<<<blocks, 256>>>(static_cast<const float*>(t.data), t.row_stride, t.cols, ids,
                                   vocab_begin, vocab_end, out);
      break;
    case DType::kF16:
      EmbedKernel<<<blocks, 256>>>(static_cast<const __half*>(t.data), t.row_stride, t.cols, ids,
                                   vocab_begin, vocab_end, out);
      break;
    case DType::kBF16:
      EmbedKernel<<<blocks, 256>>>(static_cast<const __nv_bfloat16*>(t.data), t.row_stride, t.cols,
                                   ids, vocab_begin, vocab_end, out);
      break;
  }
  return Check(cudaGetLastError(), "Embed launch");
}

absl::Status AddBias(float* x, int64_t rows, int64_t cols, const float* bias) {
  if (rows * cols == 0) return absl::OkStatus();
  AddBiasKernel<<<Grid(rows * cols), 256>>>(x, rows, cols, bias);
  return Check(cudaGetLastError(), "AddBias launch");
}

absl::Status Add(float* x, const float* y, int64_t n) {
  if (n == 0) return absl::OkStatus();
  AddKernel<<<Grid(n), 256>>>(x, y, n);
  return Check(cudaGetLastError(), "Add launch");
}

absl::Status SiluMul(float* a, const float* b, int64_t n) {
  if (n == 0) return absl::OkStatus();
  SiluMulKernel<<<Grid(n), 256>>>(a, b, n);
  return Check(cudaGetLastError(), "SiluMul launch");
}

absl::Status Rope(float* x, int64_t rows, int64_t heads, int64_t head_dim, const int32_t* positions,
                  const float* inv_freq) {
  if (rows == 0) return absl::OkStatus();
  RopeKernel<<<static_cast<unsigned>(rows), 64>>>(x, heads, head_dim, positions, inv_freq);
  return Check(cudaGetLastError(), "Rope launch");
}

absl::Status WriteKv(const DeviceKv& c, const float* k, const float* v, int64_t rows,
                     const int32_t* positions, const int32_t* blocks, const int32_t* block_offset) {
  if (rows == 0) return absl::OkStatus();
  WriteKvKernel<<<static_cast<unsigned>(rows), 128>>>(
      c.k, c.v, c.kv_heads, c.block_size, c.head_dim, k, v, positions, blocks, block_offset);
  return Check(cudaGetLastError(), "WriteKv launch");
}

absl::Status Attention(Context& ctx, const DeviceKv& c, const float* q, int64_t rows, int64_t heads,
                       int64_t head0, int64_t group, int64_t kv_head0, const int32_t* positions,
                       const int32_t* blocks, const int32_t* block_offset, int64_t max_len,
                       float scale, float* out) {
  if (rows * heads == 0) return absl::OkStatus();
  auto scores = ctx.Scratch(static_cast<size_t>(rows * heads * max_len) * sizeof(float));
  if (!scores.ok()) return scores.status();
  AttentionKernel<<<static_cast<unsigned>(rows * heads), 128>>>(
      c.k, c.v, c.kv_heads, c.block_size, c.head_dim, q, heads, head0, group, kv_head0, positions,
      blocks, block_offset, max_len, scale, static_cast<float*>(*scores), out);
  return Check(cudaGetLastError(), "Attention launch");
}

absl::Status GatherRows(const float* x, int64_t dim, const int32_t* rows, int64_t n, float* out) {
  if (n == 0) return absl::OkStatus();
  GatherRowsKernel<<<static_cast<unsigned>(n), 256>>>(x, dim, rows, out);
  return Check(cudaGetLastError(), "GatherRows launch");
}

absl::Status ScaleAddRows(const float* x, int64_t dim, const int32_t* rows, const float* weight,
                          int64_t n, float* y) {
  if (n == 0) return absl::OkStatus();
  ScaleAddRowsKernel<<<static_cast<unsigned>(n), 256>>>(x, dim, rows, weight, y);
  return Check(cudaGetLastError(), "ScaleAddRows launch");
}

absl::Status VocabSummaries(Context& ctx, const float* logits, int64_t rows, int64_t ld, int64_t n,
                            int64_t vocab_begin, int64_t K, float* out) {
  if (rows == 0) return absl::OkStatus();
  const size_t bytes = static_cast<size_t>(rows * (2 + 2 * K)) * sizeof(float);
  ASSIGN_OR_RETURN(void* d, ctx.Scratch(bytes));
  VocabSummaryKernel<<<static_cast<unsigned>(rows), 256>>>(logits, ld, n, vocab_begin, K,
                                                           static_cast<float*>(d));
  RETURN_IF_CUDA(cudaGetLastError(), "VocabSummaries launch");
  return Check(cudaMemcpy(out, d, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy of the summaries");
}

absl::Status SampleRows(Context& ctx, const float* logits, int64_t rows, int64_t V,
                        const SampleSpec* specs, int64_t K, int32_t* ids, float* logprobs,
                        int32_t* top_ids, float* top_logprobs) {
  if (rows == 0) return absl::OkStatus();
  if (K > V) return absl::InvalidArgumentError(absl::StrCat("top ", K, " of ", V, " logits"));
  if (rows * V > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(rows, " rows of ", V, " logits to sort"));
  }
  const int n = static_cast<int>(rows * V);
  size_t sort_bytes = 0;
  RETURN_IF_CUDA(cub::DeviceSegmentedRadixSort::SortPairsDescending(
                     nullptr, sort_bytes, logits, static_cast<float*>(nullptr),
                     static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), n,
                     static_cast<int>(rows), static_cast<const int32_t*>(nullptr),
                     static_cast<const int32_t*>(nullptr)),
                 "sort size");
  // One scratch allocation, carved into 256-byte aligned parts.
  auto align = [](size_t b) { return (b + 255) / 256 * 256; };
  const size_t keys_b = align(n * sizeof(float)), ids_b = align(n * sizeof(int32_t)),
               off_b = align((rows + 1) * sizeof(int32_t)),
               spec_b = align(rows * sizeof(SampleSpec)),
               pick_b = align(rows * (sizeof(int32_t) + sizeof(float))),
               top_b = align(rows * K * (sizeof(int32_t) + sizeof(float)));
  ASSIGN_OR_RETURN(void* base, ctx.Scratch(keys_b + 2 * ids_b + off_b + spec_b + pick_b + top_b +
                                           align(sort_bytes)));
  char* p = static_cast<char*>(base);
  auto take = [&p](size_t b) {
    char* at = p;
    p += b;
    return at;
  };
  float* keys = reinterpret_cast<float*>(take(keys_b));
  int32_t* ids_in = reinterpret_cast<int32_t*>(take(ids_b));
  int32_t* ids_out = reinterpret_cast<int32_t*>(take(ids_b));
  int32_t* offsets = reinterpret_cast<int32_t*>(take(off_b));
  SampleSpec* dspecs = reinterpret_cast<SampleSpec*>(take(spec_b));
  char* picks = take(pick_b);
  char* tops = take(top_b);
  void* sort_tmp = take(align(sort_bytes));
  int32_t* d_ids = reinterpret_cast<int32_t*>(picks);
  float* d_lp = reinterpret_cast<float*>(picks + rows * sizeof(int32_t));
  int32_t* d_top_ids = reinterpret_cast<int32_t*>(tops);
  float* d_top_lp = reinterpret_cast<float*>(tops + rows * K * sizeof(int32_t));

  IotaRowsKernel<<<Grid(n), 256>>>(ids_in, rows, V, offsets);
  RETURN_IF_CUDA(cudaGetLastError(), "SampleRows ids launch");
  RETURN_IF_CUDA(cub::DeviceSegmentedRadixSort::SortPairsDescending(
                     sort_tmp, sort_bytes, logits, keys, static_cast<const int32_t*>(ids_in),
                     ids_out, n, static_cast<int>(rows), static_cast<const int32_t*>(offsets),
                     static_cast<const int32_t*>(offsets + 1)),
                 "segmented sort");
  RETURN_IF_CUDA(cudaMemcpy(dspecs, specs, rows * sizeof(SampleSpec), cudaMemcpyHostToDevice),
                 "cudaMemcpy of the sampling parameters");
  SampleKernel<<<static_cast<unsigned>(rows), kSampleThreads>>>(keys, ids_out, V, dspecs, K, d_ids,
                                                                d_lp, d_top_ids, d_top_lp);
  RETURN_IF_CUDA(cudaGetLastError(), "SampleRows launch");
  RETURN_IF_CUDA(cudaMemcpy(ids, d_ids, rows * sizeof(int32_t), cudaMemcpyDeviceToHost),
                 "cudaMemcpy of the sampled ids");
  RETURN_IF_CUDA(cudaMemcpy(logprobs, d_lp, rows * sizeof(float), cudaMemcpyDeviceToHost),
                 "cudaMemcpy of the sampled log-probabilities");
  if (K > 0) {
    RETURN_IF_CUDA(
        cudaMemcpy(top_ids, d_top_ids, rows * K * sizeof(int32_t), cudaMemcpyDeviceToHost),
        "cudaMemcpy of the top ids");
    RETURN_IF_CUDA(
        cudaMemcpy(top_logprobs, d_top_lp, rows * K * sizeof(float), cudaMemcpyDeviceToHost),
        "cudaMemcpy of the top log-probabilities");
  }
  return absl::OkStatus();
}

absl::Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                    size_t height) {
  if (width == 0 || height == 0) return absl::OkStatus();
  return Check(cudaMemcpy2D(dst, dst_pitch, src, src_pitch, width, height, cudaMemcpyDefault),
               "cudaMemcpy2D");
}

absl::Status RouteTopK(const float* logits, int64_t rows, int64_t E, int64_t k, int32_t* experts,
                       float* weights) {
  if (rows == 0) return absl::OkStatus();
  if (k < 1 || k > E) return absl::InvalidArgumentError(absl::StrCat(k, " of ", E, " experts"));
  RouteKernel<<<Grid(rows, 128), 128>>>(logits, rows, E, k, experts, weights);
  return Check(cudaGetLastError(), "RouteTopK launch");
}

absl::Status ExpertMatVec(const ExpertWeights& w, const int32_t* experts, int64_t slots,
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
  }
  return Check(cudaGetLastError(), "ExpertMatVec launch");
}

absl::Status CombineSlots(const float* x, const float* weights, int64_t rows, int64_t k,
                          int64_t dim, float* y) {
  if (rows == 0) return absl::OkStatus();
  CombineSlotsKernel<<<static_cast<unsigned>(rows), 256>>>(x, weights, k, dim, y);
  return Check(cudaGetLastError(), "CombineSlots launch");
}

absl::Status RmsNorm(const float* x, int64_t M, int64_t dim, const float* w, float eps,
                     float* out) {
  if (M == 0) return absl::OkStatus();
  RmsNormKernel<<<static_cast<unsigned>(M), 256>>>(x, dim, w, eps, out);
  return Check(cudaGetLastError(), "RmsNorm launch");
}

absl::Status MatVec(DType dtype, const void* w, int64_t rows, int64_t cols, const float* x,
                    float* y) {
  if (rows == 0) return absl::OkStatus();
  constexpr int kWarps = 8;
  const unsigned blocks = static_cast<unsigned>((rows + kWarps - 1) / kWarps);
  switch (dtype) {
    case DType::kF32:
      MatVecKernel<<<blocks, kWarps * 32>>>(static_cast<const float*>(w), rows, cols, x, y);
      break;
    case DType::kF16:
      MatVecKernel<<<blocks, kWarps * 32>>>(static_cast<const __half*>(w), rows, cols, x, y);
      break;
    case DType::kBF16:
      MatVecKernel<<<blocks, kWarps * 32>>>(static_cast<const __nv_bfloat16*>(w), rows, cols, x, y);
      break;
  }
  return Check(cudaGetLastError(), "MatVec launch");
}

}  // namespace shardserve::cuda
