#include "model/vocab_parallel.h"

#include <algorithm>
#include <cmath>

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

absl::StatusOr<std::vector<SampledToken>> GreedyFromSummaries(const std::vector<float>& mine,
                                                              int64_t S, int64_t top_logprobs,
                                                              Communicator* comm) {
  const int64_t K = SummaryCandidates(top_logprobs), width = SummaryWidth(top_logprobs);
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
    float gmax = -INFINITY;
    for (int r = 0; r < T; ++r) gmax = std::max(gmax, all[(r * S + s) * width]);
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
    out[s].id = static_cast<int32_t>(cand[0].second);
    out[s].logprob = cand[0].first - log_z;
    for (int64_t j = 0; j < std::min<int64_t>(top_logprobs, cand.size()); ++j) {
      out[s].top.push_back({static_cast<int32_t>(cand[j].second), cand[j].first - log_z});
    }
  }
  return out;
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
