#pragma once
// What the leader's scheduler asks of a replica, one step at a time (DESIGN.md §5): the
// sequences of one micro-batch with their new tokens, and the sequences whose KV cache every
// rank must free. A step's result carries one sampled token per sequence that asked for one.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/kv_transfer.h"
#include "model/sampler.h"
#include "serve/kv_layout.h"

namespace shardserve {

struct StepChunk {
  int64_t seq = 0;
  std::vector<int32_t> tokens;  // new positions of this sequence, in order
  // Set on a sequence's first chunk (and again after it was preempted): the last stage starts
  // its sampler, advanced by `draws` random draws so a resumed sequence continues its stream,
  // knowing that the first `prompt_tokens` tokens it reads are the prompt (the penalties').
  std::optional<SamplingParams> params;
  int64_t draws = 0;
  int64_t prompt_tokens = 0;
  bool sample = true;  // false for a prompt chunk that is not the prompt's last
  // The sequence's KV blocks, as the leader hands them out (serve/prefix_cache.h): on its first
  // chunk (params set) the cached blocks it starts with, holding positions [0, start) that the
  // ranks skip; on every chunk the blocks added to its table for these tokens.
  int64_t start = 0;
  std::vector<int32_t> cached;
  // With a cached start and a sampler that reads the sequence's tokens (penalties): positions
  // [0, start), which the ranks skip but the sampler reads first.
  std::vector<int32_t> history;
  // Disaggregated prefill (WorkerEnv::kv_role "prefill"): once this chunk's KV is written, every
  // rank offers the sequence's blocks under this ticket (serve/kv_layout.h's OfferedKv) until the
  // sequence is released.
  std::optional<KvTicket> offer;
  std::vector<int32_t> blocks;
  // Speculative decoding: the chunk's last `drafts` tokens are drafted, not yet the sequence's;
  // the last stage verifies them (Sampler::Verify) and returns the kept ones and one token more.
  // `rewind`: positions dropped from the end of the sequence's cache before this chunk (the
  // drafts its previous chunk had refused; their blocks stay its own).
  int64_t drafts = 0;
  int64_t rewind = 0;
  // Multi-token prediction (speculative method mtp): the sequence's token after this chunk where
  // the leader knows it (a prompt chunk not the prompt's last), which the MTP layer reads at the
  // chunk's last row; -1: none (a sampled chunk's comes from its sampling).
  int32_t next = -1;
  // The LoRA adapter slot the sequence runs (every chunk of it; -1: the base model).
  int32_t lora_slot = -1;
  // Structured output: the ids each sampled row may take (Sampler::Allow's mask), row after row:
  // 1 + drafts masks of one size (a draft's row reads the grammar past the drafts before it);
  // empty: any.
  std::vector<uint32_t> allowed;
  // Prompt log-probabilities (echo with logprobs): rows [score_from, score_from + score.size())
  // of this chunk are scored, row score_from + i against token score[i] (the prompt's next), with
  // score_top alternatives each.
  int64_t score_from = 0;
  std::vector<int32_t> score;
  int64_t score_top = 0;
};

struct StepDesc {
  int microbatch = 0;
  std::vector<StepChunk> chunks;
  std::vector<int64_t> release;  // freed before the chunks run
};

// A sampled token; a chunk with drafts gets its kept drafts and one more, in order.
struct StepToken {
  int64_t seq = 0;
  int32_t token = 0;
  float logprob = 0;
  std::vector<TokenLogprob> top;
};

struct StepResult {
  int microbatch = 0;
  std::vector<StepToken> tokens;
  // The scored prompt tokens (StepChunk::score), in chunk and row order: token is the prompt's.
  std::vector<StepToken> prompt;
  // Multi-token prediction: a sampled sequence's draft for the step after its next (the MTP
  // layer's greedy token two positions past the step's last row), logprob unused.
  std::vector<StepToken> drafts;
};

// A chunk's allowed sets (StepChunk::allowed), one a sampled row; none without a grammar.
inline std::vector<std::vector<uint32_t>> RowMasks(const StepChunk& c) {
  std::vector<std::vector<uint32_t>> out;
  if (c.allowed.empty()) return out;
  const size_t rows = static_cast<size_t>(1 + c.drafts), words = c.allowed.size() / rows;
  for (size_t r = 0; r < rows; ++r) {
    out.emplace_back(c.allowed.begin() + r * words, c.allowed.begin() + (r + 1) * words);
  }
  return out;
}

// The batch rows a step asks the last stage to score (StepChunk::score, every chunk's in order),
// their targets and the most alternatives any asks for.
struct ScoreRows {
  std::vector<int32_t> rows, targets;
  int64_t top = 0;
};
inline ScoreRows ScoreRowsOf(const StepDesc& step) {
  ScoreRows out;
  int64_t row = 0;  // the chunk's first row in the batch
  for (const StepChunk& c : step.chunks) {
    for (size_t i = 0; i < c.score.size(); ++i) {
      out.rows.push_back(static_cast<int32_t>(row + c.score_from + static_cast<int64_t>(i)));
      out.targets.push_back(c.score[i]);
    }
    out.top = std::max(out.top, c.score_top);
    row += static_cast<int64_t>(c.tokens.size());
  }
  return out;
}
// The scored rows (in ScoreRowsOf's order) into the result, each with its chunk's alternatives.
inline void AddPromptScores(const StepDesc& step, std::vector<SampledToken> scored,
                            StepResult& result) {
  size_t next = 0;
  for (const StepChunk& c : step.chunks) {
    for (size_t i = 0; i < c.score.size() && next < scored.size(); ++i, ++next) {
      SampledToken& t = scored[next];
      t.top.resize(std::min<size_t>(t.top.size(), static_cast<size_t>(c.score_top)));
      result.prompt.push_back({c.seq, t.id, t.logprob, std::move(t.top)});
    }
  }
}

// Disaggregated decode: the prompt KV a prefill replica offers under `ticket`, pulled by every
// rank of this replica into `blocks` (the sequence's table for its first `positions` positions),
// leaving out the first `skip_blocks` (this replica's prefix cache holds them).
struct KvImport {
  int64_t seq = 0;
  KvTicket ticket{};
  KvRoleShape source;                  // how the prefill replica holds the KV
  std::vector<std::string> addresses;  // its ranks' exporters, by rank (stage * tp + tp_rank)
  int64_t positions = 0;
  std::vector<int32_t> blocks;
  int64_t skip_blocks = 0;
};

// A LoRA adapter loaded at runtime (serve/adapter_registry.h), the leader's order to every
// rank: prepare (read the adapter in `path` and lay out the rank's share in host memory, on a
// thread of the rank's own while steps run; kept under `id`), install (copy the prepared `id`
// into `slot`, between steps, waiting for the preparation if it is not done), evict (empty
// `slot`; the host copy stays), forget (drop the host copy of `id`).
struct LoraOrder {
  enum class Op { kPrepare, kInstall, kEvict, kForget };
  Op op = Op::kPrepare;
  int64_t id = 0;
  std::string path;
  int32_t slot = -1;
};

// The leader's handle on its replica. Not thread-safe: one scheduler thread drives it.
class StepExecutor {
 public:
  virtual ~StepExecutor() = default;
  // Sends the step to every rank and runs the leader's own part of it.
  virtual absl::Status Issue(const StepDesc& step) = 0;
  // The result of the oldest issued step not yet collected (steps complete in order); blocks.
  virtual absl::StatusOr<StepResult> Collect() = 0;
  // A round trip through every rank: fails, naming the rank, when one is gone.
  virtual absl::Status Ping() = 0;
  // Tells every rank to exit cleanly.
  virtual absl::Status Stop() = 0;
  // Every rank pulls its share of `import` (between steps; the steps issued before it may still
  // be in flight). The status returned is the replica's (a rank gone); `transfer` the transfer's
  // (refused, failed, too slow: the sequence is then prefilled here, its blocks overwritten).
  // `bytes`: those pulled, over every rank.
  virtual absl::Status ImportKv(const KvImport& /*import*/, absl::Status* transfer,
                                int64_t* /*bytes*/) {
    *transfer = absl::FailedPreconditionError("this replica does not take KV from others");
    return absl::OkStatus();
  }
  // Every rank carries out `order` (between steps). The status returned is the replica's (a rank
  // gone); `result` the order's (an install: the first rank's error, naming it; the others: OK).
  virtual absl::Status OrderLora(const LoraOrder& /*order*/, absl::Status* result) {
    *result = absl::FailedPreconditionError("this replica runs no LoRA adapters");
    return absl::OkStatus();
  }
};

}  // namespace shardserve
