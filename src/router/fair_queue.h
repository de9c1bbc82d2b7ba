#pragma once
// The order in which the router lets held requests out (router/router.h's queue): by priority
// first (lower first, vLLM's), then weighted fair between tenants (the API key is the tenant):
// start-time fair queuing, each tenant's virtual time advancing by 1/weight per request let out,
// the next request the oldest of the tenant with the least virtual time. A tenant that had
// nothing queued starts at the band's current virtual time, so idling earns no credit, and a
// tenant with twice the weight gets twice the requests out of a shared backlog. FIFO within a
// tenant. Pure and not thread-safe (the router holds its lock).
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>

namespace shardserve {

class FairQueue {
 public:
  struct Entry {
    uint64_t id = 0;
    int64_t priority = 0;
    std::string tenant;
    double weight = 1.0;  // > 0
  };
  void Push(Entry e);
  // The next entry to let out, taken from the queue; nullopt when empty.
  std::optional<Entry> Pop();
  // Takes out the entry `id` (its request gave up); false when not queued.
  bool Remove(uint64_t id);
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

 private:
  struct Tenant {
    std::deque<Entry> queue;
    double vtime = 0;
  };
  struct Band {
    std::map<std::string, Tenant> tenants;  // those with entries queued
    double vtime = 0;                       // the start time of the last entry let out
  };
  std::map<int64_t, Band> bands_;  // by priority, only those with entries
  size_t size_ = 0;
};

}  // namespace shardserve
