#pragma once
// Minimal leveled logging to stderr: SS_LOG(INFO) << "...". Thread-safe per line.
#include <sstream>
#include <string_view>

namespace shardserve {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Messages below this level are dropped; set from $SHARDSERVE_LOG_LEVEL (debug|info|warning|error).
LogLevel MinLogLevel();

class LogLine {
 public:
  LogLine(LogLevel level, const char* file, int line);
  ~LogLine();
  LogLine(const LogLine&) = delete;
  LogLine& operator=(const LogLine&) = delete;
  template <typename T>
  LogLine& operator<<(const T& v) {
    if (enabled_) stream_ << v;
    return *this;
  }

 private:
  bool enabled_;
  LogLevel level_;
  std::ostringstream stream_;
};

}  // namespace shardserve

#define SS_LOG(level) ::shardserve::LogLine(::shardserve::LogLevel::k##level, __FILE__, __LINE__)
