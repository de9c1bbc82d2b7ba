#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"

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

double Sampler::Uniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

SampledToken Sampler::Sample(const float* logits, int64_t vocab) {
  // Log-softmax of the raw logits (the model's distribution, independent of temperature).
  float mx = *std::max_element(logits, logits + vocab);
  double sum = 0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i] - mx));
  const float log_z = mx + static_cast<float>(std::log(sum));
  auto logprob = [&](int64_t i) { return logits[i] - log_z; };

  int32_t chosen;
  if (params_.temperature == 0.0f) {
    chosen = static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  } else {
    std::vector<int32_t> ids(vocab);
    std::iota(ids.begin(), ids.end(), 0);
    auto by_logit = [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    };
    int64_t keep = vocab;
    if (params_.top_k > 0 && params_.top_k < vocab) {
      keep = params_.top_k;
      std::partial_sort(ids.begin(), ids.begin() + keep, ids.end(), by_logit);
    } else {
      std::sort(ids.begin(), ids.end(), by_logit);
    }
    const double inv_t = 1.0 / params_.temperature;
    std::vector<double> p(keep);
    double total = 0;
    for (int64_t i = 0; i < keep; ++i) {
      p[i] = std::exp((static_cast<double>(logits[ids[i]]) - logits[ids[0]]) * inv_t);
      total += p[i];
    }
    if (params_.top_p < 1.0f) {
      double cum = 0;
      int64_t n = 0;
      while (n < keep) {
        cum += p[n] / total;
        ++n;
        if (cum >= params_.top_p) break;
      }
      keep = n;
      total = std::accumulate(p.begin(), p.begin() + keep, 0.0);
    }
    const double u = Uniform() * total;
    double cum = 0;
    chosen = ids[keep - 1];
    for (int64_t i = 0; i < keep; ++i) {
      cum += p[i];
      if (u < cum) {
        chosen = ids[i];
        break;
      }
    }
  }
  SampledToken out{chosen, logprob(chosen), {}};
  if (params_.top_logprobs > 0) {
    const int64_t k = std::min<int64_t>(params_.top_logprobs, vocab);
    std::vector<int32_t> ids(vocab);
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    for (int64_t i = 0; i < k; ++i) out.top.push_back({ids[i], logprob(ids[i])});
  }
  return out;
}

}  // namespace shardserve
