#include "plan/memory.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "plan/cluster_view.h"

namespace shardserve {

StageMemory MemoryOfStage(const ModelFootprint& f, const LayerRange& layers, int64_t tp,
                          int64_t kv_tokens) {
  StageMemory m;
  const double T = static_cast<double>(tp);
  int64_t layer = 0;
  double kv_values = 0;
  auto hold = [&](const LayerFootprint& k, double n) {  // n layers of kind k
    const double kv_heads = k.kv_heads == 0 ? 0 : std::max<double>(1, k.kv_heads / tp);
    m.weights += n * (k.split_bytes / T + k.kv_head_bytes * kv_heads + k.whole_bytes);
    kv_values += n * static_cast<double>(f.KvValuesPerRank(k, tp));
  };
  for (const LayerFootprint& k : f.kinds) {
    const int64_t begin = std::max(layer, layers.begin);
    const int64_t end = std::min(layer + k.count, layers.end);
    layer += k.count;
    if (begin < end) hold(k, static_cast<double>(end - begin));
  }
  if (layers.begin == 0) m.weights += f.embed_bytes / T;
  if (layers.end == f.layers) {
    m.weights += f.head_bytes / T;
    if (f.mtp_loaded && f.mtp.count > 0) hold(f.mtp, 1);  // the one layer method mtp runs
  }
  m.kv_cache = kv_values * static_cast<double>(kv_tokens) * static_cast<double>(f.KvValueBytes());
  m.margin = kMarginBytes + kMarginShare * (m.weights + m.kv_cache);
  return m;
}

std::string KvBytesLine(const ModelFootprint& f) {
  if (f.kinds.empty()) return "";
  const int64_t own = f.KvValuesPerRank(f.kinds.front(), 1) * f.KvValueBytes();
  const int64_t full = f.full_kv_values * f.KvValueBytes();
  const std::string dtype = absl::AsciiStrToUpper(f.kv_dtype);
  if (own == full) {
    return absl::StrCat("KV cache: ", own, " bytes a position per layer (", dtype, ")");
  }
  return absl::StrCat("KV cache: ", own, " bytes a position per layer (", dtype,
                      ", the compressed latent every rank keeps), against ", full,
                      " for full heads (", absl::StrFormat("%.1f", static_cast<double>(full) / own),
                      "x)");
}

absl::Status CheckTensorParallel(const ModelFootprint& f, int64_t tp) {
  auto check = [&](const char* field, int64_t n) -> absl::Status {
    if (n == 0 || n % tp == 0) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat(field, " ", n, " is not divisible by tensor parallelism ", tp));
  };
  RETURN_IF_ERROR(check("num_attention_heads", f.heads));
  if (f.kv_heads > 0 && f.kv_heads % tp != 0 && tp % f.kv_heads != 0) {
    return absl::FailedPreconditionError(absl::StrCat("num_key_value_heads ", f.kv_heads,
                                                      " and tensor parallelism ", tp,
                                                      ": neither divides the other"));
  }
  RETURN_IF_ERROR(check("the experts", f.experts));
  return check("intermediate_size", f.intermediate);
}

std::string FormatGiB(double bytes) {
  return absl::StrFormat("%.1f GiB", bytes / (1024.0 * 1024 * 1024));
}

std::string DescribeStage(int64_t stage, int64_t tp, const StageMemory& m) {
  constexpr double kGiB = 1024.0 * 1024 * 1024;
  return absl::StrFormat(
      "stage %d needs %s per GPU at TP=%d (weights %.1f, KV cache %.1f, margin %.1f)", stage,
      FormatGiB(m.total()), tp, m.weights / kGiB, m.kv_cache / kGiB, m.margin / kGiB);
}

absl::StatusOr<ParallelismChoice> PlanMemory(const ModelFootprint& f, int64_t tp, int64_t pp,
                                             int64_t kv_tokens) {
  RETURN_IF_ERROR(CheckTensorParallel(f, tp));
  ParallelismChoice c;
  c.tensor = tp;
  c.pipeline = pp;
  ASSIGN_OR_RETURN(c.layers, PlanStageLayers(f.shape, static_cast<int>(pp)));
  for (size_t s = 0; s < c.layers.size(); ++s) {
    c.stages.push_back(MemoryOfStage(f, c.layers[s], tp, kv_tokens));
    if (c.stages.back().total() > c.largest) {
      c.largest = c.stages.back().total();
      c.largest_stage = static_cast<int64_t>(s);
    }
  }
  return c;
}

absl::StatusOr<ParallelismChoice> ChooseParallelism(const ModelFootprint& f,
                                                    std::optional<int64_t> tensor,
                                                    std::optional<int64_t> pipeline,
                                                    const std::vector<int64_t>& node_gpus,
                                                    double gpu_memory, int64_t kv_tokens,
                                                    ParallelismChoice* closest_out) {
  const int64_t max_gpus =
      node_gpus.empty() ? 64 : *std::max_element(node_gpus.begin(), node_gpus.end());
  auto room = [&](int64_t tp) {  // stages of tp GPUs the nodes can hold
    if (node_gpus.empty()) return f.layers;
    int64_t n = 0;
    for (int64_t g : node_gpus) n += g / tp;
    return n;
  };
  std::vector<int64_t> tensors;
  if (tensor) {
    tensors.push_back(*tensor);
  } else {
    for (int64_t t = 1; t <= std::min<int64_t>(max_gpus, 64); ++t) {
      if (CheckTensorParallel(f, t).ok()) tensors.push_back(t);
    }
    if (tensors.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "no tensor-parallel size up to the ", max_gpus, " GPUs of a node divides the model: ",
          CheckTensorParallel(f, std::max<int64_t>(1, max_gpus)).message()));
    }
  }
  // As many stages as the layers, and no more than a fixed pipeline may have (the CRD's 64).
  const int64_t last_pp = pipeline ? *pipeline : std::min<int64_t>(f.layers, 64);
  std::optional<ParallelismChoice> closest;  // of the plans that do not fit, the least needy
  for (int64_t pp = pipeline ? *pipeline : 1; pp <= last_pp; ++pp) {
    bool any = false;
    for (int64_t tp : tensors) {
      if (!pipeline && pp > room(tp)) continue;  // not enough nodes for that many stages
      any = true;
      ASSIGN_OR_RETURN(ParallelismChoice c, PlanMemory(f, tp, pp, kv_tokens));
      if (gpu_memory <= 0 || c.largest <= gpu_memory) return c;
      if (!closest || c.largest < closest->largest) closest = std::move(c);
    }
    if (!any && !pipeline) break;  // more stages fit no better: no node room for them
  }
  if (!closest) {  // no node has room for a stage: placement says so with its counts
    ASSIGN_OR_RETURN(closest, PlanMemory(f, tensors.front(), pipeline ? *pipeline : 1, kv_tokens));
    if (closest_out) *closest_out = *closest;
    return absl::FailedPreconditionError(
        absl::StrCat("the nodes have room for no stage of TP=", tensors.front()));
  }
  if (closest_out) *closest_out = *closest;
  return absl::FailedPreconditionError(
      absl::StrCat(DescribeStage(closest->largest_stage, closest->tensor,
                                 closest->stages[closest->largest_stage]),
                   " with ", closest->pipeline, closest->pipeline == 1 ? " stage" : " stages",
                   " (the closest of the plans the nodes have room for); the nodes have ",
                   FormatGiB(gpu_memory)));
}

absl::StatusOr<SpecPlan> PlanSpec(const ModelFootprint& model, const ShardedModelSpec& spec,
                                  const std::vector<NodeInfo>& nodes) {
  ModelFootprint f = model;
  UseKvCacheDtype(f, spec.kv_cache_dtype);
  UseSpeculativeMethod(f, spec.speculative_method);
  const PlacementRequest request = PlacementRequestFor(spec, {});
  SpecPlan plan;
  std::vector<int64_t> node_gpus;
  for (const NodeInfo& n : nodes) {
    if (n.gpus < 1 || !Eligible(n, request)) continue;
    node_gpus.push_back(n.gpus);
    const int64_t memory = GpuMemoryOf(n, request);
    if (memory > 0 && (plan.gpu_memory == 0 || memory < plan.gpu_memory)) plan.gpu_memory = memory;
  }
  const int64_t tokens = spec.kv_cache_tokens();
  if (!spec.tensor_auto && !spec.pipeline_auto) {
    auto c = PlanMemory(f, spec.tensor, spec.pipeline, tokens);
    if (!c.ok()) {
      const bool tp = CheckTensorParallel(f, spec.tensor).ok() == false;
      return absl::Status(
          c.status().code(),
          absl::StrCat(tp ? "spec.parallelism.tensor " : "spec.parallelism.pipeline ",
                       tp ? spec.tensor : spec.pipeline, ": ", c.status().message()));
    }
    plan.choice = *std::move(c);
    return plan;
  }
  ParallelismChoice closest;
  auto c = ChooseParallelism(f, spec.tensor_auto ? std::nullopt : std::optional(spec.tensor),
                             spec.pipeline_auto ? std::nullopt : std::optional(spec.pipeline),
                             node_gpus, static_cast<double>(plan.gpu_memory), tokens, &closest);
  if (!c.ok() && !closest.stages.empty()) {  // nothing fits: placement says so, with numbers
    plan.choice = std::move(closest);
    return plan;
  }
  if (!c.ok()) {
    return absl::Status(
        c.status().code(),
        absl::StrCat("spec.parallelism ", spec.tensor_auto ? "tensor" : "",
                     spec.tensor_auto && spec.pipeline_auto ? " and " : "",
                     spec.pipeline_auto ? "pipeline" : "", " auto: ", c.status().message()));
  }
  plan.choice = *std::move(c);
  return plan;
}

PlacementRequest MemoryAwareRequest(const ShardedModelSpec& spec, const SpecPlan& plan,
                                    std::vector<int64_t> replicas) {
  PlacementRequest r = PlacementRequestFor(spec, std::move(replicas));
  r.tensor = plan.choice.tensor;
  r.pipeline = plan.choice.pipeline;
  r.memory_needed = plan.choice.largest;
  if (!plan.choice.stages.empty()) {
    r.memory_need = DescribeStage(plan.choice.largest_stage, plan.choice.tensor,
                                  plan.choice.stages[plan.choice.largest_stage]);
  }
  return r;
}

}  // namespace shardserve
