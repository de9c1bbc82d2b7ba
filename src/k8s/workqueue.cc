#include "k8s/workqueue.h"

#include <algorithm>
#include <cmath>

namespace shardserve::k8s {

using Clock = std::chrono::steady_clock;

WorkQueue::WorkQueue(RateLimit limit)
    : limit_(limit), bucket_tokens_(limit.burst), bucket_time_(Clock::now()) {}

WorkQueue::~WorkQueue() { ShutDown(); }

void WorkQueue::AddLocked(const std::string& key) {
  ++adds_;
  if (shutdown_ || dirty_.count(key)) return;
  dirty_.insert(key);
  if (processing_.count(key)) return;  // Done queues it again
  queue_.push_back(key);
  cv_.Signal();
}

void WorkQueue::Add(const std::string& key) {
  absl::MutexLock lock(&mu_);
  AddLocked(key);
}

void WorkQueue::AddAfter(const std::string& key, std::chrono::milliseconds delay) {
  absl::MutexLock lock(&mu_);
  if (delay.count() <= 0) {
    AddLocked(key);
    return;
  }
  delayed_.emplace(Clock::now() + delay, key);
  cv_.SignalAll();
}

void WorkQueue::AddRateLimited(const std::string& key) {
  std::chrono::milliseconds delay;
  {
    absl::MutexLock lock(&mu_);
    const int n = failures_[key]++;
    const double per_key =
        std::min<double>(static_cast<double>(limit_.max.count()),
                         static_cast<double>(limit_.base.count()) * std::pow(2.0, std::min(n, 40)));
    // The overall bucket: reserve a token, waiting for it if the bucket is empty.
    const auto now = Clock::now();
    bucket_tokens_ = std::min<double>(
        limit_.burst,
        bucket_tokens_ + limit_.qps * std::chrono::duration<double>(now - bucket_time_).count());
    bucket_time_ = now;
    bucket_tokens_ -= 1;
    const double overall = bucket_tokens_ >= 0 ? 0 : -bucket_tokens_ / limit_.qps * 1000;
    delay = std::chrono::milliseconds(static_cast<int64_t>(std::max(per_key, overall)));
  }
  AddAfter(key, delay);
}

void WorkQueue::Forget(const std::string& key) {
  absl::MutexLock lock(&mu_);
  failures_.erase(key);
}

int WorkQueue::Requeues(const std::string& key) const {
  absl::MutexLock lock(&mu_);
  auto it = failures_.find(key);
  return it == failures_.end() ? 0 : it->second;
}

std::optional<std::string> WorkQueue::Get() {
  absl::MutexLock lock(&mu_);
  for (;;) {
    const auto now = Clock::now();
    while (!delayed_.empty() && delayed_.begin()->first <= now) {
      const std::string key = delayed_.begin()->second;
      delayed_.erase(delayed_.begin());
      AddLocked(key);
    }
    if (!queue_.empty()) {
      std::string key = std::move(queue_.front());
      queue_.pop_front();
      processing_.insert(key);
      dirty_.erase(key);
      return key;
    }
    if (shutdown_) return std::nullopt;
    if (delayed_.empty()) {
      cv_.Wait(&mu_);
    } else {
      cv_.WaitWithTimeout(&mu_, absl::FromChrono(delayed_.begin()->first - now));
    }
  }
}

void WorkQueue::Done(const std::string& key) {
  absl::MutexLock lock(&mu_);
  processing_.erase(key);
  if (dirty_.count(key)) {
    queue_.push_back(key);
    cv_.Signal();
  }
}

void WorkQueue::ShutDown() {
  absl::MutexLock lock(&mu_);
  shutdown_ = true;
  cv_.SignalAll();
}

size_t WorkQueue::Len() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

int64_t WorkQueue::adds() const {
  absl::MutexLock lock(&mu_);
  return adds_;
}

}  // namespace shardserve::k8s
