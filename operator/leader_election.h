#pragma once
// Leader election on a coordination.k8s.io/v1 Lease, as client-go's: a candidate takes the lease
// when it is free or its holder has not renewed it for leaseDuration (timed on this process's
// clock from when the record last changed, so clocks need not agree), then renews it every
// retryPeriod; if it cannot renew within renewDeadline it has lost the lease and must stop
// acting. Release() hands the lease back at once (a clean shutdown) so a standby takes over
// without waiting out the duration. Thread-safe.
#include <atomic>
#include <chrono>
#include <functional>
#include <string>

#include "k8s/client.h"

namespace shardserve::op {

struct LeaderElectionOptions {
  std::string namespace_ = "default";
  std::string name = "shardserve-operator";
  std::string identity;  // unique per process (hostname + pid)
  std::chrono::milliseconds lease_duration{15000};
  std::chrono::milliseconds renew_deadline{10000};
  std::chrono::milliseconds retry_period{2000};
};

class LeaderElector {
 public:
  LeaderElector(k8s::Client* client, LeaderElectionOptions options);

  // Blocks until this process holds the lease (true) or `stop` is set (false).
  bool Acquire(const std::atomic<bool>& stop);
  // Renews until the lease is lost (returns false) or `stop` is set (returns true).
  bool Hold(const std::atomic<bool>& stop);
  // Gives the lease up if held.
  void Release();

  bool leading() const { return leading_.load(); }

 private:
  // One attempt; true when this process holds the lease afterwards.
  bool TryAcquireOrRenew();

  k8s::Client* client_;
  LeaderElectionOptions options_;
  std::atomic<bool> leading_{false};
  std::string observed_record_;  // holder + renewTime last seen
  std::chrono::steady_clock::time_point observed_at_;
};

}  // namespace shardserve::op
