#include "plan/memory.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/text.h"
#include "devtools/gguf_convert.h"
#include "model/footprint.h"
#include "model/test_models.h"

namespace shardserve {
namespace {

using ::testing::HasSubstr;

constexpr double kGiB = 1024.0 * 1024 * 1024;

std::string Why(const absl::Status& s) { return std::string(s.message()); }

ModelFootprint Example(const std::string& name) {
  const std::string path = std::string(SHARDSERVE_SOURCE_DIR) + "/examples/plan/" + name;
  auto f = LoadFootprint(path);
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? *f : ModelFootprint{};
}

// The parameter counts their makers publish, from the configs alone.
TEST(FootprintTest, TheLargeModelsCountTheirPublishedParameters) {
  EXPECT_NEAR(Example("deepseek-v3").params / 1e9, 671, 1.5);  // 685 B with the MTP layer
  EXPECT_NEAR(Example("qwen3-235b-a22b").params / 1e9, 235, 1.5);
  EXPECT_NEAR(Example("llama-3.1-405b-fp8").params / 1e9, 405.9, 1.0);
  EXPECT_NEAR(Example("gpt-oss-120b").params / 1e9, 116.8, 0.5);
}

TEST(FootprintTest, WeightBytesFollowTheCheckpointsFormat) {
  auto total = [](const ModelFootprint& f) {
    return MemoryOfStage(f, {0, f.layers}, 1, 0).weights / 1e9;
  };
  // DeepSeek-V3 in FP8 blocks, computed in FP8: 132 bytes a 128 values for its linear weights;
  // BF16 for the embeddings, head and norms and for the per-head q_b and kv_b projections (3.3 B
  // weights, expanded at load for the per-head products).
  const ModelFootprint ds = Example("deepseek-v3");
  EXPECT_NEAR(total(ds), 696.2, 1);
  EXPECT_THAT(ds.weights, HasSubstr("128x128 block), computed in FP8 (an F32 scale per 128"));
  EXPECT_THAT(ds.notes.front(), HasSubstr("multi-token-prediction"));
  // gpt-oss-120b: MXFP4 experts (65 GB as published) held as BF16 (expanded at load).
  const ModelFootprint g = Example("gpt-oss-120b");
  EXPECT_NEAR(total(g), 2 * 116.8, 2);
  EXPECT_THAT(g.weights,
              HasSubstr("MXFP4 experts (4.25 bits a weight in the files), held as BF16"));
  // Qwen3-235B in BF16: two bytes a weight.
  EXPECT_NEAR(total(Example("qwen3-235b-a22b")), 2 * 235, 3);
  // Llama-3.1-405B FP8: FFNs FP8 per row, attention and the first and last layers' MLPs BF16.
  // 124 FFNs x 2.617 B in FP8 (324.5 GB), 126 attentions x 0.570 B and 2 FFNs in BF16 (154.2
  // GB), embeddings and head in BF16 (8.4 GB).
  EXPECT_NEAR(total(Example("llama-3.1-405b-fp8")), 487.2, 1);
}

TEST(FootprintTest, MlaCachesItsLatentWholeOnEveryRank) {
  const ModelFootprint ds = Example("deepseek-v3");
  ASSERT_EQ(ds.kinds.size(), 2u);  // 3 dense layers, then 58 MoE layers
  EXPECT_EQ(ds.kinds[0].count, 3);
  EXPECT_EQ(ds.kinds[1].count, 58);
  // 512 latent + 64 rope values a position, whatever the tensor-parallel size.
  EXPECT_EQ(ds.KvValuesPerRank(ds.kinds[1], 1), 576);
  EXPECT_EQ(ds.KvValuesPerRank(ds.kinds[1], 8), 576);
  // Kept in the model's dtype (kvCacheDtype auto), or as a spec says.
  EXPECT_EQ(KvBytesLine(ds),
            "KV cache: 1152 bytes a position per layer (BF16, the compressed latent every rank "
            "keeps), against 81920 for full heads (71.1x)");
  ModelFootprint f32 = ds;
  UseKvCacheDtype(f32, "f32");
  EXPECT_EQ(KvBytesLine(f32),
            "KV cache: 2304 bytes a position per layer (F32, the compressed latent every rank "
            "keeps), against 163840 for full heads (71.1x)");
  ModelFootprint fp8 = ds;
  UseKvCacheDtype(fp8, "fp8");
  UseKvCacheDtype(fp8, "auto");  // auto keeps what the footprint holds
  EXPECT_EQ(fp8.KvValueBytes(), 1);
  // The footprint's report carries it; one without it (of before) held F32.
  auto back = FootprintFromJson(FootprintToJson(fp8));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->kv_dtype, "fp8");
  nlohmann::json old = FootprintToJson(fp8);
  old.erase("kvDtype");
  EXPECT_EQ(FootprintFromJson(old)->kv_dtype, "f32");
  old["kvDtype"] = "int4";
  EXPECT_THAT(FootprintFromJson(old).status().message(), HasSubstr("'kvDtype' is 'int4'"));
  // GQA: a group larger than the KV heads replicates them.
  const ModelFootprint qwen = Example("qwen3-235b-a22b");
  EXPECT_EQ(qwen.KvValuesPerRank(qwen.kinds[0], 2), 2 * 2 * 128);
  EXPECT_EQ(qwen.KvValuesPerRank(qwen.kinds[0], 8), 1 * 2 * 128);
}

// DeepSeek-V3's multi-token-prediction layer (14 B parameters as published: 685 B with it):
// counted on the last stage under speculative method mtp only, its KV cache too.
TEST(FootprintTest, TheMtpLayerIsCountedWhenSpeculationLoadsIt) {
  const ModelFootprint ds = Example("deepseek-v3");
  ASSERT_EQ(ds.mtp.count, 1);
  const LayerRange last{58, 61};
  const StageMemory without = MemoryOfStage(ds, last, 8, 4096);
  ModelFootprint mtp = ds;
  UseSpeculativeMethod(mtp, "ngram");
  EXPECT_EQ(MemoryOfStage(mtp, last, 8, 4096).total(), without.total());
  UseSpeculativeMethod(mtp, "mtp");
  const StageMemory with = MemoryOfStage(mtp, last, 8, 4096);
  // A MoE layer (11.6 B parameters, FP8 blocks: 11.8 GB), its embedding and head (2 x 0.93 B,
  // BF16: 3.7 GB) and eh_proj (0.1 B, FP8) over 8 ranks: 1.95 GB a rank.
  EXPECT_NEAR((with.weights - without.weights) / 1e9, 1.95, 0.05);
  // One layer's latent more: 576 values a position in BF16.
  EXPECT_NEAR(with.kv_cache - without.kv_cache, 576 * 2 * 4096, 1);
  // Only the last stage holds it.
  EXPECT_EQ(MemoryOfStage(mtp, {0, 30}, 8, 4096).total(),
            MemoryOfStage(ds, {0, 30}, 8, 4096).total());
  // The plan of a spec counts it; the footprint's report carries it (one of before has none).
  ShardedModelSpec spec;
  spec.tensor = 8;
  spec.pipeline = 2;
  spec.max_batch_size = 1;
  spec.max_sequence_length = 4096;
  auto plain = PlanSpec(ds, spec, {});
  spec.speculative_method = "mtp";
  auto speculating = PlanSpec(ds, spec, {});
  ASSERT_TRUE(plain.ok() && speculating.ok());
  EXPECT_GT(speculating->choice.stages[1].weights, plain->choice.stages[1].weights + 1e9);
  EXPECT_EQ(speculating->choice.stages[0].weights, plain->choice.stages[0].weights);
  auto back = FootprintFromJson(FootprintToJson(ds));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->mtp.count, 1);
  EXPECT_NEAR(back->mtp.split_bytes, ds.mtp.split_bytes, 1);
  nlohmann::json old = FootprintToJson(ds);
  old.erase("mtp");
  EXPECT_EQ(FootprintFromJson(old)->mtp.count, 0);
  old["mtp"] = nlohmann::json::array();
  EXPECT_THAT(Why(FootprintFromJson(old).status()), HasSubstr("'mtp' is not an object"));
  EXPECT_EQ(Example("qwen3-235b-a22b").mtp.count, 0);
}

TEST(FootprintTest, ItsJsonRoundTripsAndIsBounded) {
  const ModelFootprint ds = Example("deepseek-v3");
  auto back = FootprintFromJson(FootprintToJson(ds));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->kinds.size(), ds.kinds.size());
  EXPECT_EQ(back->shape, ds.shape);
  EXPECT_NEAR(MemoryOfStage(*back, {0, 30}, 8, 4096).total(),
              MemoryOfStage(ds, {0, 30}, 8, 4096).total(), 1e3);
  nlohmann::json j = FootprintToJson(ds);
  j["kinds"][0]["count"] = 4;
  EXPECT_THAT(Why(FootprintFromJson(j).status()), HasSubstr("count 62 layers, not 61"));
  j = FootprintToJson(ds);
  j["embedBytes"] = -1;
  EXPECT_THAT(Why(FootprintFromJson(j).status()), HasSubstr("'embedBytes' is -1"));
  EXPECT_THAT(Why(FootprintFromJson(nlohmann::json::array()).status()),
              HasSubstr("not a JSON object"));
}

// A GGUF file: its shape from the metadata, its weights at the file's bytes per parameter.
TEST(FootprintTest, AGgufFileWeighsWhatItHolds) {
  testing::TempDir dir;
  const std::string hf = testing::WriteModel(testing::SmallModel("llama", dir.Sub("hf")));
  const std::string file = dir.Sub("m.gguf");
  ASSERT_TRUE(ConvertToGguf(hf, file, DType::kQ8_0).ok());
  auto want = LoadFootprint(hf);
  auto got = LoadFootprint(file);
  ASSERT_TRUE(want.ok() && got.ok()) << got.status();
  EXPECT_EQ(got->params, want->params);
  EXPECT_EQ(got->shape, want->shape);
  EXPECT_THAT(got->weights, HasSubstr("GGUF, "));
  EXPECT_NEAR(MemoryOfStage(*got, {0, got->layers}, 1, 0).weights,
              static_cast<double>(std::filesystem::file_size(file)), 1.0);
}

TEST(FootprintTest, ConfigErrorsNameTheKey) {
  EXPECT_THAT(Why(FootprintFromConfig(R"({"architectures": ["FooForCausalLM"]})").status()),
              HasSubstr("'FooForCausalLM', which shardserve does not run"));
  EXPECT_THAT(Why(FootprintFromConfig(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
      "num_hidden_layers": 2, "vocab_size": 10, "num_attention_heads": 4, "intermediate_size": 8,
      "quantization_config": {"quant_method": "gptq"}})")
                      .status()),
              HasSubstr("'gptq' does not load in shardserve"));
  EXPECT_THAT(Why(FootprintFromConfig("{").status()), HasSubstr("not valid JSON"));
  std::string qwen = ReadFileToString(std::string(SHARDSERVE_SOURCE_DIR) +
                                      "/examples/plan/qwen3-235b-a22b/config.json")
                         .value();
  qwen.replace(qwen.find("\"mlp_only_layers\": []"), 21, "\"mlp_only_layers\": [0]");
  EXPECT_THAT(Why(FootprintFromConfig(qwen).status()),
              HasSubstr("'mlp_only_layers' dense layers in a Qwen3-MoE model are not supported"));
}

// The plan reads config.json through the runtime's reader (DescribeModelConfig): a field the
// runtime defaults is the plan's default too (gpt-oss's attention biases are on unless the config
// says otherwise, as transformers' GptOssConfig has them), and a format the runtime does not load
// yet is planned for while the runtime refuses it by name.
TEST(FootprintTest, ThePlanReadsConfigsAsTheRuntimeDoes) {
  const std::string dir = std::string(SHARDSERVE_SOURCE_DIR) + "/examples/plan/";
  nlohmann::json oss =
      nlohmann::json::parse(ReadFileToString(dir + "gpt-oss-120b/config.json").value());
  ASSERT_EQ(oss["attention_bias"], true);
  const ModelFootprint with = FootprintFromConfig(oss.dump()).value();
  oss.erase("attention_bias");
  auto without = FootprintFromConfig(oss.dump());
  ASSERT_TRUE(without.ok()) << without.status();
  EXPECT_EQ(without->params, with.params);
  EXPECT_TRUE(ParseModelConfig(oss.dump())->o_bias);

  const std::string fbgemm = ReadFileToString(dir + "llama-3.1-405b-fp8/config.json").value();
  auto runs = ParseModelConfig(fbgemm);
  ASSERT_FALSE(runs.ok());
  EXPECT_THAT(Why(runs.status()), HasSubstr("'fbgemm_fp8' (FP8 with a scale per output row) does "
                                            "not load in shardserve yet"));
  auto is = DescribeModelConfig(fbgemm);
  ASSERT_TRUE(is.ok()) << is.status();
  EXPECT_EQ(is->weights, WeightFormat::kFp8PerRow);
  EXPECT_FALSE(is->keep_modules.empty());
  EXPECT_EQ(is->not_loaded, std::string(runs.status().message()));
  auto planned = FootprintFromConfig(fbgemm);
  ASSERT_TRUE(planned.ok()) << planned.status();
  EXPECT_THAT(planned->weights, HasSubstr("with an F32 scale per row"));
}

TEST(MemoryTest, AStageHoldsItsLayersShareAndTheEndsTheirs) {
  const ModelFootprint q = Example("qwen3-235b-a22b");
  auto plan = PlanMemory(q, 8, 2, 32 * 4096);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->stages.size(), 2u);
  const StageMemory& s0 = plan->stages[0];
  // Half the weights over 8 GPUs, about 29 GB, plus the embedding's share.
  EXPECT_NEAR(s0.weights / 1e9, 470.0 / 2 / 8, 2);
  // Its layers x 1 KV head x 256 values x 2 bytes (BF16, the model's) x 131072 positions.
  const double layers = static_cast<double>(plan->layers[0].end);
  EXPECT_NEAR(s0.kv_cache, layers * 256 * 2 * 32 * 4096, 1);
  // FP8 halves it again; PlanSpec counts the spec's kvCacheDtype.
  ModelFootprint fp8 = q;
  UseKvCacheDtype(fp8, "fp8");
  EXPECT_NEAR(PlanMemory(fp8, 8, 2, 32 * 4096)->stages[0].kv_cache, layers * 256 * 32 * 4096, 1);
  ShardedModelSpec spec;
  spec.tensor = 8;
  spec.pipeline = 2;
  spec.max_batch_size = 32;
  spec.max_sequence_length = 4096;
  spec.kv_cache_dtype = "f32";
  auto f32 = PlanSpec(q, spec, {});
  ASSERT_TRUE(f32.ok()) << f32.status();
  EXPECT_NEAR(f32->choice.stages[0].kv_cache, layers * 256 * 4 * 32 * 4096, 1);
  EXPECT_NEAR(s0.margin, kMarginBytes + 0.1 * (s0.weights + s0.kv_cache), 1);
  EXPECT_EQ(DescribeStage(0, 8, {80 * kGiB, 4 * kGiB, 9.4 * kGiB}),
            "stage 0 needs 93.4 GiB per GPU at TP=8 (weights 80.0, KV cache 4.0, margin 9.4)");
}

TEST(MemoryTest, DivisibilityErrorsNameTheField) {
  const ModelFootprint q = Example("qwen3-235b-a22b");
  EXPECT_THAT(Why(CheckTensorParallel(q, 3)),
              HasSubstr("num_attention_heads 64 is not divisible by tensor parallelism 3"));
  EXPECT_TRUE(CheckTensorParallel(q, 8).ok());  // 4 KV heads, each on 2 ranks
  const ModelFootprint g = Example("gpt-oss-120b");
  EXPECT_TRUE(CheckTensorParallel(g, 4).ok());
}

// What `tensor: auto, pipeline: auto` chooses on 8-GPU nodes of 80 and of 141 GB.
TEST(MemoryTest, AutoPicksTheSmallestTensorThenTheFewestStagesThatFit) {
  const std::vector<int64_t> four_nodes = {8, 8, 8, 8};
  const int64_t tokens = 32 * 4096;
  auto choose = [&](const std::string& name, double gib) {
    return ChooseParallelism(Example(name), std::nullopt, std::nullopt, four_nodes, gib * 1e9,
                             tokens);
  };
  // gpt-oss-120b (234 GB with its experts expanded): two GPUs of 141 GB, four of 80 GB.
  auto g141 = choose("gpt-oss-120b", 141);
  ASSERT_TRUE(g141.ok()) << g141.status();
  EXPECT_EQ(g141->tensor, 2);
  EXPECT_EQ(g141->pipeline, 1);
  auto g80 = choose("gpt-oss-120b", 80);
  ASSERT_TRUE(g80.ok()) << g80.status();
  EXPECT_EQ(g80->tensor, 4);
  // DeepSeek-V3 (696 GB, its FP8 computed as FP8; 1.34 TB were it expanded into BF16): one 8x141
  // node, two 8x80 nodes.
  auto d141 = choose("deepseek-v3", 141);
  ASSERT_TRUE(d141.ok()) << d141.status();
  EXPECT_EQ(d141->tensor, 8);
  EXPECT_EQ(d141->pipeline, 1);
  auto d80 = choose("deepseek-v3", 80);
  ASSERT_TRUE(d80.ok()) << d80.status();
  EXPECT_EQ(d80->tensor, 8);
  EXPECT_EQ(d80->pipeline, 2);
  for (const StageMemory& s : d80->stages) EXPECT_LE(s.total(), 80e9);
  // A fixed tensor size: only the stages are chosen.
  auto fixed =
      ChooseParallelism(Example("qwen3-235b-a22b"), 4, std::nullopt, four_nodes, 80e9, tokens);
  ASSERT_TRUE(fixed.ok()) << fixed.status();
  EXPECT_EQ(fixed->tensor, 4);
  EXPECT_EQ(fixed->pipeline, 2);
  // Nothing fits: the closest plan's numbers.
  auto none =
      ChooseParallelism(Example("deepseek-v3"), std::nullopt, std::nullopt, {8}, 80e9, tokens);
  EXPECT_THAT(
      Why(none.status()),
      ::testing::MatchesRegex("stage [0-9] needs [0-9.]+ GiB per GPU at TP=[0-9] .* with "
                              "[0-9] stages? \\(the closest .*\\); the nodes have 74.5 GiB"));
}

// Through the spec and the nodes, as the operator and `shardserve plan` use it: the sizes auto
// chooses, and where nothing fits, the least needy plan, which placement refuses with numbers.
TEST(MemoryTest, APlanThatCannotFitIsRefusedByPlacementWithItsNumbers) {
  ShardedModelSpec spec;
  spec.tensor_auto = spec.pipeline_auto = true;
  std::vector<NodeInfo> nodes;
  for (int i = 0; i < 2; ++i) {
    NodeInfo n;
    n.name = "n" + std::to_string(i);
    n.gpus = 8;
    n.gpu_memory = int64_t{81559} << 20;  // 80 GB
    nodes.push_back(n);
  }
  auto fits = PlanSpec(Example("gpt-oss-120b"), spec, nodes);
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(fits->choice.tensor, 4);
  EXPECT_EQ(fits->gpu_memory, int64_t{81559} << 20);
  auto placed = PlaceReplicas(MemoryAwareRequest(spec, *fits, {0}), nodes);
  ASSERT_TRUE(placed.ok());
  EXPECT_EQ(placed->placed.size(), 1u);

  auto too_big = PlanSpec(Example("deepseek-v3"), spec, {nodes[0]});  // one node of 8 x 80 GB
  ASSERT_TRUE(too_big.ok()) << too_big.status();
  EXPECT_GT(too_big->choice.largest, 80e9);
  auto refused = PlaceReplicas(MemoryAwareRequest(spec, *too_big, {0}), {nodes[0]});
  ASSERT_TRUE(refused.ok());
  ASSERT_EQ(refused->unplaced.size(), 1u);
  EXPECT_THAT(
      refused->unplaced[0],
      ::testing::MatchesRegex(".*1 with too little GPU memory: stage [0-9]+ needs [0-9.]+ GiB "
                              "per GPU at TP=[0-9]+ .*; they have 79.6 GiB\\)"));
  // A fixed tensor size wider than any node: the smallest plan, refused for want of GPUs.
  spec.tensor_auto = false;
  spec.tensor = 16;
  auto wide = PlanSpec(Example("gpt-oss-120b"), spec, nodes);
  ASSERT_TRUE(wide.ok()) << wide.status();
  EXPECT_EQ(wide->choice.tensor, 16);
  EXPECT_EQ(wide->choice.pipeline, 1);
  auto no_room = PlaceReplicas(MemoryAwareRequest(spec, *wide, {0}), nodes);
  ASSERT_TRUE(no_room.ok());
  EXPECT_THAT(no_room->unplaced[0], HasSubstr("needs 1 node with 16 free nvidia.com/gpu"));
  // A fixed size that the model cannot divide is an error naming the field.
  spec.tensor_auto = spec.pipeline_auto = false;
  spec.tensor = 3;
  EXPECT_THAT(Why(PlanSpec(Example("deepseek-v3"), spec, nodes).status()),
              HasSubstr("spec.parallelism.tensor 3: num_attention_heads 128 is not divisible"));
}

}  // namespace
}  // namespace shardserve
