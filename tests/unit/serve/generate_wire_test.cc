// The one-shot run of `shardserve generate` (serve/generate_wire.h): the request and the result
// round-trip, and each malformed field is refused by name (never an exception).
#include "serve/generate_wire.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace shardserve {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

GenerateRun SomeRun() {
  GenerateRun run;
  run.request.prompt_ids = {1, 5, 9};
  SamplingParams& p = run.request.params;
  p.max_tokens = 12;
  p.temperature = 0.7f;
  p.top_p = 0.9f;
  p.top_k = 40;
  p.seed = 18446744073709551615ull;
  p.top_logprobs = 2;
  p.stop_token_ids = {2, 7};
  p.ignore_eos = true;
  run.batch = 3;
  return run;
}

TEST(GenerateWireTest, TheRequestRoundTrips) {
  const GenerateRun run = SomeRun();
  auto back = DecodeGenerateRun(json::parse(EncodeGenerateRun(run).dump()));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->request.prompt_ids, run.request.prompt_ids);
  const SamplingParams &p = back->request.params, &q = run.request.params;
  EXPECT_EQ(p.max_tokens, q.max_tokens);
  EXPECT_EQ(p.temperature, q.temperature);
  EXPECT_EQ(p.top_p, q.top_p);
  EXPECT_EQ(p.top_k, q.top_k);
  EXPECT_EQ(p.seed, q.seed);
  EXPECT_EQ(p.top_logprobs, q.top_logprobs);
  EXPECT_EQ(p.stop_token_ids, q.stop_token_ids);
  EXPECT_EQ(p.ignore_eos, q.ignore_eos);
  EXPECT_EQ(back->batch, 3);
}

TEST(GenerateWireTest, MalformedRequestsNameTheField) {
  const json good = EncodeGenerateRun(SomeRun());
  auto refused = [&](auto mutate) {
    json m = good;
    mutate(m);
    auto r = DecodeGenerateRun(m);
    EXPECT_FALSE(r.ok());
    return std::string(r.status().message());
  };
  EXPECT_THAT(refused([](json& m) { m.erase("prompt_ids"); }),
              HasSubstr("the one-shot request (SHARDSERVE_REQUEST): 'prompt_ids' is missing"));
  EXPECT_THAT(refused([](json& m) {
                m["prompt_ids"] = {1, -2};
              }),
              HasSubstr("'prompt_ids' holds -2, not an integer in [0, "));
  EXPECT_THAT(refused([](json& m) {
                m["prompt_ids"] = {1, 1e300};
              }),
              HasSubstr("'prompt_ids' holds"));
  EXPECT_THAT(refused([](json& m) { m["max_tokens"] = "many"; }),
              HasSubstr("'max_tokens' is missing or not an integer"));
  EXPECT_THAT(refused([](json& m) { m["params"]["top_p"] = 3; }),
              HasSubstr("top_p must be in (0, 1]"));
  EXPECT_THAT(refused([](json& m) { m.erase("params"); }), HasSubstr("'params' is missing"));
  EXPECT_THAT(refused([](json& m) { m["ignore_eos"] = 1; }),
              HasSubstr("'ignore_eos' is missing or not a boolean"));
  EXPECT_THAT(refused([](json& m) { m["batch"] = 0; }), HasSubstr("'batch' is 0, outside [1, "));
  EXPECT_THAT(refused([](json& m) { m = json::array(); }), HasSubstr("not a JSON object"));
  // What a failed parse leaves (nlohmann's discarded value) is refused too.
  auto discarded = DecodeGenerateRun(json::parse("{", nullptr, false));
  EXPECT_FALSE(discarded.ok());
}

TEST(GenerateWireTest, TheResultRoundTripsAndAMalformedOneIsNamed) {
  GenerateOutcome outcome;
  outcome.seconds = 1.5;
  GenerationResult r;
  r.tokens = {4, 8};
  r.logprobs = {-0.5f, -1.25f};
  r.top_logprobs = {{{4, -0.5f}, {3, -2.0f}}, {{8, -1.25f}}};
  r.finish_reason = "length";
  outcome.results = {r, r};
  outcome.drafts = {{5}, {6, 7}};
  auto back = DecodeGenerateOutcome(json::parse(EncodeGenerateOutcome(outcome).dump()));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->seconds, 1.5);
  EXPECT_EQ(back->drafts, outcome.drafts);
  ASSERT_EQ(back->results.size(), 2u);
  EXPECT_EQ(back->results[1].tokens, r.tokens);
  EXPECT_EQ(back->results[1].logprobs, r.logprobs);
  EXPECT_EQ(back->results[1].finish_reason, "length");
  ASSERT_EQ(back->results[1].top_logprobs.size(), 2u);
  EXPECT_EQ(back->results[1].top_logprobs[0][1].id, 3);
  EXPECT_EQ(back->results[1].top_logprobs[0][1].logprob, -2.0f);

  json bad = EncodeGenerateOutcome(outcome);
  bad["results"][0]["top_logprobs"][0][0]["id"] = "four";
  EXPECT_THAT(std::string(DecodeGenerateOutcome(bad).status().message()),
              HasSubstr("the leader's result: 'id' is missing or not an integer"));
  bad = EncodeGenerateOutcome(outcome);
  bad["drafts"][1][0] = -0.5;
  EXPECT_THAT(std::string(DecodeGenerateOutcome(bad).status().message()),
              HasSubstr("a draft is not a token id"));
  bad = EncodeGenerateOutcome(outcome);
  bad["results"] = json::array();
  EXPECT_THAT(std::string(DecodeGenerateOutcome(bad).status().message()),
              HasSubstr("'results' is empty"));
}

}  // namespace
}  // namespace shardserve
