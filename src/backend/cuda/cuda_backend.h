#pragma once
// The CUDA backend (built with SHARDSERVE_CUDA). This header exposes no CUDA types: device memory
// is an opaque pointer owned by DeviceBuffer. Kernels take device pointers and run on the current
// device's default stream; they return after the work is queued (Synchronize() waits).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "backend/backend.h"

namespace shardserve::cuda {

// The decode attention kernel to force (the worker contract's SHARDSERVE_CUDA_ATTN_KERNEL):
// split (split-K, a block per group of query heads sharing a KV head), split-batched (the same
// with more loads in flight a warp) or heads (a block per query head and split); empty, Attention
// chooses by shape. Any other name is an error naming it. A window or sinks always take the
// per-head kernel.
enum class AttentionKernel { kByShape, kSplit, kSplitBatched, kHeads };
absl::StatusOr<AttentionKernel> AttentionKernelNamed(std::string_view name);

// The quantized decode GEMV (SHARDSERVE_CUDA_QUANT_GEMV): dp4a (the default: the inputs
// quantized to int8 per 32, the GGUF types' chunks read as integers, four products an
// instruction; FP8 keeps the float kernel) or float (each lane expands a chunk of the blocks to
// F32 and multiplies it with F32 inputs). Measured on an H200 (bench/cuda-notes.md, 2026-11-30):
// Llama-3-8B Q4_K at batch 1, 277.6 tok/s with dp4a against 153.0 with float. Any other name is
// an error naming it.
enum class QuantGemvMode { kFloat, kDp4a };
absl::StatusOr<QuantGemvMode> QuantGemvNamed(std::string_view name);

// FP8's decode GEMV (SHARDSERVE_CUDA_FP8_GEMV; F8_128 blocks): direct (the default: each lane
// reads 4 bytes of every block straight from memory, 128 bytes a warp a load, and multiplies them
// with F32 inputs; 187.5 tok/s for the Llama-3-8B shape at batch 1 on an H200) or staged (the
// quantized float kernel, a warp staging 32-value chunks through shared memory; 148.0 tok/s in
// the same run). Any other name is an error naming it.
enum class Fp8GemvMode { kStaged, kDirect };
absl::StatusOr<Fp8GemvMode> Fp8GemvNamed(std::string_view name);

// The kernels a backend runs where it has several; NewBackend takes them, Context keeps them.
struct KernelChoice {
  AttentionKernel attention = AttentionKernel::kByShape;
  QuantGemvMode quant_gemv = QuantGemvMode::kDp4a;
  Fp8GemvMode fp8_gemv = Fp8GemvMode::kDirect;
};

// Number of usable GPUs; 0 when there is no GPU or no driver.
int DeviceCount();
// The backend seam (backend/backend.h) on GPU `device`: the ops below on its default stream,
// weights copied to the device (backend/cuda/backend.cc), running the kernels `kernels` chooses.
absl::StatusOr<std::unique_ptr<Backend>> NewBackend(int device, KernelChoice kernels = {});
absl::Status Synchronize();
// The device's memory bandwidth as a copy measures it: bytes read + written per second of
// cudaMemcpy between two device buffers of `bytes` (best of `reps`).
absl::StatusOr<double> CopyBandwidth(size_t bytes, int reps = 10);
// Sets `bytes` of device memory at p to zero.
absl::Status Zero(void* p, size_t bytes);
// Starts (true) or stops a profiled range: `ncu --profile-from-start off` measures the kernels
// between the two (bench cuda --profile-steps).
absl::Status ProfilerRange(bool start);

class DeviceBuffer {
 public:
  static absl::StatusOr<DeviceBuffer> Alloc(size_t bytes);
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  absl::Status CopyFromHost(const void* src, size_t bytes);
  absl::Status CopyToHost(void* dst, size_t bytes) const;
  void* data() const { return ptr_; }
  size_t size() const { return size_; }

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

// Per-device state the ops share: the cuBLAS handle, a scratch buffer that grows as needed, and
// the kernels chosen.
// One Context per thread of work; the ops run on the device's default stream.
class Context {
 public:
  static absl::StatusOr<std::unique_ptr<Context>> Create(int device = 0, KernelChoice kernels = {});
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  // At least `bytes` of device scratch, valid until the next call.
  absl::StatusOr<void*> Scratch(size_t bytes);
  const KernelChoice& kernels() const;
  struct Impl;
  Impl* impl() const { return impl_.get(); }

 private:
  explicit Context(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// RMSNorm of M rows of dim floats: out = x / rms(x) * w (all device pointers, F32).
absl::Status RmsNorm(const float* x, int64_t M, int64_t dim, const float* w, float eps, float* out);
// x += y, then out = RmsNorm(x): the residual add and the next norm in one pass.
absl::Status AddRmsNorm(float* x, const float* y, int64_t M, int64_t dim, const float* w, float eps,
                        float* out);

// Whether weights of this block-quantized dtype have kernels: the GGUF types Q8_0, Q4_0, Q4_1,
// Q4_K, Q5_K and Q6_K, kept on the device in ggml's layouts as the file has them (quant.cu).
bool RunsQuantized(DType dtype);

// y[m][n] = sum_k w[n][k] * x[m][k] (F32 x and y with row strides K and N), F32 accumulate. Up
// to 8 rows with whole 16-byte weight rows: a GEMV that keeps x in F32 (decode; quantized
// weights: their blocks expanded in registers); otherwise cuBLAS, with x rounded to the weight's
// dtype first for F16/BF16 (tensor cores; quantized weights: tiles of rows expanded into BF16).
absl::Status Gemm(Context& ctx, const WeightMatrix& w, const float* x, int64_t M, float* y);

// Gemm of n matrices with the same cols that read the same x (Backend::GemmGroup): up to four
// decode-shaped (GEMV) products as one launch, otherwise one Gemm each.
absl::Status GemmGroup(Context& ctx, const WeightMatrix* const* ws, float* const* ys, size_t n,
                       const float* x, int64_t M);

// Vocab-parallel embedding: out[i] = float(table row ids[i] - vocab_begin) for ids in
// [vocab_begin, vocab_end), zeros otherwise (summed over the TP group afterwards).
absl::Status Embed(const WeightMatrix& table, const int32_t* ids, int64_t n, int64_t vocab_begin,
                   int64_t vocab_end, float* out);

// x[r][c] += bias[c] for rows x cols; x[i] += y[i]; a[i] = silu(a[i]) * b[i].
absl::Status AddBias(float* x, int64_t rows, int64_t cols, const float* bias);
absl::Status Add(float* x, const float* y, int64_t n);
absl::Status SiluMul(float* a, const float* b, int64_t n);
// gpt-oss's clamped SwiGLU, as Backend::SwiGluClamped.
absl::Status SwiGluClamped(float* a, const float* b, int64_t n, float alpha, float limit);

// Rotary embedding (rotate_half layout, as model/rope.h) of `heads` heads of head_dim per row,
// row r at position positions[r]; inv_freq holds head_dim / 2 floats.
absl::Status Rope(float* x, int64_t rows, int64_t heads, int64_t head_dim, const int32_t* positions,
                  const float* inv_freq);

// The block KV cache of one layer on the device: K and V of [blocks][kv_heads][block_size][hd]
// values of `dtype` (the layout and the format of Backend::AllocKv), K times k_scale, V times
// v_scale.
struct DeviceKv {
  void* k = nullptr;
  void* v = nullptr;
  int64_t kv_heads = 0, block_size = 0, head_dim = 0;
  DType dtype = DType::kF32;
  float k_scale = 1, v_scale = 1;
};

// Writes each row's k and v (kv_heads * head_dim floats) at its position: block
// blocks[block_offset[r] + pos / block_size], slot pos % block_size.
absl::Status WriteKv(const DeviceKv& cache, const float* k, const float* v, int64_t rows,
                     const int32_t* positions, const int32_t* blocks, const int32_t* block_offset);

// Causal attention of every row's `heads` query heads over positions [0, positions[r]] of its
// sequence (blocks at block_offset[r]); head h reads KV head (head0 + h) / group - kv_head0.
// Writes rows x heads x head_dim floats; scale is 1/sqrt(head_dim).
absl::Status Attention(Context& ctx, const DeviceKv& cache, const float* q, int64_t rows,
                       int64_t heads, int64_t head0, int64_t group, int64_t kv_head0,
                       const int32_t* positions, const int32_t* blocks, const int32_t* block_offset,
                       int64_t max_len, float scale, const AttentionExtras& extras, float* out);

// One layer of a latent KV cache on the device (Backend::AllocLatentKv):
// [blocks][block_size][latent_dim + rope_dim] values of `dtype`, each times `scale`.
struct DeviceLatentKv {
  void* data = nullptr;
  int64_t block_size = 0, latent_dim = 0, rope_dim = 0;
  DType dtype = DType::kF32;
  float scale = 1;
};
// Backend::WriteLatentKv and Backend::LatentAttention on one layer (latent_dim up to 512,
// rope_dim up to 128).
absl::Status WriteLatentKv(const DeviceLatentKv& cache, const float* latent, const float* rope,
                           int64_t rows, const int32_t* positions, const int32_t* blocks,
                           const int32_t* block_offset);
absl::Status LatentAttention(const DeviceLatentKv& cache, const float* q_latent,
                             const float* q_rope, int64_t rows, int64_t heads,
                             const int32_t* positions, const int32_t* blocks,
                             const int32_t* block_offset, float scale, float* out);
// Backend::HeadGemm: per-head products with F32 accumulation (F32, F16 or BF16 weights).
absl::Status HeadGemm(const WeightMatrix& w, int64_t heads, const float* x, int64_t ldx,
                      int64_t x_head, int64_t rows, float* y, int64_t ldy, int64_t y_head);

// out[i] = x[rows[i]] (dim floats each) for i < n; y[rows[i]] += weight[i] * x[i].
absl::Status GatherRows(const float* x, int64_t dim, const int32_t* rows, int64_t n, float* out);
absl::Status ScaleAddRows(const float* x, int64_t dim, const int32_t* rows, const float* weight,
                          int64_t n, float* y);

// Token choice. Logits are on the device; the few numbers of the choice come back to host memory.
//
// The summary of each of `rows` rows of n logits (row stride ld) of the vocabulary slice that
// starts at id vocab_begin, in the layout model/vocab_parallel.h exchanges across a TP group:
// max, sum of exp(logit - max), then the K best (logit, id) pairs (ties to the lower id), -inf
// where the slice has fewer than K. Writes rows * (2 + 2K) floats to `out` (host).
absl::Status VocabSummaries(Context& ctx, const float* logits, int64_t rows, int64_t ld, int64_t n,
                            int64_t vocab_begin, int64_t K, float* out);

// Samples one token per row of `rows` x V logits exactly as model/sampler.h (Sampler::Sample)
// does on the host: the row sorted by logit (ties to the lower id), top-k, then top-p over
// exp((logit - best) / temperature), then the draw u on the cumulative weights. Host outputs:
// ids[rows], logprobs[rows] (log-softmax of the raw logits) and the K best of each row with their
// log-probabilities (top_ids, top_logprobs: rows * K, best first).
absl::Status SampleRows(Context& ctx, const float* logits, int64_t rows, int64_t V,
                        const SampleSpec* specs, int64_t K, int32_t* ids, float* logprobs,
                        int32_t* top_ids, float* top_logprobs);

// Copies `height` rows of `width` bytes between pitched buffers (device or host, either way).
absl::Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                    size_t height);

// MoE routing, as Backend::RouteTopK: per row of `rows` x E router logits the k
// best experts (ties to the lower id) and their weights (the softmax over those k, or with
// normalize false their share of the softmax over all E). Writes
// experts[rows * k] and weights[rows * k] (device).
absl::Status RouteTopK(const float* logits, int64_t rows, int64_t E, int64_t k, bool normalize,
                       int32_t* experts, float* weights);
// DeepSeek-V3's routing, as Backend::RouteGrouped (groups up to 64).
absl::Status RouteGrouped(const float* logits, const float* bias, int64_t rows, int64_t E,
                          int64_t k, int64_t groups, int64_t topk_groups, bool normalize,
                          float scaling, int32_t* experts, float* weights);
// For each of `slots` (row, expert) assignments: y[slot] = W_expert(slot) x[slot / x_div], with
// experts[slot] the expert; a slot whose expert is not local gets zeros. Reads only the assigned
// experts' weights: the decode path of a MoE layer, no host round trip.
absl::Status ExpertMatVec(const ExpertTable& w, const int32_t* experts, int64_t slots,
                          const float* x, int64_t x_div, float* y);
// LoRA's gathered product of a batch of rows of different adapters, as Backend::LoraAdd (rows up
// to 65535).
absl::Status LoraAdd(const LoraTable& t, const int32_t* row_slot, int64_t rows, const float* x,
                     float* y, float* scratch);
// y[r] = sum over j < k of weights[r * k + j] * x[r * k + j] (dim floats each), for rows rows.
absl::Status CombineSlots(const float* x, const float* weights, int64_t rows, int64_t k,
                          int64_t dim, float* y);

}  // namespace shardserve::cuda
