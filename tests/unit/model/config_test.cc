#include "model/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace shardserve {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

json Llama() {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"hidden_size", 64},
          {"intermediate_size", 128},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"vocab_size", 100},
          {"max_position_embeddings", 128},
          {"eos_token_id", {2, 7}}};
}

TEST(ConfigTest, ParsesLlamaWithDefaults) {
  auto c = ParseModelConfig(Llama().dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 16);
  EXPECT_EQ(c->kv_dim(), 32);
  EXPECT_EQ(c->eos_token_ids, (std::vector<int64_t>{2, 7}));
  EXPECT_FALSE(c->moe);
  EXPECT_EQ(c->rope_scaling, RopeScaling::kNone);
  EXPECT_EQ(c->max_context, 128);
}

TEST(ConfigTest, ParsesRopeScalingOldAndNewSpelling) {
  json j = Llama();
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 4.0}};
  auto c = ParseModelConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling, RopeScaling::kLinear);
  EXPECT_EQ(c->rope_factor, 4.0);
  j.erase("rope_scaling");
  j["rope_parameters"] = {{"rope_type", "llama3"},
                          {"rope_theta", 500000.0},
                          {"factor", 8.0},
                          {"original_max_position_embeddings", 8192}};
  c = ParseModelConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling, RopeScaling::kLlama3);
  EXPECT_EQ(c->rope_theta, 500000.0);
}

TEST(ConfigTest, QwenBiasMistralWindowMixtralExperts) {
  json q = Llama();
  q["architectures"] = {"Qwen2ForCausalLM"};
  EXPECT_TRUE(ParseModelConfig(q.dump())->qkv_bias);
  EXPECT_FALSE(ParseModelConfig(q.dump())->o_bias);
  json m = Llama();
  m["architectures"] = {"MistralForCausalLM"};
  m["sliding_window"] = 64;
  EXPECT_EQ(ParseModelConfig(m.dump())->max_context, 64);
  json x = Llama();
  x["architectures"] = {"MixtralForCausalLM"};
  x["num_local_experts"] = 8;
  x["num_experts_per_tok"] = 2;
  auto c = ParseModelConfig(x.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->moe);
  EXPECT_EQ(c->num_experts, 8);
}

struct Bad {
  const char* name;
  json patch;  // merged into the Llama config; null values erase the key
  const char* message;
};

TEST(ConfigTest, RefusesWhatItDoesNotRunExactly) {
  const std::vector<Bad> cases = {
      {"unknown architecture", {{"architectures", {"GPT2LMHeadModel"}}}, "'GPT2LMHeadModel'"},
      {"activation", {{"hidden_act", "gelu"}}, "'hidden_act' 'gelu' is not supported"},
      {"rope type", {{"rope_scaling", {{"type", "yarn"}, {"factor", 2.0}}}}, "'yarn'"},
      {"kv heads", {{"num_key_value_heads", 3}}, "3 does not divide num_attention_heads 4"},
      {"missing field", {{"hidden_size", nullptr}}, "'hidden_size' is required"},
      {"mlp bias", {{"mlp_bias", true}}, "'mlp_bias' true is not supported"},
      {"negative", {{"vocab_size", -5}}, "'vocab_size' must be positive, got -5"},
      {"wrong type", {{"num_hidden_layers", "two"}}, "'num_hidden_layers' must be an integer"},
      {"partial rotary", {{"partial_rotary_factor", 0.5}}, "partial_rotary_factor"},
      {"experts",
       {{"architectures", {"MixtralForCausalLM"}},
        {"num_local_experts", 2},
        {"num_experts_per_tok", 3}},
       "3 exceeds num_local_experts 2"},
  };
  for (const Bad& b : cases) {
    json j = Llama();
    for (auto it = b.patch.begin(); it != b.patch.end(); ++it) {
      if (it.value().is_null()) {
        j.erase(it.key());
      } else {
        j[it.key()] = it.value();
      }
    }
    auto c = ParseModelConfig(j.dump());
    ASSERT_FALSE(c.ok()) << b.name;
    EXPECT_THAT(std::string(c.status().message()), HasSubstr(b.message)) << b.name;
  }
  EXPECT_THAT(std::string(ParseModelConfig("{nope").status().message()),
              HasSubstr("not valid JSON"));
}

}  // namespace
}  // namespace shardserve
