#pragma once
// The step protocol between a replica's leader and its other ranks (DESIGN.md §5), on the mesh
// in the frames of comm/json_frame.h: the leader sends every rank each step (or a ping, or a
// stop), and the last stage's tp_rank 0 answers each step with its sampled tokens. Decoding
// checks every field and names the one that is wrong.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "absl/status/statusor.h"
#include "serve/step.h"

namespace shardserve {

// A frame on the mesh holds at most this (a step of a long prompt is the largest).
inline constexpr uint32_t kMaxStepMessage = 64u << 20;

enum class StepMessageType { kStep, kPing, kStop, kKvImport, kLora };

nlohmann::json EncodeStep(const StepDesc& step);
nlohmann::json EncodePing();
nlohmann::json EncodeStop();
absl::StatusOr<StepMessageType> DecodeStepMessageType(const nlohmann::json& message);
absl::StatusOr<StepDesc> DecodeStep(const nlohmann::json& message);

// How the last stage samples a sequence (temperature, top_p, top_k, seed, top_logprobs; the
// stopping fields stay on the leader).
nlohmann::json EncodeSamplingParams(const SamplingParams& params);
absl::StatusOr<SamplingParams> DecodeSamplingParams(const nlohmann::json& params);

// A ticket as text (hex) and back.
std::string KvTicketHex(const KvTicket& ticket);
absl::StatusOr<KvTicket> KvTicketFromHex(const std::string& hex);

// How a role holds the KV ({tp, stages: [[begin, end], ...], kv_heads, latent, block_size}).
nlohmann::json EncodeKvRoleShape(const KvRoleShape& shape);
absl::StatusOr<KvRoleShape> DecodeKvRoleShape(const nlohmann::json& shape);

// The leader's import order to every rank, and each rank's answer ("error" empty: pulled).
nlohmann::json EncodeKvImport(const KvImport& import);
absl::StatusOr<KvImport> DecodeKvImport(const nlohmann::json& message);
nlohmann::json EncodeKvImported(int64_t seq, const absl::Status& transfer, int64_t bytes);
// Whether a frame from a rank is an import answer (else: a step result).
bool IsKvImported(const nlohmann::json& message);
// The answer's transfer status as the rank saw it and the bytes it pulled; an error when the
// answer is malformed or for another sequence.
absl::Status DecodeKvImported(const nlohmann::json& message, int64_t seq, absl::Status* transfer,
                              int64_t* bytes);

// A LoRA order to every rank, and each rank's answer to an install ("error" empty: installed).
nlohmann::json EncodeLoraOrder(const LoraOrder& order);
absl::StatusOr<LoraOrder> DecodeLoraOrder(const nlohmann::json& message);
nlohmann::json EncodeLoraInstalled(int32_t slot, const absl::Status& result);
bool IsLoraInstalled(const nlohmann::json& message);
// The rank's result; an error when the answer is malformed or for another slot.
absl::Status DecodeLoraInstalled(const nlohmann::json& message, int32_t slot, absl::Status* result);

nlohmann::json EncodeStepResult(const StepResult& result);
absl::StatusOr<StepResult> DecodeStepResult(const nlohmann::json& message);

}  // namespace shardserve
