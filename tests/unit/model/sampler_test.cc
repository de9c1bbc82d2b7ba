#include "model/sampler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>

namespace shardserve {
namespace {

std::vector<float> Logits() {
  std::vector<float> l(50);
  for (size_t i = 0; i < l.size(); ++i) l[i] = std::sin(0.7f * i) * 3;
  l[10] = 4.0f;  // a clear maximum (sin leaves near-ties at the top)
  return l;
}

std::vector<int32_t> Draw(const SamplingParams& p, int n) {
  Sampler s(p);
  const auto l = Logits();
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) out.push_back(s.Sample(l.data(), l.size()).id);
  return out;
}

TEST(SamplerTest, GreedyIsArgmaxWithNormalizedLogprobs) {
  SamplingParams p;
  p.top_logprobs = 3;
  Sampler s(p);
  const auto l = Logits();
  SampledToken t = s.Sample(l.data(), l.size());
  EXPECT_EQ(t.id, std::max_element(l.begin(), l.end()) - l.begin());
  double z = 0;
  for (float v : l) z += std::exp(double(v));
  EXPECT_NEAR(t.logprob, l[t.id] - std::log(z), 1e-5);
  ASSERT_EQ(t.top.size(), 3u);
  EXPECT_EQ(t.top[0].id, t.id);
  EXPECT_GE(t.top[0].logprob, t.top[1].logprob);
  EXPECT_GE(t.top[1].logprob, t.top[2].logprob);
}

TEST(SamplerTest, SameSeedSameTokensOtherSeedOtherTokens) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 11;
  EXPECT_EQ(Draw(p, 40), Draw(p, 40));
  SamplingParams q = p;
  q.seed = 12;
  EXPECT_NE(Draw(p, 40), Draw(q, 40));
}

TEST(SamplerTest, TopKAndTopPRestrictTheChoice) {
  const auto l = Logits();
  std::vector<int32_t> order(l.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return l[a] > l[b]; });
  SamplingParams p;
  p.temperature = 5.0f;  // flat: without limits every token would appear
  p.top_k = 3;
  for (int32_t id : Draw(p, 300)) {
    EXPECT_THAT(id, ::testing::AnyOf(order[0], order[1], order[2]));
  }
  p.top_k = 0;
  p.top_p = 1e-6f;  // the nucleus is the single most likely token
  for (int32_t id : Draw(p, 50)) EXPECT_EQ(id, order[0]);
  p.top_p = 1.0f;
  std::map<int32_t, int> counts;
  for (int32_t id : Draw(p, 2000)) counts[id]++;
  EXPECT_GT(counts.size(), 30u);
}

TEST(SamplerTest, LowTemperatureConcentratesOnTheArgmax) {
  SamplingParams p;
  p.temperature = 0.01f;
  const auto l = Logits();
  const int32_t best = std::max_element(l.begin(), l.end()) - l.begin();
  for (int32_t id : Draw(p, 50)) EXPECT_EQ(id, best);
}

TEST(SamplerTest, ValidateNamesTheParameter) {
  auto bad = [](auto mutate) {
    SamplingParams p;
    mutate(p);
    return std::string(p.Validate().message());
  };
  EXPECT_THAT(bad([](SamplingParams& p) { p.temperature = -1; }),
              ::testing::HasSubstr("temperature"));
  EXPECT_THAT(bad([](SamplingParams& p) { p.temperature = NAN; }),
              ::testing::HasSubstr("temperature"));
  EXPECT_THAT(bad([](SamplingParams& p) { p.top_p = 0; }), ::testing::HasSubstr("top_p"));
  EXPECT_THAT(bad([](SamplingParams& p) { p.top_k = -2; }), ::testing::HasSubstr("top_k"));
  EXPECT_THAT(bad([](SamplingParams& p) { p.max_tokens = 0; }), ::testing::HasSubstr("max_tokens"));
  EXPECT_THAT(bad([](SamplingParams& p) { p.top_logprobs = 21; }),
              ::testing::HasSubstr("logprobs"));
  EXPECT_TRUE(SamplingParams().Validate().ok());
}

}  // namespace
}  // namespace shardserve
