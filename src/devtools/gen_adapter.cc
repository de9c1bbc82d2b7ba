#include "devtools/gen_adapter.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "model/lora.h"
#include "model/safetensors.h"

namespace shardserve {

absl::Status WriteRandomAdapter(const std::string& dir, const ModelConfig& c,
                                const AdapterOptions& o) {
  if (c.mla || c.gpt_oss) {
    return absl::InvalidArgumentError("random adapters are written for Llama-shaped attention");
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(dir, ": ", ec.message()));
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  struct Proj {
    LoraTarget target;
    int64_t in, out;
  };
  const Proj projections[] = {{LoraTarget::kQ, H, c.q_dim()},  {LoraTarget::kK, H, c.kv_dim()},
                              {LoraTarget::kV, H, c.kv_dim()}, {LoraTarget::kO, c.q_dim(), H},
                              {LoraTarget::kGate, H, I},       {LoraTarget::kUp, H, I},
                              {LoraTarget::kDown, I, H}};
  std::vector<TensorSpec> specs;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (c.moe_layer(l)) continue;
    for (const Proj& p : projections) {
      const std::string name = absl::StrCat("base_model.model.model.layers.", l,
                                            p.target <= LoraTarget::kO ? ".self_attn." : ".mlp.",
                                            LoraTargetName(p.target));
      specs.push_back({name + ".lora_A.weight", DType::kF32, {o.rank, p.in}});
      specs.push_back({name + ".lora_B.weight", DType::kF32, {p.out, o.rank}});
    }
  }
  RETURN_IF_ERROR(WriteSafetensors(dir + "/adapter_model.safetensors", specs,
                                   [&](size_t k, std::vector<uint8_t>& bytes) {
                                     std::mt19937_64 rng(o.seed * 1000003 + k);
                                     std::uniform_real_distribution<float> u(-o.bound, o.bound);
                                     std::vector<float> v(specs[k].nbytes() / sizeof(float));
                                     for (float& f : v) f = u(rng);
                                     bytes.resize(specs[k].nbytes());
                                     std::memcpy(bytes.data(), v.data(), bytes.size());
                                   }));
  const nlohmann::json config = {
      {"peft_type", "LORA"},   {"task_type", "CAUSAL_LM"},       {"r", o.rank},
      {"lora_alpha", o.alpha}, {"target_modules", "all-linear"}, {"lora_dropout", 0.0},
      {"bias", "none"}};
  std::ofstream f(dir + "/adapter_config.json");
  f << config.dump(2);
  if (!f.good()) return absl::InternalError(absl::StrCat(dir, "/adapter_config.json: not written"));
  return absl::OkStatus();
}

}  // namespace shardserve
