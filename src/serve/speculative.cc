#include "serve/speculative.h"

#include <algorithm>

namespace shardserve {

std::vector<int32_t> NgramDrafts(absl::Span<const int32_t> prompt, absl::Span<const int32_t> output,
                                 const SpeculativeConfig& config, int64_t k) {
  std::vector<int32_t> drafts;
  const int64_t p = static_cast<int64_t>(prompt.size());
  const int64_t length = p + static_cast<int64_t>(output.size());
  auto token = [&](int64_t i) { return i < p ? prompt[i] : output[i - p]; };
  if (k <= 0) return drafts;
  for (int64_t n = std::min(config.ngram_max, length - 1);
       n >= std::max<int64_t>(1, config.ngram_min); --n) {
    std::vector<int32_t> suffix(n);
    for (int64_t i = 0; i < n; ++i) suffix[i] = token(length - n + i);
    // Latest start first; the occurrence ends before the sequence does, so a token follows it.
    for (int64_t start = length - n - 1; start >= 0; --start) {
      int64_t i = 0;
      while (i < n && token(start + i) == suffix[i]) ++i;
      if (i < n) continue;
      for (int64_t j = start + n; j < length && static_cast<int64_t>(drafts.size()) < k; ++j) {
        drafts.push_back(token(j));
      }
      return drafts;
    }
  }
  return drafts;
}

std::vector<std::vector<int32_t>> NgramDrafter::Propose(const std::vector<Query>& queries) {
  std::vector<std::vector<int32_t>> out;
  out.reserve(queries.size());
  for (const Query& q : queries) out.push_back(NgramDrafts(q.prompt, q.output, config_, q.k));
  return out;
}

std::vector<std::vector<int32_t>> MtpDrafter::Propose(const std::vector<Query>& queries) {
  std::vector<std::vector<int32_t>> out(queries.size());
  for (size_t i = 0; i < queries.size(); ++i) {
    const Query& q = queries[i];
    auto it = drafts_.find(q.seq);
    if (it == drafts_.end() || q.k < 1) continue;
    if (it->second.first == static_cast<int64_t>(q.prompt.size() + q.output.size())) {
      out[i].push_back(it->second.second);
    }
  }
  return out;
}

}  // namespace shardserve
