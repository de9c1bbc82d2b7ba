#pragma once
// Rotary position embeddings as Hugging Face computes them (rotate_half layout: dimension i pairs
// with i + head_dim/2), including `linear` and `llama3` frequency scaling. The rotation itself is
// a backend op (Backend::Rope).
#include <vector>

#include "model/config.h"

namespace shardserve {

// The head_dim / 2 inverse frequencies, float32 as in the reference.
std::vector<float> RopeInvFreq(const ModelConfig& config);

}  // namespace shardserve
