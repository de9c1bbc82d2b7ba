#include "plan/cluster_view.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace shardserve {
namespace {

using json = nlohmann::json;

std::string Str(const json& o, const char* key) {
  if (!o.is_object()) return "";
  auto it = o.find(key);
  if (it == o.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_boolean()) return it->get<bool>() ? "true" : "false";
  if (it->is_number_integer()) return std::to_string(it->get<int64_t>());
  return "";
}

const json& At(const json& o, std::initializer_list<const char*> keys) {
  static const json kNull;
  const json* n = &o;
  for (const char* k : keys) {
    if (!n->is_object()) return kNull;
    auto it = n->find(k);
    if (it == n->end()) return kNull;
    n = &*it;
  }
  return *n;
}

// A quantity of whole devices: 8 or "8"; anything else ("500m", "1Gi") is refused by name.
absl::StatusOr<int64_t> Count(const json& q, const std::string& what) {
  if (q.is_null()) return 0;
  if (q.is_number_integer()) return q.get<int64_t>();
  int64_t v = 0;
  if (q.is_string() && absl::SimpleAtoi(q.get<std::string>(), &v)) return v;
  return absl::InvalidArgumentError(absl::StrCat(
      what, " '", q.is_string() ? q.get<std::string>() : q.dump(), "' is not a whole number"));
}

}  // namespace

absl::StatusOr<NodeInfo> NodeFromObject(const json& o, const std::string& resource) {
  NodeInfo n;
  n.name = Str(At(o, {"metadata"}), "name");
  if (n.name.empty()) return absl::InvalidArgumentError("a node has no metadata.name");
  const json& labels = At(o, {"metadata", "labels"});
  if (labels.is_object()) {
    for (const auto& [k, v] : labels.items()) n.labels[k] = Str(labels, k.c_str());
  }
  const json& taints = At(o, {"spec", "taints"});
  if (taints.is_array()) {
    for (const json& t : taints) {
      n.taints.push_back({Str(t, "key"), Str(t, "value"), Str(t, "effect")});
    }
  }
  n.unschedulable = Str(At(o, {"spec"}), "unschedulable") == "true";
  const json& allocatable = At(o, {"status", "allocatable"});
  auto gpus = Count(allocatable.is_object() ? At(allocatable, {resource.c_str()}) : json(),
                    absl::StrCat("node ", n.name, " allocatable ", resource));
  if (!gpus.ok()) return gpus.status();
  n.gpus = *gpus;
  // NVIDIA's GPU feature discovery labels each GPU's memory in MiB; a label that is not a number
  // is taken as no label (it does not keep the node from the plan, it only goes unchecked).
  if (auto it = n.labels.find(kGpuMemoryLabel); it != n.labels.end()) {
    int64_t mib = 0;
    if (absl::SimpleAtoi(it->second, &mib) && mib > 0 && mib < (int64_t{1} << 32)) {
      n.gpu_memory = mib << 20;
    }
  }
  const json& conditions = At(o, {"status", "conditions"});
  if (conditions.is_array()) {
    for (const json& c : conditions) {
      if (Str(c, "type") == "Ready") n.ready = Str(c, "status") == "True";
    }
  }
  return n;
}

absl::StatusOr<int64_t> PodRequests(const json& pod, const std::string& resource) {
  int64_t total = 0;
  const json& containers = At(pod, {"spec", "containers"});
  if (!containers.is_array()) return 0;
  for (const json& c : containers) {
    const json* q = &At(c, {"resources", "requests", resource.c_str()});
    if (q->is_null()) q = &At(c, {"resources", "limits", resource.c_str()});
    auto n = Count(
        *q, absl::StrCat("pod ", Str(At(pod, {"metadata"}), "name"), " request of ", resource));
    if (!n.ok()) return n.status();
    total += *n;
  }
  return total;
}

bool PodHoldsResources(const json& pod) {
  const std::string phase = Str(At(pod, {"status"}), "phase");
  return phase != "Succeeded" && phase != "Failed";
}

PlacementRequest PlacementRequestFor(const ShardedModelSpec& spec, std::vector<int64_t> replicas) {
  PlacementRequest r;
  r.tensor = spec.tensor;
  r.pipeline = spec.pipeline;
  r.replicas = std::move(replicas);
  r.gpu_resource = spec.gpu_resource;
  r.node_selector = spec.node_selector;
  r.tolerations = spec.tolerations;
  r.topology_key = spec.topology_key;
  r.gpu_memory = spec.gpu_memory;
  return r;
}

}  // namespace shardserve
