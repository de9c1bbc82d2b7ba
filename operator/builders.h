#pragma once
// Pure desired-state builders of the operator (DESIGN.md §4, STYLE.md): from a ShardedModel (as
// the apiserver returns it) and a placement, the objects that should exist. No I/O; one writer
// applies them elsewhere.
//
//   BuildStagePod(model, replica, stage, nodes)  pod <name>-<r>-<s>: T GPUs, pinned to
//       nodes[stage], the replica's whole plan in annotation shardserve.io/placement,
//       hostname/subdomain for rank DNS, labels, owner reference, the worker env and ports of
//       §4, probes, a memory-backed /dev/shm for the TP group, the model volume
//   BuildInspectPod(model)  inspect-<key>: `shardserve-worker inspect` on the model's volume,
//       which reports the model's shape as its termination message (the layer split's input);
//       one per inspection (InspectionKey), shared by the namespace's models that read alike
//   BuildWorkersService(model)  headless <name>-workers (publishNotReadyAddresses) for rank DNS
//   BuildLeaderService(model)   <name> on the leaders of all replicas (the API)
//   BuildNetworkPolicy(model)   <name>-workers: only the model's own pods reach its ranks
//   BuildRendezvousSecret(model, replica, secret)  <name>-<r>-rendezvous: the secret the
//       replica's ranks prove to each other (created once; the operator never reads it back)
//   BuildDisruptionBudget(model, replica, leader pod)  the replica's gang as one budget
//   BuildRouterDeployment(model)  <name>-router: kRouterPods shardserve-router pods in front of
//       the leaders when the model has several replicas (none with one), in the worker image,
//       with the model's files (its tokenizer), the API keys and the router token
//   BuildLeadersService(model)  headless <name>-leaders: the ready leaders the routers resolve
//   BuildRouterTokenSecret(model, token)  <name>-router-token: what a router proves to the
//       leaders' KV events (mounted by the leaders and the routers; created once)
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "api/sharded_model.h"
#include "api/worker_env.h"
#include "plan/layer_split.h"
#include "plan/memory.h"

namespace shardserve::op {

using json = nlohmann::json;

// The labels and ports of the worker contract (kModelLabel, kRendezvousPort, ...) are in
// api/worker_env.h.
using ::shardserve::kMetricsPortBase;
using ::shardserve::kModelLabel;
using ::shardserve::kRendezvousPort;
using ::shardserve::kReplicaLabel;
using ::shardserve::kRevisionLabel;
using ::shardserve::kRoleLabel;
using ::shardserve::kStageLabel;
inline constexpr char kPlacementAnnotation[] = "shardserve.io/placement";
// The inspect pod: its role label, the model uri it reads, and how long it may take.
inline constexpr char kInspectRole[] = "inspect";
inline constexpr char kModelUriAnnotation[] = "shardserve.io/model-uri";
inline constexpr char kInspectionAnnotation[] = "shardserve.io/inspection";  // InspectionKey
inline constexpr int kInspectDeadlineSeconds = 600;
inline constexpr char kRendezvousSecretMount[] = "/var/run/shardserve/rendezvous";
inline constexpr char kApiKeysMount[] = "/var/run/shardserve/api-keys";
inline constexpr char kRouterTokenMount[] = "/var/run/shardserve/router-token";
inline constexpr char kRouterRole[] = "router";
inline constexpr int kRouterPods = 2;
// A deleted worker pod waits this long before its SIGTERM, so that no new request is routed to
// a leader that has begun to drain.
inline constexpr int kPreStopSeconds = 5;
// How long a rank in a pod waits on a silent peer before it calls it frozen. A dead peer's
// connections close at once; silence across pods also comes from a node busy starting and
// stopping other pods, which the local default (2 s) took for a freeze on the real nodes.
inline constexpr int kPeerTimeoutMs = 10000;

// What the platform sets on every worker pod (the chart's `workerDefaults`, given to the
// operator with --worker-defaults): env (NCCL settings and the like; a model's own spec.worker.env
// of the same name wins), resources (requests and limits a model's spec.worker.resources does not
// set), the container's and the pod's securityContext. The defaults match the chart's: the
// image's user, and fsGroup so that the mounted Secrets (mode 0440) are readable by the ranks.
struct WorkerDefaults {
  std::vector<ShardedModelSpec::EnvVar> env;
  // Each node's cache of remote models (hf://, s3://, oci://): a directory of the node's ("{node}"
  // in it is the node's name: a directory per node where nodes share a file system) and the most
  // it may hold (0: no limit; beyond it the least recently used models no pod holds go).
  struct ModelCache {
    std::string host_path = "/var/lib/shardserve/models";
    int64_t size_limit = 0;
  } model_cache;
  json resources = json::object();
  json security_context = {{"runAsNonRoot", true},
                           {"runAsUser", 65532},
                           {"runAsGroup", 65532},
                           {"allowPrivilegeEscalation", false},
                           {"readOnlyRootFilesystem", true},
                           {"capabilities", {{"drop", json::array({"ALL"})}}}};
  json pod_security_context = {{"fsGroup", 65532},
                               {"seccompProfile", {{"type", "RuntimeDefault"}}}};
};

// {"env": [...], "resources": {...}, "securityContext": {...}, "podSecurityContext": {...},
//  "modelCache": {"hostPath": "/var/lib/shardserve/models", "sizeLimit": "500Gi"}};
// absent keys keep the defaults above. InvalidArgument names the key.
absl::StatusOr<WorkerDefaults> ReadWorkerDefaults(const json& j);

// What the platform lets whoever may create a ShardedModel ask for (the chart's
// operator.allowedHostPaths and operator.allowedImages, given with --allowed-host-paths and
// --allowed-images): a hostpath:// model only inside one of `host_paths` (none listed: hostPath
// is refused), an image only with one of `image_prefixes` (none listed: any image). A model
// that asks for more is Invalid, with a condition that says what is allowed.
struct ModelPolicy {
  std::vector<std::string> host_paths;
  std::vector<std::string> image_prefixes;
};

// The bytes of /dev/shm a stage of `tensor` ranks needs: the TP group's shared-memory segment
// (comm/shm_comm.h) and room for NCCL's shared-memory transport.
int64_t ShmSizeBytes(int64_t tensor);

// The model as the builders read it: the parsed spec plus what passes through to pods unchanged.
struct ModelView {
  ShardedModel model;
  std::string uid;
  json resources = json::object();  // spec.worker.resources
  std::string revision;             // hash of everything in the spec that shapes a pod
  WorkerDefaults defaults;
  // The model's footprint, its shape with it (status.model), and the plan's layers of each stage,
  // which every stage pod is given, and what each stage needs of a GPU's memory: the
  // controller's, once the footprint is known.
  std::optional<ModelFootprint> footprint;
  std::string inspection;  // the footprint's InspectionKey
  std::vector<LayerRange> stage_layers;
  std::optional<SpecPlan> memory;
  std::string auto_for;  // parallelism auto: the revision of the spec the sizes were chosen for
  // A remote model as the inspect pod resolved it (status.model.source): the revision every
  // stage fetches, and its directory in a node's cache. Set with the footprint.
  struct Source {
    std::string revision;
    std::string dir;
    int64_t bytes = 0;
    int64_t files = 0;
  };
  std::optional<Source> source;
  // Disaggregated serving (spec.disaggregation): "decode" on the model that declares it (its
  // replicas are the decode role; its routers pair the roles), "prefill" on the ShardedModel the
  // operator makes for the prefill role (spec.prefillOf), "" on a colocated model.
  std::string kv_role;
  // The model whose routers serve this one and whose router token its leaders mount: the
  // decode role's for a prefill role, else its own name.
  const std::string& group() const {
    return model.spec.prefill_of.empty() ? model.name : model.spec.prefill_of;
  }
};

// The plan's sizes into the spec; where parallelism says auto, the revision also hashes them (a
// new choice rolls the replicas) and auto_for keeps the revision they were chosen for.
void SetParallelism(ModelView& m, int64_t tensor, int64_t pipeline);

// Reads a ShardedModel object (JSON from the apiserver). InvalidArgument names the field; a
// file:// model uri is refused here (it only works with `shardserve local`), and so is what
// `policy` does not allow.
absl::StatusOr<ModelView> ReadModel(const json& object, const WorkerDefaults& defaults = {},
                                    const ModelPolicy& policy = {});

json BuildStagePod(const ModelView& m, int64_t replica, int64_t stage,
                   const std::vector<std::string>& nodes);
json BuildInspectPod(const ModelView& m);
// The identity of the inspection BuildInspectPod runs: a digest (16 hex digits) of what its pod
// reads and how (the uri and its revision, the files, the credentials' Secret, the endpoints of
// the worker env, the volumes), not of the model's name, image or scheduling. Models of one
// namespace with one key share one inspection (its result in any of their statuses).
std::string InspectionKey(const ModelView& m);
json BuildWorkersService(const ModelView& m);
// The model's Service (the API): on its router pods when `routers_ready` (the model has several
// replicas and a router pod is ready), else on its leaders, so that one replica, or routers
// that are all down, still serve.
json BuildLeaderService(const ModelView& m, bool routers_ready = false);
json BuildLeadersService(const ModelView& m);
json BuildRouterDeployment(const ModelView& m);
json BuildRouterTokenSecret(const ModelView& m, const std::string& token);
std::string RouterTokenSecretName(const std::string& model);
// Several replicas, none (scaled to zero: the routers hold the requests until one is ready),
// latency targets (a model that scales on them keeps its routers at one replica, which measure
// what clients see and hold requests through a scale to zero and back), or a disaggregated
// model (its routers pair the roles): the routers run. A prefill role never has its own (the
// decode role's route to it).
inline bool Routed(const ModelView& m) {
  const ShardedModelSpec& s = m.model.spec;
  return m.kv_role == "decode" ||
         (m.kv_role.empty() && (s.replicas != 1 || s.slo_ttft_ms > 0 || s.slo_itl_ms > 0));
}
// The prefill role of a disaggregated model `m` (kv_role "decode"), a ShardedModel of its own
// (PrefillModelName) that `m` owns: `object` (m as the apiserver returns it) with the prefill
// role's replicas, parallelism, node selector and rollout, no spec.disaggregation, and
// spec.prefillOf naming m. Its replicas are m's spec.disaggregation.prefill.replicas when it is
// made and whenever that field changes (annotation kPrefillReplicasAnnotation keeps the value
// applied); in between they are `existing`'s (kubectl scale or KEDA on the prefill role's scale
// subresource).
json BuildPrefillModel(const ModelView& m, const json& object, const json* existing);
inline constexpr char kPrefillReplicasAnnotation[] = "shardserve.io/prefill-replicas";
// NetworkPolicy <name>-workers: the model's pods take any traffic from each other (rendezvous,
// TCP/NCCL communication) and only the API and metrics ports from elsewhere.
json BuildNetworkPolicy(const ModelView& m);

// The Secret that the replica's ranks prove at the rendezvous: `secret` under key "secret",
// owned by the model (so it goes with it); mounted by every stage pod of the replica.
json BuildRendezvousSecret(const ModelView& m, int64_t replica, const std::string& secret);
// A PodDisruptionBudget of the replica's gang (every stage pod must stay: evicting one loses the
// whole replica), owned by the replica's leader pod, so it goes when the gang is recreated or
// scaled away. A gang that is already broken may be drained (unhealthyPodEvictionPolicy).
json BuildDisruptionBudget(const ModelView& m, int64_t replica, const std::string& leader_pod,
                           const std::string& leader_uid);

std::string PodName(const std::string& model, int64_t replica, int64_t stage);
std::string RendezvousSecretName(const std::string& model, int64_t replica);
std::string InspectPodName(const std::string& inspection);  // of InspectionKey

}  // namespace shardserve::op
