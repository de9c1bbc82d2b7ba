#include "common/stall_watchdog.h"

#include <algorithm>
#include <utility>

namespace shardserve {

StallWatchdog::StallWatchdog(std::chrono::milliseconds stall,
                             std::function<void(double share)> on_stall)
    : stall_(absl::FromChrono(stall)), on_stall_(std::move(on_stall)) {
  {
    absl::MutexLock lock(&mu_);
    last_ = absl::Now();
  }
  thread_ = std::thread([this] { Run(); });
}

StallWatchdog::~StallWatchdog() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void StallWatchdog::Progress(double share) {
  absl::MutexLock lock(&mu_);
  if (share <= share_) return;
  share_ = share;
  last_ = absl::Now();
}

void StallWatchdog::Run() {
  double share = 0;
  {
    absl::MutexLock lock(&mu_);
    while (true) {
      if (stop_) return;
      const absl::Time deadline = last_ + stall_;
      if (absl::Now() >= deadline) {
        share = std::max(share_, 0.0);
        break;
      }
      mu_.AwaitWithDeadline(absl::Condition(&stop_), deadline);
    }
  }
  on_stall_(share);
}

}  // namespace shardserve
