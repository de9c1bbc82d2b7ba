#include "operator/builders.h"

#include <openssl/sha.h>

#include <algorithm>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "api/adapters.h"
#include "api/router_env.h"
#include "comm/shm_comm.h"
#include "common/status.h"

namespace shardserve::op {
namespace {

constexpr char kModelMount[] = "/models";
constexpr char kCacheMount[] = "/var/lib/shardserve/models";  // the node's cache, in a fetch step
constexpr char kFetchMount[] = "/var/run/shardserve/fetch";
constexpr char kAdminKeysMount[] = "/var/run/shardserve/admin-keys";
constexpr char kFlowControlMount[] = "/var/run/shardserve/flow-control";

bool HasFlowControl(const ShardedModelSpec& s) {
  return !s.flow_control_config_map.empty() || !s.flow_control_secret.empty();
}

std::string FlowControlFile(const ShardedModelSpec& s) {
  return HasFlowControl(s) ? absl::StrCat(kFlowControlMount, "/", s.flow_control_key) : "";
}
constexpr char kCredentialsMount[] = "/var/run/shardserve/model-credentials";

uint64_t Fnv(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

json OwnerReference(const ModelView& m) {
  return {{"apiVersion", kApiVersion}, {"kind", "ShardedModel"},
          {"name", m.model.name},      {"uid", m.uid},
          {"controller", true},        {"blockOwnerDeletion", true}};
}

json Labels(const ModelView& m) { return {{kModelLabel, m.model.name}}; }

// metadata of an object the model owns (services, the network policy).
json ChildMeta(const ModelView& m, const std::string& name) {
  return {{"name", name},
          {"namespace", m.model.namespace_},
          {"labels", Labels(m)},
          {"ownerReferences", json::array({OwnerReference(m)})}};
}

// spec.serving.chatTemplate from a ConfigMap: the leaders' and routers' variable reads its key
// (the kubelet fills it in; a ConfigMap or key that is missing holds the pod, named in status).
void AddChatTemplateRef(const ShardedModelSpec& s, json& env) {
  if (s.chat_template_config_map.empty()) return;
  env.push_back({{"name", kChatTemplateEnv},
                 {"valueFrom",
                  {{"configMapKeyRef",
                    {{"name", s.chat_template_config_map}, {"key", s.chat_template_key}}}}}});
}

// The spec's env for a container: the platform's defaults, then the model's own (same name wins).
json SpecEnv(const ModelView& m) {
  const ShardedModelSpec& s = m.model.spec;
  auto entry = [](const ShardedModelSpec::EnvVar& e) {
    return e.value_from.empty() ? json{{"name", e.name}, {"value", e.value}}
                                : json{{"name", e.name}, {"valueFrom", json::parse(e.value_from)}};
  };
  json env = json::array();
  for (const ShardedModelSpec::EnvVar& e : m.defaults.env) {
    const bool overridden = std::any_of(s.env.begin(), s.env.end(),
                                        [&](const auto& own) { return own.name == e.name; });
    if (!overridden) env.push_back(entry(e));
  }
  for (const ShardedModelSpec::EnvVar& e : s.env) env.push_back(entry(e));
  return env;
}

// Where a pod finds the model's files: its volumes, the mounts of the container that reads
// them, the path it reads, and for a remote model the init container that fetches them first.
struct ModelFiles {
  json volumes = json::array();
  json mounts = json::array();
  std::string path;
  json init = nullptr;
  json more_init = json::array();  // a remote adapter's fetch steps (StageAdapterFiles)
};

// What a fetch step fetches: `uri` (a remote one), pinned to `revision` when known, the files
// `patterns` choose; `progress`: on the first metrics port (the model's step, which the operator
// reads while the pod initializes).
struct FetchSource {
  std::string uri, revision;
  std::vector<std::string> patterns;
  bool progress = true;
};
json FetchContainer(const ModelView& m, const std::string& name, const FetchSource& src,
                    const std::string& cache, json mounts, std::vector<std::string> extra,
                    json security_context, json& volumes);

// The files of one more model a rank reads besides the model (an adapter, a draft model), from
// `uri_text` (checked by ReadModel): its volume `volume` read-only at `at` (its claim; its host
// path, of hostPath type `host_type` ("": any); or for a remote one a volume of `size` that a
// fetch step named `fetch` fills, linking `at`/`link` to it, at the same path in the step and in
// the rank, so that the link resolves), added to `f`; the path the rank reads.
struct UriFiles {
  std::string volume, at, fetch, size, link, host_type;
};
std::string AddUriFiles(const ModelView& m, const std::string& uri_text, const UriFiles& u,
                        ModelFiles& f) {
  const ModelUri uri = *ParseModelUri(uri_text);
  const std::string& volume = u.volume;
  const std::string& at = u.at;
  std::string path = at;
  if (uri.remote()) {
    f.volumes.push_back({{"name", volume}, {"emptyDir", {{"sizeLimit", u.size}}}});
    path = absl::StrCat(at, "/", u.link);
    f.more_init.push_back(FetchContainer(m, u.fetch, {uri_text, "", {}, false},
                                         absl::StrCat(at, "/cache"),
                                         json::array({{{"name", volume}, {"mountPath", at}}}),
                                         {"--link", path}, m.defaults.security_context, f.volumes));
  } else if (uri.scheme == ModelUri::Scheme::kPvc) {
    f.volumes.push_back(
        {{"name", volume},
         {"persistentVolumeClaim", {{"claimName", uri.claim}, {"readOnly", true}}}});
    path = absl::StrCat(at, "/", uri.path);
  } else {
    json host = {{"path", uri.path}};
    if (!u.host_type.empty()) host["type"] = u.host_type;
    f.volumes.push_back({{"name", volume}, {"hostPath", host}});
  }
  f.mounts.push_back({{"name", volume}, {"mountPath", at}, {"readOnly", true}});
  return path;
}

// The leader's draft model (spec.serving.speculative.draftModel), read-only at kDraftMount: the
// path its rank reads (SHARDSERVE_DRAFT_MODEL).
constexpr char kDraftMount[] = "/draft";
ModelFiles DraftFiles(const ModelView& m, std::string* path) {
  ModelFiles f;
  const std::string& uri = m.model.spec.draft_model;
  // A directory or a GGUF file.
  if (!uri.empty())
    *path = AddUriFiles(m, uri, {"draft", kDraftMount, "fetch-draft", "64Gi", "model", ""}, f);
  return f;
}

// A stage's LoRA adapters (spec.adapters): each one's volume (its claim or its host directory),
// read-only at kAdapterMount/N, and the directories the ranks read (SHARDSERVE_LORA_ADAPTERS);
// and the directory of the adapters loaded at runtime (spec.lora.source), read-only at
// kAdapterDynamicMount: `root` (SHARDSERVE_LORA_ROOT).
constexpr char kAdapterMount[] = "/adapters";
constexpr char kAdapterDynamicMount[] = "/adapters/dynamic";
ModelFiles StageAdapterFiles(const ModelView& m, std::vector<AdapterRef>& refs, std::string* root) {
  ModelFiles f;
  const auto& adapters = m.model.spec.adapters;
  for (size_t i = 0; i < adapters.size(); ++i) {
    // Adapters are small: a remote one is fetched into a volume of its own, no node cache.
    const UriFiles u = {absl::StrCat("adapter-", i),
                        absl::StrCat(kAdapterMount, "/", i),
                        absl::StrCat("fetch-adapter-", i),
                        "4Gi",
                        "adapter",
                        "Directory"};
    refs.push_back({adapters[i].name, AddUriFiles(m, adapters[i].uri, u, f)});
  }
  if (!m.model.spec.lora_source.empty()) {  // where adapters loaded at runtime are
    const ModelUri uri = *ParseModelUri(m.model.spec.lora_source);  // checked by ReadModel
    if (uri.scheme == ModelUri::Scheme::kPvc) {
      f.volumes.push_back(
          {{"name", "adapters-dynamic"},
           {"persistentVolumeClaim", {{"claimName", uri.claim}, {"readOnly", true}}}});
      *root = absl::StrCat(kAdapterDynamicMount, "/", uri.path);
    } else {
      f.volumes.push_back({{"name", "adapters-dynamic"},
                           {"hostPath", {{"path", uri.path}, {"type", "Directory"}}}});
      *root = kAdapterDynamicMount;
    }
    f.mounts.push_back(
        {{"name", "adapters-dynamic"}, {"mountPath", kAdapterDynamicMount}, {"readOnly", true}});
  }
  return f;
}

// The fetch step of a remote model (`shardserve fetch`, cli/fetch.h): pinned to the revision the
// inspect pod resolved, its credentials (spec.model.secret) mounted here only, its progress on
// the first metrics port (the operator reads /startupz there while the pod initializes).
json FetchContainer(const ModelView& m, const std::string& name, const FetchSource& src,
                    const std::string& cache, json mounts, std::vector<std::string> extra,
                    json security_context, json& volumes) {
  const ShardedModelSpec& s = m.model.spec;
  json command = {"shardserve", "fetch", "--uri", src.uri, "--cache", cache};
  if (src.progress) {
    command.push_back("--progress-port");
    command.push_back(std::to_string(kMetricsPortBase));
  }
  if (!src.revision.empty()) {
    command.push_back("--revision");
    command.push_back(src.revision);
  }
  if (!src.patterns.empty()) {
    command.push_back("--files");
    command.push_back(absl::StrJoin(src.patterns, ","));
  }
  if (!s.model_secret.empty()) {  // the model's credentials serve its adapters' sources too
    volumes.push_back({{"name", "model-credentials"},
                       {"secret", {{"secretName", s.model_secret}, {"defaultMode", 0440}}}});
    mounts.push_back(
        {{"name", "model-credentials"}, {"mountPath", kCredentialsMount}, {"readOnly", true}});
    command.push_back("--credentials");
    command.push_back(kCredentialsMount);
  }
  for (std::string& e : extra) command.push_back(std::move(e));
  json ports = json::array();
  if (src.progress) ports.push_back({{"name", "fetch"}, {"containerPort", kMetricsPortBase}});
  return {
      {"name", name},
      {"image", s.image},
      {"command", command},
      {"env", SpecEnv(m)},  // endpoints and regions (AWS_ENDPOINT_URL, HF_ENDPOINT, ...)
      {"ports", ports},
      {"terminationMessagePolicy", "FallbackToLogsOnError"},
      {"volumeMounts", mounts},
      {"securityContext", security_context},
      {"resources",
       {{"requests", {{"cpu", "100m"}, {"memory", "128Mi"}}}, {"limits", {{"memory", "1Gi"}}}}}};
}

// The model's source, pinned once the inspect pod resolved it (a router built before has none, and
// no pods).
FetchSource ModelFetchSource(const ModelView& m) {
  return {m.model.spec.model_uri, m.source ? m.source->revision : "", m.model.spec.model_files};
}

// A stage's model. pvc:// and hostpath://: the volume, read-only. A remote model: the node's
// model cache (a hostPath the platform sets), fetched into by the init container, which alone
// mounts the whole cache (as root: the directory is the node's; no capability); the ranks mount
// their model's directory only (subPath), read-only, so no pod reads or writes another model's
// files; the fetch's report reaches the ranks' metrics through a small emptyDir.
ModelFiles StageModelFiles(const ModelView& m, const std::string& node) {
  const ModelUri uri = *ParseModelUri(m.model.spec.model_uri);  // checked by ReadModel
  ModelFiles f;
  if (!uri.remote()) {
    if (uri.scheme == ModelUri::Scheme::kPvc) {
      f.volumes.push_back(
          {{"name", "model"},
           {"persistentVolumeClaim", {{"claimName", uri.claim}, {"readOnly", true}}}});
      f.path = absl::StrCat(kModelMount, "/", uri.path);
    } else {
      f.volumes.push_back(
          {{"name", "model"}, {"hostPath", {{"path", uri.path}, {"type", "Directory"}}}});
      f.path = kModelMount;
    }
    f.mounts.push_back({{"name", "model"}, {"mountPath", kModelMount}, {"readOnly", true}});
    return f;
  }
  f.volumes.push_back(
      {{"name", "model-cache"},
       {"hostPath",
        {{"path", absl::StrReplaceAll(m.defaults.model_cache.host_path, {{"{node}", node}})},
         {"type", "DirectoryOrCreate"}}}});
  f.volumes.push_back({{"name", "fetch"}, {"emptyDir", {{"sizeLimit", "1Mi"}}}});
  // Stage pods are built once the inspect pod resolved the model (its shape, its source); never
  // the whole cache, whatever happens.
  f.mounts.push_back({{"name", "model-cache"},
                      {"mountPath", kModelMount},
                      {"subPath", m.source ? m.source->dir : "unresolved"},
                      {"readOnly", true}});
  f.mounts.push_back({{"name", "fetch"}, {"mountPath", kFetchMount}, {"readOnly", true}});
  f.path = kModelMount;
  json security = m.defaults.security_context;
  security["runAsUser"] = 0;
  security["runAsGroup"] = 0;
  security["runAsNonRoot"] = false;
  std::vector<std::string> extra = {"--report", absl::StrCat(kFetchMount, "/report.json")};
  if (m.defaults.model_cache.size_limit > 0) {
    extra.push_back("--cache-limit");
    extra.push_back(std::to_string(m.defaults.model_cache.size_limit));
  }
  // Pinned to the revision the inspect pod resolved (stage pods are built once it did).
  f.init = FetchContainer(m, "fetch", ModelFetchSource(m), kCacheMount,
                          json::array({{{"name", "model-cache"}, {"mountPath", kCacheMount}},
                                       {{"name", "fetch"}, {"mountPath", kFetchMount}}}),
                          std::move(extra), security, f.volumes);
  return f;
}

// A router's model: what it reads is the tokenizer and the config, so a remote model's small
// files only (no weights), fetched into an emptyDir of the pod.
ModelFiles RouterModelFiles(const ModelView& m) {
  const ModelUri uri = *ParseModelUri(m.model.spec.model_uri);  // checked by ReadModel
  if (!uri.remote()) return StageModelFiles(m, "");
  ModelFiles f;
  f.volumes.push_back({{"name", "model"}, {"emptyDir", {{"sizeLimit", "1Gi"}}}});
  f.mounts.push_back({{"name", "model"}, {"mountPath", kModelMount}, {"readOnly", true}});
  f.path = absl::StrCat(kModelMount, "/model");
  f.init = FetchContainer(m, "fetch", ModelFetchSource(m), absl::StrCat(kModelMount, "/cache"),
                          json::array({{{"name", "model"}, {"mountPath", kModelMount}}}),
                          {"--small", "--link", f.path}, m.defaults.security_context, f.volumes);
  return f;
}

// The spec's node selector and tolerations, on a pod spec.
void AddScheduling(const ShardedModelSpec& s, json& spec) {
  if (!s.node_selector.empty()) spec["nodeSelector"] = s.node_selector;
  for (const Toleration& t : s.tolerations) {
    json tol = {{"operator", t.op}};
    if (!t.key.empty()) tol["key"] = t.key;
    if (!t.value.empty()) tol["value"] = t.value;
    if (!t.effect.empty()) tol["effect"] = t.effect;
    if (t.seconds) tol["tolerationSeconds"] = *t.seconds;
    spec["tolerations"].push_back(std::move(tol));
  }
}

// What a leader and a router mount: the API keys (when the model has them) and the router token.
void AddLeaderSecrets(const ModelView& m, json& volumes, json& mounts) {
  const ShardedModelSpec& s = m.model.spec;
  if (!s.api_key_secret.empty()) {
    volumes.push_back({{"name", "api-keys"},
                       {"secret", {{"secretName", s.api_key_secret}, {"defaultMode", 0440}}}});
    mounts.push_back({{"name", "api-keys"}, {"mountPath", kApiKeysMount}, {"readOnly", true}});
  }
  if (HasFlowControl(s)) {  // tenants' classes and limits, read again when they change
    json source =
        s.flow_control_secret.empty()
            ? json{{"configMap", {{"name", s.flow_control_config_map}}}}
            : json{{"secret", {{"secretName", s.flow_control_secret}, {"defaultMode", 0440}}}};
    source["name"] = "flow-control";
    volumes.push_back(std::move(source));
    mounts.push_back(
        {{"name", "flow-control"}, {"mountPath", kFlowControlMount}, {"readOnly", true}});
  }
  if (!s.lora_admin_key_secret.empty()) {  // who may load adapters at runtime
    volumes.push_back(
        {{"name", "admin-keys"},
         {"secret", {{"secretName", s.lora_admin_key_secret}, {"defaultMode", 0440}}}});
    mounts.push_back({{"name", "admin-keys"}, {"mountPath", kAdminKeysMount}, {"readOnly", true}});
  }
  volumes.push_back(
      {{"name", "router-token"},
       {"secret", {{"secretName", RouterTokenSecretName(m.group())}, {"defaultMode", 0440}}}});
  mounts.push_back(
      {{"name", "router-token"}, {"mountPath", kRouterTokenMount}, {"readOnly", true}});
}

}  // namespace

std::string PodName(const std::string& model, int64_t replica, int64_t stage) {
  return absl::StrCat(model, "-", replica, "-", stage);
}

std::string InspectPodName(const std::string& inspection) { return "inspect-" + inspection; }

std::string RouterTokenSecretName(const std::string& model) { return model + "-router-token"; }

std::string RendezvousSecretName(const std::string& model, int64_t replica) {
  return absl::StrCat(model, "-", replica, "-rendezvous");
}

int64_t ShmSizeBytes(int64_t tensor) {
  constexpr int64_t kMiB = 1 << 20;
  constexpr int64_t kNcclPerRank = 64 * kMiB;  // NCCL's shared-memory transport and proxies
  const int64_t bytes =
      static_cast<int64_t>(ShmSegmentBytes(static_cast<int>(tensor))) + tensor * kNcclPerRank;
  return (bytes + kMiB - 1) / kMiB * kMiB;
}

absl::StatusOr<WorkerDefaults> ReadWorkerDefaults(const json& j) {
  WorkerDefaults d;
  if (!j.is_object()) return absl::InvalidArgumentError("worker defaults must be an object");
  for (const auto& [k, v] : j.items()) {
    if (k == "env") {
      ASSIGN_OR_RETURN(d.env, ParseEnvList(v, "worker defaults: env"));
    } else if (k == "resources") {
      if (!v.is_object()) {
        return absl::InvalidArgumentError("worker defaults: resources must be an object");
      }
      for (const auto& [part, list] : v.items()) {
        if ((part != "requests" && part != "limits") || !list.is_object()) {
          return absl::InvalidArgumentError(absl::StrCat("worker defaults: resources.", part,
                                                         " is not requests or limits (an object)"));
        }
      }
      d.resources = v;
    } else if (k == "securityContext" || k == "podSecurityContext") {
      if (!v.is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat("worker defaults: ", k, " must be an object"));
      }
      (k == "securityContext" ? d.security_context : d.pod_security_context) = v;
    } else if (k == "modelCache") {
      if (!v.is_object()) {
        return absl::InvalidArgumentError("worker defaults: modelCache must be an object");
      }
      for (const auto& [field, value] : v.items()) {
        if (field == "hostPath" && value.is_string() &&
            absl::StartsWith(value.get<std::string>(), "/") &&
            value.get<std::string>().find("..") == std::string::npos) {
          d.model_cache.host_path = value.get<std::string>();
        } else if (field == "sizeLimit" && value == "0") {
          d.model_cache.size_limit = 0;  // no limit
        } else if (field == "sizeLimit" && value.is_string()) {
          ASSIGN_OR_RETURN(
              d.model_cache.size_limit,
              ParseByteQuantity(value.get<std::string>(), "worker defaults: modelCache.sizeLimit"));
        } else if (field == "sizeLimit" && value.is_number_unsigned()) {
          d.model_cache.size_limit = value.get<int64_t>();
        } else {
          return absl::InvalidArgumentError(
              absl::StrCat("worker defaults: modelCache.", field,
                           " is not hostPath (an absolute path) or sizeLimit (a quantity)"));
        }
      }
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("worker defaults: unknown key '", k,
                       "' (env, resources, securityContext, podSecurityContext, modelCache)"));
    }
  }
  return d;
}

namespace {

// A hostPath directory inside one of the allowed ones: both absolute, no '.' or '..' steps or
// empty ones, compared step by step ("/models" allows "/models/x", not "/models-x").
absl::Status CheckHostPath(const std::string& path, const std::vector<std::string>& allowed,
                           const std::string& field) {
  auto steps = [](const std::string& p) -> std::optional<std::vector<std::string>> {
    if (p.empty() || p[0] != '/') return std::nullopt;
    std::vector<std::string> out;
    for (absl::string_view step : absl::StrSplit(p.substr(1), '/')) {
      if (step == "." || step == "..") return std::nullopt;
      if (!step.empty()) out.emplace_back(step);
    }
    return out;
  };
  const auto want = steps(path);
  if (!want) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": the host path '", path, "' must be absolute, without '.' or '..'"));
  }
  for (const std::string& a : allowed) {
    const auto root = steps(a);
    if (root && root->size() <= want->size() &&
        std::equal(root->begin(), root->end(), want->begin())) {
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": the host path '", path, "' is not inside a directory the platform allows (",
      allowed.empty() ? "none: hostPath models are off"
                      : absl::StrCat("operator.allowedHostPaths: ", absl::StrJoin(allowed, ", ")),
      "); use pvc://CLAIM/PATH"));
}

// A URI that `field` gives for a pod to read: not file:// (only shardserve local reads one), a
// host path inside the platform's.
absl::Status CheckClusterUri(const std::string& text, const std::string& field,
                             const ModelPolicy& policy) {
  ASSIGN_OR_RETURN(const ModelUri at, ParseModelUri(text));
  if (at.scheme == ModelUri::Scheme::kFile) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " '", text,
                     "' is a file:// uri, which only shardserve local reads; on a cluster use "
                     "pvc:// or hostpath://"));
  }
  if (at.scheme == ModelUri::Scheme::kHostPath) {
    return CheckHostPath(at.path, policy.host_paths, field);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelView> ReadModel(const json& object, const WorkerDefaults& defaults,
                                    const ModelPolicy& policy) {
  ModelView v;
  v.defaults = defaults;
  ASSIGN_OR_RETURN(v.model, ParseShardedModelObject(object));
  const json& meta = object.at("metadata");
  v.uid = meta.value("uid", "");
  if (meta.contains("namespace")) v.model.namespace_ = meta["namespace"].get<std::string>();
  const json& worker = object["spec"]["worker"];
  if (worker.contains("resources")) v.resources = worker["resources"];
  if (v.model.spec.disaggregation) v.kv_role = "decode";
  if (const std::string& of = v.model.spec.prefill_of; !of.empty()) {
    // Only the operator makes a prefill role: owned by the model it serves, which alone routes
    // to it and lends it its router token.
    const json owners = meta.value("ownerReferences", json::array());
    const bool owned =
        owners.is_array() && std::any_of(owners.begin(), owners.end(), [&](const json& o) {
          return o.is_object() && o.value("kind", "") == "ShardedModel" &&
                 o.value("name", "") == of && o.value("controller", false);
        });
    if (!owned || v.model.name != PrefillModelName(of)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.prefillOf '", of, "': this model is not ", PrefillModelName(of),
          " owned by ShardedModel '", of,
          "' (the operator makes a disaggregated model's prefill role; remove spec.prefillOf)"));
    }
    v.kv_role = "prefill";
  }
  RETURN_IF_ERROR(CheckClusterUri(v.model.spec.model_uri, "spec.model.uri", policy));
  for (size_t i = 0; i < v.model.spec.adapters.size(); ++i) {
    RETURN_IF_ERROR(CheckClusterUri(v.model.spec.adapters[i].uri,
                                    absl::StrCat("spec.adapters[", i, "].uri"), policy));
  }
  if (const std::string& source = v.model.spec.lora_source; !source.empty()) {
    RETURN_IF_ERROR(CheckClusterUri(source, "spec.lora.source", policy));
  }
  if (const std::string& draft = v.model.spec.draft_model; !draft.empty()) {
    RETURN_IF_ERROR(CheckClusterUri(draft, "spec.serving.speculative.draftModel", policy));
  }
  const std::string& image = v.model.spec.image;
  if (!policy.image_prefixes.empty() &&
      std::none_of(policy.image_prefixes.begin(), policy.image_prefixes.end(),
                   [&](const std::string& p) { return absl::StartsWith(image, p); })) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.worker.image '", image, "' is not from a source the platform allows (",
                     "operator.allowedImages: ", absl::StrJoin(policy.image_prefixes, ", "), ")"));
  }
  // Everything that shapes a pod; a change rolls the replicas.
  json shaping = {object["spec"]["model"], object["spec"]["parallelism"], worker,
                  object["spec"].value("serving", json::object()), v.kv_role};
  for (const char* field : {"adapters", "lora"}) {  // (absent: the revision a model had before)
    if (object["spec"].contains(field)) shaping.push_back(object["spec"][field]);
  }
  v.revision = absl::StrFormat("%012x", Fnv(shaping.dump()) & 0xffffffffffffull);
  return v;
}

void SetParallelism(ModelView& m, int64_t tensor, int64_t pipeline) {
  ShardedModelSpec& s = m.model.spec;
  s.tensor = tensor;
  s.pipeline = pipeline;
  if (!s.tensor_auto && !s.pipeline_auto) return;
  m.auto_for = m.revision;
  m.revision = absl::StrFormat(
      "%012x", Fnv(absl::StrCat(m.revision, "/", tensor, "x", pipeline)) & 0xffffffffffffull);
}

json BuildStagePod(const ModelView& m, int64_t replica, int64_t stage,
                   const std::vector<std::string>& nodes) {
  const std::string& node = nodes.at(stage);
  const ShardedModelSpec& s = m.model.spec;
  const std::string& name = m.model.name;
  const std::string pod = PodName(name, replica, stage);
  const std::string workers = name + "-workers";
  const ModelFiles files = StageModelFiles(m, node);
  std::vector<AdapterRef> adapters;
  std::string lora_root;
  const ModelFiles adapter_files = StageAdapterFiles(m, adapters, &lora_root);
  const bool leader = stage == 0;
  std::string draft_path;  // the leader runs the draft model
  const ModelFiles draft_files = leader ? DraftFiles(m, &draft_path) : ModelFiles{};

  json labels = Labels(m);
  labels[kReplicaLabel] = std::to_string(replica);
  labels[kStageLabel] = std::to_string(stage);
  labels[kRevisionLabel] = m.revision;
  labels[kRoleLabel] = leader ? "leader" : "worker";

  WorkerEnv w;
  w.model_name = s.model_name;
  // The metrics' `model` label: a prefill role's are its model's (their `role` label tells them
  // apart), as with shardserve local, so that a dashboard or a KEDA query sees one model.
  w.deployment = m.group();
  w.model_path = files.path;
  if (!files.init.is_null()) w.fetch_report = absl::StrCat(kFetchMount, "/report.json");
  w.replica = replica;
  w.stage = stage;
  w.stage_layers = FormatStageLayers(m.stage_layers);
  w.tp = static_cast<int>(s.tensor);
  w.pp = static_cast<int>(s.pipeline);
  w.leader_addr = absl::StrCat(PodName(name, replica, 0), ".", workers, ".", m.model.namespace_,
                               ".svc:", kRendezvousPort);
  w.microbatches = static_cast<int>(s.effective_micro_batches());
  w.job_id = absl::StrCat(name, "-", replica);
  w.api_port = static_cast<int>(s.port);
  ApplyServing(s, w);
  w.lora_adapters = EncodeAdapterList(adapters);
  w.lora_root = lora_root;
  w.draft_model = draft_path;
  w.host = absl::StrCat(pod, ".", workers, ".", m.model.namespace_, ".svc");
  w.rendezvous_secret_file = absl::StrCat(kRendezvousSecretMount, "/secret");
  w.termination_log = "/dev/termination-log";  // the first rank error, for status
  w.peer_timeout_ms = kPeerTimeoutMs;
  w.kv_role = m.kv_role;
  if (leader && !s.api_key_secret.empty()) w.api_keys_file = kApiKeysMount;
  if (leader && !s.lora_admin_key_secret.empty()) w.admin_keys_file = kAdminKeysMount;
  if (leader) w.router_token_file = absl::StrCat(kRouterTokenMount, "/token");
  if (leader) w.flow_control_file = FlowControlFile(s);
  json env = json::array();
  for (const auto& [k, v] : w.ToEnv()) env.push_back({{"name", k}, {"value", v}});
  // The rendezvous and the mesh listen on the pod's own address only.
  env.push_back(
      {{"name", kPodIpEnv}, {"valueFrom", {{"fieldRef", {{"fieldPath", "status.podIP"}}}}}});
  // The metrics' `node` label.
  env.push_back(
      {{"name", kNodeNameEnv}, {"valueFrom", {{"fieldRef", {{"fieldPath", "spec.nodeName"}}}}}});
  for (json& e : SpecEnv(m)) env.push_back(std::move(e));
  if (leader) AddChatTemplateRef(s, env);

  json ports = json::array({{{"name", "rendezvous"}, {"containerPort", kRendezvousPort}}});
  if (leader) ports.push_back({{"name", "api"}, {"containerPort", s.port}});
  for (int64_t t = 0; t < s.tensor; ++t) {
    ports.push_back(
        {{"name", absl::StrCat("metrics-", t)}, {"containerPort", kMetricsPortBase + t}});
  }

  // The model's own requests and limits, then the platform's for what it leaves unset.
  json resources = m.resources;
  for (const char* part : {"requests", "limits"}) {
    const json platform = m.defaults.resources.value(part, json::object());
    for (const auto& [name, quantity] : platform.items()) {
      if (!resources[part].contains(name)) resources[part][name] = quantity;
    }
  }
  resources["limits"][s.gpu_resource] = std::to_string(s.tensor);
  resources["requests"][s.gpu_resource] = std::to_string(s.tensor);

  // Readiness: the leader is ready when its /readyz is (every rank connected and loaded); the
  // other stages when their rank-0 metrics page answers. Loading may take long: startup probe.
  // A replica under full load (the other one rolling) may answer a probe late: 5 s, not
  // Kubernetes' 1 s, before a probe counts as failed; a dead rank refuses at once either way.
  json ready_probe = leader ? json{{"httpGet", {{"path", "/readyz"}, {"port", s.port}}}}
                            : json{{"httpGet", {{"path", "/metrics"}, {"port", kMetricsPortBase}}}};
  ready_probe["periodSeconds"] = 5;
  ready_probe["timeoutSeconds"] = 5;
  ready_probe["failureThreshold"] = 3;
  const json startup_probe = {
      {"tcpSocket", {{"port", kMetricsPortBase}}}, {"periodSeconds", 5}, {"failureThreshold", 360}};
  const json liveness_probe = {
      {"tcpSocket", {{"port", kMetricsPortBase}}}, {"periodSeconds", 10}, {"failureThreshold", 3}};

  // /dev/shm in memory, bounded by what the stage's TP group maps.
  json volumes = json::array(
      {{{"name", "shm"},
        {"emptyDir",
         {{"medium", "Memory"}, {"sizeLimit", std::to_string(ShmSizeBytes(s.tensor))}}}}});
  for (const ModelFiles* f : {&files, &adapter_files, &draft_files}) {
    for (const json& v : f->volumes) {
      // The fetch steps (the model's, its adapters') share the credentials' volume.
      if (std::none_of(volumes.begin(), volumes.end(),
                       [&](const json& w) { return w["name"] == v["name"]; })) {
        volumes.push_back(v);
      }
    }
  }

  // Secrets the kubelet mounts, readable by the pod's group (fsGroup) only: the replica's
  // rendezvous secret, and on the leader the API keys.
  json mounts = {{{"name", "shm"}, {"mountPath", "/dev/shm"}}};
  for (const ModelFiles* f : {&files, &adapter_files, &draft_files}) {
    for (const json& v : f->mounts) mounts.push_back(v);
  }
  mounts.push_back(
      {{"name", "rendezvous"}, {"mountPath", kRendezvousSecretMount}, {"readOnly", true}});
  volumes.push_back(
      {{"name", "rendezvous"},
       {"secret", {{"secretName", RendezvousSecretName(name, replica)}, {"defaultMode", 0440}}}});
  if (leader) AddLeaderSecrets(m, volumes, mounts);

  json container = {{"name", "worker"},
                    {"image", s.image},
                    {"command", json::array({"shardserve-worker", "launch"})},
                    // A rank that fails writes why to the termination message (or, if it could
                    // not, its last log line stands in): the pod's status carries it, and the
                    // operator's replica message quotes it.
                    {"terminationMessagePath", "/dev/termination-log"},
                    {"terminationMessagePolicy", "FallbackToLogsOnError"},
                    // Before SIGTERM, the replica keeps serving while the Service's endpoints
                    // and kube-proxy forget the leader; then the leader drains what it has.
                    {"lifecycle", {{"preStop", {{"sleep", {{"seconds", kPreStopSeconds}}}}}}},
                    {"env", env},
                    {"ports", ports},
                    {"resources", resources},
                    {"readinessProbe", ready_probe},
                    {"startupProbe", startup_probe},
                    {"livenessProbe", liveness_probe},
                    {"volumeMounts", mounts},
                    {"securityContext", m.defaults.security_context}};

  json spec = {
      {"hostname", pod},
      {"subdomain", workers},
      {"restartPolicy", "Never"},  // a failed rank fails the pod; the operator recreates the gang
      {"automountServiceAccountToken", false},  // a worker never talks to the apiserver
      {"terminationGracePeriodSeconds", 30},
      {"affinity",
       {{"nodeAffinity",
         {{"requiredDuringSchedulingIgnoredDuringExecution",
           {{"nodeSelectorTerms",
             {{{"matchFields",
                {{{"key", "metadata.name"},
                  {"operator", "In"},
                  {"values", json::array({node})}}}}}}}}}}}}},
      {"securityContext", m.defaults.pod_security_context},
      {"containers", json::array({container})},
      {"volumes", volumes}};
  json init = json::array();
  if (!files.init.is_null()) init.push_back(files.init);
  for (const ModelFiles* f : {&adapter_files, &draft_files}) {
    for (const json& c : f->more_init) init.push_back(c);
  }
  if (!init.empty()) spec["initContainers"] = std::move(init);
  AddScheduling(s, spec);

  return {{"apiVersion", "v1"},
          {"kind", "Pod"},
          {"metadata",
           {{"name", pod},
            {"namespace", m.model.namespace_},
            {"labels", labels},
            {"annotations", {{kPlacementAnnotation, absl::StrJoin(nodes, ",")}}},
            {"ownerReferences", json::array({OwnerReference(m)})}}},
          {"spec", spec}};
}

namespace {

// What an inspect pod reads and how: its env, volumes and mounts (BuildInspectPod,
// InspectionKey).
struct InspectReads {
  json env = json::array(), volumes = json::array(), mounts = json::array();
};

InspectReads InspectReadsOf(const ModelView& m) {
  const ShardedModelSpec& s = m.model.spec;
  const ModelUri uri = *ParseModelUri(s.model_uri);  // checked by ReadModel
  WorkerEnv w;
  w.termination_log = "/dev/termination-log";
  json volumes = json::array(), mounts = json::array();
  if (uri.remote()) {
    // Listed (its revision pinned for the stages) with the model's credentials, and its small
    // files (config, tokenizer) fetched into a scratch directory where they are read.
    w.model_uri = s.model_uri;
    w.model_files = absl::StrJoin(s.model_files, ",");
    w.model_path = kModelMount;
    volumes.push_back({{"name", "model"}, {"emptyDir", {{"sizeLimit", "1Gi"}}}});
    mounts.push_back({{"name", "model"}, {"mountPath", kModelMount}});
    if (!s.model_secret.empty()) {
      w.credentials_dir = kCredentialsMount;
      volumes.push_back({{"name", "model-credentials"},
                         {"secret", {{"secretName", s.model_secret}, {"defaultMode", 0440}}}});
      mounts.push_back(
          {{"name", "model-credentials"}, {"mountPath", kCredentialsMount}, {"readOnly", true}});
    }
  } else {
    const ModelFiles files = StageModelFiles(m, "");
    w.model_path = files.path;
    volumes = files.volumes;
    mounts = files.mounts;
  }
  json env = json::array();
  for (const auto& [k, v] : w.ToEnv()) env.push_back({{"name", k}, {"value", v}});
  if (uri.remote()) {
    for (json& e : SpecEnv(m)) env.push_back(std::move(e));
  }
  return {std::move(env), std::move(volumes), std::move(mounts)};
}

}  // namespace

std::string InspectionKey(const ModelView& m) {
  const InspectReads r = InspectReadsOf(m);
  const std::string what =
      json{{"env", r.env}, {"volumes", r.volumes}, {"mounts", r.mounts}}.dump();
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(what.data()), what.size(), digest);
  std::string hex;
  for (int i = 0; i < 8; ++i) absl::StrAppend(&hex, absl::Hex(digest[i], absl::kZeroPad2));
  return hex;
}

json BuildInspectPod(const ModelView& m) {
  const ShardedModelSpec& s = m.model.spec;
  InspectReads r = InspectReadsOf(m);
  const std::string key = InspectionKey(m);
  json labels = Labels(m);
  labels[kRoleLabel] = kInspectRole;
  json container = {{"name", "inspect"},
                    {"image", s.image},
                    {"command", json::array({"shardserve-worker", "inspect"})},
                    {"terminationMessagePath", "/dev/termination-log"},
                    {"terminationMessagePolicy", "FallbackToLogsOnError"},
                    {"env", std::move(r.env)},
                    {"volumeMounts", std::move(r.mounts)},
                    {"securityContext", m.defaults.security_context},
                    // It reads a config and a tokenizer: small, and stated, so that a namespace
                    // whose quota wants requests and limits admits it (and no GPU).
                    {"resources",
                     {{"requests", {{"cpu", "100m"}, {"memory", "256Mi"}}},
                      {"limits", {{"cpu", "1"}, {"memory", "2Gi"}}}}}};
  json spec = {{"restartPolicy", "Never"},
               {"automountServiceAccountToken", false},
               {"activeDeadlineSeconds", kInspectDeadlineSeconds},
               {"terminationGracePeriodSeconds", 5},
               {"securityContext", m.defaults.pod_security_context},
               {"containers", json::array({container})},
               {"volumes", std::move(r.volumes)}};
  AddScheduling(s, spec);
  return {{"apiVersion", "v1"},
          {"kind", "Pod"},
          {"metadata",
           {{"name", InspectPodName(key)},
            {"namespace", m.model.namespace_},
            {"labels", labels},
            {"annotations", {{kModelUriAnnotation, s.model_uri}, {kInspectionAnnotation, key}}},
            {"ownerReferences", json::array({OwnerReference(m)})}}},
          {"spec", spec}};
}

json BuildWorkersService(const ModelView& m) {
  return {{"apiVersion", "v1"},
          {"kind", "Service"},
          {"metadata", ChildMeta(m, m.model.name + "-workers")},
          {"spec",
           {{"clusterIP", "None"},
            {"publishNotReadyAddresses", true},  // ranks find each other before they are ready
            {"selector", Labels(m)},
            {"ports", {{{"name", "rendezvous"}, {"port", kRendezvousPort}}}}}}};
}

json BuildLeaderService(const ModelView& m, bool routers_ready) {
  json selector = Labels(m);
  selector[kRoleLabel] = Routed(m) && routers_ready ? kRouterRole : "leader";
  return {
      {"apiVersion", "v1"},
      {"kind", "Service"},
      {"metadata", ChildMeta(m, m.model.name)},
      {"spec",
       {{"selector", selector},
        {"ports",
         {{{"name", "api"}, {"port", m.model.spec.port}, {"targetPort", m.model.spec.port}}}}}}};
}

json BuildLeadersService(const ModelView& m) {
  json selector = Labels(m);
  selector[kRoleLabel] = "leader";
  return {
      {"apiVersion", "v1"},
      {"kind", "Service"},
      {"metadata", ChildMeta(m, m.model.name + "-leaders")},
      {"spec",
       {{"clusterIP", "None"},
        {"publishNotReadyAddresses", false},  // a router follows the ready leaders only
        {"selector", selector},
        {"ports",
         {{{"name", "api"}, {"port", m.model.spec.port}, {"targetPort", m.model.spec.port}}}}}}};
}

json BuildRouterDeployment(const ModelView& m) {
  const ShardedModelSpec& s = m.model.spec;
  const std::string& name = m.model.name;
  const ModelFiles files = RouterModelFiles(m);
  json labels = Labels(m);
  labels[kRoleLabel] = kRouterRole;
  RouterEnv r;  // the router's contract (api/router_env.h)
  r.leaders = absl::StrCat("dns:", name, "-leaders.", m.model.namespace_, ".svc:", s.port);
  r.port = static_cast<int>(s.port);
  r.model_path = files.path;
  r.deployment = name;
  r.token_file = absl::StrCat(kRouterTokenMount, "/token");
  if (const auto& d = s.disaggregation) {
    r.prefill_leaders = absl::StrCat("dns:", PrefillModelName(name), "-leaders.",
                                     m.model.namespace_, ".svc:", s.port);
    r.disaggregate_min_tokens = d->min_prompt_tokens;
  }
  if (!s.api_key_secret.empty()) r.api_keys_file = kApiKeysMount;
  r.flow_control_file = FlowControlFile(s);
  r.flow_share = kRouterPods;         // kube-proxy spreads a key's requests over them
  r.metrics_port = kMetricsPortBase;  // as rank 0's: the chart's PodMonitor scrapes it
  ApplyServing(s, r);
  json env = json::array();
  for (const auto& [k, v] : r.ToEnv()) env.push_back({{"name", k}, {"value", v}});
  AddChatTemplateRef(s, env);
  json volumes = files.volumes;
  json mounts = files.mounts;
  AddLeaderSecrets(m, volumes, mounts);
  json probe = {{"httpGet", {{"path", "/readyz"}, {"port", s.port}}},
                {"periodSeconds", 2},
                {"timeoutSeconds", 5},
                {"failureThreshold", 3}};
  json container = {
      {"name", "router"},
      {"image", s.image},
      {"command", json::array({"shardserve-router"})},
      {"env", env},
      {"ports", json::array({{{"name", "api"}, {"containerPort", s.port}},
                             {{"name", "metrics-0"}, {"containerPort", kMetricsPortBase}}})},
      {"resources", {{"requests", {{"cpu", "100m"}, {"memory", "256Mi"}}}}},
      {"readinessProbe", probe},
      {"livenessProbe",
       {{"httpGet", {{"path", "/healthz"}, {"port", s.port}}}, {"periodSeconds", 10}}},
      // Before SIGTERM, kube-proxy forgets the router; then it finishes what it relays.
      {"lifecycle", {{"preStop", {{"sleep", {{"seconds", kPreStopSeconds}}}}}}},
      {"volumeMounts", mounts},
      {"securityContext", m.defaults.security_context}};
  json pod_spec = {
      {"automountServiceAccountToken", false},  // a router never talks to the apiserver
      {"terminationGracePeriodSeconds", 40},    // it finishes what it relays (30 s)
      {"securityContext", m.defaults.pod_security_context},
      // The two on different nodes where there are: one node lost keeps a router.
      {"affinity",
       {{"podAntiAffinity",
         {{"preferredDuringSchedulingIgnoredDuringExecution",
           json::array({{{"weight", 100},
                         {"podAffinityTerm",
                          {{"topologyKey", "kubernetes.io/hostname"},
                           {"labelSelector", {{"matchLabels", labels}}}}}}})}}}}},
      {"containers", json::array({container})},
      {"volumes", volumes}};
  if (!files.init.is_null()) pod_spec["initContainers"] = json::array({files.init});
  AddScheduling(s, pod_spec);  // the nodes that have the model's files
  json meta = ChildMeta(m, name + "-router");
  meta["labels"][kRoleLabel] = kRouterRole;
  return {
      {"apiVersion", "apps/v1"},
      {"kind", "Deployment"},
      {"metadata", meta},
      {"spec",
       // A remote model's routers wait for its revision (they fetch its tokenizer).
       {{"replicas", Routed(m) && (files.init.is_null() || m.source) ? kRouterPods : 0},
        {"selector", {{"matchLabels", labels}}},
        {"strategy",
         {{"type", "RollingUpdate"}, {"rollingUpdate", {{"maxUnavailable", 0}, {"maxSurge", 1}}}}},
        {"template", {{"metadata", {{"labels", labels}}}, {"spec", pod_spec}}}}}};
}

json BuildRouterTokenSecret(const ModelView& m, const std::string& token) {
  return {{"apiVersion", "v1"},
          {"kind", "Secret"},
          {"metadata", ChildMeta(m, RouterTokenSecretName(m.model.name))},
          {"type", "Opaque"},
          {"stringData", {{"token", token}}}};
}

json BuildNetworkPolicy(const ModelView& m) {
  json open_ports = json::array({{{"protocol", "TCP"}, {"port", m.model.spec.port}}});
  for (int64_t t = 0; t < m.model.spec.tensor; ++t) {
    open_ports.push_back({{"protocol", "TCP"}, {"port", kMetricsPortBase + t}});
  }
  // The model's own pods; a disaggregated model's two roles are one model (KV pulls and releases
  // go between their ranks over UCX, on ports of its choosing).
  json from = {{"podSelector", {{"matchLabels", Labels(m)}}}};
  if (!m.kv_role.empty()) {
    const json peers = {m.model.name,
                        m.kv_role == "decode" ? PrefillModelName(m.model.name) : m.group()};
    from["podSelector"] = {
        {"matchExpressions",
         json::array({{{"key", kModelLabel}, {"operator", "In"}, {"values", peers}}})}};
  }
  return {{"apiVersion", "networking.k8s.io/v1"},
          {"kind", "NetworkPolicy"},
          {"metadata", ChildMeta(m, m.model.name + "-workers")},
          {"spec",
           {{"podSelector", {{"matchLabels", Labels(m)}}},
            {"policyTypes", json::array({"Ingress"})},
            {"ingress", json::array({{{"from", json::array({from})}}, {{"ports", open_ports}}})}}}};
}

json BuildPrefillModel(const ModelView& m, const json& object, const json* existing) {
  const ShardedModelSpec::Disaggregation& d = *m.model.spec.disaggregation;
  const std::string wanted = std::to_string(d.prefill_replicas);
  int64_t replicas = d.prefill_replicas;
  if (existing != nullptr && existing->is_object()) {
    const json& meta = existing->value("metadata", json::object());
    const json& spec = existing->value("spec", json::object());
    const bool applied =
        meta.value("annotations", json::object()).value(kPrefillReplicasAnnotation, "") == wanted;
    if (applied && spec.value("replicas", json()).is_number_integer()) {
      replicas = spec["replicas"].get<int64_t>();  // scaled since: theirs
    }
  }
  json spec = object.at("spec");
  spec.erase("disaggregation");
  spec["replicas"] = replicas;
  spec["parallelism"] = {{"tensor", d.prefill_tensor}, {"pipeline", d.prefill_pipeline}};
  if (d.prefill_node_selector) spec["worker"]["nodeSelector"] = *d.prefill_node_selector;
  spec["rollout"] = {{"maxUnavailable", d.prefill_max_unavailable},
                     {"maxSurge", d.prefill_max_surge}};
  spec["prefillOf"] = m.model.name;
  json meta = ChildMeta(m, PrefillModelName(m.model.name));
  meta["annotations"][kPrefillReplicasAnnotation] = wanted;
  return {
      {"apiVersion", kApiVersion}, {"kind", "ShardedModel"}, {"metadata", meta}, {"spec", spec}};
}

json BuildRendezvousSecret(const ModelView& m, int64_t replica, const std::string& secret) {
  json meta = ChildMeta(m, RendezvousSecretName(m.model.name, replica));
  meta["labels"][kReplicaLabel] = std::to_string(replica);
  return {{"apiVersion", "v1"},
          {"kind", "Secret"},
          {"metadata", meta},
          {"type", "Opaque"},
          {"stringData", {{"secret", secret}}}};
}

json BuildDisruptionBudget(const ModelView& m, int64_t replica, const std::string& leader_pod,
                           const std::string& leader_uid) {
  json selector = Labels(m);
  selector[kReplicaLabel] = std::to_string(replica);
  json meta = {
      {"name", absl::StrCat(leader_pod, "-", leader_uid.substr(0, 8))},
      {"namespace", m.model.namespace_},
      {"labels", selector},
      {"ownerReferences",
       json::array(
           {{{"apiVersion", "v1"}, {"kind", "Pod"}, {"name", leader_pod}, {"uid", leader_uid}}})}};
  return {{"apiVersion", "policy/v1"},
          {"kind", "PodDisruptionBudget"},
          {"metadata", meta},
          {"spec",
           {{"minAvailable", m.model.spec.pipeline},
            {"selector", {{"matchLabels", selector}}},
            {"unhealthyPodEvictionPolicy", "AlwaysAllow"}}}};
}

}  // namespace shardserve::op
