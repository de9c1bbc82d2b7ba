#include "plan/layer_split.h"

#include <algorithm>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

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

StageCosts CostsOf(const ModelShape& m) {
  const double H = static_cast<double>(m.hidden), I = static_cast<double>(m.intermediate);
  const double experts = m.experts_per_token > 0 ? static_cast<double>(m.experts_per_token) : 1.0;
  return {2 * H * static_cast<double>(m.q_dim) + 2 * H * static_cast<double>(m.kv_dim) +
              experts * 3 * H * I,
          H, H * static_cast<double>(m.vocab)};
}

absl::StatusOr<std::vector<LayerRange>> PlanStageLayers(const ModelShape& shape, int pp) {
  return SplitLayers(shape.layers, pp, CostsOf(shape));
}

namespace {

// The fields of the shape's JSON with their upper bounds (a model's config is input: a size
// past these is a broken file, not a model).
struct ShapeField {
  const char* name;
  int64_t ModelShape::*field;
  int64_t min, max;
};
constexpr ShapeField kShapeFields[] = {
    {"layers", &ModelShape::layers, 1, 1 << 16},
    {"hidden", &ModelShape::hidden, 1, 1 << 20},
    {"intermediate", &ModelShape::intermediate, 1, 1 << 22},
    {"qDim", &ModelShape::q_dim, 1, 1 << 22},
    {"kvDim", &ModelShape::kv_dim, 1, 1 << 22},
    {"vocab", &ModelShape::vocab, 1, 1 << 24},
    {"expertsPerToken", &ModelShape::experts_per_token, 0, 1 << 10},
};

}  // namespace

nlohmann::json ShapeToJson(const ModelShape& shape) {
  nlohmann::json j = nlohmann::json::object();
  for (const ShapeField& f : kShapeFields) j[f.name] = shape.*f.field;
  return j;
}

absl::StatusOr<ModelShape> ShapeFromJson(const nlohmann::json& j) {
  if (!j.is_object()) return absl::InvalidArgumentError("the model's shape is not a JSON object");
  ModelShape shape;
  for (const ShapeField& f : kShapeFields) {
    auto it = j.find(f.name);
    if (it == j.end() || !it->is_number_integer()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the model's shape has no integer '", f.name, "'"));
    }
    const int64_t v = it->get<int64_t>();
    if (v < f.min || v > f.max) {
      return absl::InvalidArgumentError(absl::StrCat("the model's shape: '", f.name, "' is ", v,
                                                     ", outside [", f.min, ", ", f.max, "]"));
    }
    shape.*f.field = v;
  }
  return shape;
}

std::string FormatLayerRange(const LayerRange& r) { return absl::StrCat(r.begin, "-", r.end - 1); }

std::string FormatStageLayers(const std::vector<LayerRange>& split) {
  return absl::StrJoin(
      split, ",", [](std::string* out, const LayerRange& r) { out->append(FormatLayerRange(r)); });
}

absl::StatusOr<std::vector<LayerRange>> ParseStageLayers(absl::string_view text, int64_t num_layers,
                                                         int pp) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("stage layers '", text.substr(0, 200), "': ", why));
  };
  std::vector<LayerRange> out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    const size_t dash = part.find('-');
    int64_t first, last;
    if (dash == absl::string_view::npos || !absl::SimpleAtoi(part.substr(0, dash), &first) ||
        !absl::SimpleAtoi(part.substr(dash + 1), &last)) {
      return bad(absl::StrCat("'", part.substr(0, 40), "' is not FIRST-LAST"));
    }
    const int64_t begin = out.empty() ? 0 : out.back().end;
    if (first != begin || last < first) {
      return bad(absl::StrCat("stage ", out.size(), " must start at layer ", begin,
                              " and hold at least one layer"));
    }
    out.push_back({first, last + 1});
    if (out.size() > static_cast<size_t>(pp)) break;
  }
  if (out.size() != static_cast<size_t>(pp)) {
    return bad(absl::StrCat("has ", out.size(), " stage(s), the pipeline ", pp));
  }
  if (out.back().end != num_layers) {
    return bad(absl::StrCat("ends at layer ", out.back().end - 1, "; the model has ", num_layers,
                            " layers"));
  }
  return out;
}

}  // namespace shardserve
