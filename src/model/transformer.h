#pragma once
// The Llama-family / Mixtral / Qwen2 / Qwen3 / DeepSeek-V3 transformer, written once over the
// backend seam (backend/backend.h): the CPU backend runs it in host memory with the weights left in
// the mapped safetensors files; the CUDA backend with weights, activations and the KV cache on the
// device. Loading validates every tensor on the host and hands this rank's slices to the backend,
// which uses the mapped views (CPU) or copies them (GPU, after which the mapped pages leave the
// process's resident memory and the column slices read for it are freed).
//
// A step is Run() and then one of its outputs, all of which stay in backend memory until asked
// for. Per step only the batch layout goes to the backend (token ids, positions, block tables),
// and only the choice of the next tokens comes back: the greedy summaries (2 + 2K floats a
// sequence) or the sampled ids and log-probabilities. Not thread-safe: one step at a time (the
// backend parallelizes internally).
//
// Sharded (DESIGN.md §5): one instance is one rank. Tensor parallelism (Megatron) over the
// stage's TP group: q/k/v and gate/up column-parallel (output rows split), o_proj and down_proj
// row-parallel (input columns split) followed by one all-reduce each; attention heads and KV
// heads split (KV heads replicated when the group outnumbers them); Mixtral experts split across
// the group (one all-reduce of the MoE output); embedding and LM head vocab-parallel. Pipeline
// parallelism: the rank runs layers [layer_begin, layer_end); the first stage embeds tokens, the
// others take hidden states; the last stage produces logits, the others hidden states. The TP
// communicator takes pointers in the backend's memory (host: the shared-memory group; GPU: NCCL).
#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "api/kv_cache_dtype.h"
#include "backend/backend.h"
#include "comm/communicator.h"
#include "common/prefetch.h"
#include "model/config.h"
#include "model/kv_cache.h"
#include "model/lora.h"
#include "model/safetensors.h"
#include "model/sampler.h"

namespace shardserve {

// A LoRA adapter's share of one rank, laid out as a slot holds it (Transformer::PrepareLora):
// each module's A and B transposed at its offsets (in floats). Where the backend's memory is the
// host's, in a backend buffer that slots share (installing it copies nothing); else in host
// memory, copied into a slot's buffer when installed.
struct PreparedLora {
  struct Piece {
    int64_t layer = 0;  // of the stage
    LoraTarget target = LoraTarget::kQ;
    int64_t rank = 0;
    float scale = 0;
    size_t a_at = 0, b_at = 0;
  };
  std::vector<Piece> pieces;
  std::vector<float> host;
  std::shared_ptr<Buffer> mem;
};

struct SequenceChunk {
  std::vector<int32_t> tokens;  // new tokens of this sequence
  SequenceKv* kv = nullptr;     // positions [kv->length, kv->length + tokens.size()) are new
  int32_t lora_slot = -1;       // the LoRA adapter its rows run (Transformer::LoadLora); -1: none
  // The chunk's last rows whose logits the last stage computes, in order (speculative decoding
  // verifies drafted tokens on 1 + drafts rows); at least 1, at most tokens.size().
  int64_t logit_rows = 1;
};

// A batch of chunks, validated and with its cache blocks reserved, laid out for the backend's
// ops: each new token (row) has its id, its position and the offset of its sequence's block table
// in `blocks`; the rows whose logits are computed (each chunk's last logit_rows), in order;
// max_len bounds every row's position + 1.
struct BatchLayout {
  int64_t rows = 0, max_len = 0;
  std::vector<int32_t> ids, positions, blocks, block_offset, last_row;
  std::vector<int32_t> lora_slots;  // each row's; empty when no chunk runs an adapter
};

class Transformer {
 public:
  struct Options {
    int num_threads = 1;  // of the CPU backend Load makes when given none
    int tp_size = 1;
    int tp_rank = 0;
    Communicator* tp_comm = nullptr;  // the stage's TP group; required when tp_size > 1
    int64_t layer_begin = 0;
    int64_t layer_end = -1;  // -1: through the last layer
    // FP8 weights kept as DType::kF8_128 where their blocks allow (the default), or expanded into
    // the model's dtype everywhere (the worker contract's SHARDSERVE_FP8=expand).
    bool fp8_blocks = true;
    // Told the share of the stage's weights bound so far, in [0, 1]: at the start, after the
    // embeddings and head, and after each layer (a start-up watchdog reads it).
    std::function<void(double)> progress = nullptr;
    // Threads that read the stage's weight files into the page cache while the layers are bound
    // (common/prefetch.h), the TP group sharing the pieces; 0: none (binding faults pages in).
    int read_threads = 2;
    // LoRA adapters held at once (the replica's maxLoras slots) and the largest rank any may have
    // (maxLoraRank); 0 slots: none.
    int lora_slots = 0;
    int64_t lora_max_rank = 0;
    // How the KV caches keep their values (api/kv_cache_dtype.h; auto: the model's dtype).
    KvCacheDtype kv_cache_dtype = KvCacheDtype::kAuto;
    // The last stage also loads the checkpoint's multi-token-prediction layer (DeepSeek-V3's
    // nextn layer, num_nextn_predict_layers; speculative method mtp) and runs it with Mtp. Refused
    // for a model without one.
    bool mtp = false;
  };
  // Reads config.json and the safetensors weights of `model_dir` and validates every tensor the
  // architecture needs (presence, shape). Errors name the tensor and the shapes; a shape that
  // does not split over tp_size names the dimension and both numbers. `backend` runs the model;
  // null: the CPU backend with options.num_threads threads.
  static absl::StatusOr<std::unique_ptr<Transformer>> Load(const std::string& model_dir,
                                                           const Options& options,
                                                           std::unique_ptr<Backend> backend = {});
  ~Transformer();

  const ModelConfig& config() const { return config_; }
  Backend& backend() { return *backend_; }
  size_t weight_bytes() const { return weights_->total_bytes(); }  // of the model's files

  // A cache sized for `positions` total positions across all sequences, its storage in the
  // backend; a model may have several.
  absl::StatusOr<std::unique_ptr<KvCache>> NewKvCache(int64_t positions, int64_t block_size = 16);
  // Bytes of KV storage one cache block takes on this rank.
  size_t kv_block_bytes(int64_t block_size = 16) const;
  // How this rank's KV caches keep their values: the dtype Options chose (auto resolved) and,
  // for FP8, the checkpoint's per-layer scales of the stage's layers.
  const KvFormat& kv_format() const { return kv_format_; }

  // The input of a stage after the first: the previous stage's rows x hidden floats, from host
  // memory or received from member `peer` of `link` (a communicator on backend memory).
  absl::Status HiddenFromHost(const float* hidden, int64_t rows);
  absl::Status ReceiveHidden(Communicator& link, int peer, int64_t rows);
  // Runs this rank's layers on a batch: the first stage embeds the chunks' tokens, a later one
  // takes the input given just before for as many rows (one row of hidden_size floats per new
  // token, in chunk order). Reserves cache blocks for the new positions (ResourceExhausted if the
  // cache is full; nothing is written then) and advances every kv->length. Token ids outside the
  // vocabulary and positions beyond the context are InvalidArgument.
  absl::Status Run(std::vector<SequenceChunk>& chunks, KvCache& cache);
  // After Run on a stage before the last: its hidden states to host memory, or sent to member
  // `peer` of `link`.
  absl::Status HiddenToHost(std::vector<float>& out);
  absl::Status SendHidden(Communicator& link, int peer);
  // After Run on the last stage: this rank's vocab-parallel slice of the logits of the chunks'
  // logit rows (SequenceChunk::logit_rows, one a chunk unless asked), each a row of
  // logits_stride() floats whose first vocab_end() - vocab_begin() are ids
  // [vocab_begin(), vocab_end()).
  absl::Status LogitsToHost(std::vector<float>& out);
  // After Run on the last stage, every rank of the TP group: each logit row's greedy token, its
  // log-probability and top_logprobs alternatives. tp_group exchanges the summaries (host
  // pointers; null for one rank).
  absl::StatusOr<std::vector<SampledToken>> Greedy(int64_t top_logprobs, Communicator* tp_group);
  // After Run on the last stage (and after Greedy or Sample, whose logits it overwrites), every
  // rank of the TP group: the log-probability of targets[i] at batch row rows[i] (the prompt's
  // next token: echo with logprobs) and the top_logprobs alternatives there. The LM head runs on
  // those rows in groups of kScoreRows. tp_group as for Greedy.
  static constexpr int64_t kScoreRows = 64;
  absl::StatusOr<std::vector<SampledToken>> Score(const std::vector<int32_t>& rows,
                                                  const std::vector<int32_t>& targets,
                                                  int64_t top_logprobs, Communicator* tp_group);
  // After Run on the last stage, every rank of the TP group (the logits are gathered over the TP
  // communicator, so that a seed gives the same tokens at every TP size): on the rank that holds
  // the sequences' generators (samplers[s], null for a sequence not sampled now) each sequence's
  // token sampled with its parameters and generator, as Sampler::Sample would (a chunk of one
  // logit row each); other ranks pass an empty vector and get one back.
  absl::StatusOr<std::vector<SampledToken>> Sample(const std::vector<Sampler*>& samplers,
                                                   int64_t top_logprobs);

  // DeepSeek-V3's multi-token prediction (Options::mtp), after Run on the last stage and after
  // the step's tokens are chosen (it overwrites the logits), every rank of the TP group: the MTP
  // layer on the batch rows `rows` (ascending; those whose next token is known), row rows[i]
  // reading the model's final hidden state there (after the final norm) and the embedding of
  // next[i]: eh_proj([enorm(embed(next)), hnorm(hidden)]) (the embedding zero at position 0), its
  // decoder layer (writing the cache's MTP layer at those positions) and shared_head. Returns the
  // greedy token of each of rows[drafts[j]]: the token two positions after that row, a draft.
  // tp_group as for Greedy.
  absl::StatusOr<std::vector<int32_t>> Mtp(const std::vector<int32_t>& rows,
                                           const std::vector<int32_t>& next,
                                           const std::vector<int32_t>& drafts, KvCache& cache,
                                           Communicator* tp_group);
  bool has_mtp() const { return mtp_.enorm != nullptr; }

  // After Run on the last stage, every rank of the TP group: the full logits of each logit row
  // (rows x vocab_size, host), gathered over the TP communicator; identical on every rank.
  absl::Status GatherLogits(std::vector<float>& logits);
  // Run on host memory: `hidden_in` is a later stage's input; `out` gets LogitsToHost's or
  // HiddenToHost's output.
  absl::Status ForwardStage(std::vector<SequenceChunk>& chunks, KvCache& cache,
                            const float* hidden_in, std::vector<float>& out);
  // Run, then GatherLogits: a whole model (first and last stage).
  absl::Status Forward(std::vector<SequenceChunk>& chunks, KvCache& cache,
                       std::vector<float>& logits);
  int64_t vocab_begin() const { return vocab_begin_; }
  int64_t vocab_end() const { return vocab_end_; }
  int64_t logits_stride() const {
    return (config_.vocab_size + options_.tp_size - 1) / options_.tp_size;
  }

  // LoRA (model/lora.h): puts this rank's share of `adapter` into slot `slot` (of
  // options.lora_slots), replacing what the slot held: its stage's layers, and of each layer the
  // rows of B of the column-parallel projections (q, k, v, gate, up: this rank's outputs) and the
  // columns of A of the row-parallel ones (o, down: this rank's inputs). A chunk with that
  // lora_slot then runs it. Refused by name: a slot out of range, a rank over lora_max_rank, a
  // module of a shape this model does not have. The adapter may be freed afterwards.
  absl::Status LoadLora(int slot, const LoraAdapter& adapter);
  // LoadLora in two halves: the checks and this rank's share laid out in host memory (safe on
  // another thread while steps run: it reads only the model's shape), then the copy into a slot
  // (on the thread that runs the steps, between them).
  absl::StatusOr<PreparedLora> PrepareLora(const LoraAdapter& adapter) const;
  absl::Status InstallLora(int slot, const PreparedLora& prepared);
  // Empties a slot (its backend memory freed); a chunk may no longer name it.
  absl::Status UnloadLora(int slot);
  // Backend bytes the slot's factors take on this rank (0: empty).
  size_t lora_bytes(int slot) const;

  bool first_stage() const { return layer_begin_ == 0; }
  bool last_stage() const { return layer_end_ == config_.num_layers; }
  int64_t layer_begin() const { return layer_begin_; }
  int64_t layer_end() const { return layer_end_; }
  // Bytes of the weights this rank holds (its slices), and of the full tensors they come from
  // (the stage's weights), for the "1/T" measurement.
  size_t shard_weight_bytes() const { return shard_bytes_; }
  size_t stage_weight_bytes() const { return stage_bytes_; }

 private:
  // Validates the chunks (non-empty, ids in the vocabulary, within the context), checks the
  // cache has room (ResourceExhausted, nothing taken), then reserves it and lays out the rows.
  absl::StatusOr<BatchLayout> PrepareBatch(std::vector<SequenceChunk>& chunks,
                                           KvCache& cache) const;
  // One projection's update of one layer, `slots` entries each: the table LoraAdd reads (its
  // arrays in backend memory) and the host arrays it is copied from.
  struct LoraProjection {
    std::vector<const float*> a, bt;
    std::vector<int32_t> rank;
    std::vector<float> scale;
    std::unique_ptr<Buffer> a_mem, b_mem, rank_mem, scale_mem;
    LoraTable table;
  };
  // This rank's in and out sizes of a projection, and the rows (column-parallel: of B) or columns
  // (row-parallel: of A) of the full factor it keeps.
  struct LoraShare {
    int64_t in = 0, out = 0, begin = 0, end = 0;
    bool slices_a = false;
  };
  LoraShare LoraShareOf(LoraTarget target) const;
  absl::Status InitLora();  // options.lora_slots empty slots in every layer
  absl::Status PublishLora(LoraProjection& p);
  // y += every row's adapter update of `target` in layer `li` (no-op without adapters in the
  // batch): x rows of the projection's input, y of its output.
  absl::Status ApplyLora(int64_t li, LoraTarget target, const Buffer& x, Buffer& y, int64_t rows);
  // The weights as the backend holds them.
  struct Expert {
    WeightMatrix gate, up, down;
    const float *gate_bias = nullptr, *up_bias = nullptr, *down_bias = nullptr;  // gpt-oss
  };
  struct Layer {
    bool sparse = false;  // experts (moe_layer), else the dense MLP
    const float *input_norm = nullptr, *post_norm = nullptr;
    WeightMatrix q, k, v, o;
    const float *q_bias = nullptr, *k_bias = nullptr, *v_bias = nullptr;  // null when absent
    const float* o_bias = nullptr;
    const float *q_norm = nullptr, *k_norm = nullptr;  // per head (Qwen3), null when absent
    const float* sinks = nullptr;                      // this rank's heads' (gpt-oss)
    int64_t window = 0;                                // gpt-oss's sliding layers
    // Multi-head latent attention (DeepSeek-V3): the query's nope and rotated rows of this
    // rank's heads (from q_proj, or q_b_proj after q_a / q_a_norm), the latent and rotated rows
    // of kv_a_proj_with_mqa (replicated, as q_a), kv_b_proj's key part transposed per head
    // ([kv_lora_rank][qk_nope_dim], absorbed into the query) and value part ([v_head_dim]
    // [kv_lora_rank], applied to the attended latent). Rotated rows in rotate_half order.
    WeightMatrix q_a, q_nope, q_rope, kv_latent, kv_rope, uk_t, uv;
    const float *q_a_norm = nullptr, *kv_norm = nullptr;
    WeightMatrix gate, up, down;                       // dense MLP
    WeightMatrix router;                               // MoE
    const float* route_bias = nullptr;                 // DeepSeek-V3's e_score_correction_bias
    const float* router_bias = nullptr;                // gpt-oss's, on the router's logits
    WeightMatrix shared_gate, shared_up, shared_down;  // its shared experts, TP-sliced
    std::vector<Expert> experts;                       // this rank's, from expert_begin_
    // The experts' projections for Backend::ExpertMatVec; count 0 unless they share a dtype.
    ExpertTable gate_table, up_table, down_table;
  };
  // Backend memory, grown as batches grow.
  struct Buffers {
    std::unique_ptr<Buffer> x, h, q, k, v, attn, o, g, u, d, in, router, ids, pos, table, offsets,
        sel, weights, routes, route_weights, last, logits, padded, gathered, full, targets;
    std::unique_ptr<Buffer> qa, qr, lat, kr, qlat, olat;  // multi-head latent attention
    std::unique_ptr<Buffer> lora_rows, lora_u;            // LoRA: each row's slot, A x
  };

  Transformer(ModelConfig config, std::unique_ptr<WeightStore> weights, const Options& options,
              std::unique_ptr<Backend> backend);
  absl::Status CheckSplit() const;
  absl::Status BindWeights();
  // The byte ranges of the weight files this stage binds, in pieces (common/prefetch.h).
  std::vector<FileRange> StagePieces() const;
  // Rows [begin, end) of a weight matrix: a view into the mapping (contiguous, so only those
  // pages ever become resident), in the backend.
  absl::StatusOr<WeightMatrix> Rows(const TensorView& t, int64_t begin, int64_t end);
  // Columns [begin, end): strided, so a view would make every page of the matrix resident; a
  // proper slice is read into host memory (kept while the backend uses it) instead.
  absl::StatusOr<WeightMatrix> Cols(const TensorView& t, int64_t begin, int64_t end);
  // Elements [begin, end) of a vector, as F32 in the backend (null when t is absent).
  absl::StatusOr<const float*> VectorSlice(const TensorView& t, int64_t begin, int64_t end);
  // Rows [r0, r1) x columns [c0, c1) of an FP8 weight (model/fp8.h), expanded into the model's
  // dtype in host memory (kept while the backend uses it).
  absl::StatusOr<WeightMatrix> Expanded(const TensorView& t, int64_t r0, int64_t r1, int64_t c0,
                                        int64_t c1);
  // An F8_E4M3 tensor needs config.json to declare the FP8 checkpoint.
  absl::Status Fp8Declared(const TensorView& t) const;
  // The rows `rows` of a 2-D weight in that order (FP8 expanded), or with `transpose_by` > 0
  // each consecutive group of that many picked rows transposed (a [n][cols] block becomes
  // [cols][n]), in host memory kept while the backend uses it.
  absl::StatusOr<WeightMatrix> Picked(const TensorView& t, const std::vector<int64_t>& rows,
                                      int64_t transpose_by = 0);
  // A layer's attention (this rank's q rows [q0, q1), KV rows [k0, k1)), MLA, experts.
  absl::Status BindAttention(Layer& L, const std::string& prefix, int64_t q0, int64_t q1,
                             int64_t k0, int64_t k1);
  absl::Status BindLatentAttention(Layer& L, const std::string& prefix);
  // Model layer i (of the checkpoint; num_layers: the MTP layer's decoder) into L.
  absl::Status BindLayer(Layer& L, int64_t i);
  absl::Status BindMtp();
  absl::Status BindExperts(Layer& L, const std::string& prefix);
  // gpt-oss's fused experts ([E][in][out], gate and up interleaved) and their biases, this
  // rank's experts transposed into [out][in] matrices.
  absl::Status BindFusedExperts(Layer& L, const std::string& prefix);
  // Columns first, first + step, ... (n of them) of expert e's [rows][cols] block of a 3-D
  // tensor [E][rows][cols], as the rows of an [n][rows] matrix in host memory kept while the
  // backend uses it; and the same of a 2-D bias [E][cols] as a vector.
  absl::StatusOr<WeightMatrix> ExpertColumns(const TensorView& t, int64_t e, int64_t first,
                                             int64_t step, int64_t n);
  absl::StatusOr<const float*> ExpertBias(const TensorView& t, int64_t e, int64_t first,
                                          int64_t step, int64_t n);
  // Rows first, first + step, ... (n of them) of an MXFP4 [E * out][in] matrix (its blocks and
  // scales, model/mxfp4.h), expanded into the model's dtype in host memory kept while the backend
  // uses it.
  absl::StatusOr<WeightMatrix> Mxfp4Rows(const TensorView& blocks, const TensorView& scales,
                                         int64_t first, int64_t step, int64_t n, int64_t cols);
  // A layer's attention of the batch laid out in the buffers (h in, attn out: this rank's heads'
  // outputs for o_proj), with its KV cache; MLA with the latent cache.
  absl::Status AttentionLayer(const Layer& L, int64_t li, const KvCache& cache, int64_t rows,
                              int64_t max_len);
  absl::Status LatentAttentionLayer(const Layer& L, int64_t li, const KvCache& cache, int64_t rows,
                                    int64_t max_len);
  // Layer L (cache layer li) on the rows of x whose input norm is in h: attention, MLP, their
  // residual adds into x; then h = next_norm(x), or (null) x alone.
  absl::Status LayerForward(const Layer& L, int64_t li, const KvCache& cache, int64_t rows,
                            int64_t max_len, const float* next_norm);
  // The cache layers this rank keeps: its stage's, and the MTP layer's.
  int64_t kv_layers() const { return layer_end_ - layer_begin_ + (has_mtp() ? 1 : 0); }
  absl::StatusOr<ExpertTable> TableOf(const std::vector<const WeightMatrix*>& mats);
  absl::Status AllReduce(float* data, size_t count);
  absl::Status Gemm(const WeightMatrix& w, const Buffer& x, int64_t M, Buffer& y);
  // Gemm of matrices that read the same x, each into its buffer (Backend::GemmGroup).
  absl::Status GemmGroup(std::initializer_list<std::pair<const WeightMatrix*, Buffer*>> outs,
                         const Buffer& x, int64_t M);
  template <typename T>
  absl::Status Put(Buffer& b, const std::vector<T>& v) {
    if (absl::Status s = b.Reserve(std::max<size_t>(1, v.size()) * sizeof(T)); !s.ok()) return s;
    return backend_->CopyFromHost(b.data(), v.data(), v.size() * sizeof(T));
  }
  // Add this rank's MLP / MoE output for `rows` rows of h to o (which they overwrite).
  absl::Status Mlp(const Layer& L, int64_t li, int64_t rows);
  absl::Status Moe(const Layer& L, int64_t rows);
  absl::Status SharedExperts(const Layer& L, int64_t rows);
  absl::Status MoeGrouped(const Layer& L, int64_t rows);
  // The last Run's full logits (logit_rows_ x vocab_size) in backend memory, gathered over the TP
  // group.
  absl::StatusOr<const float*> FullLogits();

  ModelConfig config_;
  Options options_;
  int64_t layer_begin_ = 0, layer_end_ = 0;
  // This rank's share: local heads, KV heads (from kv_head_begin_), experts
  // [expert_begin_, expert_end_) and vocabulary rows [vocab_begin_, vocab_end_).
  int64_t heads_ = 0, kv_heads_ = 0, kv_head_begin_ = 0;
  int64_t expert_begin_ = 0, expert_end_ = 0, vocab_begin_ = 0, vocab_end_ = 0;
  size_t shard_bytes_ = 0, stage_bytes_ = 0;
  std::vector<std::unique_ptr<uint8_t[]>> owned_;  // column slices read from the files
  std::unique_ptr<WeightStore> weights_;
  std::unique_ptr<Backend> backend_;
  std::vector<std::unique_ptr<Buffer>> tables_;  // the experts' pointer arrays
  WeightMatrix embed_, lm_head_;
  const float *final_norm_ = nullptr, *inv_freq_ = nullptr;
  std::vector<Layer> layers_;
  // The multi-token-prediction layer (Options::mtp): its decoder layer (cache layer
  // layers_.size()), norms, eh_proj's halves (the embedding's and the hidden state's columns,
  // replicated over the TP group), its embedding and head (vocab-parallel: the checkpoint's own,
  // else the model's).
  struct MtpLayer {
    Layer layer;
    const float *enorm = nullptr, *hnorm = nullptr, *norm = nullptr;
    WeightMatrix eh_embed, eh_hidden, embed, head;
  };
  MtpLayer mtp_;
  // The KV caches' format (Options::kv_cache_dtype resolved; for FP8 each stage layer's scales:
  // the checkpoint's self_attn.k_scale / v_scale, or k_proj / v_proj.output_scale, vLLM's names,
  // 1 where it has none, vLLM's default). BindKvFormat sets it.
  absl::Status BindKvFormat();
  KvFormat kv_format_;
  // LoRA: by stage layer and target; each slot's factors (null: empty); whether the last Run's
  // batch has rows of an adapter.
  std::vector<std::array<LoraProjection, kLoraTargets>> lora_;
  std::vector<std::shared_ptr<const Buffer>> lora_mem_;  // shared with the PreparedLora
  bool lora_batch_ = false;
  Buffers buf_;
  // The last Run: its rows and logit rows (the rows of `logits` on the last stage); the rows of
  // the input in x (-1: none given); its layout (Mtp reads its positions).
  int64_t rows_ = 0, logit_rows_ = 0, input_rows_ = -1;
  BatchLayout batch_;
};

}  // namespace shardserve
