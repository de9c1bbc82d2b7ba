#pragma once
// `shardserve bench allreduce`: the shared-memory all-reduce between processes, 4 KiB to 64 MiB:
// algorithm and bus bandwidth (nccl-tests: busbw = algbw * 2(n-1)/n) against the machine's memcpy
// bandwidth measured in the same run, and small-message latency.
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardserve {

absl::Status RunAllReduceBench(const std::vector<std::string>& argv);
inline constexpr char kAllReduceBenchUsage[] =
    "[--processes N]\n(allreduce latency and bandwidth across processes, shared memory vs TCP)";

}  // namespace shardserve
