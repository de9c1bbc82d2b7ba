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

// TinyLlama-1.1B's sizes.
ModelShape TinyLlama() { return {22, 2048, 5632, 2048, 256, 32000, 0}; }

TEST(LayerSplitTest, TheShapesCostsWeighTheLmHead) {
  const StageCosts c = CostsOf(TinyLlama());
  // q, o: 2 x 2048 x 2048; k, v: 2 x 2048 x 256; MLP: 3 x 2048 x 5632.
  EXPECT_DOUBLE_EQ(c.layer, 2.0 * 2048 * 2048 + 2.0 * 2048 * 256 + 3.0 * 2048 * 5632);
  EXPECT_DOUBLE_EQ(c.first, 2048);
  EXPECT_DOUBLE_EQ(c.last, 2048.0 * 32000);
  EXPECT_EQ(Sizes(*PlanStageLayers(TinyLlama(), 2)), (std::vector<int64_t>{12, 10}));
  // A MoE layer counts the experts each token uses.
  ModelShape moe = TinyLlama();
  moe.experts_per_token = 2;
  EXPECT_DOUBLE_EQ(CostsOf(moe).layer - c.layer, 3.0 * 2048 * 5632);
}

TEST(LayerSplitTest, StageLayersRoundTripAsText) {
  const auto split = *PlanStageLayers(TinyLlama(), 3);
  const std::string text = FormatStageLayers(split);
  EXPECT_EQ(text, "0-7,8-15,16-21");
  auto back = ParseStageLayers(text, 22, 3);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(Sizes(*back), Sizes(split));
  EXPECT_EQ(FormatLayerRange(split[2]), "16-21");
}

TEST(LayerSplitTest, StageLayersThatDoNotFitTheModelAreRefused) {
  auto why = [](const std::string& text, int64_t layers, int pp) {
    auto r = ParseStageLayers(text, layers, pp);
    EXPECT_FALSE(r.ok()) << text;
    return std::string(r.status().message());
  };
  EXPECT_THAT(why("0-10,11-21", 22, 3), ::testing::HasSubstr("has 2 stage(s), the pipeline 3"));
  EXPECT_THAT(why("0-10,11-21,22-23", 22, 2), ::testing::HasSubstr("the pipeline 2"));
  EXPECT_THAT(why("0-10,12-21", 22, 2), ::testing::HasSubstr("stage 1 must start at layer 11"));
  EXPECT_THAT(why("1-10,11-21", 22, 2), ::testing::HasSubstr("stage 0 must start at layer 0"));
  EXPECT_THAT(why("0-10,11-20", 22, 2), ::testing::HasSubstr("the model has 22 layers"));
  EXPECT_THAT(why("0-10,11-9", 22, 2), ::testing::HasSubstr("at least one layer"));
  EXPECT_THAT(why("0-10;11-21", 22, 2), ::testing::HasSubstr("is not FIRST-LAST"));
  EXPECT_THAT(why("", 22, 1), ::testing::HasSubstr("is not FIRST-LAST"));
  EXPECT_THAT(why("-1-21", 22, 1), ::testing::HasSubstr("is not FIRST-LAST"));
  EXPECT_THAT(why(std::string(1 << 20, ','), 22, 2), ::testing::HasSubstr("is not FIRST-LAST"));
}

TEST(LayerSplitTest, TheShapesJsonIsCheckedFieldByField) {
  const ModelShape shape = TinyLlama();
  auto back = ShapeFromJson(ShapeToJson(shape));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, shape);
  nlohmann::json j = ShapeToJson(shape);
  j.erase("vocab");
  EXPECT_THAT(std::string(ShapeFromJson(j).status().message()),
              ::testing::HasSubstr("no integer 'vocab'"));
  j = ShapeToJson(shape);
  j["layers"] = 0;
  EXPECT_THAT(std::string(ShapeFromJson(j).status().message()),
              ::testing::HasSubstr("'layers' is 0, outside [1, 65536]"));
  j["layers"] = "22";
  EXPECT_FALSE(ShapeFromJson(j).ok());
  j["layers"] = 1e300;
  EXPECT_FALSE(ShapeFromJson(j).ok());
  EXPECT_FALSE(ShapeFromJson(nlohmann::json::array()).ok());
  EXPECT_FALSE(ShapeFromJson(nlohmann::json()).ok());
}

}  // namespace
}  // namespace shardserve
