#pragma once
// Token selection from logits: greedy (temperature 0) or sampled with temperature, top-k and
// top-p from a seeded generator (same seed, same tokens), plus log-probabilities of the model
// distribution (log-softmax of the raw logits) for the chosen token and the top K.
#include <cstdint>
#include <random>
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

  absl::Status Validate() const;  // names the bad parameter
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

// One per sequence; holds the sequence's random generator.
class Sampler {
 public:
  explicit Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}
  SampledToken Sample(const float* logits, int64_t vocab);
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
  std::mt19937_64 rng_;
};

}  // namespace shardserve
