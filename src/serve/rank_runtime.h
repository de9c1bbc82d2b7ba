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
#include "serve/kv_layout.h"
#include "serve/step.h"

namespace prometheus {
class Collectable;
class Registry;
}  // namespace prometheus

namespace shardserve {

// A rank's configuration: the worker contract as its launcher handed it (api/worker_env.h owns
// every setting, its default and its bounds), and what the rank derives from it.
struct RankConfig {
  WorkerEnv env;
  // The leader's rendezvous, from env.leader_addr (loopback on the default port when unset).
  std::string leader_host = "127.0.0.1";
  int leader_port = kRendezvousPort;
  std::string host = "127.0.0.1";  // this rank's address as the others reach it
  // Where the rendezvous and the mesh listen: the pod's address (env.pod_ip), loopback when the
  // rank is local, else "" (every address).
  std::string bind_host = "127.0.0.1";
  // The replica's secret, read from env.rendezvous_secret_file and proven at the rendezvous and
  // on every mesh connection (required when the replica has more than one rank).
  std::string secret;
  std::string job_id;     // names the shared-memory segments of this replica
  int metrics_port = -1;  // -1: no /metrics server

  int rank() const { return env.rank(); }
  std::chrono::milliseconds peer_timeout() const {
    return std::chrono::milliseconds(env.peer_timeout_ms);
  }
  std::chrono::milliseconds startup_timeout() const {
    return std::chrono::milliseconds(env.startup_timeout_ms);
  }
  // Every rank of the replica runs on this machine (`shardserve local`, `shardserve generate`).
  bool local() const { return host == "127.0.0.1"; }
};

// A rank's configuration from the worker contract: how to reach the others (the leader's
// rendezvous, this rank's address, the secret read from its file), where its /metrics listen.
// Errors name the variable.
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
  // The replica's batch, queue, cache, context, micro-batches and vocabulary filled in.
  EngineOptions engine;
  std::shared_ptr<prometheus::Registry> registry;  // the rank's /metrics; null when off
  // Adds a registry to the rank's /metrics page; null when off.
  std::function<void(std::shared_ptr<prometheus::Collectable>)> expose;
  // How the replica holds the KV, and (a prefill replica) its ranks' exporter addresses and where
  // the leader hears that a decode replica is done with an offer (set while an engine runs,
  // reset to null before it goes; called on the exporter's thread).
  KvRoleShape kv_shape;
  std::vector<std::string> kv_addresses;
  std::function<void(std::function<void(const KvTicket&)>)> on_kv_release;
};
// Runs on the leader; returning stops the replica (the executor's Stop or, on error, an abort
// that every rank reports).
using LeaderMain = std::function<absl::Status(LeaderContext&)>;

// This rank's stage's layers: from the contract's SHARDSERVE_STAGE_LAYERS (the launcher's plan),
// checked against the model; without it (a worker started by hand), the plan itself.
absl::StatusOr<LayerRange> StageLayersOf(const WorkerEnv& env, const ModelConfig& config);

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
