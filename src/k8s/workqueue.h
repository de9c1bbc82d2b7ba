#pragma once
// The controller's work queue (as client-go's): keys, not events. A key added while it waits is
// not added twice; a key added while it is being processed is processed once more afterwards,
// never by two workers at once. Failed keys come back with per-key exponential backoff, bounded
// by an overall token bucket. Thread-safe.
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace shardserve::k8s {

struct RateLimit {
  std::chrono::milliseconds base{5};       // first retry of a key
  std::chrono::milliseconds max{1000000};  // cap of a key's backoff
  double qps = 10;                         // overall retries per second, with
  int burst = 100;                         // this burst
};

class WorkQueue {
 public:
  explicit WorkQueue(RateLimit limit = {});
  ~WorkQueue();

  void Add(const std::string& key);
  void AddAfter(const std::string& key, std::chrono::milliseconds delay);
  // After a failure: the key's backoff (base * 2^failures, capped) or the overall limit,
  // whichever is later.
  void AddRateLimited(const std::string& key);
  // The key succeeded: its backoff starts over.
  void Forget(const std::string& key);
  int Requeues(const std::string& key) const;

  // The next key to process (blocks); nullopt once shut down and empty.
  std::optional<std::string> Get();
  // Processing of `key` ended; if it was added meanwhile it is queued again.
  void Done(const std::string& key);
  void ShutDown();

  size_t Len() const;
  int64_t adds() const;  // Add calls, including duplicates that were collapsed

 private:
  void AddLocked(const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const RateLimit limit_;
  mutable absl::Mutex mu_;
  absl::CondVar cv_;
  std::deque<std::string> queue_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> dirty_ ABSL_GUARDED_BY(mu_), processing_ ABSL_GUARDED_BY(mu_);
  std::multimap<std::chrono::steady_clock::time_point, std::string> delayed_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> failures_ ABSL_GUARDED_BY(mu_);
  double bucket_tokens_ ABSL_GUARDED_BY(mu_);
  std::chrono::steady_clock::time_point bucket_time_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  int64_t adds_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardserve::k8s
