#pragma once
// A fixed pool of worker threads for data-parallel loops. ParallelFor blocks until every chunk is
// done; the calling thread works too. One ParallelFor at a time per pool (callers serialize).
// Between loops the workers, and the caller waiting for them, spin for a bounded while (kSpin)
// before they sleep on a condition variable: a decode step runs hundreds of loops a few tens of
// microseconds apart, and a wake-up through the kernel costs about as much as a small loop.
#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

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

  // Calls fn(thread_index, begin, end) on the chunks [c * grain, (c + 1) * grain) of [0, n), each
  // once, taken in order by whichever thread is free: a thread that runs slower (a hybrid CPU's
  // efficiency core, a virtual CPU whose host runs something else, a core taken by another
  // process) does fewer chunks instead of holding up the rest (a pool of one thread, or n <= grain:
  // one call on [0, n)). For loops whose chunks' results do not depend on the thread that
  // computes them.
  void ParallelChunks(int64_t n, int64_t grain,
                      const std::function<void(int, int64_t, int64_t)>& fn);

  // A pool of a thread per core, made on first use, for the tools' one-caller loops (generating
  // and converting models); the serving path sizes its own pools.
  static ThreadPool& EveryCore();

 private:
  void WorkerLoop(int index);
  void Run(int64_t n, int64_t grain, bool chunks,
           const std::function<void(int, int64_t, int64_t)>& fn);
  // The part of the current job that thread `index` runs.
  void Work(int index, const std::function<void(int, int64_t, int64_t)>& fn, int64_t n,
            int64_t grain, bool chunks);
  // Spins until pred() holds or the spin budget is spent; returns pred().
  template <typename Pred>
  static bool SpinUntil(Pred pred);

  std::vector<std::thread> workers_;
  absl::Mutex mu_;
  absl::CondVar start_cv_;
  absl::CondVar done_cv_;
  const std::function<void(int, int64_t, int64_t)>* job_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t job_n_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t job_grain_ ABSL_GUARDED_BY(mu_) = 1;
  bool job_chunks_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<int64_t> next_chunk_{0};  // ParallelChunks: the next chunk not yet taken
  // Written under mu_ (so that a sleeper cannot miss a change), read without it while spinning.
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace shardserve
