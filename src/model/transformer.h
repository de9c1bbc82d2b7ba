#pragma once
// The Llama-family / Mixtral transformer on the CPU backend. Weights are views into the mapped
// safetensors files (never copied, except the small norm vectors and biases, held as F32).
//
// Forward() runs a flattened batch: several sequences, each contributing a chunk of new tokens
// (a whole prompt for prefill, one token for decode) at its own position; it writes the chunk's
// K/V into the block KV cache and returns the logits of each sequence's last new token.
// Not thread-safe: one Forward at a time (it parallelizes internally over the pool).
//
// Sharded (DESIGN.md §5): one instance is one rank. Tensor parallelism (Megatron) over the
// stage's TP group: q/k/v and gate/up column-parallel (output rows split), o_proj and down_proj
// row-parallel (input columns split) followed by one all-reduce each; attention heads and KV
// heads split (KV heads replicated when the group outnumbers them); Mixtral experts split across
// the group (one all-reduce of the MoE output); embedding and LM head vocab-parallel. Pipeline
// parallelism: the rank runs layers [layer_begin, layer_end); the first stage embeds tokens, the
// others take hidden states; the last stage produces logits, the others hidden states.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "backend/cpu/kernels.h"
#include "comm/communicator.h"
#include "common/thread_pool.h"
#include "model/config.h"
#include "model/kv_cache.h"
#include "model/rope.h"
#include "model/safetensors.h"

namespace shardserve {

struct SequenceChunk {
  std::vector<int32_t> tokens;  // new tokens of this sequence
  SequenceKv* kv = nullptr;     // positions [kv->length, kv->length + tokens.size()) are new
};

// A batch of chunks, validated and with its cache blocks reserved: for each new token (row), its
// position and sequence, and each chunk's last row.
struct PreparedBatch {
  int64_t rows = 0;
  std::vector<int64_t> row_pos;
  std::vector<const SequenceKv*> row_seq;
  std::vector<int64_t> last_row;
};

// Top-k MoE routing of `rows` router logit rows (E experts each): for each expert, the rows sent
// to it and their weights (softmax over the row's top-k logits; ties to the lower expert).
std::vector<std::vector<std::pair<int64_t, float>>> RouteExperts(const float* router, int64_t rows,
                                                                 int64_t E, int64_t top_k);

// Gathers a TP group's vocab-parallel logit slices (`local`: rows x stride floats, stride =
// ceil(V / T); rank m holds ids [V*m/T, V*(m+1)/T)) into rows x V full logits on every rank.
// `comm` takes host pointers; null when T is 1.
absl::Status GatherVocabSlices(const std::vector<float>& local, int64_t rows, int64_t V, int T,
                               Communicator* comm, std::vector<float>& logits);

class CudaTransformer;

class Transformer {
 public:
  struct Options {
    int num_threads = 1;
    int tp_size = 1;
    int tp_rank = 0;
    Communicator* tp_comm = nullptr;  // the stage's TP group; required when tp_size > 1
    int64_t layer_begin = 0;
    int64_t layer_end = -1;  // -1: through the last layer
  };
  // Reads config.json and the safetensors weights of `model_dir` and validates every tensor the
  // architecture needs (presence, shape). Errors name the tensor and the shapes; a shape that
  // does not split over tp_size names the dimension and both numbers.
  static absl::StatusOr<std::unique_ptr<Transformer>> Load(const std::string& model_dir,
                                                           const Options& options);

  const ModelConfig& config() const { return config_; }
  size_t weight_bytes() const { return weights_->total_bytes(); }
  ThreadPool& pool() { return *pool_; }

  // A cache sized for `positions` total positions across all sequences.
  std::unique_ptr<KvCache> NewKvCache(int64_t positions, int64_t block_size = 16) const;

  // Runs the chunks; logits gets chunks.size() × vocab_size floats. Reserves cache blocks for the
  // new positions (ResourceExhausted if the cache is full; nothing is written then) and advances
  // every kv->length. Token ids outside the vocabulary and positions beyond the context are
  // InvalidArgument.
  absl::Status Forward(std::vector<SequenceChunk>& chunks, KvCache& cache,
                       std::vector<float>& logits);
  // One pipeline stage: the first stage embeds the chunks' tokens, the others read `hidden_in`
  // (one row of hidden_size floats per new token, in chunk order). The last stage writes this
  // rank's vocab-parallel logits to `out`: chunks.size() rows of logits_stride() floats whose
  // first vocab_end() - vocab_begin() are ids [vocab_begin(), vocab_end()); the other stages
  // write the hidden states for the next stage.
  absl::Status ForwardStage(std::vector<SequenceChunk>& chunks, KvCache& cache,
                            const float* hidden_in, std::vector<float>& out);
  // Gathers the TP group's logit slices (`local` from ForwardStage, `rows` rows) into
  // rows x vocab_size full logits, identical on every rank. Every rank of the group must call it.
  absl::Status GatherLogits(const std::vector<float>& local, int64_t rows,
                            std::vector<float>& logits);
  int64_t vocab_begin() const { return vocab_begin_; }
  int64_t vocab_end() const { return vocab_end_; }
  int64_t logits_stride() const {
    return (config_.vocab_size + options_.tp_size - 1) / options_.tp_size;
  }

  bool first_stage() const { return layer_begin_ == 0; }
  bool last_stage() const { return layer_end_ == config_.num_layers; }
  int64_t layer_begin() const { return layer_begin_; }
  int64_t layer_end() const { return layer_end_; }
  // Bytes of the weights this rank holds (its slices), and of the full tensors they come from
  // (the stage's weights), for the "1/T" measurement.
  size_t shard_weight_bytes() const { return shard_bytes_; }
  size_t stage_weight_bytes() const { return stage_bytes_; }

  // Validates the chunks (non-empty, ids in the vocabulary, within the context), checks the
  // cache has room (ResourceExhausted, nothing taken), then reserves it and lays out the rows.
  // Every backend's ForwardStage starts here.
  absl::StatusOr<PreparedBatch> PrepareBatch(std::vector<SequenceChunk>& chunks,
                                             KvCache& cache) const;

 private:
  friend class CudaTransformer;  // uploads this rank's weight slices to the device
  struct Expert {
    cpu::WeightMatrix gate, up, down;
  };
  struct Layer {
    std::vector<float> input_norm, post_norm;
    cpu::WeightMatrix q, k, v, o;
    std::vector<float> q_bias, k_bias, v_bias, o_bias;  // empty when absent
    cpu::WeightMatrix gate, up, down;                   // dense MLP
    cpu::WeightMatrix router;                           // MoE
    std::vector<Expert> experts;
  };

  Transformer(ModelConfig config, std::unique_ptr<WeightStore> weights, const Options& options);
  absl::Status CheckSplit() const;
  absl::Status BindWeights();
  // Rows [begin, end) of a weight matrix: a view into the mapping (contiguous, so only those
  // pages ever become resident).
  cpu::WeightMatrix Rows(const TensorView& t, int64_t begin, int64_t end);
  // Columns [begin, end): strided, so a view would make every page of the matrix resident; a
  // proper slice is read into memory this object owns instead.
  absl::StatusOr<cpu::WeightMatrix> Cols(const TensorView& t, int64_t begin, int64_t end);
  std::vector<float> VectorSlice(const TensorView& t, int64_t begin, int64_t end);
  absl::Status AllReduce(float* data, size_t count);
  void Attention(const Layer& layer, int64_t layer_index, const std::vector<int64_t>& row_pos,
                 const std::vector<const SequenceKv*>& row_seq, const float* q, float* out,
                 KvCache& cache);
  // Add this rank's partial MLP / MoE output for `rows` rows of h to out (zeroed by the caller).
  void Mlp(const Layer& layer, const float* h, int64_t rows, float* out);
  void Moe(const Layer& layer, const float* h, int64_t rows, float* out);

  ModelConfig config_;
  Options options_;
  int64_t layer_begin_ = 0, layer_end_ = 0;
  // This rank's share: local heads, KV heads (from kv_head_begin_), intermediate rows, experts
  // [expert_begin_, expert_end_) and vocabulary rows [vocab_begin_, vocab_end_).
  int64_t heads_ = 0, kv_heads_ = 0, kv_head_begin_ = 0, inter_ = 0;
  int64_t expert_begin_ = 0, expert_end_ = 0, vocab_begin_ = 0, vocab_end_ = 0;
  size_t shard_bytes_ = 0, stage_bytes_ = 0;
  std::vector<std::unique_ptr<uint8_t[]>> owned_;  // column slices read from the files
  std::unique_ptr<WeightStore> weights_;
  std::unique_ptr<ThreadPool> pool_;
  Rope rope_;
  cpu::WeightMatrix embed_, lm_head_;
  std::vector<float> final_norm_;
  std::vector<Layer> layers_;
};

}  // namespace shardserve
