#include "model/sampler.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>

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
  if (!(repetition_penalty > 0.0f) || !std::isfinite(repetition_penalty)) {
    return absl::InvalidArgumentError(
        absl::StrCat("repetition_penalty must be a finite number > 0, got ", repetition_penalty));
  }
  if (!std::isfinite(frequency_penalty) || !std::isfinite(presence_penalty)) {
    return absl::InvalidArgumentError("frequency_penalty and presence_penalty must be finite");
  }
  for (const auto& [id, bias] : logit_bias) {
    if (id < 0 || !std::isfinite(bias)) {
      return absl::InvalidArgumentError(
          absl::StrCat("logit_bias needs token ids >= 0 and finite biases, got ", id, ": ", bias));
    }
  }
  if (min_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("min_tokens must be >= 0, got ", min_tokens));
  }
  return absl::OkStatus();
}

void SamplingParams::SetEndIds(const std::vector<int64_t>& eos) {
  end_ids.clear();
  if (min_tokens == 0) return;
  end_ids = stop_token_ids;
  if (!ignore_eos) end_ids.insert(end_ids.end(), eos.begin(), eos.end());
}

void Sampler::Observe(const int32_t* tokens, int64_t n) {
  if (!params_.ProcessesLogits()) return;  // no history needed: nothing kept on the hot path
  for (int64_t i = 0; i < n; ++i, ++read_) {
    if (read_ < prompt_) {
      if (params_.repetition_penalty != 1.0f) prompt_ids_.insert(tokens[i]);
    } else {
      ++generated_;
      ++output_counts_[tokens[i]];
    }
  }
}

void Sampler::Process(float* logits, int64_t vocab) const {
  const SamplingParams& p = params_;
  for (const auto& [id, bias] : p.logit_bias) {
    if (id < vocab) logits[id] += bias;
  }
  if (generated_ < p.min_tokens) {
    for (int64_t id : p.end_ids) {
      if (id >= 0 && id < vocab) logits[id] = -std::numeric_limits<float>::infinity();
    }
  }
  auto repeat = [&](int32_t id) {
    float& l = logits[id];
    l = l > 0 ? l / p.repetition_penalty : l * p.repetition_penalty;
  };
  if (p.repetition_penalty != 1.0f) {
    for (int32_t id : prompt_ids_) {
      if (id < vocab && !output_counts_.count(id)) repeat(id);
    }
  }
  for (const auto& [id, count] : output_counts_) {
    if (id >= vocab) continue;
    if (p.repetition_penalty != 1.0f) repeat(id);
    logits[id] -= p.frequency_penalty * static_cast<float>(count) + p.presence_penalty;
  }
  if (!allowed_.empty()) {
    const int64_t covered = static_cast<int64_t>(allowed_.size()) * 32;
    for (int64_t id = 0; id < vocab; ++id) {
      if (id >= covered || !(allowed_[id / 32] >> (id % 32) & 1u)) {
        logits[id] = -std::numeric_limits<float>::infinity();
      }
    }
  }
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
  // The model's own log-probabilities: of its greedy token (log-sum-exp from it) and its top K.
  int32_t best;
  float best_lp;
  const bool processed = ProcessesLogits();
  cpu::SampleRow(logits, vocab, processed ? SampleSpec{} : spec, K, &best, &best_lp, top_ids.data(),
                 top_lps.data());
  for (int64_t j = 0; j < K; ++j) out.top.push_back({top_ids[j], top_lps[j]});
  if (!processed) {
    out.id = best;
    out.logprob = best_lp;
    return out;
  }
  std::vector<float> row(logits, logits + vocab);
  Process(row.data(), vocab);
  allowed_.clear();
  float unused;
  cpu::SampleRow(row.data(), vocab, spec, 0, &out.id, &unused, nullptr, nullptr);
  out.logprob = logits[out.id] - (logits[best] - best_lp);
  return out;
}

std::vector<SampledToken> Sampler::Verify(const float* rows, int64_t vocab,
                                          const std::vector<int32_t>& drafts,
                                          const std::vector<std::vector<uint32_t>>& masks) {
  const int64_t k = static_cast<int64_t>(drafts.size());
  const int64_t K = std::min(params_.top_logprobs, vocab);
  std::vector<SampledToken> out;
  std::vector<int32_t> top_ids(K);
  std::vector<float> top_lps(K), row;
  for (int64_t i = 0; i <= k; ++i) {
    const float* raw = rows + i * vocab;
    int32_t best;
    float best_lp;
    cpu::SampleRow(raw, vocab, SampleSpec{}, K, &best, &best_lp, top_ids.data(), top_lps.data());
    const float log_z = raw[best] - best_lp;
    allowed_ = static_cast<size_t>(i) < masks.size() ? masks[i] : std::vector<uint32_t>();
    const float* choice = raw;
    if (ProcessesLogits()) {
      row.assign(raw, raw + vocab);
      Process(row.data(), vocab);
      choice = row.data();
    }
    allowed_.clear();
    const int32_t draft = i < k ? drafts[i] : -1;
    int32_t token = draft;
    if (params_.temperature == 0.0f) {
      const auto argmax = static_cast<int32_t>(std::max_element(choice, choice + vocab) - choice);
      token = argmax;
    } else {
      const SampleSpec spec = NextSpec();
      const cpu::Distribution d = cpu::DistributionOf(choice, vocab, spec);
      double w_draft = 0;
      for (size_t j = 0; j < d.ids.size(); ++j) {
        if (d.ids[j] == draft) w_draft = d.weights[j];
      }
      const double p_draft = w_draft / d.total;
      if (draft < 0 || spec.u >= p_draft) {
        // Refused (or the last row): the draw, rescaled onto what refusal leaves, chooses among
        // the other ids by their weights.
        const double u = draft < 0 ? spec.u : (spec.u - p_draft) / (1.0 - p_draft);
        const double target = u * (d.total - w_draft);
        double cum = 0;
        token = -1;
        for (size_t j = 0; j < d.ids.size(); ++j) {
          if (d.ids[j] == draft) continue;
          token = d.ids[j];  // the last other id where rounding leaves the sum short
          cum += d.weights[j];
          if (target < cum) break;
        }
        if (token < 0) token = draft;  // the draft is the only id kept: it cannot be refused
      }
    }
    SampledToken t{token, raw[token] - log_z, {}};
    for (int64_t j = 0; j < K; ++j) t.top.push_back({top_ids[j], top_lps[j]});
    out.push_back(std::move(t));
    if (token != draft) break;
    Observe(&token, 1);
  }
  return out;
}

}  // namespace shardserve
