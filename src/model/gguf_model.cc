#include "model/gguf_model.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <tuple>
#include <unordered_map>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace shardserve {
namespace {

using json = nlohmann::json;

}  // namespace

const std::vector<GgufName> kGgufLayerNames = {
    {"attn_norm.weight", "input_layernorm.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
    {"attn_q.weight", "self_attn.q_proj.weight"},
    {"attn_k.weight", "self_attn.k_proj.weight"},
    {"attn_v.weight", "self_attn.v_proj.weight"},
    {"attn_output.weight", "self_attn.o_proj.weight"},
    {"attn_q.bias", "self_attn.q_proj.bias"},
    {"attn_k.bias", "self_attn.k_proj.bias"},
    {"attn_v.bias", "self_attn.v_proj.bias"},
    {"attn_output.bias", "self_attn.o_proj.bias"},
    {"ffn_gate.weight", "mlp.gate_proj.weight"},
    {"ffn_up.weight", "mlp.up_proj.weight"},
    {"ffn_down.weight", "mlp.down_proj.weight"},
    {"ffn_gate_inp.weight", "block_sparse_moe.gate.weight"},
    {"attn_q_norm.weight", "self_attn.q_norm.weight"},  // Qwen3: RMSNorm of each q / k head
    {"attn_k_norm.weight", "self_attn.k_norm.weight"},
    // DeepSeek-V3 (deepseek2): MLA's projections; k_b and v_b are kv_b_proj's key rows (each
    // head's [kv_lora_rank][nope], transposed) and value rows, apart, as llama.cpp now writes it.
    {"attn_q_a.weight", "self_attn.q_a_proj.weight"},
    {"attn_q_a_norm.weight", "self_attn.q_a_layernorm.weight"},
    {"attn_q_b.weight", "self_attn.q_b_proj.weight"},
    {"attn_kv_a_mqa.weight", "self_attn.kv_a_proj_with_mqa.weight"},
    {"attn_kv_a_norm.weight", "self_attn.kv_a_layernorm.weight"},
    {"attn_kv_b.weight", "self_attn.kv_b_proj.weight"},
    {"attn_k_b.weight", "self_attn.k_b_proj.weight"},
    {"attn_v_b.weight", "self_attn.v_b_proj.weight"},
    {"exp_probs_b.bias", "mlp.gate.e_score_correction_bias"},
    {"ffn_gate_shexp.weight", "mlp.shared_experts.gate_proj.weight"},
    {"ffn_up_shexp.weight", "mlp.shared_experts.up_proj.weight"},
    {"ffn_down_shexp.weight", "mlp.shared_experts.down_proj.weight"},
    // gpt-oss: sinks, the norm before the experts, the router's bias and the experts' biases
    // ([E][rows], gate and up apart).
    {"attn_sinks.weight", "self_attn.sinks"},
    {"post_attention_norm.weight", "post_attention_layernorm.weight"},
    {"ffn_gate_inp.bias", "block_sparse_moe.gate.bias"},
    {"ffn_gate_exps.bias", "mlp.experts.gate_proj_bias"},
    {"ffn_up_exps.bias", "mlp.experts.up_proj_bias"},
    {"ffn_down_exps.bias", "mlp.experts.down_proj_bias"},
    // DeepSeek-V3's multi-token-prediction layer (llama.cpp's nextn tensors, in the block after
    // the model's; embed_tokens and the shared head's may be left out, the model's then).
    {"nextn.eh_proj.weight", "eh_proj.weight"},
    {"nextn.enorm.weight", "enorm.weight"},
    {"nextn.hnorm.weight", "hnorm.weight"},
    {"nextn.embed_tokens.weight", "embed_tokens.weight"},
    {"nextn.shared_head_head.weight", "shared_head.head.weight"},
    {"nextn.shared_head_norm.weight", "shared_head.norm.weight"},
};
const std::vector<GgufName> kGgufExpertNames = {
    {"ffn_gate_exps.weight", "w1.weight"},
    {"ffn_down_exps.weight", "w2.weight"},
    {"ffn_up_exps.weight", "w3.weight"},
};

std::string GgufLayerHfName(const ModelConfig& c, const GgufName& n) {
  const std::string hf = n.hf;
  if (!absl::StartsWith(hf, "block_sparse_moe.gate.")) return hf;
  if (c.gpt_oss) return "mlp.router." + hf.substr(hf.rfind('.') + 1);
  if (c.architecture == "Qwen3MoeForCausalLM" || c.mla)
    return "mlp.gate." + hf.substr(hf.rfind('.') + 1);
  return hf;
}

std::string GgufExpertHfName(const ModelConfig& c, int64_t e, const GgufName& n) {
  if (c.architecture == "MixtralForCausalLM") {
    return absl::StrCat("block_sparse_moe.experts.", e, ".", n.hf);
  }
  const std::string hf = n.hf;
  const char* proj = hf == "w1.weight" ? "gate_proj" : hf == "w2.weight" ? "down_proj" : "up_proj";
  return absl::StrCat("mlp.experts.", e, ".", proj, ".weight");
}

namespace {

absl::StatusOr<DType> DTypeOf(const GgufTensor& t) {
  switch (t.type) {
    case GgmlType::kF32:
      return DType::kF32;
    case GgmlType::kF16:
      return DType::kF16;
    case GgmlType::kBF16:
      return DType::kBF16;
    case GgmlType::kQ8_0:
      return DType::kQ8_0;
    case GgmlType::kQ4_0:
      return DType::kQ4_0;
    case GgmlType::kQ4_1:
      return DType::kQ4_1;
    case GgmlType::kQ4_K:
      return DType::kQ4_K;
    case GgmlType::kQ5_K:
      return DType::kQ5_K;
    case GgmlType::kQ6_K:
      return DType::kQ6_K;
    case GgmlType::kMXFP4:
      return DType::kMXFP4;
    default:
      break;
  }
  return absl::UnimplementedError(absl::StrCat(
      "tensor '", t.name, "' has type ",
      GgmlTypeName(static_cast<uint32_t>(t.type)).value_or("unknown"),
      ", which shardserve does not run (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K; "
      "MXFP4 experts)"));
}

// The pre-tokenizers of tokenizer.ggml.pre as Hugging Face writes them (llama.cpp's names).
constexpr char kGpt2Regex[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr char kLlama3Regex[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr char kQwen2Regex[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

json ByteLevel(bool use_regex) {
  return {{"type", "ByteLevel"},
          {"add_prefix_space", false},
          {"trim_offsets", true},
          {"use_regex", use_regex}};
}
json SplitThenByteLevel(const char* regex) {
  return {{"type", "Sequence"},
          {"pretokenizers", json::array({{{"type", "Split"},
                                          {"pattern", {{"Regex", regex}}},
                                          {"behavior", "Isolated"},
                                          {"invert", false}},
                                         ByteLevel(false)})}};
}

absl::StatusOr<json> PreTokenizer(const std::string& file, const std::string& pre) {
  if (pre == "gpt-2") return SplitThenByteLevel(kGpt2Regex);
  if (pre == "llama-bpe" || pre == "llama3") return SplitThenByteLevel(kLlama3Regex);
  if (pre == "qwen2") return SplitThenByteLevel(kQwen2Regex);
  if (pre == "smollm") {  // every digit alone, then GPT-2's split
    return json{{"type", "Sequence"},
                {"pretokenizers", json::array({{{"type", "Digits"}, {"individual_digits", true}},
                                               ByteLevel(true)})}};
  }
  return absl::UnimplementedError(
      absl::StrCat(file, ": tokenizer.ggml.pre '", pre,
                   "' is not a pre-tokenizer shardserve knows (gpt-2, llama-bpe, qwen2, smollm)"));
}

}  // namespace

int64_t GgufRotaryRow(int64_t file_row, int64_t head_dim) {
  const int64_t head = file_row / head_dim, in_head = file_row % head_dim;
  return head * head_dim + (in_head % 2) * (head_dim / 2) + in_head / 2;
}

absl::StatusOr<std::optional<std::string>> FindGgufFile(const std::string& model_path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_regular_file(model_path, ec)) return std::optional<std::string>(model_path);
  if (!fs::is_directory(model_path, ec)) return std::optional<std::string>();  // said later
  if (fs::exists(fs::path(model_path) / "model.safetensors") ||
      fs::exists(fs::path(model_path) / "model.safetensors.index.json")) {
    return std::optional<std::string>();
  }
  std::vector<std::string> found;
  for (const auto& e : fs::directory_iterator(model_path, ec)) {
    if (e.is_regular_file(ec) && absl::EndsWith(e.path().filename().string(), ".gguf")) {
      found.push_back(e.path().string());
    }
  }
  std::sort(found.begin(), found.end());
  // The parts of one split model (gguf-split's PREFIX-0000i-of-0000N.gguf) name the model by
  // their first; GgufFile::Open names any part missing.
  const auto first = found.empty() ? std::nullopt : ParseGgufSplitName(found[0]);
  const bool one_split =
      found.size() > 1 && first && std::all_of(found.begin(), found.end(), [&](const auto& p) {
        const auto part = ParseGgufSplitName(p);
        return part && part->prefix == first->prefix && part->count == first->count;
      });
  if (found.size() > 1 && !one_split) {
    return absl::InvalidArgumentError(
        absl::StrCat(model_path, ": holds ", found.size(),
                     " GGUF files; name the one to serve: ", absl::StrJoin(found, ", ")));
  }
  if (found.empty()) return std::optional<std::string>();
  return std::optional<std::string>(found[0]);
}

namespace {

bool Has(const GgufFile& f, const std::string& key) { return f.metadata().count(key) > 0; }

absl::StatusOr<bool> GetBool(const GgufFile& f, const std::string& key) {
  const bool* b = std::get_if<bool>(&f.metadata().at(key).v);
  if (b == nullptr)
    return absl::InvalidArgumentError(absl::StrCat(f.path(), ": ", key, " must be a bool"));
  return *b;
}

// rope.scaling.* as config.json's rope_scaling; YaRN's fields where the file gives them.
absl::StatusOr<json> RopeScalingOf(const GgufFile& f, const std::string& p) {
  ASSIGN_OR_RETURN(const std::string type, f.GetString(p + "rope.scaling.type"));
  if (type == "none") return json();
  if (type != "linear" && type != "yarn") {
    return absl::UnimplementedError(absl::StrCat(f.path(), ": ", p, "rope.scaling.type '", type,
                                                 "' is not one shardserve runs (none, linear, "
                                                 "yarn)"));
  }
  ASSIGN_OR_RETURN(const double factor, f.GetFloat(p + "rope.scaling.factor"));
  json out = {{"rope_type", type}, {"factor", factor}};
  if (type == "yarn") {
    ASSIGN_OR_RETURN(out["original_max_position_embeddings"],
                     f.GetUint(p + "rope.scaling.original_context_length"));
    for (const auto& [key, field] : {std::pair{"yarn_beta_fast", "beta_fast"},
                                     {"yarn_beta_slow", "beta_slow"},
                                     {"yarn_attn_factor", "attention_factor"}}) {
      if (Has(f, p + "rope.scaling." + key)) {
        ASSIGN_OR_RETURN(out[field], f.GetFloat(p + "rope.scaling." + key));
      }
    }
    if (Has(f, p + "rope.scaling.yarn_ext_factor")) {
      return absl::UnimplementedError(absl::StrCat(
          f.path(), ": ", p, "rope.scaling.yarn_ext_factor is not something shardserve runs"));
    }
  }
  return out;
}

// A head's size (key_length, value_length alike) and its rotated dims (all of them), and the
// RoPE scaling.
absl::Status HeadFields(const GgufFile& f, const std::string& arch, json& j) {
  const std::string p = arch + ".";
  if (Has(f, p + "attention.key_length")) {
    ASSIGN_OR_RETURN(j["head_dim"], f.GetUint(p + "attention.key_length"));
    if (Has(f, p + "attention.value_length")) {
      ASSIGN_OR_RETURN(const uint64_t v, f.GetUint(p + "attention.value_length"));
      if (v != j["head_dim"].get<uint64_t>()) {
        return absl::UnimplementedError(absl::StrCat(
            f.path(), ": ", p, "attention.value_length ", v, " differs from key_length ",
            j["head_dim"].get<uint64_t>(), ", which shardserve does not run"));
      }
    }
  }
  const uint64_t heads = j["num_attention_heads"].get<uint64_t>();
  const uint64_t head_dim = j.contains("head_dim")
                                ? j["head_dim"].get<uint64_t>()
                                : j["hidden_size"].get<uint64_t>() / std::max<uint64_t>(1, heads);
  if (Has(f, p + "rope.dimension_count")) {
    ASSIGN_OR_RETURN(const uint64_t rot, f.GetUint(p + "rope.dimension_count"));
    if (rot != head_dim) {
      return absl::UnimplementedError(absl::StrCat(f.path(), ": ", p, "rope.dimension_count ", rot,
                                                   " rotates part of a head of ", head_dim,
                                                   ", which shardserve does not run"));
    }
  }
  if (Has(f, p + "rope.scaling.type")) {
    ASSIGN_OR_RETURN(j["rope_scaling"], RopeScalingOf(f, p));
    if (arch == "gpt-oss" && j["rope_scaling"].is_object()) {
      j["rope_scaling"]["truncate"] = false;  // GptOssConfig's YaRN, which the file cannot say
    }
  }
  return absl::OkStatus();
}

// llama.cpp's deepseek2 as DeepSeek-V3's config.json. The file's attention is MLA written as
// MQA over the latent (head_count_kv 1, key_length kv_lora_rank + rope dims, key_length_mla and
// value_length_mla a head's own sizes) or, in files converted before that, with the heads' sizes
// in key_length and value_length. YaRN's mscale is rope.scaling.yarn_log_multiplier / 0.1 (the
// converter's 0.1 x mscale_all_dim), on both mscale fields: llama.cpp scales cos and sin by none.
absl::Status DeepseekFields(const GgufFile& f, json& j) {
  const std::string p = "deepseek2.";
  j["architectures"] = {"DeepseekV3ForCausalLM"};
  j["model_type"] = "deepseek_v3";
  j["num_key_value_heads"] = j["num_attention_heads"];  // MLA: every head reads the latent
  if (Has(f, p + "attention.q_lora_rank")) {
    ASSIGN_OR_RETURN(j["q_lora_rank"], f.GetUint(p + "attention.q_lora_rank"));
  } else {
    j["q_lora_rank"] = nullptr;
  }
  ASSIGN_OR_RETURN(const uint64_t kv_lora, f.GetUint(p + "attention.kv_lora_rank"));
  j["kv_lora_rank"] = kv_lora;
  ASSIGN_OR_RETURN(const uint64_t rope, f.GetUint(p + "rope.dimension_count"));
  j["qk_rope_head_dim"] = rope;
  const bool mqa = Has(f, p + "attention.key_length_mla");
  if (mqa) {  // the MQA form's own keys must say the latent: one KV head of kv_lora + rope
    ASSIGN_OR_RETURN(const uint64_t kv_heads, f.GetUint(p + "attention.head_count_kv"));
    ASSIGN_OR_RETURN(const uint64_t key, f.GetUint(p + "attention.key_length"));
    if (kv_heads != 1 || key != kv_lora + rope) {
      return absl::InvalidArgumentError(absl::StrCat(
          f.path(), ": ", p, "attention.head_count_kv ", kv_heads, " and key_length ", key,
          " are not MLA's latent (1 and kv_lora_rank + rope dims = ", kv_lora + rope, ")"));
    }
  }
  ASSIGN_OR_RETURN(const uint64_t k,
                   f.GetUint(p + (mqa ? "attention.key_length_mla" : "attention.key_length")));
  ASSIGN_OR_RETURN(j["v_head_dim"],
                   f.GetUint(p + (mqa ? "attention.value_length_mla" : "attention.value_length")));
  if (k <= rope) {
    return absl::InvalidArgumentError(absl::StrCat(f.path(), ": a head's key of ", k,
                                                   " values leaves none beside its ", rope,
                                                   " rotated dims (", p, "rope.dimension_count)"));
  }
  j["qk_nope_head_dim"] = k - rope;
  ASSIGN_OR_RETURN(j["moe_intermediate_size"], f.GetUint(p + "expert_feed_forward_length"));
  ASSIGN_OR_RETURN(j["n_routed_experts"], f.GetUint(p + "expert_count"));
  ASSIGN_OR_RETURN(j["num_experts_per_tok"], f.GetUint(p + "expert_used_count"));
  j["n_shared_experts"] = 0;
  if (Has(f, p + "expert_shared_count")) {
    ASSIGN_OR_RETURN(j["n_shared_experts"], f.GetUint(p + "expert_shared_count"));
  }
  j["first_k_dense_replace"] = 0;
  if (Has(f, p + "leading_dense_block_count")) {
    ASSIGN_OR_RETURN(j["first_k_dense_replace"], f.GetUint(p + "leading_dense_block_count"));
  }
  j["routed_scaling_factor"] = 1.0;  // llama.cpp scales by none without the key
  if (Has(f, p + "expert_weights_scale")) {
    ASSIGN_OR_RETURN(j["routed_scaling_factor"], f.GetFloat(p + "expert_weights_scale"));
  }
  j["norm_topk_prob"] = false;
  if (Has(f, p + "expert_weights_norm")) {
    ASSIGN_OR_RETURN(j["norm_topk_prob"], GetBool(f, p + "expert_weights_norm"));
  }
  for (const auto& [key, field] :
       {std::pair{"expert_group_count", "n_group"}, {"expert_group_used_count", "topk_group"}}) {
    j[field] = 1;
    if (Has(f, p + key)) {
      ASSIGN_OR_RETURN(j[field], f.GetUint(p + key));
    }
  }
  // 1: softmax (DeepSeek-V2, llama.cpp's default), 2: sigmoid with the correction bias (V3).
  uint64_t gating = 1;
  if (Has(f, p + "expert_gating_func")) {
    ASSIGN_OR_RETURN(gating, f.GetUint(p + "expert_gating_func"));
  }
  if (gating != 2 ||
      !f.tensors().count(
          absl::StrCat("blk.", j["first_k_dense_replace"].get<uint64_t>(), ".exp_probs_b.bias"))) {
    return absl::UnimplementedError(absl::StrCat(
        f.path(), ": ", p, "expert_gating_func ", gating,
        " without DeepSeek-V3's sigmoid scores and correction bias (expert_gating_func 2, "
        "exp_probs_b) is DeepSeek-V2's routing, which shardserve does not run"));
  }
  if (Has(f, p + "rope.scaling.type")) {
    ASSIGN_OR_RETURN(j["rope_scaling"], RopeScalingOf(f, p));
    if (j["rope_scaling"].is_object() && j["rope_scaling"]["rope_type"] == "yarn") {
      double log_mul = 0;
      if (Has(f, p + "rope.scaling.yarn_log_multiplier")) {
        ASSIGN_OR_RETURN(log_mul, f.GetFloat(p + "rope.scaling.yarn_log_multiplier"));
      }
      if (j["rope_scaling"].contains("attention_factor") &&
          j["rope_scaling"]["attention_factor"].get<double>() != 1.0) {
        return absl::UnimplementedError(absl::StrCat(
            f.path(), ": ", p,
            "rope.scaling.yarn_attn_factor other than 1 scales MLA's rotated dims, which "
            "shardserve does not run"));
      }
      j["rope_scaling"]["mscale"] = j["rope_scaling"]["mscale_all_dim"] = log_mul / 0.1;
      j["rope_scaling"]["attention_factor"] = 1.0;
    }
  }
  return absl::OkStatus();
}

// gpt-oss: its experts' size, the window of its sliding layers (llama.cpp's: every other layer,
// the first sliding), its YaRN (above). llama.cpp fixes the clamp of the SwiGLU at 7.0, alpha
// 1.702 (GptOssConfig's).
absl::Status GptOssFields(const GgufFile& f, json& j) {
  const std::string p = "gpt-oss.";
  j["architectures"] = {"GptOssForCausalLM"};
  j["model_type"] = "gpt_oss";
  ASSIGN_OR_RETURN(j["num_local_experts"], f.GetUint(p + "expert_count"));
  ASSIGN_OR_RETURN(j["num_experts_per_tok"], f.GetUint(p + "expert_used_count"));
  ASSIGN_OR_RETURN(j["intermediate_size"], f.GetUint(p + "expert_feed_forward_length"));
  ASSIGN_OR_RETURN(j["sliding_window"], f.GetUint(p + "attention.sliding_window"));
  if (Has(f, p + "attention.sliding_window_pattern")) {  // llama.cpp's gpt-oss has none
    return absl::UnimplementedError(absl::StrCat(
        f.path(), ": ", p,
        "attention.sliding_window_pattern is not read for gpt-oss (every other layer slides, "
        "the first)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelConfig> GgufModelConfig(const GgufFile& f) {
  ASSIGN_OR_RETURN(const std::string arch, f.GetString("general.architecture"));
  if (arch != "llama" && arch != "qwen2" && arch != "qwen3" && arch != "qwen3moe" &&
      arch != "deepseek2" && arch != "gpt-oss") {
    return absl::UnimplementedError(absl::StrCat(f.path(), ": general.architecture '", arch,
                                                 "' is not one shardserve runs (llama, qwen2, "
                                                 "qwen3, qwen3moe, deepseek2, gpt-oss)"));
  }
  const std::string p = arch + ".";
  json j;
  ASSIGN_OR_RETURN(j["hidden_size"], f.GetUint(p + "embedding_length"));
  ASSIGN_OR_RETURN(j["intermediate_size"], f.GetUint(p + "feed_forward_length"));
  ASSIGN_OR_RETURN(const uint64_t blocks, f.GetUint(p + "block_count"));
  j["num_hidden_layers"] = blocks;
  // llama.cpp counts the multi-token-prediction (nextn) layers in block_count, after the others.
  if (Has(f, p + "nextn_predict_layers")) {
    ASSIGN_OR_RETURN(const uint64_t nextn, f.GetUint(p + "nextn_predict_layers"));
    if (nextn >= blocks) {
      return absl::InvalidArgumentError(absl::StrCat(f.path(), ": ", p, "nextn_predict_layers ",
                                                     nextn, " leaves none of ", p, "block_count ",
                                                     blocks));
    }
    j["num_hidden_layers"] = blocks - nextn;
    j["num_nextn_predict_layers"] = nextn;
  }
  // The file's layers must be the ones it declares: a file that holds more would run truncated.
  for (const auto& [name, tensor] : f.tensors()) {
    uint64_t block;
    const size_t dot = name.find('.', 4);
    if (absl::StartsWith(name, "blk.") && dot != std::string::npos &&
        absl::SimpleAtoi(name.substr(4, dot - 4), &block) && block >= blocks) {
      return absl::InvalidArgumentError(absl::StrCat(
          f.path(), ": tensor '", name, "' is of a layer past ", p, "block_count ", blocks));
    }
  }
  ASSIGN_OR_RETURN(const uint64_t heads, f.GetUint(p + "attention.head_count"));
  j["num_attention_heads"] = heads;
  j["num_key_value_heads"] = heads;
  if (Has(f, p + "attention.head_count_kv")) {
    ASSIGN_OR_RETURN(j["num_key_value_heads"], f.GetUint(p + "attention.head_count_kv"));
  }
  ASSIGN_OR_RETURN(j["max_position_embeddings"], f.GetUint(p + "context_length"));
  ASSIGN_OR_RETURN(j["rms_norm_eps"], f.GetFloat(p + "attention.layer_norm_rms_epsilon"));
  if (Has(f, p + "rope.freq_base")) {
    ASSIGN_OR_RETURN(j["rope_theta"], f.GetFloat(p + "rope.freq_base"));
  }
  if (arch == "deepseek2") {
    RETURN_IF_ERROR(DeepseekFields(f, j));
  } else {
    RETURN_IF_ERROR(HeadFields(f, arch, j));
  }
  if (f.tensors().count("rope_freqs.weight")) {
    return absl::UnimplementedError(absl::StrCat(
        f.path(),
        ": tensor 'rope_freqs.weight' (per-frequency RoPE factors, e.g. Llama 3.1's) is "
        "not something shardserve runs from GGUF yet"));
  }
  auto embed = f.tensors().find("token_embd.weight");
  if (embed == f.tensors().end() || embed->second.dims.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.path(), ": no 2-dimensional tensor 'token_embd.weight'"));
  }
  j["vocab_size"] = embed->second.dims[1];
  j["tie_word_embeddings"] = f.tensors().count("output.weight") == 0;
  uint64_t experts = 0;
  if (Has(f, p + "expert_count")) {
    ASSIGN_OR_RETURN(experts, f.GetUint(p + "expert_count"));
  }
  if (arch == "deepseek2") {
    // DeepseekFields above
  } else if (arch == "gpt-oss") {
    RETURN_IF_ERROR(GptOssFields(f, j));
  } else if (arch == "qwen3moe") {  // llama.cpp renormalizes the k experts' weights
    j["architectures"] = {"Qwen3MoeForCausalLM"};
    j["model_type"] = "qwen3_moe";
    ASSIGN_OR_RETURN(j["num_experts"], f.GetUint(p + "expert_count"));
    ASSIGN_OR_RETURN(j["num_experts_per_tok"], f.GetUint(p + "expert_used_count"));
    ASSIGN_OR_RETURN(j["moe_intermediate_size"], f.GetUint(p + "expert_feed_forward_length"));
    j["norm_topk_prob"] = true;
  } else if (experts > 0) {
    j["architectures"] = {"MixtralForCausalLM"};
    j["model_type"] = "mixtral";
    j["num_local_experts"] = experts;
    ASSIGN_OR_RETURN(j["num_experts_per_tok"], f.GetUint(p + "expert_used_count"));
  } else {
    j["architectures"] = {arch == "qwen2"   ? "Qwen2ForCausalLM"
                          : arch == "qwen3" ? "Qwen3ForCausalLM"
                                            : "LlamaForCausalLM"};
    j["model_type"] = arch;
  }
  if (arch == "llama") j["attention_bias"] = f.tensors().count("blk.0.attn_q.bias") > 0;
  if (Has(f, "tokenizer.ggml.bos_token_id")) {
    ASSIGN_OR_RETURN(j["bos_token_id"], f.GetUint("tokenizer.ggml.bos_token_id"));
  }
  if (Has(f, "tokenizer.ggml.eos_token_id")) {
    ASSIGN_OR_RETURN(j["eos_token_id"], f.GetUint("tokenizer.ggml.eos_token_id"));
  }
  ASSIGN_OR_RETURN(ModelConfig c,
                   ParseModelConfig(j.dump(), absl::StrCat(f.path(), " (GGUF metadata)")));
  c.kv_auto_dtype = DType::kF16;
  return c;
}

absl::StatusOr<std::map<std::string, TensorView>> GgufTensors(
    const GgufFile& f, const ModelConfig& c, std::vector<std::unique_ptr<uint8_t[]>>& owned) {
  auto view = [&](const GgufTensor& t, const std::string& name) -> absl::StatusOr<TensorView> {
    TensorView v;
    v.name = name;
    v.file = f.path(t.part);
    ASSIGN_OR_RETURN(v.dtype, DTypeOf(t));
    v.shape.assign(t.dims.rbegin(), t.dims.rend());
    v.data = t.data;
    v.nbytes = t.bytes;
    v.file_offset = static_cast<uint64_t>(t.data - f.file_data(t.part));
    return v;
  };
  // The q / k rows back in Hugging Face order, in memory of our own.
  auto unpermute = [&](TensorView& v) {
    const size_t row = v.nbytes / v.shape[0];
    auto buf = std::make_unique<uint8_t[]>(v.nbytes);
    const auto* src = static_cast<const uint8_t*>(v.data);
    for (int64_t r = 0; r < v.shape[0]; ++r) {
      std::memcpy(buf.get() + GgufRotaryRow(r, c.head_dim) * row, src + r * row, row);
    }
    v.data = buf.get();
    owned.push_back(std::move(buf));
  };
  // llama.cpp interleaves the rotary rows of `llama`'s q and k (Llama, Mistral, Mixtral) only.
  ASSIGN_OR_RETURN(const std::string arch, f.GetString("general.architecture"));
  std::map<std::string, TensorView> out;
  for (const auto& [name, t] : f.tensors()) {
    std::string hf;
    if (name == "token_embd.weight") hf = "model.embed_tokens.weight";
    if (name == "output_norm.weight") hf = "model.norm.weight";
    if (name == "output.weight") hf = "lm_head.weight";
    if (!hf.empty()) {
      ASSIGN_OR_RETURN(out[hf], view(t, hf));
      continue;
    }
    int64_t layer = -1;
    size_t used = 0;
    // The model's layers and the first multi-token-prediction layer (the one MTP runs).
    if (std::sscanf(name.c_str(), "blk.%ld.%zn", &layer, &used) != 1 || used == 0 || layer < 0 ||
        layer >= c.num_layers + std::min<int64_t>(c.mtp_layers, 1)) {
      continue;  // not a tensor the model reads: rope_freqs and the like were refused above
    }
    const std::string rest = name.substr(used);
    const std::string layer_prefix = absl::StrCat("model.layers.", layer, ".");
    for (const GgufName& n : kGgufLayerNames) {
      if (rest != n.gguf) continue;
      const std::string full = layer_prefix + GgufLayerHfName(c, n);
      ASSIGN_OR_RETURN(TensorView v, view(t, full));
      const bool rotary = rest == "attn_q.weight" || rest == "attn_k.weight" ||
                          rest == "attn_q.bias" || rest == "attn_k.bias";
      if (arch == "llama" && rotary && v.shape[0] % c.head_dim == 0) unpermute(v);
      if (v.shape.size() == 3 && (rest == "attn_k_b.weight" || rest == "attn_v_b.weight")) {
        v.shape = {v.shape[0] * v.shape[1], v.shape[2]};  // the heads' matrices one under another
      }
      out[full] = v;
    }
    for (const GgufName& n : kGgufExpertNames) {
      if (rest != n.gguf) continue;
      ASSIGN_OR_RETURN(TensorView all, view(t, name));
      if (all.shape.size() != 3 || all.shape[0] != c.num_experts) {
        return absl::InvalidArgumentError(absl::StrCat(f.path(), ": tensor '", name, "' has shape ",
                                                       all.ShapeString(), ", expected ",
                                                       c.num_experts, " stacked experts"));
      }
      const size_t each = all.nbytes / c.num_experts;
      for (int64_t e = 0; e < c.num_experts; ++e) {
        TensorView v = all;
        v.name = layer_prefix + GgufExpertHfName(c, e, n);
        v.shape = {all.shape[1], all.shape[2]};
        v.data = static_cast<const uint8_t*>(all.data) + e * each;
        v.nbytes = each;
        v.file_offset = all.file_offset + e * each;
        out[v.name] = v;
      }
    }
  }
  return out;
}

namespace {

// The code points of a UTF-8 string, as byte offsets (the last one: its size).
std::vector<size_t> CodePointOffsets(const std::string& s) {
  std::vector<size_t> out;
  for (size_t i = 0; i < s.size(); ++i) {
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) out.push_back(i);
  }
  out.push_back(s.size());
  return out;
}

// The merges a SentencePiece vocabulary implies, as transformers derives them for a GGUF file
// that lists none (tokenization_utils_base.generate_merges): every split of a token into two
// tokens, at code point boundaries, is a merge with the token's score; a token's splits in the
// order of their ids, and all of them by score, then the left and right lengths in code points,
// best first (a stable sort).
std::vector<std::pair<std::string, std::string>> MergesFromScores(
    const std::vector<std::string>& tokens, const std::vector<double>& scores) {
  std::unordered_map<std::string, size_t> id;     // the last id of a spelling
  std::unordered_map<std::string, double> score;  // the last score of a spelling
  std::vector<size_t> order;                      // first occurrences, in order
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (!score.count(tokens[i])) order.push_back(i);
    id[tokens[i]] = i;
    score[tokens[i]] = scores[i];
  }
  struct Merge {
    std::string left, right;
    size_t left_id, right_id;
    double score;
    size_t left_len, right_len;
  };
  std::vector<Merge> merges;
  for (size_t i : order) {
    const std::string& t = tokens[i];
    const std::vector<size_t> cut = CodePointOffsets(t);
    const size_t n = cut.size() - 1;  // code points
    std::vector<Merge> local;
    for (size_t k = 1; k < n; ++k) {
      std::string l = t.substr(0, cut[k]), r = t.substr(cut[k]);
      const auto li = id.find(l), ri = id.find(r);
      if (li != id.end() && ri != id.end()) {
        local.push_back({std::move(l), std::move(r), li->second, ri->second, score[t], k, n - k});
      }
    }
    std::stable_sort(local.begin(), local.end(), [](const Merge& a, const Merge& b) {
      return std::pair(a.left_id, a.right_id) < std::pair(b.left_id, b.right_id);
    });
    for (Merge& m : local) merges.push_back(std::move(m));
  }
  std::stable_sort(merges.begin(), merges.end(), [](const Merge& a, const Merge& b) {
    return std::tuple(a.score, a.left_len, a.right_len) >
           std::tuple(b.score, b.left_len, b.right_len);
  });
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(merges.size());
  for (Merge& m : merges) out.emplace_back(std::move(m.left), std::move(m.right));
  return out;
}

}  // namespace

absl::StatusOr<GgufTokenizerFiles> GgufTokenizer(const GgufFile& f) {
  ASSIGN_OR_RETURN(const std::string model, f.GetString("tokenizer.ggml.model"));
  const bool sentencepiece = model == "llama";
  if (model != "gpt2" && !sentencepiece) {
    return absl::UnimplementedError(absl::StrCat(
        f.path(), ": tokenizer.ggml.model '", model,
        "' is not a tokenizer shardserve reads from GGUF (gpt2: byte-level BPE; llama: "
        "SentencePiece BPE with byte fallback)"));
  }
  auto strings = [&](const std::string& key) -> absl::StatusOr<std::vector<std::string>> {
    ASSIGN_OR_RETURN(const GgufArray* a, f.GetArray(key));
    std::vector<std::string> out;
    out.reserve(a->size());
    for (const GgufValue& v : *a) {
      if (v.type != kGgufString) {
        return absl::InvalidArgumentError(absl::StrCat(f.path(), ": ", key, " must hold strings"));
      }
      out.push_back(std::get<std::string>(v.v));
    }
    return out;
  };
  ASSIGN_OR_RETURN(const std::vector<std::string> tokens, strings("tokenizer.ggml.tokens"));
  // Real vocabularies' longest tokens are runs of a few dozen spaces; the bound keeps a damaged
  // file's merge recovery (quadratic in a token's length) from running for hours.
  constexpr size_t kMaxTokenBytes = 1024;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i].size() > kMaxTokenBytes) {
      return absl::InvalidArgumentError(absl::StrCat(f.path(), ": tokenizer.ggml.tokens[", i,
                                                     "] is ", tokens[i].size(), " bytes (at most ",
                                                     kMaxTokenBytes, ")"));
    }
  }
  std::vector<std::pair<std::string, std::string>> merge_pairs;
  if (!sentencepiece || f.metadata().count("tokenizer.ggml.merges")) {
    ASSIGN_OR_RETURN(const std::vector<std::string> merges, strings("tokenizer.ggml.merges"));
    for (const std::string& m : merges) {
      const size_t space = m.find(' ', 1);
      if (space == std::string::npos) {
        return absl::InvalidArgumentError(
            absl::StrCat(f.path(), ": tokenizer.ggml.merges entry '", m, "' is not two tokens"));
      }
      merge_pairs.emplace_back(m.substr(0, space), m.substr(space + 1));
    }
  } else {  // SentencePiece files list scores instead
    ASSIGN_OR_RETURN(const GgufArray* a, f.GetArray("tokenizer.ggml.scores"));
    if (a->size() != tokens.size()) {
      return absl::InvalidArgumentError(absl::StrCat(f.path(), ": tokenizer.ggml.scores has ",
                                                     a->size(), " entries for ", tokens.size(),
                                                     " tokens"));
    }
    std::vector<double> scores;
    for (const GgufValue& v : *a) {
      const double* d = std::get_if<double>(&v.v);
      if (d == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat(f.path(), ": tokenizer.ggml.scores must hold floats"));
      }
      scores.push_back(*d);
    }
    merge_pairs = MergesFromScores(tokens, scores);
  }
  std::vector<int64_t> types(tokens.size(), 1);  // 1: normal
  if (f.metadata().count("tokenizer.ggml.token_type")) {
    ASSIGN_OR_RETURN(const GgufArray* a, f.GetArray("tokenizer.ggml.token_type"));
    if (a->size() != tokens.size()) {
      return absl::InvalidArgumentError(absl::StrCat(f.path(), ": tokenizer.ggml.token_type has ",
                                                     a->size(), " entries for ", tokens.size(),
                                                     " tokens"));
    }
    for (size_t i = 0; i < a->size(); ++i) {
      const GgufValue& v = (*a)[i];
      if (const auto* s = std::get_if<int64_t>(&v.v)) types[i] = *s;
      if (const auto* u = std::get_if<uint64_t>(&v.v)) types[i] = static_cast<int64_t>(*u);
    }
  }
  std::string pre = "default";  // llama.cpp's name when the key is absent
  if (!sentencepiece && f.metadata().count("tokenizer.ggml.pre")) {
    ASSIGN_OR_RETURN(pre, f.GetString("tokenizer.ggml.pre"));
  }
  json vocab = json::object(), added = json::array();
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (!vocab.contains(tokens[i])) vocab[tokens[i]] = i;
    // 3: control (special), 4: user-defined (added, not special).
    if (types[i] == 3 || types[i] == 4) {
      added.push_back({{"id", i},
                       {"content", tokens[i]},
                       {"single_word", false},
                       {"lstrip", false},
                       {"rstrip", false},
                       {"normalized", false},
                       {"special", types[i] == 3}});
    }
  }
  json merges_json = json::array();
  for (const auto& [l, r] : merge_pairs) merges_json.push_back(json::array({l, r}));
  json j;
  j["version"] = "1.0";
  j["added_tokens"] = added;
  j["normalizer"] = nullptr;
  if (sentencepiece) {                        // transformers' LlamaTokenizer
    const std::string meta = "\xE2\x96\x81";  // U+2581, SentencePiece's space
    j["pre_tokenizer"] = {{"type", "Metaspace"},
                          {"replacement", meta},
                          {"prepend_scheme", "first"},
                          {"split", false}};
    j["decoder"] = {
        {"type", "Sequence"},
        {"decoders",
         json::array({{{"type", "Replace"}, {"pattern", {{"String", meta}}}, {"content", " "}},
                      {{"type", "ByteFallback"}},
                      {{"type", "Fuse"}},
                      {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}};
  } else {
    ASSIGN_OR_RETURN(j["pre_tokenizer"], PreTokenizer(f.path(), pre));
    j["decoder"] = ByteLevel(true);
  }
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", sentencepiece},
                {"byte_fallback", sentencepiece},
                {"ignore_merges", pre == "llama-bpe" || pre == "llama3"},
                {"vocab", vocab},
                {"merges", merges_json}};
  json config = json::object();
  auto token_text = [&](const char* key) -> absl::StatusOr<std::string> {
    if (!f.metadata().count(key)) return std::string();
    ASSIGN_OR_RETURN(const uint64_t id, f.GetUint(key));
    if (id >= tokens.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(f.path(), ": ", key, " ", id, " is outside the ", tokens.size(), " tokens"));
    }
    return tokens[id];
  };
  ASSIGN_OR_RETURN(const std::string bos, token_text("tokenizer.ggml.bos_token_id"));
  ASSIGN_OR_RETURN(const std::string eos, token_text("tokenizer.ggml.eos_token_id"));
  bool add_bos = sentencepiece;  // transformers' default for a SentencePiece file without the key
  if (f.metadata().count("tokenizer.ggml.add_bos_token")) {
    const GgufValue& v = f.metadata().at("tokenizer.ggml.add_bos_token");
    if (const bool* b = std::get_if<bool>(&v.v)) add_bos = *b;
  }
  if (add_bos && !bos.empty()) {
    const int64_t bos_id = vocab[bos].get<int64_t>();
    j["post_processor"] = {
        {"type", "TemplateProcessing"},
        {"single", json::array({json{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}},
                                json{{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
        {"pair", json::array({json{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}},
                              json{{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                              json{{"SpecialToken", {{"id", bos}, {"type_id", 1}}}},
                              json{{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
        {"special_tokens", {{bos, {{"id", bos}, {"ids", {bos_id}}, {"tokens", {bos}}}}}}};
  } else {
    j["post_processor"] = nullptr;
  }
  if (!bos.empty()) config["bos_token"] = bos;
  if (!eos.empty()) config["eos_token"] = eos;
  if (f.metadata().count("tokenizer.chat_template")) {
    ASSIGN_OR_RETURN(config["chat_template"], f.GetString("tokenizer.chat_template"));
  }
  return GgufTokenizerFiles{j.dump(), config.dump()};
}

}  // namespace shardserve
