#pragma once
// A watchdog over work that reports its progress: when `stall` passes without a new report,
// `on_stall` runs once, on the watchdog's own thread, with the last share reported (the work
// itself may be blocked where it cannot be interrupted, e.g. reading a file that never arrives).
// Stops when destroyed. Thread-safe.
#include <chrono>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace shardserve {

class StallWatchdog {
 public:
  StallWatchdog(std::chrono::milliseconds stall, std::function<void(double share)> on_stall);
  ~StallWatchdog();
  StallWatchdog(const StallWatchdog&) = delete;
  StallWatchdog& operator=(const StallWatchdog&) = delete;

  // Progress: `share` (in [0, 1]) is reported; a share that does not grow is no progress.
  void Progress(double share);

 private:
  void Run();

  const absl::Duration stall_;
  const std::function<void(double)> on_stall_;
  absl::Mutex mu_;
  double share_ ABSL_GUARDED_BY(mu_) = -1;
  absl::Time last_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace shardserve
