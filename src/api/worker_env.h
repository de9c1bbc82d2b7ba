#pragma once
// The worker contract (DESIGN.md §4) in one place: every SHARDSERVE_* variable that tells a
// worker process which replica, stage and rank it is and how to reach the others, the ports and
// the pod labels. The operator (operator/builders.cc), `shardserve local` and `shardserve
// generate` write it with ToEnv(); the worker's launcher, its ranks and the leader's API read it
// with FromEnv(). Tunables that are not the contract (queue and HTTP limits) are read where they
// are used, with the same EnvInt.
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve {

// Ports: the rendezvous on every pod, the API on the leader (the spec's default), and the
// metrics of tp_rank t on kMetricsPortBase + t.
inline constexpr int kRendezvousPort = 29500;
inline constexpr int kDefaultApiPort = 8000;
inline constexpr int kMetricsPortBase = 9400;

// The labels of a replica's pods.
inline constexpr char kModelLabel[] = "shardserve.io/model";
inline constexpr char kReplicaLabel[] = "shardserve.io/replica";
inline constexpr char kStageLabel[] = "shardserve.io/stage";
inline constexpr char kRevisionLabel[] = "shardserve.io/revision";
inline constexpr char kRoleLabel[] = "shardserve.io/role";

// The one variable the launcher adds for each rank it starts.
inline constexpr char kTpRankEnv[] = "SHARDSERVE_TP_RANK";
// Where the rendezvous and the mesh listen: the operator sets it from the downward API
// (status.podIP), which ToEnv cannot write.
inline constexpr char kPodIpEnv[] = "SHARDSERVE_POD_IP";
// Where the first fatal error goes (read even when the rest of the contract is malformed).
inline constexpr char kTerminationLogEnv[] = "SHARDSERVE_TERMINATION_LOG";

// Reads an environment variable (std::getenv, or a map in tests); null when unset.
using EnvLookup = std::function<const char*(const char*)>;
const char* ProcessEnv(const char* name);

// An integer variable: `def` when unset or empty; otherwise it must lie in [min, max], or the
// error names the variable and its value.
absl::StatusOr<int64_t> EnvInt(const EnvLookup& env, const char* name, int64_t def, int64_t min,
                               int64_t max);

struct WorkerEnv {
  // The model and the replica.
  std::string model_path;            // SHARDSERVE_MODEL_PATH (required)
  std::string model_name = "model";  // SHARDSERVE_MODEL_NAME: the name served on the API
  std::string deployment;            // SHARDSERVE_DEPLOYMENT: the metrics' `model` label
  int replica = 0;                   // SHARDSERVE_REPLICA
  std::string job_id;                // SHARDSERVE_JOB_ID: names the replica's shared memory
  // The shape and this process's place in it.
  int tp = 1;                       // SHARDSERVE_TP
  int pp = 1;                       // SHARDSERVE_PP
  int stage = 0;                    // SHARDSERVE_STAGE
  int tp_rank = 0;                  // SHARDSERVE_TP_RANK (the launcher's, per rank)
  int microbatches = 0;             // SHARDSERVE_MICROBATCHES (0: pp)
  int threads = 1;                  // SHARDSERVE_THREADS
  std::string backend = "auto";     // SHARDSERVE_BACKEND: cpu, cuda or auto (the rank checks)
  int64_t kv_cache_tokens = 8192;   // SHARDSERVE_KV_CACHE_TOKENS
  int64_t max_sequence_length = 0;  // SHARDSERVE_MAX_SEQUENCE_LENGTH (0: the model's)
  // Finding the others.
  std::string leader_addr;             // SHARDSERVE_LEADER_ADDR: host:port of the rendezvous
  std::string host;                    // SHARDSERVE_HOST: this rank's address as others reach it
  std::string pod_ip;                  // SHARDSERVE_POD_IP: where to listen (the downward API)
  std::string rendezvous_secret_file;  // SHARDSERVE_RENDEZVOUS_SECRET_FILE
  int peer_timeout_ms = 2000;          // SHARDSERVE_PEER_TIMEOUT_MS: a silent peer is dead after it
  int startup_timeout_ms = 120000;     // SHARDSERVE_STARTUP_TIMEOUT_MS: rendezvous and loading
  // Observing.
  bool metrics = true;          // SHARDSERVE_METRICS (off: no /metrics server)
  int metrics_port_base = -1;   // SHARDSERVE_METRICS_PORT_BASE: rank r on base + r; -1: 9400+t
  std::string termination_log;  // SHARDSERVE_TERMINATION_LOG: the first fatal error
  // The leader's API.
  std::string api_host;            // SHARDSERVE_API_HOST ("": every address)
  int api_port = kDefaultApiPort;  // SHARDSERVE_API_PORT
  int max_batch_size = 0;          // SHARDSERVE_MAX_BATCH_SIZE (0: the server's default)
  std::string api_keys_file;       // SHARDSERVE_API_KEYS_FILE
  // A one-shot run (`shardserve generate`): the request, where the result goes.
  std::string request;         // SHARDSERVE_REQUEST (JSON)
  std::string result_file;     // SHARDSERVE_RESULT_FILE
  bool report_memory = false;  // SHARDSERVE_REPORT_MEMORY=1

  int rank() const { return stage * tp + tp_rank; }

  // The variables to set: the replica's identity always, the rest where they differ from the
  // defaults above.
  std::vector<std::pair<std::string, std::string>> ToEnv() const;
  // What a worker process reads; an unset variable keeps its default, a bad one is an error
  // naming it.
  static absl::StatusOr<WorkerEnv> FromEnv(const EnvLookup& env = ProcessEnv);

  bool operator==(const WorkerEnv&) const = default;
};

}  // namespace shardserve
