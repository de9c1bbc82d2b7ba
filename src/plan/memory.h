#pragma once
// Whether a stage fits in a GPU's memory, and the parallelism that makes it fit (pure). A rank's
// bytes are its weights and its KV cache (model/footprint.h says what each holds at a tensor-
// parallel size) plus a working margin for what neither counts: the CUDA context, NCCL's
// buffers, activations and workspaces (kMarginBytes plus kMarginShare of the rest).
//
// `shardserve plan` and the operator use it alike: a stage that cannot fit is not placed (its
// numbers in the reason), and `parallelism.tensor: auto` / `pipeline: auto` pick the smallest
// tensor-parallel size inside a node, then the fewest stages, whose every stage fits.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "api/sharded_model.h"
#include "plan/footprint.h"
#include "plan/layer_split.h"
#include "plan/placement.h"

namespace shardserve {

inline constexpr double kMarginBytes = 1024.0 * 1024 * 1024;  // 1 GiB
inline constexpr double kMarginShare = 0.10;

// What one rank of a stage needs.
struct StageMemory {
  double weights = 0, kv_cache = 0, margin = 0;
  double total() const { return weights + kv_cache + margin; }
};

// One rank of the stage holding `layers` at tensor-parallel size `tp`, its cache holding
// `kv_tokens` positions.
StageMemory MemoryOfStage(const ModelFootprint& f, const LayerRange& layers, int64_t tp,
                          int64_t kv_tokens);

// KV cache bytes per position (one layer, all of a rank's heads) of a full cache against the
// model's own (equal but for MLA's compressed latent), for a person.
std::string KvBytesLine(const ModelFootprint& f);

// Whether a tensor-parallel group of `tp` can divide the model; an error names the field and
// the numbers ("num_attention_heads 6 is not divisible by tensor parallelism 4").
absl::Status CheckTensorParallel(const ModelFootprint& f, int64_t tp);

std::string FormatGiB(double bytes);  // "93.1 GiB"

// "stage 1 needs 93.1 GiB per GPU at TP=4 (weights 80.2, KV cache 4.0, margin 8.9)"
std::string DescribeStage(int64_t stage, int64_t tp, const StageMemory& m);

struct ParallelismChoice {
  int64_t tensor = 1, pipeline = 1;
  std::vector<LayerRange> layers;  // per stage
  std::vector<StageMemory> stages;
  // The largest stage's need, and which stage it is.
  double largest = 0;
  int64_t largest_stage = 0;
};

// The plan at a given tensor x pipeline size: the layer split and each stage's need.
absl::StatusOr<ParallelismChoice> PlanMemory(const ModelFootprint& f, int64_t tp, int64_t pp,
                                             int64_t kv_tokens);

// Chooses the sizes left open (nullopt: "auto"). Candidates: the tensor-parallel sizes that divide
// the model, up to the GPUs of the largest candidate node (`node_gpus`: each candidate node's
// allocatable GPUs), smallest first, at each number of stages from 1 up to the layers and the
// nodes' room for stages of that size (64 at most); the first whose every stage needs at most
// `gpu_memory` bytes per GPU. With the memory unknown (0), the smallest sizes that divide the
// model. FailedPrecondition when nothing fits, with the numbers of the least needy plan the nodes
// have room for, which `closest` (when given) receives (where they have room for none, the
// smallest plan, which placement then refuses for want of GPUs).
absl::StatusOr<ParallelismChoice> ChooseParallelism(const ModelFootprint& f,
                                                    std::optional<int64_t> tensor,
                                                    std::optional<int64_t> pipeline,
                                                    const std::vector<int64_t>& node_gpus,
                                                    double gpu_memory, int64_t kv_tokens,
                                                    ParallelismChoice* closest = nullptr);

// The plan of `spec` on `nodes` (its KV cache in spec.serving.kvCacheDtype): the sizes it fixes or,
// for auto, the ones chosen on the nodes placement could use (ready, selected, tolerated, with
// GPUs), the layer split and each stage's need; `gpu_memory` is the least memory of those nodes (0:
// none says it). Where no auto sizes fit, the least needy plan: placement then refuses it with its
// numbers. Errors name the field
// ("spec.parallelism.tensor 3: num_attention_heads 64 is not divisible by tensor parallelism 3").
struct SpecPlan {
  ParallelismChoice choice;
  int64_t gpu_memory = 0;
};
absl::StatusOr<SpecPlan> PlanSpec(const ModelFootprint& f, const ShardedModelSpec& spec,
                                  const std::vector<NodeInfo>& nodes);

// The placement request of `spec` that also checks each node's GPU memory against `plan`.
PlacementRequest MemoryAwareRequest(const ShardedModelSpec& spec, const SpecPlan& plan,
                                    std::vector<int64_t> replicas);

}  // namespace shardserve
