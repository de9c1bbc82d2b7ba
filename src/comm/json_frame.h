#pragma once
// The one framing of the control messages between shardserve processes (the rendezvous; the
// leader's steps to its ranks and their results, serve/step_wire.h): a 4-byte little-endian
// length, then that many bytes of one JSON object. Every reader caps the length it accepts, and
// the typed field readers name the field that is missing or of the wrong type, so hostile or
// corrupt bytes are an error that says what was wrong, never an exception.
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve {

// Reads exactly `bytes` into `data` (from a socket before a deadline, from a communicator, ...).
using ReadExactly = std::function<absl::Status(void* data, size_t bytes)>;

// Writes exactly `bytes` from `data`.
using WriteAll = std::function<absl::Status(const void* data, size_t bytes)>;

// The frame of `message`: its length, then its text.
std::string EncodeJsonFrame(const nlohmann::json& message);

// Writes a frame of EncodeJsonFrame as two writes, the length and then the text: a
// message-based communicator delivers each as one message, which ReadJsonFrame's two reads take.
absl::Status WriteJsonFrame(const WriteAll& write, const std::string& frame);

// One frame of at most `max_bytes` holding a JSON object; `what` names the message in errors
// ("a rendezvous message", "a step message").
absl::StatusOr<nlohmann::json> ReadJsonFrame(const ReadExactly& read, uint32_t max_bytes,
                                             const char* what);

// Typed fields of a message: absent, of another type or out of bounds is a DataLoss error
// naming the field.
absl::StatusOr<int64_t> JsonInt(const nlohmann::json& m, const char* key, int64_t min, int64_t max);
absl::StatusOr<std::string> JsonString(const nlohmann::json& m, const char* key, size_t max_bytes);
absl::StatusOr<bool> JsonBool(const nlohmann::json& m, const char* key);
absl::StatusOr<double> JsonNumber(const nlohmann::json& m, const char* key);
// An array field (the reference stays valid while `m` does).
absl::StatusOr<const nlohmann::json*> JsonArray(const nlohmann::json& m, const char* key);
// An array of integers in [min, max].
absl::StatusOr<std::vector<int64_t>> JsonInts(const nlohmann::json& m, const char* key, int64_t min,
                                              int64_t max);

}  // namespace shardserve
