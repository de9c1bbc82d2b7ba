#include "common/thread_pool.h"

#include <algorithm>
#include <chrono>

#include "common/cpu_relax.h"

namespace shardserve {
namespace {

// The range of chunk `index` of `parts` over [0, n), aligned to grain.
std::pair<int64_t, int64_t> Split(int64_t n, int64_t grain, int parts, int index) {
  const int64_t units = (n + grain - 1) / grain;
  const int64_t per = units / parts, extra = units % parts;
  const int64_t ub = index * per + std::min<int64_t>(index, extra);
  const int64_t ue = ub + per + (index < extra ? 1 : 0);
  return {std::min(n, ub * grain), std::min(n, ue * grain)};
}

// How long a thread spins for the next loop (a worker) or for the last chunk (the caller) before
// it sleeps.
constexpr std::chrono::microseconds kSpin{100};

}  // namespace

template <typename Pred>
bool ThreadPool::SpinUntil(Pred pred) {
  const auto deadline = std::chrono::steady_clock::now() + kSpin;
  for (int i = 1;; ++i) {
    if (pred()) return true;
    CpuRelax();
    if (i % 64 == 0 && std::chrono::steady_clock::now() > deadline) return pred();
  }
}

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < std::max(1, num_threads); ++i) {
    workers_.emplace_back([this, i] { WorkerLoop(i); });
  }
}

ThreadPool& ThreadPool::EveryCore() {
  static ThreadPool pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  return pool;
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_.store(true);
  }
  start_cv_.SignalAll();
  for (auto& t : workers_) t.join();
}

void ThreadPool::ParallelFor(int64_t n, int64_t grain,
                             const std::function<void(int, int64_t, int64_t)>& fn) {
  Run(n, grain, false, fn);
}

void ThreadPool::ParallelChunks(int64_t n, int64_t grain,
                                const std::function<void(int, int64_t, int64_t)>& fn) {
  Run(n, grain, true, fn);
}

void ThreadPool::Work(int index, const std::function<void(int, int64_t, int64_t)>& fn, int64_t n,
                      int64_t grain, bool chunks) {
  if (!chunks) {
    auto [b, e] = Split(n, grain, num_threads(), index);
    if (b < e) fn(index, b, e);
    return;
  }
  for (;;) {
    const int64_t c = next_chunk_.fetch_add(1, std::memory_order_relaxed);
    if (c >= (n + grain - 1) / grain) return;
    fn(index, c * grain, std::min(n, (c + 1) * grain));
  }
}

void ThreadPool::Run(int64_t n, int64_t grain, bool chunks,
                     const std::function<void(int, int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int parts = num_threads();
  if (parts == 1 || n <= grain) {
    fn(0, 0, n);
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    job_ = &fn;
    job_n_ = n;
    job_grain_ = grain;
    job_chunks_ = chunks;
    next_chunk_.store(0, std::memory_order_relaxed);
    pending_.store(parts - 1);
    generation_.fetch_add(1);
  }
  start_cv_.SignalAll();
  Work(0, fn, n, grain, chunks);
  if (!SpinUntil([this] { return pending_.load(std::memory_order_acquire) == 0; })) {
    absl::MutexLock lock(&mu_);
    while (pending_.load() != 0) done_cv_.Wait(&mu_);
  }
  absl::MutexLock lock(&mu_);
  job_ = nullptr;
}

void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int, int64_t, int64_t)>* job;
    int64_t n, grain;
    bool chunks;
    SpinUntil([&] {
      return stop_.load(std::memory_order_acquire) ||
             generation_.load(std::memory_order_acquire) != seen;
    });
    {
      absl::MutexLock lock(&mu_);
      while (!stop_.load() && generation_.load() == seen) start_cv_.Wait(&mu_);
      if (stop_) return;
      seen = generation_.load();
      job = job_;
      n = job_n_;
      grain = job_grain_;
      chunks = job_chunks_;
    }
    Work(index, *job, n, grain, chunks);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      absl::MutexLock lock(&mu_);  // the caller is spinning, or waits under mu_
      done_cv_.Signal();
    }
  }
}

}  // namespace shardserve
