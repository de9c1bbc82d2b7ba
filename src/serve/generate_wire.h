#pragma once
// The one-shot run of `shardserve generate` (DESIGN.md §5): the CLI hands the leader a request
// in SHARDSERVE_REQUEST (api/worker_env.h) and reads its result back from SHARDSERVE_RESULT_FILE.
// Both are JSON objects read with the typed field readers of comm/json_frame.h, so a malformed
// one is an error naming the field, never an exception.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <vector>

#include "absl/status/statusor.h"
#include "model/generation.h"

namespace shardserve {

// `batch` copies of one request, run together.
struct GenerateRun {
  GenerationRequest request;
  int64_t batch = 1;
};

// The leader's answer: one result per copy, and the generation time (start-up excluded).
struct GenerateOutcome {
  std::vector<GenerationResult> results;
  double seconds = 0;
  // Speculative decoding: tokens drafted and kept, over the run.
  int64_t drafted = 0, accepted = 0;
  // The drafts of one request (the first to draft), step by step: those each step carried, kept
  // or not.
  std::vector<std::vector<int32_t>> drafts;
};

nlohmann::json EncodeGenerateRun(const GenerateRun& run);
absl::StatusOr<GenerateRun> DecodeGenerateRun(const nlohmann::json& message);

nlohmann::json EncodeGenerateOutcome(const GenerateOutcome& outcome);
absl::StatusOr<GenerateOutcome> DecodeGenerateOutcome(const nlohmann::json& message);

}  // namespace shardserve
