// The handoff of a disaggregated request between its prefill and decode legs
// (serve/kv_handoff.h): round trips, and every malformed field refused naming it.
#include "serve/kv_handoff.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

namespace shardserve {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

KvHandoff Some() {
  KvHandoff h;
  h.shape.tp = 2;
  h.shape.stages = {{0, 4}};
  h.shape.kv_heads = 2;
  h.shape.block_size = 16;
  h.addresses = {std::string("\x01\x00\xfe", 3), "rank1"};
  h.seed = UINT64_MAX;
  KvHandoff::Sequence a;
  a.ticket = KvTicket{};
  (*a.ticket)[5] = 9;
  a.first = {42, -0.5f, {{42, -0.5f}, {7, -2.25f}}};
  KvHandoff::Sequence b;  // ended at its first token: no ticket
  b.first = {3, -std::numeric_limits<float>::infinity(), {}};
  h.sequences = {a, b};
  return h;
}

TEST(KvHandoffTest, RoundTrips) {
  const KvHandoff h = Some();
  auto back = DecodeKvHandoff(json::parse(EncodeKvHandoff(h).dump()));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(std::tuple(back->shape.tp, back->shape.stages, back->addresses, back->seed),
            std::tuple(2, h.shape.stages, h.addresses, UINT64_MAX));
  ASSERT_EQ(back->sequences.size(), 2u);
  EXPECT_EQ(back->sequences[0].ticket, h.sequences[0].ticket);
  EXPECT_EQ(back->sequences[0].first.id, 42);
  ASSERT_EQ(back->sequences[0].first.top.size(), 2u);
  EXPECT_EQ(back->sequences[0].first.top[1].id, 7);
  EXPECT_FLOAT_EQ(back->sequences[0].first.top[1].logprob, -2.25f);
  EXPECT_FALSE(back->sequences[1].ticket.has_value());
  EXPECT_LT(back->sequences[1].first.logprob, -1e38f);  // -inf crosses as the lowest float
}

TEST(KvHandoffTest, MalformedHandoffsNameTheField) {
  const json good = EncodeKvHandoff(Some());
  auto refused = [&](auto mutate) {
    json m = good;
    mutate(m);
    auto h = DecodeKvHandoff(m);
    EXPECT_FALSE(h.ok());
    return std::string(h.status().message());
  };
  EXPECT_THAT(refused([](json& m) { m.erase("shape"); }),
              HasSubstr("'kv_transfer_params': 'shape' is missing"));
  EXPECT_THAT(refused([](json& m) { m["addresses"].erase(1); }),
              HasSubstr("1 addresses for 2 prefill ranks"));
  EXPECT_THAT(refused([](json& m) { m["addresses"][0] = "!!"; }), HasSubstr("not base64"));
  EXPECT_THAT(refused([](json& m) { m["seed"] = -1; }), HasSubstr("'seed' is missing"));
  EXPECT_THAT(refused([](json& m) { m["sequences"] = json::array(); }),
              HasSubstr("0 sequences (1 to 4096)"));
  EXPECT_THAT(refused([](json& m) { m["sequences"][0]["ticket"] = "zz"; }),
              HasSubstr("a KV ticket is 64 hex digits"));
  EXPECT_THAT(refused([](json& m) { m["sequences"][0]["first"]["id"] = -3; }),
              HasSubstr("'id' is -3"));
  EXPECT_THAT(refused([](json& m) { m["sequences"][0]["first"]["top"] = {{1}}; }),
              HasSubstr("alternative is not [id, logprob]"));
  EXPECT_THAT(refused([](json& m) {
                m["sequences"][0]["first"]["top"] = json::array();
                for (int i = 0; i < 21; ++i) m["sequences"][0]["first"]["top"].push_back({i, 0});
              }),
              HasSubstr("21 alternatives (at most 20)"));
  EXPECT_THAT(refused([](json& m) { m = 7; }), HasSubstr("it is not an object"));
}

}  // namespace
}  // namespace shardserve
