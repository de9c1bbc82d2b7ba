// `shardserve plan -f MANIFEST --nodes NODES.yaml [--pods PODS.yaml]`: where the operator would
// place every replica of a ShardedModel on these nodes, or why it cannot, without a cluster.
// NODES.yaml and PODS.yaml are what `kubectl get nodes -o yaml` / `kubectl get pods -A -o yaml`
// print (a List, a single object, or a YAML list of objects).
#include "cli/plan.h"

#include <yaml-cpp/yaml.h>

#include <cstdio>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "api/sharded_model.h"
#include "common/args.h"
#include "common/status.h"
#include "common/text.h"
#include "plan/placement.h"

namespace shardserve {
namespace {

// The objects of a `kubectl get -o yaml` document.
absl::StatusOr<std::vector<YAML::Node>> Objects(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  std::vector<YAML::Node> out;
  try {
    for (const YAML::Node& doc : YAML::LoadAll(text)) {
      if (doc.IsSequence()) {
        for (const auto& o : doc) out.push_back(o);
      } else if (doc["items"] && doc["items"].IsSequence()) {
        for (const auto& o : doc["items"]) out.push_back(o);
      } else if (doc.IsMap()) {
        out.push_back(doc);
      }
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not valid YAML: ", e.what()));
  }
  return out;
}

// node[k1][k2]..., or an undefined node when any key is missing (yaml-cpp throws instead).
YAML::Node At(const YAML::Node& root, std::initializer_list<const char*> keys) {
  YAML::Node n = root;
  for (const char* k : keys) {
    const YAML::Node& cn = n;
    if (!cn.IsMap() || !cn[k]) return YAML::Node(YAML::NodeType::Undefined);
    n.reset(cn[k]);  // rebind (operator= would overwrite the node it refers to)
  }
  return n;
}

std::string Str(const YAML::Node& n) { return n.IsDefined() && n.IsScalar() ? n.Scalar() : ""; }

// A resource quantity of whole devices ("8"); anything else is refused by name.
absl::StatusOr<int64_t> Count(const YAML::Node& n, const std::string& what) {
  int64_t v = 0;
  if (!n.IsDefined()) return 0;
  if (!n.IsScalar() || !absl::SimpleAtoi(n.Scalar(), &v)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " '", n.IsScalar() ? n.Scalar() : "", "' is not a whole number"));
  }
  return v;
}

absl::StatusOr<std::vector<NodeInfo>> ReadNodes(const std::string& path,
                                                const std::string& resource) {
  ASSIGN_OR_RETURN(std::vector<YAML::Node> objects, Objects(path));
  std::vector<NodeInfo> nodes;
  for (const YAML::Node& o : objects) {
    if (!Str(At(o, {"kind"})).empty() && Str(At(o, {"kind"})) != "Node") continue;
    NodeInfo n;
    n.name = Str(At(o, {"metadata", "name"}));
    if (n.name.empty()) return absl::InvalidArgumentError(path + ": a node has no metadata.name");
    const YAML::Node labels = At(o, {"metadata", "labels"});
    if (labels.IsMap()) {
      for (const auto& kv : labels) n.labels[kv.first.Scalar()] = Str(kv.second);
    }
    const YAML::Node taints = At(o, {"spec", "taints"});
    if (taints.IsSequence()) {
      for (const auto& t : taints) {
        n.taints.push_back({Str(At(t, {"key"})), Str(At(t, {"value"})), Str(At(t, {"effect"}))});
      }
    }
    n.unschedulable = Str(At(o, {"spec", "unschedulable"})) == "true";
    const YAML::Node allocatable = At(o, {"status", "allocatable"});
    ASSIGN_OR_RETURN(n.gpus,
                     Count(allocatable.IsMap() ? At(allocatable, {resource.c_str()}) : allocatable,
                           absl::StrCat(path, ": node ", n.name, " allocatable ", resource)));
    const YAML::Node conditions = At(o, {"status", "conditions"});
    if (conditions.IsSequence()) {
      for (const auto& c : conditions) {
        if (Str(At(c, {"type"})) == "Ready") n.ready = Str(At(c, {"status"})) == "True";
      }
    }
    nodes.push_back(std::move(n));
  }
  return nodes;
}

// GPUs requested on each node by pods that are bound and not finished.
absl::Status AddPodRequests(const std::string& path, const std::string& resource,
                            std::vector<NodeInfo>& nodes) {
  ASSIGN_OR_RETURN(std::vector<YAML::Node> objects, Objects(path));
  for (const YAML::Node& o : objects) {
    if (!Str(At(o, {"kind"})).empty() && Str(At(o, {"kind"})) != "Pod") continue;
    const std::string node = Str(At(o, {"spec", "nodeName"}));
    const std::string phase = Str(At(o, {"status", "phase"}));
    if (node.empty() || phase == "Succeeded" || phase == "Failed") continue;
    int64_t gpus = 0;
    const YAML::Node containers = At(o, {"spec", "containers"});
    if (containers.IsSequence()) {
      for (const auto& c : containers) {
        YAML::Node q = At(c, {"resources", "requests", resource.c_str()});
        if (!q.IsDefined()) q = At(c, {"resources", "limits", resource.c_str()});
        ASSIGN_OR_RETURN(int64_t n, Count(q, absl::StrCat(path, ": pod requests of ", resource)));
        gpus += n;
      }
    }
    for (NodeInfo& n : nodes) {
      if (n.name == node) n.requested += gpus;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunPlan(std::vector<std::string> argv) {
  for (std::string& a : argv) {
    if (a == "-f") a = "--file";
  }
  ASSIGN_OR_RETURN(Args a, Args::Parse(argv, {"file", "nodes", "pods"}, {}));
  ASSIGN_OR_RETURN(std::string file, a.Require("file"));
  ASSIGN_OR_RETURN(std::string nodes_file, a.Require("nodes"));
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(file));
  auto parsed = ParseShardedModel(text);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", parsed.status().message()));
  }
  const ShardedModelSpec& spec = parsed->spec;
  std::vector<NodeInfo> nodes;
  try {
    ASSIGN_OR_RETURN(nodes, ReadNodes(nodes_file, spec.gpu_resource));
    if (auto pods = a.Get("pods")) {
      RETURN_IF_ERROR(AddPodRequests(*pods, spec.gpu_resource, nodes));
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("reading the nodes or pods: ", e.what()));
  }

  PlacementRequest r;
  r.tensor = spec.tensor;
  r.pipeline = spec.pipeline;
  for (int64_t i = 0; i < spec.replicas; ++i) r.replicas.push_back(i);
  r.gpu_resource = spec.gpu_resource;
  r.node_selector = spec.node_selector;
  for (const auto& t : spec.tolerations) r.tolerations.push_back({t.key, t.op, t.value, t.effect});
  r.topology_key = spec.topology_key;
  ASSIGN_OR_RETURN(PlacementResult result, PlaceReplicas(r, nodes));

  std::printf("%s: %lld replica(s) of TP=%lld x PP=%lld, %lld %s per replica, on %zu node(s)\n",
              parsed->name.c_str(), static_cast<long long>(spec.replicas),
              static_cast<long long>(spec.tensor), static_cast<long long>(spec.pipeline),
              static_cast<long long>(spec.gpus_per_replica()), spec.gpu_resource.c_str(),
              nodes.size());
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
