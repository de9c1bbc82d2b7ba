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

// Structured output's allowed set: the choice keeps to it (greedy and sampled), ids past the mask
// are not allowed, the reported log-probability stays the model's, and the set holds for one
// token only.
TEST(SamplerTest, AnAllowedSetBoundsTheNextChoiceOnly) {
  const int64_t V = 40;
  std::vector<float> logits(V, 0.f);
  logits[3] = 9.f;   // the model's favourite, not allowed
  logits[35] = 8.f;  // past the one-word mask: not allowed either
  logits[17] = 1.f;
  for (float temperature : {0.f, 1.f}) {
    SamplingParams p;
    p.temperature = temperature;
    p.seed = 5;
    Sampler s(p);
    for (int round = 0; round < 20; ++round) {
      std::vector<uint32_t> mask(1, 0);
      mask[0] |= 1u << 17 | 1u << 20;
      s.Allow(mask);
      EXPECT_TRUE(s.ProcessesLogits());
      const SampledToken t = s.Sample(logits.data(), V);
      EXPECT_TRUE(t.id == 17 || t.id == 20) << t.id;
      if (temperature == 0.f) {
        EXPECT_EQ(t.id, 17);
      }
      // The model's own log-probability of the token.
      double z = 0;
      for (float l : logits) z += std::exp(l - 9.f);
      EXPECT_NEAR(t.logprob, logits[t.id] - 9.f - std::log(z), 1e-4);
      EXPECT_FALSE(s.ProcessesLogits());
    }
    if (temperature == 0.f) EXPECT_EQ(s.Sample(logits.data(), V).id, 3);  // the set is gone
  }
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

// Each control equals its definition (vLLM's): Process on a row against the row computed by hand
// from the sequence's prompt [3, 7, 7] and output [7, 9, 9, 9].
TEST(SamplerTest, PenaltiesBiasAndMinTokensAreTheirDefinitions) {
  const std::vector<int32_t> prompt = {3, 7, 7}, output = {7, 9, 9, 9};
  auto processed = [&](const SamplingParams& p) {
    Sampler s(p, static_cast<int64_t>(prompt.size()));
    s.Observe(prompt.data(), 3);
    s.Observe(output.data(), 4);
    std::vector<float> row = Logits();
    s.Process(row.data(), static_cast<int64_t>(row.size()));
    return row;
  };
  const std::vector<float> raw = Logits();
  SamplingParams p;
  p.frequency_penalty = 0.5f;  // minus 0.5 x the count in the output: 7 once, 9 three times
  std::vector<float> want = raw;
  want[7] -= 0.5f;
  want[9] -= 1.5f;
  EXPECT_EQ(processed(p), want);
  p = {};
  p.presence_penalty = -0.25f;  // once for each token of the output, whatever its count
  want = raw;
  want[7] += 0.25f;
  want[9] += 0.25f;
  EXPECT_EQ(processed(p), want);
  p = {};
  p.repetition_penalty = 2.0f;  // the prompt's and the output's tokens: / 2 if > 0, x 2 if not
  want = raw;
  for (int32_t id : {3, 7, 9}) want[id] = raw[id] > 0 ? raw[id] / 2 : raw[id] * 2;
  EXPECT_EQ(processed(p), want);
  ASSERT_TRUE(raw[3] > 0 || raw[7] > 0 || raw[9] > 0);  // both branches of the definition
  ASSERT_TRUE(raw[3] < 0 || raw[7] < 0 || raw[9] < 0);
  p = {};
  p.logit_bias = {{4, 100.0f}, {10, -100.0f}};  // added
  want = raw;
  want[4] += 100;
  want[10] -= 100;
  EXPECT_EQ(processed(p), want);
  p = {};
  p.min_tokens = 5;  // 4 generated: the ids that end it are held back
  p.end_ids = {10, 11};
  want = raw;
  want[10] = want[11] = -INFINITY;
  EXPECT_EQ(processed(p), want);
  p.min_tokens = 4;  // reached: nothing held back
  EXPECT_EQ(processed(p), raw);
}

// The processed row is what the choice sees; the log-probabilities stay the model's own.
TEST(SamplerTest, TheChoiceSeesTheProcessedRowTheLogprobsTheModels) {
  const std::vector<float> raw = Logits();
  double z = 0;
  for (float v : raw) z += std::exp(double(v));
  SamplingParams p;
  p.top_logprobs = 2;
  p.logit_bias = {{4, 50.0f}};
  Sampler s(p);
  const SampledToken t = s.Sample(raw.data(), static_cast<int64_t>(raw.size()));
  EXPECT_EQ(t.id, 4);
  EXPECT_NEAR(t.logprob, raw[4] - std::log(z), 1e-5);
  ASSERT_EQ(t.top.size(), 2u);
  EXPECT_EQ(t.top[0].id, 10);  // the model's own best
  p.temperature = 1.0f;        // sampled: the bias decides it too
  Sampler sampled(p);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(sampled.Sample(raw.data(), raw.size()).id, 4);
  // A repeated token loses its place: greedy with a frequency penalty leaves 10 once chosen.
  SamplingParams f;
  f.frequency_penalty = 2.0f;
  Sampler g(f, 1);
  const int32_t first = 1;
  g.Observe(&first, 1);
  const SampledToken a = g.Sample(raw.data(), raw.size());
  EXPECT_EQ(a.id, 10);
  g.Observe(&a.id, 1);
  EXPECT_NE(g.Sample(raw.data(), raw.size()).id, 10);
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
  EXPECT_THAT(bad([](SamplingParams& p) { p.repetition_penalty = 0; }),
              ::testing::HasSubstr("repetition_penalty"));
  EXPECT_THAT(bad([](SamplingParams& p) { p.frequency_penalty = INFINITY; }),
              ::testing::HasSubstr("frequency_penalty"));
  EXPECT_THAT(bad([](SamplingParams& p) {
                p.logit_bias = {{-1, 1.0f}};
              }),
              ::testing::HasSubstr("logit_bias"));
  EXPECT_THAT(bad([](SamplingParams& p) { p.min_tokens = -1; }),
              ::testing::HasSubstr("min_tokens"));
  EXPECT_TRUE(SamplingParams().Validate().ok());
}

}  // namespace
}  // namespace shardserve
