#include "devtools/gguf_convert.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "backend/cpu/kernels.h"
#include "common/status.h"
#include "common/text.h"
#include "common/thread_pool.h"
#include "devtools/gguf_writer.h"
#include "devtools/quantize_row.h"
#include "model/config.h"
#include "model/gguf_model.h"
#include "model/safetensors.h"
#include "nlohmann/json.hpp"

namespace shardserve {
namespace {

using json = nlohmann::json;

absl::StatusOr<GgmlType> GgmlOf(DType t) {
  switch (t) {
    case DType::kF32:
      return GgmlType::kF32;
    case DType::kF16:
      return GgmlType::kF16;
    case DType::kBF16:
      return GgmlType::kBF16;
    case DType::kQ8_0:
      return GgmlType::kQ8_0;
    case DType::kQ4_0:
      return GgmlType::kQ4_0;
    case DType::kQ4_1:
      return GgmlType::kQ4_1;
    case DType::kQ4_K:
      return GgmlType::kQ4_K;
    case DType::kQ5_K:
      return GgmlType::kQ5_K;
    case DType::kQ6_K:
      return GgmlType::kQ6_K;
    case DType::kQ4_KX:
    case DType::kQ4_1X:
    case DType::kQ6_KX:
    case DType::kBF16X:
      break;  // the CPU backend's own layout, no file's
    case DType::kMXFP4:
      return GgmlType::kMXFP4;
    case DType::kF8E4M3:
    case DType::kF8_128:
    case DType::kU8:
      break;  // scaled by blocks, no GGUF type
  }
  return absl::InvalidArgumentError(absl::StrCat("no GGUF type for ", DTypeName(t)));
}

// rows x cols F32 values stored as `type` (quantized rows on every core: an 8B model's weights
// take minutes on one).
std::string Encode(DType type, const std::vector<float>& v, int64_t rows, int64_t cols) {
  std::string out;
  if (IsQuantized(type)) {
    const size_t row_bytes = DTypeBytes(type, cols);
    out.resize(rows * row_bytes);
    ThreadPool::EveryCore().ParallelFor(rows, 16, [&](int, int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const std::string q = QuantizeRow(type, v.data() + r * cols, cols);
        std::memcpy(out.data() + r * row_bytes, q.data(), row_bytes);
      }
    });
    return out;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = v.data() + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      if (type == DType::kF32) {
        out.append(reinterpret_cast<const char*>(&row[c]), 4);
      } else {
        const uint16_t h = type == DType::kF16 ? F32ToF16(row[c]) : F32ToBf16(row[c]);
        out.append(reinterpret_cast<const char*>(&h), 2);
      }
    }
  }
  return out;
}

// A tensor's values as F32.
std::vector<float> Floats(const TensorView& t) {
  std::vector<float> v(t.numel());
  cpu::ToFloat(t.dtype, t.data, t.numel(), v.data());
  return v;
}

// The tokenizer of a byte-level BPE tokenizer.json, padded to vocab_size.
absl::Status SetTokenizer(GgufWriter& w, const std::string& dir, const ModelConfig& c) {
  const std::string path = (std::filesystem::path(dir) / "tokenizer.json").string();
  ASSIGN_OR_RETURN(const std::string text, ReadFileToString(path));
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON: ", e.what()));
  }
  const json& model = j["model"];
  if (!model.is_object() || model.value("type", "") != "BPE") {
    return absl::UnimplementedError(
        absl::StrCat(path,
                     ": only BPE tokenizers convert to GGUF (byte-level: tokenizer.ggml.model "
                     "gpt2; SentencePiece with byte fallback: llama)"));
  }
  // SentencePiece (byte fallback) is written as llama.cpp writes it: tokens with scores and
  // types, no merges; a reader recovers the merges from the scores (the token a merge makes
  // scores -rank).
  const bool sentencepiece = model.value("byte_fallback", false);
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  auto put = [&](int64_t id, const std::string& tok, int32_t type) {
    if (id >= static_cast<int64_t>(tokens.size())) {
      tokens.resize(id + 1);
      types.resize(id + 1, 0);
    }
    tokens[id] = tok;
    types[id] = type;
  };
  for (auto it = model["vocab"].begin(); it != model["vocab"].end(); ++it) {
    const std::string& tok = it.key();
    const bool byte =
        sentencepiece && tok.size() == 6 && absl::StartsWith(tok, "<0x") && tok.back() == '>';
    put(it.value().get<int64_t>(), tok, byte ? 6 : 1);  // 6: byte
  }
  const std::string unk = model.value("unk_token", json()).is_string()
                              ? model["unk_token"].get<std::string>()
                              : std::string();
  for (const json& a : j.value("added_tokens", json::array())) {
    put(a["id"].get<int64_t>(), a["content"].get<std::string>(), a.value("special", false) ? 3 : 4);
  }
  if (static_cast<int64_t>(tokens.size()) > c.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", tokens.size(), " tokens exceed vocab_size ", c.vocab_size));
  }
  for (int64_t i = 0; i < c.vocab_size; ++i) {  // llama.cpp's padding of a short vocabulary
    if (i >= static_cast<int64_t>(tokens.size()) || types[i] == 0) {
      put(i, absl::StrCat("[PAD", i, "]"), 5);  // 5: unused
    }
  }
  std::vector<std::string> merges;
  for (const json& m : model["merges"]) {
    merges.push_back(m.is_string()
                         ? m.get<std::string>()
                         : absl::StrCat(m[0].get<std::string>(), " ", m[1].get<std::string>()));
  }
  GgufArray tok_values, type_values, merge_values, score_values;
  for (size_t i = 0; i < tokens.size(); ++i) {
    tok_values.push_back(GgufWriter::String(tokens[i]));
    type_values.push_back(GgufWriter::I32(sentencepiece && tokens[i] == unk ? 2 : types[i]));
  }
  if (sentencepiece) {
    // Tokens no merge makes score below every merge.
    std::vector<float> scores(tokens.size(), -static_cast<float>(merges.size() + 1));
    std::map<std::string, size_t> id;
    for (size_t i = 0; i < tokens.size(); ++i) id.emplace(tokens[i], i);
    for (size_t rank = merges.size(); rank-- > 0;) {  // the first merge making a token counts
      std::string made = merges[rank];
      made.erase(made.find(' ', 1), 1);
      if (auto it = id.find(made); it != id.end()) scores[it->second] = -static_cast<float>(rank);
    }
    for (float v : scores) score_values.push_back(GgufWriter::F32(v));
  }
  for (const std::string& m : merges) merge_values.push_back(GgufWriter::String(m));
  w.Set("tokenizer.ggml.model", GgufWriter::String(sentencepiece ? "llama" : "gpt2"));
  w.Set("tokenizer.ggml.tokens", GgufWriter::Array(std::move(tok_values)));
  w.Set("tokenizer.ggml.token_type", GgufWriter::Array(std::move(type_values)));
  if (sentencepiece) {
    w.Set("tokenizer.ggml.scores", GgufWriter::Array(std::move(score_values)));
    if (!unk.empty()) {
      for (size_t i = 0; i < tokens.size(); ++i) {
        if (tokens[i] == unk) {
          w.Set("tokenizer.ggml.unknown_token_id", GgufWriter::U32(static_cast<uint32_t>(i)));
        }
      }
    }
  } else {
    w.Set("tokenizer.ggml.pre", GgufWriter::String("gpt-2"));
    w.Set("tokenizer.ggml.merges", GgufWriter::Array(std::move(merge_values)));
  }
  if (c.bos_token_id >= 0) {
    w.Set("tokenizer.ggml.bos_token_id", GgufWriter::U32(static_cast<uint32_t>(c.bos_token_id)));
  }
  if (!c.eos_token_ids.empty()) {
    w.Set("tokenizer.ggml.eos_token_id",
          GgufWriter::U32(static_cast<uint32_t>(c.eos_token_ids[0])));
  }
  const json& post = j.value("post_processor", json());
  w.Set("tokenizer.ggml.add_bos_token",
        GgufWriter::Bool(post.is_object() && post.value("type", "") == "TemplateProcessing"));
  const std::string config_path = (std::filesystem::path(dir) / "tokenizer_config.json").string();
  if (auto cfg = ReadFileToString(config_path); cfg.ok()) {
    const json tc = json::parse(*cfg, nullptr, false);
    if (tc.is_object() && tc.contains("chat_template") && tc["chat_template"].is_string()) {
      w.Set("tokenizer.chat_template", GgufWriter::String(tc["chat_template"].get<std::string>()));
    }
  }
  return absl::OkStatus();
}

// What llama.cpp's format can say of a model's RoPE scaling (YaRN with its own conventions:
// DeepSeek's mscale equal to mscale_all_dim, written as a log multiplier; gpt-oss untruncated,
// the rest truncated, with transformers' default factor on cos and sin); the rest is refused.
absl::Status RopeScalingFits(const std::string& hf_dir, const ModelConfig& c) {
  if (c.rope_scaling == RopeScaling::kLlama3) {
    return absl::UnimplementedError(absl::StrCat(
        hf_dir, ": llama3 RoPE scaling is not converted (GGUF keeps it as a rope_freqs tensor)"));
  }
  if (c.rope_scaling != RopeScaling::kYarn) return absl::OkStatus();
  if (c.mla) {
    if (c.rope_mscale != c.rope_mscale_all_dim) {
      return absl::UnimplementedError(
          absl::StrCat(hf_dir, ": YaRN mscale ", c.rope_mscale, " differs from mscale_all_dim ",
                       c.rope_mscale_all_dim, ", which deepseek2 GGUF files cannot say"));
    }
    return absl::OkStatus();
  }
  const double usual = c.rope_factor <= 1 ? 1.0 : 0.1 * std::log(c.rope_factor) + 1.0;
  if (c.rope_truncate == c.gpt_oss || std::fabs(c.rope_attention_factor - usual) > 1e-12) {
    return absl::UnimplementedError(
        absl::StrCat(hf_dir, ": YaRN with truncate ", c.rope_truncate ? "true" : "false",
                     " and attention factor ", c.rope_attention_factor,
                     " is not what llama.cpp's format says for ", c.architecture));
  }
  return absl::OkStatus();
}

// llama.cpp's architecture for a model: Mistral and Mixtral are written as llama (with experts).
std::string GgufArch(const ModelConfig& c) {
  if (c.mla) return "deepseek2";
  if (c.gpt_oss) return "gpt-oss";
  if (c.architecture == "Qwen3MoeForCausalLM") return "qwen3moe";
  if (c.model_type == "qwen2" || c.model_type == "qwen3") return c.model_type;
  return "llama";
}

// The metadata llama.cpp reads for the model's architecture.
void SetModelKeys(GgufWriter& w, const ModelConfig& c, const std::string& arch, bool legacy_mla) {
  const std::string p = arch + ".";
  auto u32 = [&](const std::string& key, int64_t v) {
    w.Set(p + key, GgufWriter::U32(static_cast<uint32_t>(v)));
  };
  auto f32 = [&](const std::string& key, double v) {
    w.Set(p + key, GgufWriter::F32(static_cast<float>(v)));
  };
  u32("context_length", c.max_position_embeddings);
  u32("embedding_length", c.hidden_size);
  // The multi-token-prediction layer after the others, as llama.cpp writes nextn layers.
  const int64_t layers = c.num_layers + c.mtp_layers;
  u32("block_count", layers);
  if (c.mtp_layers > 0) u32("nextn_predict_layers", c.mtp_layers);
  u32("feed_forward_length", c.mla ? c.dense_intermediate_size : c.intermediate_size);
  u32("attention.head_count", c.num_heads);
  f32("attention.layer_norm_rms_epsilon", c.rms_norm_eps);
  f32("rope.freq_base", c.rope_theta);
  u32("rope.dimension_count", c.head_dim);
  if (c.rope_scaling == RopeScaling::kLinear || c.rope_scaling == RopeScaling::kYarn) {
    const bool yarn = c.rope_scaling == RopeScaling::kYarn;
    w.Set(p + "rope.scaling.type", GgufWriter::String(yarn ? "yarn" : "linear"));
    f32("rope.scaling.factor", c.rope_factor);
    if (yarn) {
      u32("rope.scaling.original_context_length", c.rope_original_max_position);
      f32("rope.scaling.yarn_beta_fast", c.rope_beta_fast);
      f32("rope.scaling.yarn_beta_slow", c.rope_beta_slow);
      if (c.mla) f32("rope.scaling.yarn_log_multiplier", 0.1 * c.rope_mscale_all_dim);
    }
  }
  if (c.mla) {  // MLA as MQA over the latent, or (legacy) with the heads' own sizes
    const int64_t R = c.head_dim, Lr = c.kv_lora_rank;
    if (c.q_lora_rank > 0) u32("attention.q_lora_rank", c.q_lora_rank);
    u32("attention.kv_lora_rank", Lr);
    if (legacy_mla) {
      u32("attention.head_count_kv", c.num_heads);
      u32("attention.key_length", c.qk_nope_dim + R);
      u32("attention.value_length", c.v_head_dim);
    } else {
      u32("attention.head_count_kv", 1);
      u32("attention.key_length", Lr + R);
      u32("attention.value_length", Lr);
      u32("attention.key_length_mla", c.qk_nope_dim + R);
      u32("attention.value_length_mla", c.v_head_dim);
    }
    u32("leading_dense_block_count", c.first_dense_layers);
    u32("expert_shared_count", c.shared_experts);
    f32("expert_weights_scale", c.routed_scaling);
    if (c.norm_topk_prob) w.Set(p + "expert_weights_norm", GgufWriter::Bool(true));
    u32("expert_gating_func", 2);  // sigmoid
    u32("expert_group_count", c.n_group);
    u32("expert_group_used_count", c.topk_group);
  } else {
    u32("attention.head_count_kv", c.num_kv_heads);
    if (c.head_dim * c.num_heads != c.hidden_size) {
      u32("attention.key_length", c.head_dim);
      u32("attention.value_length", c.head_dim);
    }
  }
  if (c.gpt_oss) u32("attention.sliding_window", c.sliding_window);
  if (c.moe) {
    u32("expert_count", c.num_experts);
    u32("expert_used_count", c.experts_per_token);
  }
  if (arch == "qwen3moe" || c.mla || c.gpt_oss) {
    u32("expert_feed_forward_length", c.intermediate_size);
  }
}

// Whether the layer loop writes a table name: gpt-oss's norm before the experts is
// post_attention_norm (the rest's ffn_norm), its experts' biases GptOssExperts writes; MLA's
// kv_b_proj is one tensor only in legacy files.
bool NameOfArch(const ModelConfig& c, const std::string& g, bool legacy_mla) {
  if (absl::EndsWith(g, "_exps.bias")) return false;
  if (g == "ffn_norm.weight") return !c.gpt_oss;
  if (g == "post_attention_norm.weight") return c.gpt_oss;
  if (g == "attn_kv_b.weight") return legacy_mla;
  return true;
}

// An HF MXFP4 [E][rows][cols / 32][16] with its scales [E][rows][cols / 32], rows first, first +
// step, ... (n a expert), as ggml's blocks: the scale, then value k's code in the low nibble and
// value k + 16's in the high one of byte k.
std::string GgmlMxfp4(const TensorView& blocks, const TensorView& scales, int64_t first,
                      int64_t step, int64_t n) {
  const int64_t E = blocks.shape[0], rows = blocks.shape[1], groups = blocks.shape[2];
  const auto* b = static_cast<const uint8_t*>(blocks.data);
  const auto* s = static_cast<const uint8_t*>(scales.data);
  std::string out;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t j = 0; j < n; ++j) {
      const int64_t r = e * rows + first + j * step;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* codes = b + (r * groups + g) * 16;
        auto code = [&](int k) { return (k % 2 == 0 ? codes[k / 2] : codes[k / 2] >> 4) & 0xF; };
        out.push_back(static_cast<char>(s[r * groups + g]));
        for (int k = 0; k < 16; ++k) out.push_back(static_cast<char>(code(k) | code(k + 16) << 4));
      }
    }
  }
  return out;
}

// gpt-oss's fused experts as llama.cpp writes them: gate (HF's even columns of gate_up_proj) and
// up (its odd ones) apart, each expert [out][in], with their biases; MXFP4 experts repacked as
// ggml's MXFP4, the rest stored as `type`.
absl::Status GptOssExperts(GgufWriter& w, const WeightStore& weights, const ModelConfig& c,
                           const std::string& hf, const std::string& blk, DType type) {
  const int64_t E = c.num_experts, H = c.hidden_size, I = c.intermediate_size;
  const std::string m = hf + "mlp.experts.";
  ASSIGN_OR_RETURN(const TensorView gub, weights.Get(m + "gate_up_proj_bias", {E, 2 * I}));
  ASSIGN_OR_RETURN(const TensorView db, weights.Get(m + "down_proj_bias", {E, H}));
  const std::vector<float> gu = Floats(gub);
  std::vector<float> gate_bias(E * I), up_bias(E * I);
  for (int64_t i = 0; i < E * I; ++i) {
    gate_bias[i] = gu[2 * i];
    up_bias[i] = gu[2 * i + 1];
  }
  w.AddTensor(blk + "ffn_gate_exps.bias", GgmlType::kF32, {I, E},
              Encode(DType::kF32, gate_bias, E, I));
  w.AddTensor(blk + "ffn_up_exps.bias", GgmlType::kF32, {I, E}, Encode(DType::kF32, up_bias, E, I));
  w.AddTensor(blk + "ffn_down_exps.bias", GgmlType::kF32, {H, E},
              Encode(DType::kF32, Floats(db), E, H));
  if (c.mxfp4()) {
    const int64_t gh = H / 32, gi = I / 32;
    ASSIGN_OR_RETURN(const TensorView gb,
                     weights.Get(m + "gate_up_proj_blocks", {E, 2 * I, gh, 16}));
    ASSIGN_OR_RETURN(const TensorView gs, weights.Get(m + "gate_up_proj_scales", {E, 2 * I, gh}));
    ASSIGN_OR_RETURN(const TensorView dbk, weights.Get(m + "down_proj_blocks", {E, H, gi, 16}));
    ASSIGN_OR_RETURN(const TensorView ds, weights.Get(m + "down_proj_scales", {E, H, gi}));
    w.AddTensor(blk + "ffn_gate_exps.weight", GgmlType::kMXFP4, {H, I, E},
                GgmlMxfp4(gb, gs, 0, 2, I));
    w.AddTensor(blk + "ffn_up_exps.weight", GgmlType::kMXFP4, {H, I, E},
                GgmlMxfp4(gb, gs, 1, 2, I));
    w.AddTensor(blk + "ffn_down_exps.weight", GgmlType::kMXFP4, {I, H, E},
                GgmlMxfp4(dbk, ds, 0, 1, H));
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(const GgmlType ggml, GgmlOf(type));
  for (const auto& [name, cols] : {std::pair{"gate_up_proj", H}, {"down_proj", I}}) {
    if (cols % DTypeBlock(type) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", m, name, "' has rows of ", cols,
                                                     " values, not whole ", DTypeName(type),
                                                     " blocks of ", DTypeBlock(type)));
    }
  }
  ASSIGN_OR_RETURN(const TensorView gate_up, weights.Get(m + "gate_up_proj", {E, H, 2 * I}));
  ASSIGN_OR_RETURN(const TensorView down, weights.Get(m + "down_proj", {E, I, H}));
  const std::vector<float> g = Floats(gate_up), d = Floats(down);
  std::vector<float> gate(E * I * H), up(E * I * H), down_t(E * H * I);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < I; ++i) {
        gate[(e * I + i) * H + h] = g[(e * H + h) * 2 * I + 2 * i];
        up[(e * I + i) * H + h] = g[(e * H + h) * 2 * I + 2 * i + 1];
        down_t[(e * H + h) * I + i] = d[(e * I + i) * H + h];
      }
    }
  }
  w.AddTensor(blk + "ffn_gate_exps.weight", ggml, {H, I, E}, Encode(type, gate, E * I, H));
  w.AddTensor(blk + "ffn_up_exps.weight", ggml, {H, I, E}, Encode(type, up, E * I, H));
  w.AddTensor(blk + "ffn_down_exps.weight", ggml, {I, H, E}, Encode(type, down_t, E * H, I));
  return absl::OkStatus();
}

}  // namespace

absl::Status ConvertToGguf(const std::string& hf_dir, const std::string& out_file, DType type,
                           bool legacy_mla) {
  ASSIGN_OR_RETURN(const ModelConfig c, LoadModelConfig(hf_dir));
  ASSIGN_OR_RETURN(const std::unique_ptr<WeightStore> weights, WeightStore::Open(hf_dir));
  RETURN_IF_ERROR(RopeScalingFits(hf_dir, c));
  if (legacy_mla && !c.mla) {
    return absl::InvalidArgumentError("the legacy MLA layout is DeepSeek-V3's (deepseek2) only");
  }
  const bool qwen_moe = c.architecture == "Qwen3MoeForCausalLM";
  if (qwen_moe && !c.norm_topk_prob) {
    return absl::UnimplementedError(
        absl::StrCat(hf_dir,
                     ": norm_topk_prob false has no qwen3moe GGUF form (llama.cpp "
                     "renormalizes the chosen experts' weights)"));
  }
  if (c.gpt_oss) {  // llama.cpp fixes the clamp and the windows' layers
    bool alternating = true;
    for (int64_t l = 0; l < c.num_layers; ++l) alternating &= c.sliding_layers[l] == (l % 2 == 0);
    if (c.swiglu_limit != 7.0 || c.swiglu_alpha != 1.702 || !alternating) {
      return absl::UnimplementedError(absl::StrCat(
          hf_dir,
          ": gpt-oss GGUF files say no swiglu_limit or swiglu_alpha (llama.cpp takes 7.0 and "
          "1.702) and no layer_types (llama.cpp slides every other layer, the first)"));
    }
  }
  for (const auto& [name, t] : weights->tensors()) {
    if (t.dtype == DType::kF8E4M3) {
      return absl::UnimplementedError(absl::StrCat(
          hf_dir, ": tensor '", name, "' is F8_E4M3: FP8 checkpoints are not converted to GGUF"));
    }
  }
  ASSIGN_OR_RETURN(const GgmlType ggml, GgmlOf(type));
  const std::string arch = GgufArch(c);
  GgufWriter w;
  w.Set("general.architecture", GgufWriter::String(arch));
  w.Set("general.name", GgufWriter::String(std::filesystem::path(hf_dir).filename().string()));
  SetModelKeys(w, c, arch, legacy_mla);
  w.Set("general.file_type", GgufWriter::U32(static_cast<uint32_t>(ggml)));
  RETURN_IF_ERROR(SetTokenizer(w, hf_dir, c));
  auto Blocks = [&](const std::string& name, int64_t cols) -> absl::Status {
    if (cols % DTypeBlock(type) == 0) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has rows of ", cols,
                                                   " values, not whole ", DTypeName(type),
                                                   " blocks of ", DTypeBlock(type)));
  };

  // rows x cols F32 values as a matrix of `type` (GGUF dims cols, rows[, stack]).
  auto matrix = [&](const std::string& gguf, const std::vector<float>& v, int64_t rows,
                    int64_t cols, int64_t stack) -> absl::Status {
    RETURN_IF_ERROR(Blocks(gguf, cols));
    std::vector<int64_t> dims = {cols, rows};
    if (stack > 0) dims.push_back(stack);
    w.AddTensor(gguf, ggml, dims, Encode(type, v, rows * std::max<int64_t>(stack, 1), cols));
    return absl::OkStatus();
  };
  // A 2-D matrix as `type` (rotary rows interleaved when `rotary`), a vector as F32.
  auto add = [&](const std::string& gguf, const std::string& hf, bool rotary) -> absl::Status {
    ASSIGN_OR_RETURN(const TensorView t, weights->Get(hf));
    std::vector<float> v = Floats(t);
    const int64_t rows = t.shape[0], cols = t.shape.size() == 2 ? t.shape[1] : 1;
    if (rotary && arch == "llama") {
      std::vector<float> permuted(v.size());
      for (int64_t r = 0; r < rows; ++r) {
        std::copy_n(v.data() + GgufRotaryRow(r, c.head_dim) * cols, cols,
                    permuted.data() + r * cols);
      }
      v = std::move(permuted);
    }
    if (t.shape.size() == 1) {
      w.AddTensor(gguf, GgmlType::kF32, {rows}, Encode(DType::kF32, v, 1, rows));
      return absl::OkStatus();
    }
    return matrix(gguf, v, rows, cols, 0);
  };
  RETURN_IF_ERROR(add("token_embd.weight", "model.embed_tokens.weight", false));
  RETURN_IF_ERROR(add("output_norm.weight", "model.norm.weight", false));
  if (!c.tie_word_embeddings) RETURN_IF_ERROR(add("output.weight", "lm_head.weight", false));
  for (int64_t l = 0; l < c.num_layers + c.mtp_layers; ++l) {
    const std::string blk = absl::StrCat("blk.", l, "."),
                      hf = absl::StrCat("model.layers.", l, ".");
    for (const GgufName& n : kGgufLayerNames) {
      const std::string name = hf + GgufLayerHfName(c, n);
      const std::string g = n.gguf;
      if (!weights->Has(name) || !NameOfArch(c, g, legacy_mla)) continue;
      const bool rotary =
          g == "attn_q.weight" || g == "attn_k.weight" || g == "attn_q.bias" || g == "attn_k.bias";
      if (g == "ffn_gate_inp.weight") {  // the router stays F32
        ASSIGN_OR_RETURN(const TensorView t, weights->Get(name));
        const std::vector<float> v = Floats(t);
        w.AddTensor(blk + g, GgmlType::kF32, {c.hidden_size, c.num_experts},
                    Encode(DType::kF32, v, c.num_experts, c.hidden_size));
        continue;
      }
      RETURN_IF_ERROR(add(blk + g, name, rotary));
    }
    if (c.mla && !legacy_mla) {  // kv_b_proj's key rows transposed per head (k_b), value rows (v_b)
      ASSIGN_OR_RETURN(const TensorView t, weights->Get(hf + "self_attn.kv_b_proj.weight"));
      const std::vector<float> v = Floats(t);
      const int64_t H = c.num_heads, Lr = c.kv_lora_rank, nope = c.qk_nope_dim, vd = c.v_head_dim;
      std::vector<float> kb(H * Lr * nope), vb(H * vd * Lr);
      for (int64_t h = 0; h < H; ++h) {
        const float* head = v.data() + h * (nope + vd) * Lr;
        for (int64_t j = 0; j < nope; ++j) {
          for (int64_t r = 0; r < Lr; ++r) kb[(h * Lr + r) * nope + j] = head[j * Lr + r];
        }
        std::copy_n(head + nope * Lr, vd * Lr, vb.data() + h * vd * Lr);
      }
      RETURN_IF_ERROR(matrix(blk + "attn_k_b.weight", kb, Lr, nope, H));
      RETURN_IF_ERROR(matrix(blk + "attn_v_b.weight", vb, vd, Lr, H));
    }
    if (c.gpt_oss) {
      RETURN_IF_ERROR(GptOssExperts(w, *weights, c, hf, blk, type));
      continue;
    }
    for (const GgufName& n : kGgufExpertNames) {
      if (!c.moe || !c.moe_layer(l)) break;
      std::string bytes;
      int64_t rows = 0, cols = 0;
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const std::string name = hf + GgufExpertHfName(c, e, n);
        ASSIGN_OR_RETURN(const TensorView t, weights->Get(name));
        const std::vector<float> v = Floats(t);
        rows = t.shape[0];
        cols = t.shape[1];
        RETURN_IF_ERROR(Blocks(name, cols));
        bytes += Encode(type, v, rows, cols);
      }
      w.AddTensor(blk + n.gguf, ggml, {cols, rows, c.num_experts}, std::move(bytes));
    }
  }
  return w.Write(out_file);
}

}  // namespace shardserve

namespace shardserve {

absl::StatusOr<std::string> SplitGguf(const std::string& in_file, const std::string& out_prefix,
                                      int parts) {
  ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> in, GgufFile::Open(in_file));
  const int64_t n = static_cast<int64_t>(in->tensors().size());
  if (parts < 1 || parts > n) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot split ", n, " tensors into ", parts, " parts"));
  }
  auto it = in->tensors().begin();
  std::string first;
  for (int p = 0; p < parts; ++p) {
    GgufWriter w;
    if (p == 0) {
      for (const auto& [key, value] : in->metadata()) {
        if (!absl::StartsWith(key, "split.")) w.Set(key, value);
      }
      w.Set("split.tensors.count", GgufWriter::I32(static_cast<int32_t>(n)));
    }
    w.Set("split.no", GgufWriter::U16(static_cast<uint16_t>(p)));
    w.Set("split.count", GgufWriter::U16(static_cast<uint16_t>(parts)));
    for (int64_t i = n * p / parts; i < n * (p + 1) / parts; ++i, ++it) {
      const GgufTensor& t = it->second;
      w.AddTensor(t.name, t.type, t.dims,
                  std::string(reinterpret_cast<const char*>(t.data), t.bytes));
    }
    const std::string path = absl::StrFormat("%s-%05d-of-%05d.gguf", out_prefix, p + 1, parts);
    RETURN_IF_ERROR(w.Write(path));
    if (p == 0) first = path;
  }
  return first;
}

}  // namespace shardserve
