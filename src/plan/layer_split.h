#pragma once
// Pipeline layer split (pure): contiguous layer ranges per stage that balance the cost per stage,
// counting the embedding on the first stage and the final norm + LM head on the last.
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

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

}  // namespace shardserve
