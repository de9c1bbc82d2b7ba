// The CUDA backend: vocab-slice summaries (greedy) and sampling (top-k, top-p).
#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include "backend/cuda/common.cuh"

namespace shardserve::cuda {
namespace {

// The vocabulary summary in two launches, so that a long row (128k logits) is spread over the
// GPU rather than one block: grid (chunks, rows), each block a chunk of kSummaryChunk logits —
// its max, its sum of exp(logit - that max) (double, as the host) and its K best (ties to the
// lower id, ids absolute within the slice); then one block per row merges its chunks.
constexpr int64_t kSummaryChunk = 2048;
constexpr int kSummaryThreads = 256;

// The first of c[0..n) in the candidate order after `prev`; i == INT32_MAX if none.
__device__ Cand BlockBestCandAfter(const Cand* c, int64_t n, Cand prev, Cand* shared) {
  Cand b{-INFINITY, INT32_MAX};
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const Cand x = c[j];
    if (x.i != INT32_MAX && Before(prev.v, prev.i, x.v, x.i) && Before(x.v, x.i, b.v, b.i)) b = x;
  }
  return BlockBest(b, shared);
}

__global__ void __launch_bounds__(kSummaryThreads)
    VocabChunkKernel(const float* logits, int64_t ld, int64_t n, int64_t K, float* chunk_max,
                     double* chunk_sum, Cand* chunk_best) {
  __shared__ float fsh[32];
  __shared__ double dsh[32];
  __shared__ Cand csh[32];
  const int64_t chunks = gridDim.x, c = blockIdx.x, r = blockIdx.y;
  const int64_t begin = c * kSummaryChunk, len = min(kSummaryChunk, n - begin);
  const float* row = logits + r * ld + begin;
  float mx = -INFINITY;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) mx = fmaxf(mx, row[i]);
  mx = BlockReduce(mx, MaxOp{}, -INFINITY, fsh);
  double sum = 0;
  if (mx != -INFINITY) {
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x)
      sum += exp(static_cast<double>(row[i] - mx));
  }
  sum = BlockReduce(sum, SumOp<double>{}, 0.0, dsh);
  const int64_t at = r * chunks + c;
  if (threadIdx.x == 0) {
    chunk_max[at] = mx;
    chunk_sum[at] = sum;
  }
  Cand prev{INFINITY, -1};
  for (int64_t j = 0; j < K; ++j) {
    const Cand b = BlockBestAfter(row, len, prev, csh);  // ids relative to the chunk
    if (threadIdx.x == 0) {
      chunk_best[at * K + j] = b.i == INT32_MAX ? Cand{-INFINITY, INT32_MAX}
                                                : Cand{b.v, static_cast<int32_t>(begin + b.i)};
    }
    prev = b;
  }
}

__global__ void __launch_bounds__(kSummaryThreads)
    VocabMergeKernel(const float* chunk_max, const double* chunk_sum, const Cand* chunk_best,
                     int64_t chunks, int64_t vocab_begin, int64_t K, float* out) {
  __shared__ float fsh[32];
  __shared__ double dsh[32];
  __shared__ Cand csh[32];
  const int64_t r = blockIdx.x;
  const float* cm = chunk_max + r * chunks;
  const double* cs = chunk_sum + r * chunks;
  float mx = -INFINITY;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) mx = fmaxf(mx, cm[c]);
  mx = BlockReduce(mx, MaxOp{}, -INFINITY, fsh);
  double sum = 0;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    if (cm[c] != -INFINITY) sum += cs[c] * exp(static_cast<double>(cm[c] - mx));
  }
  sum = BlockReduce(sum, SumOp<double>{}, 0.0, dsh);
  float* rec = out + r * (2 + 2 * K);
  if (threadIdx.x == 0) {
    rec[0] = mx;
    rec[1] = static_cast<float>(sum);
  }
  Cand prev{INFINITY, -1};
  for (int64_t j = 0; j < K; ++j) {
    const Cand b = BlockBestCandAfter(chunk_best + r * chunks * K, chunks * K, prev, csh);
    if (threadIdx.x == 0) {
      const bool found = b.i != INT32_MAX;
      rec[2 + 2 * j] = found ? b.v : -INFINITY;
      rec[3 + 2 * j] = found ? static_cast<float>(vocab_begin + b.i) : -INFINITY;
    }
    prev = b;
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

}  // namespace

absl::Status VocabSummaries(Context& ctx, const float* logits, int64_t rows, int64_t ld, int64_t n,
                            int64_t vocab_begin, int64_t K, float* out) {
  if (rows == 0) return absl::OkStatus();
  if (rows > 65535) return absl::InvalidArgumentError(absl::StrCat(rows, " rows to summarize"));
  const int64_t chunks = std::max<int64_t>(1, (n + kSummaryChunk - 1) / kSummaryChunk);
  // One scratch allocation: the summaries, then each chunk's max, sum and K best.
  auto align = [](size_t b) { return (b + 255) / 256 * 256; };
  const size_t bytes = static_cast<size_t>(rows * (2 + 2 * K)) * sizeof(float);
  const size_t parts = static_cast<size_t>(rows * chunks);
  const size_t max_b = align(parts * sizeof(float)), sum_b = align(parts * sizeof(double));
  ASSIGN_OR_RETURN(void* base, ctx.Scratch(align(bytes) + max_b + sum_b +
                                           parts * static_cast<size_t>(K) * sizeof(Cand)));
  char* p = static_cast<char*>(base);
  float* d = reinterpret_cast<float*>(p);
  float* chunk_max = reinterpret_cast<float*>(p + align(bytes));
  double* chunk_sum = reinterpret_cast<double*>(p + align(bytes) + max_b);
  Cand* chunk_best = reinterpret_cast<Cand*>(p + align(bytes) + max_b + sum_b);
  VocabChunkKernel<<<dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(rows)),
                     kSummaryThreads>>>(logits, ld, n, K, chunk_max, chunk_sum, chunk_best);
  RETURN_IF_CUDA(cudaGetLastError(), "VocabSummaries launch");
  VocabMergeKernel<<<static_cast<unsigned>(rows), kSummaryThreads>>>(
      chunk_max, chunk_sum, chunk_best, chunks, vocab_begin, K, d);
  RETURN_IF_CUDA(cudaGetLastError(), "VocabSummaries merge launch");
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

}  // namespace shardserve::cuda
