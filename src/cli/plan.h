#pragma once
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardserve {

// `shardserve plan -f MANIFEST --nodes NODES.yaml [--pods PODS.yaml]`: prints the placement of
// every replica, or why a replica cannot be placed (then FailedPrecondition).
absl::Status RunPlan(std::vector<std::string> argv);

}  // namespace shardserve
