#pragma once
// The processes' log (stderr): one line per event, with its level, the time and who wrote it,
// like klog's header, so that the lines of many ranks, interleaved in one terminal or in
// `kubectl logs`, each say where they come from:
//   I1123 02:40:00.123456 rank 3 (stage 1, tp 1)] leader: ready
// SHARDSERVE_LOG_LEVEL (debug, info, warning, error; default info) drops the lower levels.
// Thread-safe: each line is one write.
#include <string>

#include "absl/strings/str_cat.h"

namespace shardserve {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Who this process is in every line from now on ("operator", "rank 3 (stage 1, tp 1)", ...).
void SetLogIdentity(const std::string& identity);
void LogLine(LogLevel level, const std::string& message);

template <typename... Parts>
void LogInfo(const Parts&... parts) {
  LogLine(LogLevel::kInfo, absl::StrCat(parts...));
}
template <typename... Parts>
void LogWarning(const Parts&... parts) {
  LogLine(LogLevel::kWarning, absl::StrCat(parts...));
}
template <typename... Parts>
void LogError(const Parts&... parts) {
  LogLine(LogLevel::kError, absl::StrCat(parts...));
}

}  // namespace shardserve
