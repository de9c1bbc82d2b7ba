// Tensor x pipeline parallel execution against the single-rank model. Each stage's TP ranks run
// as threads over a real shared-memory communicator; stages run in order, passing hidden states.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "comm/shm_comm.h"
#include "model/generator.h"
#include "model/test_models.h"
#include "model/transformer.h"
#include "model/vocab_parallel.h"
#include "plan/layer_split.h"

namespace shardserve {
namespace {

using ::testing::HasSubstr;

struct Rank {
  std::unique_ptr<ShmCommunicator> comm;
  std::unique_ptr<Transformer> model;
  std::unique_ptr<KvCache> cache;
  SequenceKv kv;
};

class ShardedModel {
 public:
  static absl::StatusOr<std::unique_ptr<ShardedModel>> Load(const std::string& dir, int tp,
                                                            int pp) {
    auto config = LoadModelConfig(dir);
    if (!config.ok()) return config.status();
    auto split = SplitLayers(config->num_layers, pp, {});
    if (!split.ok()) return split.status();
    static std::atomic<int> groups{0};
    auto m = std::make_unique<ShardedModel>();
    m->stages_.resize(pp);
    for (int s = 0; s < pp; ++s) {
      m->stages_[s].resize(tp);
      const std::string name = absl::StrCat("/shardserve-sharded-", getpid(), "-", groups++);
      std::vector<absl::Status> status(tp);
      std::vector<std::thread> threads;
      for (int t = 0; t < tp; ++t) {
        threads.emplace_back([&, s, t] {
          Rank& r = m->stages_[s][t];
          if (tp > 1) {
            ShmOptions o;
            o.name = name;
            o.size = tp;
            o.rank = t;
            auto comm = ShmCommunicator::Create(o);
            if (!comm.ok()) {
              status[t] = comm.status();
              return;
            }
            r.comm = std::move(*comm);
          }
          Transformer::Options opts;
          opts.tp_size = tp;
          opts.tp_rank = t;
          opts.tp_comm = r.comm.get();
          opts.layer_begin = (*split)[s].begin;
          opts.layer_end = (*split)[s].end;
          auto model = Transformer::Load(dir, opts);
          if (!model.ok()) {
            status[t] = model.status();
            return;
          }
          r.model = std::move(*model);
          r.cache = *r.model->NewKvCache(512);
        });
      }
      for (auto& th : threads) th.join();
      for (const absl::Status& st : status) {
        if (!st.ok()) return st;
      }
    }
    return m;
  }

  // One step for one sequence: `tokens` enter stage 0. Returns the last stage's gathered logits
  // and the greedy choice its ranks made from their vocabulary slices alone, checking that every
  // TP rank of every stage agrees.
  struct StepOut {
    std::vector<float> logits;
    SampledToken greedy;
  };
  StepOut Step(const std::vector<int32_t>& tokens) {
    std::vector<float> hidden;
    StepOut result;
    for (auto& stage : stages_) {
      const int tp = static_cast<int>(stage.size());
      std::vector<std::vector<float>> outs(tp);
      std::vector<SampledToken> greedy(tp);
      std::vector<std::thread> threads;
      for (int t = 0; t < tp; ++t) {
        threads.emplace_back([&, t] {
          Rank& r = stage[t];
          std::vector<SequenceChunk> chunks(1);
          chunks[0].tokens = tokens;
          chunks[0].kv = &r.kv;
          std::vector<float> out;
          absl::Status s = r.model->ForwardStage(chunks, *r.cache,
                                                 hidden.empty() ? nullptr : hidden.data(), out);
          ASSERT_TRUE(s.ok()) << s;
          if (!r.model->last_stage()) {
            outs[t] = std::move(out);
            return;
          }
          ASSERT_TRUE(r.model->GatherLogits(outs[t]).ok());
          auto g =
              GreedyFromVocabSlices(out.data(), 1, r.model->logits_stride(), r.model->vocab_begin(),
                                    r.model->vocab_end(), 3, r.comm.get());
          ASSERT_TRUE(g.ok()) << g.status();
          greedy[t] = (*g)[0];
        });
      }
      for (auto& th : threads) th.join();
      for (int t = 1; t < tp; ++t) {
        EXPECT_EQ(outs[t], outs[0]) << "tp ranks disagree";
        EXPECT_EQ(greedy[t].id, greedy[0].id);
        EXPECT_EQ(greedy[t].logprob, greedy[0].logprob);
      }
      hidden = std::move(outs[0]);
      result.greedy = greedy[0];
    }
    result.logits = std::move(hidden);
    return result;
  }

  std::vector<std::vector<Rank>> stages_;
};

struct Greedy {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
};

Greedy RunGreedy(ShardedModel& m, std::vector<int32_t> prompt, int steps) {
  Greedy g;
  std::vector<int32_t> in = prompt;
  for (int i = 0; i < steps; ++i) {
    auto step = m.Step(in);
    // The choice made from the slices equals the one made from the whole logits.
    SamplingParams p;
    p.top_logprobs = 3;
    SampledToken whole = Sampler(p).Sample(step.logits.data(), step.logits.size());
    EXPECT_EQ(step.greedy.id, whole.id);
    EXPECT_NEAR(step.greedy.logprob, whole.logprob, 1e-5);
    for (int j = 0; j < 3; ++j) {
      EXPECT_EQ(step.greedy.top[j].id, whole.top[j].id);
      EXPECT_NEAR(step.greedy.top[j].logprob, whole.top[j].logprob, 1e-5);
    }
    g.tokens.push_back(step.greedy.id);
    g.logprobs.push_back(step.greedy.logprob);
    in = {step.greedy.id};
  }
  return g;
}

class ShardedTest : public ::testing::TestWithParam<std::string> {
 protected:
  // "ARCH" or "ARCH fp8": an FP8 checkpoint whose 24x24 blocks the ranks' slices cut through
  // (rows and columns split in 32s and 16s), each rank expanding its part; "gpt_oss mxfp4".
  std::string Write() {
    const std::string param = GetParam();
    auto o = testing::SmallModel(param.substr(0, param.find(' ')), dir_.Sub("m"));
    o.layers = 3;   // not divisible by 2 stages
    o.vocab = 401;  // not divisible by 2 or 4 ranks
    o.dtype = DType::kBF16;
    if (param.ends_with(" fp8")) o.fp8_block = 24;
    o.mxfp4 = param.ends_with(" mxfp4");  // gpt-oss's experts as it ships them
    if (o.arch == "gpt_oss") {  // a window the prompt and its tokens cross, the clamp reached
      o.sliding_window = 4;
      o.swiglu_limit = 1.5;
    }
    if (o.arch == "deepseek_v3") {  // MLA with q LoRA, YaRN, grouped routing, a dense layer
      o.q_lora_rank = 32;
      o.groups = 2;
      o.topk_groups = 1;
      o.rope_scaling = "yarn";
    }
    return testing::WriteModel(o);
  }
  testing::TempDir dir_;
};

// Greedy tokens identical to TP=1,PP=1 and logprobs within 1e-4, for TP in {1,2,4} x PP in
// {1,2,3} (TP=4 exceeds the 2 KV heads: they are replicated).
TEST_P(ShardedTest, EveryShapeMatchesTheSingleRank) {
  const std::string dir = Write();
  auto single = Transformer::Load(dir, {});
  ASSERT_TRUE(single.ok()) << single.status();
  GenerationRequest req;
  req.prompt_ids = {1, 17, 42, 300, 7, 99, 400};
  req.params.max_tokens = 6;
  req.params.ignore_eos = true;
  auto want = Generate(**single, {req});
  ASSERT_TRUE(want.ok());
  for (int tp : {1, 2, 4}) {
    for (int pp : {1, 2, 3}) {
      auto m = ShardedModel::Load(dir, tp, pp);
      ASSERT_TRUE(m.ok()) << m.status();
      Greedy got = RunGreedy(**m, req.prompt_ids, 6);
      EXPECT_EQ(got.tokens, (*want)[0].tokens) << "tp " << tp << " pp " << pp;
      for (size_t i = 0; i < got.logprobs.size(); ++i) {
        EXPECT_NEAR(got.logprobs[i], (*want)[0].logprobs[i], 1e-4) << "tp " << tp << " pp " << pp;
      }
    }
  }
}

TEST_P(ShardedTest, EachRankHoldsItsShareOfTheWeights) {
  const std::string dir = Write();
  auto one = ShardedModel::Load(dir, 1, 1);
  auto two = ShardedModel::Load(dir, 2, 1);
  ASSERT_TRUE(one.ok() && two.ok());
  const size_t whole = (*one)->stages_[0][0].model->shard_weight_bytes();
  // Replicated on every rank: DeepSeek-V3's q_a_proj and kv_a_proj_with_mqa (every head reads
  // their latents) and its routers' score-correction biases (the norms are not counted).
  size_t replicated = 0;
  const ModelConfig& c = (*one)->stages_[0][0].model->config();
  if (c.mla) {
    replicated = c.num_layers * (c.q_lora_rank + c.kv_lora_rank + c.head_dim) * c.hidden_size *
                 DTypeSize(c.dtype);
  }
  for (int t = 0; t < 2; ++t) {
    const size_t part = (*two)->stages_[0][t].model->shard_weight_bytes();
    // Everything else is split except the (replicated) MoE router: about half.
    const size_t half = (whole + replicated) / 2;
    EXPECT_LE(part, half + whole / 50) << "rank " << t;
    EXPECT_GE(part, half - whole / 50) << "rank " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(Archs, ShardedTest,
                         ::testing::Values("llama", "mixtral", "qwen2", "llama fp8",
                                           "qwen3_moe fp8", "deepseek_v3", "deepseek_v3 fp8",
                                           "gpt_oss", "gpt_oss mxfp4"));

TEST(ShardedShapeTest, BadShapesNameTheNumbers) {
  testing::TempDir dir;
  auto o = testing::SmallModel("llama", dir.Sub("m"));  // 4 heads, 2 KV heads, intermediate 96
  testing::WriteModel(o);
  auto err = [&](int tp, int pp) {
    auto m = ShardedModel::Load(dir.Sub("m"), tp, pp);
    EXPECT_FALSE(m.ok());
    return std::string(m.status().message());
  };
  EXPECT_THAT(err(3, 1),
              HasSubstr("num_attention_heads 4 is not divisible by tensor parallelism 3"));
  EXPECT_THAT(err(1, 3), HasSubstr("the model has 2 layers: too few for 3 pipeline stages"));
  o.heads = 6;
  o.kv_heads = 3;
  o.hidden = 96;
  o.out_dir = dir.Sub("kv3");
  testing::WriteModel(o);
  auto m = ShardedModel::Load(dir.Sub("kv3"), 2, 1);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(
      std::string(m.status().message()),
      HasSubstr("num_key_value_heads 3 and tensor parallelism 2: one must divide the other"));
}

// DeepSeek-V3's own sizes: routed experts, the shared experts' slice, the dense layers'.
TEST(ShardedShapeTest, DeepseekSizesNameTheField) {
  testing::TempDir dir;
  auto o = testing::SmallModel("deepseek_v3", dir.Sub("m"));
  o.heads = 6;
  auto err = [&](const std::string& name, int tp) {
    o.out_dir = dir.Sub(name);
    testing::WriteModel(o);
    auto m = ShardedModel::Load(o.out_dir, tp, 1);
    EXPECT_FALSE(m.ok());
    return std::string(m.status().message());
  };
  o.experts = 4;
  EXPECT_THAT(err("experts", 3), HasSubstr("n_routed_experts 4 is not divisible by tensor "
                                           "parallelism 3"));
  o.experts = 6;
  o.moe_intermediate = 32;
  o.shared_experts = 1;
  EXPECT_THAT(err("shared", 3), HasSubstr("n_shared_experts x moe_intermediate_size 32 is not "
                                          "divisible by tensor parallelism 3"));
  o.moe_intermediate = 48;
  o.intermediate = 100;
  EXPECT_THAT(err("dense", 3),
              HasSubstr("intermediate_size 100 is not divisible by tensor parallelism 3"));
}

}  // namespace
}  // namespace shardserve
