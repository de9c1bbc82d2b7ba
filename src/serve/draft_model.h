#pragma once
// Speculative decoding with a draft model (api/speculative.h's draft): a smaller model of the
// target's vocabulary (a quantized GGUF of the same model, a smaller sibling), whole on the
// replica's leader (on its CPU or its GPU, as the leader's stage), its own KV cache, greedy. Each
// Propose feeds every sequence what the draft has not read yet (its prompt at first; then the
// tokens the target kept, its last token), rewinding past drafted positions the target refused, and
// then drafts k tokens, one batched forward a token over all the sequences asked.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/config.h"
#include "model/kv_cache.h"
#include "model/transformer.h"
#include "serve/speculative.h"

namespace shardserve {

class ModelDrafter : public Drafter {
 public:
  // The draft in `path` (a model directory or GGUF file) on `backend` (the replica leader's kind:
  // serve/stage_backend.h's DraftBackend; null: the CPU's, one thread) with a KV cache of
  // `kv_tokens` positions. A sequence's unread tokens are read at most
  // `max_read` a Propose (the replica's max_step_tokens: a long prompt does not stall the
  // scheduler in one forward); it is drafted for once the draft has read it all. Refused, naming
  // the draft: a model that cannot load, or whose vocabulary is larger than the target's (its
  // ids would not be the target's).
  static absl::StatusOr<std::unique_ptr<ModelDrafter>> Load(const std::string& path,
                                                            const ModelConfig& target,
                                                            std::unique_ptr<Backend> backend,
                                                            int64_t kv_tokens, int64_t max_read);
  std::vector<std::vector<int32_t>> Propose(const std::vector<Query>& queries) override;
  void Forget(int64_t seq) override;

 private:
  struct Seq {
    SequenceKv kv;
    std::vector<int32_t> fed;  // the tokens at the cache's positions, in order
  };
  ModelDrafter(std::unique_ptr<Transformer> model, std::unique_ptr<KvCache> cache, int64_t max_read)
      : model_(std::move(model)), cache_(std::move(cache)), max_read_(max_read) {}
  absl::StatusOr<std::vector<std::vector<int32_t>>> Draft(const std::vector<Query>& queries);

  std::unique_ptr<Transformer> model_;
  std::unique_ptr<KvCache> cache_;
  int64_t max_read_;
  std::map<int64_t, Seq> seqs_;
  bool warned_ = false;
};

}  // namespace shardserve
