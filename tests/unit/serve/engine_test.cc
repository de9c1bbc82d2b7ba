// The continuous-batching engine against a real single-process model: whatever the batch, cache
// and chunk limits force (joining mid-flight, chunked prompts, preemption and resumption), every
// sequence gets the tokens the plain batched generator gives it.
#include "serve/engine.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/status.h"
#include "model/generator.h"
#include "model/test_models.h"
#include "model/transformer.h"
#include "serve/draft_model.h"
#include "serve/grammar.h"

namespace shardserve {
namespace {

using testing::SmallModel;
using testing::TempDir;
using testing::WriteModel;

// One process is the whole replica: steps run at once and their results wait for Collect.
class LocalExecutor : public StepExecutor {
 public:
  LocalExecutor(Transformer* model, int64_t kv_tokens)
      : model_(model), cache_(*model->NewKvCache(kv_tokens)) {
    cache_->FollowTables();  // the engine hands out the blocks
  }

  absl::Status Issue(const StepDesc& step) override {
    if (++steps_ == pause_at_) {  // the test acts while the engine waits here
      paused_.Notify();
      resume_.WaitForNotification();
    }
    if (fail_after_ >= 0 && issued_++ >= fail_after_) {
      return absl::UnavailableError("rank 1 died");
    }
    for (int64_t seq : step.release) {  // the blocks are the engine's
      kv_.erase(seq);
      samplers_.erase(seq);
      ++releases_;
    }
    std::vector<SequenceChunk> chunks;
    for (const StepChunk& c : step.chunks) {
      SequenceKv& kv = kv_[c.seq];
      if (c.params) {
        kv = SequenceKv{c.cached, c.start};
        cached_ += c.start;
        samplers_.erase(c.seq);
        samplers_.emplace(c.seq, Sampler(*c.params)).first->second.Skip(c.draws);
        resumed_ += c.draws > 0;
      }
      kv.blocks.insert(kv.blocks.end(), c.blocks.begin(), c.blocks.end());
      kv.length -= c.rewind;
      if (mtp_) {  // the sequence's tokens as the ranks see them, and the token after a prompt
                   // chunk
        std::vector<int32_t>& seen = seen_[c.seq];
        if (c.params) seen.clear();
        seen.insert(seen.end(), c.tokens.begin(), c.tokens.end() - c.drafts);
        if (!c.sample) {
          ++mtp_next_;
          mtp_next_wrong_ += c.next != following_(c.seq, seen);
        }
      }
      chunked_ += !c.sample;
      masks_ += !c.allowed.empty();
      drafted_ += c.drafts;
      if (!c.allowed.empty() && c.drafts == 0) samplers_.at(c.seq).Allow(c.allowed);
      chunks.push_back({c.tokens, &kv_[c.seq], -1, 1 + c.drafts});
    }
    StepResult r;
    r.microbatch = step.microbatch;
    if (!chunks.empty()) {
      std::vector<float> logits;
      RETURN_IF_ERROR(model_->Forward(chunks, *cache_, logits));
      const int64_t V = model_->config().vocab_size;
      int64_t row = 0;  // a chunk's first row of logits: 1 + its drafts each
      for (size_t i = 0; i < step.chunks.size(); row += 1 + step.chunks[i].drafts, ++i) {
        const StepChunk& c = step.chunks[i];
        if (!c.sample) continue;
        Sampler& sampler = samplers_.at(c.seq);
        std::vector<SampledToken> tokens;
        if (c.drafts > 0) {
          tokens = sampler.Verify(logits.data() + row * V, V,
                                  std::vector<int32_t>(c.tokens.end() - c.drafts, c.tokens.end()),
                                  RowMasks(c));
        } else {
          tokens.push_back(sampler.Sample(logits.data() + row * V, V));
        }
        for (const SampledToken& t : tokens) r.tokens.push_back({c.seq, t.id, t.logprob, t.top});
        if (mtp_) {  // the kept drafts are the sequence's; the draft is for the token after the new
                     // one
          std::vector<int32_t>& seen = seen_[c.seq];
          for (size_t j = 0; j + 1 < tokens.size(); ++j) seen.push_back(tokens[j].id);
          std::vector<int32_t> all = seen;
          all.push_back(tokens.back().id);
          if (const int32_t d = mtp_(c.seq, all); d >= 0) r.drafts.push_back({c.seq, d, 0, {}});
        }
        absl::MutexLock lock(&first_mu_);
        first_token_step_.emplace(c.seq, steps_.load());
      }
      // The prompt rows asked for, as a rank scores them.
      const ScoreRows score = ScoreRowsOf(step);
      scored_ += static_cast<int64_t>(score.rows.size());
      if (!score.rows.empty()) {
        ASSIGN_OR_RETURN(std::vector<SampledToken> scored,
                         model_->Score(score.rows, score.targets, score.top, nullptr));
        AddPromptScores(step, std::move(scored), r);
      }
    }
    done_.push_back(std::move(r));
    return absl::OkStatus();
  }
  absl::StatusOr<StepResult> Collect() override {
    StepResult r = std::move(done_.front());
    done_.pop_front();
    return r;
  }
  absl::Status Ping() override { return absl::OkStatus(); }
  absl::Status Stop() override { return absl::OkStatus(); }

  EngineOptions Options() const {
    EngineOptions o;
    o.kv_blocks = cache_->num_blocks();
    o.kv_block_size = cache_->block_size();
    o.max_context = model_->config().max_context;
    o.vocab_size = model_->config().vocab_size;
    o.eos_token_ids = model_->config().eos_token_ids;
    return o;
  }

  // Multi-token prediction as the last stage returns it: mtp_, given a sequence and its tokens,
  // guesses the one after them (-1: none); after each sampled chunk, its guess for the tokens with
  // the new one is the draft returned (StepResult::drafts). following_ knows that token: a prompt
  // chunk's StepChunk::next is checked against it (mtp_next_ such chunks, mtp_next_wrong_ wrong).
  using Oracle = std::function<int32_t(int64_t seq, const std::vector<int32_t>&)>;
  Oracle mtp_, following_;
  int mtp_next_ = 0, mtp_next_wrong_ = 0;
  int resumed_ = 0, chunked_ = 0, releases_ = 0, masks_ = 0;
  int64_t drafted_ = 0;  // tokens drafted by the steps' chunks
  int64_t cached_ = 0;   // prompt positions skipped for a cached prefix
  int64_t scored_ = 0;   // prompt rows scored
  int fail_after_ = -1, issued_ = 0;
  std::atomic<int> steps_{0};  // steps issued
  // Issue blocks at step pause_at_ (paused_) until the test says resume_.
  int pause_at_ = -1;
  absl::Notification paused_, resume_;
  // A sequence's first sampled token: at which step.
  int FirstTokenStep(int64_t seq) {
    absl::MutexLock lock(&first_mu_);
    auto it = first_token_step_.find(seq);
    return it == first_token_step_.end() ? -1 : it->second;
  }

 private:
  Transformer* model_;
  std::unique_ptr<KvCache> cache_;
  std::map<int64_t, SequenceKv> kv_;
  std::map<int64_t, Sampler> samplers_;
  std::map<int64_t, std::vector<int32_t>> seen_;  // mtp_: each sequence's tokens so far
  std::deque<StepResult> done_;
  absl::Mutex first_mu_;
  std::map<int64_t, int> first_token_step_ ABSL_GUARDED_BY(first_mu_);
};

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto o = SmallModel("llama", dir_.Sub("m"));
    o.dtype = DType::kF32;
    model_ = *Transformer::Load(WriteModel(o), {});
    for (int i = 0; i < 6; ++i) {
      GenerationRequest r;
      r.prompt_ids = {1, static_cast<int32_t>(10 + i), 20, static_cast<int32_t>(30 + 3 * i)};
      for (int k = 0; k < i; ++k) r.prompt_ids.push_back(40 + k);
      r.params.max_tokens = 12 + 2 * i;
      r.params.ignore_eos = true;
      requests_.push_back(r);
    }
  }
  std::vector<GenerationResult> Reference() { return *Generate(*model_, requests_); }
  // Room for about two sequences (exec's cache of 64 tokens), prompts fed 3 tokens per step, 2
  // micro-batches: chunking and preemption.
  static EngineOptions Cramped(const LocalExecutor& exec) {
    EngineOptions o = exec.Options();
    o.max_batch = 4;
    o.microbatches = 2;
    o.max_step_tokens = 3;
    return o;
  }

  // Speculative decoding: `o` drafting up to `tokens` a step with `method`.
  static EngineOptions Speculating(EngineOptions o, SpeculativeMethod method, int64_t tokens) {
    o.speculative.method = method;
    o.speculative.tokens = tokens;
    return o;
  }
  // The drafted and kept tokens an engine reports, each step's within its bounds.
  struct Drafts {
    int64_t drafted = 0, accepted = 0;
    EngineObserver Observer(int64_t tokens) {
      EngineObserver o;
      o.speculation = [this, tokens](int64_t d, int64_t a) {
        EXPECT_LE(a, d);
        EXPECT_LE(d, tokens);
        drafted += d;
        accepted += a;
      };
      return o;
    }
  };

  // Structured output: the grammar vocabulary of the model's tokenizer (which TextOf then
  // decodes with).
  absl::StatusOr<std::shared_ptr<const GrammarVocabulary>> Vocabulary() {
    auto tok = Tokenizer::Load(dir_.Sub("m"));
    if (!tok.ok()) return tok.status();
    tok_ = *std::move(tok);
    return GrammarVocabulary::Create(*tok_, model_->config().vocab_size,
                                     model_->config().eos_token_ids);
  }
  // A result's text, without the end-of-sequence token that ends it.
  std::string TextOf(const GenerationResult& g) const {
    std::vector<int32_t> ids = g.tokens;
    const auto& eos = model_->config().eos_token_ids;
    if (!ids.empty() && std::count(eos.begin(), eos.end(), ids.back())) ids.pop_back();
    return tok_->Decode(ids);
  }

  TempDir dir_;
  std::unique_ptr<Transformer> model_;
  std::unique_ptr<Tokenizer> tok_;
  std::vector<GenerationRequest> requests_;
};

TEST_F(EngineTest, GreedyTokensSurviveChunkingAndPreemption) {
  const auto want = Reference();
  LocalExecutor exec(model_.get(), 64);
  auto got = GenerateAll(&exec, Cramped(exec), requests_);
  ASSERT_TRUE(got.ok()) << got.status();
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ((*got)[i].tokens, want[i].tokens) << "request " << i;
    EXPECT_EQ((*got)[i].finish_reason, "length");
  }
  EXPECT_GT(exec.resumed_, 0) << "the cache was meant to force preemption";
  EXPECT_GT(exec.chunked_, 0) << "prompts were meant to be chunked";
}

// Speculative decoding (n-gram) verifies drafts on the model's rows and rewinds the refused ones:
// greedy tokens stay the plain generator's whatever chunking and preemption do, drafts are kept
// (the tiny model repeats itself), and a request may opt out.
TEST_F(EngineTest, SpeculationKeepsGreedyTokensThroughChunkingAndPreemption) {
  for (auto& r : requests_) r.params.max_tokens = 40;
  const auto want = Reference();
  LocalExecutor exec(model_.get(), 160);
  EngineOptions o = Speculating(Cramped(exec), SpeculativeMethod::kNgram, 3);
  Drafts drafts;
  auto got = GenerateAll(&exec, o, requests_, drafts.Observer(3));
  const int64_t drafted = drafts.drafted, accepted = drafts.accepted;
  ASSERT_TRUE(got.ok()) << got.status();
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ((*got)[i].tokens, want[i].tokens) << "request " << i;
    // The target's log-probabilities (rounding apart: the batch's rows differ).
    EXPECT_THAT((*got)[i].logprobs,
                ::testing::Pointwise(::testing::FloatNear(1e-4f), want[i].logprobs))
        << "request " << i;
  }
  EXPECT_EQ(drafted, exec.drafted_);
  EXPECT_GT(accepted, 0) << "the model's loops were meant to be drafted";
  EXPECT_LT(accepted, drafted) << "some drafts were meant to be refused";
  EXPECT_GT(exec.resumed_, 0) << "the cache was meant to force preemption";
  // Opted out: no drafts.
  for (auto& r : requests_) r.speculative = false;
  LocalExecutor plain(model_.get(), 160);
  got = GenerateAll(&plain, o, requests_);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(plain.drafted_, 0);
  EXPECT_EQ((*got)[0].tokens, want[0].tokens);
}

// Multi-token prediction (speculative method mtp): the last stage returns, with a step's result, a
// draft for each sampled sequence's next step (StepResult::drafts), which the engine feeds then,
// and a prompt chunk before the prompt's last carries the token after it (StepChunk::next). An
// MTP that always guesses the greedy token has every draft kept, one a step; one that always
// misses, none; the tokens are the plain generator's either way, through chunked prompts and
// preemption.
TEST_F(EngineTest, MtpDraftsReturnedWithAStepAreFedTheNext) {
  for (auto& r : requests_) r.params.max_tokens = 30;
  const auto want = Reference();
  // The token after `t` of sequence `seq`'s prompt and greedy output (the engine numbers the
  // requests' sequences from 0 in order).
  LocalExecutor::Oracle following = [&](int64_t seq, const std::vector<int32_t>& t) -> int32_t {
    std::vector<int32_t> full = requests_.at(seq).prompt_ids;
    full.insert(full.end(), want.at(seq).tokens.begin(), want.at(seq).tokens.end());
    const bool on = t.size() < full.size() && std::equal(t.begin(), t.end(), full.begin());
    return on ? full[t.size()] : -1;
  };
  const int32_t V = static_cast<int32_t>(model_->config().vocab_size);
  for (const bool right : {true, false}) {
    LocalExecutor exec(model_.get(), 64);
    exec.following_ = following;
    exec.mtp_ = [&](int64_t seq, const std::vector<int32_t>& t) {
      const int32_t f = following(seq, t);
      return f < 0 || right ? f : (f + 1) % V;
    };
    EngineOptions o = Speculating(Cramped(exec), SpeculativeMethod::kMtp, 1);
    o.prefix_caching = false;  // every chunk from a sequence's start: the executor sees it all
    Drafts drafts;
    auto got = GenerateAll(&exec, o, requests_, drafts.Observer(1));
    ASSERT_TRUE(got.ok()) << got.status();
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ((*got)[i].tokens, want[i].tokens) << "request " << i << (right ? "" : ", wrong");
    }
    EXPECT_GT(drafts.drafted, 40);
    EXPECT_EQ(drafts.accepted, right ? drafts.drafted : 0);
    EXPECT_GT(exec.mtp_next_, 0) << "prompts were meant to be chunked";
    EXPECT_EQ(exec.mtp_next_wrong_, 0);
    EXPECT_GT(exec.resumed_, 0) << "the cache was meant to force preemption";
  }
}

// A draft model (serve/draft_model.h) drafts for the engine: the model itself as its own draft
// has every draft kept (rounding apart), and the tokens stay the plain generator's through
// chunked prompts and a batch of sequences. (cli.speculative runs a Q4_K draft, which the
// target often refuses.)
TEST_F(EngineTest, ADraftModelDraftsAndTheTokensStayTheModels) {
  for (auto& r : requests_) r.params.max_tokens = 40;
  const auto want = Reference();
  LocalExecutor exec(model_.get(), 160);
  EngineOptions o = Speculating(Cramped(exec), SpeculativeMethod::kDraft, 4);
  auto drafter = ModelDrafter::Load(dir_.Sub("m"), model_->config(), nullptr, 4096, 512);
  ASSERT_TRUE(drafter.ok()) << drafter.status();
  o.drafter = *std::move(drafter);
  Drafts drafts;
  auto got = GenerateAll(&exec, o, requests_, drafts.Observer(4));
  const int64_t drafted = drafts.drafted, accepted = drafts.accepted;
  ASSERT_TRUE(got.ok()) << got.status();
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ((*got)[i].tokens, want[i].tokens) << "request " << i;
  }
  EXPECT_GT(drafted, 50);
  EXPECT_GE(accepted, drafted * 9 / 10) << accepted << " of " << drafted;
  // A draft whose vocabulary is larger than the model's is refused, naming both.
  // A prompt longer than a call reads (4 tokens here) is read over calls, no draft meanwhile.
  auto reader = ModelDrafter::Load(dir_.Sub("m"), model_->config(), nullptr, 4096, 4);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const std::vector<int32_t> prompt = {1, 5, 9, 13, 17, 21, 25, 29, 33, 37};
  std::vector<size_t> drafted_per_call;
  for (int call = 0; call < 4; ++call) {
    drafted_per_call.push_back((*reader)->Propose({{7, prompt, {}, 3}})[0].size());
  }
  EXPECT_EQ(drafted_per_call, (std::vector<size_t>{0, 0, 3, 3}));
  ModelConfig smaller = model_->config();
  smaller.vocab_size -= 1;
  EXPECT_THAT(ModelDrafter::Load(dir_.Sub("m"), smaller, nullptr, 4096, 512).status().message(),
              ::testing::HasSubstr("more than the model's"));
}

// The backlog a role scales on: the prompt tokens still to compute fall as prompts are fed (3 a
// step here), to none once every prompt is computed; the running sequences are counted.
TEST_F(EngineTest, TheBacklogCountsPromptTokensNotYetComputed) {
  LocalExecutor exec(model_.get(), 1024);
  EngineOptions o = exec.Options();
  o.max_step_tokens = 3;
  o.exit_when_idle = true;
  std::vector<std::pair<int, int64_t>> seen;
  EngineObserver observer;
  observer.backlog = [&](int running, int64_t prompt) { seen.emplace_back(running, prompt); };
  Engine engine(&exec, o, observer);
  int64_t total = 0;
  for (const GenerationRequest& r : requests_) {
    ASSERT_TRUE(engine.Submit(r).ok());
    total += static_cast<int64_t>(r.prompt_ids.size());
  }
  ASSERT_TRUE(engine.Run().ok());
  ASSERT_GE(seen.size(), 2u);
  EXPECT_EQ(seen.front().second, total - 3) << "one step fed 3 prompt tokens";
  EXPECT_EQ(seen.front().first, 6);
  for (size_t i = 1; i < seen.size(); ++i) EXPECT_LE(seen[i].second, seen[i - 1].second);
  const auto decoding =
      std::find_if(seen.begin(), seen.end(), [](auto p) { return p.second == 0; });
  ASSERT_NE(decoding, seen.end()) << "every prompt computed at last";
  EXPECT_GE(decoding->first, 1);
}

// The adapters a leader exports (EngineObserver::adapters): the running sequences' and the
// waiting requests' LoRA adapters, each once, the base's none; a batch of two leaves the others
// waiting, and the waiting ones run in their turn.
TEST_F(EngineTest, TheAdaptersOfRunningAndWaitingRequestsAreObserved) {
  LocalExecutor exec(model_.get(), 1024);
  EngineOptions o = exec.Options();
  o.max_batch = 2;
  o.exit_when_idle = true;
  o.lora_slots = 4;
  o.adapters = {{"zero", "/z"}, {"one", "/o"}, {"two", "/t"}, {"three", "/th"}};
  using Names = std::vector<std::string>;
  std::vector<std::pair<Names, Names>> seen;
  EngineObserver observer;
  observer.adapters = [&](const Names& running, const Names& waiting) {
    seen.emplace_back(running, waiting);
  };
  Engine engine(&exec, o, observer);
  const int64_t ids[] = {3, 3, -1, 1, 1, -1};  // the base's requests have none
  for (size_t i = 0; i < requests_.size(); ++i) {
    GenerationRequest r = requests_[i];
    r.adapter = ids[i % 6];
    ASSERT_TRUE(engine.Submit(r).ok());
  }
  ASSERT_TRUE(engine.Run().ok());
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.front().first, Names({"three"})) << "the first two share adapter 3";
  EXPECT_EQ(seen.front().second, Names({"one"}));
  EXPECT_TRUE(std::any_of(seen.begin(), seen.end(), [](const auto& p) {
    return p.first == Names({"one"});
  })) << "adapter 1's requests run in their turn";
  EXPECT_EQ(seen.back(), (std::pair<Names, Names>{}));
}

// The adapters a replica keeps are bounded (spec.lora.maxCpuLoras): declared ones count, a load
// past the bound is refused naming it, and nothing of the refused one stays.
TEST_F(EngineTest, LoadingPastTheAdaptersKeptIsRefused) {
  LocalExecutor exec(model_.get(), 1024);
  EngineOptions o = exec.Options();
  o.lora_slots = 2;
  o.max_adapters = 3;
  o.adapters = {{"a", "/a"}, {"b", "/b"}};
  Engine engine(&exec, o, EngineObserver{});
  ASSERT_TRUE(engine.LoadAdapter("c", "/c").ok());
  const absl::Status past = engine.LoadAdapter("d", "/d");
  EXPECT_EQ(past.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(past.message()), ::testing::HasSubstr("keeps 3 LoRA adapters"));
  EXPECT_THAT(std::string(past.message()), ::testing::HasSubstr("spec.lora.maxCpuLoras 3"));
  EXPECT_EQ(engine.adapter_names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_FALSE(engine.AdapterOf("d").ok());
}

// Structured output through the engine: the constrained sequences' tokens follow their
// grammars (a JSON schema, a regex) and end when the grammar is complete, through preemption and
// chunked prompts; each of their sampled tokens went out with a mask, and the other sequences'
// with none.
TEST_F(EngineTest, ConstrainedSequencesFollowTheirGrammars) {
  auto vocab = Vocabulary();
  ASSERT_TRUE(vocab.ok()) << vocab.status();
  const std::string schema =
      R"({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
          "b": {"type": "boolean"}}, "required": ["n", "b"], "additionalProperties": false})";
  int constrained_tokens = 0;
  for (size_t i = 0; i < requests_.size(); ++i) {
    GenerationRequest& r = requests_[i];
    r.params.temperature = 1.0f;
    r.params.seed = 11 + i;
    r.params.max_tokens = 40;
    if (i % 3 == 2) continue;  // unconstrained
    r.params.ignore_eos = false;
    auto c = vocab.value()->Compile(i % 3 == 0 ? Grammar{"json_schema", schema}
                                               : Grammar{"regex", "[a-e]{2,5}"});
    ASSERT_TRUE(c.ok()) << c.status();
    r.constraint = std::move(*c);
  }
  LocalExecutor exec(model_.get(), 64);
  auto got = GenerateAll(&exec, Cramped(exec), requests_);
  ASSERT_TRUE(got.ok()) << got.status();
  for (size_t i = 0; i < requests_.size(); ++i) {
    const GenerationResult& g = (*got)[i];
    if (i % 3 == 2) {
      EXPECT_EQ(g.finish_reason, "length");
      continue;
    }
    constrained_tokens += static_cast<int>(g.tokens.size());
    const std::string text = TextOf(g);
    EXPECT_EQ(g.finish_reason, "stop") << text;
    if (i % 3 == 0) {
      const auto v = nlohmann::json::parse(text, nullptr, false);
      ASSERT_TRUE(v.is_object() && v.size() == 2 && v["n"].is_number_integer() &&
                  v["b"].is_boolean())
          << text;
    } else {
      EXPECT_TRUE(std::regex_match(text, std::regex("[a-e]{2,5}"))) << text;
    }
  }
  EXPECT_GT(exec.resumed_, 0) << "the cache was meant to force preemption";
  EXPECT_EQ(exec.masks_, constrained_tokens);
}

// Speculation under a grammar: a constrained sequence's drafts are checked against its grammar
// and each drafted row is sampled under the grammar as it stands after the drafts before it.
// Greedy tokens stay those of decoding without drafts; sampled outputs still follow their
// grammars (a row sampled under another row's mask would take a token the grammar refuses, and
// the sequence would end in an error); drafts are kept.
TEST_F(EngineTest, DraftsUnderAGrammarKeepItsTokens) {
  auto vocab = Vocabulary();
  ASSERT_TRUE(vocab.ok()) << vocab.status();
  const std::string schema =
      R"({"type": "array", "items": {"type": "object", "properties": {"a": {"type": "boolean"}},
          "required": ["a"], "additionalProperties": false}, "minItems": 3, "maxItems": 6})";
  for (size_t i = 0; i < requests_.size(); ++i) {
    GenerationRequest& r = requests_[i];
    r.params.max_tokens = 120;
    r.params.ignore_eos = false;
    if (i >= 3) {  // sampled
      r.params.temperature = 1.0f;
      r.params.seed = 3 + i;
    }
    auto c = vocab.value()->Compile(i % 2 == 0 ? Grammar{"json_schema", schema}
                                               : Grammar{"regex", "[a-e]{10,30}"});
    ASSERT_TRUE(c.ok()) << c.status();
    r.constraint = std::move(*c);
  }
  auto fresh = [&] {  // a run uses its constraints up
    std::vector<GenerationRequest> out = requests_;
    for (auto& r : out) r.constraint = r.constraint->Clone();
    return out;
  };
  LocalExecutor plain(model_.get(), 4096);
  auto want = GenerateAll(&plain, Cramped(plain), fresh());
  ASSERT_TRUE(want.ok()) << want.status();
  LocalExecutor exec(model_.get(), 4096);
  Drafts drafts;
  auto got = GenerateAll(&exec, Speculating(Cramped(exec), SpeculativeMethod::kNgram, 3), fresh(),
                         drafts.Observer(3));
  ASSERT_TRUE(got.ok()) << got.status();
  for (size_t i = 0; i < requests_.size(); ++i) {
    const GenerationResult& g = (*got)[i];
    EXPECT_EQ(g.finish_reason, "stop") << "request " << i;
    const std::string text = TextOf(g);
    if (i % 2 == 0) {
      const auto v = nlohmann::json::parse(text, nullptr, false);
      EXPECT_TRUE(v.is_array() && v.size() >= 3) << "request " << i << ": " << text;
    } else {
      EXPECT_TRUE(std::regex_match(text, std::regex("[a-e]{10,30}"))) << "request " << i << text;
    }
    if (i < 3) EXPECT_EQ(g.tokens, (*want)[i].tokens) << "request " << i << ": " << text;
  }
  EXPECT_EQ(drafts.drafted, exec.drafted_);
  EXPECT_GT(drafts.accepted, 0) << "the grammars' repetitions were meant to be drafted";
  EXPECT_EQ(plain.drafted_, 0);
}

TEST_F(EngineTest, SeededSamplingResumesItsStreamAfterPreemption) {
  for (auto& r : requests_) {
    r.params.temperature = 0.9f;
    r.params.seed = 77;
  }
  LocalExecutor roomy(model_.get(), 4096);
  auto want = GenerateAll(&roomy, roomy.Options(), requests_);
  LocalExecutor tight(model_.get(), 64);
  EngineOptions o = tight.Options();
  o.max_batch = 4;
  auto got = GenerateAll(&tight, o, requests_);
  ASSERT_TRUE(want.ok() && got.ok());
  EXPECT_GT(tight.resumed_, 0);
  for (size_t i = 0; i < requests_.size(); ++i) EXPECT_EQ((*got)[i].tokens, (*want)[i].tokens);
}

// Request migration: a sequence resumed on another engine from its prompt and the output so far
// (GenerationRequest::resumed) goes on exactly as it would have: greedy, seeded with penalties,
// and under a grammar (its constraint past the resumed tokens); the resumed tokens count toward
// max_tokens and are not produced again. A resumed output as long as max_tokens, or with a token
// outside the vocabulary, is refused.
TEST_F(EngineTest, AResumedSequenceGoesOnAsTheUninterruptedOne) {
  auto vocab = Vocabulary();
  ASSERT_TRUE(vocab.ok()) << vocab.status();
  for (size_t i = 0; i < requests_.size(); ++i) {
    GenerationRequest& r = requests_[i];
    r.params.max_tokens = 16;
    if (i % 3 == 0) continue;  // greedy
    r.params.temperature = 0.9f;
    r.params.seed = 5 + i;
    r.params.presence_penalty = 0.5f;
    r.params.frequency_penalty = 0.3f;
    r.params.repetition_penalty = 1.2f;
    if (i % 3 == 2) {
      r.params.ignore_eos = false;
      auto c = vocab.value()->Compile(Grammar{"regex", "[a-e]{6,12}"});
      ASSERT_TRUE(c.ok()) << c.status();
      r.constraint = std::move(*c);
    }
  }
  auto fresh = [&] {  // constraints are used up by a run: each run takes new clones
    std::vector<GenerationRequest> out = requests_;
    for (auto& r : out) {
      if (r.constraint) r.constraint = r.constraint->Clone();
    }
    return out;
  };
  LocalExecutor whole_exec(model_.get(), 4096);
  auto whole = GenerateAll(&whole_exec, whole_exec.Options(), fresh());
  ASSERT_TRUE(whole.ok()) << whole.status();
  std::vector<GenerationRequest> resumed = fresh();
  std::vector<size_t> cut(resumed.size());
  for (size_t i = 0; i < resumed.size(); ++i) {
    const std::vector<int32_t>& w = (*whole)[i].tokens;
    ASSERT_GE(w.size(), 3u) << "request " << i;
    cut[i] = 1 + i % (w.size() - 1);
    resumed[i].resumed.assign(w.begin(), w.begin() + static_cast<int64_t>(cut[i]));
  }
  LocalExecutor exec(model_.get(), 4096);
  auto got = GenerateAll(&exec, exec.Options(), resumed);
  ASSERT_TRUE(got.ok()) << got.status();
  for (size_t i = 0; i < resumed.size(); ++i) {
    const std::vector<int32_t>& w = (*whole)[i].tokens;
    EXPECT_EQ((*got)[i].tokens,
              std::vector<int32_t>(w.begin() + static_cast<int64_t>(cut[i]), w.end()))
        << "request " << i << " resumed after " << cut[i];
    EXPECT_EQ((*got)[i].finish_reason, (*whole)[i].finish_reason) << "request " << i;
  }
  Engine engine(&exec, exec.Options());
  GenerationRequest r = requests_[0];
  r.resumed.assign(16, 5);
  EXPECT_THAT(std::string(engine.Submit(r).status().message()),
              ::testing::HasSubstr("16 tokens of its max_tokens 16"));
  r.resumed = {5, static_cast<int32_t>(model_->config().vocab_size)};
  EXPECT_THAT(std::string(engine.Submit(r).status().message()),
              ::testing::HasSubstr("resumed token id"));
}

// Runs `r` alone on a running engine: its tokens, logprobs and cached prompt tokens.
// A stream's whole output.
GenerationResult Drain(RequestStream& stream) {
  GenerationResult out;
  for (;;) {
    auto u = stream.Next(std::chrono::seconds(10));
    for (auto& t : u.prompt) out.prompt_logprobs.push_back({t.id, t.logprob, t.top});
    for (auto& t : u.tokens) {
      out.tokens.push_back(t.id);
      out.logprobs.push_back(t.logprob);
    }
    if (u.finished) break;
  }
  return out;
}

GenerationResult RunOne(Engine& engine, const GenerationRequest& r, int64_t* cached) {
  auto stream = engine.Submit(r);
  EXPECT_TRUE(stream.ok()) << stream.status();
  if (!stream.ok()) return {};
  GenerationResult out = Drain(**stream);
  *cached = (*stream)->cached_tokens();
  return out;
}

// Prefix caching: requests that share a 40-token start (two full 16-token blocks) take the
// first one's blocks after it ends and skip their prefill; a 49-token prompt sent again takes
// all its blocks but the one with its last token; answers equal the uncached ones. In a cache of
// four blocks the other prompts evict it, and answers stay equal; turned off, nothing is cached.
TEST_F(EngineTest, CachedPrefixesGiveTheUncachedAnswers) {
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 4; ++i) {
    GenerationRequest r;
    for (int k = 0; k < 40; ++k) r.prompt_ids.push_back(3 + (k * 7) % 50);
    for (int k = 0; k <= i; ++k) r.prompt_ids.push_back(60 + 5 * i + k);
    r.params.max_tokens = 6;
    r.params.ignore_eos = true;
    reqs.push_back(r);
  }
  reqs.push_back(reqs[0]);  // a 49-token prompt: three full blocks, sent twice
  for (int k = 1; k < 9; ++k) reqs.back().prompt_ids.push_back(90 + k);
  reqs.push_back(reqs.back());
  const std::vector<GenerationResult> want = *Generate(*model_, reqs);
  const int64_t bs = LocalExecutor(model_.get(), 16).Options().kv_block_size;
  ASSERT_EQ(bs, 16);
  for (const auto& [kv_tokens, caching] :
       {std::pair{4096, true}, std::pair{64, true}, std::pair{4096, false}}) {
    LocalExecutor exec(model_.get(), kv_tokens);
    EngineOptions o = exec.Options();
    o.prefix_caching = caching;
    Engine engine(&exec, o);
    std::thread loop([&] { ASSERT_TRUE(engine.Run().ok()); });
    for (size_t i = 0; i < reqs.size(); ++i) {
      int64_t cached = -1;
      const GenerationResult got = RunOne(engine, reqs[i], &cached);
      EXPECT_EQ(got.tokens, want[i].tokens) << "request " << i << " cache " << kv_tokens;
      for (size_t k = 0; k < got.logprobs.size() && k < want[i].logprobs.size(); ++k) {
        EXPECT_NEAR(got.logprobs[k], want[i].logprobs[k], 1e-4) << "request " << i;
      }
      const int64_t expect = !caching || i == 0 ? 0
                             : kv_tokens == 64  ? -1  // evicted or not: checked for equality only
                             : i < 5            ? 32
                                                : 48;  // all but the last prompt token
      if (expect >= 0) EXPECT_EQ(cached, expect) << "request " << i << " cache " << kv_tokens;
    }
    engine.Shutdown();
    loop.join();
    if (caching && kv_tokens == 4096) EXPECT_EQ(exec.cached_, 4 * 32 + 48);
    if (!caching) EXPECT_EQ(exec.cached_, 0);
  }
  // Three sequences of one prompt sent at once (a request's n choices): the first computes the
  // prompt, the others wait for its blocks and take them.
  std::vector<GenerationRequest> same(3, reqs[5]);
  const std::vector<GenerationResult> once = *Generate(*model_, same);
  LocalExecutor exec(model_.get(), 4096);
  auto got = GenerateAll(&exec, exec.Options(), same);
  ASSERT_TRUE(got.ok()) << got.status();
  for (size_t i = 0; i < same.size(); ++i) EXPECT_EQ((*got)[i].tokens, once[i].tokens);
  EXPECT_EQ(exec.cached_, 2 * 48);
  // Sent at once to a running engine, the second waits and reports what it found cached.
  LocalExecutor live(model_.get(), 4096);
  Engine engine(&live, live.Options());
  std::thread loop([&] { ASSERT_TRUE(engine.Run().ok()); });
  auto a = engine.Submit(same[0]);
  auto b = engine.Submit(same[1]);
  ASSERT_TRUE(a.ok() && b.ok());
  for (auto* stream : {&*a, &*b}) {
    while (!(*stream)->Next(std::chrono::seconds(10)).finished) {
    }
  }
  EXPECT_EQ((*a)->cached_tokens(), 0);
  EXPECT_EQ((*b)->cached_tokens(), 48);
  engine.Shutdown();
  loop.join();
}

// Echo with logprobs: each prompt token after the first gets the log-probability the model gives
// it after the tokens before it (and its alternatives), once, through chunked prompts, preemption
// and a prefix cache that already holds the prompt (which such a request does not take).
TEST_F(EngineTest, PromptLogprobsAreTheModelsAtEveryPosition) {
  const int64_t V = model_->config().vocab_size;
  auto reference = [&](const std::vector<int32_t>& prompt, size_t q) {
    auto cache = *model_->NewKvCache(256);
    SequenceKv kv;
    std::vector<SequenceChunk> chunks = {
        {std::vector<int32_t>(prompt.begin(), prompt.begin() + q), &kv}};
    std::vector<float> logits;
    EXPECT_TRUE(model_->Forward(chunks, *cache, logits).ok());
    double m = -INFINITY, z = 0;
    for (int64_t v = 0; v < V; ++v) m = std::max<double>(m, logits[v]);
    for (int64_t v = 0; v < V; ++v) z += std::exp(logits[v] - m);
    std::vector<std::pair<double, int32_t>> all;
    for (int64_t v = 0; v < V; ++v) all.push_back({logits[v] - m - std::log(z), v});
    std::stable_sort(all.begin(), all.end(), [](auto a, auto b) { return a.first > b.first; });
    return std::pair(all, logits[prompt[q]] - m - std::log(z));
  };
  std::vector<GenerationRequest> reqs = requests_;
  for (GenerationRequest& r : reqs) {
    for (int k = 0; k < 20; ++k) r.prompt_ids.push_back(5 + (k * 11) % 90);
    r.prompt_logprobs = 3;
  }
  reqs[1].prompt_logprobs = 0;
  reqs[2].prompt_logprobs = -1;  // not asked
  for (const bool cramped : {false, true}) {
    LocalExecutor exec(model_.get(), cramped ? 64 : 4096);
    Engine engine(&exec, cramped ? Cramped(exec) : exec.Options());
    std::thread loop([&] { ASSERT_TRUE(engine.Run().ok()); });
    // The same prompts sent before without logprobs, one at a time: the last one's blocks (the
    // others' too when the cache holds them) stay cached.
    for (GenerationRequest r : reqs) {
      r.prompt_logprobs = -1;
      int64_t cached = 0;
      RunOne(engine, r, &cached);
    }
    int64_t cached = 0;
    GenerationRequest again = reqs.back();
    again.prompt_logprobs = -1;
    RunOne(engine, again, &cached);
    EXPECT_GT(cached, 0) << "the prompts were meant to be cached";
    exec.resumed_ = 0;
    std::vector<std::shared_ptr<RequestStream>> streams;
    for (const GenerationRequest& r : reqs) streams.push_back(*engine.Submit(r));
    std::vector<GenerationResult> results;
    for (auto& stream : streams) results.push_back(Drain(*stream));
    engine.Shutdown();
    loop.join();
    const std::vector<GenerationResult>* got = &results;
    const std::vector<GenerationResult> want = *Generate(*model_, reqs);
    int64_t asked = 0;
    for (size_t i = 0; i < reqs.size(); ++i) {
      const std::vector<int32_t>& p = reqs[i].prompt_ids;
      EXPECT_EQ((*got)[i].tokens, want[i].tokens) << "request " << i;
      if (reqs[i].prompt_logprobs < 0) {
        EXPECT_TRUE((*got)[i].prompt_logprobs.empty());
        continue;
      }
      asked += static_cast<int64_t>(p.size()) - 1;
      ASSERT_EQ((*got)[i].prompt_logprobs.size(), p.size() - 1) << "request " << i;
      for (size_t q = 1; q < p.size(); ++q) {
        const SampledToken& t = (*got)[i].prompt_logprobs[q - 1];
        const auto [ranked, lp] = reference(p, q);
        EXPECT_EQ(t.id, p[q]);
        EXPECT_NEAR(t.logprob, lp, 1e-4) << "request " << i << " position " << q;
        ASSERT_EQ(t.top.size(), static_cast<size_t>(reqs[i].prompt_logprobs));
        for (size_t k = 0; k < t.top.size(); ++k) {
          EXPECT_NEAR(t.top[k].logprob, ranked[k].first, 1e-4);
          if (k + 1 < t.top.size()) EXPECT_GE(t.top[k].logprob, t.top[k + 1].logprob);
        }
      }
    }
    if (cramped) EXPECT_GT(exec.resumed_, 0) << "the cache was meant to force preemption";
    EXPECT_EQ(exec.scored_, asked) << "every prompt row scored once, none from the cache";
  }
}

TEST_F(EngineTest, RequestsJoinARunningBatchAndCancelFreesTheirCache) {
  const std::vector<GenerationResult> want = Reference();  // before the engine uses the model
  LocalExecutor exec(model_.get(), 4096);
  EngineOptions o = exec.Options();
  o.max_batch = 8;
  Engine engine(&exec, o);
  std::thread loop([&] { ASSERT_TRUE(engine.Run().ok()); });
  GenerationRequest endless = requests_[0];
  endless.params.max_tokens = 240;  // the model context is 256
  auto a = engine.Submit(endless);
  ASSERT_TRUE(a.ok());
  ASSERT_FALSE((*a)->Next(std::chrono::seconds(10)).tokens.empty());  // running
  auto b = engine.Submit(requests_[1]);                               // joins it
  ASSERT_TRUE(b.ok());
  std::vector<int32_t> b_tokens;
  for (;;) {
    auto u = (*b)->Next(std::chrono::seconds(10));
    for (auto& t : u.tokens) b_tokens.push_back(t.id);
    if (u.finished) break;
  }
  EXPECT_EQ(b_tokens, want[1].tokens);
  const int before = exec.releases_;
  (*a)->Cancel();
  for (int i = 0; i < 1000 && exec.releases_ == before; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_GT(exec.releases_, before) << "a cancelled sequence's cache must be released";
  engine.Shutdown();
  loop.join();
}

// Flow control in the batch: streams of `requests` submitted to a running engine in order (each
// once the previous ones run, `wait_running` of them), drained on threads; the order in which
// they finished.
std::vector<int> FinishOrder(Engine& engine, const std::vector<GenerationRequest>& requests,
                             size_t wait_running) {
  std::vector<std::shared_ptr<RequestStream>> streams;
  std::vector<std::thread> drains;
  absl::Mutex mu;
  std::vector<int> order;
  for (size_t i = 0; i < requests.size(); ++i) {
    auto s = engine.Submit(requests[i]);
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) break;
    streams.push_back(*s);
    if (i + 1 == wait_running) {  // the first ones hold the batch before the others come
      for (int k = 0; k < 2000 && engine.running() < static_cast<int>(wait_running); ++k) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  }
  for (size_t i = 0; i < streams.size(); ++i) {
    drains.emplace_back([&, i] {
      Drain(*streams[i]);
      absl::MutexLock lock(&mu);
      order.push_back(static_cast<int>(i));
    });
  }
  for (std::thread& t : drains) t.join();
  return order;
}

// A more urgent request (a lower vLLM priority) arriving at a full batch takes the slot of the
// least urgent running sequence (preempted, resumed later with the same tokens) and finishes
// first; the less urgent ones' answers are unchanged.
TEST_F(EngineTest, AMoreUrgentRequestPreemptsTheLeastUrgent) {
  const std::vector<GenerationResult> want = Reference();
  LocalExecutor exec(model_.get(), 4096);
  EngineOptions o = exec.Options();
  o.max_batch = 2;
  Engine engine(&exec, o);
  std::thread loop([&] { ASSERT_TRUE(engine.Run().ok()); });
  std::vector<GenerationRequest> reqs = {requests_[0], requests_[1], requests_[2]};
  reqs[0].params.max_tokens = reqs[1].params.max_tokens = 200;
  reqs[0].priority = 5;
  reqs[1].priority = 3;
  reqs[2].priority = 0;
  const std::vector<int> order = FinishOrder(engine, reqs, 2);
  ASSERT_EQ(order.size(), 3u);
  EXPECT_EQ(order[0], 2) << "the urgent request waited for a slot";
  EXPECT_GT(exec.resumed_, 0) << "the least urgent sequence was meant to give up its slot";
  engine.Shutdown();
  loop.join();
  // Submitted before the engine runs, with one slot: by priority, then in order.
  LocalExecutor exec2(model_.get(), 4096);
  o = exec2.Options();
  o.max_batch = 1;
  o.exit_when_idle = true;
  Engine engine2(&exec2, o);
  std::vector<GenerationRequest> queued = {requests_[0], requests_[1], requests_[2]};
  queued[0].priority = queued[1].priority = 2;
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& r : queued) streams.push_back(*engine2.Submit(r));
  std::vector<int> done;
  std::thread run([&] { ASSERT_TRUE(engine2.Run().ok()); });
  for (int i : {2, 0, 1}) {
    EXPECT_EQ(Drain(*streams[i]).tokens, want[i].tokens) << "request " << i;
    done.push_back(i);
  }
  run.join();
}

// Weighted fair sharing between tenants: one tenant's flood holds the batch; another tenant's
// request takes a slot at once (the flood's newest sequence preempted) and finishes before the
// flood does. With weights 3 : 1 the batch of 4 is shared 3 : 1 while both wait.
TEST_F(EngineTest, TenantsShareTheBatchByWeight) {
  LocalExecutor exec(model_.get(), 4096);
  EngineOptions o = exec.Options();
  o.max_batch = 4;
  Engine engine(&exec, o);
  std::thread loop([&] { ASSERT_TRUE(engine.Run().ok()); });
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 6; ++i) {
    GenerationRequest r = requests_[i % requests_.size()];
    r.params.max_tokens = 150;
    r.tenant = "flood";
    reqs.push_back(r);
  }
  GenerationRequest other = requests_[1];
  other.params.max_tokens = 20;
  other.tenant = "other";
  reqs.push_back(other);
  const std::vector<int> order = FinishOrder(engine, reqs, 4);
  ASSERT_EQ(order.size(), 7u);
  EXPECT_EQ(order[0], 6) << "the other tenant's request waited behind the flood";
  engine.Shutdown();
  loop.join();

  // Weights: a flood of each, queued together; while both wait, the 4 slots go 3 : 1.
  LocalExecutor exec2(model_.get(), 4096);
  o = exec2.Options();
  o.max_batch = 4;
  Engine engine2(&exec2, o);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (int i = 0; i < 8; ++i) {
    GenerationRequest r = requests_[i % requests_.size()];
    r.params.max_tokens = 100;
    r.tenant = i % 2 ? "heavy" : "light";
    r.weight = i % 2 ? 3.0 : 1.0;
    streams.push_back(*engine2.Submit(r));
  }
  std::thread loop2([&] { ASSERT_TRUE(engine2.Run().ok()); });
  // The order of the first tokens: the first 4 are the first admitted.
  absl::Mutex mu;
  std::vector<int> first;
  std::vector<std::thread> readers;
  for (int i = 0; i < 8; ++i) {
    readers.emplace_back([&, i] {
      while (streams[i]->Next(std::chrono::seconds(10)).tokens.empty()) {
      }
      absl::MutexLock lock(&mu);
      first.push_back(i);
    });
  }
  for (std::thread& t : readers) t.join();
  const int heavy = static_cast<int>(
      std::count_if(first.begin(), first.begin() + 4, [](int i) { return i % 2 == 1; }));
  EXPECT_EQ(heavy, 3) << "of the first 4 admitted";
  engine2.Shutdown();
  loop2.join();
}

TEST_F(EngineTest, ShutdownDrainsTheRequestsItHas) {
  LocalExecutor exec(model_.get(), 4096);
  Engine engine(&exec, exec.Options());
  auto a = engine.Submit(requests_[2]);
  ASSERT_TRUE(a.ok());
  engine.Shutdown(std::chrono::seconds(60));
  EXPECT_FALSE(engine.accepting());
  EXPECT_EQ(engine.Submit(requests_[3]).status().code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE(engine.Run().ok());
  std::vector<int32_t> tokens;
  RequestStream::Update u = (*a)->Next(std::chrono::seconds(1));
  for (auto& t : u.tokens) tokens.push_back(t.id);
  EXPECT_EQ(u.finish_reason, "length");
  EXPECT_EQ(tokens, Reference()[2].tokens);
}

TEST_F(EngineTest, SubmitRefusesBadRequestsAndAFullQueue) {
  LocalExecutor exec(model_.get(), 256);
  EngineOptions o = exec.Options();
  o.max_batch = 1;
  o.max_queue = 1;
  Engine engine(&exec, o);
  GenerationRequest r = requests_[0];
  r.prompt_ids = {};
  EXPECT_EQ(engine.Submit(r).status().code(), absl::StatusCode::kInvalidArgument);
  r.prompt_ids = {1, 100000};
  EXPECT_NE(engine.Submit(r).status().message().find("outside the vocabulary"), std::string::npos);
  r.prompt_ids = {1, 2};
  r.params.max_tokens = 300;  // beyond the 256-token cache
  EXPECT_NE(engine.Submit(r).status().message().find("maximum context length is 256"),
            std::string::npos);
  r.params.max_tokens = 4;
  // A queue place per request: five sequences of one request take the free batch slot's place.
  ASSERT_TRUE(engine.SubmitGroup({r, r, r, r, r}).ok());
  ASSERT_TRUE(engine.Submit(r).ok());  // queued
  EXPECT_EQ(engine.Submit(r).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(engine.queue_depth(), 2u);
}

// One request's many sequences (prompts x n) fill the batch; another request that arrives then
// gets a slot within a few steps (a sequence of the big request is preempted for it) instead of
// waiting for the big one's sequences to end: with no tenant, and with both requests of one
// tenant (as the API names every request's tenant, "anonymous" without keys).
TEST_F(EngineTest, ABigRequestLeavesAnotherItsShareOfTheBatch) {
  for (const std::string tenant : {"", "anonymous"}) {
    SCOPED_TRACE(absl::StrCat("tenant '", tenant, "'"));
    LocalExecutor exec(model_.get(), 4096);
    exec.pause_at_ = 3;  // the big request fills the batch by then
    EngineOptions o = exec.Options();
    o.max_batch = 4;
    Engine engine(&exec, o);
    GenerationRequest long_one = requests_[0];
    long_one.params.max_tokens = 60;
    long_one.tenant = tenant;
    auto big = engine.SubmitGroup(std::vector<GenerationRequest>(12, long_one));
    ASSERT_TRUE(big.ok());
    std::thread loop([&] { ASSERT_TRUE(engine.Run().ok()); });
    exec.paused_.WaitForNotification();
    EXPECT_EQ(engine.running(), 4);
    GenerationRequest plain = requests_[1];
    plain.params.max_tokens = 4;
    plain.tenant = tenant;
    auto small = engine.Submit(plain);  // sequence 12
    ASSERT_TRUE(small.ok());
    exec.resume_.Notify();
    RequestStream::Update u;
    while (!u.finished) u = (*small)->Next(std::chrono::seconds(30));
    EXPECT_EQ(u.finish_reason, "length");
    // First come, first served, it would wait for a big sequence to end: 60 steps.
    const int first = exec.FirstTokenStep(12);
    EXPECT_GE(first, 0);
    EXPECT_LE(first - exec.pause_at_, 3) << "steps the plain request waited for its first token";
    for (auto& st : *big) st->Cancel();
    engine.Shutdown();
    loop.join();
  }
}

// A constraint whose mask never comes (a hostile grammar): Allowed runs until cancelled.
class StuckConstraint : public TokenConstraint {
 public:
  absl::Status Allowed(std::vector<uint32_t>* mask) override {
    for (int i = 0; i < 30000 && !cancelled_->load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return absl::InvalidArgumentError("cancelled");
  }
  absl::Status Accept(int32_t) override { return absl::OkStatus(); }
  bool Finished() const override { return false; }
  void Cancel() override { cancelled_->store(true); }
  std::unique_ptr<TokenConstraint> Clone() const override {
    return std::make_unique<StuckConstraint>();
  }
  std::shared_ptr<std::atomic<bool>> cancelled_ = std::make_shared<std::atomic<bool>>(false);
};

// Its mask past mask_timeout ends that sequence with a 400-class error naming the grammar; the
// others give their own answers, unaffected.
TEST_F(EngineTest, AGrammarPastItsMaskTimeEndsOnlyItsSequence) {
  const std::vector<GenerationResult> want = Reference();
  LocalExecutor exec(model_.get(), 4096);
  EngineOptions o = exec.Options();
  o.mask_timeout = std::chrono::milliseconds(300);
  Engine engine(&exec, o);
  std::vector<std::shared_ptr<RequestStream>> streams;
  auto stuck = std::make_shared<StuckConstraint>();
  for (size_t i = 0; i < requests_.size(); ++i) {
    GenerationRequest r = requests_[i];
    if (i == 2) r.constraint = stuck;
    streams.push_back(*engine.Submit(r));
  }
  std::thread loop([&] { ASSERT_TRUE(engine.Run().ok()); });
  for (size_t i = 0; i < streams.size(); ++i) {
    std::vector<int32_t> tokens;
    RequestStream::Update u;
    while (!u.finished) {
      u = streams[i]->Next(std::chrono::seconds(30));
      for (auto& t : u.tokens) tokens.push_back(t.id);
    }
    if (i == 2) {
      EXPECT_EQ(u.status.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(std::string(u.status.message()), ::testing::HasSubstr("took longer than 300 ms"));
      EXPECT_TRUE(tokens.empty());
      EXPECT_TRUE(stuck->cancelled_->load()) << "the mask in progress must be stopped";
    } else {
      EXPECT_TRUE(u.status.ok()) << u.status;
      EXPECT_EQ(tokens, want[i].tokens) << "request " << i;
    }
  }
  engine.Shutdown();
  loop.join();
}

TEST_F(EngineTest, AReplicaFailureEndsEveryRequestWithTheError) {
  LocalExecutor exec(model_.get(), 4096);
  exec.fail_after_ = 3;
  Engine engine(&exec, exec.Options());
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& r : requests_) streams.push_back(*engine.Submit(r));
  const absl::Status s = engine.Run();
  EXPECT_NE(s.message().find("rank 1 died"), std::string::npos);
  for (auto& st : streams) {
    auto u = st->Next(std::chrono::seconds(1));
    EXPECT_TRUE(u.finished);
    EXPECT_EQ(u.status.code(), absl::StatusCode::kUnavailable);
  }
  EXPECT_FALSE(engine.healthy());
  EXPECT_EQ(engine.Submit(requests_[0]).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace shardserve
