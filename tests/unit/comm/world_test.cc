#include "comm/world.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>

namespace shardserve {
namespace {

// Every rank of several shapes: its coordinates, its TP group and its pipeline neighbours.
TEST(WorldConfigTest, EnumeratesEveryRankAndGroup) {
  for (auto [tp, pp] : {std::pair{1, 1}, {2, 1}, {1, 3}, {2, 2}, {4, 3}, {8, 2}}) {
    std::set<int> seen_in_groups;
    for (int rank = 0; rank < tp * pp; ++rank) {
      auto w = WorldConfig::Create(tp, pp, rank);
      ASSERT_TRUE(w.ok()) << w.status();
      EXPECT_EQ(w->world_size(), tp * pp);
      EXPECT_EQ(w->RankOf(w->stage(), w->tp_rank()), rank);
      EXPECT_EQ(w->is_leader(), rank == 0);
      const std::vector<int> group = w->TpGroup();
      ASSERT_EQ(static_cast<int>(group.size()), tp);
      for (int t = 0; t < tp; ++t) EXPECT_EQ(group[t], w->stage() * tp + t);
      if (w->tp_rank() == 0) seen_in_groups.insert(group.begin(), group.end());
      if (w->is_first_stage()) {
        EXPECT_FALSE(w->PrevStageRank().has_value());
      } else {
        EXPECT_EQ(*w->PrevStageRank(), rank - tp);
      }
      if (w->is_last_stage()) {
        EXPECT_FALSE(w->NextStageRank().has_value());
      } else {
        auto next = WorldConfig::Create(tp, pp, *w->NextStageRank());
        EXPECT_EQ(next->tp_rank(), w->tp_rank());
        EXPECT_EQ(*next->PrevStageRank(), rank);
      }
    }
    EXPECT_EQ(static_cast<int>(seen_in_groups.size()), tp * pp) << "groups partition the world";
  }
}

TEST(WorldConfigTest, RefusesBadShapesWithTheNumbers) {
  EXPECT_THAT(std::string(WorldConfig::Create(0, 1, 0).status().message()),
              ::testing::HasSubstr("tensor parallelism 0 < 1"));
  EXPECT_THAT(std::string(WorldConfig::Create(2, 0, 0).status().message()),
              ::testing::HasSubstr("pipeline parallelism 0 < 1"));
  EXPECT_THAT(std::string(WorldConfig::Create(2, 2, 4).status().message()),
              ::testing::HasSubstr("rank 4 is outside the world of 2 x 2 = 4"));
  EXPECT_EQ(WorldConfig::Create(4, 2, 5)->Describe(5), "rank 5 (stage 1, tp 1)");
}

}  // namespace
}  // namespace shardserve
