#pragma once
// `shardserve bench cuda`: decode on the CUDA backend (one GPU) at several batch sizes: tokens/s,
// inter-token latency, and the effective HBM bandwidth (weights + KV cache read per step) as a
// share of the device's copy bandwidth, measured in the same run. Needs a GPU and a CUDA build.
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardserve {

absl::Status RunCudaBench(const std::vector<std::string>& argv);
inline constexpr char kCudaBenchUsage[] =
    "--model DIR [--batch 1,32 --steps N --prompt-tokens N --profile-steps N]\n(decode and "
    "prefill on a GPU)";

}  // namespace shardserve
