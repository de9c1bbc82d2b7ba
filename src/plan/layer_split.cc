#include "plan/layer_split.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace shardserve {

absl::StatusOr<std::vector<LayerRange>> SplitLayers(int64_t num_layers, int pp,
                                                    const StageCosts& costs) {
  if (pp < 1) return absl::InvalidArgumentError(absl::StrCat("pipeline stages ", pp, " < 1"));
  if (num_layers < pp) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the model has ", num_layers, " layers: too few for ", pp, " pipeline stages"));
  }
  auto cost = [&](int stage, int64_t layers) {
    return layers * costs.layer + (stage == 0 ? costs.first : 0.0) +
           (stage == pp - 1 ? costs.last : 0.0);
  };
  // best[s][l]: for stages s.. over the last l layers, the smallest maximum stage cost, then
  // (among equal maxima) the smallest sum of squared stage costs, i.e. the most even split.
  using Score = std::pair<double, double>;
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<Score>> best(pp + 1, std::vector<Score>(num_layers + 1, {inf, inf}));
  std::vector<std::vector<int64_t>> take(pp + 1, std::vector<int64_t>(num_layers + 1, 0));
  best[pp][0] = {0, 0};
  for (int s = pp - 1; s >= 0; --s) {
    for (int64_t l = 1; l <= num_layers; ++l) {
      for (int64_t k = 1; k <= l - (pp - 1 - s); ++k) {  // leave a layer for each later stage
        const double c = cost(s, k);
        const Score& rest = best[s + 1][l - k];
        const Score v{std::max(c, rest.first), c * c + rest.second};
        if (v < best[s][l]) {
          best[s][l] = v;
          take[s][l] = k;
        }
      }
    }
  }
  std::vector<LayerRange> out;
  int64_t begin = 0;
  for (int s = 0; s < pp; ++s) {
    const int64_t k = take[s][num_layers - begin];
    out.push_back({begin, begin + k});
    begin += k;
  }
  return out;
}

}  // namespace shardserve
