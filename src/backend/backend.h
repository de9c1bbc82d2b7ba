#pragma once
// The backend seam (DESIGN.md §5): the memory and the op set one transformer layer, the MoE
// routing, the vocab-parallel head and the token choice need. model/transformer.cc writes the
// stage's loop once against it; backend/cpu and backend/cuda implement it. No backend type (no
// CUDA type) appears here.
//
// Memory: every pointer an op takes is in the backend's memory (host memory on the CPU, device
// memory on a GPU) unless its comment says "host". Ops may return before their work is done;
// Synchronize() waits, and every copy to host memory waits for the work before it.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "backend/dtype.h"

namespace shardserve {

// A row-major weight matrix [rows][cols] (Hugging Face [out_features][in_features]), possibly a
// slice: row r starts at data + r * row_stride elements.
struct WeightMatrix {
  DType dtype = DType::kF32;
  const void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;
};

// One projection's matrices over a stage's local experts [expert_begin, expert_begin + count),
// all of one dtype and shape: `data` is an array (in backend memory) of `count` pointers to
// row-major [rows][cols] matrices.
struct ExpertTable {
  DType dtype = DType::kBF16;
  const void* const* data = nullptr;
  int64_t expert_begin = 0, count = 0, rows = 0, cols = 0;
};

// One projection's LoRA factors for every adapter slot of a replica, as Backend::LoraAdd reads
// them (model/lora.h): slot s's A (rank[s] x in) and B transposed (bt: rank[s] x out, so that a
// row's update is a sum of contiguous rows), F32 row-major, and its scale; rank 0 where the slot
// has no update of this projection. The four arrays (`slots`
// entries each) and the matrices are in backend memory; max_rank bounds every rank.
struct LoraTable {
  const float* const* a = nullptr;
  const float* const* bt = nullptr;
  const int32_t* rank = nullptr;
  const float* scale = nullptr;
  int64_t slots = 0, in = 0, out = 0, max_rank = 0;
};

// One row's sampling parameters and its generator's uniform draw in [0, 1) (model/sampler.h).
struct SampleSpec {
  float temperature = 0;  // 0: greedy
  float top_p = 1;
  int32_t top_k = 0;  // 0: no limit
  double u = 0;
};

// What a layer's attention adds to plain causal attention (gpt-oss): a sliding window (a row at
// position p attends to [p - window + 1, p]; 0: to [0, p]) and a sink logit per local head,
// added to the softmax's denominator (`sinks`: heads floats in backend memory; null: none).
struct AttentionExtras {
  int64_t window = 0;
  const float* sinks = nullptr;
};

// Backend memory that grows: contents are undefined after a Reserve that grows it.
class Buffer {
 public:
  virtual ~Buffer() = default;
  virtual absl::Status Reserve(size_t bytes) = 0;
  virtual void* data() const = 0;
  virtual size_t size() const = 0;
  template <typename T>
  T* as() const {
    return static_cast<T*>(data());
  }
};

class Backend;

// How a KV cache keeps its values (spec.serving.kvCacheDtype): F32, F16, BF16 (rounded to
// nearest even), or FP8 E4M3 (DType::kF8E4M3), value = scale * e4m3, with one scale per layer
// for K and one for V (the checkpoint's k_scale / v_scale; a latent cache uses k_scale alone),
// values past +-448 * scale saturated. Empty scales: 1. The ops convert on write and read; every
// product and sum stays F32.
struct KvFormat {
  DType dtype = DType::kF32;
  std::vector<float> k_scale, v_scale;
  float KScale(int64_t layer) const { return Of(k_scale, layer); }
  float VScale(int64_t layer) const { return Of(v_scale, layer); }
  static float Of(const std::vector<float>& scales, int64_t layer) {
    return layer >= 0 && static_cast<size_t>(layer) < scales.size() ? scales[layer] : 1.f;
  }
};
// Whether a backend's KV cache can hold `dtype` (F32, F16, BF16, F8_E4M3).
constexpr bool IsKvDType(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16 ||
         dtype == DType::kF8E4M3;
}
// AllocKv's check of a format: a dtype a cache holds, every scale finite and positive.
inline absl::Status CheckKvFormat(const KvFormat& format) {
  if (!IsKvDType(format.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a KV cache cannot hold ", DTypeName(format.dtype)));
  }
  for (const std::vector<float>* scales : {&format.k_scale, &format.v_scale}) {
    for (size_t l = 0; l < scales->size(); ++l) {
      const float s = (*scales)[l];
      if (!(s > 0) || !std::isfinite(s)) {
        return absl::InvalidArgumentError(
            absl::StrCat("layer ", l, "'s KV cache scale ", s, " is not a finite positive number"));
      }
    }
  }
  return absl::OkStatus();
}

// The storage of one KV cache (model/kv_cache.h keeps its block tables): `layers` layers of K and
// V, each [blocks][kv_heads][block_size][head_dim] values of format.dtype, in the memory of the
// backend that made it (`owner`); each backend's ops take only their own.
class KvStorage {
 public:
  virtual ~KvStorage() = default;
  // One layer's K (kv 0) or V (kv 1) of one block: [kv_heads][block_size][head_dim] values,
  // contiguous (a latent cache: kv 0 alone, [block_size][dim]) — what moves between replicas.
  virtual void* block_data(int64_t layer, int kv, int64_t block) const = 0;
  virtual size_t block_bytes() const = 0;
  // Whether block_data is host memory (else the owner's device memory).
  virtual bool on_host() const = 0;
  const Backend* owner = nullptr;
  KvFormat format;
};

class Backend {
 public:
  virtual ~Backend() = default;
  // Whether Upload copies the weights: the host views (and the mapped pages behind them) are
  // then no longer needed once the model is loaded.
  virtual bool copies_weights() const = 0;
  // Whether its Buffers are host memory, which any thread may allocate and fill (a LoRA adapter
  // is then laid out in its slot's memory off the step thread: model/transformer.h).
  virtual bool host_memory() const = 0;

  // --- Memory
  virtual std::unique_ptr<Buffer> NewBuffer() = 0;
  // A host matrix (a view into a mapped file, or memory the caller keeps) usable by the ops; the
  // backend keeps what it copies until it is destroyed.
  virtual absl::StatusOr<WeightMatrix> Upload(const WeightMatrix& host) = 0;
  // A host vector in backend memory, kept until the backend is destroyed; null when empty.
  virtual absl::StatusOr<const float*> Upload(const std::vector<float>& host) = 0;
  virtual absl::Status CopyFromHost(void* dst, const void* host, size_t bytes) = 0;
  virtual absl::Status CopyToHost(void* host, const void* src, size_t bytes) = 0;
  // Copies `height` rows of `width` bytes between pitched buffers, each in host or backend memory.
  virtual absl::Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                              size_t width, size_t height) = 0;
  virtual absl::Status Zero(void* p, size_t bytes) = 0;
  virtual absl::Status Synchronize() = 0;

  // --- KV caches (as many as the memory holds), in `format` (IsKvDType; InvalidArgument else)
  virtual absl::StatusOr<std::unique_ptr<KvStorage>> AllocKv(int64_t layers, int64_t blocks,
                                                             int64_t kv_heads, int64_t block_size,
                                                             int64_t head_dim,
                                                             const KvFormat& format) = 0;

  // --- Layer ops (activations F32)
  // Vocab-parallel embedding: out[i] = float(table row ids[i] - vocab_begin) for ids in
  // [vocab_begin, vocab_end), zeros otherwise (summed over the TP group afterwards).
  virtual absl::Status Embed(const WeightMatrix& table, const int32_t* ids, int64_t n,
                             int64_t vocab_begin, int64_t vocab_end, float* out) = 0;
  // RMSNorm of M rows of dim floats: out = x / rms(x) * w; out may be x.
  virtual absl::Status RmsNorm(const float* x, int64_t M, int64_t dim, const float* w, float eps,
                               float* out) = 0;
  // x[m] += y[m], then out[m] = RmsNorm(x[m]) as above, for M rows of dim: a layer's residual
  // add and the norm after it, which a backend may do in one pass. By default, Add then RmsNorm.
  virtual absl::Status AddRmsNorm(float* x, const float* y, int64_t M, int64_t dim, const float* w,
                                  float eps, float* out) {
    if (absl::Status s = Add(x, y, M * dim); !s.ok()) return s;
    return RmsNorm(x, M, dim, w, eps, out);
  }
  // y[m][n] = sum_k w[n][k] * x[m][k] for m < M (x and y with row strides w.cols and w.rows).
  virtual absl::Status Gemm(const WeightMatrix& w, const float* x, int64_t M, float* y) = 0;
  // Gemm of n weight matrices with the same cols that read the same x (a layer's q, k and v
  // projections; gate and up), ys[i] with row stride ws[i]->rows: one op, so that a backend can
  // prepare x once and spread all the rows over its threads at once (GemmGroupSameCols). Matrices
  // with different cols are refused.
  absl::Status GemmGroup(const WeightMatrix* const* ws, float* const* ys, size_t n, const float* x,
                         int64_t M) {
    for (size_t i = 1; i < n; ++i) {
      if (ws[i]->cols != ws[0]->cols) {
        return absl::InvalidArgumentError(absl::StrCat(
            "GemmGroup: matrix ", i, " has ", ws[i]->cols, " columns, matrix 0 has ", ws[0]->cols));
      }
    }
    return GemmGroupSameCols(ws, ys, n, x, M);
  }
  // GemmGroup's work, its matrices checked. By default, Gemm for each.
  virtual absl::Status GemmGroupSameCols(const WeightMatrix* const* ws, float* const* ys, size_t n,
                                         const float* x, int64_t M) {
    for (size_t i = 0; i < n; ++i) {
      if (absl::Status s = Gemm(*ws[i], x, M, ys[i]); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  // x[r][c] += bias[c] for rows x cols; x[i] += y[i]; a[i] = silu(a[i]) * b[i].
  virtual absl::Status AddBias(float* x, int64_t rows, int64_t cols, const float* bias) = 0;
  virtual absl::Status Add(float* x, const float* y, int64_t n) = 0;
  virtual absl::Status SiluMul(float* a, const float* b, int64_t n) = 0;
  // gpt-oss's clamped SwiGLU: g = min(a[i], limit), u = clamp(b[i], -limit, limit),
  // a[i] = (u + 1) * g * sigmoid(alpha * g).
  virtual absl::Status SwiGluClamped(float* a, const float* b, int64_t n, float alpha,
                                     float limit) = 0;
  // Rotary embedding (rotate_half layout, as model/rope.h) of `heads` heads of head_dim per row,
  // row r at position positions[r]; inv_freq holds head_dim / 2 floats.
  virtual absl::Status Rope(float* x, int64_t rows, int64_t heads, int64_t head_dim,
                            const int32_t* positions, const float* inv_freq) = 0;
  // Writes each row's k and v (kv_heads * head_dim floats, converted to the cache's format) into
  // layer `layer` of `kv` at its position:
  // block blocks[block_offset[r] + pos / block_size], slot pos % block_size.
  virtual absl::Status WriteKv(const KvStorage& kv, int64_t layer, const float* k, const float* v,
                               int64_t rows, const int32_t* positions, const int32_t* blocks,
                               const int32_t* block_offset) = 0;
  // Causal attention of every row's `heads` query heads over positions [0, positions[r]] of its
  // sequence in layer `layer` of `kv` (blocks at block_offset[r]); head h reads KV head
  // (head0 + h) / group - kv_head0. Writes rows x heads x head_dim floats; max_len bounds every
  // row's positions + 1. `extras` narrows it to a window and adds sinks (gpt-oss).
  virtual absl::Status Attention(const KvStorage& kv, int64_t layer, const float* q, int64_t rows,
                                 int64_t heads, int64_t head0, int64_t group, int64_t kv_head0,
                                 const int32_t* positions, const int32_t* blocks,
                                 const int32_t* block_offset, int64_t max_len, float scale,
                                 const AttentionExtras& extras, float* out) = 0;
  // --- Multi-head latent attention (DeepSeek-V3's MLA; model/transformer.cc)
  // Per-head products: for each of `rows` rows and each head h < heads,
  // y[r * ldy + h * y_head + n] = sum_k w[h * N + n][k] * x[r * ldx + h * x_head + k] for
  // n < N = w.rows / heads, k < w.cols: head h's matrix is rows [h * N, (h + 1) * N) of w (F32,
  // F16 or BF16).
  virtual absl::Status HeadGemm(const WeightMatrix& w, int64_t heads, const float* x, int64_t ldx,
                                int64_t x_head, int64_t rows, float* y, int64_t ldy,
                                int64_t y_head) = 0;
  // A latent KV cache: per layer [blocks][block_size][latent_dim + rope_dim] values of
  // format.dtype, one vector a position that every head reads (the compressed latent, then the
  // rotated key dims).
  virtual absl::StatusOr<std::unique_ptr<KvStorage>> AllocLatentKv(int64_t layers, int64_t blocks,
                                                                   int64_t block_size,
                                                                   int64_t latent_dim,
                                                                   int64_t rope_dim,
                                                                   const KvFormat& format) = 0;
  // Writes each row's latent (latent_dim floats of `latent`) and rotated key (rope_dim floats of
  // `rope`) into layer `layer` of a latent cache at its position, as WriteKv places them.
  virtual absl::Status WriteLatentKv(const KvStorage& kv, int64_t layer, const float* latent,
                                     const float* rope, int64_t rows, const int32_t* positions,
                                     const int32_t* blocks, const int32_t* block_offset) = 0;
  // Causal attention of every row's `heads` heads over positions [0, positions[r]] of a latent
  // cache: head h scores position p as scale * (q_latent[r][h] . latent_p + q_rope[r][h] .
  // rope_p) (q_latent rows x heads x latent_dim, q_rope rows x heads x rope_dim) and writes the
  // softmax-weighted sum of the latents (rows x heads x latent_dim floats).
  virtual absl::Status LatentAttention(const KvStorage& kv, int64_t layer, const float* q_latent,
                                       const float* q_rope, int64_t rows, int64_t heads,
                                       const int32_t* positions, const int32_t* blocks,
                                       const int32_t* block_offset, int64_t max_len, float scale,
                                       float* out) = 0;

  // out[i] = x[rows[i]] (dim floats each) for i < n; y[rows[i]] += weight[i] * x[i].
  virtual absl::Status GatherRows(const float* x, int64_t dim, const int32_t* rows, int64_t n,
                                  float* out) = 0;
  virtual absl::Status ScaleAddRows(const float* x, int64_t dim, const int32_t* rows,
                                    const float* weight, int64_t n, float* y) = 0;

  // --- LoRA: the gathered product of a batch whose rows run different adapters (Punica's BGMV)
  // y[r][n] += scale[s] * sum_j bt_s[j][n] * sum_k a_s[j][k] * x[r][k] for each row r < rows whose
  // slot s = row_slot[r] is in [0, t.slots) with rank[s] > 0; other rows (the base model: slot
  // -1) are left as they are. x: rows x t.in floats, y: rows x t.out; `scratch`: rows x
  // t.max_rank floats of backend memory the op may overwrite.
  virtual absl::Status LoraAdd(const LoraTable& t, const int32_t* row_slot, int64_t rows,
                               const float* x, float* y, float* scratch) = 0;

  // --- MoE
  // Per row of rows x E router logits the k best experts (ties to the lower id) and their
  // weights: with `normalize`, the softmax over those k (Mixtral; Qwen3-MoE's norm_topk_prob);
  // without, their share of the softmax over all E (which sums to less than 1).
  // experts[rows * k], weights[rows * k].
  virtual absl::Status RouteTopK(const float* logits, int64_t rows, int64_t E, int64_t k,
                                 bool normalize, int32_t* experts, float* weights) = 0;
  // DeepSeek-V3's routing, per row of rows x E router logits: scores s = sigmoid(logit), chosen
  // by s + bias (bias: E floats) among the experts of the topk_groups best of `groups` equal
  // groups (a group scored by the sum of its two best; groups == 1: every expert), the k best
  // (ties to the lower id, groups too); each weighted by its s, divided by the k's sum when
  // `normalize`, times `scaling`. experts[rows * k], weights[rows * k].
  virtual absl::Status RouteGrouped(const float* logits, const float* bias, int64_t rows, int64_t E,
                                    int64_t k, int64_t groups, int64_t topk_groups, bool normalize,
                                    float scaling, int32_t* experts, float* weights) = 0;
  // Whether ExpertMatVec is the better way to run a batch of at most one (row, expert) slot per
  // local expert (the GPU's decode path: no host round trip). Otherwise the routes come to the
  // host and each local expert runs its rows as one Gemm.
  virtual bool per_slot_experts() const = 0;
  // For each of `slots` (row, expert) assignments: y[slot] = W_expert(slot) x[slot / x_div], with
  // experts[slot] the expert; a slot whose expert is not local gets zeros.
  virtual absl::Status ExpertMatVec(const ExpertTable& w, const int32_t* experts, int64_t slots,
                                    const float* x, int64_t x_div, float* y) = 0;
  // y[r] = sum over j < k of weights[r * k + j] * x[r * k + j] (dim floats each).
  virtual absl::Status CombineSlots(const float* x, const float* weights, int64_t rows, int64_t k,
                                    int64_t dim, float* y) = 0;

  // --- Token choice (model/vocab_parallel.h, model/sampler.h)
  // The summary of each of `rows` rows of n logits (row stride ld) of the vocabulary slice that
  // starts at id vocab_begin: max, sum of exp(logit - max), then the K best (logit, id) pairs
  // (ties to the lower id), -inf where the slice has fewer than K. rows * (2 + 2K) floats to
  // `out` (host).
  virtual absl::Status VocabSummaries(const float* logits, int64_t rows, int64_t ld, int64_t n,
                                      int64_t vocab_begin, int64_t K, float* out) = 0;
  // One token per row of rows x V logits, as Sampler::Sample: sorted by logit (ties to the lower
  // id), top-k, top-p over exp((logit - best) / temperature), then the draw u on the cumulative
  // weights. Host outputs: ids[rows], logprobs[rows] (log-softmax of the raw logits) and the K
  // best of each row (top_ids, top_logprobs: rows * K, best first).
  virtual absl::Status SampleRows(const float* logits, int64_t rows, int64_t V,
                                  const SampleSpec* specs, int64_t K, int32_t* ids, float* logprobs,
                                  int32_t* top_ids, float* top_logprobs) = 0;
};

}  // namespace shardserve
