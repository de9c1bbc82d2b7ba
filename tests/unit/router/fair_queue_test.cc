// The router queue's order (router/fair_queue.h): priority first, then weighted fair between
// tenants, FIFO within one; an idle tenant earns no credit; a request that gives up leaves.
#include "router/fair_queue.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

namespace shardserve {
namespace {

std::vector<uint64_t> Drain(FairQueue& q) {
  std::vector<uint64_t> out;
  while (auto e = q.Pop()) out.push_back(e->id);
  return out;
}

TEST(FairQueue, PriorityFirstThenFifoWithinATenant) {
  FairQueue q;
  q.Push({1, 5, "a", 1});
  q.Push({2, 0, "a", 1});
  q.Push({3, -1, "b", 1});
  q.Push({4, 0, "a", 1});
  EXPECT_EQ(q.size(), 4u);
  EXPECT_EQ(Drain(q), (std::vector<uint64_t>{3, 2, 4, 1}));
  EXPECT_TRUE(q.empty());
  EXPECT_FALSE(q.Pop());
}

TEST(FairQueue, AFloodingTenantDoesNotDelayAnotherByItsBacklog) {
  FairQueue q;
  uint64_t id = 0;
  for (int i = 0; i < 100; ++i) q.Push({++id, 0, "flood", 1});
  q.Push({1000, 0, "quiet", 1});  // arrives after 100 of the flood's
  std::vector<uint64_t> order = Drain(q);
  const size_t at = std::find(order.begin(), order.end(), 1000u) - order.begin();
  EXPECT_LE(at, 1u) << "the quiet tenant's request waits behind at most one of the flood's";
}

TEST(FairQueue, WeightsShareABacklogInProportion) {
  FairQueue q;
  uint64_t id = 0;
  std::map<uint64_t, std::string> of;
  for (int i = 0; i < 60; ++i) {
    for (const auto& [t, w] : {std::pair{"heavy", 2.0}, std::pair{"light", 1.0}}) {
      q.Push({++id, 0, t, w});
      of[id] = t;
    }
  }
  std::map<std::string, int> first30;
  for (int i = 0; i < 30; ++i) ++first30[of[q.Pop()->id]];
  EXPECT_EQ(first30["heavy"], 20);
  EXPECT_EQ(first30["light"], 10);
}

TEST(FairQueue, AnIdleTenantEarnsNoCredit) {
  FairQueue q;
  uint64_t id = 0;
  for (int i = 0; i < 10; ++i) q.Push({++id, 0, "busy", 1});
  for (int i = 0; i < 8; ++i) q.Pop();  // busy alone for a while
  // "late" joins now: it alternates with busy instead of taking the next 8 slots.
  for (int i = 0; i < 4; ++i) q.Push({100 + static_cast<uint64_t>(i), 0, "late", 1});
  for (int i = 0; i < 4; ++i) q.Push({++id, 0, "busy", 1});
  std::vector<uint64_t> order = Drain(q);
  int late_in_first4 = 0;
  for (int i = 0; i < 4; ++i) late_in_first4 += order[i] >= 100 && order[i] < 104;
  EXPECT_EQ(late_in_first4, 2);
}

TEST(FairQueue, ARequestThatGivesUpLeaves) {
  FairQueue q;
  q.Push({1, 0, "a", 1});
  q.Push({2, 3, "b", 1});
  EXPECT_TRUE(q.Remove(2));
  EXPECT_FALSE(q.Remove(2));
  EXPECT_EQ(q.size(), 1u);
  EXPECT_EQ(Drain(q), (std::vector<uint64_t>{1}));
}

}  // namespace
}  // namespace shardserve
