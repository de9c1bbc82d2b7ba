#pragma once
// Token choice from vocab-parallel logits (each TP rank holds the logits of its vocabulary slice)
// without gathering them: every rank contributes its slice's maximum, its sum of exp(logit - max)
// and its top-K candidates (2 + 2K floats per sequence), one all-gather, and every rank derives
// the greedy token, its log-probability and the top-K log-probabilities exactly as Sampler does
// on the full logits (ties to the lower id).
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "model/sampler.h"

namespace shardserve {

// local: S rows of this rank's logits for vocabulary ids [vocab_begin, vocab_end), row stride ld.
// comm: the TP group (null for a single rank). top_logprobs: K alternatives to report.
absl::StatusOr<std::vector<SampledToken>> GreedyFromVocabSlices(const float* local, int64_t S,
                                                                int64_t ld, int64_t vocab_begin,
                                                                int64_t vocab_end,
                                                                int64_t top_logprobs,
                                                                Communicator* comm);

}  // namespace shardserve
