// The router's choice (router/choice.h): the replica that caches the longest prefix wins until
// its batch fills, then a hot prefix spreads; reasons name why; equal replicas take turns.
#include "router/choice.h"

#include <gtest/gtest.h>

#include <set>

namespace shardserve {
namespace {

Candidate Live(int64_t matched, int64_t running = 0, int64_t max_batch = 8) {
  Candidate c;
  c.routable = true;
  c.matched_blocks = matched;
  c.running = running;
  c.max_batch = max_batch;
  return c;
}

TEST(ChoiceTest, TheLongestCachedPrefixWinsUntilItsReplicaIsLoaded) {
  const ChoiceWeights w;
  Ranking r = RankReplicas({Live(0), Live(60), Live(20)}, 64, w, 0);
  EXPECT_EQ(r.order, (std::vector<int>{1, 2, 0}));
  EXPECT_EQ(r.reason, ChoiceReason::kPrefix);
  EXPECT_NEAR(r.expected_hit, 60.0 / 64, 1e-9);
  // Half its batch busy: still worth it (2 * 0.94 - 2 * 0.5 > 0).
  r = RankReplicas({Live(0), Live(60, 4)}, 64, w, 0);
  EXPECT_EQ(r.order[0], 1);
  // Its batch full and requests waiting: the prefix spreads to an idle replica.
  Candidate loaded = Live(60, 8);
  loaded.waiting = 3;
  r = RankReplicas({Live(0), loaded}, 64, w, 0);
  EXPECT_EQ(r.order[0], 0);
  EXPECT_EQ(r.reason, ChoiceReason::kLoad);
  EXPECT_EQ(r.expected_hit, 0);
  // The router's own requests in flight count when the leader's report lags.
  Candidate busy = Live(60);
  busy.in_flight = 12;
  EXPECT_EQ(RankReplicas({Live(0), busy}, 64, w, 0).order[0], 0);
  // A full KV cache weighs too.
  Candidate full = Live(10);
  full.kv_usage = 1.0;
  EXPECT_EQ(RankReplicas({Live(0), full}, 64, w, 0).order[0], 0);
}

TEST(ChoiceTest, ReasonsAndTurns) {
  const ChoiceWeights w;
  EXPECT_EQ(RankReplicas({Live(0), Live(0)}, 10, w, 0).reason, ChoiceReason::kNoPrefix);
  EXPECT_EQ(RankReplicas({Live(0), Live(0)}, -1, w, 0).reason, ChoiceReason::kNoPrompt);
  Candidate dead;
  EXPECT_EQ(RankReplicas({dead, dead}, 10, w, 0).reason, ChoiceReason::kNoState);
  // Equal replicas take requests in turn; one whose stream is not live comes last.
  std::set<int> firsts;
  for (uint64_t t = 0; t < 6; ++t)
    firsts.insert(RankReplicas({Live(0), Live(0), dead}, 4, w, t).order[0]);
  EXPECT_EQ(firsts, (std::set<int>{0, 1}));
  EXPECT_EQ(RankReplicas({dead, Live(0)}, 4, w, 0).order, (std::vector<int>{1, 0}));
  // Equal scores: fewer requests in flight first.
  Candidate a = Live(0), b = Live(0);
  a.in_flight = 1;
  b.in_flight = 0;
  a.max_batch = b.max_batch = 1000;
  EXPECT_EQ(RankReplicas({a, b}, 4, ChoiceWeights{2, 0, 0}, 0).order[0], 1);
  EXPECT_STREQ(ChoiceReasonName(ChoiceReason::kLoad), "load");
}

TEST(ChoiceTest, ARequestOfAnAdapterGoesWhereItIsLoadedUnlessLoadSaysOtherwise) {
  const ChoiceWeights w;
  Candidate loaded = Live(0), room = Live(0), full = Live(0);
  loaded.adapter_loaded = true;
  room.adapter_room = true;
  // Loaded beats a free slot, which beats a replica that must evict one; whatever the turn.
  for (uint64_t t = 0; t < 3; ++t) {
    Ranking r = RankReplicas({full, room, loaded}, 8, w, t);
    EXPECT_EQ(r.order, (std::vector<int>{2, 1, 0}));
    EXPECT_EQ(r.reason, ChoiceReason::kAdapter);
  }
  // A prefix cached elsewhere names its reason (blocks salted by adapter were made under it).
  EXPECT_EQ(RankReplicas({loaded, Live(6)}, 8, w, 0).reason, ChoiceReason::kPrefix);
  // Its replica loaded past its batch: the request goes to one with a free slot.
  Candidate busy = loaded;
  busy.running = 8;
  busy.waiting = 8;
  EXPECT_EQ(RankReplicas({busy, room}, 8, w, 0).order[0], 1);
  EXPECT_STREQ(ChoiceReasonName(ChoiceReason::kAdapter), "adapter");
}

}  // namespace
}  // namespace shardserve
