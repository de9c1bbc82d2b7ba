#pragma once
// `shardserve bench`: decode and prefill speed of the CPU runtime against the machine's measured
// memory bandwidth and FMA peak, and the resident memory of the serving process.
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardserve {

absl::Status RunRuntimeBench(const std::vector<std::string>& argv);

}  // namespace shardserve
