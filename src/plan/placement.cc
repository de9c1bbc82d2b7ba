#include "plan/placement.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace shardserve {

bool Tolerates(const Toleration& tol, const Taint& t) {
  if (!tol.effect.empty() && tol.effect != t.effect) return false;
  if (tol.op == "Exists") return tol.key.empty() || tol.key == t.key;
  return tol.key == t.key && tol.value == t.value;
}

int64_t GpuMemoryOf(const NodeInfo& n, const PlacementRequest& r) {
  return n.gpu_memory > 0 ? n.gpu_memory : r.gpu_memory;
}

namespace {

enum class Exclusion { kNone, kNotReady, kSelector, kTaint, kGpus, kMemory };

Exclusion Check(const NodeInfo& n, const PlacementRequest& r) {
  if (!n.ready || n.unschedulable) return Exclusion::kNotReady;
  for (const auto& [k, v] : r.node_selector) {
    auto it = n.labels.find(k);
    if (it == n.labels.end() || it->second != v) return Exclusion::kSelector;
  }
  for (const Taint& t : n.taints) {
    if (t.effect == "PreferNoSchedule") continue;
    const bool tolerated = std::any_of(r.tolerations.begin(), r.tolerations.end(),
                                       [&](const Toleration& tol) { return Tolerates(tol, t); });
    if (!tolerated) return Exclusion::kTaint;
  }
  const int64_t memory = GpuMemoryOf(n, r);
  if (r.memory_needed > 0 && memory > 0 && static_cast<double>(memory) < r.memory_needed) {
    return Exclusion::kMemory;
  }
  if (n.gpus - n.requested < r.tensor) return Exclusion::kGpus;
  return Exclusion::kNone;
}

struct Choice {
  std::vector<size_t> slots;  // node index per stage
  int64_t distinct = 0;
  int64_t leftover = 0;
};

// P stages of T GPUs on `pool` (node indices): distinct nodes first, best-fit; then extra stages
// on nodes with room for more. Empty slots when they do not fit.
Choice Choose(const std::vector<size_t>& pool, const std::vector<NodeInfo>& nodes, int64_t T,
              int64_t P) {
  std::vector<size_t> order = pool;
  auto free = [&](size_t i) { return nodes[i].gpus - nodes[i].requested; };
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::make_tuple(free(a), nodes[a].name) < std::make_tuple(free(b), nodes[b].name);
  });
  Choice c;
  std::map<size_t, int64_t> used;
  for (size_t i : order) {
    if (static_cast<int64_t>(c.slots.size()) == P) break;
    c.slots.push_back(i);
    used[i] += T;
  }
  for (size_t i : order) {
    while (static_cast<int64_t>(c.slots.size()) < P && free(i) - used[i] >= T) {
      c.slots.push_back(i);
      used[i] += T;
    }
  }
  if (static_cast<int64_t>(c.slots.size()) < P) return Choice{};
  std::sort(c.slots.begin(), c.slots.end(),
            [&](size_t a, size_t b) { return nodes[a].name < nodes[b].name; });
  c.distinct = static_cast<int64_t>(used.size());
  for (const auto& [i, u] : used) c.leftover += free(i) - u;
  return c;
}

}  // namespace

bool Eligible(const NodeInfo& n, const PlacementRequest& r) {
  const Exclusion e = Check(n, r);
  return e == Exclusion::kNone || e == Exclusion::kGpus || e == Exclusion::kMemory;
}

absl::StatusOr<PlacementResult> PlaceReplicas(const PlacementRequest& r,
                                              std::vector<NodeInfo> nodes) {
  if (r.tensor < 1 || r.pipeline < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", r.tensor, " and pipeline ", r.pipeline, " must be at least 1"));
  }
  std::sort(nodes.begin(), nodes.end(),
            [](const NodeInfo& a, const NodeInfo& b) { return a.name < b.name; });
  PlacementResult result;
  for (int64_t replica : r.replicas) {
    std::map<Exclusion, int64_t> excluded;
    int64_t largest_free = 0;
    int64_t largest_memory = 0;  // of the nodes with too little
    std::map<std::string, std::vector<size_t>> domains;
    std::vector<size_t> all;
    for (size_t i = 0; i < nodes.size(); ++i) {
      const Exclusion e = Check(nodes[i], r);
      if (e == Exclusion::kGpus)
        largest_free = std::max(largest_free, nodes[i].gpus - nodes[i].requested);
      if (e == Exclusion::kMemory)
        largest_memory = std::max(largest_memory, GpuMemoryOf(nodes[i], r));
      if (e != Exclusion::kNone) {
        ++excluded[e];
        continue;
      }
      auto it = nodes[i].labels.find(r.topology_key);
      domains[it == nodes[i].labels.end() ? "" : it->second].push_back(i);
      all.push_back(i);
    }
    // Inside one domain if any can hold the replica: most distinct nodes, then best fit.
    Choice best;
    std::string best_domain;
    for (const auto& [domain, pool] : domains) {
      if (domain.empty()) continue;  // nodes without the label share no domain
      Choice c = Choose(pool, nodes, r.tensor, r.pipeline);
      if (c.slots.empty()) continue;
      if (best.slots.empty() || std::make_tuple(-c.distinct, c.leftover) <
                                    std::make_tuple(-best.distinct, best.leftover)) {
        best = c;
        best_domain = domain;
      }
    }
    if (best.slots.empty()) {
      best = Choose(all, nodes, r.tensor, r.pipeline);
      best_domain.clear();
    }
    if (best.slots.empty()) {
      std::vector<std::string> why;
      if (excluded[Exclusion::kNotReady]) {
        why.push_back(absl::StrCat(excluded[Exclusion::kNotReady], " not ready or cordoned"));
      }
      if (excluded[Exclusion::kSelector]) {
        why.push_back(absl::StrCat(excluded[Exclusion::kSelector], " by nodeSelector"));
      }
      if (excluded[Exclusion::kTaint]) {
        why.push_back(absl::StrCat(excluded[Exclusion::kTaint], " by an untolerated taint"));
      }
      if (excluded[Exclusion::kMemory]) {
        why.push_back(absl::StrFormat("%d with too little GPU memory: %s; they have %.1f GiB",
                                      excluded[Exclusion::kMemory], r.memory_need,
                                      static_cast<double>(largest_memory) / (1 << 30)));
      }
      if (excluded[Exclusion::kGpus]) {
        why.push_back(absl::StrCat(excluded[Exclusion::kGpus], " with fewer free GPUs (at most ",
                                   largest_free, ")"));
      }
      std::string reason = absl::StrCat("replica ", replica, " needs ", r.pipeline,
                                        r.pipeline == 1 ? " node" : " nodes", " with ", r.tensor,
                                        " free ", r.gpu_resource, "; ", all.size(),
                                        all.size() == 1 ? " has" : " have", " them");
      if (!why.empty()) {
        absl::StrAppend(&reason, " (of ", nodes.size(), " nodes: ", absl::StrJoin(why, ", "), ")");
      }
      result.unplaced[replica] = reason;
      continue;
    }
    ReplicaPlacement p;
    p.replica = replica;
    p.domain = best_domain;
    for (size_t i : best.slots) {
      p.nodes.push_back(nodes[i].name);
      nodes[i].requested += r.tensor;
    }
    result.placed.push_back(std::move(p));
  }
  result.nodes_after = std::move(nodes);
  return result;
}

}  // namespace shardserve
