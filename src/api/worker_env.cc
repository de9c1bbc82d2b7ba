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
// drift apart. `identity` variables (the replica's identity) are written even at their default.
struct StringVar {
  const char* name;
  std::string WorkerEnv::*field;
  bool identity = false;
};
struct IntVar {
  const char* name;
  int WorkerEnv::*field;
  int64_t min, max;
  bool identity = false;
};
struct Int64Var {
  const char* name;
  int64_t WorkerEnv::*field;
  int64_t min, max;
};
struct BoolVar {
  const char* name;
  bool WorkerEnv::*field;
  const char* yes;  // the words for true and false
  const char* no;
};

const StringVar kStrings[] = {
    {kModelPathEnv, &WorkerEnv::model_path, true},
    {"SHARDSERVE_MODEL_NAME", &WorkerEnv::model_name, true},
    {"SHARDSERVE_DEPLOYMENT", &WorkerEnv::deployment},
    {"SHARDSERVE_JOB_ID", &WorkerEnv::job_id},
    {kStageLayersEnv, &WorkerEnv::stage_layers},
    {kBackendEnv, &WorkerEnv::backend},
    {"SHARDSERVE_LEADER_ADDR", &WorkerEnv::leader_addr},
    {"SHARDSERVE_HOST", &WorkerEnv::host},
    {kPodIpEnv, &WorkerEnv::pod_ip},
    {kSecretFileEnv, &WorkerEnv::rendezvous_secret_file},
    {kTerminationLogEnv, &WorkerEnv::termination_log},
    {"SHARDSERVE_API_HOST", &WorkerEnv::api_host},
    {kApiKeyEnv, &WorkerEnv::api_key},
    {kApiKeysFileEnv, &WorkerEnv::api_keys_file},
    {kRouterTokenFileEnv, &WorkerEnv::router_token_file},
    {kRequestEnv, &WorkerEnv::request},
    {"SHARDSERVE_RESULT_FILE", &WorkerEnv::result_file},
    {"SHARDSERVE_TOOL_CALL_PARSER", &WorkerEnv::tool_call_parser},
};
const IntVar kInts[] = {
    {"SHARDSERVE_REPLICA", &WorkerEnv::replica, 0, kIntMax, true},
    {"SHARDSERVE_TP", &WorkerEnv::tp, 1, 1 << 16, true},
    {"SHARDSERVE_PP", &WorkerEnv::pp, 1, 1 << 16, true},
    {"SHARDSERVE_STAGE", &WorkerEnv::stage, 0, 1 << 16, true},
    {kTpRankEnv, &WorkerEnv::tp_rank, 0, 1 << 16},
    {"SHARDSERVE_MICROBATCHES", &WorkerEnv::microbatches, 0, 1 << 16},
    {"SHARDSERVE_THREADS", &WorkerEnv::threads, 1, 4096},
    {"SHARDSERVE_PEER_TIMEOUT_MS", &WorkerEnv::peer_timeout_ms, 100, kIntMax},
    {"SHARDSERVE_STARTUP_TIMEOUT_MS", &WorkerEnv::startup_timeout_ms, 100, kIntMax},
    {"SHARDSERVE_LOAD_STALL_MS", &WorkerEnv::load_stall_ms, 100, kIntMax},
    {"SHARDSERVE_METRICS_PORT_BASE", &WorkerEnv::metrics_port_base, -1, 65535},
    {"SHARDSERVE_API_PORT", &WorkerEnv::api_port, 0, 65535},
    {"SHARDSERVE_MAX_BATCH_SIZE", &WorkerEnv::max_batch_size, 1, 1 << 20},
    {"SHARDSERVE_MAX_QUEUE", &WorkerEnv::max_queue, 0, kIntMax},
    {"SHARDSERVE_DRAIN_SECONDS", &WorkerEnv::drain_seconds, 0, 86400},
    {"SHARDSERVE_HTTP_HEADER_TIMEOUT_MS", &WorkerEnv::http_header_timeout_ms, 100, kIntMax},
    {"SHARDSERVE_HTTP_BODY_TIMEOUT_MS", &WorkerEnv::http_body_timeout_ms, 100, kIntMax},
    {"SHARDSERVE_HTTP_MAX_CONNECTIONS", &WorkerEnv::http_max_connections, 16, kIntMax},
};
const Int64Var kInt64s[] = {
    {"SHARDSERVE_KV_CACHE_TOKENS", &WorkerEnv::kv_cache_tokens, 16, int64_t{1} << 40},
    {"SHARDSERVE_MAX_SEQUENCE_LENGTH", &WorkerEnv::max_sequence_length, 0, int64_t{1} << 40},
    {"SHARDSERVE_MAX_STEP_TOKENS", &WorkerEnv::max_step_tokens, 1, kIntMax},
    {"SHARDSERVE_MAX_BODY_BYTES", &WorkerEnv::max_body_bytes, 1024, kIntMax},
};
const BoolVar kBools[] = {
    {"SHARDSERVE_METRICS", &WorkerEnv::metrics, "on", "off"},
    {"SHARDSERVE_API_METRICS_AUTH", &WorkerEnv::api_metrics_auth, "true", "false"},
    {"SHARDSERVE_SPECIAL_TOKENS_IN_CONTENT", &WorkerEnv::special_tokens_as_text, "text", "special"},
    {"SHARDSERVE_REPORT_MEMORY", &WorkerEnv::report_memory, "1", "0"},
    {"SHARDSERVE_PREFIX_CACHING", &WorkerEnv::prefix_caching, "true", "false"},
    {"SHARDSERVE_PREFIX_CACHE_ISOLATION", &WorkerEnv::prefix_cache_per_key, "perKey", "none"},
};

// The variable of a field, for errors that name it.
template <typename Table, typename Field>
const char* NameOf(const Table& table, Field field) {
  for (const auto& v : table) {
    if (v.field == field) return v.name;
  }
  return "?";
}

// An integer variable: `def` when unset or empty; otherwise it must lie in [min, max], or the
// error names the variable and its value.
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

}  // namespace

const char* ProcessEnv(const char* name) { return std::getenv(name); }

const WorkerEnv& WorkerEnv::Defaults() {
  static const WorkerEnv* defaults = new WorkerEnv;
  return *defaults;
}

std::vector<std::pair<std::string, std::string>> WorkerEnv::ToEnv() const {
  const WorkerEnv& defaults = Defaults();
  std::vector<std::pair<std::string, std::string>> out;
  for (const StringVar& v : kStrings) {
    if (this->*v.field != defaults.*v.field || v.identity) out.emplace_back(v.name, this->*v.field);
  }
  for (const IntVar& v : kInts) {
    if (this->*v.field != defaults.*v.field || v.identity) {
      out.emplace_back(v.name, std::to_string(this->*v.field));
    }
  }
  for (const Int64Var& v : kInt64s) {
    if (this->*v.field != defaults.*v.field)
      out.emplace_back(v.name, std::to_string(this->*v.field));
  }
  for (const BoolVar& v : kBools) {
    if (this->*v.field != defaults.*v.field)
      out.emplace_back(v.name, this->*v.field ? v.yes : v.no);
  }
  return out;
}

std::vector<std::string> WorkerEnv::Names() {
  std::vector<std::string> names;
  for (const StringVar& v : kStrings) names.push_back(v.name);
  for (const IntVar& v : kInts) names.push_back(v.name);
  for (const Int64Var& v : kInt64s) names.push_back(v.name);
  for (const BoolVar& v : kBools) names.push_back(v.name);
  return names;
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
  for (const BoolVar& v : kBools) {
    const char* s = env(v.name);
    if (s == nullptr || *s == '\0') continue;
    if (std::string_view(s) != v.yes && std::string_view(s) != v.no) {
      return absl::InvalidArgumentError(absl::StrCat("environment variable ", v.name, "='", s,
                                                     "' must be ", v.yes, " or ", v.no));
    }
    w.*v.field = std::string_view(s) == v.yes;
  }
  if (w.stage >= w.pp || w.tp_rank >= w.tp) {
    return absl::InvalidArgumentError(
        absl::StrCat(NameOf(kInts, &WorkerEnv::stage), " ", w.stage, " / ", kTpRankEnv, " ",
                     w.tp_rank, " are outside ", NameOf(kInts, &WorkerEnv::tp), " ", w.tp, " x ",
                     NameOf(kInts, &WorkerEnv::pp), " ", w.pp));
  }
  if (!w.tool_call_parser.empty() && w.tool_call_parser != "hermes" &&
      w.tool_call_parser != "llama3_json" && w.tool_call_parser != "mistral") {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", NameOf(kStrings, &WorkerEnv::tool_call_parser), "='",
                     w.tool_call_parser, "' must be hermes, llama3_json or mistral"));
  }
  if (!w.leader_addr.empty()) {
    const size_t colon = w.leader_addr.rfind(':');
    int port;
    if (colon == std::string::npos || colon == 0 ||
        !absl::SimpleAtoi(w.leader_addr.substr(colon + 1), &port) || port < 1 || port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("environment variable ",
                                                     NameOf(kStrings, &WorkerEnv::leader_addr),
                                                     "='", w.leader_addr, "' is not HOST:PORT"));
    }
  }
  return w;
}

}  // namespace shardserve
