#pragma once
// Gang placement (DESIGN.md §3), pure: given the nodes (their labels, taints and GPUs already
// requested) and what a ShardedModel's replicas need, choose a node for every stage of every
// replica, or say exactly why a replica does not fit. A replica is placed whole or not at all;
// its stages are packed inside one value of the topology key when possible; a stage's T ranks
// never cross a node (a stage is one pod with T GPUs); distinct nodes are preferred, and a node
// takes several stages only if it has the GPUs. Nodes are chosen best-fit (least GPUs left
// over), so large gaps stay free for large stages. Deterministic: same input, same plan.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "api/sharded_model.h"

namespace shardserve {

struct Taint {
  std::string key, value, effect;  // effect: NoSchedule, PreferNoSchedule, NoExecute
};

// Whether a pod with `toleration` may run on a node with `taint`.
bool Tolerates(const Toleration& toleration, const Taint& taint);

// The label NVIDIA's GPU feature discovery puts on a node: each GPU's memory, in MiB.
inline constexpr char kGpuMemoryLabel[] = "nvidia.com/gpu.memory";

struct NodeInfo {
  std::string name;
  std::map<std::string, std::string> labels;
  std::vector<Taint> taints;
  int64_t gpus = 0;       // allocatable GPUs of the model's resource
  int64_t requested = 0;  // GPUs already requested by pods bound or planned there
  bool ready = true;
  bool unschedulable = false;
  int64_t gpu_memory = 0;  // bytes per GPU (kGpuMemoryLabel); 0: unknown
};

struct PlacementRequest {
  int64_t tensor = 1;             // GPUs per stage (one pod)
  int64_t pipeline = 1;           // stages per replica
  std::vector<int64_t> replicas;  // indices to place, in order
  std::string gpu_resource = "nvidia.com/gpu";
  std::map<std::string, std::string> node_selector;
  std::vector<Toleration> tolerations;
  std::string topology_key = "topology.kubernetes.io/zone";
  // Bytes one GPU of the neediest stage needs (plan/memory.h), 0: unchecked; `memory_need` says
  // it for a person ("stage 1 needs 93.1 GiB per GPU at TP=4 (...)"). A node's memory is its
  // label's, else `gpu_memory` (spec.worker.gpuMemory); a node of neither is not checked.
  double memory_needed = 0;
  std::string memory_need;
  int64_t gpu_memory = 0;
};

// Whether a replica's stage may go on `n` at all: ready, selected, its taints tolerated (its free
// GPUs and memory aside).
bool Eligible(const NodeInfo& n, const PlacementRequest& r);

// A node's GPU memory as placement counts it: its label's, else the spec's (0: unknown).
int64_t GpuMemoryOf(const NodeInfo& n, const PlacementRequest& r);

struct ReplicaPlacement {
  int64_t replica = 0;
  std::vector<std::string> nodes;  // one per stage
  std::string domain;              // the topology value they share ("" if they span several)
};

struct PlacementResult {
  std::vector<ReplicaPlacement> placed;
  // For each replica that does not fit: why, for a person ("replica 1 needs 2 nodes with 8 free
  // nvidia.com/gpu; 1 has them (of 4 nodes: 2 by nodeSelector, 1 by an untolerated taint)").
  // Replicas are tried in order, each on what the earlier ones left.
  std::map<int64_t, std::string> unplaced;
  std::vector<NodeInfo> nodes_after;  // `requested` includes the placed replicas
};

// Plans every replica of `request` on `nodes`. InvalidArgument only for a malformed request
// (tensor or pipeline < 1).
absl::StatusOr<PlacementResult> PlaceReplicas(const PlacementRequest& request,
                                              std::vector<NodeInfo> nodes);

}  // namespace shardserve
