// Fine-grained FP8 checkpoints: E4M3 values, the expansion of a rank's slice with its block
// scales, and what a directory or config gets when it is wrong.
#include "model/fp8.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>

#include "backend/cpu/kernels.h"
#include "devtools/gen_model.h"
#include "model/config.h"
#include "model/generator.h"
#include "model/test_models.h"
#include "model/transformer.h"

namespace shardserve {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

TEST(Fp8Test, EveryE4M3ValueEncodesBackToItsByte) {
  int finite = 0;
  for (int c = 0; c < 256; ++c) {
    const float v = F8E4M3ToF32(static_cast<uint8_t>(c));
    if (std::isnan(v)) {
      EXPECT_TRUE(c == 0x7F || c == 0xFF) << c;
      continue;
    }
    ++finite;
    EXPECT_EQ(F32ToF8E4M3(v), c) << v;
  }
  EXPECT_EQ(finite, 254);
  EXPECT_EQ(F8E4M3ToF32(0x38), 1.0f);
  EXPECT_EQ(F8E4M3ToF32(0x7E), 448.0f);
  EXPECT_EQ(F8E4M3ToF32(0x01), std::ldexp(1.0f, -9));  // the least subnormal
  EXPECT_EQ(F8E4M3ToF32(0x08), std::ldexp(1.0f, -6));  // the least normal
  EXPECT_EQ(F8E4M3ToF32(0xB8), -1.0f);
}

TEST(Fp8Test, EncodingRoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(F32ToF8E4M3(1.0625f), 0x38);  // halfway between 1 and 1.125: to the even 1
  EXPECT_EQ(F32ToF8E4M3(1.1875f), 0x3A);  // halfway between 1.125 and 1.25: to the even 1.25
  EXPECT_EQ(F32ToF8E4M3(1.07f), 0x39);
  EXPECT_EQ(F32ToF8E4M3(15.5f), 0x58);  // halfway between 15 (0x57) and 16: to the even 16
  EXPECT_EQ(F32ToF8E4M3(std::ldexp(1.0f, -10)), 0x00);  // half the least subnormal: to 0
  EXPECT_EQ(F32ToF8E4M3(std::ldexp(3.0f, -10)), 0x02);  // 1.5 subnormal units: to 2
  EXPECT_EQ(F32ToF8E4M3(1e6f), 0x7E);
  EXPECT_EQ(F32ToF8E4M3(-1e6f), 0xFE);
  EXPECT_EQ(F32ToF8E4M3(std::nanf("")), 0x7F);
}

// A 5 x 7 FP8 weight in blocks of 4 x 4 (a 2 x 2 grid of scales, the last blocks partial).
struct Weight {
  std::vector<uint8_t> q;
  std::vector<float> scales{0.5f, 2.0f, -0.25f, 3.0f};
  TensorView w, s;
  Weight() {
    for (int i = 0; i < 35; ++i) q.push_back(static_cast<uint8_t>((i * 37 + 11) % 0x7E));
    s = {"w.weight_scale_inv", "f", DType::kF32, {2, 2}, scales.data(), 16};
    w = {"w.weight", "f", DType::kF8E4M3, {5, 7}, q.data(), 35};
    w.scale = &s;
  }
  float Value(int r, int c) const {
    return F8E4M3ToF32(q[r * 7 + c]) * scales[(r / 4) * 2 + c / 4];
  }
};

TEST(Fp8Test, ASliceExpandsWithItsBlocksScales) {
  Weight m;
  std::vector<float> f32(4 * 5);
  ASSERT_TRUE(
      ExpandFp8(m.w, {4, 4}, 1, 5, 2, 7, DType::kF32, reinterpret_cast<uint8_t*>(f32.data())).ok());
  std::vector<uint16_t> bf16(4 * 5);
  ASSERT_TRUE(
      ExpandFp8(m.w, {4, 4}, 1, 5, 2, 7, DType::kBF16, reinterpret_cast<uint8_t*>(bf16.data()))
          .ok());
  for (int r = 1; r < 5; ++r) {
    for (int c = 2; c < 7; ++c) {
      const int i = (r - 1) * 5 + (c - 2);
      EXPECT_EQ(f32[i], m.Value(r, c)) << r << "," << c;
      EXPECT_EQ(bf16[i], F32ToBf16(m.Value(r, c))) << r << "," << c;  // rounded once
    }
  }
}

TEST(Fp8Test, BadScalesAndNaNsAreNamed) {
  Weight m;
  uint8_t out[35 * 4];
  absl::Status grid = ExpandFp8(m.w, {2, 4}, 0, 5, 0, 7, DType::kF32, out);
  EXPECT_THAT(grid.message(), HasSubstr("tensor 'w.weight_scale_inv' has shape [2,2]; the [5,7] "
                                        "weight in blocks of 2x4 (quantization_config."
                                        "weight_block_size) needs [3,2]"));
  m.q[2 * 7 + 3] = 0xFF;
  absl::Status nan = ExpandFp8(m.w, {4, 4}, 0, 5, 0, 7, DType::kF32, out);
  EXPECT_EQ(nan.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(nan.message(), HasSubstr("tensor 'w.weight' holds a NaN (E4M3 0xff) at row 2, "
                                       "column 3"));
  // Rows past the NaN expand: only what a rank reads is checked.
  EXPECT_TRUE(ExpandFp8(m.w, {4, 4}, 3, 5, 0, 7, DType::kF32, out).ok());
  m.scales[3] = INFINITY;
  EXPECT_THAT(ExpandFp8(m.w, {4, 4}, 4, 5, 0, 7, DType::kF32, out).message(),
              HasSubstr("tensor 'w.weight_scale_inv' holds a scale that is not finite"));
}

// A 3 x 384 weight in blocks of 2 x 128 (a 2 x 3 grid of scales): a slice of rows 1-2 and
// columns [128, 384) packs into blocks of an F32 scale and 128 bytes, the values the expansion's.
TEST(Fp8Test, ASlicePacksIntoBlocksOf128WithTheirScales) {
  std::vector<uint8_t> q(3 * 384);
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<uint8_t>((i * 37 + 11) % 0x7E);
  std::vector<float> scales{0.5f, 2.0f, -0.25f, 3.0f, 0.125f, 7.0f};
  TensorView s{"w.weight_scale_inv", "f", DType::kF32, {2, 3}, scales.data(), 24};
  TensorView w{"w.weight", "f", DType::kF8E4M3, {3, 384}, q.data(), 3 * 384};
  w.scale = &s;
  EXPECT_TRUE(Fp8Packs({2, 128}, 128, 384));
  EXPECT_TRUE(Fp8Packs({128, 256}, 0, 512));
  EXPECT_TRUE(Fp8Packs({0, 0}, 0, 128));      // one scale per tensor
  EXPECT_FALSE(Fp8Packs({128, 64}, 0, 128));  // two scales in a group
  EXPECT_FALSE(Fp8Packs({128, 128}, 64, 192));
  EXPECT_FALSE(Fp8Packs({128, 128}, 0, 96));
  std::vector<uint8_t> packed(2 * DTypeBytes(DType::kF8_128, 256));
  ASSERT_TRUE(PackFp8(w, {2, 128}, 1, 3, 128, 384, packed.data()).ok());
  std::vector<float> want(2 * 256), got(256);
  ASSERT_TRUE(
      ExpandFp8(w, {2, 128}, 1, 3, 128, 384, DType::kF32, reinterpret_cast<uint8_t*>(want.data()))
          .ok());
  for (int r = 0; r < 2; ++r) {
    const uint8_t* row = packed.data() + r * DTypeBytes(DType::kF8_128, 256);
    float first_scale;
    std::memcpy(&first_scale, row, 4);
    EXPECT_EQ(first_scale, scales[(r + 1) / 2 * 3 + 1]) << r;
    EXPECT_EQ(row[4], q[(r + 1) * 384 + 128]) << r;
    cpu::ToFloat(DType::kF8_128, row, 256, got.data());
    for (int c = 0; c < 256; ++c) EXPECT_EQ(got[c], want[r * 256 + c]) << r << "," << c;
  }
  EXPECT_THAT(PackFp8(w, {2, 128}, 0, 3, 64, 320, packed.data()).message(),
              HasSubstr("columns [64, 320) of tensor 'w.weight' do not fall in groups of 128 "
                        "under one scale each"));
  q[2 * 384 + 300] = 0x7F;
  EXPECT_THAT(PackFp8(w, {2, 128}, 1, 3, 128, 384, packed.data()).message(),
              HasSubstr("tensor 'w.weight' holds a NaN (E4M3 0x7f) at row 2, column 300"));
  scales[5] = 2e36f;  // finite, but not times 256
  EXPECT_THAT(PackFp8(w, {2, 128}, 0, 3, 256, 384, packed.data()).message(),
              HasSubstr("tensor 'w.weight' has a scale of 2e+36 (for row 2, column 256): FP8 "
                        "computes with scales of magnitude up to 1.3e36"));
  scales[5] = NAN;
  EXPECT_THAT(PackFp8(w, {2, 128}, 0, 3, 256, 384, packed.data()).message(),
              HasSubstr("tensor 'w.weight_scale_inv' holds a scale that is not finite"));
}

// weight_block_size null: one scale, shape [] (as transformers' FP8Linear keeps it) or [1].
TEST(Fp8Test, OneScalePerTensorExpandsAndPacks) {
  std::vector<uint8_t> q(2 * 128);
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<uint8_t>(i % 0x7E);
  float scale = 0.375f;
  TensorView s{"w.weight_scale_inv", "f", DType::kF32, {}, &scale, 4};
  TensorView w{"w.weight", "f", DType::kF8E4M3, {2, 128}, q.data(), 256};
  w.scale = &s;
  std::vector<float> f32(256);
  ASSERT_TRUE(
      ExpandFp8(w, {0, 0}, 0, 2, 0, 128, DType::kF32, reinterpret_cast<uint8_t*>(f32.data())).ok());
  for (int i = 0; i < 256; ++i) EXPECT_EQ(f32[i], F8E4M3ToF32(q[i]) * scale) << i;
  std::vector<uint8_t> packed(2 * 132);
  ASSERT_TRUE(PackFp8(w, {0, 0}, 0, 2, 0, 128, packed.data()).ok());
  EXPECT_EQ(std::memcmp(packed.data() + 132, &scale, 4), 0);
  s.shape = {1};
  EXPECT_TRUE(PackFp8(w, {0, 0}, 0, 2, 0, 128, packed.data()).ok());
  s.shape = {1, 2};
  EXPECT_THAT(PackFp8(w, {0, 0}, 0, 2, 0, 128, packed.data()).message(),
              HasSubstr("tensor 'w.weight_scale_inv' has shape [1,2]; with one scale per tensor "
                        "(quantization_config.weight_block_size null) it is [] or [1]"));
}

class Fp8ModelTest : public ::testing::Test {
 protected:
  std::string Write() {
    auto o = testing::SmallModel("llama", dir_.Sub("m"));
    o.fp8_block = 32;
    return testing::WriteModel(o);
  }
  void EditConfig(const std::function<void(json&)>& edit) {
    const std::string path = dir_.Sub("m/config.json");
    json c = json::parse(testing::ReadFile(path));
    edit(c);
    testing::WriteFile(path, c.dump());
  }
  std::string LoadError() {
    auto m = Transformer::Load(dir_.Sub("m"), {});
    EXPECT_FALSE(m.ok());
    return m.ok() ? "" : std::string(m.status().message());
  }
  testing::TempDir dir_;
};

// The same model in FP8 and expanded by hand into F32 safetensors gives the same tokens and the
// same log-probabilities, bit for bit: with blocks of 32 (expanded at load), of 128 and one scale
// per tensor (computed in FP8, as DType::kF8_128: about a byte a weight, checked by the shard's
// bytes against the expanded load's), decode and a prefill long enough for the CPU's GEMM.
class Fp8ExpansionTest : public Fp8ModelTest, public ::testing::WithParamInterface<int64_t> {};

TEST_P(Fp8ExpansionTest, LoadsAsTheModelItsExpansionIs) {
  const int64_t block = GetParam();
  auto o = testing::SmallModel("llama", dir_.Sub("m"));
  o.fp8_block = block;
  if (block != 32) {  // columns in groups of 128
    o.hidden = 128;
    o.intermediate = 256;
  }
  testing::WriteModel(o);
  auto fp8 = Transformer::Load(dir_.Sub("m"), {});
  ASSERT_TRUE(fp8.ok()) << fp8.status();
  const Fp8Blocks blocks =
      block == GenModelOptions::kFp8PerTensor ? Fp8Blocks{0, 0} : Fp8Blocks{block, block};
  auto store = WeightStore::Open(dir_.Sub("m"));
  ASSERT_TRUE(store.ok());
  std::vector<TensorSpec> specs;
  std::vector<std::vector<uint8_t>> data;
  size_t fp8_values = 0;
  for (const auto& [name, t] : (*store)->tensors()) {
    if (name.ends_with("_scale_inv")) continue;
    std::vector<uint8_t> bytes(t.numel() * 4);
    if (t.dtype == DType::kF8E4M3) {
      ASSERT_TRUE(
          ExpandFp8(t, blocks, 0, t.shape[0], 0, t.shape[1], DType::kF32, bytes.data()).ok());
      fp8_values += t.numel();
    } else {
      ASSERT_EQ(t.dtype, DType::kF32);
      std::memcpy(bytes.data(), t.data, bytes.size());
    }
    specs.push_back({name, DType::kF32, t.shape});
    data.push_back(std::move(bytes));
  }
  // The shard keeps FP8 weights in 132 bytes a 128 (or, expanded, 4 a value).
  const bool computes_fp8 = block != 32;
  {
    Transformer::Options expand;
    expand.fp8_blocks = false;
    auto expanded = Transformer::Load(dir_.Sub("m"), expand);
    ASSERT_TRUE(expanded.ok()) << expanded.status();
    const size_t saved = computes_fp8 ? fp8_values * 4 - fp8_values / 128 * 132 : 0;
    EXPECT_EQ((*fp8)->shard_weight_bytes() + saved, (*expanded)->shard_weight_bytes());
  }
  std::filesystem::create_directories(dir_.Sub("plain"));
  for (const char* f : {"config.json", "tokenizer.json", "tokenizer_config.json"}) {
    std::filesystem::copy_file(dir_.Sub(std::string("m/") + f),
                               dir_.Sub(std::string("plain/") + f));
  }
  ASSERT_TRUE(WriteSafetensors(dir_.Sub("plain/model.safetensors"), specs,
                               [&](size_t i, std::vector<uint8_t>& b) { b = data[i]; })
                  .ok());
  json c = json::parse(testing::ReadFile(dir_.Sub("plain/config.json")));
  c.erase("quantization_config");
  testing::WriteFile(dir_.Sub("plain/config.json"), c.dump());
  auto plain = Transformer::Load(dir_.Sub("plain"), {});
  ASSERT_TRUE(plain.ok()) << plain.status();
  GenerationRequest req;
  req.prompt_ids = {1, 17, 42, 300, 7};
  for (int i = 0; i < 20; ++i) req.prompt_ids.push_back(3 + 11 * i);  // past 12 rows: the GEMM
  req.params.max_tokens = 5;
  req.params.ignore_eos = true;
  auto a = Generate(**fp8, {req}), b = Generate(**plain, {req});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ((*a)[0].tokens, (*b)[0].tokens);
  EXPECT_EQ((*a)[0].logprobs, (*b)[0].logprobs);
}

INSTANTIATE_TEST_SUITE_P(Blocks, Fp8ExpansionTest,
                         ::testing::Values(int64_t{32}, int64_t{128},
                                           GenModelOptions::kFp8PerTensor));

TEST_F(Fp8ModelTest, WhatIsMissingOrNotLoadedIsNamed) {
  Write();
  EditConfig([](json& c) { c["quantization_config"]["quant_method"] = "gptq"; });
  EXPECT_THAT(LoadError(),
              HasSubstr("quantization_config: 'quant_method' 'gptq' does not load in "
                        "shardserve (fine-grained FP8, fp8, does; mxfp4 for gpt-oss; fbgemm_fp8 is "
                        "planned for)"));
  EditConfig([](json& c) {
    c["quantization_config"]["quant_method"] = "fp8";
    c["quantization_config"]["activation_scheme"] = "static";
  });
  EXPECT_THAT(LoadError(), HasSubstr("'activation_scheme' 'static' is not dynamic"));
  EditConfig([](json& c) {
    c["quantization_config"]["activation_scheme"] = "dynamic";
    c["quantization_config"]["weight_block_size"] = {128};
  });
  EXPECT_THAT(LoadError(), HasSubstr("'weight_block_size' must be two integers"));
  EditConfig([](json& c) { c["quantization_config"]["weight_block_size"] = {16, 16}; });
  EXPECT_THAT(LoadError(), HasSubstr("tensor 'model.layers.0.self_attn.q_proj.weight_scale_inv' "
                                     "has shape [2,2]; the [64,64] weight in blocks of 16x16 "
                                     "(quantization_config.weight_block_size) needs [4,4]"));
  EditConfig([](json& c) {
    c["quantization_config"]["weight_block_size"] = {32, 32};
    c["torch_dtype"] = "float64";
  });
  EXPECT_THAT(LoadError(),
              HasSubstr("'torch_dtype' 'float64' is not bfloat16, float16 or float32"));
  EditConfig([](json& c) {
    c.erase("quantization_config");
    c["torch_dtype"] = "float32";
  });
  EXPECT_THAT(LoadError(), HasSubstr("is F8_E4M3 but config.json has no quantization_config"));
}

TEST_F(Fp8ModelTest, AWeightWithoutItsScalesIsRefused) {
  Write();
  testing::RemoveTensor(dir_.Sub("m/model.safetensors"),
                        "model.layers.1.self_attn.k_proj.weight_scale_inv");
  EXPECT_THAT(LoadError(), HasSubstr("tensor 'model.layers.1.self_attn.k_proj.weight' is F8_E4M3 "
                                     "but its scales, 'model.layers.1.self_attn.k_proj.weight_"
                                     "scale_inv', are not in the model"));
}

// Scales beside a weight that is not FP8 would be ignored: refused instead.
TEST_F(Fp8ModelTest, ScalesOfAWeightThatIsNotFp8AreRefused) {
  auto o = testing::SmallModel("llama", dir_.Sub("m"));
  testing::WriteModel(o);
  o.out_dir = dir_.Sub("q");
  o.fp8_block = 32;
  testing::WriteModel(o);
  // The plain model's file, plus one FP8 model's scales.
  std::vector<TensorSpec> specs;
  std::vector<std::vector<uint8_t>> data;
  for (const char* d : {"m", "q"}) {
    auto f = SafetensorsFile::Open(dir_.Sub(std::string(d) + "/model.safetensors"));
    ASSERT_TRUE(f.ok());
    for (const auto& [name, t] : (*f)->tensors()) {
      if ((d[0] == 'q') != (name == "model.layers.0.mlp.up_proj.weight_scale_inv")) continue;
      specs.push_back({name, t.dtype, t.shape});
      const auto* p = static_cast<const uint8_t*>(t.data);
      data.emplace_back(p, p + t.nbytes);
    }
  }
  ASSERT_TRUE(WriteSafetensors(dir_.Sub("m/model.safetensors"), specs,
                               [&](size_t i, std::vector<uint8_t>& b) { b = data[i]; })
                  .ok());
  EXPECT_THAT(LoadError(), HasSubstr("tensor 'model.layers.0.mlp.up_proj.weight_scale_inv' scales "
                                     "'model.layers.0.mlp.up_proj.weight', which is F32, not "
                                     "F8_E4M3"));
}

}  // namespace
}  // namespace shardserve
