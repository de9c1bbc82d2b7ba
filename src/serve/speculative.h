#pragma once
// Speculative decoding's drafts (DESIGN.md §5, issue 56). The leader drafts up to k tokens for a
// decode step of a sequence; the step feeds them after its last token, the last stage computes
// logits on each of those rows and verifies the drafts by rejection sampling (Sampler::Verify),
// returning the kept drafts and one token more; the refused drafts' cache positions are rewound
// by the sequence's next chunk. Greedy output is the same as without speculation; sampled output
// has the same distribution.
#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "api/speculative.h"

namespace shardserve {

// Prompt lookup (n-gram): of the sequence's tokens (its prompt, then its output), the latest
// earlier occurrence of its last n tokens, n from config.ngram_max down to ngram_min, and the up
// to `k` tokens that followed it; none when no suffix recurs.
std::vector<int32_t> NgramDrafts(absl::Span<const int32_t> prompt, absl::Span<const int32_t> output,
                                 const SpeculativeConfig& config, int64_t k);

}  // namespace shardserve
