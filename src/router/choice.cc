#include "router/choice.h"

#include <algorithm>

namespace shardserve {

const char* ChoiceReasonName(ChoiceReason r) {
  switch (r) {
    case ChoiceReason::kPrefix:
      return "prefix";
    case ChoiceReason::kLoad:
      return "load";
    case ChoiceReason::kNoPrefix:
      return "no_prefix";
    case ChoiceReason::kNoPrompt:
      return "no_prompt";
    case ChoiceReason::kNoState:
      return "no_state";
    case ChoiceReason::kAdapter:
      return "adapter";
  }
  return "unknown";
}

Ranking RankReplicas(const std::vector<Candidate>& c, int64_t prompt_blocks, const ChoiceWeights& w,
                     uint64_t turn) {
  Ranking out;
  const int n = static_cast<int>(c.size());
  if (n == 0) return out;
  std::vector<double> score(n, 0.0);
  int64_t best_match = 0;
  bool any_routable = false;
  for (int i = 0; i < n; ++i) {
    if (!c[i].routable) continue;
    any_routable = true;
    const double requests =
        static_cast<double>(std::max(c[i].running + c[i].waiting, c[i].in_flight));
    const double load =
        std::min(2.0, requests / static_cast<double>(std::max<int64_t>(1, c[i].max_batch)));
    const double hit = prompt_blocks > 0 ? static_cast<double>(c[i].matched_blocks) /
                                               static_cast<double>(prompt_blocks)
                                         : 0.0;
    const double adapter = c[i].adapter_loaded ? 1.0 : c[i].adapter_room ? 0.5 : 0.0;
    score[i] = w.prefix * hit - w.load * load - w.kv * c[i].kv_usage + w.adapter * adapter;
    best_match = std::max(best_match, c[i].matched_blocks);
  }
  out.order.resize(n);
  for (int i = 0; i < n; ++i) out.order[i] = static_cast<int>((i + turn) % n);  // ties in turn
  std::stable_sort(out.order.begin(), out.order.end(), [&](int a, int b) {
    if (c[a].routable != c[b].routable) return c[a].routable;
    if (score[a] != score[b]) return score[a] > score[b];
    return c[a].in_flight < c[b].in_flight;
  });
  const Candidate& first = c[out.order[0]];
  if (!any_routable) {
    out.reason = ChoiceReason::kNoState;
  } else if (prompt_blocks < 0) {
    out.reason = ChoiceReason::kNoPrompt;
  } else if (best_match == 0) {
    out.reason = first.adapter_loaded ? ChoiceReason::kAdapter : ChoiceReason::kNoPrefix;
  } else {
    out.reason = first.matched_blocks == best_match ? ChoiceReason::kPrefix : ChoiceReason::kLoad;
  }
  if (prompt_blocks > 0 && first.routable) {
    out.expected_hit =
        static_cast<double>(first.matched_blocks) / static_cast<double>(prompt_blocks);
  }
  return out;
}

}  // namespace shardserve
