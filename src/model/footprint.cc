#include "model/footprint.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "common/text.h"
#include "model/config.h"
#include "model/fp8.h"

namespace shardserve {
namespace {

// The sizes of one architecture's layers, read from its config.
struct Dims {
  std::string architecture;
  int64_t hidden = 0, layers = 0, vocab = 0, heads = 0, kv_heads = 0, head_dim = 0;
  bool qkv_bias = false, o_bias = false, qk_norm = false, sinks = false;
  int64_t intermediate = 0;  // a dense layer's MLP
  int64_t experts = 0, expert_intermediate = 0, experts_per_token = 0;
  int64_t shared_experts = 0;  // each of expert_intermediate
  bool expert_bias = false;    // gpt-oss: biases on the experts' projections
  bool router_bias = false;    // gpt-oss's router bias, DeepSeek's score correction
  int64_t first_dense = 0;     // layers [0, first_dense) are dense in a MoE model
  // Multi-head latent attention (DeepSeek-V3): 0 kv_lora for ordinary attention.
  int64_t q_lora = 0, kv_lora = 0, rope_dim = 0, nope_dim = 0, v_dim = 0;
  int64_t mtp_layers = 0;  // multi-token-prediction layers after the model's (DeepSeek-V3)
  std::vector<std::string> notes;
};

// How the checkpoint stores its weights, as kept on a GPU.
struct Format {
  enum class Kind { kPlain, kFp8Block, kFp8Row, kMxfp4 };
  Kind kind = Kind::kPlain;
  double dtype_bytes = 2;
  std::string dtype = "BF16";
  int64_t block_rows = 128, block_cols = 128;
  std::vector<std::string> keep;  // modules_to_not_convert

  // HF's rule: a pattern with '*' matches whole dotted segments from the start ("*" any one);
  // one without matches any module whose name contains it.
  bool Kept(const std::string& module) const {
    for (const std::string& p : keep) {
      if (p.find('*') == std::string::npos) {
        if (module.find(p) != std::string::npos) return true;
        continue;
      }
      const std::vector<std::string> ps = absl::StrSplit(p, '.');
      const std::vector<std::string> ms = absl::StrSplit(module, '.');
      if (ps.size() > ms.size()) continue;
      bool match = true;
      for (size_t i = 0; i < ps.size() && match; ++i) match = ps[i] == "*" || ps[i] == ms[i];
      if (match) return true;
    }
    return false;
  }
  double Plain(double params) const { return params * dtype_bytes; }
  // A linear layer's weight of rows x cols (out x in).
  double Linear(const std::string& module, double rows, double cols) const {
    if (Kept(module)) return Plain(rows * cols);
    switch (kind) {
      case Kind::kPlain:
        return Plain(rows * cols);
      case Kind::kFp8Block:  // repacked into blocks of 128 with an F32 scale, or expanded into
                             // the model's dtype where its blocks do not allow that (model/fp8.h)
        if (Fp8Packs(Fp8Blocks{block_rows, block_cols}, 0, static_cast<int64_t>(cols))) {
          return rows * cols * DTypeBlockBytes(DType::kF8_128) / kFp8Group;
        }
        return Plain(rows * cols);
      case Kind::kFp8Row:  // one F32 scale per output row
        return rows * cols + rows * 4;
      case Kind::kMxfp4:  // experts expanded into the model's dtype at load (model/mxfp4.h)
        return Plain(rows * cols);
    }
    return Plain(rows * cols);
  }
  // A weight whose rows a rank picks per head (MLA's q and kv_b projections): the per-head
  // products take F32, F16 or BF16, so an FP8 one is expanded (model/transformer.cc, Picked).
  double PerHead(const std::string& module, double rows, double cols) const {
    return kind == Kind::kFp8Block ? Plain(rows * cols) : Linear(module, rows, cols);
  }
  std::string Describe() const {
    std::string kept =
        keep.empty() ? "" : absl::StrCat("; ", dtype, " where modules_to_not_convert says");
    switch (kind) {
      case Kind::kPlain:
        return dtype;
      case Kind::kFp8Block:
        return absl::StrCat(
            "FP8 E4M3 linear weights (",
            Fp8Blocks{block_rows, block_cols}.per_tensor()
                ? std::string("a scale per tensor")
                : absl::StrCat("a scale per ", block_rows, "x", block_cols, " block"),
            "), ",
            Fp8Packs(Fp8Blocks{block_rows, block_cols}, 0, kFp8Group)
                ? absl::StrCat("computed in FP8 (an F32 scale per 128 values; ", dtype,
                               " where a slice's columns are not groups of 128)")
                : absl::StrCat("held as ", dtype,
                               ": expanded at load (FP8 computes with "
                               "blocks 128 or more columns wide)"));
      case Kind::kFp8Row:
        return absl::StrCat("FP8 E4M3 linear weights with an F32 scale per row, ", dtype,
                            " embeddings, norms and routers", kept, " (does not load yet)");
      case Kind::kMxfp4:
        return absl::StrCat("MXFP4 experts (4.25 bits a weight in the files), held as ", dtype,
                            ": expanded at load, no backend computes in FP4 yet");
    }
    return dtype;
  }
};

// How ModelConfig says the checkpoint stores its weights.
Format FormatOf(const ModelConfig& c) {
  Format f;
  f.dtype = DTypeName(c.dtype);
  f.dtype_bytes = static_cast<double>(DTypeSize(c.dtype));
  f.keep = c.keep_modules;
  switch (c.weights) {
    case WeightFormat::kPlain:
      f.kind = Format::Kind::kPlain;
      break;
    case WeightFormat::kFp8:
      f.kind = Format::Kind::kFp8Block;
      f.block_rows = c.fp8_blocks.rows;
      f.block_cols = c.fp8_blocks.cols;
      break;
    case WeightFormat::kFp8PerRow:
      f.kind = Format::Kind::kFp8Row;
      break;
    case WeightFormat::kMxfp4:
      f.kind = Format::Kind::kMxfp4;
      break;
  }
  return f;
}

// The sizes of the layers as ModelConfig read them (for MoE models its intermediate_size is an
// expert's; DeepSeek-V3's dense layers have dense_intermediate_size, its head_dim is the rotated
// dims).
Dims DimsOf(const ModelConfig& c) {
  Dims d;
  d.architecture = c.architecture;
  d.hidden = c.hidden_size;
  d.layers = c.num_layers;
  d.vocab = c.vocab_size;
  d.heads = c.num_heads;
  d.kv_heads = c.num_kv_heads;
  d.head_dim = c.head_dim;
  d.qkv_bias = c.qkv_bias;
  d.o_bias = c.o_bias;
  d.qk_norm = c.qk_norm;
  d.sinks = d.expert_bias = c.gpt_oss;
  d.router_bias = c.gpt_oss || c.sigmoid_routing;  // gpt-oss's bias, DeepSeek's correction
  if (c.moe) {
    d.experts = c.num_experts;
    d.experts_per_token = c.experts_per_token;
    d.expert_intermediate = c.intermediate_size;
    d.shared_experts = c.shared_experts;
    d.first_dense = c.first_dense_layers;
    d.intermediate = c.dense_intermediate_size;
  } else {
    d.intermediate = c.intermediate_size;
  }
  if (c.mla) {
    d.q_lora = c.q_lora_rank;
    d.kv_lora = c.kv_lora_rank;
    d.rope_dim = c.head_dim;
    d.nope_dim = c.qk_nope_dim;
    d.v_dim = c.v_head_dim;
  }
  if (c.mtp_layers > 0) {
    d.mtp_layers = c.mtp_layers;
    d.notes.push_back(absl::StrCat("its ", c.mtp_layers,
                                   " multi-token-prediction layer(s) are counted only under "
                                   "speculative method mtp, which loads one on the last stage "
                                   "(its weights and KV cache)"));
  }
  if (std::find(c.sliding_layers.begin(), c.sliding_layers.end(), true) != c.sliding_layers.end()) {
    d.notes.push_back(
        "its sliding-window layers are counted with a cache as long as the full layers' "
        "(the KV cache is one size for every layer)");
  }
  return d;
}

// What each layer holds (then merged into runs of equal layers), the embeddings and the head.
ModelFootprint Compute(const Dims& d, const Format& f) {
  ModelFootprint out;
  out.architecture = d.architecture;
  out.weights = f.Describe();
  out.layers = d.layers;
  out.heads = d.heads;
  out.kv_heads = d.kv_lora > 0 ? 0 : d.kv_heads;
  out.experts = d.experts;
  out.intermediate = d.intermediate;
  out.notes = d.notes;
  const double H = static_cast<double>(d.hidden), V = static_cast<double>(d.vocab);
  out.embed_bytes = f.Plain(V * H);
  out.head_bytes = f.Linear("lm_head", V, H) + f.Plain(H);
  out.params = 2 * V * H + H;
  // Layer i's footprint, its parameters added to `params`.
  auto layer = [&](int64_t i, double& params) {
    const std::string at = absl::StrCat("model.layers.", i, ".");
    LayerFootprint l;
    params += 2 * H;  // the two norms
    l.whole_bytes += f.Plain(2 * H);
    auto linear = [&](const std::string& module, double rows, double cols, double& into,
                      double copies = 1) {
      into += copies * f.Linear(at + module, rows, cols);
      params += copies * rows * cols;
    };
    auto per_head = [&](const std::string& module, double rows, double cols, double& into) {
      into += f.PerHead(at + module, rows, cols);
      params += rows * cols;
    };
    auto plain = [&](double n, double& into) {
      into += f.Plain(n);
      params += n;
    };
    const double hd = static_cast<double>(d.head_dim), nh = static_cast<double>(d.heads);
    if (d.kv_lora > 0) {  // MLA
      const double qk = static_cast<double>(d.nope_dim + d.rope_dim);
      if (d.q_lora > 0) {
        linear("self_attn.q_a_proj", static_cast<double>(d.q_lora), H, l.whole_bytes);
        plain(static_cast<double>(d.q_lora), l.whole_bytes);
        per_head("self_attn.q_b_proj", nh * qk, static_cast<double>(d.q_lora), l.split_bytes);
      } else {
        per_head("self_attn.q_proj", nh * qk, H, l.split_bytes);
      }
      linear("self_attn.kv_a_proj_with_mqa", static_cast<double>(d.kv_lora + d.rope_dim), H,
             l.whole_bytes);
      plain(static_cast<double>(d.kv_lora), l.whole_bytes);
      per_head("self_attn.kv_b_proj", nh * static_cast<double>(d.nope_dim + d.v_dim),
               static_cast<double>(d.kv_lora), l.split_bytes);
      linear("self_attn.o_proj", H, nh * static_cast<double>(d.v_dim), l.split_bytes);
      l.whole_values = d.kv_lora + d.rope_dim;
      out.full_kv_values = d.heads * (d.nope_dim + d.rope_dim + d.v_dim);
    } else {
      linear("self_attn.q_proj", nh * hd, H, l.split_bytes);
      linear("self_attn.o_proj", H, nh * hd, l.split_bytes);
      const double kv = static_cast<double>(d.kv_heads);
      // One KV head's share of k_proj and v_proj (each kv_heads * head_dim rows).
      l.kv_head_bytes = (f.Linear(at + "self_attn.k_proj", kv * hd, H) +
                         f.Linear(at + "self_attn.v_proj", kv * hd, H)) /
                        kv;
      params += 2 * kv * hd * H;
      if (d.qkv_bias) {
        plain(nh * hd, l.split_bytes);
        l.kv_head_bytes += f.Plain(2 * hd);
        params += 2 * kv * hd;
      }
      if (d.o_bias) plain(H, l.whole_bytes);
      if (d.qk_norm) plain(2 * hd, l.whole_bytes);
      if (d.sinks) plain(nh, l.split_bytes);
      l.kv_heads = d.kv_heads;
      l.head_values = 2 * d.head_dim;
      out.full_kv_values = d.kv_heads * 2 * d.head_dim;
    }
    if (d.experts > 0 && i >= d.first_dense) {
      const double E = static_cast<double>(d.experts);
      const double I = static_cast<double>(d.expert_intermediate);
      plain(E * H, l.whole_bytes);  // the router
      if (d.router_bias) plain(E, l.whole_bytes);
      // gate and up, then down, per expert; experts are divided across the group.
      linear("mlp.experts", 2 * I, H, l.split_bytes, E);
      linear("mlp.experts", H, I, l.split_bytes, E);
      if (d.expert_bias) plain(E * (2 * I + H), l.split_bytes);
      if (d.shared_experts > 0) {
        const double S = static_cast<double>(d.shared_experts) * I;
        linear("mlp.shared_experts.gate_proj", S, H, l.split_bytes);
        linear("mlp.shared_experts.up_proj", S, H, l.split_bytes);
        linear("mlp.shared_experts.down_proj", H, S, l.split_bytes);
      }
    } else {
      const double I = static_cast<double>(d.intermediate);
      linear("mlp.gate_proj", I, H, l.split_bytes);
      linear("mlp.up_proj", I, H, l.split_bytes);
      linear("mlp.down_proj", H, I, l.split_bytes);
    }
    return l;
  };
  for (int64_t i = 0; i < d.layers; ++i) {
    const LayerFootprint l = layer(i, out.params);
    if (!out.kinds.empty()) {
      LayerFootprint last = out.kinds.back();
      last.count = 1;
      if (last == l) {
        ++out.kinds.back().count;
        continue;
      }
    }
    out.kinds.push_back(l);
  }
  if (d.mtp_layers > 0) {  // not in params: the model's own count leaves it out
    // The decoder layer after the model's; eh_proj (H x 2H) and its three norms, each rank all
    // of them; its embedding and head, vocabulary rows (Transformer::BindMtp).
    double params = 0;
    out.mtp = layer(d.layers, params);
    const std::string at = absl::StrCat("model.layers.", d.layers, ".");
    out.mtp.whole_bytes += f.Linear(at + "eh_proj", H, 2 * H) + f.Plain(3 * H);
    out.mtp.split_bytes += f.Plain(V * H) + f.Linear(at + "shared_head.head", V, H);
  }
  const bool moe = d.experts > 0;
  out.shape = {d.layers,
               d.hidden,
               moe ? d.expert_intermediate : d.intermediate,
               d.heads * (d.kv_lora > 0 ? d.nope_dim + d.rope_dim : d.head_dim),
               d.kv_lora > 0 ? d.kv_lora + d.rope_dim : d.kv_heads * d.head_dim,
               d.vocab,
               moe ? d.experts_per_token + d.shared_experts : 0};
  return out;
}

}  // namespace

// The KV cache's dtype under kvCacheDtype auto.
std::string KvAutoName(const ModelConfig& c) {
  return c.kv_auto_dtype == DType::kF32 ? "f32" : c.kv_auto_dtype == DType::kF16 ? "f16" : "bf16";
}

ModelFootprint FootprintOf(const ModelConfig& config) {
  ModelFootprint out = Compute(DimsOf(config), FormatOf(config));
  out.kv_dtype = KvAutoName(config);
  return out;
}

absl::StatusOr<ModelFootprint> FootprintFromConfig(const std::string& json_text,
                                                   const std::string& source) {
  ASSIGN_OR_RETURN(const ModelConfig c, DescribeModelConfig(json_text, source));
  return FootprintOf(c);
}

absl::StatusOr<ModelFootprint> LoadFootprint(const std::string& model_path) {
  std::error_code ec;
  if (std::filesystem::is_directory(model_path, ec)) {
    const std::string path = (std::filesystem::path(model_path) / "config.json").string();
    ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
    return FootprintFromConfig(text, path);
  }
  // A GGUF file: its shape from the metadata, its bytes from the file.
  ASSIGN_OR_RETURN(ModelConfig c, LoadModelConfig(model_path));
  const Dims d = DimsOf(c);
  Format f;
  f.dtype_bytes = 1;
  const ModelFootprint unit = Compute(d, f);  // in parameters
  const double bytes = static_cast<double>(std::filesystem::file_size(model_path, ec));
  if (ec || unit.params <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(model_path, ": cannot read its size"));
  }
  f.dtype_bytes = bytes / unit.params;
  f.dtype = absl::StrCat("GGUF, ", absl::StrFormat("%.2f", f.dtype_bytes * 8),
                         " bits a weight on average (the file's size over its parameters)");
  ModelFootprint out = Compute(d, f);
  out.kv_dtype = KvAutoName(c);
  return out;
}

}  // namespace shardserve
