#pragma once
// The ShardedModel resource (shardserve.io/v1alpha1, DESIGN.md §2) as C++ types, read from
// YAML or JSON, with the checks that need no model and no cluster (the same rules the CRD's
// schema and CEL rules enforce). Pure: no I/O. Errors name the field ("spec.parallelism.tensor
// must be at least 1, got 0").
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "api/speculative.h"
#include "api/worker_env.h"

namespace shardserve {

// The resource's API group, its version (and the two as an apiVersion) and kind.
inline constexpr char kApiGroup[] = "shardserve.io";
inline constexpr char kApiGroupVersion[] = "v1alpha1";
inline constexpr char kApiVersion[] = "shardserve.io/v1alpha1";
inline constexpr char kShardedModelKind[] = "ShardedModel";

struct ModelUri {
  enum class Scheme { kPvc, kHostPath, kFile, kS3, kHf, kOci };
  Scheme scheme = Scheme::kFile;
  std::string claim;     // pvc only
  std::string bucket;    // s3 only
  std::string registry;  // oci only: HOST[:PORT]
  std::string repo;      // hf: ORG/NAME; oci: the repository's path in the registry
  // hf: a branch, a tag or a commit ("main" when not given); oci: a tag ("latest" when not
  // given) or "sha256:HEX"
  std::string revision;
  std::string path;  // inside the claim, the directory, or the objects' key prefix (s3)
  // Fetched from where it lives into a cache before a rank reads it (source/model_source.h).
  bool remote() const {
    return scheme == Scheme::kS3 || scheme == Scheme::kHf || scheme == Scheme::kOci;
  }
};

// pvc://CLAIM/PATH | hostpath:///DIR | file:///DIR | s3://BUCKET[/PREFIX] | hf://ORG/NAME[@REV]
// | oci://REGISTRY/REPO[:TAG|@sha256:DIGEST]
absl::StatusOr<ModelUri> ParseModelUri(const std::string& uri);

// A pod's toleration of node taints (spec.worker.tolerations; placement checks them).
struct Toleration {
  std::string key, op = "Equal", value, effect;  // empty key + Exists tolerates everything
  std::optional<int64_t> seconds;                // tolerationSeconds
};

struct ShardedModelSpec {
  int64_t replicas = 1;
  std::string model_name;
  std::string model_uri;
  // spec.model.files: which of a remote model's files to fetch (shell patterns of their paths
  // under the uri; empty: all).
  std::vector<std::string> model_files;
  // spec.model.secret: a Secret in the model's namespace with the remote source's credentials,
  // its keys named as the variables every client reads (HF_TOKEN; AWS_ACCESS_KEY_ID,
  // AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN; an image pull Secret's .dockerconfigjson); mounted
  // only where the model is listed and fetched, never where its ranks run.
  std::string model_secret;
  // parallelism.tensor / pipeline; "auto" sets the flag and leaves 1 until a plan that knows the
  // model's memory and the nodes' GPUs chooses (plan/memory.h: ChooseParallelism).
  int64_t tensor = 1;
  int64_t pipeline = 1;
  bool tensor_auto = false;
  bool pipeline_auto = false;
  int64_t micro_batches = 0;  // 0: pipeline
  std::string image;
  std::string gpu_resource = "nvidia.com/gpu";
  // worker.gpuMemory: each GPU's memory in bytes where a node does not say it (the
  // nvidia.com/gpu.memory label of NVIDIA's GPU feature discovery); 0: unknown.
  int64_t gpu_memory = 0;
  std::map<std::string, std::string> node_selector;
  std::vector<Toleration> tolerations;
  // Passed to every worker: a value, or (on a cluster) a valueFrom source as its JSON text.
  struct EnvVar {
    std::string name, value;
    std::string value_from;  // {"fieldRef": ...}, {"secretKeyRef": ...}; "" for a plain value
  };
  std::vector<EnvVar> env;
  std::string topology_key = "topology.kubernetes.io/zone";
  std::string failure_policy = "RecreateReplica";  // RecreateReplica | None
  int64_t max_unavailable = 1;
  int64_t max_surge = 0;
  int64_t port = kDefaultApiPort;
  int64_t max_batch_size = kDefaultMaxBatchSize;
  int64_t max_sequence_length = 4096;
  // spec.serving.kvCacheDtype (api/kv_cache_dtype.h): auto, f32, bf16, f16 or fp8.
  std::string kv_cache_dtype = "auto";
  // spec.serving.speculative (api/speculative.h): method (none, ngram, draft, mtp), tokens a step,
  // and the draft method's model (a URI as spec.model.uri's).
  std::string speculative_method = "none";
  int64_t speculative_tokens = kDefaultSpeculativeTokens;
  std::string draft_model;
  // The Secret (in the model's namespace) whose entries are the API's bearer keys; "" = open.
  std::string api_key_secret;
  // How a chat message's special-token strings are tokenized: "special" (as control tokens, as
  // transformers and vLLM do) or "text" (as the characters they are; a user cannot forge a turn).
  std::string special_tokens_in_content = "special";
  std::string tool_call_parser = "auto";  // auto (the chat template's), hermes, llama3_json
  // spec.serving.reasoningParser: auto (<think> blocks where the template writes them), none,
  // deepseek_r1 or qwen3 (vLLM's names; both <think> blocks).
  std::string reasoning_parser = "auto";
  // spec.serving.chatTemplate: a template replacing the model's, inline or a ConfigMap's key.
  std::string chat_template_inline;
  std::string chat_template_config_map, chat_template_key;
  // spec.serving.flowControl (serve/flow_control.h): the ConfigMap or the Secret (one of them)
  // whose entry `key` is the flow-control config, mounted on the leaders and routers.
  std::string flow_control_config_map, flow_control_secret, flow_control_key = "flow.yaml";
  // spec.serving.slo: latency targets in ms (0: none) and the percentile held to them
  // (metrics/slo.h); spec.serving.queue: the router's queue (router/router.h).
  int64_t slo_ttft_ms = 0, slo_itl_ms = 0, slo_percentile = 90;
  int64_t queue_max_requests = 256, queue_timeout_seconds = 120;
  // spec.serving.trustRequestChatTemplate: a request may bring its own chat_template.
  bool trust_request_chat_template = false;
  bool prefix_caching = true;  // full KV blocks stay cached and are shared
  // none: every request may share every cached prefix; perKey: only requests with the same API
  // key do (the key salts every block name).
  std::string prefix_cache_isolation = "none";
  // Start-up (spec.startup): a rank waits this long at the rendezvous for the other stages' pods
  // (pulling an image, starting, reaching it), and gives up when its loading makes no progress
  // for load_stall_seconds.
  int64_t startup_timeout_seconds = 1800;
  int64_t load_stall_seconds = 300;
  // spec.disaggregation: prefill and decode in separate replicas, the prompt's KV moved between
  // their ranks (serve/kv_handoff.h). The decode replicas are spec.replicas of
  // spec.parallelism (the scale subresource, `kubectl scale`, scales them); the prefill replicas
  // have a count, a shape, nodes and a rollout of their own. On a cluster they are a
  // ShardedModel of their own, <name>-prefill, that the operator makes and owns (PrefillSpec):
  // its scale subresource scales them. Prompts shorter than min_prompt_tokens are served by a
  // decode replica alone.
  struct Disaggregation {
    int64_t prefill_replicas = 1;
    int64_t prefill_tensor = 1;
    int64_t prefill_pipeline = 1;
    std::optional<std::map<std::string, std::string>> prefill_node_selector;  // else the model's
    int64_t prefill_max_unavailable = 1;
    int64_t prefill_max_surge = 0;
    int64_t min_prompt_tokens = 0;
  };
  std::optional<Disaggregation> disaggregation;
  // spec.adapters: LoRA adapters of the model (model/lora.h), each served under its name (a
  // request's `model`) beside the base; uri as spec.model.uri's local forms (pvc:// and
  // hostpath:// on a cluster, file:// and hostpath:// with shardserve local). spec.lora: how many a
  // replica holds at once (maxLoras) and their largest rank (maxLoraRank); LoRA is on when either
  // is given.
  struct Adapter {
    std::string name, uri;
  };
  std::vector<Adapter> adapters;
  bool lora = false;
  int64_t max_loras = 4;
  int64_t max_lora_rank = 64;
  // The adapters a replica keeps, declared and loaded at runtime (each rank's share in host
  // memory, ready for a slot); 0: 4 x maxLoras.
  int64_t max_cpu_loras = 0;
  // Adapters loaded at runtime (POST /v1/load_lora_adapter): the Secret (in the model's
  // namespace) whose entries are the admin keys allowed to load and unload them ("": runtime
  // loading off), and the directory their paths are inside (a uri as spec.model.uri's local
  // forms; mounted read-only on every stage pod).
  std::string lora_admin_key_secret;
  std::string lora_source;
  // spec.prefillOf: this model is the prefill role of the named disaggregated model (made by the
  // operator, owned by that model; never written by hand).
  std::string prefill_of;

  int64_t effective_micro_batches() const { return micro_batches > 0 ? micro_batches : pipeline; }
  // Positions the KV cache of each rank holds: a full batch of full-length sequences.
  int64_t kv_cache_tokens() const { return max_batch_size * max_sequence_length; }
  int64_t gpus_per_replica() const { return tensor * pipeline; }
};

struct ShardedModel {
  std::string name;
  std::string namespace_ = "default";
  ShardedModelSpec spec;
};

// The prefill role of a disaggregated spec as a spec of its own: its replicas, shape, nodes and
// rollout, the rest the model's.
ShardedModelSpec PrefillSpec(const ShardedModelSpec& spec);
// The name of a disaggregated model's prefill role on a cluster.
std::string PrefillModelName(const std::string& model);
// The longest name of a disaggregated model (its prefill role's name adds "-prefill").
inline constexpr size_t kMaxDisaggregatedNameLength = 37;

// The serving and start-up settings of `spec` in a worker's contract: its batch, sequence, KV
// cache and chat-content limits, how long it waits for peers and for loading progress (not the
// port, which a deployment chooses).
void ApplyServing(const ShardedModelSpec& spec, WorkerEnv& w);

// Parses one ShardedModel document (YAML or JSON) and validates it. Unknown fields under spec
// are refused by name, so a misspelt field is not silently ignored.
absl::StatusOr<ShardedModel> ParseShardedModel(const std::string& text);
// The same from the object as the apiserver returns it, already parsed (the operator's informer
// cache): read as it is, without printing and parsing it again.
absl::StatusOr<ShardedModel> ParseShardedModelObject(const nlohmann::json& object);

// A list of {name, value} or {name, valueFrom} entries (spec.worker.env, the platform's worker
// defaults); `path` names the list in errors.
absl::StatusOr<std::vector<ShardedModelSpec::EnvVar>> ParseEnvList(const nlohmann::json& list,
                                                                   const std::string& path);

// A memory quantity as Kubernetes writes one: bytes, or with a suffix Ki, Mi, Gi, Ti (powers of
// 1024) or k, M, G, T (of 1000): "80Gi", "81559Mi", "141G". InvalidArgument names `field`.
absl::StatusOr<int64_t> ParseByteQuantity(const std::string& text, const std::string& field);

// The static checks, on their own.
absl::Status ValidateShardedModel(const ShardedModel& model);

}  // namespace shardserve
