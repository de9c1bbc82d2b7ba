#include "common/stall_watchdog.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace shardserve {
namespace {

using std::chrono::milliseconds;

// Work that keeps reporting growth is never called stalled, however long it takes in all.
TEST(StallWatchdogTest, ProgressKeepsItQuiet) {
  std::atomic<int> stalls{0};
  {
    StallWatchdog dog(milliseconds(500), [&](double) { ++stalls; });
    for (int i = 1; i <= 15; ++i) {  // 1.5 s in all, three stall bounds
      std::this_thread::sleep_for(milliseconds(100));
      dog.Progress(i / 15.0);
    }
  }
  EXPECT_EQ(stalls.load(), 0);
}

// Reports that do not grow are no progress: the stall is called once, with the last share.
TEST(StallWatchdogTest, AStallIsCalledOnceWithTheShareReached) {
  std::atomic<int> stalls{0};
  std::atomic<double> at{-1};
  {
    StallWatchdog dog(milliseconds(200), [&](double share) {
      ++stalls;
      at = share;
    });
    dog.Progress(0.25);
    for (int i = 0; i < 8; ++i) {
      std::this_thread::sleep_for(milliseconds(100));
      dog.Progress(0.25);  // the same share again: not progress
    }
  }
  EXPECT_EQ(stalls.load(), 1);
  EXPECT_EQ(at.load(), 0.25);
}

// Work that never reports at all stalls at 0; a watchdog destroyed first never fires.
TEST(StallWatchdogTest, NoReportAtAllStallsAtZeroAndDestructionStopsIt) {
  std::atomic<double> at{-1};
  {
    StallWatchdog dog(milliseconds(100), [&](double share) { at = share; });
    std::this_thread::sleep_for(milliseconds(400));
  }
  EXPECT_EQ(at.load(), 0.0);
  std::atomic<int> stalls{0};
  {
    StallWatchdog dog(milliseconds(60000), [&](double) { ++stalls; });
  }
  EXPECT_EQ(stalls.load(), 0);
}

}  // namespace
}  // namespace shardserve
