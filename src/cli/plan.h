#pragma once
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardserve {

// `shardserve plan -f MANIFEST --nodes NODES.yaml [--pods PODS.yaml] [--model DIR]`: prints the
// model's memory, the parallelism (chosen, for auto), each stage's layers and bytes per GPU, and
// the placement of every replica, or why a replica cannot be placed (then FailedPrecondition).
absl::Status RunPlan(std::vector<std::string> argv);
inline constexpr char kPlanUsage[] =
    "-f MANIFEST.yaml --nodes NODES.yaml [--pods PODS.yaml] [--model DIR|config.json|FILE.gguf]\n"
    "(where the operator would place each replica and what each GPU holds, or why it cannot;\n"
    "no cluster needed; --model reads the model from here instead of spec.model.uri)\n"
    "--model DIR --footprint   (the model's footprint as JSON, as the operator reads it)";

}  // namespace shardserve
