#include "model/sampler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "backend/cpu/kernels.h"

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

// Speculative verification keeps the model's distribution exactly: over many seeds, the first
// token follows the choice's distribution of row 0 whatever the draft, and after a kept draft the
// next follows row 1's (a chi-square test at a fixed set of seeds, so it cannot flake); the draft
// is kept with its probability; one draw a token, as Sample's.
TEST(SamplerTest, VerifyKeepsTheDistributionOfSampling) {
  const int64_t V = 6;
  const std::vector<float> rows = {2.0f, 1.5f, 1.0f, 0.5f, 0.0f,  -1.0f,  // row 0
                                   0.1f, 1.0f, 0.3f, 2.0f, -0.5f, 0.7f,   // row 1
                                   0.0f, 0.0f, 0.0f, 0.0f, 0.0f,  0.0f};  // row 2
  SamplingParams p;
  p.temperature = 0.7f;
  p.top_k = 5;  // id 5 never
  p.top_p = 0.97f;
  const std::vector<int32_t> drafts = {1, 3};
  auto target = [&](int64_t row) {  // the choice's distribution of a row
    const cpu::Distribution d =
        cpu::DistributionOf(rows.data() + row * V, V, {p.temperature, p.top_p, 5, 0});
    std::vector<double> prob(V, 0.0);
    for (size_t j = 0; j < d.ids.size(); ++j) prob[d.ids[j]] = d.weights[j] / d.total;
    return prob;
  };
  // Chi-square of counts against probabilities; an id of probability 0 must never occur.
  auto chi2 = [&](const std::vector<int>& count, const std::vector<double>& prob) {
    int n = 0;
    for (int c : count) n += c;
    double x = 0;
    for (int64_t i = 0; i < V; ++i) {
      if (prob[i] == 0) {
        EXPECT_EQ(count[i], 0) << "id " << i;
        continue;
      }
      const double e = n * prob[i];
      x += (count[i] - e) * (count[i] - e) / e;
    }
    return x;
  };
  const int trials = 40000;
  std::vector<int> first(V, 0), second(V, 0);
  int kept = 0;
  for (int t = 0; t < trials; ++t) {
    p.seed = static_cast<uint64_t>(t);
    Sampler s(p);
    const std::vector<SampledToken> out = s.Verify(rows.data(), V, drafts);
    ASSERT_GE(out.size(), 1u);
    ASSERT_LE(out.size(), 3u);
    ++first[out[0].id];
    if (out[0].id == drafts[0]) {
      ++kept;
      ASSERT_GE(out.size(), 2u);
      ++second[out[1].id];
    } else {
      EXPECT_EQ(out.size(), 1u);
    }
    if (t < 50) {  // as many draws as tokens
      Sampler skipped(p);
      skipped.Skip(static_cast<int64_t>(out.size()));
      EXPECT_EQ(s.NextSpec().u, skipped.NextSpec().u);
    }
  }
  // df 3 and 4 (ids of nonzero probability - 1): chi-square beyond 25 has p < 1e-4.
  EXPECT_LT(chi2(first, target(0)), 25.0);
  EXPECT_LT(chi2(second, target(1)), 25.0);
  EXPECT_NEAR(static_cast<double>(kept) / trials, target(0)[drafts[0]], 0.01);
}

// At temperature 0 a draft is kept when it is the row's greedy token (of the processed row: a
// kept draft counts for the penalties of the rows after it), and the first refused is replaced by
// the greedy token; the log-probabilities are the unprocessed rows'.
TEST(SamplerTest, GreedyVerifyKeepsDraftsWhileTheyAreTheArgmax) {
  const int64_t V = 4;
  const std::vector<float> rows = {0.0f, 3.0f, 1.0f, 0.0f,   // argmax 1
                                   2.0f, 0.0f, 0.0f, 1.0f,   // argmax 0
                                   0.0f, 0.0f, 5.0f, 0.0f};  // argmax 2
  SamplingParams p;
  auto ids = [&](const SamplingParams& params, std::vector<int32_t> drafts) {
    Sampler s(params);
    std::vector<int32_t> out;
    for (const SampledToken& t : s.Verify(rows.data(), V, drafts)) out.push_back(t.id);
    return out;
  };
  EXPECT_EQ(ids(p, {1, 0}), (std::vector<int32_t>{1, 0, 2}));
  EXPECT_EQ(ids(p, {1, 3}), (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(ids(p, {2, 0}), (std::vector<int32_t>{1}));
  Sampler s(p);
  const std::vector<SampledToken> out = s.Verify(rows.data(), V, {1});
  double z = 0;
  for (int64_t i = 0; i < V; ++i) z += std::exp(double(rows[i]));
  EXPECT_NEAR(out[0].logprob, 3.0 - std::log(z), 1e-5);
  // A kept draft is observed: with a presence penalty of 3, row 1 (where 1 leads by 2.5) no
  // longer chooses 1 once the draft 1 was kept at row 0.
  SamplingParams penalized = p;
  penalized.presence_penalty = 3.0f;
  const std::vector<float> same = {0.0f, 2.0f, 0.0f, 0.0f, 0.0f, 2.5f,
                                   0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  Sampler q(penalized);
  std::vector<int32_t> got;
  for (const SampledToken& t : q.Verify(same.data(), V, {1, 1})) got.push_back(t.id);
  // Row 1 penalizes the kept 1 (2.5 - 3 < 0): its greedy token is 0, the draft 1 refused.
  EXPECT_EQ(got, (std::vector<int32_t>{1, 0}));
  Sampler unpenalized(p);
  got.clear();
  for (const SampledToken& t : unpenalized.Verify(same.data(), V, {1, 1})) got.push_back(t.id);
  EXPECT_EQ(got, (std::vector<int32_t>{1, 1, 0}));
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
