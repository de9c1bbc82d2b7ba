#pragma once
// Pipeline layer split (pure): contiguous layer ranges per stage that balance the cost per stage,
// counting the embedding on the first stage and the final norm + LM head on the last.
//
// The operator computes the split once from the model's shape (which `shardserve-worker inspect`
// reads from the model's files in the cluster), writes it into status.plan.stageLayers and hands
// it to every rank in SHARDSERVE_STAGE_LAYERS; `shardserve local` does the same on one machine.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardserve {

struct LayerRange {
  int64_t begin = 0;  // first layer
  int64_t end = 0;    // one past the last layer
};

struct StageCosts {
  double layer = 1.0;  // per transformer layer
  double first = 0.0;  // extra on the first stage (embedding)
  double last = 0.0;   // extra on the last stage (final norm + LM head)
};

// Minimizes the most expensive stage; every stage gets at least one layer. Errors name the
// numbers (more stages than layers).
absl::StatusOr<std::vector<LayerRange>> SplitLayers(int64_t num_layers, int pp,
                                                    const StageCosts& costs);

// What the split needs to know of a model: its sizes (model/config.h's ModelConfig has them all).
struct ModelShape {
  int64_t layers = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;       // of one MLP (one expert's, for a MoE model)
  int64_t q_dim = 0, kv_dim = 0;  // attention: heads x head dim
  int64_t vocab = 0;
  int64_t experts_per_token = 0;  // 0: a dense MLP
  bool operator==(const ModelShape&) const = default;
};

// The cost per stage: multiply-adds per token of a layer (attention projections and the MLP,
// each active expert counted), the embedding row on the first stage, the LM head on the last.
StageCosts CostsOf(const ModelShape& shape);
absl::StatusOr<std::vector<LayerRange>> PlanStageLayers(const ModelShape& shape, int pp);

// The shape as `shardserve-worker inspect` reports it and status.model keeps it:
// {"layers":..,"hidden":..,"intermediate":..,"qDim":..,"kvDim":..,"vocab":..,
//  "expertsPerToken":..}. Reading checks every field (an integer, within bounds).
nlohmann::json ShapeToJson(const ModelShape& shape);
absl::StatusOr<ModelShape> ShapeFromJson(const nlohmann::json& j);

// Stage layers as text, one inclusive range a stage: "0-11,12-23" (status.plan.stageLayers
// holds the same ranges one per item). Parsing checks that the ranges are `pp` contiguous,
// non-empty stages from layer 0 to the last of `num_layers`.
std::string FormatLayerRange(const LayerRange& range);
std::string FormatStageLayers(const std::vector<LayerRange>& split);
absl::StatusOr<std::vector<LayerRange>> ParseStageLayers(absl::string_view text, int64_t num_layers,
                                                         int pp);

}  // namespace shardserve
