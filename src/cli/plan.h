#pragma once
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardserve {

// `shardserve plan -f MANIFEST --nodes NODES.yaml [--pods PODS.yaml]`: prints the placement of
// every replica, or why a replica cannot be placed (then FailedPrecondition).
absl::Status RunPlan(std::vector<std::string> argv);
inline constexpr char kPlanUsage[] =
    "-f MANIFEST.yaml --nodes NODES.yaml [--pods PODS.yaml]\n"
    "(where the operator would place each replica, or why it cannot; no cluster needed)";

}  // namespace shardserve
