#pragma once
// One rank of a sharded replica as a process (DESIGN.md §4-5). Ranks meet at the leader's
// rendezvous, build a shared-memory communicator for their stage's TP group and a TCP mesh over
// the world (pipeline links and control), load their shard and run one step loop:
//
//   the leader (rank 0) issues step descriptors (which sequences, which new tokens) to every rank;
//   a stage after the first receives hidden states from the same tp_rank of the previous stage,
//   runs its layers and sends them on; the last stage's tp_rank 0 samples and returns tokens and
//   logprobs to the leader. The leader cuts the running sequences into micro-batches and issues
//   them ahead, so every stage works at once.
//
// Any failure (a dead or frozen rank, a bad shape) ends RunRank with a status naming it; the
// process then exits non-zero and its launcher takes the stage down.
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "api/worker_env.h"
#include "comm/world.h"
#include "model/config.h"
#include "plan/layer_split.h"
#include "serve/engine.h"
#include "serve/step.h"

namespace prometheus {
class Registry;
}

namespace shardserve {

struct RankConfig {
  std::string model_path;
  int tp = 1;
  int pp = 1;
  int stage = 0;
  int tp_rank = 0;
  std::string leader_host = "127.0.0.1";
  int leader_port = 29500;         // rendezvous
  std::string job_id;              // names the shared-memory segments of this replica
  std::string host = "127.0.0.1";  // this rank's address as the others reach it
  // Where the rendezvous and the mesh listen: the pod's address (SHARDSERVE_POD_IP), loopback
  // when the rank is local, else "" (every address).
  std::string bind_host = "127.0.0.1";
  // The replica's secret, proven at the rendezvous and on every mesh connection
  // (SHARDSERVE_RENDEZVOUS_SECRET_FILE; required when the replica has more than one rank).
  std::string secret;
  std::string model_name = "model";  // the name served on the API
  // The `model` label of the metrics: the ShardedModel (SHARDSERVE_DEPLOYMENT), so the
  // operator's, the leader's and every rank's series of one deployment share it.
  std::string metrics_model = "model";
  int replica = 0;
  int metrics_port = -1;  // -1: no /metrics server
  int microbatches = 0;   // 0: pp
  int threads = 1;
  // SHARDSERVE_BACKEND: cpu, cuda, or auto (CUDA when this build has it and a GPU is visible).
  std::string backend = "auto";
  int64_t kv_cache_tokens = 8192;
  int64_t max_sequence_length = 0;  // 0: the model's context
  std::chrono::milliseconds peer_timeout{2000};
  std::chrono::milliseconds startup_timeout{120000};

  int rank() const { return stage * tp + tp_rank; }
};

// A rank's configuration from the worker contract (api/worker_env.h): its place in the
// replica, how to reach the others (the leader's rendezvous, this rank's address, the secret read
// from its file), where its /metrics listen. Errors name the variable.
absl::StatusOr<RankConfig> RankConfigFrom(const WorkerEnv& env);

struct RankOutcome {
  size_t resident_bytes = 0;      // this process at the end
  size_t shard_weight_bytes = 0;  // the weight slices it holds
  size_t stage_weight_bytes = 0;  // the full tensors of its stage
};

// What the leader drives once every rank is connected and loaded.
struct LeaderContext {
  StepExecutor* executor = nullptr;  // the replica; valid during the LeaderMain call
  const ModelConfig* config = nullptr;
  EngineOptions engine;  // the replica's cache, context, micro-batches and vocabulary filled in
  std::shared_ptr<prometheus::Registry> registry;  // the rank's /metrics; null when off
  // Adds a registry to the rank's /metrics page; null when off.
  std::function<void(std::shared_ptr<prometheus::Registry>)> expose;
};
// Runs on the leader; returning stops the replica (the executor's Stop or, on error, an abort
// that every rank reports).
using LeaderMain = std::function<absl::Status(LeaderContext&)>;

// The layers of each pipeline stage, as every rank computes them (weights by parameter count).
absl::StatusOr<std::vector<LayerRange>> StageLayers(const ModelConfig& config, int pp);

// Runs this rank (`world`: its place, made once per process from `config`): start-up, then
// `started` (every rank, once the replica is connected and loaded), then `lead` on the leader;
// the other ranks serve steps until the leader stops them.
absl::StatusOr<RankOutcome> RunRank(const RankConfig& config, const WorldConfig& world,
                                    const LeaderMain& lead,
                                    const std::function<void()>& started = nullptr);

// The leader could not start (`why`): every other rank of the replica that comes to the
// rendezvous within the start-up timeout (at most 30 s) is told so, rather than waiting for it.
void RefuseReplica(const RankConfig& config, const WorldConfig& world, const absl::Status& why);

// The shared memory of this rank's stage TP group.
std::string ShmGroupName(const RankConfig& config);

}  // namespace shardserve
