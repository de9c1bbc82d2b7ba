#include "plan/layer_split.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace shardserve {
namespace {

std::vector<int64_t> Sizes(const std::vector<LayerRange>& r) {
  std::vector<int64_t> out;
  for (size_t i = 0; i < r.size(); ++i) {
    if (i > 0) {
      EXPECT_EQ(r[i].begin, r[i - 1].end) << "ranges are contiguous";
    }
    out.push_back(r[i].end - r[i].begin);
  }
  return out;
}

TEST(LayerSplitTest, EvenWithoutEndCosts) {
  EXPECT_EQ(Sizes(*SplitLayers(8, 2, {})), (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(Sizes(*SplitLayers(7, 3, {})), (std::vector<int64_t>{2, 2, 3}));
  EXPECT_EQ(Sizes(*SplitLayers(5, 1, {})), (std::vector<int64_t>{5}));
  EXPECT_EQ(Sizes(*SplitLayers(3, 3, {})), (std::vector<int64_t>{1, 1, 1}));
}

TEST(LayerSplitTest, EndCostsMoveLayersAway) {
  // TinyLlama shape: a layer is ~44M weights, the LM head 65.5M (1.5 layers), embedding ~0.
  EXPECT_EQ(Sizes(*SplitLayers(22, 2, {44.0, 0.0, 65.5})), (std::vector<int64_t>{12, 10}));
  // An expensive first stage gets fewer layers.
  EXPECT_EQ(Sizes(*SplitLayers(10, 2, {1.0, 4.0, 0.0})), (std::vector<int64_t>{3, 7}));
  // Every stage keeps at least one layer, even when its end cost dominates.
  EXPECT_EQ(Sizes(*SplitLayers(3, 3, {1.0, 0.0, 100.0})), (std::vector<int64_t>{1, 1, 1}));
}

TEST(LayerSplitTest, MoreStagesThanLayersIsRefused) {
  EXPECT_THAT(std::string(SplitLayers(2, 3, {}).status().message()),
              ::testing::HasSubstr("the model has 2 layers: too few for 3 pipeline stages"));
  EXPECT_FALSE(SplitLayers(4, 0, {}).ok());
}

}  // namespace
}  // namespace shardserve
