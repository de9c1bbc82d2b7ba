#pragma once
// What placement needs from Kubernetes objects (pure, no I/O): a Node as NodeInfo, the GPUs a Pod
// holds and where, and the PlacementRequest of a ShardedModel. The objects are JSON as the
// apiserver returns them or as `kubectl get -o yaml` prints them (quantities may be strings or
// numbers). Errors name the object and field.
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "api/sharded_model.h"
#include "plan/placement.h"

namespace shardserve {

// labels, taints, cordon, readiness and allocatable `resource` of a Node.
absl::StatusOr<NodeInfo> NodeFromObject(const nlohmann::json& node, const std::string& resource);

// Whole devices of `resource` a Pod requests (requests, else limits, summed over containers).
absl::StatusOr<int64_t> PodRequests(const nlohmann::json& pod, const std::string& resource);

// True while a Pod holds its resources: not Succeeded or Failed (a pod being deleted holds them
// until it is gone).
bool PodHoldsResources(const nlohmann::json& pod);

// The request that places `replicas` of `spec` (GPUs, selector, tolerations, topology key).
PlacementRequest PlacementRequestFor(const ShardedModelSpec& spec, std::vector<int64_t> replicas);

}  // namespace shardserve
