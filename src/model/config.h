#pragma once
// The model configuration read from a Hugging Face config.json. Only what shardserve runs
// exactly is accepted; anything else is refused with a message naming the option.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "backend/dtype.h"
#include "model/fp8.h"
#include "plan/layer_split.h"

namespace shardserve {

enum class RopeScaling { kNone, kLinear, kLlama3 };

struct ModelConfig {
  std::string architecture;  // e.g. "LlamaForCausalLM"
  std::string model_type;    // e.g. "llama"
  bool moe = false;          // Mixtral-style sparse MoE MLP
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;
  int64_t max_context = 0;  // max_position_embeddings, capped by a sliding window if any
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling = RopeScaling::kNone;
  double rope_factor = 1.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 4.0;
  int64_t rope_original_max_position = 8192;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // q/k/v projections carry a bias (Qwen2, Llama attention_bias)
  bool o_bias = false;    // o_proj carries a bias (Llama attention_bias)
  bool qk_norm = false;   // q and k get an RMSNorm per head before RoPE (Qwen3)
  // MoE: the k experts' weights renormalized to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob),
  // else their share of the softmax over all experts.
  bool norm_topk_prob = true;
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;
  int64_t bos_token_id = -1;
  std::vector<int64_t> eos_token_ids;
  std::string torch_dtype;  // informational
  // The dtype FP8 weights expand into at load: torch_dtype's (BF16 where it names none).
  DType dtype = DType::kBF16;
  // A fine-grained FP8 checkpoint (quantization_config, model/fp8.h): its scales' block.
  bool fp8 = false;
  Fp8Blocks fp8_blocks;

  int64_t q_dim() const { return num_heads * head_dim; }
  int64_t kv_dim() const { return num_kv_heads * head_dim; }
  // The sizes the pipeline split weighs (plan/layer_split.h).
  ModelShape shape() const {
    return {num_layers, hidden_size, intermediate_size,          q_dim(),
            kv_dim(),   vocab_size,  moe ? experts_per_token : 0};
  }
};

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text,
                                             const std::string& source = "config.json");
// config.json of a model directory, or the metadata of the GGUF file the path names.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir);

}  // namespace shardserve
