#pragma once
// spec.serving.kvCacheDtype (SHARDSERVE_KV_CACHE_DTYPE, `--kv-cache-dtype`): how the ranks' KV
// caches keep their values (backend/backend.h KvFormat). auto: the model's dtype (config.json's
// torch_dtype: F32, F16 or BF16, BF16 where it names none; a GGUF file's F16, llama.cpp's
// default); fp8: E4M3 under the checkpoint's per-layer k_scale / v_scale, or 1 where it has none
// (vLLM's default).
#include <cstdint>
#include <optional>
#include <string_view>

namespace shardserve {

enum class KvCacheDtype { kAuto, kF32, kBF16, kF16, kFP8 };

inline std::optional<KvCacheDtype> ParseKvCacheDtype(std::string_view name) {
  if (name == "auto") return KvCacheDtype::kAuto;
  if (name == "f32") return KvCacheDtype::kF32;
  if (name == "bf16") return KvCacheDtype::kBF16;
  if (name == "f16") return KvCacheDtype::kF16;
  if (name == "fp8") return KvCacheDtype::kFP8;
  return std::nullopt;
}
inline constexpr const char* kKvCacheDtypes = "auto, f32, bf16, f16 or fp8";

inline const char* KvCacheDtypeName(KvCacheDtype t) {
  switch (t) {
    case KvCacheDtype::kF32:
      return "f32";
    case KvCacheDtype::kBF16:
      return "bf16";
    case KvCacheDtype::kF16:
      return "f16";
    case KvCacheDtype::kFP8:
      return "fp8";
    default:
      return "auto";
  }
}

// Bytes of one cached value; auto takes the model's (`auto_bytes`).
inline int64_t KvCacheDtypeBytes(KvCacheDtype t, int64_t auto_bytes) {
  switch (t) {
    case KvCacheDtype::kF32:
      return 4;
    case KvCacheDtype::kBF16:
    case KvCacheDtype::kF16:
      return 2;
    case KvCacheDtype::kFP8:
      return 1;
    default:
      return auto_bytes;
  }
}

}  // namespace shardserve
