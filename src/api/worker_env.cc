#include "api/worker_env.h"

#include <cstdlib>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "api/env_table.h"
#include "api/kv_cache_dtype.h"
#include "common/status.h"

namespace shardserve {
namespace {

constexpr int64_t kIntMax = std::numeric_limits<int>::max();

// The variables and where they live in WorkerEnv: one table (api/env_table.h), so that writing
// and reading cannot drift apart. `identity` variables (the replica's identity) are written even
// at their default.
using StringVar = env_internal::StringVar<WorkerEnv>;
using IntVar = env_internal::IntVar<WorkerEnv>;
using Int64Var = env_internal::Int64Var<WorkerEnv>;
using BoolVar = env_internal::BoolVar<WorkerEnv>;
using env_internal::NameOf;

const StringVar kStrings[] = {
    {kModelPathEnv, &WorkerEnv::model_path, true},
    {"SHARDSERVE_MODEL_NAME", &WorkerEnv::model_name, true},
    {"SHARDSERVE_DEPLOYMENT", &WorkerEnv::deployment},
    {"SHARDSERVE_MODEL_URI", &WorkerEnv::model_uri},
    {"SHARDSERVE_MODEL_FILES", &WorkerEnv::model_files},
    {"SHARDSERVE_CREDENTIALS_DIR", &WorkerEnv::credentials_dir},
    {"SHARDSERVE_FETCH_REPORT", &WorkerEnv::fetch_report},
    {kNodeNameEnv, &WorkerEnv::node_name},
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
    {"SHARDSERVE_FLOW_CONTROL_FILE", &WorkerEnv::flow_control_file},
    {kRequestEnv, &WorkerEnv::request},
    {"SHARDSERVE_RESULT_FILE", &WorkerEnv::result_file},
    {"SHARDSERVE_TOOL_CALL_PARSER", &WorkerEnv::tool_call_parser},
    {kChatTemplateEnv, &WorkerEnv::chat_template},
    {"SHARDSERVE_REASONING_PARSER", &WorkerEnv::reasoning_parser},
    {kCudaAttnKernelEnv, &WorkerEnv::cuda_attention_kernel},
    {kCudaQuantGemvEnv, &WorkerEnv::cuda_quant_gemv},
    {kCudaFp8GemvEnv, &WorkerEnv::cuda_fp8_gemv},
    {kCpuKernelsEnv, &WorkerEnv::cpu_kernels},
    {"SHARDSERVE_KV_ROLE", &WorkerEnv::kv_role},
    {"SHARDSERVE_KV_CACHE_DTYPE", &WorkerEnv::kv_cache_dtype},
    {"SHARDSERVE_SPECULATIVE_METHOD", &WorkerEnv::speculative_method},
    {"SHARDSERVE_DRAFT_MODEL", &WorkerEnv::draft_model},
    {"SHARDSERVE_LORA_ADAPTERS", &WorkerEnv::lora_adapters},
    {"SHARDSERVE_ADMIN_KEYS_FILE", &WorkerEnv::admin_keys_file},
    {"SHARDSERVE_LORA_ROOT", &WorkerEnv::lora_root},
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
    {"SHARDSERVE_KV_OFFER_MS", &WorkerEnv::kv_offer_ms, 100, 3600000},
    {"SHARDSERVE_KV_TRANSFER_TIMEOUT_MS", &WorkerEnv::kv_transfer_timeout_ms, 100, 600000},
    {"SHARDSERVE_MAX_LORAS", &WorkerEnv::max_loras, 0, 1024},
    {"SHARDSERVE_MAX_CPU_LORAS", &WorkerEnv::max_cpu_loras, 1, 4096},
    {"SHARDSERVE_SLO_TTFT_MS", &WorkerEnv::slo_ttft_ms, 0, 86400000},
    {"SHARDSERVE_SLO_ITL_MS", &WorkerEnv::slo_itl_ms, 0, 86400000},
    {"SHARDSERVE_SLO_PERCENTILE", &WorkerEnv::slo_percentile, 1, 99},
    {"SHARDSERVE_SPECULATIVE_TOKENS", &WorkerEnv::speculative_tokens, 1,
     static_cast<int>(kMaxSpeculativeTokens)},
};
const Int64Var kInt64s[] = {
    {"SHARDSERVE_KV_CACHE_TOKENS", &WorkerEnv::kv_cache_tokens, 16, int64_t{1} << 40},
    {"SHARDSERVE_MAX_SEQUENCE_LENGTH", &WorkerEnv::max_sequence_length, 0, int64_t{1} << 40},
    {"SHARDSERVE_MAX_STEP_TOKENS", &WorkerEnv::max_step_tokens, 1, kIntMax},
    {"SHARDSERVE_MAX_BODY_BYTES", &WorkerEnv::max_body_bytes, 1024, kIntMax},
    {"SHARDSERVE_MAX_LORA_RANK", &WorkerEnv::max_lora_rank, 1, 4096},
};
const BoolVar kBools[] = {
    {"SHARDSERVE_METRICS", &WorkerEnv::metrics, "on", "off"},
    {"SHARDSERVE_API_METRICS_AUTH", &WorkerEnv::api_metrics_auth, "true", "false"},
    {"SHARDSERVE_SPECIAL_TOKENS_IN_CONTENT", &WorkerEnv::special_tokens_as_text, "text", "special"},
    {"SHARDSERVE_TRUST_REQUEST_CHAT_TEMPLATE", &WorkerEnv::trust_request_chat_template, "true",
     "false"},
    {"SHARDSERVE_REPORT_MEMORY", &WorkerEnv::report_memory, "1", "0"},
    {"SHARDSERVE_PREFIX_CACHING", &WorkerEnv::prefix_caching, "true", "false"},
    {"SHARDSERVE_PREFIX_CACHE_ISOLATION", &WorkerEnv::prefix_cache_per_key, "perKey", "none"},
    {"SHARDSERVE_FP8", &WorkerEnv::fp8_blocks, "blocks", "expand"},
    {kCudaLoraEnv, &WorkerEnv::cuda_lora, "on", "off"},
};

const env_internal::Table<WorkerEnv> kTable{kStrings, kInts, kInt64s, kBools};

}  // namespace

const char* ProcessEnv(const char* name) { return std::getenv(name); }

const WorkerEnv& WorkerEnv::Defaults() {
  static const WorkerEnv* defaults = new WorkerEnv;
  return *defaults;
}

std::vector<std::pair<std::string, std::string>> WorkerEnv::ToEnv() const {
  return env_internal::ToEnv(kTable, *this, Defaults());
}

std::vector<std::string> WorkerEnv::Names() { return env_internal::Names(kTable); }

absl::StatusOr<WorkerEnv> WorkerEnv::FromEnv(const EnvLookup& env) {
  WorkerEnv w;
  RETURN_IF_ERROR(env_internal::FromEnv(kTable, env, w));
  if (w.stage >= w.pp || w.tp_rank >= w.tp) {
    return absl::InvalidArgumentError(
        absl::StrCat(NameOf(kInts, &WorkerEnv::stage), " ", w.stage, " / ", kTpRankEnv, " ",
                     w.tp_rank, " are outside ", NameOf(kInts, &WorkerEnv::tp), " ", w.tp, " x ",
                     NameOf(kInts, &WorkerEnv::pp), " ", w.pp));
  }
  if (!w.reasoning_parser.empty() && w.reasoning_parser != "think" &&
      w.reasoning_parser != "harmony" && w.reasoning_parser != "none") {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", NameOf(kStrings, &WorkerEnv::reasoning_parser), "='",
                     w.reasoning_parser, "' must be think, harmony or none"));
  }
  if (!ParseKvCacheDtype(w.kv_cache_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", NameOf(kStrings, &WorkerEnv::kv_cache_dtype), "='",
                     w.kv_cache_dtype, "' must be ", kKvCacheDtypes));
  }
  if (!ParseSpeculativeMethod(w.speculative_method)) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", NameOf(kStrings, &WorkerEnv::speculative_method),
                     "='", w.speculative_method, "' must be ", kSpeculativeMethods));
  }
  // The names of backend/cpu/cpu_features.h's levels (which the CPU may still lack: the rank says).
  if (w.cpu_kernels != "auto" && w.cpu_kernels != "avx2" && w.cpu_kernels != "avx512" &&
      w.cpu_kernels != "avx512bf16" && w.cpu_kernels != "avx512int8" &&
      w.cpu_kernels != "portable") {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", kCpuKernelsEnv, "='", w.cpu_kernels,
                     "' must be auto, avx2, avx512, avx512bf16, avx512int8 or portable"));
  }
  if (w.speculative_method == "mtp" && w.speculative_tokens != kMtpSpeculativeTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable SHARDSERVE_SPECULATIVE_TOKENS='", w.speculative_tokens,
                     "': method mtp drafts ", kMtpSpeculativeTokens, " a step"));
  }
  if (!w.kv_role.empty() && w.kv_role != "prefill" && w.kv_role != "decode") {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", NameOf(kStrings, &WorkerEnv::kv_role), "='",
                     w.kv_role, "' must be prefill or decode (or unset: colocated)"));
  }
  if (!w.tool_call_parser.empty() && !IsToolCallFormat(w.tool_call_parser)) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", NameOf(kStrings, &WorkerEnv::tool_call_parser), "='",
                     w.tool_call_parser, "' must be ", kToolCallFormats));
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

absl::StatusOr<KvCacheDtype> KvCacheDtypeOf(const std::optional<std::string>& flag,
                                            const WorkerEnv& env) {
  const std::string& name = flag ? *flag : env.kv_cache_dtype;
  if (const std::optional<KvCacheDtype> t = ParseKvCacheDtype(name)) return *t;
  return absl::InvalidArgumentError(
      absl::StrCat("--kv-cache-dtype '", name, "' must be ", kKvCacheDtypes));
}

}  // namespace shardserve
