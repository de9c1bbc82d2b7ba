#pragma once
// A fixed pool of worker threads for data-parallel loops. ParallelFor blocks until every chunk is
// done; the calling thread works too. One ParallelFor at a time per pool (callers serialize).
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace shardserve {

class ThreadPool {
 public:
  // num_threads counts the caller: 1 means no extra threads.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(thread_index, begin, end) on disjoint ranges covering [0, n), split into
  // num_threads() contiguous ranges aligned to `grain`.
  void ParallelFor(int64_t n, int64_t grain, const std::function<void(int, int64_t, int64_t)>& fn);

 private:
  void WorkerLoop(int index);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  const std::function<void(int, int64_t, int64_t)>* job_ = nullptr;  // guarded by mu_
  int64_t job_n_ = 0;
  int64_t job_grain_ = 1;
  uint64_t generation_ = 0;  // guarded by mu_
  int pending_ = 0;          // guarded by mu_
  bool stop_ = false;        // guarded by mu_
};

}  // namespace shardserve
