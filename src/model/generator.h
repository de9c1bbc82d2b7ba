#pragma once
// Batched generation on one Transformer: prefill every prompt in one flattened forward, then
// decode all unfinished sequences together, one token per step, until each hits max_tokens, a
// stop token id or an eos token.
#include <vector>

#include "absl/status/statusor.h"
#include "model/generation.h"
#include "model/transformer.h"

namespace shardserve {

// Runs all requests to completion with a KV cache sized for them. Invalid parameters, empty
// prompts and prompts that do not fit the context are InvalidArgument naming the request.
absl::StatusOr<std::vector<GenerationResult>> Generate(
    Transformer& model, const std::vector<GenerationRequest>& requests);

}  // namespace shardserve
