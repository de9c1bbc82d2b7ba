#include "model/transformer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <tuple>

#include "backend/cpu/cpu_features.h"
#include "model/generator.h"
#include "model/test_models.h"

namespace shardserve {
namespace {

using ::testing::HasSubstr;

class TransformerTest : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<Transformer> Load(int threads = 2) {
    auto o = testing::SmallModel(GetParam(), dir_.Sub("m"));
    o.dtype = DType::kBF16;
    testing::WriteModel(o);
    auto m = Transformer::Load(dir_.Sub("m"), {threads});
    EXPECT_TRUE(m.ok()) << m.status();
    return std::move(*m);
  }
  testing::TempDir dir_;
};

// Decoding with the KV cache gives the logits of recomputing the whole sequence.
TEST_P(TransformerTest, IncrementalDecodeMatchesFullPrefill) {
  auto model = Load();
  const int64_t V = model->config().vocab_size;
  const std::vector<int32_t> seq = {1, 40, 7, 300, 12, 99, 5, 18, 250, 3};
  auto cache = *model->NewKvCache(64);
  SequenceKv inc;
  std::vector<SequenceChunk> chunks(1);
  chunks[0].kv = &inc;
  chunks[0].tokens.assign(seq.begin(), seq.begin() + 4);
  std::vector<float> logits;
  ASSERT_TRUE(model->Forward(chunks, *cache, logits).ok());
  for (size_t i = 4; i < seq.size(); ++i) {
    chunks[0].tokens = {seq[i]};
    ASSERT_TRUE(model->Forward(chunks, *cache, logits).ok());
  }
  EXPECT_EQ(inc.length, static_cast<int64_t>(seq.size()));
  SequenceKv full;
  chunks[0].kv = &full;
  chunks[0].tokens = seq;
  std::vector<float> full_logits;
  ASSERT_TRUE(model->Forward(chunks, *cache, full_logits).ok());
  for (int64_t v = 0; v < V; ++v) ASSERT_NEAR(logits[v], full_logits[v], 2e-4) << v;
}

// Sequences batched together get the tokens they get alone.
TEST_P(TransformerTest, BatchedGenerationEqualsSingle) {
  auto model = Load();
  std::vector<GenerationRequest> reqs(3);
  reqs[0].prompt_ids = {1, 2, 3};
  reqs[1].prompt_ids = {1, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140};
  reqs[2].prompt_ids = {7};
  for (auto& r : reqs) {
    r.params.max_tokens = 8;
    r.params.ignore_eos = true;
    r.params.top_logprobs = 2;
  }
  reqs[1].params.max_tokens = 3;  // finishes early: the batch shrinks mid-way
  auto batched = Generate(*model, reqs);
  ASSERT_TRUE(batched.ok()) << batched.status();
  for (size_t i = 0; i < reqs.size(); ++i) {
    auto single = Generate(*model, {reqs[i]});
    ASSERT_TRUE(single.ok());
    EXPECT_EQ((*batched)[i].tokens, (*single)[0].tokens) << "request " << i;
    ASSERT_EQ((*batched)[i].logprobs.size(), (*single)[0].logprobs.size());
    for (size_t t = 0; t < (*single)[0].logprobs.size(); ++t) {
      EXPECT_NEAR((*batched)[i].logprobs[t], (*single)[0].logprobs[t], 1e-4);
    }
    EXPECT_EQ((*batched)[i].finish_reason, "length");
  }
  EXPECT_EQ((*batched)[1].tokens.size(), 3u);
}

TEST_P(TransformerTest, ThreadCountDoesNotChangeTokens) {
  auto m1 = Load(1);
  GenerationRequest r;
  r.prompt_ids = {1, 9, 8, 7, 6, 5};
  r.params.max_tokens = 6;
  r.params.ignore_eos = true;
  auto a = Generate(*m1, {r});
  auto m3 = Transformer::Load(dir_.Sub("m"), {3});
  ASSERT_TRUE(m3.ok());
  auto b = Generate(**m3, {r});
  EXPECT_EQ((*a)[0].tokens, (*b)[0].tokens);
}

TEST_P(TransformerTest, StopTokensEndGeneration) {
  auto model = Load();
  GenerationRequest r;
  r.prompt_ids = {1, 4, 4};
  r.params.max_tokens = 10;
  r.params.ignore_eos = true;
  auto free_run = Generate(*model, {r});
  ASSERT_TRUE(free_run.ok());
  r.params.stop_token_ids = {(*free_run)[0].tokens[2]};
  auto stopped = Generate(*model, {r});
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ((*stopped)[0].finish_reason, "stop");
  EXPECT_LE((*stopped)[0].tokens.size(), 3u);
  EXPECT_EQ((*stopped)[0].tokens.back(), r.params.stop_token_ids[0]);
}

// Positions 0..255 exist: a 250-token prompt leaves 6 positions to feed sampled tokens back,
// so exactly 7 tokens come out and the reason is "length".
TEST_P(TransformerTest, GenerationStopsWhenTheContextIsFull) {
  auto model = Load();
  GenerationRequest r;
  r.prompt_ids.assign(250, 5);
  r.params.max_tokens = 50;
  r.params.ignore_eos = true;
  auto out = Generate(*model, {r});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)[0].tokens.size(), 7u);
  EXPECT_EQ((*out)[0].finish_reason, "length");
}

TEST_P(TransformerTest, BadRequestsAreRefusedWithoutTouchingTheCache) {
  auto model = Load();
  auto cache = *model->NewKvCache(32);
  SequenceKv kv;
  std::vector<SequenceChunk> chunks(1);
  chunks[0].kv = &kv;
  std::vector<float> logits;
  chunks[0].tokens = {1, 400};
  EXPECT_THAT(std::string(model->Forward(chunks, *cache, logits).message()),
              HasSubstr("token id 400 is outside the vocabulary [0, 400)"));
  chunks[0].tokens.assign(300, 1);
  EXPECT_THAT(std::string(model->Forward(chunks, *cache, logits).message()),
              HasSubstr("exceeds the model's context of 256"));
  chunks[0].tokens.assign(40, 1);
  auto status = model->Forward(chunks, *cache, logits);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_EQ(cache->free_blocks(), cache->num_blocks());
  EXPECT_EQ(kv.length, 0);
  GenerationRequest r;
  r.params.max_tokens = 0;
  r.prompt_ids = {1};
  EXPECT_THAT(std::string(Generate(*model, {r}).status().message()),
              HasSubstr("request 0: max_tokens must be >= 1"));
  r.params.max_tokens = 1;
  r.prompt_ids.clear();
  EXPECT_THAT(std::string(Generate(*model, {r}).status().message()), HasSubstr("prompt is empty"));
}

TEST_P(TransformerTest, ShardedFilesGiveTheSameModel) {
  auto model = Load();
  auto o = testing::SmallModel(GetParam(), dir_.Sub("sharded"));
  o.dtype = DType::kBF16;
  o.shard_bytes = 20000;
  testing::WriteModel(o);
  auto sharded = Transformer::Load(dir_.Sub("sharded"), {2});
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  GenerationRequest r;
  r.prompt_ids = {1, 30, 31};
  r.params.max_tokens = 5;
  r.params.ignore_eos = true;
  EXPECT_EQ((*Generate(*model, {r}))[0].tokens, (*Generate(**sharded, {r}))[0].tokens);
}

INSTANTIATE_TEST_SUITE_P(Archs, TransformerTest, ::testing::Values("llama", "qwen2", "mixtral"));

// The last logits of a prompt and three decoded tokens with the KV cache in `dtype`.
std::vector<float> LogitsWithKv(const std::string& dir, KvCacheDtype dtype, size_t* block_bytes) {
  Transformer::Options o;
  o.num_threads = 2;
  o.kv_cache_dtype = dtype;
  auto model = Transformer::Load(dir, o);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return {};
  *block_bytes = (*model)->kv_block_bytes();
  auto cache = *(*model)->NewKvCache(64);
  EXPECT_EQ(cache->storage()->block_bytes() * 2 * (*model)->config().num_layers,
            (*model)->kv_block_bytes());
  SequenceKv kv;
  std::vector<SequenceChunk> chunks(1);
  chunks[0].kv = &kv;
  chunks[0].tokens = {1, 40, 7, 300, 12, 99, 5, 18, 250, 3, 77, 8};
  std::vector<float> logits;
  EXPECT_TRUE((*model)->Forward(chunks, *cache, logits).ok());
  for (int32_t t : {11, 42, 9}) {
    chunks[0].tokens = {t};
    EXPECT_TRUE((*model)->Forward(chunks, *cache, logits).ok());
  }
  return logits;
}

// Each KV cache dtype: auto the model's (BF16 here), its bytes (half of F32's for BF16 and F16, a
// quarter for FP8) and logits near F32's (F16's as near as BF16's at the CPU kernel level that
// rounds BF16 weights' activations to BF16 anyway).
TEST(KvCacheDtypeTest, EachDtypeKeepsItsBytesAndNearlyTheLogits) {
  const double f16_bound = cpu::ActiveKernelLevel() == cpu::KernelLevel::kAvx512Bf16 ? 0.02 : 0.005;
  testing::TempDir dir;
  auto o = testing::SmallModel("llama", dir.Sub("m"));
  o.dtype = DType::kBF16;
  const std::string path = testing::WriteModel(o);
  size_t f32_bytes = 0, bytes = 0;
  const std::vector<float> want = LogitsWithKv(path, KvCacheDtype::kF32, &f32_bytes);
  ASSERT_FALSE(want.empty());
  for (const auto& [dtype, share, bound] :
       {std::tuple{KvCacheDtype::kAuto, 2, 0.02}, std::tuple{KvCacheDtype::kBF16, 2, 0.02},
        std::tuple{KvCacheDtype::kF16, 2, f16_bound}, std::tuple{KvCacheDtype::kFP8, 4, 0.2}}) {
    const std::vector<float> got = LogitsWithKv(path, dtype, &bytes);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(bytes * share, f32_bytes) << KvCacheDtypeName(dtype);
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i)
      worst = std::max<double>(worst, std::abs(got[i] - want[i]));
    EXPECT_LT(worst, bound) << KvCacheDtypeName(dtype);
    EXPECT_GT(worst, 0) << KvCacheDtypeName(dtype) << " rounds nothing";
  }
}

// FP8 takes the checkpoint's per-layer k_scale / v_scale (1 where it has none); one that is not a
// finite positive scalar is refused by name.
TEST(KvCacheDtypeTest, Fp8TakesTheCheckpointsScales) {
  testing::TempDir dir;
  auto o = testing::SmallModel("llama", dir.Sub("m"));
  const std::string path = testing::WriteModel(o);
  const std::string file = path + "/model.safetensors";
  auto scalar = [](float v) {
    std::vector<uint8_t> b(4);
    std::memcpy(b.data(), &v, 4);
    return b;
  };
  testing::AddTensor(file, "model.layers.1.self_attn.k_scale", DType::kF32, {}, scalar(0.125f));
  testing::AddTensor(file, "model.layers.0.self_attn.v_proj.output_scale", DType::kF32, {1},
                     scalar(0.5f));
  Transformer::Options fp8;
  fp8.kv_cache_dtype = KvCacheDtype::kFP8;
  auto model = Transformer::Load(path, fp8);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->kv_format().dtype, DType::kF8E4M3);
  EXPECT_EQ((*model)->kv_format().k_scale, (std::vector<float>{1.f, 0.125f}));
  EXPECT_EQ((*model)->kv_format().v_scale, (std::vector<float>{0.5f, 1.f}));
  // A pipeline stage keeps its own layers' scales.
  fp8.layer_begin = 1;
  auto stage = Transformer::Load(path, fp8);
  ASSERT_TRUE(stage.ok()) << stage.status();
  EXPECT_EQ((*stage)->kv_format().k_scale, (std::vector<float>{0.125f}));
  fp8.layer_begin = 0;
  for (const float bad : {0.f, -1.f, NAN, INFINITY}) {
    testing::AddTensor(file, "model.layers.1.self_attn.k_scale", DType::kF32, {}, scalar(bad));
    auto refused = Transformer::Load(path, fp8);
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_THAT(refused.status().message(),
                HasSubstr("tensor 'model.layers.1.self_attn.k_scale' is"));
  }
  testing::AddTensor(file, "model.layers.1.self_attn.k_scale", DType::kF32, {2},
                     std::vector<uint8_t>(8));
  EXPECT_THAT(Transformer::Load(path, fp8).status().message(),
              HasSubstr("must be one F32, F16 or BF16 value"));
  // Other dtypes read no scale.
  EXPECT_TRUE(Transformer::Load(path, {}).ok());
}

TEST(KvCacheTest, BlocksAreAllocatedOnDemandAndReturned) {
  KvCache cache(4, 5);
  SequenceKv a, b;
  ASSERT_TRUE(cache.Reserve(a, 1).ok());
  EXPECT_EQ(a.blocks.size(), 1u);
  ASSERT_TRUE(cache.Reserve(a, 9).ok());
  EXPECT_EQ(a.blocks.size(), 3u);
  ASSERT_TRUE(cache.Reserve(b, 8).ok());
  EXPECT_EQ(cache.free_blocks(), 0);
  SequenceKv c;
  EXPECT_EQ(cache.Reserve(c, 1).code(), absl::StatusCode::kResourceExhausted);
  cache.Release(a);
  EXPECT_EQ(cache.free_blocks(), 3);
  EXPECT_TRUE(a.blocks.empty());
  ASSERT_TRUE(cache.Reserve(c, 12).ok());
  // Distinct blocks never alias.
  std::set<int32_t> all(b.blocks.begin(), b.blocks.end());
  all.insert(c.blocks.begin(), c.blocks.end());
  EXPECT_EQ(all.size(), 5u);
}

}  // namespace
}  // namespace shardserve
