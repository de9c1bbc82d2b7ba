#pragma once
// spec.serving.speculative (SHARDSERVE_SPECULATIVE_METHOD / _TOKENS, `--speculative`,
// `--speculative-tokens`): how a replica drafts tokens for its decode steps to verify
// (serve/speculative.h). ngram: prompt lookup, the tokens that followed the latest earlier
// occurrence of the sequence's last few tokens; draft: a smaller model of the same vocabulary
// (draftModel; SHARDSERVE_DRAFT_MODEL, `--draft-model`), run by the replica's leader, its greedy
// tokens. mtp: the checkpoint's own multi-token-prediction layer (DeepSeek-V3's nextn layer), run
// by the last stage after each step: one draft a step. none: no speculation.
#include <cstdint>
#include <optional>
#include <string_view>

namespace shardserve {

enum class SpeculativeMethod { kNone, kNgram, kDraft, kMtp };

inline std::optional<SpeculativeMethod> ParseSpeculativeMethod(std::string_view name) {
  if (name == "none" || name.empty()) return SpeculativeMethod::kNone;
  if (name == "ngram") return SpeculativeMethod::kNgram;
  if (name == "draft") return SpeculativeMethod::kDraft;
  if (name == "mtp") return SpeculativeMethod::kMtp;
  return std::nullopt;
}
inline constexpr const char* kSpeculativeMethods = "none, ngram, draft or mtp";

inline const char* SpeculativeMethodName(SpeculativeMethod m) {
  switch (m) {
    case SpeculativeMethod::kNgram:
      return "ngram";
    case SpeculativeMethod::kDraft:
      return "draft";
    case SpeculativeMethod::kMtp:
      return "mtp";
    default:
      return "none";
  }
}

// Tokens drafted a step: the default and the most; mtp drafts one (its one layer, once).
inline constexpr int64_t kDefaultSpeculativeTokens = 4;
inline constexpr int64_t kMaxSpeculativeTokens = 16;
inline constexpr int64_t kMtpSpeculativeTokens = 1;

struct SpeculativeConfig {
  SpeculativeMethod method = SpeculativeMethod::kNone;
  int64_t tokens = kDefaultSpeculativeTokens;  // drafted per decode step, at most
  // n-gram lookup: the longest and shortest suffix looked for, longest first.
  int64_t ngram_max = 4, ngram_min = 2;
  bool enabled() const { return method != SpeculativeMethod::kNone && tokens > 0; }
};

}  // namespace shardserve
