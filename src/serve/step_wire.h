#pragma once
// The step protocol between a replica's leader and its other ranks (DESIGN.md §5), on the mesh
// in the frames of comm/json_frame.h: the leader sends every rank each step (or a ping, or a
// stop), and the last stage's tp_rank 0 answers each step with its sampled tokens. Decoding
// checks every field and names the one that is wrong.
#include <cstdint>
#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "serve/step.h"

namespace shardserve {

// A frame on the mesh holds at most this (a step of a long prompt is the largest).
inline constexpr uint32_t kMaxStepMessage = 64u << 20;

enum class StepMessageType { kStep, kPing, kStop };

nlohmann::json EncodeStep(const StepDesc& step);
nlohmann::json EncodePing();
nlohmann::json EncodeStop();
absl::StatusOr<StepMessageType> DecodeStepMessageType(const nlohmann::json& message);
absl::StatusOr<StepDesc> DecodeStep(const nlohmann::json& message);

// How the last stage samples a sequence (temperature, top_p, top_k, seed, top_logprobs; the
// stopping fields stay on the leader).
nlohmann::json EncodeSamplingParams(const SamplingParams& params);
absl::StatusOr<SamplingParams> DecodeSamplingParams(const nlohmann::json& params);

nlohmann::json EncodeStepResult(const StepResult& result);
absl::StatusOr<StepResult> DecodeStepResult(const nlohmann::json& message);

}  // namespace shardserve
