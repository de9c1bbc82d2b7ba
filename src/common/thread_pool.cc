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
    pending_.store(parts - 1);
    generation_.fetch_add(1);
  }
  start_cv_.SignalAll();
  auto [b, e] = Split(n, grain, parts, 0);
  if (b < e) fn(0, b, e);
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
    }
    auto [b, e] = Split(n, grain, num_threads(), index);
    if (b < e) (*job)(index, b, e);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      absl::MutexLock lock(&mu_);  // the caller is spinning, or waits under mu_
      done_cv_.Signal();
    }
  }
}

}  // namespace shardserve
