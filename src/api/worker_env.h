#pragma once
// The worker contract (DESIGN.md §4) in one place: every SHARDSERVE_* variable a worker process
// reads, with its default and its bounds, in one table (worker_env.cc): which replica, stage and
// rank it is, how to reach the others, the ports and limits of the leader's API. The operator
// (operator/builders.cc), `shardserve local` and `shardserve generate` write it with ToEnv(); the
// worker's launcher, its ranks and the leader's API read it once with FromEnv() and keep it. What
// the processes derive from it (the secret read from its file, the addresses they bind) lives in
// the views RankConfig (serve/rank_runtime.h) and ServeConfig (serve/api_server.h). A new setting
// is one field here and one line in the table.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "api/kv_cache_dtype.h"
#include "api/speculative.h"

namespace shardserve {

// Ports: the rendezvous on every pod, the API on the leader (the spec's default), and the
// metrics of tp_rank t on kMetricsPortBase + t.
inline constexpr int kRendezvousPort = 29500;
inline constexpr int kDefaultApiPort = 8000;
inline constexpr int kMetricsPortBase = 9400;
// Running sequences of a replica (the spec's serving.maxBatchSize default).
inline constexpr int kDefaultMaxBatchSize = 32;

// The labels of a replica's pods.
inline constexpr char kModelLabel[] = "shardserve.io/model";
inline constexpr char kReplicaLabel[] = "shardserve.io/replica";
inline constexpr char kStageLabel[] = "shardserve.io/stage";
inline constexpr char kRevisionLabel[] = "shardserve.io/revision";
inline constexpr char kRoleLabel[] = "shardserve.io/role";

// The names that code other than the table mentions (errors that name the variable to set, and
// the few variables written or read outside ToEnv/FromEnv).
// The one variable the launcher adds for each rank it starts.
inline constexpr char kTpRankEnv[] = "SHARDSERVE_TP_RANK";
// Where the rendezvous and the mesh listen: the operator sets it from the downward API
// (status.podIP), which ToEnv cannot write.
inline constexpr char kPodIpEnv[] = "SHARDSERVE_POD_IP";
// Where the first fatal error goes (read even when the rest of the contract is malformed).
inline constexpr char kTerminationLogEnv[] = "SHARDSERVE_TERMINATION_LOG";
inline constexpr char kModelPathEnv[] = "SHARDSERVE_MODEL_PATH";
// A chat template replacing the model's (spec.serving.chatTemplate; on a cluster possibly from a
// ConfigMap's key).
inline constexpr char kChatTemplateEnv[] = "SHARDSERVE_CHAT_TEMPLATE";

// The tool-call formats the leader parses (serve/tool_calls.h).
inline constexpr char kToolCallFormats[] =
    "hermes, llama3_json, mistral, pythonic, qwen3_coder, deepseek_v3, deepseek_v31, kimi_k2 or "
    "openai (gpt-oss's harmony)";
inline bool IsToolCallFormat(std::string_view f) {
  return f == "hermes" || f == "llama3_json" || f == "mistral" || f == "pythonic" ||
         f == "qwen3_coder" || f == "deepseek_v3" || f == "deepseek_v31" || f == "kimi_k2" ||
         f == "openai";
}
// The node the pod runs on (the metrics' `node` label): the downward API's spec.nodeName.
inline constexpr char kNodeNameEnv[] = "SHARDSERVE_NODE_NAME";
inline constexpr char kSecretFileEnv[] = "SHARDSERVE_RENDEZVOUS_SECRET_FILE";
inline constexpr char kBackendEnv[] = "SHARDSERVE_BACKEND";
inline constexpr char kApiKeyEnv[] = "SHARDSERVE_API_KEY";
inline constexpr char kApiKeysFileEnv[] = "SHARDSERVE_API_KEYS_FILE";
inline constexpr char kRouterTokenFileEnv[] = "SHARDSERVE_ROUTER_TOKEN_FILE";
inline constexpr char kRequestEnv[] = "SHARDSERVE_REQUEST";
inline constexpr char kStageLayersEnv[] = "SHARDSERVE_STAGE_LAYERS";
inline constexpr char kCudaAttnKernelEnv[] = "SHARDSERVE_CUDA_ATTN_KERNEL";
inline constexpr char kCudaQuantGemvEnv[] = "SHARDSERVE_CUDA_QUANT_GEMV";
inline constexpr char kCudaFp8GemvEnv[] = "SHARDSERVE_CUDA_FP8_GEMV";
inline constexpr char kCudaLoraEnv[] = "SHARDSERVE_CUDA_LORA";
inline constexpr char kCpuKernelsEnv[] = "SHARDSERVE_CPU_KERNELS";

// Reads an environment variable (std::getenv, or a map in tests); null when unset.
using EnvLookup = std::function<const char*(const char*)>;
const char* ProcessEnv(const char* name);

// The settings, each with its default; the table in worker_env.cc gives each its variable and
// its bounds.
struct WorkerEnv {
  // The model and the replica.
  std::string model_path;            // required
  std::string model_name = "model";  // the name served on the API
  std::string deployment;            // the metrics' `model` label ("": model_name)
  // A remote model (spec.model.uri hf://, s3://, oci://; source/model_source.h): the inspect
  // step lists it and fetches its small files into model_path (a scratch directory), with the
  // credentials of a mounted Secret; a stage's fetch step (`shardserve fetch`, an init container)
  // wrote what it did to fetch_report, which the metrics read.
  std::string model_uri;
  std::string model_files;  // spec.model.files, comma-separated
  std::string credentials_dir;
  std::string fetch_report;
  std::string node_name;
  int replica = 0;
  std::string job_id;  // names the replica's shared memory
  // The shape and this process's place in it.
  int tp = 1;
  int pp = 1;
  int stage = 0;
  std::string stage_layers;  // every stage's layers, "0-11,12-23" (plan/layer_split.h)
  int tp_rank = 0;           // set by the launcher, per rank
  int microbatches = 0;      // 0: pp
  int threads = 1;
  std::string backend = "auto";  // cpu, cuda or auto (the rank checks)
  int64_t kv_cache_tokens = 8192;
  std::string kv_cache_dtype = "auto";  // api/kv_cache_dtype.h (KvCacheDtypeOf)
  // Speculative decoding (api/speculative.h): the method and the tokens drafted a step.
  std::string speculative_method = "none";
  int speculative_tokens = static_cast<int>(kDefaultSpeculativeTokens);
  std::string draft_model;  // the draft method's model (a directory or GGUF file) on the leader
  int64_t max_sequence_length = 0;  // 0: the model's context
  // How the weights compute (the defaults serve; benchmarks and the GPU checks choose others).
  bool fp8_blocks = true;  // FP8 weights computed as FP8 blocks; false: expanded at load
  // The CUDA backend's decode kernels: the attention kernel forced (split, split-batched, heads;
  // "": the shape chooses), the quantized GEMV (dp4a, the default, or float) and FP8's (direct,
  // the default, or staged); the CUDA stage backend reads the names
  // (backend/cuda/cuda_backend.h), a CPU rank ignores them.
  std::string cuda_attention_kernel;
  std::string cuda_quant_gemv = "dp4a";
  std::string cuda_fp8_gemv = "direct";
  // The CPU backend's kernel level (backend/cpu/cpu_features.h): auto (the widest the CPU has),
  // avx2, avx512 or avx512bf16 (to force one: tests and comparisons), portable (a build for a CPU
  // other than x86-64); a level the CPU or the build lacks fails the rank.
  std::string cpu_kernels = "auto";
  // LoRA on the CUDA backend (Backend::LoraAdd's kernels; the op suite passes them on an H200):
  // off refuses a CUDA rank of a replica with adapters, by name.
  bool cuda_lora = true;
  // Finding the others.
  std::string leader_addr;  // host:port of the rendezvous
  std::string host;         // this rank's address as others reach it
  std::string pod_ip;       // where to listen (the downward API)
  std::string rendezvous_secret_file;
  int peer_timeout_ms = 2000;  // a silent peer is dead after it
  // Start-up (spec.startup): how long a rank waits at the rendezvous for its peers (their pods
  // may still be pulling an image or starting), and how long its loading may go without
  // progress before the rank gives up.
  int startup_timeout_ms = 120000;
  int load_stall_ms = 300000;
  // Observing.
  bool metrics = true;          // off: no /metrics server
  int metrics_port_base = -1;   // rank r on base + r; -1: kMetricsPortBase + tp_rank
  std::string termination_log;  // where the first fatal error goes
  // The leader's API and its limits.
  std::string api_host;  // "": every address
  int api_port = kDefaultApiPort;
  int max_batch_size = kDefaultMaxBatchSize;  // running sequences
  int max_queue = 128;                        // waiting requests (beyond: 429)
  int64_t max_step_tokens = 512;              // prompt tokens fed per step
  int64_t max_body_bytes = 4 << 20;
  int drain_seconds = 5;  // on SIGTERM, requests in progress may finish for this long
  int http_header_timeout_ms = 10000;
  int http_body_timeout_ms = 60000;
  int http_max_connections = 4096;
  bool api_metrics_auth = true;  // with API keys, /metrics needs one too
  // Chat messages' special-token strings are text (spec.serving.specialTokensInContent: text).
  bool special_tokens_as_text = false;
  // The format of the model's tool calls (spec.serving.toolCallParser): one of kToolCallFormats,
  // or empty: the one its chat template shows (ChatTemplate::tool_call_format).
  std::string tool_call_parser;
  // Reasoning apart from the answer (spec.serving.reasoningParser): "think" (<think> blocks),
  // "harmony" (gpt-oss's channels), "none", or empty: harmony where the chat template writes
  // <|channel|>, else "think" where it writes </think>.
  std::string reasoning_parser;
  // The chat template used instead of the model's (spec.serving.chatTemplate), "" for the model's.
  std::string chat_template;
  // A request may bring its own chat_template (spec.serving.trustRequestChatTemplate).
  bool trust_request_chat_template = false;
  // Full KV blocks stay cached after their sequences and are shared by later ones with the same
  // prefix (spec.serving.prefixCaching).
  bool prefix_caching = true;
  // Cached prefixes are shared only between requests with the same API key: the key's digest
  // salts every block name (spec.serving.prefixCacheIsolation: perKey).
  bool prefix_cache_per_key = false;
  // Disaggregated serving (serve/kv_handoff.h): "prefill" (the replica offers each exported
  // prompt's KV blocks over UCX), "decode" (it pulls them), or "" (colocated: neither). An offer
  // is held at most kv_offer_ms; a pull waits at most kv_transfer_timeout_ms before the decode
  // replica prefills by itself.
  std::string kv_role;
  int kv_offer_ms = 30000;
  int kv_transfer_timeout_ms = 10000;
  // LoRA adapters (api/adapters.h): up to max_loras held at once (0: LoRA off), each of rank
  // at most max_lora_rank; those the manifest declares (spec.adapters), a JSON array of
  // {"name", "path"}, in their slots from the start.
  int max_loras = 0;
  int64_t max_lora_rank = 64;
  // The adapters the replica keeps (declared and loaded at runtime): a load past it is refused.
  int max_cpu_loras = 16;
  std::string lora_adapters;
  // Runtime adapters (POST /v1/load_lora_adapter): the keys allowed to load and unload them (a
  // keys file as api_keys_file; unset: runtime loading off) and the directory their paths must be
  // inside (spec.lora.source, mounted).
  std::string admin_keys_file;
  std::string lora_root;
  std::string api_key;        // one key (serve/api_keys.h)
  std::string api_keys_file;  // a file or a directory of keys
  // The token a router proves to read the leader's KV events (GET /v1/kv-events), a keys file as
  // api_keys_file; unset: nobody reads them (an API key never does).
  std::string router_token_file;
  // Flow control between tenants (serve/flow_control.h): the config file (spec.serving
  // .flowControl, mounted); unset: every key alike, no limits.
  std::string flow_control_file;
  // Latency targets (spec.serving.slo, metrics/slo.h): the time to first token and the
  // inter-token latency in ms (0: none), and the percentile held to them.
  int slo_ttft_ms = 0;
  int slo_itl_ms = 0;
  int slo_percentile = 90;
  // A one-shot run (`shardserve generate`, serve/generate_wire.h): the request, where the
  // result goes.
  std::string request;
  std::string result_file;
  bool report_memory = false;  // the ranks print their memory at the end

  int rank() const { return stage * tp + tp_rank; }
  // The `model` label of every metric of the deployment: the ShardedModel, else the model's name.
  const std::string& metrics_model() const { return deployment.empty() ? model_name : deployment; }

  // The variables to set: the replica's identity always, the rest where they differ from the
  // defaults above.
  std::vector<std::pair<std::string, std::string>> ToEnv() const;
  // What a worker process reads; an unset variable keeps its default, a bad one is an error
  // naming it.
  static absl::StatusOr<WorkerEnv> FromEnv(const EnvLookup& env = ProcessEnv);
  // Every variable of the table, in its order.
  static std::vector<std::string> Names();
  // The defaults above, for the structs that take theirs from the contract (EngineOptions).
  static const WorkerEnv& Defaults();

  bool operator==(const WorkerEnv&) const = default;
};

// The KV cache's dtype a command runs: `flag` (its --kv-cache-dtype) where given, else the
// contract's kv_cache_dtype (FromEnv checked it); an unknown name is refused naming the flag.
absl::StatusOr<KvCacheDtype> KvCacheDtypeOf(const std::optional<std::string>& flag,
                                            const WorkerEnv& env);

}  // namespace shardserve
