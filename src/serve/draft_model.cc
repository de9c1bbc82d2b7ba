#include "serve/draft_model.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"

namespace shardserve {

absl::StatusOr<std::unique_ptr<ModelDrafter>> ModelDrafter::Load(const std::string& path,
                                                                 const ModelConfig& target,
                                                                 std::unique_ptr<Backend> backend,
                                                                 int64_t kv_tokens,
                                                                 int64_t max_read) {
  auto model = Transformer::Load(path, {}, std::move(backend));
  if (!model.ok()) {
    return absl::Status(model.status().code(),
                        absl::StrCat("the draft model: ", model.status().message()));
  }
  if ((*model)->config().vocab_size > target.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("the draft model ", path, " has a vocabulary of ",
                     (*model)->config().vocab_size, " ids, more than the model's ",
                     target.vocab_size, ": it must share the model's vocabulary"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache, (*model)->NewKvCache(kv_tokens));
  return std::unique_ptr<ModelDrafter>(
      new ModelDrafter(*std::move(model), std::move(cache), std::max<int64_t>(1, max_read)));
}

void ModelDrafter::Forget(int64_t seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  cache_->Release(it->second.kv);
  seqs_.erase(it);
}

std::vector<std::vector<int32_t>> ModelDrafter::Propose(const std::vector<Query>& queries) {
  absl::StatusOr<std::vector<std::vector<int32_t>>> drafts = Draft(queries);
  if (drafts.ok()) return *std::move(drafts);
  // Not the request's failure: its sequences decode without drafts (and the draft starts over).
  if (!std::exchange(warned_, true)) {
    LogWarning("the draft model drafts nothing: ", drafts.status().message());
  }
  for (const Query& q : queries) Forget(q.seq);
  return std::vector<std::vector<int32_t>>(queries.size());
}

absl::StatusOr<std::vector<std::vector<int32_t>>> ModelDrafter::Draft(
    const std::vector<Query>& queries) {
  const int64_t context = model_->config().max_context;
  std::vector<std::vector<int32_t>> out(queries.size());
  std::vector<size_t> active;  // queries still drafting
  std::vector<SequenceChunk> chunks;
  std::vector<SequenceChunk> reading;  // sequences read this call, not yet drafted for
  for (size_t i = 0; i < queries.size(); ++i) {
    const Query& q = queries[i];
    const int64_t p = static_cast<int64_t>(q.prompt.size());
    const int64_t total = p + static_cast<int64_t>(q.output.size());
    auto token = [&](int64_t j) { return j < p ? q.prompt[j] : q.output[j - p]; };
    if (q.k <= 0 || total == 0 || total + q.k > context) continue;
    Seq& s = seqs_[q.seq];
    // What the draft read and the sequence agree on (drafts the target refused end it); at least
    // the last token is fed again, whose logits draft the first token.
    int64_t same = 0;
    const int64_t fed = static_cast<int64_t>(s.fed.size());
    while (same < fed && same < total - 1 && s.fed[same] == token(same)) ++same;
    s.fed.resize(same);
    s.kv.length = same;
    SequenceChunk ch;
    const bool whole = total - same <= max_read_;
    for (int64_t j = same; j < (whole ? total : same + max_read_); ++j) {
      ch.tokens.push_back(token(j));
    }
    // An id past the draft's vocabulary (the model's is larger): this sequence is not drafted.
    if (std::any_of(ch.tokens.begin(), ch.tokens.end(),
                    [&](int32_t t) { return t >= model_->config().vocab_size; })) {
      Forget(q.seq);
      continue;
    }
    s.fed.insert(s.fed.end(), ch.tokens.begin(), ch.tokens.end());
    ch.kv = &s.kv;
    if (!whole) {
      reading.push_back(std::move(ch));
      continue;
    }
    chunks.push_back(std::move(ch));
    active.push_back(i);
  }
  if (!reading.empty()) RETURN_IF_ERROR(model_->Run(reading, *cache_));
  while (!active.empty()) {
    RETURN_IF_ERROR(model_->Run(chunks, *cache_));
    ASSIGN_OR_RETURN(std::vector<SampledToken> best, model_->Greedy(0, nullptr));
    std::vector<size_t> next;
    std::vector<SequenceChunk> next_chunks;
    for (size_t a = 0; a < active.size(); ++a) {
      const Query& q = queries[active[a]];
      std::vector<int32_t>& d = out[active[a]];
      d.push_back(best[a].id);
      if (static_cast<int64_t>(d.size()) == q.k) continue;
      // The draft feeds its token to draft the next (its position then holds it).
      Seq& s = seqs_[q.seq];
      s.fed.push_back(best[a].id);
      next_chunks.push_back({{best[a].id}, &s.kv});
      next.push_back(active[a]);
    }
    active = std::move(next);
    chunks = std::move(next_chunks);
  }
  return out;
}

}  // namespace shardserve
