#pragma once
// The Llama-family / Mixtral transformer on the CPU backend. Weights are views into the mapped
// safetensors files (never copied, except the small norm vectors and biases, held as F32).
//
// Forward() runs a flattened batch: several sequences, each contributing a chunk of new tokens
// (a whole prompt for prefill, one token for decode) at its own position; it writes the chunk's
// K/V into the block KV cache and returns the logits of each sequence's last new token.
// Not thread-safe: one Forward at a time (it parallelizes internally over the pool).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "backend/cpu/kernels.h"
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

class Transformer {
 public:
  struct Options {
    int num_threads = 1;
  };
  // Reads config.json and the safetensors weights of `model_dir` and validates every tensor the
  // architecture needs (presence, shape). Errors name the tensor and the shapes.
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

 private:
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
  absl::Status BindWeights();
  void Attention(const Layer& layer, int64_t layer_index, const std::vector<int64_t>& row_pos,
                 const std::vector<const SequenceKv*>& row_seq, const float* q, float* out,
                 KvCache& cache);
  void Mlp(const Layer& layer, const float* h, int64_t rows, float* x);
  void Moe(const Layer& layer, const float* h, int64_t rows, float* x);

  ModelConfig config_;
  std::unique_ptr<WeightStore> weights_;
  std::unique_ptr<ThreadPool> pool_;
  Rope rope_;
  cpu::WeightMatrix embed_, lm_head_;
  std::vector<float> final_norm_;
  std::vector<Layer> layers_;
};

}  // namespace shardserve
