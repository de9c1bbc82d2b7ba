#pragma once
// Token selection from logits: greedy (temperature 0) or sampled with temperature, top-k and
// top-p from a seeded generator (same seed, same tokens), plus log-probabilities of the model
// distribution (log-softmax of the raw logits) for the chosen token and the top K.
#include <cstdint>
#include <random>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "backend/backend.h"

namespace shardserve {

struct SamplingParams {
  float temperature = 0.0f;  // 0 = greedy
  float top_p = 1.0f;        // (0, 1]
  int64_t top_k = 0;         // 0 = no limit
  uint64_t seed = 0;
  int64_t max_tokens = 16;
  std::vector<int64_t> stop_token_ids;  // generation ends after producing one of these
  bool ignore_eos = false;              // do not stop at the model's eos tokens
  int64_t top_logprobs = 0;             // alternatives to report per generated token
  // What changes the logits before the choice, as vLLM applies it, in this order: logit_bias
  // (added), min_tokens (end_ids held back until that many tokens were generated),
  // repetition_penalty (a token of the prompt or the output: its logit divided by it when
  // positive, multiplied when not), frequency_penalty (subtracted times the token's count in the
  // output) and presence_penalty (subtracted once for a token the output holds). The reported
  // log-probabilities stay the model's own (vLLM's raw logprobs).
  std::vector<std::pair<int32_t, float>> logit_bias;
  int64_t min_tokens = 0;
  std::vector<int64_t> end_ids;  // stop_token_ids and, without ignore_eos, the model's eos
  float repetition_penalty = 1.0f;
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;

  absl::Status Validate() const;  // names the bad parameter
  // Sets end_ids from stop_token_ids and the model's `eos` (unless ignore_eos) when min_tokens
  // needs them.
  void SetEndIds(const std::vector<int64_t>& eos);
  bool ProcessesLogits() const {
    return !logit_bias.empty() || (min_tokens > 0 && !end_ids.empty()) ||
           repetition_penalty != 1.0f || frequency_penalty != 0.0f || presence_penalty != 0.0f;
  }
};

struct TokenLogprob {
  int32_t id;
  float logprob;
};

struct SampledToken {
  int32_t id;
  float logprob;
  std::vector<TokenLogprob> top;  // best first, top_logprobs entries
};

// One per sequence; holds the sequence's random generator and, for the penalties, the tokens it
// has read.
class Sampler {
 public:
  // `prompt_tokens`: how many of the tokens the sequence reads (Observe) are its prompt.
  explicit Sampler(const SamplingParams& params, int64_t prompt_tokens = 0)
      : params_(params), prompt_(prompt_tokens), rng_(params.seed) {}
  // The sequence's next tokens as the model reads them (its prompt, then its output), in order.
  void Observe(const int32_t* tokens, int64_t n);
  // The next Sample chooses among these ids only (a bit mask, bit i % 32 of word i / 32 for
  // token i; structured output's, computed by the leader for this token).
  void Allow(std::vector<uint32_t> mask) { allowed_ = std::move(mask); }
  // Whether the next choice is made from a processed row (the parameters' processing or an
  // allowed set), on the host.
  bool ProcessesLogits() const { return params_.ProcessesLogits() || !allowed_.empty(); }
  // The row of logits as the choice sees it (SamplingParams' processing, then the allowed set),
  // in place.
  void Process(float* logits, int64_t vocab) const;
  // The next token from the model's logits: processed (when the parameters ask) and chosen, with
  // the log-probabilities of the unprocessed row.
  SampledToken Sample(const float* logits, int64_t vocab);
  // Speculative decoding's verification. `rows`: drafts.size() + 1 rows of the model's logits,
  // row i read after the tokens Observe saw and drafts[0, i). The drafts are checked in order by
  // rejection sampling against a proposal that chose them deterministically (n-gram lookup, a
  // draft model's greedy token): drafts[i] is kept with the probability the choice (processed,
  // at the temperature, top_k, top_p) gives it, at temperature 0 when it is the greedy token;
  // the first refused is replaced by a token drawn from the choice without it, renormalized;
  // with every draft kept, the last row adds one token. So the tokens keep exactly the
  // distribution Sample gives, one draw a token as Sample's (the draw of a refusal, rescaled,
  // chooses the replacement). Kept drafts are observed (the penalties'). `masks`: the allowed
  // set of each row (structured output), or none. Returns the kept drafts and the last token,
  // with the unprocessed rows' log-probabilities.
  std::vector<SampledToken> Verify(const float* rows, int64_t vocab,
                                   const std::vector<int32_t>& drafts,
                                   const std::vector<std::vector<uint32_t>>& masks = {});
  const SamplingParams& params() const { return params_; }
  // The parameters and the draw the next Sample would use (one draw per sampled token at
  // temperature > 0; none when greedy), for a backend that samples with this sequence's stream
  // (Backend::SampleRows).
  SampleSpec NextSpec();
  // Moves the generator past the random draws of `tokens` earlier samples, so a sequence that
  // is resumed continues the stream it started.
  void Skip(int64_t tokens) {
    if (params_.temperature > 0.0f) rng_.discard(static_cast<unsigned long long>(tokens));
  }

 private:
  double Uniform();  // [0, 1), identical on every platform for a seed
  SamplingParams params_;
  int64_t prompt_ = 0, read_ = 0, generated_ = 0;
  std::unordered_set<int32_t> prompt_ids_;
  std::unordered_map<int32_t, int64_t> output_counts_;
  std::vector<uint32_t> allowed_;  // for the next Sample only
  std::mt19937_64 rng_;
};

}  // namespace shardserve
