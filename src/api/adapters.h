#pragma once
// The LoRA adapters a replica serves (model/lora.h) as the worker contract names them
// (SHARDSERVE_LORA_ADAPTERS: a JSON array of {"name", "path"}, the manifest's spec.adapters with
// each uri resolved to a directory the ranks read) and as the leader maps a request's `model` to
// them: each declared adapter has the slot of its place in the list.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve {

struct AdapterRef {
  std::string name;
  std::string path;
  bool operator==(const AdapterRef&) const = default;
};

// What an adapter's name may be: 1 to 128 characters of letters, digits and . _ - / : (an
// OpenAI model id; never empty, never only dots).
absl::Status CheckAdapterName(const std::string& name);

// Parses SHARDSERVE_LORA_ADAPTERS ("" : none). Every name checked and distinct, every path
// non-empty, at most kMaxAdapters entries; errors name the entry and the variable.
inline constexpr size_t kMaxAdapters = 1024;
absl::StatusOr<std::vector<AdapterRef>> ParseAdapterList(std::string_view text);
std::string EncodeAdapterList(const std::vector<AdapterRef>& adapters);

// The slot of the adapter a request's `model` names, nullopt for the base model's name; NotFound
// naming it when it is neither.
absl::StatusOr<std::optional<int32_t>> AdapterSlotOf(const std::vector<AdapterRef>& adapters,
                                                     const std::string& base,
                                                     const std::string& model);

}  // namespace shardserve
