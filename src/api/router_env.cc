#include "api/router_env.h"

#include <limits>

#include "absl/strings/numbers.h"
#include "api/env_table.h"
#include "api/sharded_model.h"

namespace shardserve {
namespace {

constexpr int64_t kIntMax = std::numeric_limits<int>::max();

using StringVar = env_internal::StringVar<RouterEnv>;
using IntVar = env_internal::IntVar<RouterEnv>;
using Int64Var = env_internal::Int64Var<RouterEnv>;
using BoolVar = env_internal::BoolVar<RouterEnv>;

const StringVar kStrings[] = {
    {"SHARDSERVE_ROUTER_LEADERS", &RouterEnv::leaders, true},
    {"SHARDSERVE_ROUTER_PREFILL_LEADERS", &RouterEnv::prefill_leaders},
    {kModelPathEnv, &RouterEnv::model_path, true},
    {"SHARDSERVE_DEPLOYMENT", &RouterEnv::deployment},
    {"SHARDSERVE_MODEL_NAME", &RouterEnv::model_name},
    {kApiKeyEnv, &RouterEnv::api_key},
    {kApiKeysFileEnv, &RouterEnv::api_keys_file},
    {kRouterTokenFileEnv, &RouterEnv::token_file},
    {kChatTemplateEnv, &RouterEnv::chat_template},
    {"SHARDSERVE_FLOW_CONTROL_FILE", &RouterEnv::flow_control_file},
};
const IntVar kInts[] = {
    {"SHARDSERVE_ROUTER_PORT", &RouterEnv::port, 0, 65535},
    {"SHARDSERVE_ROUTER_FLOW_SHARE", &RouterEnv::flow_share, 1, 1024},
    {"SHARDSERVE_ROUTER_QUEUE_MAX", &RouterEnv::queue_max, 0, 4096},
    {"SHARDSERVE_ROUTER_QUEUE_TIMEOUT_MS", &RouterEnv::queue_timeout_ms, 0, 86400000},
    {"SHARDSERVE_SLO_TTFT_MS", &RouterEnv::slo_ttft_ms, 0, 86400000},
    {"SHARDSERVE_SLO_ITL_MS", &RouterEnv::slo_itl_ms, 0, 86400000},
    {"SHARDSERVE_SLO_PERCENTILE", &RouterEnv::slo_percentile, 1, 99},
    {"SHARDSERVE_ROUTER_METRICS_PORT", &RouterEnv::metrics_port, -1, 65535},
};
const Int64Var kInt64s[] = {
    {"SHARDSERVE_MAX_BODY_BYTES", &RouterEnv::max_body_bytes, 1024, kIntMax},
    {"SHARDSERVE_ROUTER_DISAGGREGATE_MIN_TOKENS", &RouterEnv::disaggregate_min_tokens, 0,
     int64_t{1} << 40},
};
const BoolVar kBools[] = {
    {"SHARDSERVE_SPECIAL_TOKENS_IN_CONTENT", &RouterEnv::special_tokens_as_text, "text", "special"},
    {"SHARDSERVE_TRUST_REQUEST_CHAT_TEMPLATE", &RouterEnv::trust_request_chat_template, "true",
     "false"},
    {"SHARDSERVE_PREFIX_CACHE_ISOLATION", &RouterEnv::prefix_cache_per_key, "perKey", "none"},
};
const env_internal::Table<RouterEnv> kTable{kStrings, kInts, kInt64s, kBools};

}  // namespace

const RouterEnv& RouterEnv::Defaults() {
  static const RouterEnv* defaults = new RouterEnv;
  return *defaults;
}

std::vector<std::pair<std::string, std::string>> RouterEnv::ToEnv() const {
  return env_internal::ToEnv(kTable, *this, Defaults());
}

std::vector<std::string> RouterEnv::Names() { return env_internal::Names(kTable); }

absl::StatusOr<RouterEnv> RouterEnv::FromEnv(const EnvLookup& env) {
  RouterEnv r;
  RETURN_IF_ERROR(env_internal::FromEnv(kTable, env, r));
  return r;
}

void ApplyServing(const ShardedModelSpec& spec, RouterEnv& r) {
  WorkerEnv w;
  ApplyServing(spec, w);
  r.special_tokens_as_text = w.special_tokens_as_text;
  r.chat_template = w.chat_template;
  r.trust_request_chat_template = w.trust_request_chat_template;
  r.prefix_cache_per_key = w.prefix_cache_per_key;
  r.model_name = spec.model_name;
  r.slo_ttft_ms = w.slo_ttft_ms;
  r.slo_itl_ms = w.slo_itl_ms;
  r.slo_percentile = w.slo_percentile;
  r.queue_max = static_cast<int>(spec.queue_max_requests);
  r.queue_timeout_ms = static_cast<int>(spec.queue_timeout_seconds * 1000);
  for (const ShardedModelSpec::EnvVar& e : spec.env) {  // the leaders' body bound, if set
    int64_t bytes = 0;
    if (e.name == "SHARDSERVE_MAX_BODY_BYTES" && e.value_from.empty() &&
        absl::SimpleAtoi(e.value, &bytes)) {
      r.max_body_bytes = bytes;
    }
  }
}

}  // namespace shardserve
