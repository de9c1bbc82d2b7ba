#pragma once
// Speculative decoding's drafts (DESIGN.md §5, issue 56). The leader drafts up to k tokens for a
// decode step of a sequence; the step feeds them after its last token, the last stage computes
// logits on each of those rows and verifies the drafts by rejection sampling (Sampler::Verify),
// returning the kept drafts and one token more; the refused drafts' cache positions are rewound
// by the sequence's next chunk. Greedy output is the same as without speculation; sampled output
// has the same distribution.
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"
#include "api/speculative.h"

namespace shardserve {

// Prompt lookup (n-gram): of the sequence's tokens (its prompt, then its output), the latest
// earlier occurrence of its last n tokens, n from config.ngram_max down to ngram_min, and the up
// to `k` tokens that followed it; none when no suffix recurs.
std::vector<int32_t> NgramDrafts(absl::Span<const int32_t> prompt, absl::Span<const int32_t> output,
                                 const SpeculativeConfig& config, int64_t k);

// What drafts tokens for the engine's decode steps: every sequence that drafts in a step, asked
// at once (a draft model runs them as one batch). Called on the scheduler thread only.
class Drafter {
 public:
  struct Query {
    int64_t seq = 0;
    absl::Span<const int32_t> prompt, output;  // the sequence's tokens so far
    int64_t k = 0;                             // drafts wanted, at most
  };
  virtual ~Drafter() = default;
  // Each query's drafts (at most its k; none is an answer). A drafter that fails drafts nothing:
  // the sequences then decode one token a step.
  virtual std::vector<std::vector<int32_t>> Propose(const std::vector<Query>& queries) = 0;
  // The sequence ended or was preempted: what the drafter keeps of it is freed.
  virtual void Forget(int64_t /*seq*/) {}
  // A draft the replica's model computed with a step (StepResult::drafts, multi-token
  // prediction): `token` for the sequence's position `length` (once it has that many tokens).
  virtual void Drafted(int64_t /*seq*/, int64_t /*length*/, int32_t /*token*/) {}
};

// Multi-token prediction (method mtp): the replica's last stage runs the checkpoint's MTP layer
// after each step (Transformer::Mtp) and returns a draft for the sequence's next step with the
// step's result; this drafter hands it back then, one token, if the sequence is where the draft
// was made for (none after a preemption, or for a sequence whose step drafted nothing).
class MtpDrafter : public Drafter {
 public:
  std::vector<std::vector<int32_t>> Propose(const std::vector<Query>& queries) override;
  void Forget(int64_t seq) override { drafts_.erase(seq); }
  void Drafted(int64_t seq, int64_t length, int32_t token) override {
    drafts_[seq] = {length, token};
  }

 private:
  absl::flat_hash_map<int64_t, std::pair<int64_t, int32_t>> drafts_;  // seq -> length, token
};

class NgramDrafter : public Drafter {
 public:
  explicit NgramDrafter(const SpeculativeConfig& config) : config_(config) {}
  std::vector<std::vector<int32_t>> Propose(const std::vector<Query>& queries) override;

 private:
  SpeculativeConfig config_;
};

}  // namespace shardserve
