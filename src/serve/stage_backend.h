#pragma once
// A rank's backend (DESIGN.md §5): the stage of the model it runs and, on GPUs, the NCCL
// communicators between its GPU and its peers'. The one place that knows which backends this
// build has; the rank runtime drives only StageBackend and StageModel.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "comm/rendezvous.h"
#include "comm/world.h"
#include "model/generator.h"
#include "model/kv_cache.h"
#include "model/sampler.h"
#include "model/transformer.h"

namespace shardserve {

struct RankConfig;

// The transfers of hidden states between this rank and its counterparts (same tp_rank) in the
// neighbouring stages: over the host mesh, or over a two-member NCCL link (the earlier stage is
// member 0), device to device.
struct StageLinks {
  Communicator* mesh = nullptr;
  std::optional<int> prev, next;  // world ranks, on the mesh
  Communicator* device_prev = nullptr;
  Communicator* device_next = nullptr;
};

// One rank's share of the model on its backend, as the runtime drives it: a step is Receive (a
// stage after the first), Forward, then Pass (a stage before the last) or a token choice (the
// last stage, every TP rank).
class StageModel {
 public:
  virtual ~StageModel() = default;
  virtual const ModelConfig& config() const = 0;
  virtual absl::Status Receive(int64_t rows, const StageLinks& links) = 0;
  virtual absl::Status Forward(std::vector<SequenceChunk>& chunks, KvCache& cache) = 0;
  virtual absl::Status Pass(const StageLinks& links) = 0;
  // Each sequence's greedy token with top_logprobs alternatives, from the vocab slices.
  virtual absl::StatusOr<std::vector<SampledToken>> Greedy(int64_t top_logprobs,
                                                           Communicator* tp_group) = 0;
  // Each sequence's token from its generator (samplers[s]; null: not sampled now) on the rank
  // that holds them; the others pass an empty vector but take part in gathering the logits.
  virtual absl::StatusOr<std::vector<SampledToken>> Sample(const std::vector<Sampler*>& samplers,
                                                           int64_t top_logprobs,
                                                           Communicator* tp_group) = 0;
  virtual bool first_stage() const = 0;
  virtual bool last_stage() const = 0;
  virtual size_t shard_weight_bytes() const = 0;
  virtual size_t stage_weight_bytes() const = 0;
};

class StageBackend {
 public:
  using Observer = std::function<void(const char* op, double seconds, size_t bytes)>;

  // SHARDSERVE_BACKEND (config.backend): cpu, cuda, or auto (CUDA when this build has it and a
  // GPU is visible). cuda without a build or a GPU is FailedPrecondition; anything else is
  // InvalidArgument.
  static absl::StatusOr<std::unique_ptr<StageBackend>> Choose(const RankConfig& config,
                                                              const WorldConfig& world);
  virtual ~StageBackend() = default;

  // What the leader hands every rank at the rendezvous, from all their addresses (on GPUs the
  // NCCL ids); none on the CPU.
  virtual absl::StatusOr<std::vector<std::string>> Blobs(
      const std::vector<RankAddress>& ranks) const = 0;
  // Joins what the blobs name, then loads this rank's stage (o: its layers, TP rank and host TP
  // group) and a KV cache for it. `observe` times the backend's communicators.
  virtual absl::StatusOr<std::unique_ptr<StageModel>> Load(const WorldInfo& info,
                                                           Transformer::Options o,
                                                           const Observer& observe,
                                                           std::unique_ptr<KvCache>& cache) = 0;
  // Device links to the neighbouring stages; null where hidden states go over the host mesh.
  virtual Communicator* device_prev() const { return nullptr; }
  virtual Communicator* device_next() const { return nullptr; }
  // Tells the peers on the backend's own communicators why this rank stops.
  virtual void Abort(const absl::Status& cause) { (void)cause; }
};

}  // namespace shardserve
