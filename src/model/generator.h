#pragma once
// Batched generation on one Transformer: prefill every prompt in one flattened forward, then
// decode all unfinished sequences together, one token per step, until each hits max_tokens, a
// stop token id or an eos token.
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/sampler.h"
#include "model/transformer.h"

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

// Runs all requests to completion with a KV cache sized for them. Invalid parameters, empty
// prompts and prompts that do not fit the context are InvalidArgument naming the request.
absl::StatusOr<std::vector<GenerationResult>> Generate(
    Transformer& model, const std::vector<GenerationRequest>& requests);

}  // namespace shardserve
