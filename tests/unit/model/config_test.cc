#include "model/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "common/text.h"
#include "model/footprint.h"
#include "model/rope.h"

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

// generation_config.json's end ids join config.json's (once each), as transformers' generate
// and vLLM stop at them; a bad one names the file.
TEST(ConfigTest, GenerationConfigAddsEndIds) {
  auto c = ParseModelConfig(Llama().dump());
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(AddGenerationEosIds(R"({"eos_token_id": [7, 9], "do_sample": true})", "g", *c).ok());
  EXPECT_EQ(c->eos_token_ids, (std::vector<int64_t>{2, 7, 9}));
  ASSERT_TRUE(AddGenerationEosIds(R"({"eos_token_id": 11})", "g", *c).ok());
  ASSERT_TRUE(AddGenerationEosIds(R"({"eos_token_id": null, "bos_token_id": 1})", "g", *c).ok());
  EXPECT_EQ(c->eos_token_ids, (std::vector<int64_t>{2, 7, 9, 11}));
  for (const char* bad : {R"({"eos_token_id": [3, 100]})", R"({"eos_token_id": "2"})",
                          R"({"eos_token_id": -1})", "[1]", "{not json"}) {
    const absl::Status s = AddGenerationEosIds(bad, "generation_config.json", *c);
    EXPECT_FALSE(s.ok()) << bad;
    EXPECT_THAT(s.message(), HasSubstr("generation_config.json")) << bad;
  }
  EXPECT_EQ(c->eos_token_ids, (std::vector<int64_t>{2, 7, 9, 11}));
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
// The experts' count under each name transformers' config classes give it (attribute_map):
// transformers 5 writes num_local_experts for Qwen3-MoE, Mixtral and gpt-oss, and DeepSeek-V3's
// n_routed_experts may come as num_local_experts; the runtime and the plan read the same, and two
// names that disagree are refused.
TEST(ConfigTest, ExpertsUnderEitherNameTransformersGivesThem) {
  json q = Llama();
  q["architectures"] = {"Qwen3MoeForCausalLM"};
  q["num_experts_per_tok"] = 2;
  q["moe_intermediate_size"] = 24;
  for (const char* name : {"num_experts", "num_local_experts"}) {
    json named = q;
    named[name] = 8;
    auto c = ParseModelConfig(named.dump());
    ASSERT_TRUE(c.ok()) << name << ": " << c.status();
    EXPECT_EQ(c->num_experts, 8) << name;
    auto f = FootprintFromConfig(named.dump());
    ASSERT_TRUE(f.ok()) << name << ": " << f.status();
    EXPECT_EQ(f->experts, 8) << name;
  }
  json both = q;
  both["num_experts"] = 8;
  both["num_local_experts"] = 16;
  EXPECT_THAT(std::string(ParseModelConfig(both.dump()).status().message()),
              HasSubstr("'num_experts' disagrees with 'num_local_experts'"));
  both["num_local_experts"] = 8;
  EXPECT_TRUE(ParseModelConfig(both.dump()).ok());
  json mixtral = Llama();
  mixtral["architectures"] = {"MixtralForCausalLM"};
  mixtral["num_experts"] = 4;
  mixtral["num_experts_per_tok"] = 2;
  auto m = ParseModelConfig(mixtral.dump());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->num_experts, 4);
  EXPECT_EQ(FootprintFromConfig(mixtral.dump())->experts, 4);
}

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

// `base` with `patch` merged in; null values erase the key.
json Patched(json base, const json& patch) {
  for (auto it = patch.begin(); it != patch.end(); ++it) {
    if (it.value().is_null()) {
      base.erase(it.key());
    } else {
      base[it.key()] = it.value();
    }
  }
  return base;
}

TEST(ConfigTest, RefusesWhatItDoesNotRunExactly) {
  const std::vector<Bad> cases = {
      {"unknown architecture", {{"architectures", {"GPT2LMHeadModel"}}}, "'GPT2LMHeadModel'"},
      {"activation", {{"hidden_act", "gelu"}}, "'hidden_act' 'gelu' is not supported"},
      {"rope type", {{"rope_scaling", {{"type", "dynamic"}, {"factor", 2.0}}}}, "'dynamic'"},
      {"yarn factor", {{"rope_scaling", {{"type", "yarn"}, {"factor", 0.5}}}}, "at least 1"},
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
    auto c = ParseModelConfig(Patched(Llama(), b.patch).dump());
    ASSERT_FALSE(c.ok()) << b.name;
    EXPECT_THAT(std::string(c.status().message()), HasSubstr(b.message)) << b.name;
  }
  EXPECT_THAT(std::string(ParseModelConfig("{nope").status().message()),
              HasSubstr("not valid JSON"));
}

json DeepseekV3() {
  auto text = ReadFileToString(std::string(SHARDSERVE_SOURCE_DIR) +
                               "/examples/plan/deepseek-v3/config.json");
  EXPECT_TRUE(text.ok()) << text.status();
  return json::parse(*text);
}

// DeepSeek-V3's own config.json: MLA, its routing, the dense first layers, YaRN as it sets it.
TEST(ConfigTest, ParsesDeepseekV3) {
  auto c = ParseModelConfig(DeepseekV3().dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->mla && c->moe && c->sigmoid_routing && c->rope_interleave);
  EXPECT_EQ(c->q_lora_rank, 1536);
  EXPECT_EQ(c->kv_lora_rank, 512);
  EXPECT_EQ(c->head_dim, 64);  // the rotated dims
  EXPECT_EQ(c->qk_nope_dim, 128);
  EXPECT_EQ(c->v_head_dim, 128);
  EXPECT_EQ(c->intermediate_size, 2048);  // an expert's
  EXPECT_EQ(c->dense_intermediate_size, 18432);
  EXPECT_EQ(c->num_experts, 256);
  EXPECT_EQ(c->shared_experts, 1);
  EXPECT_EQ(c->n_group, 8);
  EXPECT_EQ(c->topk_group, 4);
  EXPECT_EQ(c->first_dense_layers, 3);
  EXPECT_EQ(c->routed_scaling, 2.5);
  EXPECT_EQ(c->mtp_layers, 1);
  EXPECT_FALSE(c->moe_layer(2));
  EXPECT_TRUE(c->moe_layer(3));
  EXPECT_EQ(c->rope_scaling, RopeScaling::kYarn);
  EXPECT_EQ(c->rope_original_max_position, 4096);
  EXPECT_EQ(c->rope_attention_factor, 1.0);  // mscale = mscale_all_dim
  // transformers' softmax scale: (128 + 64)^-0.5 x (0.1 ln 40 + 1)^2.
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(c->attention_scale(), m * m / std::sqrt(192.0), 1e-12);
  EXPECT_TRUE(c->fp8());
}

TEST(ConfigTest, RefusesDeepseekV3OptionsItDoesNotRun) {
  const std::vector<Bad> cases = {
      {"scoring", {{"scoring_func", "softmax"}}, "'scoring_func' 'softmax' is not supported"},
      {"topk method", {{"topk_method", "greedy"}}, "'topk_method' 'greedy' is not supported"},
      {"groups", {{"n_group", 7}}, "'n_group' 7 does not divide n_routed_experts 256"},
      {"topk groups", {{"topk_group", 9}}, "'topk_group' 9 exceeds n_group 8"},
      {"k past groups", {{"topk_group", 1}, {"num_experts_per_tok", 40}}, "exceeds the 1 chosen"},
      {"bias", {{"attention_bias", true}}, "'attention_bias' true is not supported"},
      {"dense", {{"first_k_dense_replace", 62}}, "'first_k_dense_replace' must be between 0"},
      {"freq", {{"moe_layer_freq", 2}}, "'moe_layer_freq' other than 1"},
      {"kv lora", {{"kv_lora_rank", nullptr}}, "'kv_lora_rank' is required"},
      {"odd rope", {{"qk_rope_head_dim", 63}}, "'qk_rope_head_dim' must be even"},
      {"yarn factor on the rotated dims",
       {{"rope_scaling",
         {{"type", "yarn"}, {"factor", 40}, {"mscale", 0.707}, {"mscale_all_dim", 1.0}}}},
       "attention factor of"},
  };
  for (const Bad& b : cases) {
    auto c = ParseModelConfig(Patched(DeepseekV3(), b.patch).dump());
    ASSERT_FALSE(c.ok()) << b.name;
    EXPECT_THAT(std::string(c.status().message()), HasSubstr(b.message)) << b.name;
  }
}

// gpt-oss-120b's own config.json: MXFP4 experts, sinks and per-layer windows, biases, the
// clamped SwiGLU, YaRN without truncation; GptOssConfig's defaults (YaRN factor 32, theta 150000,
// sliding layers first) where the file says nothing. MXFP4 elsewhere is refused by name.
TEST(ConfigTest, ParsesGptOss) {
  auto text = ReadFileToString(std::string(SHARDSERVE_SOURCE_DIR) +
                               "/examples/plan/gpt-oss-120b/config.json");
  ASSERT_TRUE(text.ok());
  json j = json::parse(*text);
  auto c = ParseModelConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->gpt_oss && c->moe && c->qkv_bias && c->o_bias && c->mxfp4());
  EXPECT_EQ(c->num_experts, 128);
  EXPECT_EQ(c->experts_per_token, 4);
  EXPECT_EQ(c->intermediate_size, 2880);
  EXPECT_EQ(c->swiglu_limit, 7.0);
  EXPECT_EQ(c->swiglu_alpha, 1.702);
  EXPECT_EQ(c->max_context, 131072);  // the windows are per layer, not a cap
  EXPECT_EQ(c->window(0), 128);
  EXPECT_EQ(c->window(1), 0);
  EXPECT_EQ(c->rope_scaling, RopeScaling::kYarn);
  EXPECT_FALSE(c->rope_truncate);
  EXPECT_NEAR(c->rope_attention_factor, 0.1 * std::log(32.0) + 1, 1e-12);
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j.erase("layer_types");
  c = ParseModelConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling, RopeScaling::kYarn);
  EXPECT_EQ(c->rope_factor, 32.0);
  EXPECT_EQ(c->rope_original_max_position, 4096);
  EXPECT_FALSE(c->rope_truncate);
  EXPECT_EQ(c->rope_theta, 150000.0);
  EXPECT_EQ(c->window(34), 128);
  EXPECT_EQ(c->window(35), 0);
  json l = Llama();
  l["quantization_config"] = {{"quant_method", "mxfp4"}};
  EXPECT_THAT(std::string(ParseModelConfig(l.dump()).status().message()),
              HasSubstr("'mxfp4' loads for GptOssForCausalLM's experts, not for LlamaForCausalLM"));
  j["layer_types"] = {"sliding_attention", "chunked_attention"};
  EXPECT_THAT(std::string(ParseModelConfig(j.dump()).status().message()),
              HasSubstr("'layer_types' must list the type of each of the 36 layers"));
}

// YaRN's frequencies as transformers' _compute_yarn_parameters gives them (printed from
// transformers 5.23 for head_dim 16, theta 10000, factor 4, original 64, beta 32 / 1), and its
// attention factor folded into the softmax scale where the whole head rotates.
TEST(ConfigTest, YarnFrequenciesAndScale) {
  json j = Llama();
  j["rope_scaling"] = {
      {"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 64}};
  auto c = ParseModelConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  const std::vector<float> f = RopeInvFreq(*c);
  const std::vector<float> want = {1.000000000e+00f, 2.371708155e-01f, 4.999999702e-02f,
                                   7.905694656e-03f, 2.499999944e-03f, 7.905694656e-04f,
                                   2.500000119e-04f, 7.905694656e-05f};
  ASSERT_EQ(f.size(), want.size());
  for (size_t i = 0; i < f.size(); ++i) EXPECT_NEAR(f[i], want[i], 1e-7 * want[i]) << i;
  const double af = 0.1 * std::log(4.0) + 1.0;
  EXPECT_NEAR(c->rope_attention_factor, af, 1e-12);
  EXPECT_NEAR(c->attention_scale(), af * af / 4.0, 1e-12);  // head_dim 16
}

}  // namespace
}  // namespace shardserve
