// `shardserve plan -f MANIFEST --nodes NODES.yaml [--pods PODS.yaml]`: where the operator would
// place every replica of a ShardedModel on these nodes, or why it cannot, without a cluster.
// NODES.yaml and PODS.yaml are what `kubectl get nodes -o yaml` / `kubectl get pods -A -o yaml`
// print (a List, a single object, or a YAML list of objects).
#include "cli/plan.h"

#include <yaml-cpp/yaml.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "api/sharded_model.h"
#include "common/args.h"
#include "common/status.h"
#include "common/text.h"
#include "model/config.h"
#include "plan/cluster_view.h"
#include "plan/layer_split.h"

namespace shardserve {
namespace {

using json = nlohmann::json;

// A YAML value as JSON; scalars stay strings (the readers accept "8" for 8 and "true" for true).
json ToJson(const YAML::Node& n) {
  if (n.IsMap()) {
    json o = json::object();
    for (const auto& kv : n) o[kv.first.Scalar()] = ToJson(kv.second);
    return o;
  }
  if (n.IsSequence()) {
    json a = json::array();
    for (const auto& v : n) a.push_back(ToJson(v));
    return a;
  }
  if (n.IsScalar()) return n.Scalar();
  return nullptr;
}

// The objects of a `kubectl get -o yaml` document (a List, one object, or a list of objects).
absl::StatusOr<std::vector<json>> Objects(const std::string& path, const std::string& kind) {
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  std::vector<json> out;
  auto add = [&](const YAML::Node& o) {
    json j = ToJson(o);
    if (j.is_object() && j.value("kind", kind) == kind) out.push_back(std::move(j));
  };
  try {
    for (const YAML::Node& doc : YAML::LoadAll(text)) {
      if (doc.IsSequence()) {
        for (const auto& o : doc) add(o);
      } else if (doc["items"] && doc["items"].IsSequence()) {
        for (const auto& o : doc["items"]) add(o);
      } else if (doc.IsMap()) {
        add(doc);
      }
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not valid YAML: ", e.what()));
  }
  return out;
}

absl::StatusOr<std::vector<NodeInfo>> ReadNodes(const std::string& path,
                                                const std::string& resource) {
  ASSIGN_OR_RETURN(std::vector<json> objects, Objects(path, "Node"));
  std::vector<NodeInfo> nodes;
  for (const json& o : objects) {
    auto n = NodeFromObject(o, resource);
    if (!n.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", n.status().message()));
    nodes.push_back(std::move(*n));
  }
  return nodes;
}

// GPUs requested on each node by pods that are bound and not finished.
absl::Status AddPodRequests(const std::string& path, const std::string& resource,
                            std::vector<NodeInfo>& nodes) {
  ASSIGN_OR_RETURN(std::vector<json> objects, Objects(path, "Pod"));
  for (const json& o : objects) {
    const std::string node = o.value("spec", json::object()).value("nodeName", "");
    if (node.empty() || !PodHoldsResources(o)) continue;
    auto gpus = PodRequests(o, resource);
    if (!gpus.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", gpus.status().message()));
    }
    for (NodeInfo& n : nodes) {
      if (n.name == node) n.requested += *gpus;
    }
  }
  return absl::OkStatus();
}

// Each stage's layers, as the operator would split them, when the model's files are on this
// machine (file://, or a host path that exists here); otherwise where the split will come from.
absl::StatusOr<std::string> LayersLine(const std::string& file, const ShardedModelSpec& spec) {
  auto uri = ParseModelUri(spec.model_uri);
  std::error_code ec;
  if (!uri.ok() || uri->scheme == ModelUri::Scheme::kPvc ||
      !std::filesystem::exists(uri->path, ec)) {
    return std::string(
        "layers: split once the operator has read the model (status.plan.stageLayers)");
  }
  auto config = LoadModelConfig(uri->path);
  if (!config.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(file, ": spec.model.uri: ", config.status().message()));
  }
  auto layers = PlanStageLayers(config->shape(), static_cast<int>(spec.pipeline));
  if (!layers.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        file, ": spec.parallelism.pipeline ", spec.pipeline, ": ", layers.status().message()));
  }
  std::vector<std::string> stages;
  for (size_t s = 0; s < layers->size(); ++s) {
    stages.push_back(absl::StrCat("stage ", s, " ", FormatLayerRange((*layers)[s])));
  }
  return absl::StrCat("layers: ", absl::StrJoin(stages, ", "), " (of ", config->num_layers, ")");
}

}  // namespace

absl::Status RunPlan(std::vector<std::string> argv) {
  ASSIGN_OR_RETURN(Args a,
                   Args::Parse(argv, {"file", "nodes", "pods"}, {}, "shardserve plan", kPlanUsage));
  ASSIGN_OR_RETURN(std::string file, a.Require("file"));
  ASSIGN_OR_RETURN(std::string nodes_file, a.Require("nodes"));
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(file));
  auto parsed = ParseShardedModel(text);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", parsed.status().message()));
  }
  const ShardedModelSpec& spec = parsed->spec;
  ASSIGN_OR_RETURN(std::vector<NodeInfo> nodes, ReadNodes(nodes_file, spec.gpu_resource));
  if (auto pods = a.Get("pods")) {
    RETURN_IF_ERROR(AddPodRequests(*pods, spec.gpu_resource, nodes));
  }
  std::vector<int64_t> replicas;
  for (int64_t i = 0; i < spec.replicas; ++i) replicas.push_back(i);
  ASSIGN_OR_RETURN(PlacementResult result,
                   PlaceReplicas(PlacementRequestFor(spec, std::move(replicas)), nodes));

  std::printf("%s: %lld replica(s) of TP=%lld x PP=%lld, %lld %s per replica, on %zu node(s)\n",
              parsed->name.c_str(), static_cast<long long>(spec.replicas),
              static_cast<long long>(spec.tensor), static_cast<long long>(spec.pipeline),
              static_cast<long long>(spec.gpus_per_replica()), spec.gpu_resource.c_str(),
              nodes.size());
  ASSIGN_OR_RETURN(std::string layers, LayersLine(file, spec));
  std::printf("%s\n", layers.c_str());
  for (const ReplicaPlacement& p : result.placed) {
    std::vector<std::string> stages;
    for (size_t s = 0; s < p.nodes.size(); ++s) {
      stages.push_back(absl::StrCat("stage ", s, " -> ", p.nodes[s]));
    }
    std::printf("replica %lld: %s (%s)\n", static_cast<long long>(p.replica),
                absl::StrJoin(stages, ", ").c_str(),
                p.domain.empty() ? ("across " + spec.topology_key + " values").c_str()
                                 : (spec.topology_key + "=" + p.domain).c_str());
  }
  for (const auto& [replica, why] : result.unplaced) {
    std::printf("replica %lld: not placed: %s\n", static_cast<long long>(replica), why.c_str());
  }
  if (!result.unplaced.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(result.unplaced.size(), " of ", spec.replicas,
                     " replica(s) cannot be placed; nothing would be created for them"));
  }
  return absl::OkStatus();
}

}  // namespace shardserve
