#pragma once
// `shardserve bench`: decode and prefill speed of the CPU runtime against the machine's measured
// memory bandwidth and FMA peak, and the resident memory of the serving process.
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/thread_pool.h"
#include "model/config.h"

namespace shardserve {

absl::Status RunRuntimeBench(const std::vector<std::string>& argv);
inline constexpr char kRuntimeBenchUsage[] =
    "--model DIR [--threads N --decode-tokens N --prefill-tokens N --context N\n"
    "--kv-cache-dtype auto|f32|bf16|f16|fp8]\n(CPU decode and prefill of one rank; --context: "
    "decode after N cached positions)";

// Weight bytes one decode step reads (every layer's active matrices and the LM head), and the
// parameters of one layer that a token goes through, from the model's shape and weight bytes.
struct DecodeCost {
  double bytes_per_param = 0;
  double active_layer_params = 0;
  double weight_bytes_per_step = 0;
};
DecodeCost DecodeCostOf(const ModelConfig& c, size_t weight_bytes);

// STREAM-like read bandwidth of the pool's threads, bytes/s (best of 5): every thread sums its
// part of a 3 GiB buffer, far larger than the caches.
double ReadBandwidth(ThreadPool& pool);

}  // namespace shardserve
