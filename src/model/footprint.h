#pragma once
// A model's footprint (plan/footprint.h) from its config.json alone, before any rank loads a
// byte. It covers the architectures shardserve runs and the large ones a platform team plans for
// (DeepseekV3ForCausalLM, GptOssForCausalLM), in the weight formats their checkpoints ship:
// BF16/F16/F32, fine-grained FP8 (E4M3 with a scale per 128x128 block), FP8 per output row
// (fbgemm_fp8), MXFP4 experts (4-bit values, a scale per 32), each counted as kept in that format
// with its scales, and `quantization_config.modules_to_not_convert` kept in the model's dtype.
#include <string>

#include "absl/status/statusor.h"
#include "model/config.h"
#include "plan/footprint.h"

namespace shardserve {

// From what config.json says (DescribeModelConfig: the one reader of the file).
ModelFootprint FootprintOf(const ModelConfig& config);
// From config.json's text; errors name the source and the key.
absl::StatusOr<ModelFootprint> FootprintFromConfig(const std::string& json_text,
                                                   const std::string& source = "config.json");
// A model directory (config.json) or a GGUF file (its metadata; the weights counted at the file's
// average bytes per parameter).
absl::StatusOr<ModelFootprint> LoadFootprint(const std::string& model_path);

}  // namespace shardserve
