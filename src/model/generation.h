#pragma once
// What a generation asks for and what it gives back: shared by the engine (serve/engine.h), the
// single-process generator (model/generator.h) and the CLI, without the transformer behind them.
#include <cstdint>
#include <string>
#include <vector>

#include "model/sampler.h"

namespace shardserve {

struct GenerationRequest {
  std::vector<int32_t> prompt_ids;
  SamplingParams params;
};

struct GenerationResult {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<std::vector<TokenLogprob>> top_logprobs;
  std::string finish_reason;  // "stop" or "length"
};

}  // namespace shardserve
