// Disaggregated prefill and decode between two real replicas (serve/rank_runtime.h,
// serve/engine.h): every rank a thread of this process, meeting at its replica's rendezvous, with
// its mesh, shared memory and, between the replicas, UCX as in pods. A prefill replica computes
// each prompt and offers its KV; a decode replica sharded otherwise (another TP, another PP) takes
// each rank's heads and layers of it and decodes. The tokens and log-probabilities equal the
// colocated ones; a transfer that fails (a ticket never offered) prefills on the decode replica,
// with the same answer.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "comm/socket.h"
#include "common/status.h"
#include "model/generator.h"
#include "model/test_models.h"
#include "model/transformer.h"
#include "serve/engine.h"
#include "serve/rank_runtime.h"

namespace shardserve {
namespace {

using testing::SmallModel;
using testing::TempDir;
using testing::WriteModel;

struct Shape {
  int tp, pp;
};

// Runs one replica of the model (tp x pp ranks, each a thread) until its leader's `lead` returns.
absl::Status RunReplica(const std::string& model, const std::string& secret_file, Shape shape,
                        const std::string& role, const std::string& job, const LeaderMain& lead) {
  absl::StatusOr<int> port = ChooseFreePort("127.0.0.1");
  if (!port.ok()) return port.status();
  std::vector<absl::Status> outcomes(shape.tp * shape.pp);
  std::vector<std::thread> ranks;
  for (int r = 0; r < shape.tp * shape.pp; ++r) {
    ranks.emplace_back([&, r] {
      WorkerEnv env;
      env.model_path = model;
      env.tp = shape.tp;
      env.pp = shape.pp;
      env.stage = r / shape.tp;
      env.tp_rank = r % shape.tp;
      env.metrics = false;
      env.kv_role = role;
      env.job_id = absl::StrCat(job, "-", getpid());  // test processes may run at once
      env.kv_cache_tokens = 1024;
      env.leader_addr = absl::StrCat("127.0.0.1:", *port);
      env.rendezvous_secret_file = secret_file;
      outcomes[r] = [&]() -> absl::Status {
        ASSIGN_OR_RETURN(RankConfig cfg, RankConfigFrom(env));
        ASSIGN_OR_RETURN(WorldConfig world, WorldConfig::Create(env.tp, env.pp, r));
        return RunRank(cfg, world, r == 0 ? lead : nullptr).status();
      }();
    });
  }
  for (std::thread& t : ranks) t.join();
  for (const absl::Status& s : outcomes) RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

class DisaggregationTest : public ::testing::TestWithParam<std::pair<Shape, Shape>> {
 protected:
  void SetUp() override {
    auto o = SmallModel("llama", dir_.Sub("m"));
    o.layers = 4;
    model_ = WriteModel(o);
    secret_ = dir_.Sub("secret");
    std::ofstream(secret_) << "0123456789abcdef0123456789abcdef";
    for (int i = 0; i < 4; ++i) {
      GenerationRequest r;
      // 21 to 51 tokens: whole blocks and a partial one.
      for (int k = 0; k < 21 + 10 * i; ++k) r.prompt_ids.push_back((7 * k + 3 * i) % 390 + 5);
      r.params.max_tokens = 8;
      r.params.ignore_eos = true;
      r.params.top_logprobs = 2;
      if (i % 2 == 1) {  // sampled, seeded, penalized: the decode side continues its stream
        r.params.temperature = 0.9f;
        r.params.seed = 11 + i;
        r.params.repetition_penalty = 1.3f;
      }
      requests_.push_back(r);
    }
  }

  // Colocated: one process, the plain generator.
  std::vector<GenerationResult> Reference() {
    auto model = Transformer::Load(model_, {});
    EXPECT_TRUE(model.ok()) << model.status();
    return *Generate(**model, requests_);
  }

  // The prefill replica offers each prompt's KV (the first of `forged` tickets replaced by one
  // never offered); the decode replica takes them and decodes. Returns the decode side's
  // results and its import outcomes.
  std::vector<GenerationResult> Disaggregated(Shape prefill, Shape decode, int forged,
                                              std::vector<absl::Status>* imports) {
    std::vector<SequenceKvRole> handoffs(requests_.size());
    absl::Notification handed, decoded;
    absl::Status prefill_status, decode_status;
    std::thread prefill_replica([&] {
      prefill_status = RunReplica(
          model_, secret_, prefill, "prefill", "disagg-p", [&](LeaderContext& ctx) -> absl::Status {
            EngineOptions o = ctx.engine;
            Engine engine(ctx.executor, o);
            // The decode replica tells the leader when it is done with an offer.
            ctx.on_kv_release([&engine](const KvTicket& t) { engine.ReleaseOffer(t); });
            std::thread run([&] { EXPECT_TRUE(engine.Run().ok()); });
            std::vector<std::shared_ptr<RequestStream>> streams;
            for (const GenerationRequest& r : requests_) {
              SequenceKvRole role;
              role.offer = true;
              streams.push_back((*engine.SubmitGroup({r}, {role}))[0]);
            }
            std::vector<KvTicket> tickets;
            for (size_t i = 0; i < streams.size(); ++i) {
              RequestStream::Update u;
              while (!u.finished) {
                RequestStream::Update more = streams[i]->Next(std::chrono::milliseconds(100));
                u.tokens.insert(u.tokens.end(), more.tokens.begin(), more.tokens.end());
                u.finished = more.finished;
                u.finish_reason = more.finish_reason;
              }
              EXPECT_EQ(u.finish_reason, "offered");
              EXPECT_EQ(u.tokens.size(), 1u);
              auto source = std::make_shared<SequenceKvRole::Source>();
              source->ticket = *streams[i]->kv_offer();
              tickets.push_back(source->ticket);
              if (static_cast<int>(i) < forged) source->ticket[0] ^= 1;  // never offered
              source->shape = ctx.kv_shape;
              source->addresses = ctx.kv_addresses;
              source->first = u.tokens[0];
              handoffs[i].import = std::move(source);
            }
            EXPECT_GT(engine.kv_used_blocks(), 0);  // held for the decode replica
            handed.Notify();
            decoded.WaitForNotification();
            // The decode replica released every offer it took: only forged ones' stay held.
            const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
            while (forged == 0 && engine.kv_used_blocks() > 0 &&
                   std::chrono::steady_clock::now() < until) {
              std::this_thread::sleep_for(std::chrono::milliseconds(20));
            }
            if (forged == 0) EXPECT_EQ(engine.kv_used_blocks(), 0);
            for (const KvTicket& t : tickets) engine.ReleaseOffer(t);
            engine.Shutdown(std::chrono::milliseconds(1000));
            run.join();
            ctx.on_kv_release(nullptr);
            return absl::OkStatus();
          });
      if (!handed.HasBeenNotified()) handed.Notify();
    });
    std::vector<GenerationResult> results(requests_.size());
    decode_status = RunReplica(
        model_, secret_, decode, "decode", "disagg-d", [&](LeaderContext& ctx) -> absl::Status {
          handed.WaitForNotification();
          EngineOptions o = ctx.engine;
          o.exit_when_idle = true;
          absl::Mutex mu;
          EngineObserver observer;
          observer.kv_import = [&](double, int64_t, const absl::Status& s) {
            absl::MutexLock lock(&mu);
            imports->push_back(s);
          };
          Engine engine(ctx.executor, o, observer);
          std::vector<std::shared_ptr<RequestStream>> streams;
          for (size_t i = 0; i < requests_.size(); ++i) {
            auto s = engine.SubmitGroup({requests_[i]}, {handoffs[i]});
            if (!s.ok()) return s.status();
            streams.push_back((*s)[0]);
          }
          absl::Status ran = engine.Run();
          for (size_t i = 0; i < streams.size(); ++i) {
            RequestStream::Update u = streams[i]->Next(std::chrono::milliseconds(0));
            for (RequestStream::Token& t : u.tokens) {
              results[i].tokens.push_back(t.id);
              results[i].logprobs.push_back(t.logprob);
              results[i].top_logprobs.push_back(t.top);
            }
            results[i].finish_reason = u.finish_reason;
          }
          decoded.Notify();
          return ran;
        });
    if (!decoded.HasBeenNotified()) decoded.Notify();
    prefill_replica.join();
    EXPECT_TRUE(prefill_status.ok()) << prefill_status;
    EXPECT_TRUE(decode_status.ok()) << decode_status;
    return results;
  }

  void ExpectSame(const std::vector<GenerationResult>& got,
                  const std::vector<GenerationResult>& want) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].tokens, want[i].tokens) << "request " << i;
      EXPECT_EQ(got[i].finish_reason, want[i].finish_reason) << "request " << i;
      ASSERT_EQ(got[i].logprobs.size(), want[i].logprobs.size());
      for (size_t k = 0; k < got[i].logprobs.size(); ++k) {
        EXPECT_NEAR(got[i].logprobs[k], want[i].logprobs[k], 1e-4) << "request " << i;
        ASSERT_EQ(got[i].top_logprobs[k].size(), want[i].top_logprobs[k].size());
        for (size_t j = 0; j < got[i].top_logprobs[k].size(); ++j) {
          EXPECT_EQ(got[i].top_logprobs[k][j].id, want[i].top_logprobs[k][j].id);
        }
      }
    }
  }

  TempDir dir_;
  std::string model_, secret_;
  std::vector<GenerationRequest> requests_;
};

TEST_P(DisaggregationTest, DecodeAfterAnotherReplicasPrefillGivesTheColocatedAnswers) {
  const auto [prefill, decode] = GetParam();
  std::vector<absl::Status> imports;
  ExpectSame(Disaggregated(prefill, decode, /*forged=*/0, &imports), Reference());
  ASSERT_EQ(imports.size(), requests_.size());
  for (const absl::Status& s : imports) EXPECT_TRUE(s.ok()) << s;
}

TEST_P(DisaggregationTest, ARefusedTransferIsPrefilledOnTheDecodeReplica) {
  const auto [prefill, decode] = GetParam();
  std::vector<absl::Status> imports;
  ExpectSame(Disaggregated(prefill, decode, /*forged=*/2, &imports), Reference());
  ASSERT_EQ(imports.size(), requests_.size());
  int refused = 0, pulled = 0;
  for (const absl::Status& s : imports) {
    refused += s.code() == absl::StatusCode::kPermissionDenied;
    pulled += s.ok();
  }
  EXPECT_EQ(std::pair(refused, pulled), std::pair(2, 2));
}

INSTANTIATE_TEST_SUITE_P(Shapes, DisaggregationTest,
                         ::testing::Values(std::pair(Shape{2, 1}, Shape{1, 2}),
                                           std::pair(Shape{1, 2}, Shape{2, 1}),
                                           std::pair(Shape{2, 2}, Shape{1, 1})));

}  // namespace
}  // namespace shardserve
