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
    for (int i = 1; i <= 150; ++i) {  // 1.5 s in all, three stall bounds
      std::this_thread::sleep_for(milliseconds(10));
      dog.Progress(i / 150.0);
    }
  }
  EXPECT_EQ(stalls.load(), 0);
}

// Waits (up to 10 s, for a loaded machine) until `done` holds.
template <typename F>
bool Eventually(F done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  return done();
}

// Reports that do not grow are no progress: the stall is called once, with the last share.
TEST(StallWatchdogTest, AStallIsCalledOnceWithTheShareReached) {
  std::atomic<int> stalls{0};
  std::atomic<double> at{-1};
  StallWatchdog dog(milliseconds(200), [&](double share) {
    at = share;
    ++stalls;
  });
  dog.Progress(0.25);
  ASSERT_TRUE(Eventually([&] {
    dog.Progress(0.25);  // the same share again: not progress
    return stalls.load() > 0;
  }));
  EXPECT_EQ(at.load(), 0.25);
  std::this_thread::sleep_for(milliseconds(500));  // more bounds pass: no second call
  EXPECT_EQ(stalls.load(), 1);
}

// Work that never reports at all stalls at 0; a watchdog destroyed first never fires.
TEST(StallWatchdogTest, NoReportAtAllStallsAtZeroAndDestructionStopsIt) {
  std::atomic<double> at{-1};
  StallWatchdog dog(milliseconds(100), [&](double share) { at = share; });
  ASSERT_TRUE(Eventually([&] { return at.load() >= 0; }));
  EXPECT_EQ(at.load(), 0.0);
  std::atomic<int> stalls{0};
  {
    StallWatchdog quiet(milliseconds(60000), [&](double) { ++stalls; });
  }
  EXPECT_EQ(stalls.load(), 0);
}

}  // namespace
}  // namespace shardserve
