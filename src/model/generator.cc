#include "model/generator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardserve {

absl::StatusOr<std::vector<GenerationResult>> Generate(
    Transformer& model, const std::vector<GenerationRequest>& requests) {
  const ModelConfig& c = model.config();
  int64_t positions = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const GenerationRequest& r = requests[i];
    absl::Status s = r.params.Validate();
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("request ", i, ": ", s.message()));
    if (r.prompt_ids.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("request ", i, ": the prompt is empty"));
    }
    const int64_t need = static_cast<int64_t>(r.prompt_ids.size()) + r.params.max_tokens;
    if (static_cast<int64_t>(r.prompt_ids.size()) >= c.max_context) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", i, ": prompt of ", r.prompt_ids.size(),
                       " tokens leaves no room in the context of ", c.max_context));
    }
    positions += std::min(need, c.max_context);
  }
  const int64_t block = 16;
  ASSIGN_OR_RETURN(
      auto cache,
      model.NewKvCache(positions + block * static_cast<int64_t>(requests.size()), block));

  const size_t n = requests.size();
  std::vector<GenerationResult> results(n);
  std::vector<SequenceKv> kv(n);
  std::vector<Sampler> samplers;
  for (const auto& r : requests) {
    SamplingParams p = r.params;
    p.SetEndIds(c.eos_token_ids);
    samplers.emplace_back(p, static_cast<int64_t>(r.prompt_ids.size()));
  }
  std::vector<int32_t> next(n);
  std::vector<size_t> active;

  auto accept = [&](size_t i, const float* logits) {
    const GenerationRequest& r = requests[i];
    SampledToken t = samplers[i].Sample(logits, c.vocab_size);
    GenerationResult& res = results[i];
    res.tokens.push_back(t.id);
    res.logprobs.push_back(t.logprob);
    if (r.params.top_logprobs > 0) res.top_logprobs.push_back(std::move(t.top));
    next[i] = t.id;
    const auto& stops = r.params.stop_token_ids;
    const bool stop =
        std::find(stops.begin(), stops.end(), t.id) != stops.end() ||
        (!r.params.ignore_eos &&
         std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), t.id) != c.eos_token_ids.end());
    if (stop) {
      res.finish_reason = "stop";
    } else if (static_cast<int64_t>(res.tokens.size()) >= r.params.max_tokens ||
               kv[i].length >= c.max_context) {  // no position left for the next token
      res.finish_reason = "length";
    }
    return res.finish_reason.empty();
  };

  std::vector<SequenceChunk> chunks(n);
  for (size_t i = 0; i < n; ++i) {
    chunks[i].tokens = requests[i].prompt_ids;
    chunks[i].kv = &kv[i];
    samplers[i].Observe(chunks[i].tokens.data(), static_cast<int64_t>(chunks[i].tokens.size()));
  }
  std::vector<float> logits;
  if (n > 0) RETURN_IF_ERROR(model.Forward(chunks, *cache, logits));
  for (size_t i = 0; i < n; ++i) {
    if (accept(i, logits.data() + i * c.vocab_size)) active.push_back(i);
  }
  while (!active.empty()) {
    chunks.resize(active.size());
    for (size_t j = 0; j < active.size(); ++j) {
      chunks[j].tokens.assign(1, next[active[j]]);
      chunks[j].kv = &kv[active[j]];
      samplers[active[j]].Observe(&next[active[j]], 1);
    }
    RETURN_IF_ERROR(model.Forward(chunks, *cache, logits));
    std::vector<size_t> still;
    for (size_t j = 0; j < active.size(); ++j) {
      if (accept(active[j], logits.data() + j * c.vocab_size)) still.push_back(active[j]);
    }
    active.swap(still);
  }
  return results;
}

}  // namespace shardserve
