#include "common/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
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

TEST(ThreadPoolTest, ChunksCoverEveryIndexOnceInChunksOfTheGrain) {
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    for (int64_t n : {1, 7, 16, 100, 1001}) {
      for (int64_t grain : {1, 4, 16}) {
        std::vector<std::atomic<int>> hits(n);
        pool.ParallelChunks(n, grain, [&](int t, int64_t b, int64_t e) {
          EXPECT_GE(t, 0);
          EXPECT_LT(t, threads);
          EXPECT_EQ(b % grain, 0);
          if (threads > 1 && n > grain) EXPECT_EQ(e, std::min(n, b + grain)) << b;
          for (int64_t i = b; i < e; ++i) hits[i]++;
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << i;
      }
    }
  }
}

// A thread held up in its first chunk (a slow core) does no other: the rest take every other
// chunk. With ranges fixed per thread, the held thread's other chunks would wait for it, and the
// wait below would run out.
TEST(ThreadPoolTest, ChunksGoToTheThreadsThatAreFree) {
  ThreadPool pool(3);
  constexpr int64_t kChunks = 60;
  std::atomic<int64_t> done{0};
  std::vector<std::atomic<int>> by_thread(3);
  std::atomic<int> held{-1};
  pool.ParallelChunks(kChunks, 1, [&](int t, int64_t b, int64_t e) {
    ASSERT_EQ(e, b + 1);
    by_thread[t]++;
    if (b == 0) {
      held = t;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (done.load() < kChunks - 1 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    done++;
  });
  ASSERT_EQ(done.load(), kChunks);
  ASSERT_GE(held.load(), 0);
  EXPECT_EQ(by_thread[held.load()].load(), 1);
}

}  // namespace
}  // namespace shardserve
