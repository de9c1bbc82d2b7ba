#pragma once
// LoRA adapters as PEFT writes them: a directory with adapter_config.json and
// adapter_model.safetensors. What shardserve reads: `r`, `lora_alpha`, `use_rslora`,
// `target_modules` among a decoder's attention and MLP projections (q_proj, k_proj, v_proj,
// o_proj, gate_proj, up_proj, down_proj, or "all-linear"), per-module ranks and alphas
// (`rank_pattern`, `alpha_pattern`, keyed by module names or their dotted suffixes), and
// `layers_to_transform`. Every other option PEFT writes is refused by name while it has an effect
// (`modules_to_save`, `use_dora`, embedding LoRA, a `bias`, `lora_bias`, `fan_in_fan_out`,
// `layer_replication`, `target_parameters`, `trainable_token_indices`, a regex in
// `target_modules`, ...), and so is an option this reader does not know, unless it is unset.
// Every tensor of the file must be an A or B matrix of a projection the config targets, of the
// shape the base model's projection asks (A: [rank][in], B: [out][rank]); sizes are bounded
// (LoraLimits), and no byte of the files can abort the process.
//
// The update of a projection W: y = W x + scale * B (A x), scale = lora_alpha / r, or
// lora_alpha / sqrt(r) with use_rslora (each module's own alpha and r where the patterns set
// them).
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/config.h"

namespace shardserve {

enum class LoraTarget { kQ, kK, kV, kO, kGate, kUp, kDown };
inline constexpr int kLoraTargets = 7;
const char* LoraTargetName(LoraTarget t);  // "q_proj", ..., "down_proj"

struct LoraLimits {
  int64_t max_rank = 256;                       // of any module (maxLoraRank)
  int64_t max_bytes = int64_t{4} << 30;         // adapter_model.safetensors
  int64_t max_config_bytes = int64_t{1} << 20;  // adapter_config.json
};

// One projection's update in one layer.
struct LoraModule {
  int64_t layer = 0;
  LoraTarget target = LoraTarget::kQ;
  int64_t rank = 0;
  int64_t in = 0, out = 0;  // the projection's input and output sizes
  float scale = 1.0f;
  std::vector<float> a;  // [rank][in]
  std::vector<float> b;  // [out][rank]
};

struct LoraAdapter {
  int64_t max_rank = 0;             // the largest rank of its modules
  std::vector<LoraModule> modules;  // by layer, then target
  std::string base_model;           // base_model_name_or_path, as PEFT wrote it (informational)

  // Reads and checks the adapter in `dir` against the base model `base`. InvalidArgument names
  // the file, the option or tensor, and what is wrong; Unimplemented names a PEFT option that
  // has an effect shardserve does not run yet.
  static absl::StatusOr<LoraAdapter> Load(const std::string& dir, const ModelConfig& base,
                                          const LoraLimits& limits = {});
};

}  // namespace shardserve
