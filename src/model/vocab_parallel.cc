#include "model/vocab_parallel.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "backend/cpu/kernels.h"
#include "common/status.h"

namespace shardserve {

std::vector<float> VocabSummaries(const float* local, int64_t S, int64_t ld, int64_t vocab_begin,
                                  int64_t vocab_end, int64_t top_logprobs) {
  const int64_t K = SummaryCandidates(top_logprobs), width = SummaryWidth(top_logprobs);
  std::vector<float> mine(S * width);
  for (int64_t s = 0; s < S; ++s) {
    cpu::VocabSummary(local + s * ld, vocab_end - vocab_begin, vocab_begin, K,
                      mine.data() + s * width);
  }
  return mine;
}

namespace {

// Every rank's records (a summary, then `targets` ? its logit of the row's target : nothing) to
// each row's greedy token, or its target, with the log-probability and the alternatives.
absl::StatusOr<std::vector<SampledToken>> Merge(const std::vector<float>& mine, int64_t S,
                                                int64_t top_logprobs, Communicator* comm,
                                                const std::vector<int32_t>* targets) {
  const int64_t K = SummaryCandidates(top_logprobs);
  const int64_t width = SummaryWidth(top_logprobs) + (targets != nullptr ? 1 : 0);
  const int T = comm == nullptr ? 1 : comm->size();
  std::vector<float> all;
  if (comm == nullptr) {
    all = mine;
  } else {
    all.resize(T * S * width);
    RETURN_IF_ERROR(comm->AllGather(mine.data(), mine.size(), all.data()));
  }
  std::vector<SampledToken> out(S);
  for (int64_t s = 0; s < S; ++s) {
    float gmax = -INFINITY, target = -INFINITY;
    for (int r = 0; r < T; ++r) {
      const float* rec = all.data() + (r * S + s) * width;
      gmax = std::max(gmax, rec[0]);
      if (targets != nullptr) target = std::max(target, rec[width - 1]);
    }
    double z = 0;
    std::vector<std::pair<float, int64_t>> cand;
    for (int r = 0; r < T; ++r) {
      const float* rec = all.data() + (r * S + s) * width;
      if (rec[0] == -INFINITY) continue;  // an empty slice
      z += static_cast<double>(rec[1]) * std::exp(static_cast<double>(rec[0] - gmax));
      for (int64_t j = 0; j < K; ++j) {
        if (rec[2 + 2 * j] == -INFINITY) break;
        cand.push_back({rec[2 + 2 * j], static_cast<int64_t>(rec[3 + 2 * j])});
      }
    }
    if (cand.empty()) return absl::InternalError("no vocabulary slice holds a logit");
    std::sort(cand.begin(), cand.end(), [&](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);  // ties: lower id
    });
    const float log_z = gmax + static_cast<float>(std::log(z));
    if (targets != nullptr) {
      out[s].id = (*targets)[s];
      out[s].logprob = target - log_z;
    } else {
      out[s].id = static_cast<int32_t>(cand[0].second);
      out[s].logprob = cand[0].first - log_z;
    }
    for (int64_t j = 0; j < std::min<int64_t>(top_logprobs, cand.size()); ++j) {
      out[s].top.push_back({static_cast<int32_t>(cand[j].second), cand[j].first - log_z});
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<SampledToken>> GreedyFromSummaries(const std::vector<float>& mine,
                                                              int64_t S, int64_t top_logprobs,
                                                              Communicator* comm) {
  return Merge(mine, S, top_logprobs, comm, nullptr);
}

absl::StatusOr<std::vector<SampledToken>> ScoreFromSummaries(
    const std::vector<float>& mine, const std::vector<float>& target_logits,
    const std::vector<int32_t>& targets, int64_t top_logprobs, Communicator* comm) {
  const int64_t S = static_cast<int64_t>(targets.size()), width = SummaryWidth(top_logprobs);
  if (static_cast<int64_t>(mine.size()) != S * width || target_logits.size() != targets.size()) {
    return absl::InternalError(absl::StrCat(mine.size(), " summary floats and ",
                                            target_logits.size(), " target logits for ", S,
                                            " scored rows"));
  }
  std::vector<float> records(S * (width + 1));
  for (int64_t s = 0; s < S; ++s) {
    std::copy_n(mine.data() + s * width, width, records.data() + s * (width + 1));
    records[s * (width + 1) + width] = target_logits[s];
  }
  return Merge(records, S, top_logprobs, comm, &targets);
}

absl::StatusOr<std::vector<SampledToken>> GreedyFromVocabSlices(const float* local, int64_t S,
                                                                int64_t ld, int64_t vocab_begin,
                                                                int64_t vocab_end,
                                                                int64_t top_logprobs,
                                                                Communicator* comm) {
  return GreedyFromSummaries(VocabSummaries(local, S, ld, vocab_begin, vocab_end, top_logprobs), S,
                             top_logprobs, comm);
}

}  // namespace shardserve
