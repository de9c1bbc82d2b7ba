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

// The summary of one row: max, sum, then K = max(1, top_logprobs) (logit, id) pairs, best first
// (ties to the lower id), -inf where the slice has fewer. The CUDA backend computes the same on
// the device (cuda::VocabSummaries).
inline int64_t SummaryCandidates(int64_t top_logprobs) {
  return top_logprobs > 1 ? top_logprobs : 1;
}
inline int64_t SummaryWidth(int64_t top_logprobs) {
  return 2 + 2 * SummaryCandidates(top_logprobs);
}

// The summaries of S rows of this rank's logits for vocabulary ids [vocab_begin, vocab_end), row
// stride ld: S * SummaryWidth floats.
std::vector<float> VocabSummaries(const float* local, int64_t S, int64_t ld, int64_t vocab_begin,
                                  int64_t vocab_end, int64_t top_logprobs);

// Every rank's summaries (one all-gather over comm, the TP group; null for a single rank) give
// each row's greedy token, its log-probability and the top_logprobs alternatives.
absl::StatusOr<std::vector<SampledToken>> GreedyFromSummaries(const std::vector<float>& mine,
                                                              int64_t S, int64_t top_logprobs,
                                                              Communicator* comm);

// Prompt scoring: each row's target token (targets[s]) with its log-probability and the
// top_logprobs alternatives, from this rank's summaries and its logit of each target (-inf where
// the target is outside its slice); one all-gather over comm.
absl::StatusOr<std::vector<SampledToken>> ScoreFromSummaries(
    const std::vector<float>& mine, const std::vector<float>& target_logits,
    const std::vector<int32_t>& targets, int64_t top_logprobs, Communicator* comm);

// Both steps on host logits. local: S rows of this rank's logits for vocabulary ids
// [vocab_begin, vocab_end), row stride ld.
absl::StatusOr<std::vector<SampledToken>> GreedyFromVocabSlices(const float* local, int64_t S,
                                                                int64_t ld, int64_t vocab_begin,
                                                                int64_t vocab_end,
                                                                int64_t top_logprobs,
                                                                Communicator* comm);

}  // namespace shardserve
