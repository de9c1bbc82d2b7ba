#pragma once
// A random LoRA adapter of a model, written as PEFT writes one (adapter_config.json and
// adapter_model.safetensors, F32), for benchmarks and tests that need many adapters: every dense
// layer's attention and MLP projections (target_modules "all-linear"), rank `rank`, A and B
// uniform in [-bound, bound) from `seed`.
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "model/config.h"

namespace shardserve {

struct AdapterOptions {
  int64_t rank = 16;
  double alpha = 32;
  float bound = 0.05f;
  uint64_t seed = 1;
};
absl::Status WriteRandomAdapter(const std::string& dir, const ModelConfig& base,
                                const AdapterOptions& o);

}  // namespace shardserve
