#include "devtools/gguf_convert.h"

#include <algorithm>
#include <cfloat>
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
#include "devtools/gguf_writer.h"
#include "model/config.h"
#include "model/gguf_model.h"
#include "model/safetensors.h"
#include "nlohmann/json.hpp"

namespace shardserve {
namespace {

using json = nlohmann::json;

void PutHalf(std::string& out, float v) {
  const uint16_t h = F32ToF16(v);
  out.append(reinterpret_cast<const char*>(&h), 2);
}

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
      break;  // the CPU backend's own layout, no file's
    case DType::kF8E4M3:
    case DType::kU8:
      break;  // scaled by blocks, no GGUF type
  }
  return absl::InvalidArgumentError(absl::StrCat("no GGUF type for ", DTypeName(t)));
}

// rows x cols F32 values stored as `type`.
std::string Encode(DType type, const std::vector<float>& v, int64_t rows, int64_t cols) {
  std::string out;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = v.data() + r * cols;
    if (IsQuantized(type)) {
      out += QuantizeRow(type, row, cols);
      continue;
    }
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

// One Q4_K / Q5_K super-block (bits 4 or 5): per sub-block of 32 an offset (its minimum, if
// negative) and a scale, both quantized to 6 bits against the super-block's d and dmin.
std::string QuantizeK45(const float* x, int bits) {
  const int top = (1 << bits) - 1;
  float scale[8], offset[8];
  for (int j = 0; j < 8; ++j) {
    float lo = 0, hi = 0;
    for (int l = 0; l < 32; ++l) {
      lo = std::min(lo, x[32 * j + l]);
      hi = std::max(hi, x[32 * j + l]);
    }
    scale[j] = (hi - lo) / top;
    offset[j] = -lo;
  }
  const float max_scale = *std::max_element(scale, scale + 8);
  const float max_offset = *std::max_element(offset, offset + 8);
  const float d = max_scale / 63, dmin = max_offset / 63;
  // The F16 values the reader sees.
  const float dr = F16ToF32(F32ToF16(d)), dminr = F16ToF32(F32ToF16(dmin));
  int sc[8], mn[8];
  for (int j = 0; j < 8; ++j) {
    sc[j] = dr > 0 ? std::min(63, static_cast<int>(std::lround(scale[j] / dr))) : 0;
    mn[j] = dminr > 0 ? std::min(63, static_cast<int>(std::lround(offset[j] / dminr))) : 0;
  }
  uint8_t packed[12];
  for (int j = 0; j < 4; ++j) {
    packed[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
    packed[j + 4] = static_cast<uint8_t>(mn[j] | ((mn[j + 4] >> 4) << 6));
    packed[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4));
  }
  int q[256];
  for (int i = 0; i < 256; ++i) {
    const int j = i / 32;
    const float step = dr * sc[j], off = dminr * mn[j];
    q[i] = step > 0 ? std::clamp(static_cast<int>(std::lround((x[i] + off) / step)), 0, top) : 0;
  }
  std::string out;
  PutHalf(out, d);
  PutHalf(out, dmin);
  out.append(reinterpret_cast<const char*>(packed), 12);
  if (bits == 5) {  // bit 2c of byte l: value 64c + l's fifth bit; bit 2c + 1: value 64c + 32 + l's
    uint8_t qh[32] = {};
    for (int c = 0; c < 4; ++c) {
      for (int l = 0; l < 32; ++l) {
        qh[l] |= static_cast<uint8_t>(((q[64 * c + l] >> 4) & 1) << (2 * c));
        qh[l] |= static_cast<uint8_t>(((q[64 * c + 32 + l] >> 4) & 1) << (2 * c + 1));
      }
    }
    out.append(reinterpret_cast<const char*>(qh), 32);
  }
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      out.push_back(static_cast<char>((q[64 * c + l] & 0xF) | ((q[64 * c + 32 + l] & 0xF) << 4)));
    }
  }
  return out;
}

// One Q6_K super-block: 16 sub-blocks of 16 with int8 scales against d; values in [-32, 31].
std::string QuantizeQ6K(const float* x) {
  float scale[16];
  for (int j = 0; j < 16; ++j) {
    float amax = 0;
    for (int l = 0; l < 16; ++l) amax = std::max(amax, std::fabs(x[16 * j + l]));
    scale[j] = amax / 31;
  }
  const float d = *std::max_element(scale, scale + 16) / 127;
  const float dr = F16ToF32(F32ToF16(d));
  int8_t sc[16];
  for (int j = 0; j < 16; ++j) {
    sc[j] = static_cast<int8_t>(dr > 0 ? std::min(127L, std::lround(scale[j] / dr)) : 0);
  }
  int q[256];
  for (int i = 0; i < 256; ++i) {
    const float step = dr * sc[i / 16];
    q[i] = (step > 0 ? std::clamp(static_cast<int>(std::lround(x[i] / step)), -32, 31) : 0) + 32;
  }
  uint8_t ql[128], qh[64];
  for (int half = 0; half < 2; ++half) {
    const int* v = q + 128 * half;
    for (int l = 0; l < 32; ++l) {
      ql[64 * half + l] = static_cast<uint8_t>((v[l] & 0xF) | ((v[l + 64] & 0xF) << 4));
      ql[64 * half + 32 + l] = static_cast<uint8_t>((v[l + 32] & 0xF) | ((v[l + 96] & 0xF) << 4));
      qh[32 * half + l] = static_cast<uint8_t>((v[l] >> 4) | ((v[l + 32] >> 4) << 2) |
                                               ((v[l + 64] >> 4) << 4) | ((v[l + 96] >> 4) << 6));
    }
  }
  std::string out(reinterpret_cast<const char*>(ql), 128);
  out.append(reinterpret_cast<const char*>(qh), 64);
  out.append(reinterpret_cast<const char*>(sc), 16);
  PutHalf(out, d);
  return out;
}

}  // namespace

std::string QuantizeRow(DType type, const float* x, int64_t n) {
  std::string out;
  if (DTypeBlock(type) == 256) {
    for (int64_t b = 0; b < n; b += 256) {
      out += type == DType::kQ6_K ? QuantizeQ6K(x + b)
                                  : QuantizeK45(x + b, type == DType::kQ5_K ? 5 : 4);
    }
    return out;
  }
  for (int64_t b = 0; b < n; b += 32) {
    const float* v = x + b;
    if (type == DType::kQ8_0) {
      float amax = 0;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float d = amax / 127, id = d != 0 ? 1 / d : 0;
      PutHalf(out, d);
      for (int j = 0; j < 32; ++j) out.push_back(static_cast<char>(std::lround(v[j] * id)));
    } else if (type == DType::kQ4_0) {
      float amax = 0, max = 0;
      for (int j = 0; j < 32; ++j) {
        if (amax < std::fabs(v[j])) {
          amax = std::fabs(v[j]);
          max = v[j];
        }
      }
      const float d = max / -8, id = d != 0 ? 1 / d : 0;
      PutHalf(out, d);
      for (int j = 0; j < 16; ++j) {
        const int lo = std::min(15, static_cast<int>(static_cast<int8_t>(v[j] * id + 8.5f)));
        const int hi = std::min(15, static_cast<int>(static_cast<int8_t>(v[j + 16] * id + 8.5f)));
        out.push_back(static_cast<char>(lo | (hi << 4)));
      }
    } else {  // Q4_1
      float lo_v = FLT_MAX, hi_v = -FLT_MAX;
      for (int j = 0; j < 32; ++j) {
        lo_v = std::min(lo_v, v[j]);
        hi_v = std::max(hi_v, v[j]);
      }
      const float d = (hi_v - lo_v) / 15, id = d != 0 ? 1 / d : 0;
      PutHalf(out, d);
      PutHalf(out, lo_v);
      for (int j = 0; j < 16; ++j) {
        const int lo =
            std::min(15, static_cast<int>(static_cast<int8_t>((v[j] - lo_v) * id + 0.5f)));
        const int hi =
            std::min(15, static_cast<int>(static_cast<int8_t>((v[j + 16] - lo_v) * id + 0.5f)));
        out.push_back(static_cast<char>(lo | (hi << 4)));
      }
    }
  }
  return out;
}

absl::Status ConvertToGguf(const std::string& hf_dir, const std::string& out_file, DType type) {
  ASSIGN_OR_RETURN(const ModelConfig c, LoadModelConfig(hf_dir));
  ASSIGN_OR_RETURN(const std::unique_ptr<WeightStore> weights, WeightStore::Open(hf_dir));
  if (c.rope_scaling == RopeScaling::kLlama3) {
    return absl::UnimplementedError(absl::StrCat(
        hf_dir, ": llama3 RoPE scaling is not converted (GGUF keeps it as a rope_freqs tensor)"));
  }
  if (c.mla || c.gpt_oss) {
    return absl::UnimplementedError(absl::StrCat(hf_dir, ": ", c.architecture,
                                                 " is not converted to GGUF (",
                                                 c.mla ? "deepseek2" : "gpt-oss", ") yet"));
  }
  const bool qwen_moe = c.architecture == "Qwen3MoeForCausalLM";
  if (qwen_moe && !c.norm_topk_prob) {
    return absl::UnimplementedError(
        absl::StrCat(hf_dir,
                     ": norm_topk_prob false has no qwen3moe GGUF form (llama.cpp "
                     "renormalizes the chosen experts' weights)"));
  }
  if (c.rope_scaling == RopeScaling::kYarn) {
    return absl::UnimplementedError(absl::StrCat(hf_dir, ": yarn RoPE scaling is not converted"));
  }
  for (const auto& [name, t] : weights->tensors()) {
    if (IsStorageOnly(t.dtype)) {
      return absl::UnimplementedError(
          absl::StrCat(hf_dir, ": tensor '", name, "' is ", DTypeName(t.dtype),
                       ": FP8 and MXFP4 checkpoints are not converted to GGUF"));
    }
  }
  ASSIGN_OR_RETURN(const GgmlType ggml, GgmlOf(type));
  // llama.cpp's architectures: Mistral and Mixtral are written as llama (with experts).
  const std::string arch = qwen_moe                                             ? "qwen3moe"
                           : c.model_type == "qwen2" || c.model_type == "qwen3" ? c.model_type
                                                                                : "llama";
  const std::string p = arch + ".";
  GgufWriter w;
  w.Set("general.architecture", GgufWriter::String(arch));
  w.Set("general.name", GgufWriter::String(std::filesystem::path(hf_dir).filename().string()));
  w.Set(p + "context_length", GgufWriter::U32(static_cast<uint32_t>(c.max_position_embeddings)));
  w.Set(p + "embedding_length", GgufWriter::U32(static_cast<uint32_t>(c.hidden_size)));
  w.Set(p + "block_count", GgufWriter::U32(static_cast<uint32_t>(c.num_layers)));
  w.Set(p + "feed_forward_length", GgufWriter::U32(static_cast<uint32_t>(c.intermediate_size)));
  w.Set(p + "attention.head_count", GgufWriter::U32(static_cast<uint32_t>(c.num_heads)));
  w.Set(p + "attention.head_count_kv", GgufWriter::U32(static_cast<uint32_t>(c.num_kv_heads)));
  w.Set(p + "attention.layer_norm_rms_epsilon",
        GgufWriter::F32(static_cast<float>(c.rms_norm_eps)));
  w.Set(p + "rope.freq_base", GgufWriter::F32(static_cast<float>(c.rope_theta)));
  w.Set(p + "rope.dimension_count", GgufWriter::U32(static_cast<uint32_t>(c.head_dim)));
  if (c.head_dim * c.num_heads != c.hidden_size) {
    w.Set(p + "attention.key_length", GgufWriter::U32(static_cast<uint32_t>(c.head_dim)));
    w.Set(p + "attention.value_length", GgufWriter::U32(static_cast<uint32_t>(c.head_dim)));
  }
  if (c.rope_scaling == RopeScaling::kLinear) {
    w.Set(p + "rope.scaling.type", GgufWriter::String("linear"));
    w.Set(p + "rope.scaling.factor", GgufWriter::F32(static_cast<float>(c.rope_factor)));
  }
  if (c.moe) {
    w.Set(p + "expert_count", GgufWriter::U32(static_cast<uint32_t>(c.num_experts)));
    w.Set(p + "expert_used_count", GgufWriter::U32(static_cast<uint32_t>(c.experts_per_token)));
  }
  if (qwen_moe) {
    w.Set(p + "expert_feed_forward_length",
          GgufWriter::U32(static_cast<uint32_t>(c.intermediate_size)));
  }
  w.Set("general.file_type", GgufWriter::U32(static_cast<uint32_t>(ggml)));
  RETURN_IF_ERROR(SetTokenizer(w, hf_dir, c));
  auto Blocks = [&](const std::string& name, int64_t cols) -> absl::Status {
    if (cols % DTypeBlock(type) == 0) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' has rows of ", cols,
                                                   " values, not whole ", DTypeName(type),
                                                   " blocks of ", DTypeBlock(type)));
  };

  // A tensor's values as F32 (rows x cols; 1 x n for a vector).
  auto values = [](const TensorView& t) {
    std::vector<float> v(t.numel());
    cpu::ToFloat(t.dtype, t.data, t.numel(), v.data());
    return v;
  };
  // A 2-D matrix as `type` (rotary rows interleaved when `rotary`), a vector as F32.
  auto add = [&](const std::string& gguf, const std::string& hf, bool rotary) -> absl::Status {
    ASSIGN_OR_RETURN(const TensorView t, weights->Get(hf));
    std::vector<float> v = values(t);
    const int64_t rows = t.shape[0], cols = t.shape.size() == 2 ? t.shape[1] : 1;
    RETURN_IF_ERROR(Blocks(hf, t.shape.size() == 2 ? cols : DTypeBlock(type)));
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
    } else {
      w.AddTensor(gguf, ggml, {cols, rows}, Encode(type, v, rows, cols));
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(add("token_embd.weight", "model.embed_tokens.weight", false));
  RETURN_IF_ERROR(add("output_norm.weight", "model.norm.weight", false));
  if (!c.tie_word_embeddings) RETURN_IF_ERROR(add("output.weight", "lm_head.weight", false));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string blk = absl::StrCat("blk.", l, "."),
                      hf = absl::StrCat("model.layers.", l, ".");
    for (const GgufName& n : kGgufLayerNames) {
      const std::string name = hf + GgufLayerHfName(c, n);
      if (!weights->Has(name)) continue;
      const std::string g = n.gguf;
      const bool rotary =
          g == "attn_q.weight" || g == "attn_k.weight" || g == "attn_q.bias" || g == "attn_k.bias";
      if (g == "ffn_gate_inp.weight") {  // the router stays F32
        ASSIGN_OR_RETURN(const TensorView t, weights->Get(name));
        const std::vector<float> v = values(t);
        w.AddTensor(blk + g, GgmlType::kF32, {c.hidden_size, c.num_experts},
                    Encode(DType::kF32, v, c.num_experts, c.hidden_size));
        continue;
      }
      RETURN_IF_ERROR(add(blk + g, name, rotary));
    }
    for (const GgufName& n : kGgufExpertNames) {
      if (!c.moe) break;
      std::string bytes;
      int64_t rows = 0, cols = 0;
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const std::string name = hf + GgufExpertHfName(c, e, n);
        ASSIGN_OR_RETURN(const TensorView t, weights->Get(name));
        const std::vector<float> v = values(t);
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
