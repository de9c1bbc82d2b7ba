#include "model/lora.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "common/text.h"
#include "model/safetensors.h"

namespace shardserve {
namespace {

using ojson = nlohmann::ordered_json;

constexpr const char* kTargetNames[kLoraTargets] = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                    "gate_proj", "up_proj", "down_proj"};

bool IsAttention(LoraTarget t) { return t <= LoraTarget::kO; }

// The module's name in the base model, as PEFT's patterns and target_modules see it.
std::string ModuleName(int64_t layer, LoraTarget t) {
  return absl::StrCat("model.layers.", layer, IsAttention(t) ? ".self_attn." : ".mlp.",
                      kTargetNames[static_cast<int>(t)]);
}

// PEFT's match of a target or pattern key: the name itself, or a dotted suffix of it.
bool KeyMatches(const std::string& key, const std::string& name) {
  return name == key || absl::EndsWith(name, "." + key);
}

// A value PEFT writes for an option that is not in use.
bool Unset(const ojson& v) {
  return v.is_null() || (v.is_boolean() && !v.get<bool>()) ||
         ((v.is_array() || v.is_object() || v.is_string()) && v.empty());
}

// Options without effect on an adapter's forward pass: how it was trained and initialized, where
// it came from, how PEFT holds it.
const std::set<std::string>& Ignored() {
  static const auto* kIgnored = new std::set<std::string>{
      "task_type",         "auto_mapping",       "revision",      "inference_mode",
      "lora_dropout",      "init_lora_weights",  "loftq_config",  "eva_config",
      "corda_config",      "runtime_config",     "megatron_core", "peft_version",
      "qalora_group_size", "ensure_weight_tying"};
  return *kIgnored;
}

// Options with an effect shardserve does not run yet: refused by name while set.
const std::map<std::string, std::string>& Unsupported() {
  static const auto* kUnsupported = new std::map<std::string, std::string>{
      {"modules_to_save", "modules trained in full beside the adapter"},
      {"use_dora", "DoRA (weight-decomposed LoRA)"},
      {"use_qalora", "QA-LoRA"},
      {"lora_bias", "a bias on LoRA's B"},
      {"fan_in_fan_out", "weights stored transposed (GPT-2's Conv1D)"},
      {"layer_replication", "replicated layers"},
      {"target_parameters", "LoRA on parameters (MoE experts)"},
      {"trainable_token_indices", "trainable token embeddings"},
      {"exclude_modules", "excluded modules"},
      {"megatron_config", "Megatron parallel layers"},
      {"arrow_config", "Arrow routing between adapters"},
      {"alora_invocation_tokens", "activated LoRA (aLoRA)"}};
  return *kUnsupported;
}

absl::Status Bad(const std::string& file, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(file, ": ", what));
}

// An integer option in [lo, hi].
absl::StatusOr<int64_t> IntIn(const ojson& v, const std::string& file, const std::string& what,
                              int64_t lo, int64_t hi) {
  if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi) {
    return Bad(file, absl::StrCat(what, " must be an integer from ", lo, " to ", hi, ", got ",
                                  v.dump().substr(0, 40)));
  }
  return v.get<int64_t>();
}

// A pattern's keys, each a module name or a dotted suffix of one (PEFT reads them as regular
// expressions; one with other characters is refused).
absl::StatusOr<std::vector<std::pair<std::string, ojson>>> Patterns(const ojson& v,
                                                                    const std::string& file,
                                                                    const std::string& option) {
  std::vector<std::pair<std::string, ojson>> out;
  if (v.is_null()) return out;
  if (!v.is_object() || v.size() > 4096) {
    return Bad(file, absl::StrCat(option, " must be an object of module names (at most 4096)"));
  }
  for (const auto& [key, value] : v.items()) {
    const bool plain =
        !key.empty() && key.size() <= 256 && std::all_of(key.begin(), key.end(), [](char c) {
          return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.';
        });
    if (!plain) {
      return absl::UnimplementedError(absl::StrCat(
          file, ": ", option, " key '", key.substr(0, 80),
          "' is a regular expression; shardserve reads module names and their dotted suffixes"));
    }
    out.emplace_back(key, value);
  }
  return out;
}

// The value of the one pattern key that matches `name` (nullopt: none); two keys that match with
// different values are refused (PEFT would pick one by its order of keys).
absl::StatusOr<std::optional<ojson>> PatternValue(
    const std::vector<std::pair<std::string, ojson>>& patterns, const std::string& name,
    const std::string& file, const std::string& option) {
  std::optional<std::pair<std::string, ojson>> found;
  for (const auto& [key, value] : patterns) {
    if (!KeyMatches(key, name)) continue;
    if (found && found->second != value) {
      return Bad(file, absl::StrCat(option, " keys '", found->first, "' and '", key,
                                    "' both match ", name, " with different values"));
    }
    found = {key, value};
  }
  if (!found) return std::optional<ojson>();
  return std::optional<ojson>(found->second);
}

// A tensor's values as floats (F32, F16, BF16).
absl::StatusOr<std::vector<float>> Floats(const TensorView& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  const auto* bytes = static_cast<const uint8_t*>(t.data);
  for (size_t i = 0; i < out.size(); ++i) {
    switch (t.dtype) {
      case DType::kF32:
        std::memcpy(&out[i], bytes + 4 * i, 4);
        break;
      case DType::kF16:
      case DType::kBF16: {
        uint16_t v;
        std::memcpy(&v, bytes + 2 * i, 2);
        out[i] = t.dtype == DType::kF16 ? F16ToF32(v) : Bf16ToF32(v);
        break;
      }
      default:
        return absl::InvalidArgumentError(absl::StrCat(t.file, ": tensor ", t.name, " is ",
                                                       DTypeName(t.dtype),
                                                       "; LoRA weights are F32, F16 or BF16"));
    }
  }
  return out;
}

// A tensor's place: "base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>.weight".
struct TensorName {
  int64_t layer = 0;
  LoraTarget target = LoraTarget::kQ;
  bool is_a = false;
};

absl::StatusOr<TensorName> ParseTensorName(const std::string& name, const std::string& file) {
  std::string rest = name;
  for (const char* prefix : {"base_model.model.", "base_model."}) {
    if (absl::StartsWith(rest, prefix)) {
      rest = rest.substr(std::strlen(prefix));
      break;
    }
  }
  if (absl::StrContains(name, ".base_layer.") || absl::EndsWith(rest, "embed_tokens.weight") ||
      absl::EndsWith(rest, "lm_head.weight")) {
    return absl::UnimplementedError(
        absl::StrCat(file, ": tensor ", name.substr(0, 200),
                     " is a base module saved in full with the adapter (PEFT's "
                     "save_embedding_layers or modules_to_save), which shardserve does not run "
                     "yet"));
  }
  const std::vector<std::string> parts = absl::StrSplit(rest, '.');
  TensorName out;
  int64_t layer = -1;
  const bool shaped = parts.size() == 7 && parts[0] == "model" && parts[1] == "layers" &&
                      absl::SimpleAtoi(parts[2], &layer) && layer >= 0 && layer < (1 << 20) &&
                      (parts[5] == "lora_A" || parts[5] == "lora_B") && parts[6] == "weight";
  if (!shaped) {
    return Bad(file, absl::StrCat("tensor ", name.substr(0, 200),
                                  " is not a LoRA A or B matrix of a decoder layer's projection "
                                  "(model.layers.N.self_attn|mlp.PROJ.lora_A|lora_B.weight)"));
  }
  int found = -1;
  for (int t = 0; t < kLoraTargets; ++t) {
    if (parts[4] == kTargetNames[t]) found = t;
  }
  const bool attention = found >= 0 && IsAttention(static_cast<LoraTarget>(found));
  if (found < 0 || parts[3] != (attention ? "self_attn" : "mlp")) {
    return Bad(file, absl::StrCat("tensor ", name.substr(0, 200), ": ", parts[3], ".", parts[4],
                                  " is not a projection shardserve runs LoRA on (",
                                  absl::StrJoin(kTargetNames, ", "), ")"));
  }
  out.layer = layer;
  out.target = static_cast<LoraTarget>(found);
  out.is_a = parts[5] == "lora_A";
  return out;
}

// The projection's input and output sizes in the base model.
std::pair<int64_t, int64_t> Dims(const ModelConfig& c, LoraTarget t) {
  switch (t) {
    case LoraTarget::kQ:
      return {c.hidden_size, c.q_dim()};
    case LoraTarget::kK:
    case LoraTarget::kV:
      return {c.hidden_size, c.kv_dim()};
    case LoraTarget::kO:
      return {c.q_dim(), c.hidden_size};
    case LoraTarget::kGate:
    case LoraTarget::kUp:
      return {c.hidden_size, c.intermediate_size};
    case LoraTarget::kDown:
      return {c.intermediate_size, c.hidden_size};
  }
  return {0, 0};
}

}  // namespace

const char* LoraTargetName(LoraTarget t) { return kTargetNames[static_cast<int>(t)]; }

absl::StatusOr<LoraAdapter> LoraAdapter::Load(const std::string& dir, const ModelConfig& base,
                                              const LoraLimits& limits) {
  if (base.mla || base.gpt_oss) {
    return absl::UnimplementedError(absl::StrCat("LoRA adapters on ", base.architecture,
                                                 " are not supported yet (dense attention only)"));
  }
  const std::string config_file = dir + "/adapter_config.json";
  const std::string weights_file = dir + "/adapter_model.safetensors";
  std::error_code ec;
  const auto config_size = std::filesystem::file_size(config_file, ec);
  if (ec) return absl::NotFoundError(absl::StrCat(config_file, ": ", ec.message()));
  if (config_size > static_cast<uintmax_t>(limits.max_config_bytes)) {
    return Bad(config_file, absl::StrCat(config_size, " bytes; at most ", limits.max_config_bytes));
  }
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(config_file));
  const ojson cfg = ojson::parse(text, nullptr, /*allow_exceptions=*/false);
  if (cfg.is_discarded() || !cfg.is_object()) return Bad(config_file, "not a JSON object");

  // Every option: read, ignored, or refused by name.
  static const std::set<std::string> kRead = {"peft_type",
                                              "base_model_name_or_path",
                                              "r",
                                              "lora_alpha",
                                              "use_rslora",
                                              "target_modules",
                                              "bias",
                                              "layers_to_transform",
                                              "layers_pattern",
                                              "rank_pattern",
                                              "alpha_pattern"};
  for (const auto& [key, value] : cfg.items()) {
    if (kRead.count(key) || Ignored().count(key)) continue;
    if (auto it = Unsupported().find(key); it != Unsupported().end()) {
      if (Unset(value)) continue;
      return absl::UnimplementedError(
          absl::StrCat(config_file, ": ", key, " (", it->second, ") is not supported yet"));
    }
    if (!Unset(value)) {
      return absl::UnimplementedError(absl::StrCat(config_file, ": option '", key.substr(0, 80),
                                                   "' is not one shardserve knows"));
    }
  }
  if (cfg.value("peft_type", ojson("LORA")) != "LORA") {
    return absl::UnimplementedError(absl::StrCat(
        config_file, ": peft_type ", cfg["peft_type"].dump().substr(0, 40), " is not LORA"));
  }
  if (const ojson bias = cfg.value("bias", ojson("none")); bias != "none") {
    return absl::UnimplementedError(absl::StrCat(config_file, ": bias ", bias.dump().substr(0, 40),
                                                 " (biases trained with the adapter) is not "
                                                 "supported yet"));
  }
  LoraAdapter adapter;
  if (const ojson& b = cfg.value("base_model_name_or_path", ojson()); b.is_string()) {
    adapter.base_model = b.get<std::string>().substr(0, 256);
  }
  ASSIGN_OR_RETURN(const int64_t r,
                   IntIn(cfg.value("r", ojson()), config_file, "r", 1, limits.max_rank));
  const ojson alpha_value = cfg.value("lora_alpha", ojson(r));
  if (!alpha_value.is_number() || !std::isfinite(alpha_value.get<double>())) {
    return Bad(config_file, "lora_alpha must be a number");
  }
  const double alpha = alpha_value.get<double>();
  const ojson rslora = cfg.value("use_rslora", ojson(false));
  if (!rslora.is_boolean()) return Bad(config_file, "use_rslora must be true or false");

  // The targeted modules.
  std::set<LoraTarget> all;
  std::vector<std::string> targets;
  const ojson& tm = cfg.value("target_modules", ojson());
  if (tm.is_string() && tm == "all-linear") {
    for (const char* n : kTargetNames) targets.emplace_back(n);
  } else if (tm.is_string()) {
    return absl::UnimplementedError(
        absl::StrCat(config_file, ": target_modules '", tm.get<std::string>().substr(0, 80),
                     "' is a regular expression; list the projections instead"));
  } else if (tm.is_array() && !tm.empty() && tm.size() <= 4096) {
    for (const ojson& t : tm) {
      if (!t.is_string() || t.get<std::string>().empty()) {
        return Bad(config_file, "target_modules must list module names");
      }
      targets.push_back(t.get<std::string>());
    }
  } else {
    return Bad(config_file, "target_modules must be a list of module names or \"all-linear\"");
  }
  std::set<int64_t> layers;  // empty: every layer
  if (const ojson& l = cfg.value("layers_to_transform", ojson()); !l.is_null()) {
    for (const ojson& one : l.is_array() ? l : ojson::array({l})) {
      ASSIGN_OR_RETURN(int64_t i,
                       IntIn(one, config_file, "layers_to_transform", 0, base.num_layers - 1));
      layers.insert(i);
    }
  }
  if (const ojson& p = cfg.value("layers_pattern", ojson());
      !Unset(p) && p != "layers" && p != ojson::array({"layers"})) {
    return absl::UnimplementedError(absl::StrCat(config_file, ": layers_pattern ",
                                                 p.dump().substr(0, 80),
                                                 " (the base model's layers "
                                                 "are model.layers)"));
  }
  ASSIGN_OR_RETURN(auto rank_pattern,
                   Patterns(cfg.value("rank_pattern", ojson()), config_file, "rank_pattern"));
  ASSIGN_OR_RETURN(auto alpha_pattern,
                   Patterns(cfg.value("alpha_pattern", ojson()), config_file, "alpha_pattern"));

  // The tensors.
  const auto weights_size = std::filesystem::file_size(weights_file, ec);
  if (ec) return absl::NotFoundError(absl::StrCat(weights_file, ": ", ec.message()));
  if (weights_size > static_cast<uintmax_t>(limits.max_bytes)) {
    return Bad(weights_file, absl::StrCat(weights_size, " bytes; at most ", limits.max_bytes));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(weights_file));
  // What the adapter is, before what is wrong with one of its tensors.
  for (const auto& [name, t] : file->tensors()) {
    if (absl::StrContains(name, "lora_embedding_")) {
      return absl::UnimplementedError(
          absl::StrCat(weights_file, ": tensor ", name,
                       " is embedding LoRA, which shardserve does not run yet"));
    }
    if (absl::StrContains(name, "lora_magnitude_vector")) {
      return absl::UnimplementedError(absl::StrCat(
          weights_file, ": tensor ", name, " is DoRA's, which shardserve does not run yet"));
    }
  }
  std::map<std::pair<int64_t, LoraTarget>, LoraModule> modules;
  std::map<std::pair<int64_t, LoraTarget>, int> halves;  // 1: A, 2: B
  for (const auto& [name, t] : file->tensors()) {
    ASSIGN_OR_RETURN(TensorName where, ParseTensorName(name, weights_file));
    const std::string module = ModuleName(where.layer, where.target);
    const bool targeted = std::any_of(targets.begin(), targets.end(),
                                      [&](const std::string& k) { return KeyMatches(k, module); });
    if (where.layer >= base.num_layers || !targeted ||
        (!layers.empty() && !layers.count(where.layer))) {
      return Bad(weights_file, absl::StrCat("tensor ", name, ": ", module,
                                            where.layer >= base.num_layers
                                                ? absl::StrCat(" is past the base model's ",
                                                               base.num_layers, " layers")
                                                : " is not a module adapter_config.json targets"));
    }
    if (base.moe_layer(where.layer) && !IsAttention(where.target)) {
      return absl::UnimplementedError(
          absl::StrCat(weights_file, ": tensor ", name,
                       ": LoRA on a mixture-of-experts layer's MLP is not supported yet"));
    }
    int64_t rank = r;
    ASSIGN_OR_RETURN(std::optional<ojson> rp,
                     PatternValue(rank_pattern, module, config_file, "rank_pattern"));
    if (rp) {
      ASSIGN_OR_RETURN(rank, IntIn(*rp, config_file, "rank_pattern", 1, limits.max_rank));
    }
    double a = alpha;
    ASSIGN_OR_RETURN(std::optional<ojson> ap,
                     PatternValue(alpha_pattern, module, config_file, "alpha_pattern"));
    if (ap) {
      if (!ap->is_number() || !std::isfinite(ap->get<double>())) {
        return Bad(config_file, absl::StrCat("alpha_pattern for ", module, " must be a number"));
      }
      a = ap->get<double>();
    }
    const auto [in, out] = Dims(base, where.target);
    const std::vector<int64_t> want =
        where.is_a ? std::vector<int64_t>{rank, in} : std::vector<int64_t>{out, rank};
    if (t.shape != want) {
      return Bad(weights_file,
                 absl::StrCat("tensor ", name, " is ", t.ShapeString(), "; ", module, " of rank ",
                              rank, " needs [", want[0], ",", want[1], "]"));
    }
    LoraModule& m = modules[{where.layer, where.target}];
    m.layer = where.layer;
    m.target = where.target;
    m.rank = rank;
    m.in = in;
    m.out = out;
    m.scale = static_cast<float>(a / (rslora.get<bool>() ? std::sqrt(static_cast<double>(rank))
                                                         : static_cast<double>(rank)));
    ASSIGN_OR_RETURN(std::vector<float> values, Floats(t));
    (where.is_a ? m.a : m.b) = std::move(values);
    halves[{where.layer, where.target}] |= where.is_a ? 1 : 2;
  }
  for (const auto& [key, got] : halves) {
    if (got != 3) {
      return Bad(weights_file,
                 absl::StrCat(ModuleName(key.first, key.second), " has lora_", got == 1 ? "A" : "B",
                              " without lora_", got == 1 ? "B" : "A"));
    }
  }
  if (modules.empty()) return Bad(weights_file, "no LoRA tensors");
  for (auto& [key, m] : modules) {
    adapter.max_rank = std::max(adapter.max_rank, m.rank);
    adapter.modules.push_back(std::move(m));
  }
  return adapter;
}

}  // namespace shardserve
