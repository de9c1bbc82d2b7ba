#include "common/log.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <ctime>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace shardserve {
namespace {

ABSL_CONST_INIT absl::Mutex identity_mu(absl::kConstInit);
std::string& Identity() ABSL_EXCLUSIVE_LOCKS_REQUIRED(identity_mu) {
  static std::string* identity = new std::string;
  return *identity;
}

LogLevel MinLevel() {
  static const LogLevel level = [] {
    const char* v = std::getenv("SHARDSERVE_LOG_LEVEL");
    const std::string s = v ? v : "";
    if (s == "debug") return LogLevel::kDebug;
    if (s == "warning") return LogLevel::kWarning;
    if (s == "error") return LogLevel::kError;
    return LogLevel::kInfo;
  }();
  return level;
}

}  // namespace

void SetLogIdentity(const std::string& identity) {
  absl::MutexLock lock(&identity_mu);
  Identity() = identity;
}

void LogLine(LogLevel level, const std::string& message) {
  if (level < MinLevel()) return;
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const long micros = static_cast<long>(
      std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() %
      1000000);
  std::tm tm;
  gmtime_r(&t, &tm);
  char head[64];
  std::snprintf(head, sizeof(head), "%c%02d%02d %02d:%02d:%02d.%06ld ",
                "DIWE"[static_cast<int>(level)], tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                tm.tm_sec, micros);
  std::string line = head;
  {
    absl::MutexLock lock(&identity_mu);
    line += Identity().empty() ? std::string("shardserve") : Identity();
  }
  line += "] ";
  line += message;
  line += '\n';
  // One write per line: lines of threads and processes sharing the stream do not interleave.
  size_t off = 0;
  while (off < line.size()) {
    const ssize_t n = write(STDERR_FILENO, line.data() + off, line.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

}  // namespace shardserve
