#include "common/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <vector>

namespace shardserve {
namespace {

TEST(ThreadPoolTest, CoversEveryIndexExactlyOnce) {
  for (int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    for (int64_t n : {1, 7, 16, 100, 1001}) {
      for (int64_t grain : {1, 4, 16}) {
        std::vector<std::atomic<int>> hits(n);
        pool.ParallelFor(n, grain, [&](int, int64_t b, int64_t e) {
          EXPECT_LE(b, e);
          for (int64_t i = b; i < e; ++i) hits[i]++;
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << i;
      }
    }
  }
}

TEST(ThreadPoolTest, UsesAllThreadsAndAlignsToGrain) {
  ThreadPool pool(3);
  std::vector<std::atomic<int>> by_thread(3);
  pool.ParallelFor(96, 16, [&](int t, int64_t b, int64_t e) {
    by_thread[t]++;
    EXPECT_EQ(b % 16, 0);
  });
  for (auto& c : by_thread) EXPECT_EQ(c.load(), 1);
}

}  // namespace
}  // namespace shardserve
