#include "router/fair_queue.h"

#include <algorithm>

namespace shardserve {

void FairQueue::Push(Entry e) {
  Band& band = bands_[e.priority];
  auto [it, fresh] = band.tenants.try_emplace(e.tenant);
  if (fresh) it->second.vtime = band.vtime;  // no credit for the time it was idle
  if (e.weight <= 0) e.weight = 1;
  it->second.queue.push_back(std::move(e));
  ++size_;
}

std::optional<FairQueue::Entry> FairQueue::Pop() {
  if (bands_.empty()) return std::nullopt;
  auto band_it = bands_.begin();
  Band& band = band_it->second;
  // The tenant with the least virtual time; between equals, the oldest request (lowest id).
  auto best = band.tenants.begin();
  for (auto it = band.tenants.begin(); it != band.tenants.end(); ++it) {
    const Tenant& t = it->second;
    const Tenant& b = best->second;
    if (t.vtime < b.vtime || (t.vtime == b.vtime && t.queue.front().id < b.queue.front().id)) {
      best = it;
    }
  }
  Tenant& t = best->second;
  Entry out = std::move(t.queue.front());
  t.queue.pop_front();
  band.vtime = std::max(band.vtime, t.vtime);
  t.vtime += 1.0 / out.weight;
  if (t.queue.empty()) band.tenants.erase(best);
  if (band.tenants.empty()) bands_.erase(band_it);
  --size_;
  return out;
}

bool FairQueue::Remove(uint64_t id) {
  for (auto band_it = bands_.begin(); band_it != bands_.end(); ++band_it) {
    for (auto it = band_it->second.tenants.begin(); it != band_it->second.tenants.end(); ++it) {
      auto& q = it->second.queue;
      auto e = std::find_if(q.begin(), q.end(), [id](const Entry& x) { return x.id == id; });
      if (e == q.end()) continue;
      q.erase(e);
      if (q.empty()) band_it->second.tenants.erase(it);
      if (band_it->second.tenants.empty()) bands_.erase(band_it);
      --size_;
      return true;
    }
  }
  return false;
}

}  // namespace shardserve
