#pragma once
// The model configuration read from a Hugging Face config.json: the one reader of the file, for
// the runtime (ParseModelConfig: only what shardserve runs exactly is accepted; anything else is
// refused with a message naming the option) and for the planner (DescribeModelConfig, which also
// describes the weight formats shardserve plans for but does not load yet).
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "backend/dtype.h"
#include "model/fp8.h"
#include "plan/layer_split.h"

namespace shardserve {

enum class RopeScaling { kNone, kLinear, kLlama3, kYarn };

// How a checkpoint stores its linear weights (quantization_config's quant_method): in the model's
// dtype; fine-grained FP8 (fp8: E4M3, a scale per block, model/fp8.h); FP8 with a scale per
// output row (fbgemm_fp8: planned for, not loaded); MXFP4 experts (mxfp4, gpt-oss's,
// model/mxfp4.h).
enum class WeightFormat { kPlain, kFp8, kFp8PerRow, kMxfp4 };

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
  // YaRN (rope_type yarn): the ramp between beta_fast and beta_slow rotations, truncated to whole
  // dimensions unless `truncate` is false; mscale / mscale_all_dim as DeepSeek's configs give
  // them (0: absent).
  double rope_beta_fast = 32, rope_beta_slow = 1, rope_mscale = 0, rope_mscale_all_dim = 0;
  bool rope_truncate = true;
  // YaRN's factor on the rotated dimensions' cos and sin (1 for every other scaling).
  double rope_attention_factor = 1.0;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // q/k/v projections carry a bias (Qwen2, Llama attention_bias)
  bool o_bias = false;    // o_proj carries a bias (Llama attention_bias)
  bool qk_norm = false;   // q and k get an RMSNorm per head before RoPE (Qwen3)
  // MoE: the k experts' weights renormalized to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob),
  // else their share of the softmax over all experts.
  bool norm_topk_prob = true;
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;
  // DeepSeek-V3 (DeepseekV3ForCausalLM). Multi-head latent attention: each position caches the
  // kv_lora_rank latent (after kv_a_layernorm) and head_dim (qk_rope_head_dim) rotated key dims,
  // shared by every head; the query comes from q_proj or, with q_lora_rank, from q_a_proj ->
  // q_a_layernorm -> q_b_proj; kv_b_proj maps the latent to each head's qk_nope_dim key dims and
  // v_head_dim value dims (absorbed into the query and the output at run time). rope_interleave:
  // the rotated dims come in adjacent pairs (rows permuted into rotate_half order at load).
  bool mla = false;
  int64_t q_lora_rank = 0;  // 0: q_proj
  int64_t kv_lora_rank = 0, qk_nope_dim = 0, v_head_dim = 0;
  bool rope_interleave = false;
  // Its MoE: sigmoid scores plus e_score_correction_bias choose the experts inside the topk_group
  // best of n_group groups (a group scored by its two best); the chosen sigmoid scores, normalized
  // when norm_topk_prob, times routed_scaling_factor; shared experts (shared_experts x the
  // experts' size) added for every token; the first first_dense_layers layers dense
  // (dense_intermediate_size).
  bool sigmoid_routing = false;
  int64_t n_group = 1, topk_group = 1, shared_experts = 0, first_dense_layers = 0;
  int64_t dense_intermediate_size = 0;
  double routed_scaling = 1.0;
  int64_t mtp_layers = 0;  // multi-token-prediction layers in the checkpoint (not loaded)
  // gpt-oss (GptOssForCausalLM): a learned sink logit per head in every softmax's denominator;
  // the layers that layer_types names sliding_attention attend to the last sliding_window
  // positions only; the router and the experts' projections carry biases; the experts' SwiGLU is
  // clamped (gate at most swiglu_limit, up within +-swiglu_limit, (up + 1) * gate *
  // sigmoid(swiglu_alpha * gate)); experts stored fused ([E][in][out], gate and up interleaved).
  bool gpt_oss = false;
  int64_t sliding_window = 0;
  std::vector<bool> sliding_layers;  // per layer (gpt-oss), empty: none
  double swiglu_alpha = 1.702, swiglu_limit = 7.0;
  int64_t bos_token_id = -1;
  std::vector<int64_t> eos_token_ids;
  std::string torch_dtype;  // informational
  // The dtype FP8 weights expand into at load: torch_dtype's (BF16 where it names none).
  DType dtype = DType::kBF16;
  // The KV cache's dtype under kvCacheDtype auto (api/kv_cache_dtype.h): `dtype`, F16 for a GGUF
  // file (llama.cpp's).
  DType kv_auto_dtype = DType::kBF16;
  WeightFormat weights = WeightFormat::kPlain;
  Fp8Blocks fp8_blocks;  // kFp8: its scales' block
  // quantization_config.modules_to_not_convert: modules kept in the model's dtype (HF's patterns).
  std::vector<std::string> keep_modules;
  // Why the runtime does not load this model, "" where it does (DescribeModelConfig only).
  std::string not_loaded;

  bool fp8() const { return weights == WeightFormat::kFp8; }
  bool mxfp4() const { return weights == WeightFormat::kMxfp4; }

  int64_t q_dim() const { return num_heads * head_dim; }
  int64_t kv_dim() const { return num_kv_heads * head_dim; }
  // Whether layer i has experts (DeepSeek-V3's first layers are dense).
  bool moe_layer(int64_t i) const { return moe && i >= first_dense_layers; }
  // How many positions layer i attends to, its own included (AttentionExtras::window): 0 for
  // all of them, gpt-oss's sliding layers sliding_window.
  int64_t window(int64_t i) const {
    return i < static_cast<int64_t>(sliding_layers.size()) && sliding_layers[i] ? sliding_window
                                                                                : 0;
  }
  // The softmax's scale: 1/sqrt of the query-key dot's length, times YaRN's mscale_all_dim
  // correction squared (DeepSeek) and its attention factor squared where the whole head rotates.
  double attention_scale() const;
  // The sizes the pipeline split weighs (plan/layer_split.h).
  ModelShape shape() const {
    // MLA: the heads' query dims and the latent a position caches.
    return {num_layers,
            hidden_size,
            intermediate_size,
            mla ? num_heads * (qk_nope_dim + head_dim) : q_dim(),
            mla ? kv_lora_rank + head_dim : kv_dim(),
            vocab_size,
            moe ? experts_per_token : 0};
  }
};

// What runs: every field read and checked; a format or option shardserve does not run is an
// error naming it.
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text,
                                             const std::string& source = "config.json");
// What the model is, for the planner: ParseModelConfig's reading, except that a weight format
// shardserve plans for but does not load yet (fbgemm_fp8) is described, not_loaded saying why.
absl::StatusOr<ModelConfig> DescribeModelConfig(const std::string& json_text,
                                                const std::string& source = "config.json");
// generation_config.json's eos_token_id (an id or a list) added to the end ids, as transformers'
// generate and vLLM stop at them too (Llama 3 Instruct's <|eot_id|>, gpt-oss's <|return|>).
absl::Status AddGenerationEosIds(const std::string& json_text, const std::string& source,
                                 ModelConfig& c);
// config.json of a model directory (with generation_config.json's end ids where the directory
// has one), or the metadata of the GGUF file the path names.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir);

}  // namespace shardserve
