// GGUF models: a generated model converted to GGUF runs exactly as its safetensors (the
// configuration, the tensor names, the un-interleaved q/k rows, the tokenizer and the chat
// template all come from the file); what the file holds that shardserve cannot run is refused
// naming the key, the tensor or the type.
#include "model/gguf_model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <tuple>

#include "devtools/gguf_convert.h"
#include "devtools/gguf_writer.h"
#include "model/test_models.h"
#include "model/transformer.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace shardserve {
namespace {

using ::testing::HasSubstr;
using testing::SmallModel;
using testing::TempDir;
using testing::WriteModel;

// Full logits of a few prompt tokens and one decode step.
std::vector<float> Logits(Transformer& m) {
  auto cache = m.NewKvCache(64);
  EXPECT_TRUE(cache.ok()) << cache.status();
  SequenceKv kv;
  std::vector<SequenceChunk> chunks = {{{1, 40, 7, 300}, &kv}};
  std::vector<float> a, b;
  EXPECT_TRUE(m.Forward(chunks, **cache, a).ok());
  chunks[0].tokens = {12};
  EXPECT_TRUE(m.Forward(chunks, **cache, b).ok());
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

class GgufModelTest : public ::testing::TestWithParam<std::string> {
 protected:
  TempDir dir_;
};

// DeepSeek-V3 with YaRN, q LoRA, grouped routing, a shared expert and a dense first layer, as
// deepseek2 (its kv_b_proj as k_b and v_b, or as one attn_kv_b: "deepseek_v3 legacy"); gpt-oss
// with YaRN as gpt-oss.
TEST_P(GgufModelTest, RunsAsItsSafetensors) {
  const bool legacy = GetParam() == "deepseek_v3 legacy";
  auto o = SmallModel(legacy ? "deepseek_v3" : GetParam(), dir_.Sub("hf"));
  o.dtype = DType::kF32;
  if (o.arch == "deepseek_v3") {
    o.q_lora_rank = 48;
    o.experts = 8;
    o.groups = 4;
    o.topk_groups = 2;
    o.shared_experts = 1;
    o.first_dense = 1;
  }
  if (o.arch == "deepseek_v3" || o.arch == "gpt_oss") o.rope_scaling = "yarn";
  const std::string hf = WriteModel(o);
  std::filesystem::create_directory(dir_.Sub("gguf"));
  const std::string file = dir_.Sub("gguf") + "/model.gguf";
  const absl::Status converted = ConvertToGguf(hf, file, DType::kF32, legacy);
  ASSERT_TRUE(converted.ok()) << converted;
  auto want_config = LoadModelConfig(hf);
  auto got_config = LoadModelConfig(dir_.Sub("gguf"));  // the directory names its one file
  ASSERT_TRUE(want_config.ok() && got_config.ok()) << got_config.status();
  const ModelConfig &w = *want_config, &g = *got_config;
  EXPECT_EQ(g.architecture, w.architecture);
  EXPECT_EQ(g.num_kv_heads, w.num_kv_heads);
  EXPECT_EQ(g.qkv_bias, w.qkv_bias);
  EXPECT_EQ(g.o_bias, w.o_bias);
  EXPECT_EQ(g.num_experts, w.num_experts);
  EXPECT_EQ(g.experts_per_token, w.experts_per_token);
  EXPECT_EQ(g.intermediate_size, w.intermediate_size);
  EXPECT_EQ(g.norm_topk_prob, w.norm_topk_prob);
  EXPECT_EQ(std::tuple(g.mla, g.q_lora_rank, g.kv_lora_rank, g.qk_nope_dim, g.v_head_dim,
                       g.head_dim, g.rope_interleave),
            std::tuple(w.mla, w.q_lora_rank, w.kv_lora_rank, w.qk_nope_dim, w.v_head_dim,
                       w.head_dim, w.rope_interleave));
  EXPECT_EQ(std::tuple(g.sigmoid_routing, g.n_group, g.topk_group, g.shared_experts,
                       g.first_dense_layers, g.dense_intermediate_size, g.routed_scaling),
            std::tuple(w.sigmoid_routing, w.n_group, w.topk_group, w.shared_experts,
                       w.first_dense_layers, w.dense_intermediate_size, w.routed_scaling));
  EXPECT_EQ(std::tuple(g.gpt_oss, g.sliding_window, g.sliding_layers, g.swiglu_limit),
            std::tuple(w.gpt_oss, w.sliding_window, w.sliding_layers, w.swiglu_limit));
  EXPECT_EQ(std::tuple(g.rope_scaling, g.rope_factor, g.rope_original_max_position,
                       g.rope_beta_fast, g.rope_beta_slow, g.rope_truncate),
            std::tuple(w.rope_scaling, w.rope_factor, w.rope_original_max_position,
                       w.rope_beta_fast, w.rope_beta_slow, w.rope_truncate));
  EXPECT_FLOAT_EQ(g.rope_attention_factor, w.rope_attention_factor);
  EXPECT_FLOAT_EQ(g.attention_scale(), w.attention_scale());
  // A GGUF file's KV cache is F16 by default (llama.cpp's), the F32 checkpoint's F32.
  auto auto_kv = Transformer::Load(file, {});
  ASSERT_TRUE(auto_kv.ok()) << auto_kv.status();
  EXPECT_EQ((*auto_kv)->kv_format().dtype, DType::kF16);
  Transformer::Options f32;
  f32.kv_cache_dtype = KvCacheDtype::kF32;
  auto want = Transformer::Load(hf, {});
  auto got = Transformer::Load(file, f32);
  ASSERT_TRUE(want.ok() && got.ok()) << got.status();
  EXPECT_EQ((*want)->kv_format().dtype, DType::kF32);
  EXPECT_EQ(Logits(**got), Logits(**want));  // F32 both ways: the very same arithmetic

  auto want_tok = Tokenizer::Load(hf);
  auto got_tok = Tokenizer::Load(file);
  ASSERT_TRUE(want_tok.ok() && got_tok.ok()) << got_tok.status();
  for (const char* text : {"The model is too large for one machine.", "  two  spaces\n\n", "a"}) {
    EXPECT_EQ(*(*got_tok)->Encode(text), *(*want_tok)->Encode(text)) << text;
  }
  const std::vector<ChatMessage> chat = {{"system", "be brief"}, {"user", "hi"}};
  auto got_chat = ChatTemplate::ForModel(file, **got_tok).Render(chat);
  auto want_chat = ChatTemplate::ForModel(hf, **want_tok).Render(chat);
  ASSERT_TRUE(got_chat.ok() && want_chat.ok()) << got_chat.status() << want_chat.status();
  EXPECT_EQ(got_chat->text, want_chat->text);
}

INSTANTIATE_TEST_SUITE_P(Archs, GgufModelTest,
                         ::testing::Values("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe",
                                           "deepseek_v3", "deepseek_v3 legacy", "gpt_oss"),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), ' ', '_');
                           return name;
                         });

// What llama.cpp's format cannot say is refused by name, never written as something else: a
// Qwen3-MoE whose weights qwen3moe would renormalize, a gpt-oss clamped elsewhere than 7.0.
TEST(GgufModel, WhatHasNoGgufFormHereIsNotConvertedAsSomethingElse) {
  TempDir dir;
  for (const char* arch : {"gpt_oss", "qwen3_moe"}) {
    auto o = SmallModel(arch, dir.Sub(arch));
    o.norm_topk_prob = false;
    o.swiglu_limit = 1.5;
    const std::string hf = WriteModel(o);
    const absl::Status s = ConvertToGguf(hf, dir.Sub("m.gguf"), DType::kF32);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << arch;
    EXPECT_THAT(std::string(s.message()),
                ::testing::AnyOf(HasSubstr("gpt-oss GGUF files say no swiglu_limit"),
                                 HasSubstr("norm_topk_prob false has no qwen3moe GGUF form")))
        << arch;
  }
}

// A communicator that is never used: loading only checks that one is given.
class Unused : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  absl::Status AllReduceSum(float*, size_t) override { return Fail(); }
  absl::Status AllGather(const float*, size_t, float*) override { return Fail(); }
  absl::Status ReduceScatterSum(const float*, size_t, float*) override { return Fail(); }
  absl::Status Broadcast(void*, size_t, int) override { return Fail(); }
  absl::Status Send(const void*, size_t, int) override { return Fail(); }
  absl::Status Recv(void*, size_t, int) override { return Fail(); }
  absl::Status Barrier() override { return Fail(); }
  absl::Status Abort(const absl::Status&) override { return Fail(); }

 private:
  static absl::Status Fail() { return absl::InternalError("not for use"); }
};

// Quantized blocks do not split inside: 6 heads of 16 over T=2 gives o_proj column slices of 48
// values, not whole blocks of 32.
TEST(GgufModel, AColumnSliceInsideABlockIsRefused) {
  TempDir dir;
  auto o = SmallModel("llama", dir.Sub("hf"));
  o.hidden = 96;
  o.heads = 6;
  o.kv_heads = 2;
  o.intermediate = 128;
  const std::string hf = WriteModel(o);
  const std::string file = dir.Sub("m.gguf");
  ASSERT_TRUE(ConvertToGguf(hf, file, DType::kQ8_0).ok());
  Unused comm;
  Transformer::Options opts;
  opts.tp_size = 2;
  opts.tp_comm = &comm;
  auto m = Transformer::Load(file, opts);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()),
              HasSubstr("tensor 'model.layers.0.self_attn.o_proj.weight' (Q8_0, blocks of 32 "
                        "values) does not split over tensor parallelism 2"));
  opts.tp_size = 1;
  opts.tp_comm = nullptr;
  EXPECT_TRUE(Transformer::Load(file, opts).ok());
}

// A one-layer llama file built by hand, with one thing changed per case.
struct Tiny {
  std::string arch = "llama";
  bool embedding_length = true;
  GgmlType q_type = GgmlType::kF32;
  bool rope_freqs = false;
  std::string tokenizer = "gpt2";
  std::string pre = "gpt-2";
  bool long_token = false;   // token 2 of 5000 bytes
  bool extra_layer = false;  // the file holds blk.1 while block_count says 1
};

std::string Write(const std::string& path, const Tiny& t) {
  GgufWriter w;
  const int64_t H = 64, V = 8;
  w.Set("general.architecture", GgufWriter::String(t.arch));
  const std::string p = t.arch + ".";
  if (t.embedding_length) w.Set(p + "embedding_length", GgufWriter::U32(H));
  w.Set(p + "feed_forward_length", GgufWriter::U32(64));
  w.Set(p + "block_count", GgufWriter::U32(1));
  w.Set(p + "attention.head_count", GgufWriter::U32(2));
  w.Set(p + "context_length", GgufWriter::U32(128));
  w.Set(p + "attention.layer_norm_rms_epsilon", GgufWriter::F32(1e-5f));
  GgufArray tokens;
  for (int i = 0; i + 1 < V; ++i) {
    tokens.push_back(GgufWriter::String(t.long_token && i == 2 ? std::string(5000, 'c')
                                                               : std::string(1, 'a' + i)));
  }
  tokens.push_back(GgufWriter::String("ab"));  // what the one merge makes
  w.Set("tokenizer.ggml.model", GgufWriter::String(t.tokenizer));
  w.Set("tokenizer.ggml.pre", GgufWriter::String(t.pre));
  w.Set("tokenizer.ggml.tokens", GgufWriter::Array(tokens));
  w.Set("tokenizer.ggml.merges", GgufWriter::Array({GgufWriter::String("a b")}));
  auto f32 = [&](const std::string& name, std::vector<int64_t> dims) {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    w.AddTensor(name, GgmlType::kF32, dims, std::string(n * 4, '\0'));
  };
  f32("token_embd.weight", {H, V});
  f32("output_norm.weight", {H});
  f32("blk.0.attn_norm.weight", {H});
  f32("blk.0.ffn_norm.weight", {H});
  if (t.q_type == GgmlType::kQ2_K) {
    w.AddTensor("blk.0.attn_q.weight", GgmlType::kQ2_K, {256, H / 4}, std::string(16 * 84, '\0'));
  } else {
    f32("blk.0.attn_q.weight", {H, H});
  }
  for (const char* n : {"blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.attn_output.weight",
                        "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight"}) {
    f32(n, {H, H});
  }
  if (t.rope_freqs) f32("rope_freqs.weight", {16});
  if (t.extra_layer) f32("blk.1.attn_norm.weight", {H});
  EXPECT_TRUE(w.Write(path).ok());
  return path;
}

std::string ConfigError(const std::string& path) {
  auto c = LoadModelConfig(path);
  return c.ok() ? "" : std::string(c.status().message());
}

TEST(GgufModel, WhatCannotRunIsRefusedByName) {
  TempDir dir;
  const std::string file = dir.Sub("m.gguf");
  ASSERT_EQ(ConfigError(Write(file, {})), "");
  EXPECT_TRUE(Transformer::Load(file, {}).ok());
  auto valid = Tokenizer::Load(file);
  EXPECT_TRUE(valid.ok()) << valid.status();

  Tiny t;
  t.arch = "gpt2";
  EXPECT_THAT(ConfigError(Write(file, t)), HasSubstr("general.architecture 'gpt2'"));
  t = {};
  t.embedding_length = false;
  EXPECT_THAT(ConfigError(Write(file, t)), HasSubstr("llama.embedding_length"));
  t = {};
  t.rope_freqs = true;
  EXPECT_THAT(ConfigError(Write(file, t)), HasSubstr("rope_freqs.weight"));
  t = {};
  t.extra_layer = true;  // once ran truncated to the layers block_count declares
  EXPECT_THAT(ConfigError(Write(file, t)),
              HasSubstr("tensor 'blk.1.attn_norm.weight' is of a layer past llama.block_count 1"));
  t = {};
  t.q_type = GgmlType::kQ2_K;
  auto m = Transformer::Load(Write(file, t), {});
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()),
              HasSubstr("tensor 'blk.0.attn_q.weight' has type Q2_K"));
  t = {};
  t.tokenizer = "t5";
  auto tok = Tokenizer::Load(Write(file, t));
  ASSERT_FALSE(tok.ok());
  EXPECT_THAT(std::string(tok.status().message()), HasSubstr("tokenizer.ggml.model 't5'"));
  t = {};
  t.long_token = true;
  tok = Tokenizer::Load(Write(file, t));
  ASSERT_FALSE(tok.ok());
  EXPECT_THAT(std::string(tok.status().message()),
              HasSubstr("tokenizer.ggml.tokens[2] is 5000 bytes (at most 1024)"));
  t = {};
  t.pre = "mystery";
  tok = Tokenizer::Load(Write(file, t));
  ASSERT_FALSE(tok.ok());
  EXPECT_THAT(std::string(tok.status().message()), HasSubstr("tokenizer.ggml.pre 'mystery'"));

  // A directory names its model file only when it holds one.
  Write(dir.Sub("second.gguf"), {});
  EXPECT_THAT(ConfigError(dir.path()), HasSubstr("holds 2 GGUF files"));
}

// A model split by gguf-split's layout runs as its whole file, named by any part or by its
// directory; a part missing, out of place, or repeating a tensor of another part is refused by
// name.
TEST(GgufModel, ASplitModelRunsAsItsWholeFile) {
  TempDir dir;
  auto o = SmallModel("llama", dir.Sub("hf"));
  const std::string hf = WriteModel(o);
  const std::string whole = dir.Sub("whole.gguf");
  ASSERT_TRUE(ConvertToGguf(hf, whole, DType::kQ8_0).ok());
  std::filesystem::create_directory(dir.Sub("split"));
  auto first = SplitGguf(whole, dir.Sub("split") + "/m", 3);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string second = dir.Sub("split") + "/m-00002-of-00003.gguf";
  const std::string third = dir.Sub("split") + "/m-00003-of-00003.gguf";
  auto split = GgufFile::Open(second);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ((*split)->parts(), 3);
  EXPECT_EQ((*split)->path(2), third);

  auto want = Transformer::Load(whole, {});
  ASSERT_TRUE(want.ok()) << want.status();
  const std::vector<float> logits = Logits(**want);
  for (const std::string& path : {*first, second, dir.Sub("split")}) {
    auto got = Transformer::Load(path, {});
    ASSERT_TRUE(got.ok()) << path << ": " << got.status();
    EXPECT_EQ(Logits(**got), logits) << path;
    auto tok = Tokenizer::Load(path);
    EXPECT_TRUE(tok.ok()) << path << ": " << tok.status();
  }

  // The third part replaced by the second: numbered wrongly.
  std::filesystem::copy_file(second, third, std::filesystem::copy_options::overwrite_existing);
  EXPECT_THAT(ConfigError(*first), HasSubstr("m-00003-of-00003.gguf: split.no 1 of split.count 3, "
                                             "but its name makes it part 2"));
  // A part that repeats a tensor of the first.
  auto whole_file = GgufFile::Open(whole);
  ASSERT_TRUE(whole_file.ok());
  const GgufTensor& t = (*whole_file)->tensors().begin()->second;
  GgufWriter w;
  w.Set("split.no", GgufWriter::U16(2));
  w.Set("split.count", GgufWriter::U16(3));
  w.AddTensor(t.name, t.type, t.dims, std::string(reinterpret_cast<const char*>(t.data), t.bytes));
  ASSERT_TRUE(w.Write(third).ok());
  EXPECT_THAT(ConfigError(*first),
              HasSubstr("m-00003-of-00003.gguf: tensor '" + t.name + "' is also in " + *first));
  // A part missing.
  std::filesystem::remove(third);
  EXPECT_THAT(ConfigError(dir.Sub("split")), HasSubstr("m-00003-of-00003.gguf"));
  EXPECT_THAT(ConfigError(*first), HasSubstr("m-00003-of-00003.gguf"));
  std::filesystem::copy_file(whole, dir.Sub("split") + "/other.gguf");
  EXPECT_THAT(ConfigError(dir.Sub("split")), HasSubstr("holds 3 GGUF files"));
  // A whole file named as a part.
  std::filesystem::copy_file(whole, dir.Sub("x-00001-of-00002.gguf"));
  EXPECT_THAT(ConfigError(dir.Sub("x-00001-of-00002.gguf")),
              HasSubstr("named as part 1 of 2 but has no split.count"));
}

// A SentencePiece tokenizer goes into GGUF as llama.cpp writes one (tokenizer.ggml.model llama:
// tokens, scores and types, no merges) and comes back with its merges recovered from the scores:
// plain text encodes as with the original merges, byte fallback included, and decodes back.
TEST(GgufModel, ASentencePieceTokenizerComesBackFromItsScores) {
  TempDir dir;
  auto o = SmallModel("llama", dir.Sub("hf"));
  o.tokenizer = TokenizerStyle::kSentencePiece;
  const std::string hf = WriteModel(o);
  const std::string file = dir.Sub("m.gguf");
  ASSERT_TRUE(ConvertToGguf(hf, file, DType::kQ8_0).ok());
  auto gguf = GgufFile::Open(file);
  ASSERT_TRUE(gguf.ok());
  EXPECT_EQ(*(*gguf)->GetString("tokenizer.ggml.model"), "llama");
  EXPECT_EQ((*gguf)->metadata().count("tokenizer.ggml.merges"), 0u);
  auto want = Tokenizer::Load(hf);
  auto got = Tokenizer::Load(file);
  ASSERT_TRUE(want.ok() && got.ok()) << got.status();
  for (const char* text : {"The model is too large for one machine.", "caf\u00e9 \u4f60\u597d!"}) {
    auto ids = (*got)->Encode(text);
    ASSERT_TRUE(ids.ok());
    EXPECT_EQ(*ids, *(*want)->Encode(text)) << text;
    EXPECT_THAT((*got)->Decode(*ids), HasSubstr(text));
  }
}

}  // namespace
}  // namespace shardserve

namespace shardserve {
namespace {

// A copy of a GGUF file with one metadata key set to `value` (or removed when null).
std::string WithKey(const std::string& in, const std::string& out, const std::string& key,
                    std::optional<GgufValue> value) {
  auto f = GgufFile::Open(in);
  EXPECT_TRUE(f.ok()) << f.status();
  GgufWriter w;
  for (const auto& [k, v] : (*f)->metadata()) {
    if (k != key) w.Set(k, v);
  }
  if (value) w.Set(key, *value);
  for (const auto& [name, t] : (*f)->tensors()) {
    w.AddTensor(t.name, t.type, t.dims,
                std::string(reinterpret_cast<const char*>(t.data), t.bytes));
  }
  EXPECT_TRUE(w.Write(out).ok());
  return out;
}

// DeepSeek-V2's softmax routing (llama.cpp's default for deepseek2 without expert_gating_func)
// is not V3's and is refused by name, as is a YaRN extrapolation factor.
TEST(GgufModel, ADeepseek2FileOfAnotherRoutingIsRefusedByName) {
  TempDir dir;
  auto o = SmallModel("deepseek_v3", dir.Sub("hf"));
  o.rope_scaling = "yarn";
  const std::string file = dir.Sub("m.gguf");
  ASSERT_TRUE(ConvertToGguf(WriteModel(o), file, DType::kF32).ok());
  ASSERT_EQ(ConfigError(file), "");
  for (auto gating : {std::optional<GgufValue>(), std::optional(GgufWriter::U32(1))}) {
    EXPECT_THAT(
        ConfigError(WithKey(file, dir.Sub("v2.gguf"), "deepseek2.expert_gating_func", gating)),
        HasSubstr("is DeepSeek-V2's routing, which shardserve does not run"));
  }
  EXPECT_THAT(ConfigError(WithKey(file, dir.Sub("ext.gguf"),
                                  "deepseek2.rope.scaling.yarn_ext_factor", GgufWriter::F32(0.5f))),
              HasSubstr("yarn_ext_factor is not something shardserve runs"));
  EXPECT_THAT(
      ConfigError(WithKey(file, dir.Sub("attn.gguf"), "deepseek2.rope.scaling.yarn_attn_factor",
                          GgufWriter::F32(0.5f))),
      HasSubstr("yarn_attn_factor other than 1"));
  EXPECT_THAT(ConfigError(WithKey(file, dir.Sub("kv.gguf"), "deepseek2.attention.head_count_kv",
                                  GgufWriter::U32(4))),
              HasSubstr("are not MLA's latent"));
  // gpt-oss: a layer pattern llama.cpp's gpt-oss does not have is not taken as its own.
  auto g = SmallModel("gpt_oss", dir.Sub("go"));
  const std::string go = dir.Sub("go.gguf");
  ASSERT_TRUE(ConvertToGguf(WriteModel(g), go, DType::kF32).ok());
  ASSERT_EQ(ConfigError(go), "");
  EXPECT_THAT(ConfigError(WithKey(go, dir.Sub("pattern.gguf"),
                                  "gpt-oss.attention.sliding_window_pattern", GgufWriter::U32(4))),
              HasSubstr("sliding_window_pattern is not read for gpt-oss"));
}

}  // namespace
}  // namespace shardserve
