#include "api/worker_env.h"

#include <cstdlib>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardserve {
namespace {

constexpr int64_t kIntMax = std::numeric_limits<int>::max();

// The variables and where they live in WorkerEnv: one table, so that writing and reading cannot
// drift apart.
struct StringVar {
  const char* name;
  std::string WorkerEnv::*field;
};
struct IntVar {
  const char* name;
  int WorkerEnv::*field;
  int64_t min, max;
};
struct Int64Var {
  const char* name;
  int64_t WorkerEnv::*field;
  int64_t min, max;
};

const StringVar kStrings[] = {
    {"SHARDSERVE_MODEL_PATH", &WorkerEnv::model_path},
    {"SHARDSERVE_MODEL_NAME", &WorkerEnv::model_name},
    {"SHARDSERVE_DEPLOYMENT", &WorkerEnv::deployment},
    {"SHARDSERVE_JOB_ID", &WorkerEnv::job_id},
    {"SHARDSERVE_BACKEND", &WorkerEnv::backend},
    {"SHARDSERVE_LEADER_ADDR", &WorkerEnv::leader_addr},
    {"SHARDSERVE_HOST", &WorkerEnv::host},
    {kPodIpEnv, &WorkerEnv::pod_ip},
    {"SHARDSERVE_RENDEZVOUS_SECRET_FILE", &WorkerEnv::rendezvous_secret_file},
    {kTerminationLogEnv, &WorkerEnv::termination_log},
    {"SHARDSERVE_API_HOST", &WorkerEnv::api_host},
    {"SHARDSERVE_API_KEYS_FILE", &WorkerEnv::api_keys_file},
    {"SHARDSERVE_REQUEST", &WorkerEnv::request},
    {"SHARDSERVE_RESULT_FILE", &WorkerEnv::result_file},
};
// The replica's identity, written even at its default value.
const IntVar kInts[] = {
    {"SHARDSERVE_REPLICA", &WorkerEnv::replica, 0, kIntMax},
    {"SHARDSERVE_TP", &WorkerEnv::tp, 1, 1 << 16},
    {"SHARDSERVE_PP", &WorkerEnv::pp, 1, 1 << 16},
    {"SHARDSERVE_STAGE", &WorkerEnv::stage, 0, 1 << 16},
    {kTpRankEnv, &WorkerEnv::tp_rank, 0, 1 << 16},
    {"SHARDSERVE_MICROBATCHES", &WorkerEnv::microbatches, 0, 1 << 16},
    {"SHARDSERVE_THREADS", &WorkerEnv::threads, 1, 4096},
    {"SHARDSERVE_PEER_TIMEOUT_MS", &WorkerEnv::peer_timeout_ms, 100, kIntMax},
    {"SHARDSERVE_STARTUP_TIMEOUT_MS", &WorkerEnv::startup_timeout_ms, 100, kIntMax},
    {"SHARDSERVE_METRICS_PORT_BASE", &WorkerEnv::metrics_port_base, -1, 65535},
    {"SHARDSERVE_API_PORT", &WorkerEnv::api_port, 0, 65535},
    {"SHARDSERVE_MAX_BATCH_SIZE", &WorkerEnv::max_batch_size, 0, 1 << 20},
};
const Int64Var kInt64s[] = {
    {"SHARDSERVE_KV_CACHE_TOKENS", &WorkerEnv::kv_cache_tokens, 16, int64_t{1} << 40},
    {"SHARDSERVE_MAX_SEQUENCE_LENGTH", &WorkerEnv::max_sequence_length, 0, int64_t{1} << 40},
};
const char* const kIdentity[] = {"SHARDSERVE_MODEL_PATH", "SHARDSERVE_MODEL_NAME",
                                 "SHARDSERVE_REPLICA",    "SHARDSERVE_TP",
                                 "SHARDSERVE_PP",         "SHARDSERVE_STAGE"};

bool Identity(const char* name) {
  for (const char* id : kIdentity) {
    if (std::string_view(id) == name) return true;
  }
  return false;
}

}  // namespace

const char* ProcessEnv(const char* name) { return std::getenv(name); }

absl::StatusOr<int64_t> EnvInt(const EnvLookup& env, const char* name, int64_t def, int64_t min,
                               int64_t max) {
  const char* v = env(name);
  if (v == nullptr || *v == '\0') return def;
  int64_t out;
  if (!absl::SimpleAtoi(v, &out) || out < min || out > max) {
    return absl::InvalidArgumentError(absl::StrCat(
        "environment variable ", name, "='", v, "' must be an integer in [", min, ", ", max, "]"));
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> WorkerEnv::ToEnv() const {
  const WorkerEnv defaults;
  std::vector<std::pair<std::string, std::string>> out;
  for (const StringVar& v : kStrings) {
    if (this->*v.field != defaults.*v.field || Identity(v.name)) {
      out.emplace_back(v.name, this->*v.field);
    }
  }
  for (const IntVar& v : kInts) {
    if (this->*v.field != defaults.*v.field || Identity(v.name)) {
      out.emplace_back(v.name, std::to_string(this->*v.field));
    }
  }
  for (const Int64Var& v : kInt64s) {
    if (this->*v.field != defaults.*v.field)
      out.emplace_back(v.name, std::to_string(this->*v.field));
  }
  if (!metrics) out.emplace_back("SHARDSERVE_METRICS", "off");
  if (report_memory) out.emplace_back("SHARDSERVE_REPORT_MEMORY", "1");
  return out;
}

absl::StatusOr<WorkerEnv> WorkerEnv::FromEnv(const EnvLookup& env) {
  WorkerEnv w;
  for (const StringVar& v : kStrings) {
    if (const char* s = env(v.name); s != nullptr && *s) w.*v.field = s;
  }
  for (const IntVar& v : kInts) {
    ASSIGN_OR_RETURN(int64_t x, EnvInt(env, v.name, w.*v.field, v.min, v.max));
    w.*v.field = static_cast<int>(x);
  }
  for (const Int64Var& v : kInt64s) {
    ASSIGN_OR_RETURN(w.*v.field, EnvInt(env, v.name, w.*v.field, v.min, v.max));
  }
  if (const char* m = env("SHARDSERVE_METRICS"); m != nullptr && *m) {
    const std::string s = m;
    if (s != "on" && s != "off") {
      return absl::InvalidArgumentError(
          absl::StrCat("environment variable SHARDSERVE_METRICS='", s, "' must be on or off"));
    }
    w.metrics = s == "on";
  }
  if (const char* r = env("SHARDSERVE_REPORT_MEMORY"); r != nullptr) {
    w.report_memory = std::string_view(r) == "1";
  }
  if (w.stage >= w.pp || w.tp_rank >= w.tp) {
    return absl::InvalidArgumentError(
        absl::StrCat("SHARDSERVE_STAGE ", w.stage, " / SHARDSERVE_TP_RANK ", w.tp_rank,
                     " are outside SHARDSERVE_TP ", w.tp, " x SHARDSERVE_PP ", w.pp));
  }
  if (!w.leader_addr.empty()) {
    const size_t colon = w.leader_addr.rfind(':');
    int port;
    if (colon == std::string::npos || colon == 0 ||
        !absl::SimpleAtoi(w.leader_addr.substr(colon + 1), &port) || port < 1 || port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat(
          "environment variable SHARDSERVE_LEADER_ADDR='", w.leader_addr, "' is not HOST:PORT"));
    }
  }
  return w;
}

}  // namespace shardserve
