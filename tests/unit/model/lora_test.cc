// LoRA adapters as PEFT writes them (model/lora.h): what is read, and what is refused by name.
#include "model/lora.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "model/safetensors.h"
#include "test_models.h"

namespace shardserve {
namespace {

using nlohmann::json;
using testing::TempDir;
using testing::WriteFile;

// A Llama-shaped base: hidden 64, 4 heads of 16 (2 KV heads), MLP 128, 3 layers.
ModelConfig Base() {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.model_type = "llama";
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_layers = 3;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  return c;
}

// PEFT's adapter_config.json for LoRA (the keys peft 0.21 writes), with `changes` over it.
json Config(const json& changes = json::object()) {
  json c = {{"alpha_pattern", json::object()},
            {"auto_mapping", nullptr},
            {"base_model_name_or_path", "tiny-llama"},
            {"bias", "none"},
            {"corda_config", nullptr},
            {"eva_config", nullptr},
            {"exclude_modules", nullptr},
            {"fan_in_fan_out", false},
            {"inference_mode", true},
            {"init_lora_weights", true},
            {"layer_replication", nullptr},
            {"layers_pattern", nullptr},
            {"layers_to_transform", nullptr},
            {"loftq_config", json::object()},
            {"lora_alpha", 8},
            {"lora_bias", false},
            {"lora_dropout", 0.05},
            {"megatron_config", nullptr},
            {"megatron_core", "megatron.core"},
            {"modules_to_save", nullptr},
            {"peft_type", "LORA"},
            {"r", 4},
            {"rank_pattern", json::object()},
            {"revision", nullptr},
            {"target_modules", {"q_proj", "v_proj"}},
            {"target_parameters", nullptr},
            {"task_type", "CAUSAL_LM"},
            {"trainable_token_indices", nullptr},
            {"use_dora", false},
            {"use_qalora", false},
            {"use_rslora", false}};
  c.update(changes);
  return c;
}

std::string TensorName(int layer, const std::string& module, const char* half) {
  const bool mlp = module == "gate_proj" || module == "up_proj" || module == "down_proj";
  return "base_model.model.model.layers." + std::to_string(layer) +
         (mlp ? ".mlp." : ".self_attn.") + module + ".lora_" + half + ".weight";
}

// Tensors by name with their shapes; each value is a deterministic function of its name and
// index (Value), written as `dtype`.
struct Tensors {
  std::map<std::string, std::vector<int64_t>> shapes;
  void Add(int layer, const std::string& module, int64_t rank, int64_t in, int64_t out) {
    shapes[TensorName(layer, module, "A")] = {rank, in};
    shapes[TensorName(layer, module, "B")] = {out, rank};
  }
};

float Value(const std::string& name, size_t i) {
  return static_cast<float>(std::hash<std::string>{}(name) % 7) * 0.01f +
         static_cast<float>(i % 13) * 0.001f - 0.005f;
}

std::string Write(const TempDir& dir, const std::string& sub, const json& config,
                  const Tensors& tensors, DType dtype = DType::kF32) {
  const std::string path = dir.Sub(sub);
  std::filesystem::create_directories(path);
  WriteFile(path + "/adapter_config.json", config.dump(2));
  std::vector<TensorSpec> specs;
  for (const auto& [name, shape] : tensors.shapes) specs.push_back({name, dtype, shape});
  EXPECT_TRUE(WriteSafetensors(path + "/adapter_model.safetensors", specs,
                               [&](size_t i, std::vector<uint8_t>& bytes) {
                                 const size_t n = specs[i].nbytes() / DTypeSize(dtype);
                                 bytes.resize(specs[i].nbytes());
                                 for (size_t k = 0; k < n; ++k) {
                                   const float v = Value(specs[i].name, k);
                                   if (dtype == DType::kF32) {
                                     std::memcpy(bytes.data() + 4 * k, &v, 4);
                                   } else {
                                     const uint16_t h = F32ToBf16(v);
                                     std::memcpy(bytes.data() + 2 * k, &h, 2);
                                   }
                                 }
                               })
                  .ok());
  return path;
}

// q_proj and v_proj of every layer, rank 4.
Tensors QV(int64_t rank = 4) {
  Tensors t;
  for (int l = 0; l < 3; ++l) {
    t.Add(l, "q_proj", rank, 64, 64);
    t.Add(l, "v_proj", rank, 64, 32);
  }
  return t;
}

TEST(Lora, ReadsWhatPeftWrites) {
  TempDir dir;
  auto a = LoraAdapter::Load(Write(dir, "qv", Config(), QV()), Base());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->base_model, "tiny-llama");
  EXPECT_EQ(a->max_rank, 4);
  ASSERT_EQ(a->modules.size(), 6u);
  const LoraModule& v1 = a->modules[3];  // by layer, then target
  EXPECT_EQ(v1.layer, 1);
  EXPECT_EQ(v1.target, LoraTarget::kV);
  EXPECT_EQ(std::tuple(v1.rank, v1.in, v1.out), std::tuple(4, 64, 32));
  EXPECT_FLOAT_EQ(v1.scale, 2.0f);  // lora_alpha 8 / r 4
  ASSERT_EQ(v1.a.size(), 4u * 64);
  ASSERT_EQ(v1.b.size(), 32u * 4);
  EXPECT_FLOAT_EQ(v1.a[17], Value(TensorName(1, "v_proj", "A"), 17));
  EXPECT_FLOAT_EQ(v1.b[100], Value(TensorName(1, "v_proj", "B"), 100));
  // BF16 weights, read as floats.
  auto bf16 = LoraAdapter::Load(Write(dir, "bf16", Config(), QV(), DType::kBF16), Base());
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_NEAR(bf16->modules[3].a[17], Value(TensorName(1, "v_proj", "A"), 17), 1e-3);
}

TEST(Lora, EveryProjectionPerModuleRanksAndAlphasAndRsLora) {
  TempDir dir;
  Tensors t;
  const std::map<std::string, std::pair<int64_t, int64_t>> dims = {
      {"q_proj", {64, 64}},    {"k_proj", {64, 32}},     {"v_proj", {64, 32}},
      {"o_proj", {64, 64}},    {"gate_proj", {64, 128}}, {"up_proj", {64, 128}},
      {"down_proj", {128, 64}}};
  for (int l = 0; l < 3; ++l) {
    for (const auto& [m, d] : dims) {
      const int64_t rank = (l == 2 && m == "down_proj") ? 8 : 4;
      t.Add(l, m, rank, d.first, d.second);
    }
  }
  const json cfg = Config({{"target_modules", "all-linear"},
                           {"use_rslora", true},
                           {"lora_alpha", 16},
                           {"rank_pattern", {{"model.layers.2.mlp.down_proj", 8}}},
                           {"alpha_pattern", {{"o_proj", 32}}}});
  auto a = LoraAdapter::Load(Write(dir, "all", cfg, t), Base());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->modules.size(), 21u);
  EXPECT_EQ(a->max_rank, 8);
  for (const LoraModule& m : a->modules) {
    const double alpha = m.target == LoraTarget::kO ? 32 : 16;
    EXPECT_FLOAT_EQ(m.scale, static_cast<float>(alpha / std::sqrt(static_cast<double>(m.rank))))
        << m.layer << " " << LoraTargetName(m.target);
  }
  EXPECT_EQ(a->modules.back().rank, 8);
  EXPECT_EQ(a->modules.back().target, LoraTarget::kDown);
  // layers_to_transform: the others' tensors are not the adapter's.
  Tensors one;
  one.Add(1, "q_proj", 4, 64, 64);
  EXPECT_TRUE(
      LoraAdapter::Load(Write(dir, "layer1", Config({{"layers_to_transform", {1}}}), one), Base())
          .ok());
  EXPECT_FALSE(
      LoraAdapter::Load(Write(dir, "layer0", Config({{"layers_to_transform", 0}}), one), Base())
          .ok());
}

// Each refusal names what is refused.
TEST(Lora, WhatItDoesNotRunIsRefusedByName) {
  TempDir dir;
  struct Case {
    json config;
    std::function<void(Tensors&)> tensors;
    std::string message;
  };
  const std::vector<Case> cases = {
      {Config({{"modules_to_save", {"lm_head"}}}), nullptr, "modules_to_save"},
      {Config({{"use_dora", true}}), nullptr, "use_dora (DoRA"},
      {Config({{"bias", "lora_only"}}), nullptr, "bias \"lora_only\""},
      {Config({{"lora_bias", true}}), nullptr, "lora_bias"},
      {Config({{"fan_in_fan_out", true}}), nullptr, "fan_in_fan_out"},
      {Config({{"target_parameters", {"experts.gate_up_proj"}}}), nullptr, "target_parameters"},
      {Config({{"peft_type", "IA3"}}), nullptr, "peft_type \"IA3\" is not LORA"},
      {Config({{"some_future_option", 3}}), nullptr, "option 'some_future_option'"},
      {Config({{"target_modules", ".*attn.*"}}), nullptr, "is a regular expression"},
      {Config({{"rank_pattern", {{"^model.*q_proj$", 8}}}}), nullptr, "rank_pattern key"},
      {Config({{"r", 1000}}), nullptr, "r must be an integer from 1 to 256"},
      {Config({{"target_modules", {"q_proj"}}}), nullptr,
       "model.layers.0.self_attn.v_proj is not a module adapter_config.json targets"},
      {Config(),
       [](Tensors& t) {
         t.shapes["base_model.model.model.embed_tokens.lora_embedding_A"] = {4, 8};
       },
       "embedding LoRA"},
      {Config(),
       [](Tensors& t) {
         t.shapes["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = {64};
       },
       "DoRA"},
      {Config(),
       [](Tensors& t) {
         t.shapes["base_model.model.lm_head.weight"] = {8, 8};
       },
       "a base module saved in full with the adapter"},
      {Config(), [](Tensors& t) { t.shapes["base_model.model.model.norm.weight"] = {64}; },
       "not a LoRA A or B matrix"},
      {Config(),  // embedding LoRA is named before the full embedding PEFT saves with it
       [](Tensors& t) {
         t.shapes["base_model.model.model.embed_tokens.base_layer.weight"] = {8, 8};
         t.shapes["base_model.model.model.embed_tokens.lora_embedding_A"] = {4, 8};
       },
       "is embedding LoRA"},
      {Config(),
       [](Tensors& t) {
         t.shapes[TensorName(0, "q_proj", "A")] = {4, 65};
       },
       "is [4,65]; model.layers.0.self_attn.q_proj of rank 4 needs [4,64]"},
      {Config(), [](Tensors& t) { t.shapes.erase(TensorName(2, "v_proj", "B")); },
       "model.layers.2.self_attn.v_proj has lora_A without lora_B"},
      {Config({{"target_modules", {"q_proj", "v_proj", "w1"}}}),
       [](Tensors& t) { t.Add(5, "q_proj", 4, 64, 64); }, "past the base model's 3 layers"},
      {Config({{"rank_pattern", {{"q_proj", 4}, {"layers.0.self_attn.q_proj", 2}}}}), nullptr,
       "both match model.layers.0.self_attn.q_proj with different values"},
  };
  int i = 0;
  for (const Case& c : cases) {
    Tensors t = QV();
    if (c.tensors) c.tensors(t);
    auto a = LoraAdapter::Load(Write(dir, "case" + std::to_string(i++), c.config, t), Base());
    EXPECT_FALSE(a.ok()) << c.message;
    EXPECT_NE(a.status().message().find(c.message), std::string::npos)
        << a.status() << "\n  wanted: " << c.message;
  }
  // A base it does not run LoRA on, or the MLP of an MoE layer.
  ModelConfig mla = Base();
  mla.mla = true;
  mla.architecture = "DeepseekV3ForCausalLM";
  EXPECT_EQ(LoraAdapter::Load(Write(dir, "mla", Config(), QV()), mla).status().code(),
            absl::StatusCode::kUnimplemented);
  ModelConfig moe = Base();
  moe.moe = true;
  Tensors mlp = QV();
  mlp.Add(0, "up_proj", 4, 64, 128);
  auto on_moe = LoraAdapter::Load(
      Write(dir, "moe", Config({{"target_modules", {"q_proj", "v_proj", "up_proj"}}}), mlp), moe);
  EXPECT_NE(on_moe.status().message().find("mixture-of-experts"), std::string::npos)
      << on_moe.status();
  // Bounds: the file's size, and a missing or broken config.
  LoraLimits tight;
  tight.max_bytes = 1000;
  EXPECT_NE(LoraAdapter::Load(Write(dir, "big", Config(), QV()), Base(), tight)
                .status()
                .message()
                .find("at most 1000"),
            std::string::npos);
  EXPECT_EQ(LoraAdapter::Load(dir.Sub("nowhere"), Base()).status().code(),
            absl::StatusCode::kNotFound);
}

// Bytes of any kind in adapter_config.json: an error, never a crash.
TEST(Lora, ArbitraryConfigBytesAreAnError) {
  TempDir dir;
  const std::string path = Write(dir, "fuzz", Config(), QV());
  std::mt19937 rng(5);
  const std::string good = Config().dump();
  for (int round = 0; round < 300; ++round) {
    std::string text = good;
    for (int k = 0; k < 1 + round % 8; ++k) {
      text[rng() % text.size()] = static_cast<char>(rng() % 256);
    }
    if (round % 50 == 0) text = text.substr(0, rng() % text.size());
    WriteFile(path + "/adapter_config.json", text);
    (void)LoraAdapter::Load(path, Base());  // ok or an error; it returns
  }
}

}  // namespace
}  // namespace shardserve
