#include "common/log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

namespace shardserve {

LogLevel MinLogLevel() {
  static const LogLevel level = [] {
    const char* env = std::getenv("SHARDSERVE_LOG_LEVEL");
    if (env == nullptr) return LogLevel::kInfo;
    if (std::strcmp(env, "debug") == 0) return LogLevel::kDebug;
    if (std::strcmp(env, "warning") == 0) return LogLevel::kWarning;
    if (std::strcmp(env, "error") == 0) return LogLevel::kError;
    return LogLevel::kInfo;
  }();
  return level;
}

LogLine::LogLine(LogLevel level, const char* file, int line)
    : enabled_(level >= MinLogLevel()), level_(level) {
  if (!enabled_) return;
  static constexpr char kLetters[] = {'D', 'I', 'W', 'E'};
  const char* base = std::strrchr(file, '/');
  stream_ << kLetters[static_cast<int>(level)] << ' ' << (base ? base + 1 : file) << ':' << line
          << "] ";
}

LogLine::~LogLine() {
  if (!enabled_) return;
  stream_ << '\n';
  const std::string s = stream_.str();
  std::fwrite(s.data(), 1, s.size(), stderr);
}

}  // namespace shardserve
