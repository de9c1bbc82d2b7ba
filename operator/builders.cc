#include "operator/builders.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace shardserve::op {
namespace {

constexpr char kModelMount[] = "/models";

uint64_t Fnv(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

json OwnerReference(const ModelView& m) {
  return {{"apiVersion", "shardserve.io/v1alpha1"},
          {"kind", "ShardedModel"},
          {"name", m.model.name},
          {"uid", m.uid},
          {"controller", true},
          {"blockOwnerDeletion", true}};
}

json Labels(const ModelView& m) { return {{kModelLabel, m.model.name}}; }

// metadata of an object the model owns (services, the network policy).
json ChildMeta(const ModelView& m, const std::string& name) {
  return {{"name", name},
          {"namespace", m.model.namespace_},
          {"labels", Labels(m)},
          {"ownerReferences", json::array({OwnerReference(m)})}};
}

}  // namespace

std::string PodName(const std::string& model, int64_t replica, int64_t stage) {
  return absl::StrCat(model, "-", replica, "-", stage);
}

absl::StatusOr<WorkerDefaults> ReadWorkerDefaults(const json& j) {
  WorkerDefaults d;
  if (!j.is_object()) return absl::InvalidArgumentError("worker defaults must be an object");
  for (const auto& [k, v] : j.items()) {
    if (k == "env") {
      if (!v.is_array()) return absl::InvalidArgumentError("worker defaults: env must be a list");
      for (const json& e : v) {
        if (!e.is_object() || !e.contains("name") || !e["name"].is_string()) {
          return absl::InvalidArgumentError(
              absl::StrCat("worker defaults: env entry ", e.dump(), " has no name"));
        }
      }
      d.env = v;
    } else if (k == "securityContext" || k == "podSecurityContext") {
      if (!v.is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat("worker defaults: ", k, " must be an object"));
      }
      (k == "securityContext" ? d.security_context : d.pod_security_context) = v;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "worker defaults: unknown key '", k, "' (env, securityContext, podSecurityContext)"));
    }
  }
  return d;
}

absl::StatusOr<ModelView> ReadModel(const json& object, const WorkerDefaults& defaults) {
  ModelView v;
  v.defaults = defaults;
  ASSIGN_OR_RETURN(v.model, ParseShardedModel(object.dump()));
  const json& meta = object.at("metadata");
  v.uid = meta.value("uid", "");
  if (meta.contains("namespace")) v.model.namespace_ = meta["namespace"].get<std::string>();
  const json& worker = object["spec"]["worker"];
  if (worker.contains("resources")) v.resources = worker["resources"];
  if (worker.contains("env")) v.env = worker["env"];
  if (worker.contains("tolerations")) v.tolerations = worker["tolerations"];
  ASSIGN_OR_RETURN(ModelUri uri, ParseModelUri(v.model.spec.model_uri));
  if (uri.scheme == ModelUri::Scheme::kFile) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.model.uri '", v.model.spec.model_uri,
        "' is a file:// uri, which only shardserve local reads; on a cluster use pvc:// or "
        "hostpath://"));
  }
  // Everything that shapes a pod; a change rolls the replicas.
  const json shaping = {object["spec"]["model"], object["spec"]["parallelism"], worker,
                        object["spec"].value("serving", json::object())};
  v.revision = absl::StrFormat("%012x", Fnv(shaping.dump()) & 0xffffffffffffull);
  return v;
}

json BuildStagePod(const ModelView& m, int64_t replica, int64_t stage,
                   const std::vector<std::string>& nodes) {
  const std::string& node = nodes.at(stage);
  const ShardedModelSpec& s = m.model.spec;
  const std::string& name = m.model.name;
  const std::string pod = PodName(name, replica, stage);
  const std::string workers = name + "-workers";
  const ModelUri uri = *ParseModelUri(s.model_uri);  // checked by ReadModel
  const bool leader = stage == 0;

  json labels = Labels(m);
  labels[kReplicaLabel] = std::to_string(replica);
  labels[kStageLabel] = std::to_string(stage);
  labels[kRevisionLabel] = m.revision;
  labels[kRoleLabel] = leader ? "leader" : "worker";

  json env = json::array();
  auto add = [&](const std::string& k, const std::string& v) {
    env.push_back({{"name", k}, {"value", v}});
  };
  add("SHARDSERVE_MODEL_NAME", s.model_name);
  add("SHARDSERVE_DEPLOYMENT", name);  // the metrics' `model` label
  add("SHARDSERVE_MODEL_PATH", uri.scheme == ModelUri::Scheme::kPvc
                                   ? absl::StrCat(kModelMount, "/", uri.path)
                                   : std::string(kModelMount));
  add("SHARDSERVE_REPLICA", std::to_string(replica));
  add("SHARDSERVE_STAGE", std::to_string(stage));
  add("SHARDSERVE_TP", std::to_string(s.tensor));
  add("SHARDSERVE_PP", std::to_string(s.pipeline));
  add("SHARDSERVE_LEADER_ADDR", absl::StrCat(PodName(name, replica, 0), ".", workers, ".",
                                             m.model.namespace_, ".svc:", kRendezvousPort));
  add("SHARDSERVE_MICROBATCHES", std::to_string(s.effective_micro_batches()));
  add("SHARDSERVE_JOB_ID", absl::StrCat(name, "-", replica));
  add("SHARDSERVE_API_PORT", std::to_string(s.port));
  add("SHARDSERVE_MAX_BATCH_SIZE", std::to_string(s.max_batch_size));
  add("SHARDSERVE_MAX_SEQUENCE_LENGTH", std::to_string(s.max_sequence_length));
  add("SHARDSERVE_HOST", absl::StrCat(pod, ".", workers, ".", m.model.namespace_, ".svc"));
  for (const json& e : m.defaults.env) {
    const bool overridden = std::any_of(m.env.begin(), m.env.end(), [&](const json& own) {
      return own.value("name", "") == e.value("name", "");
    });
    if (!overridden) env.push_back(e);
  }
  for (const json& e : m.env) env.push_back(e);

  json ports = json::array({{{"name", "rendezvous"}, {"containerPort", kRendezvousPort}}});
  if (leader) ports.push_back({{"name", "api"}, {"containerPort", s.port}});
  for (int64_t t = 0; t < s.tensor; ++t) {
    ports.push_back(
        {{"name", absl::StrCat("metrics-", t)}, {"containerPort", kMetricsPortBase + t}});
  }

  json resources = m.resources;
  resources["limits"][s.gpu_resource] = std::to_string(s.tensor);
  resources["requests"][s.gpu_resource] = std::to_string(s.tensor);

  // Readiness: the leader is ready when its /readyz is (every rank connected and loaded); the
  // other stages when their rank-0 metrics page answers. Loading may take long: startup probe.
  const json ready_probe =
      leader ? json{{"httpGet", {{"path", "/readyz"}, {"port", s.port}}}, {"periodSeconds", 5}}
             : json{{"httpGet", {{"path", "/metrics"}, {"port", kMetricsPortBase}}},
                    {"periodSeconds", 5}};
  const json startup_probe = {
      {"tcpSocket", {{"port", kMetricsPortBase}}}, {"periodSeconds", 5}, {"failureThreshold", 360}};
  const json liveness_probe = {
      {"tcpSocket", {{"port", kMetricsPortBase}}}, {"periodSeconds", 10}, {"failureThreshold", 3}};

  json volumes = json::array({{{"name", "shm"}, {"emptyDir", {{"medium", "Memory"}}}}});
  if (uri.scheme == ModelUri::Scheme::kPvc) {
    volumes.push_back({{"name", "model"},
                       {"persistentVolumeClaim", {{"claimName", uri.claim}, {"readOnly", true}}}});
  } else {
    volumes.push_back(
        {{"name", "model"}, {"hostPath", {{"path", uri.path}, {"type", "Directory"}}}});
  }

  json container = {{"name", "worker"},
                    {"image", s.image},
                    {"command", json::array({"shardserve-worker", "launch"})},
                    {"env", env},
                    {"ports", ports},
                    {"resources", resources},
                    {"readinessProbe", ready_probe},
                    {"startupProbe", startup_probe},
                    {"livenessProbe", liveness_probe},
                    {"volumeMounts",
                     {{{"name", "shm"}, {"mountPath", "/dev/shm"}},
                      {{"name", "model"}, {"mountPath", kModelMount}, {"readOnly", true}}}},
                    {"securityContext", m.defaults.security_context}};

  json spec = {
      {"hostname", pod},
      {"subdomain", workers},
      {"restartPolicy", "Never"},  // a failed rank fails the pod; the operator recreates the gang
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
  if (!s.node_selector.empty()) spec["nodeSelector"] = s.node_selector;
  if (!m.tolerations.empty()) spec["tolerations"] = m.tolerations;

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

json BuildLeaderService(const ModelView& m) {
  json selector = Labels(m);
  selector[kRoleLabel] = "leader";
  return {
      {"apiVersion", "v1"},
      {"kind", "Service"},
      {"metadata", ChildMeta(m, m.model.name)},
      {"spec",
       {{"selector", selector},
        {"ports",
         {{{"name", "api"}, {"port", m.model.spec.port}, {"targetPort", m.model.spec.port}}}}}}};
}

json BuildNetworkPolicy(const ModelView& m) {
  json open_ports = json::array({{{"protocol", "TCP"}, {"port", m.model.spec.port}}});
  for (int64_t t = 0; t < m.model.spec.tensor; ++t) {
    open_ports.push_back({{"protocol", "TCP"}, {"port", kMetricsPortBase + t}});
  }
  return {
      {"apiVersion", "networking.k8s.io/v1"},
      {"kind", "NetworkPolicy"},
      {"metadata", ChildMeta(m, m.model.name + "-workers")},
      {"spec",
       {{"podSelector", {{"matchLabels", Labels(m)}}},
        {"policyTypes", json::array({"Ingress"})},
        {"ingress",
         json::array({{{"from", json::array({{{"podSelector", {{"matchLabels", Labels(m)}}}}})}},
                      {{"ports", open_ports}}})}}}};
}

}  // namespace shardserve::op
