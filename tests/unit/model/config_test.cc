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

// Qwen3: q/k norms per head, biases only with attention_bias, no window unless it is used.
TEST(ConfigTest, Qwen3NormsQueriesAndKeys) {
  json q = Llama();
  q["architectures"] = {"Qwen3ForCausalLM"};
  q["sliding_window"] = 64;
  q["use_sliding_window"] = false;
  auto c = ParseModelConfig(q.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->qk_norm);
  EXPECT_FALSE(c->qkv_bias);
  EXPECT_GT(c->max_context, 64);
  q["attention_bias"] = true;
  EXPECT_TRUE(ParseModelConfig(q.dump())->qkv_bias);
  EXPECT_FALSE(ParseModelConfig(Llama().dump())->qk_norm);
}

// Qwen3-MoE: its experts' size is the MLP size, routing without renormalization unless asked;
// what it cannot run (dense layers among the sparse ones, shared experts) is refused by name.
TEST(ConfigTest, Qwen3MoeExperts) {
  json q = Llama();
  q["architectures"] = {"Qwen3MoeForCausalLM"};
  q["num_experts"] = 8;
  q["num_experts_per_tok"] = 2;
  q["moe_intermediate_size"] = 24;
  auto c = ParseModelConfig(q.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->moe && c->qk_norm);
  EXPECT_EQ(c->num_experts, 8);
  EXPECT_EQ(c->intermediate_size, 24);
  EXPECT_FALSE(c->norm_topk_prob);
  q["norm_topk_prob"] = true;
  EXPECT_TRUE(ParseModelConfig(q.dump())->norm_topk_prob);
  EXPECT_TRUE(ParseModelConfig(Llama().dump())->norm_topk_prob) << "Mixtral's: renormalized";
  for (auto [key, value] : {std::pair<const char*, json>{"decoder_sparse_step", 2},
                            {"mlp_only_layers", json::array({0})},
                            {"shared_expert_intermediate_size", 64}}) {
    json bad = q;
    bad[key] = value;
    auto r = ParseModelConfig(bad.dump());
    ASSERT_FALSE(r.ok()) << key;
    EXPECT_NE(r.status().message().find(key), std::string::npos) << r.status();
  }
  q.erase("moe_intermediate_size");
  EXPECT_FALSE(ParseModelConfig(q.dump()).ok());
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
      // Sizes no model has (10^8 layers once aborted the load on an allocation) and numbers that
      // load and then produce garbage.
      {"layers", {{"num_hidden_layers", 100000000}}, "'num_hidden_layers' is 100000000, more than"},
      {"positions",
       {{"max_position_embeddings", 4294967295LL}},
       "'max_position_embeddings' is 4294967295, more than"},
      {"hidden", {{"hidden_size", int64_t{1} << 40}}, "'hidden_size' is 1099511627776"},
      {"theta 0", {{"rope_theta", 0}}, "'rope_theta' is 0; it must lie in (1, 1e+12]"},
      {"theta -1", {{"rope_theta", -1}}, "'rope_theta' is -1"},
      {"theta huge", {{"rope_theta", 1e308}}, "'rope_theta' is 1e+308"},
      {"eps 0", {{"rms_norm_eps", 0}}, "'rms_norm_eps' is 0; it must lie in (0, 0.1]"},
      {"eps -1", {{"rms_norm_eps", -1}}, "'rms_norm_eps' is -1"},
      {"rope factor", {{"rope_scaling", {{"type", "linear"}, {"factor", 0}}}}, "'factor' is 0"},
      {"bos", {{"bos_token_id", 100}}, "'bos_token_id' 100 is not a token of the 100-token"},
      {"eos", {{"eos_token_id", {2, -3}}}, "'eos_token_id' -3 is not a token"},
      {"eos past", {{"eos_token_id", 1000}}, "'eos_token_id' 1000 is not a token"},
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
