#include "model/sampler.h"

#include <algorithm>
#include <climits>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "backend/cpu/kernels.h"

namespace shardserve {

absl::Status SamplingParams::Validate() const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature)) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be a finite number >= 0, got ", temperature));
  }
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], got ", top_p));
  }
  if (top_k < 0) return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0, got ", top_k));
  if (max_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens must be >= 1, got ", max_tokens));
  }
  if (top_logprobs < 0 || top_logprobs > 20) {
    return absl::InvalidArgumentError(
        absl::StrCat("logprobs must be between 0 and 20, got ", top_logprobs));
  }
  return absl::OkStatus();
}

SampleSpec Sampler::NextSpec() {
  const int64_t top_k = std::min<int64_t>(params_.top_k, INT32_MAX);  // larger: no limit either
  return {params_.temperature, params_.top_p, static_cast<int32_t>(top_k),
          params_.temperature > 0.0f ? Uniform() : 0.0};
}

double Sampler::Uniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

SampledToken Sampler::Sample(const float* logits, int64_t vocab) {
  const SampleSpec spec = NextSpec();
  const int64_t K = std::min(params_.top_logprobs, vocab);
  SampledToken out{0, 0, {}};
  std::vector<int32_t> top_ids(K);
  std::vector<float> top_lps(K);
  cpu::SampleRow(logits, vocab, spec, K, &out.id, &out.logprob, top_ids.data(), top_lps.data());
  for (int64_t j = 0; j < K; ++j) out.top.push_back({top_ids[j], top_lps[j]});
  return out;
}

}  // namespace shardserve
