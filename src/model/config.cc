#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/text.h"
#include "model/config_reader.h"
#include "model/gguf_model.h"

namespace shardserve {
namespace {

using json = nlohmann::json;
using config_internal::kMaxHeads;
using config_internal::kMaxLayers;
using config_internal::kMaxRopeTheta;
using config_internal::kMaxSize;
using config_internal::Reader;

absl::Status ParseRope(const json& scaling, const Reader& r, ModelConfig& c) {
  // Accepts both `rope_scaling` (transformers 4) and `rope_parameters` (transformers 5).
  if (scaling.is_null()) return absl::OkStatus();
  if (!scaling.is_object()) return r.Error("rope_scaling", "must be an object or null");
  Reader s(scaling, "config.json rope_scaling");
  std::string type;
  if (scaling.contains("rope_type")) {
    ASSIGN_OR_RETURN(type, s.String("rope_type", ""));
  } else {
    ASSIGN_OR_RETURN(type, s.String("type", "default"));
  }
  if (scaling.contains("rope_theta")) {
    ASSIGN_OR_RETURN(c.rope_theta, s.Number("rope_theta", c.rope_theta, 1.0, kMaxRopeTheta));
  }
  if (type == "default") return absl::OkStatus();
  ASSIGN_OR_RETURN(c.rope_factor, s.Number("factor", 1.0, 0.0, 1e6));
  if (type == "linear") {
    c.rope_scaling = RopeScaling::kLinear;
  } else if (type == "llama3") {
    c.rope_scaling = RopeScaling::kLlama3;
    ASSIGN_OR_RETURN(c.rope_low_freq_factor, s.Number("low_freq_factor", 1.0, 0.0, 1e6));
    ASSIGN_OR_RETURN(c.rope_high_freq_factor, s.Number("high_freq_factor", 4.0, 0.0, 1e6));
    ASSIGN_OR_RETURN(c.rope_original_max_position,
                     s.Positive("original_max_position_embeddings", 8192));
    if (c.rope_high_freq_factor <= c.rope_low_freq_factor) {
      return s.Error("high_freq_factor", "must exceed low_freq_factor");
    }
  } else if (type == "yarn") {
    c.rope_scaling = RopeScaling::kYarn;
    if (c.rope_factor < 1) return s.Error("factor", "must be at least 1 for yarn");
    // Where absent, transformers takes max_position_embeddings (read before the rope fields).
    ASSIGN_OR_RETURN(c.rope_original_max_position,
                     s.Positive("original_max_position_embeddings", c.max_position_embeddings));
    ASSIGN_OR_RETURN(c.rope_beta_fast, s.Number("beta_fast", 32.0, 0.0, 1e6));
    ASSIGN_OR_RETURN(c.rope_beta_slow, s.Number("beta_slow", 1.0, 0.0, 1e6));
    ASSIGN_OR_RETURN(c.rope_mscale, s.Number("mscale", 0.0, -1.0, 1e6));
    ASSIGN_OR_RETURN(c.rope_mscale_all_dim, s.Number("mscale_all_dim", 0.0, -1.0, 1e6));
    ASSIGN_OR_RETURN(c.rope_truncate, s.Bool("truncate", true));
    // transformers' _compute_yarn_parameters: the factor on cos and sin.
    auto mscale = [&](double m) {
      return c.rope_factor <= 1 ? 1.0 : 0.1 * m * std::log(c.rope_factor) + 1.0;
    };
    if (scaling.contains("attention_factor") && !scaling["attention_factor"].is_null()) {
      ASSIGN_OR_RETURN(c.rope_attention_factor, s.Number("attention_factor", 1.0, 0.0, 1e6));
    } else if (c.rope_mscale != 0 && c.rope_mscale_all_dim != 0) {
      c.rope_attention_factor = mscale(c.rope_mscale) / mscale(c.rope_mscale_all_dim);
    } else {
      c.rope_attention_factor = mscale(1.0);
    }
  } else {
    return s.Error("type", absl::StrCat("'", type,
                                        "' is not supported (supported: default, linear, llama3, "
                                        "yarn)"));
  }
  return absl::OkStatus();
}

// gpt-oss's sinks, per-layer sliding windows, biased router and experts, clamped SwiGLU
// (ModelConfig's comments).
absl::Status ParseGptOss(const json& j, const Reader& r, ModelConfig& c) {
  c.gpt_oss = c.moe = true;
  ASSIGN_OR_RETURN(const std::string experts, r.Named({"num_local_experts", "num_experts"}));
  ASSIGN_OR_RETURN(c.num_experts, r.Positive(experts, {}, kMaxHeads));
  ASSIGN_OR_RETURN(c.experts_per_token, r.Positive("num_experts_per_tok", {}, kMaxHeads));
  if (c.experts_per_token > c.num_experts) {
    return r.Error("num_experts_per_tok",
                   absl::StrCat(c.experts_per_token, " exceeds ", experts, " ", c.num_experts));
  }
  ASSIGN_OR_RETURN(c.swiglu_alpha, r.Number("swiglu_alpha", 1.702, 0.0, 1e6));
  ASSIGN_OR_RETURN(c.swiglu_limit, r.Number("swiglu_limit", 7.0, 0.0, 1e30));
  ASSIGN_OR_RETURN(bool bias, r.Bool("attention_bias", true));
  c.qkv_bias = c.o_bias = bias;
  if (r.Has("layer_types")) {
    const json& types = j["layer_types"];
    if (!types.is_array() || static_cast<int64_t>(types.size()) != c.num_layers) {
      return r.Error("layer_types",
                     absl::StrCat("must list the type of each of the ", c.num_layers, " layers"));
    }
    for (const json& t : types) {
      if (t == "sliding_attention") {
        c.sliding_layers.push_back(true);
      } else if (t == "full_attention") {
        c.sliding_layers.push_back(false);
      } else {
        return r.Error("layer_types",
                       absl::StrCat("holds ", t.dump(), " (sliding_attention or full_attention)"));
      }
    }
  } else {  // transformers' default: sliding and full in turn, sliding first
    for (int64_t i = 0; i < c.num_layers; ++i) c.sliding_layers.push_back(i % 2 == 0);
  }
  ASSIGN_OR_RETURN(c.sliding_window, r.Positive("sliding_window", 128));
  return absl::OkStatus();
}

// DeepSeek-V3's multi-head latent attention and MoE (ModelConfig's comments). What the runtime
// does not run is refused by name: another scoring or top-k method, biased projections, MoE
// layers other than every layer after the dense ones.
absl::Status ParseDeepseekV3(const Reader& r, ModelConfig& c) {
  c.mla = c.moe = c.sigmoid_routing = true;
  ASSIGN_OR_RETURN(c.q_lora_rank, r.Int("q_lora_rank", 0));
  if (c.q_lora_rank < 0 || c.q_lora_rank > kMaxSize) {
    return r.Error("q_lora_rank", "must be null or a positive size");
  }
  ASSIGN_OR_RETURN(c.kv_lora_rank, r.Positive("kv_lora_rank"));
  ASSIGN_OR_RETURN(c.head_dim, r.Positive("qk_rope_head_dim"));  // the rotated dims, as HF's
  if (c.head_dim % 2 != 0) return r.Error("qk_rope_head_dim", "must be even for rotary embeddings");
  ASSIGN_OR_RETURN(c.qk_nope_dim, r.Positive("qk_nope_head_dim"));
  ASSIGN_OR_RETURN(c.v_head_dim, r.Positive("v_head_dim"));
  ASSIGN_OR_RETURN(c.rope_interleave, r.Bool("rope_interleave", true));
  ASSIGN_OR_RETURN(c.dense_intermediate_size, r.Positive("intermediate_size"));
  ASSIGN_OR_RETURN(c.intermediate_size, r.Positive("moe_intermediate_size"));
  ASSIGN_OR_RETURN(const std::string experts, r.Named({"n_routed_experts", "num_local_experts"}));
  ASSIGN_OR_RETURN(c.num_experts, r.Positive(experts, {}, kMaxHeads));
  ASSIGN_OR_RETURN(c.experts_per_token, r.Positive("num_experts_per_tok", {}, kMaxHeads));
  if (c.experts_per_token > c.num_experts) {
    return r.Error("num_experts_per_tok",
                   absl::StrCat(c.experts_per_token, " exceeds ", experts, " ", c.num_experts));
  }
  ASSIGN_OR_RETURN(c.shared_experts, r.Int("n_shared_experts", 0));
  if (c.shared_experts < 0 || c.shared_experts > kMaxHeads) {
    return r.Error("n_shared_experts", "must be between 0 and 4096");
  }
  ASSIGN_OR_RETURN(c.n_group, r.Positive("n_group", 1, 64));
  ASSIGN_OR_RETURN(c.topk_group, r.Positive("topk_group", 1, 64));
  if (c.num_experts % c.n_group != 0) {
    return r.Error("n_group",
                   absl::StrCat(c.n_group, " does not divide n_routed_experts ", c.num_experts));
  }
  if (c.topk_group > c.n_group) {
    return r.Error("topk_group", absl::StrCat(c.topk_group, " exceeds n_group ", c.n_group));
  }
  if (c.num_experts / c.n_group < 2 && c.n_group > 1) {
    return r.Error("n_group",
                   "leaves fewer than 2 experts a group (a group scores by its best two)");
  }
  if (c.experts_per_token > c.topk_group * (c.num_experts / c.n_group)) {
    return r.Error(
        "num_experts_per_tok",
        absl::StrCat(c.experts_per_token, " exceeds the ", c.topk_group, " chosen groups' ",
                     c.topk_group * (c.num_experts / c.n_group), " experts"));
  }
  ASSIGN_OR_RETURN(c.routed_scaling, r.Number("routed_scaling_factor", 1.0, 0.0, 1e6));
  ASSIGN_OR_RETURN(c.norm_topk_prob, r.Bool("norm_topk_prob", true));
  ASSIGN_OR_RETURN(c.first_dense_layers, r.Int("first_k_dense_replace", 0));
  if (c.first_dense_layers < 0 || c.first_dense_layers > c.num_layers) {
    return r.Error("first_k_dense_replace",
                   absl::StrCat("must be between 0 and num_hidden_layers ", c.num_layers));
  }
  ASSIGN_OR_RETURN(int64_t freq, r.Int("moe_layer_freq", 1));
  if (freq != 1) return r.Error("moe_layer_freq", "other than 1 is not supported");
  ASSIGN_OR_RETURN(std::string scoring, r.String("scoring_func", "sigmoid"));
  if (scoring != "sigmoid") {
    return r.Error("scoring_func", absl::StrCat("'", scoring, "' is not supported (sigmoid)"));
  }
  ASSIGN_OR_RETURN(std::string method, r.String("topk_method", "noaux_tc"));
  if (method != "noaux_tc") {
    return r.Error("topk_method", absl::StrCat("'", method, "' is not supported (noaux_tc)"));
  }
  ASSIGN_OR_RETURN(bool bias, r.Bool("attention_bias", false));
  if (bias) return r.Error("attention_bias", "true is not supported for DeepseekV3ForCausalLM");
  ASSIGN_OR_RETURN(c.mtp_layers, r.Int("num_nextn_predict_layers", 0));
  if (c.mtp_layers < 0 || c.mtp_layers > kMaxLayers) {
    return r.Error("num_nextn_predict_layers", "must be between 0 and 4096");
  }
  return absl::OkStatus();
}

// The dtype FP8 and MXFP4 weights expand into, and how the checkpoint stores its weights:
// quant_method fp8 (E4M3 weights, scales computed at load for the activations) and, for gpt-oss's
// experts, mxfp4 load; fbgemm_fp8 (a scale per output row) is described for the planner, with
// not_loaded saying why it does not load; the others are refused by name.
absl::Status ReadWeightFormat(const json& j, const Reader& r, ModelConfig& c) {
  ASSIGN_OR_RETURN(c.dtype, config_internal::TorchDtype(r));
  c.kv_auto_dtype = c.dtype;
  if (!r.Has("quantization_config")) return absl::OkStatus();
  const json& q = j["quantization_config"];
  if (!q.is_object()) return r.Error("quantization_config", "must be an object");
  const Reader qr(q, absl::StrCat(r.source(), " quantization_config"));
  if (qr.Has("modules_to_not_convert") && !q["modules_to_not_convert"].is_null()) {
    const json& keep = q["modules_to_not_convert"];
    if (!keep.is_array() || keep.size() > 4096) {
      return qr.Error("modules_to_not_convert", "must be a list of at most 4096 names");
    }
    for (const json& k : keep) {
      if (!k.is_string() || k.get<std::string>().empty() || k.get<std::string>().size() > 256) {
        return qr.Error("modules_to_not_convert", "must hold names of 1 to 256 characters");
      }
      c.keep_modules.push_back(k.get<std::string>());
    }
  }
  ASSIGN_OR_RETURN(const std::string method, qr.String("quant_method", ""));
  if (method.empty()) return qr.Error("quant_method", "is required");
  if (method == "mxfp4") {
    c.weights = WeightFormat::kMxfp4;
    if (c.architecture != "GptOssForCausalLM") {
      c.not_loaded = std::string(
          qr.Error("quant_method", absl::StrCat("'mxfp4' loads for GptOssForCausalLM's experts, "
                                                "not for ",
                                                c.architecture))
              .message());
    }
    return absl::OkStatus();
  }
  if (method == "fbgemm_fp8") {
    c.weights = WeightFormat::kFp8PerRow;
    c.not_loaded = std::string(qr.Error("quant_method",
                                        "'fbgemm_fp8' (FP8 with a scale per output row) does not "
                                        "load in shardserve yet (fine-grained FP8, fp8, does)")
                                   .message());
    return absl::OkStatus();
  }
  if (method != "fp8") {
    return qr.Error("quant_method",
                    absl::StrCat("'", method,
                                 "' does not load in shardserve (fine-grained FP8, fp8, does; "
                                 "mxfp4 for gpt-oss; fbgemm_fp8 is planned for)"));
  }
  ASSIGN_OR_RETURN(const std::string fmt, qr.String("fmt", "e4m3"));
  if (fmt != "e4m3") return qr.Error("fmt", absl::StrCat("'", fmt, "' is not e4m3"));
  ASSIGN_OR_RETURN(const std::string activations, qr.String("activation_scheme", "dynamic"));
  if (activations != "dynamic") {
    return qr.Error("activation_scheme", absl::StrCat("'", activations,
                                                      "' is not dynamic (activations scaled at run "
                                                      "time; static input scales do not load)"));
  }
  ASSIGN_OR_RETURN(const auto block, config_internal::WeightBlockSize(q, qr));
  c.weights = WeightFormat::kFp8;
  c.fp8_blocks = {block[0], block[1]};
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelConfig> DescribeModelConfig(const std::string& json_text,
                                                const std::string& source) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not valid JSON: ", e.what()));
  }
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(source, ": not an object"));
  Reader r(j, source);
  ModelConfig c;
  if (!j.contains("architectures") || !j["architectures"].is_array() ||
      j["architectures"].size() != 1 || !j["architectures"][0].is_string()) {
    return r.Error("architectures", "must list exactly one architecture");
  }
  c.architecture = j["architectures"][0].get<std::string>();
  if (c.architecture == "MixtralForCausalLM") {
    c.moe = true;
  } else if (c.architecture == "Qwen3ForCausalLM") {
    c.qk_norm = true;
  } else if (c.architecture == "Qwen3MoeForCausalLM") {
    c.moe = c.qk_norm = true;
  } else if (c.architecture != "LlamaForCausalLM" && c.architecture != "MistralForCausalLM" &&
             c.architecture != "Qwen2ForCausalLM" && c.architecture != "DeepseekV3ForCausalLM" &&
             c.architecture != "GptOssForCausalLM") {
    return r.Error("architectures",
                   absl::StrCat("names '", c.architecture,
                                "', which shardserve does not run (supported: LlamaForCausalLM, "
                                "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                                "MixtralForCausalLM, Qwen3MoeForCausalLM, DeepseekV3ForCausalLM, "
                                "GptOssForCausalLM)"));
  }
  const bool deepseek = c.architecture == "DeepseekV3ForCausalLM";
  const bool gpt_oss = c.architecture == "GptOssForCausalLM";
  ASSIGN_OR_RETURN(c.model_type, r.String("model_type", ""));
  ASSIGN_OR_RETURN(c.hidden_size, r.Positive("hidden_size"));
  ASSIGN_OR_RETURN(c.intermediate_size, r.Positive("intermediate_size"));
  ASSIGN_OR_RETURN(c.num_layers, r.Positive("num_hidden_layers", {}, kMaxLayers));
  ASSIGN_OR_RETURN(c.num_heads, r.Positive("num_attention_heads", {}, kMaxHeads));
  ASSIGN_OR_RETURN(c.num_kv_heads, r.Positive("num_key_value_heads", c.num_heads, kMaxHeads));
  ASSIGN_OR_RETURN(c.vocab_size, r.Positive("vocab_size"));
  ASSIGN_OR_RETURN(c.max_position_embeddings, r.Positive("max_position_embeddings", 2048));
  ASSIGN_OR_RETURN(c.rms_norm_eps, r.Number("rms_norm_eps", 1e-6, 0.0, 0.1));
  // transformers' default_theta: gpt-oss's 150000, others' 10000.
  ASSIGN_OR_RETURN(c.rope_theta,
                   r.Number("rope_theta", gpt_oss ? 150000.0 : 10000.0, 1.0, kMaxRopeTheta));
  ASSIGN_OR_RETURN(c.tie_word_embeddings, r.Bool("tie_word_embeddings", false));
  ASSIGN_OR_RETURN(c.torch_dtype, r.String("torch_dtype", ""));
  RETURN_IF_ERROR(ReadWeightFormat(j, r, c));
  if (deepseek) {
    RETURN_IF_ERROR(ParseDeepseekV3(r, c));
  } else if (c.hidden_size % c.num_heads != 0 && !r.Has("head_dim")) {
    return r.Error("hidden_size",
                   absl::StrCat(c.hidden_size, " is not divisible by ", "num_attention_heads ",
                                c.num_heads, " and no head_dim is given"));
  }
  if (!deepseek) {
    ASSIGN_OR_RETURN(c.head_dim, r.Positive("head_dim", c.hidden_size / c.num_heads));
    if (c.head_dim % 2 != 0) return r.Error("head_dim", "must be even for rotary embeddings");
  }
  if (c.num_heads % c.num_kv_heads != 0) {
    return r.Error(
        "num_key_value_heads",
        absl::StrCat(c.num_kv_heads, " does not divide num_attention_heads ", c.num_heads));
  }
  ASSIGN_OR_RETURN(std::string act, r.String("hidden_act", "silu"));
  if (act != "silu") {
    return r.Error("hidden_act", absl::StrCat("'", act, "' is not supported (only silu)"));
  }
  ASSIGN_OR_RETURN(bool mlp_bias, r.Bool("mlp_bias", false));
  if (mlp_bias) return r.Error("mlp_bias", "true is not supported");
  ASSIGN_OR_RETURN(double partial_rotary, r.Number("partial_rotary_factor", 1.0));
  if (partial_rotary != 1.0)
    return r.Error("partial_rotary_factor", "other than 1 is not supported");
  ASSIGN_OR_RETURN(int64_t pretraining_tp, r.Int("pretraining_tp", 1));
  if (pretraining_tp != 1) return r.Error("pretraining_tp", "other than 1 is not supported");

  if (c.architecture == "Qwen2ForCausalLM") {
    c.qkv_bias = true;
  } else if (gpt_oss) {
    RETURN_IF_ERROR(ParseGptOss(j, r, c));
  } else if (!deepseek) {
    ASSIGN_OR_RETURN(bool attention_bias, r.Bool("attention_bias", false));
    c.qkv_bias = c.o_bias = attention_bias;
  }

  if (j.contains("rope_parameters")) {
    RETURN_IF_ERROR(ParseRope(j["rope_parameters"], r, c));
  } else if (j.contains("rope_scaling")) {
    RETURN_IF_ERROR(ParseRope(j["rope_scaling"], r, c));
  } else if (gpt_oss) {  // GptOssConfig's default: YaRN as gpt-oss ships it
    const json yarn = {{"rope_type", "yarn"}, {"factor", 32.0},
                       {"beta_fast", 32.0},   {"beta_slow", 1.0},
                       {"truncate", false},   {"original_max_position_embeddings", 4096}};
    RETURN_IF_ERROR(ParseRope(yarn, r, c));
  }

  c.max_context = c.max_position_embeddings;
  bool sliding = r.Has("sliding_window") && !gpt_oss;  // gpt-oss's windows are per layer
  if (c.architecture == "Qwen2ForCausalLM" || c.architecture == "Qwen3ForCausalLM" ||
      c.architecture == "Qwen3MoeForCausalLM") {
    ASSIGN_OR_RETURN(bool use_sliding, r.Bool("use_sliding_window", false));
    sliding = sliding && use_sliding;
  }
  if (sliding) {
    // Attention limited to a window equals full attention when the context fits the window.
    ASSIGN_OR_RETURN(int64_t window, r.Positive("sliding_window"));
    c.max_context = std::min(c.max_context, window);
  }

  if (c.rope_scaling == RopeScaling::kYarn && c.mla && c.rope_attention_factor != 1.0) {
    return r.Error("rope_scaling",
                   absl::StrCat("gives YaRN an attention factor of ", c.rope_attention_factor,
                                " on the rotated dims (mscale ", c.rope_mscale,
                                " against "
                                "mscale_all_dim ",
                                c.rope_mscale_all_dim,
                                "); multi-head latent attention runs with 1 (DeepSeek-V3's: "
                                "mscale = mscale_all_dim)"));
  }
  if (c.moe && !deepseek && !gpt_oss) {
    const bool qwen = c.architecture == "Qwen3MoeForCausalLM";
    // transformers 5 writes num_local_experts for both (num_experts: its alias).
    ASSIGN_OR_RETURN(const std::string experts, r.Named({"num_local_experts", "num_experts"}));
    ASSIGN_OR_RETURN(c.num_experts, r.Positive(experts, {}, kMaxHeads));
    ASSIGN_OR_RETURN(c.experts_per_token, r.Positive("num_experts_per_tok", {}, kMaxHeads));
    if (c.experts_per_token > c.num_experts) {
      return r.Error("num_experts_per_tok",
                     absl::StrCat(c.experts_per_token, " exceeds ", experts, " ", c.num_experts));
    }
    if (qwen) {
      // Every layer sparse (what Qwen3-MoE models ship): the experts' size is then the only MLP
      // size, and intermediate_size (a dense layer's) is unused.
      ASSIGN_OR_RETURN(int64_t step, r.Int("decoder_sparse_step", 1));
      if (step != 1) return r.Error("decoder_sparse_step", "other than 1 is not supported");
      if (r.Has("mlp_only_layers") &&
          (!j["mlp_only_layers"].is_array() || !j["mlp_only_layers"].empty())) {
        return r.Error("mlp_only_layers", "dense layers in a Qwen3-MoE model are not supported");
      }
      if (r.Has("shared_expert_intermediate_size")) {
        return r.Error("shared_expert_intermediate_size", "shared experts are not supported");
      }
      ASSIGN_OR_RETURN(c.intermediate_size, r.Positive("moe_intermediate_size"));
      ASSIGN_OR_RETURN(c.norm_topk_prob, r.Bool("norm_topk_prob", false));
    }
  }
  ASSIGN_OR_RETURN(c.bos_token_id, r.Int("bos_token_id", -1));
  if (c.bos_token_id < -1 || c.bos_token_id >= c.vocab_size) {
    return r.Error("bos_token_id", absl::StrCat(c.bos_token_id, " is not a token of the ",
                                                c.vocab_size, "-token vocabulary"));
  }
  if (r.Has("eos_token_id")) {
    const json& e = j["eos_token_id"];
    if (e.is_number_integer()) {
      c.eos_token_ids.push_back(e.get<int64_t>());
    } else if (e.is_array() && e.size() <= 64) {
      for (const json& id : e) {
        if (!id.is_number_integer()) return r.Error("eos_token_id", "must hold integers");
        c.eos_token_ids.push_back(id.get<int64_t>());
      }
    } else {
      return r.Error("eos_token_id", "must be an integer or a list of at most 64 integers");
    }
    for (int64_t id : c.eos_token_ids) {
      if (id < 0 || id >= c.vocab_size) {
        return r.Error("eos_token_id", absl::StrCat(id, " is not a token of the ", c.vocab_size,
                                                    "-token vocabulary"));
      }
    }
  }
  return c;
}

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text,
                                             const std::string& source) {
  ASSIGN_OR_RETURN(ModelConfig c, DescribeModelConfig(json_text, source));
  if (!c.not_loaded.empty()) return absl::InvalidArgumentError(c.not_loaded);
  return c;
}

double ModelConfig::attention_scale() const {
  if (mla) {  // transformers' yarn_apply_mscale
    double scale = 1.0 / std::sqrt(static_cast<double>(qk_nope_dim + head_dim));
    if (rope_scaling == RopeScaling::kYarn && rope_mscale_all_dim != 0 && rope_factor > 1) {
      const double m = 0.1 * rope_mscale_all_dim * std::log(rope_factor) + 1.0;
      scale *= m * m;
    }
    return scale;
  }
  return rope_attention_factor * rope_attention_factor / std::sqrt(static_cast<double>(head_dim));
}

absl::Status AddGenerationEosIds(const std::string& json_text, const std::string& source,
                                 ModelConfig& c) {
  const json j = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
  }
  if (!j.contains("eos_token_id") || j["eos_token_id"].is_null()) return absl::OkStatus();
  const json& e = j["eos_token_id"];
  std::vector<json> ids;
  if (e.is_array() && e.size() <= 64) {
    ids.assign(e.begin(), e.end());
  } else {
    ids.push_back(e);
  }
  for (const json& id : ids) {  // all checked before any is taken
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": eos_token_id ", id.dump(), " is not a token of the ",
                       c.vocab_size, "-token vocabulary (an integer or a list of at most 64)"));
    }
  }
  for (const json& id : ids) {
    if (absl::c_find(c.eos_token_ids, id.get<int64_t>()) == c.eos_token_ids.end()) {
      c.eos_token_ids.push_back(id.get<int64_t>());
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir) {
  ASSIGN_OR_RETURN(const std::optional<std::string> gguf, FindGgufFile(model_dir));
  if (gguf) {
    ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> f, GgufFile::Open(*gguf));
    return GgufModelConfig(*f);
  }
  const std::filesystem::path dir(model_dir);
  const std::string path = (dir / "config.json").string();
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  ASSIGN_OR_RETURN(ModelConfig c, ParseModelConfig(text, path));
  const std::string generation = (dir / "generation_config.json").string();
  std::error_code ec;
  if (std::filesystem::is_regular_file(generation, ec)) {
    ASSIGN_OR_RETURN(text, ReadFileToString(generation));
    RETURN_IF_ERROR(AddGenerationEosIds(text, generation, c));
  }
  return c;
}

}  // namespace shardserve
