#pragma once
// Reads the fields of a model's config.json with the bounds of what a model can be; every error
// names the file and the key. Shared by the config a rank runs (config.cc) and the footprint a
// plan weighs (footprint.cc).
#include <array>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "backend/dtype.h"
#include "common/status.h"

namespace shardserve {
namespace config_internal {

using json = nlohmann::json;

// Bounds of what a model can be: far past every real model, short of what would exhaust memory
// or overflow the arithmetic that sizes tensors.
inline constexpr int64_t kMaxSize = int64_t{1} << 24;    // vocabulary, positions, any dimension
inline constexpr int64_t kMaxLayers = int64_t{1} << 12;  // transformer layers
inline constexpr int64_t kMaxHeads = int64_t{1} << 12;   // attention heads, experts
inline constexpr double kMaxNumber = 1e30;
// RoPE's base: above 1 (or every frequency is 1 or more), at most far past the largest in use
// (1e8); past that the frequencies underflow.
inline constexpr double kMaxRopeTheta = 1e12;

class Reader {
 public:
  Reader(const json& j, std::string source) : j_(j), source_(std::move(source)) {}

  absl::Status Error(const std::string& key, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": '", key, "' ", what));
  }
  bool Has(const std::string& key) const { return j_.contains(key) && !j_[key].is_null(); }
  // A field transformers' config class knows by several names (its attribute_map: Qwen3-MoE's
  // num_experts is num_local_experts in transformers 5): the name the file uses, the first of
  // `names` where it uses none (so that an error names that one); two that disagree are an error.
  absl::StatusOr<std::string> Named(std::initializer_list<const char*> names) const {
    const char* found = nullptr;
    for (const char* n : names) {
      if (!Has(n)) continue;
      if (found != nullptr && j_[n] != j_[found]) {
        return Error(n, absl::StrCat("disagrees with '", found, "' (transformers reads them as ",
                                     "one field)"));
      }
      if (found == nullptr) found = n;
    }
    return std::string(found != nullptr ? found : *names.begin());
  }

  absl::StatusOr<int64_t> Int(const std::string& key, std::optional<int64_t> def = {}) const {
    if (!Has(key)) {
      if (def) return *def;
      return Error(key, "is required");
    }
    if (!j_[key].is_number_integer()) return Error(key, "must be an integer");
    return j_[key].get<int64_t>();
  }
  // In [1, max]: a size past `max` is a broken file, not a model (it would only be found when
  // the memory for it runs out).
  absl::StatusOr<int64_t> Positive(const std::string& key, std::optional<int64_t> def = {},
                                   int64_t max = kMaxSize) const {
    ASSIGN_OR_RETURN(int64_t v, Int(key, def));
    if (v <= 0) return Error(key, absl::StrCat("must be positive, got ", v));
    if (v > max) return Error(key, absl::StrCat("is ", v, ", more than any model has (", max, ")"));
    return v;
  }
  // A finite number in (min, max] (min excluded).
  absl::StatusOr<double> Number(const std::string& key, double def, double min = -kMaxNumber,
                                double max = kMaxNumber) const {
    if (!Has(key)) return def;
    if (!j_[key].is_number()) return Error(key, "must be a number");
    const double v = j_[key].get<double>();
    if (!std::isfinite(v) || !(v > min) || v > max) {
      return Error(key, absl::StrCat("is ", v, "; it must lie in (", min, ", ", max, "]"));
    }
    return v;
  }
  absl::StatusOr<bool> Bool(const std::string& key, bool def) const {
    if (!Has(key)) return def;
    if (!j_[key].is_boolean()) return Error(key, "must be true or false");
    return j_[key].get<bool>();
  }
  absl::StatusOr<std::string> String(const std::string& key, const std::string& def) const {
    if (!Has(key)) return def;
    if (!j_[key].is_string()) return Error(key, "must be a string");
    return j_[key].get<std::string>();
  }
  const std::string& source() const { return source_; }

 private:
  const json& j_;
  std::string source_;
};

// The model's dtype: torch_dtype (transformers 5: dtype), bfloat16 where it names none.
inline absl::StatusOr<DType> TorchDtype(const Reader& r) {
  ASSIGN_OR_RETURN(std::string dtype, r.String("torch_dtype", ""));
  if (dtype.empty()) {
    ASSIGN_OR_RETURN(dtype, r.String("dtype", "bfloat16"));
  }
  if (dtype == "bfloat16") return DType::kBF16;
  if (dtype == "float16") return DType::kF16;
  if (dtype == "float32") return DType::kF32;
  return r.Error("torch_dtype", absl::StrCat("'", dtype, "' is not bfloat16, float16 or float32"));
}

// quantization_config.weight_block_size of a fine-grained FP8 checkpoint ([rows, columns] of the
// blocks that share a scale; 128 x 128, Hugging Face's default, where it is absent; 0 x 0 for
// null, a scale per tensor).
inline absl::StatusOr<std::array<int64_t, 2>> WeightBlockSize(const json& q, const Reader& qr) {
  // null: one scale per tensor (transformers' FP8Linear with block_size None).
  if (q.contains("weight_block_size") && q["weight_block_size"].is_null()) {
    return std::array<int64_t, 2>{0, 0};
  }
  if (!qr.Has("weight_block_size")) return std::array<int64_t, 2>{128, 128};
  const json& b = q["weight_block_size"];
  if (!b.is_array() || b.size() != 2 || !b[0].is_number_integer() || !b[1].is_number_integer() ||
      b[0].get<int64_t>() < 1 || b[1].get<int64_t>() < 1 || b[0].get<int64_t>() > 65536 ||
      b[1].get<int64_t>() > 65536) {
    return qr.Error("weight_block_size",
                    "must be two integers in [1, 65536]: [rows, columns] (or null: a scale per "
                    "tensor)");
  }
  return std::array<int64_t, 2>{b[0].get<int64_t>(), b[1].get<int64_t>()};
}

}  // namespace config_internal
}  // namespace shardserve
