// The router (router/router.h) in front of two fake leaders on real sockets: it follows their KV
// events streams, sends a prompt to the one that caches its blocks, fails over when that one
// answers 503 (draining), relays a stream piece by piece, answers 401 itself without a key, and
// stops routing by a replica's cache once its stream ends.
#include "router/router.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "http/server.h"
#include "http/upstream.h"
#include "model/test_models.h"
#include "serve/kv_events.h"
#include "serve/prefix_cache.h"

namespace shardserve {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

// A leader as the router sees it: /v1/kv-events with a snapshot of `cached`, and completions
// answered with `status` and its name (as SSE pieces when the request streams).
class FakeLeader {
 public:
  // `adapters`: the LoRA adapters in its slots (of 2), as its load reports say.
  FakeLeader(std::string name, std::vector<BlockHash> cached,
             std::vector<std::string> adapters = {})
      : name_(std::move(name)), cached_(std::move(cached)), adapters_(std::move(adapters)) {
    http::Routes routes;
    routes.GetBlocking("/v1/kv-events", [this](const http::Request&, http::Exchange& ex) {
      if (!ex.StartStream({200, "application/x-ndjson", "", {}})) return;
      const int run = run_.load();  // a new run of the leader: a new epoch, a new stream
      std::string out = EncodeKvHello("m", 4, absl::StrCat(name_, run)) + "\n";
      for (const std::string& l : EncodeKvSnapshot(cached_)) out += l + "\n";
      if (!ex.Write(out)) return;
      while (!stop_stream_.load() && !ex.ClientGone() && run_.load() == run) {
        ReplicaLoad load{0, 0, max_batch_.load(), 0, 100};
        load.accepting = accepting_.load();
        if (!adapters_.empty()) {
          load.max_loras = 2;
          load.adapters = adapters_;
        }
        if (!ex.Write(EncodeKvLoad(load) + "\n")) return;
        std::this_thread::sleep_for(50ms);
      }
      ex.End();
    });
    routes.PostBlocking("/v1/completions", [this](const http::Request& req, http::Exchange& ex) {
      const int n = ++requests_;
      {
        absl::MutexLock lock(&mu_);
        bodies_.push_back(req.body);
      }
      if (req.body.find("\"stream\": true") != std::string::npos) {
        // The first piece, then the rest only once the client has it (go_): a router that
        // waited for the whole answer would never pass it on.
        if (!ex.StartStream({200, "text/event-stream", "", {}})) return;
        if (die_at_start_.load()) return;  // its process died before its first token
        ex.Write(absl::StrCat("data: ", name_, "0\n\n"));
        if (die_mid_stream_.load()) return;  // cut short, as when the leader's process dies
        for (int i = 0; i < 1000 && n > released_.load() && !go_.HasBeenNotified(); ++i) {
          std::this_thread::sleep_for(10ms);
        }
        for (int i = 1; i < 3; ++i) ex.Write(absl::StrCat("data: ", name_, i, "\n\n"));
        ex.Write("data: [DONE]\n\n");
        return ex.End();
      }
      ex.Respond(
          {status_.load(), "application/json", absl::StrCat("{\"from\":\"", name_, "\"}"), {}});
    });
    routes.PostBlocking("/v1/load_lora_adapter",
                        [this](const http::Request& req, http::Exchange& ex) {
                          ++lora_calls_;
                          {
                            absl::MutexLock lock(&mu_);
                            lora_auth_ = req.Header("authorization");
                          }
                          ex.Respond({lora_status_.load(),
                                      "text/plain",
                                      absl::StrCat(name_, " ", req.Header("authorization")),
                                      {}});
                        });
    http::ServerOptions o;
    o.host = "127.0.0.1";
    server_ = *http::Server::Start(o, std::move(routes));
  }
  int port() const { return server_->port(); }
  std::string address() const { return absl::StrCat("127.0.0.1:", port()); }

  std::string name_;
  std::vector<BlockHash> cached_;
  const std::vector<std::string> adapters_;
  std::atomic<int> status_{200};
  std::atomic<int> requests_{0};
  std::atomic<int> lora_status_{200}, lora_calls_{0};
  std::atomic<int> run_{0};  // its leader's run (the epoch its hello says)
  std::atomic<bool> stop_stream_{false};
  std::atomic<bool> accepting_{true};
  std::atomic<bool> die_mid_stream_{false};
  std::atomic<bool> die_at_start_{false};
  std::atomic<int64_t> max_batch_{8};
  // A stream's rest is sent once go_ is notified, or once released_ reaches its number.
  absl::Notification go_;
  std::atomic<int> released_{0};
  absl::Mutex mu_;
  std::vector<std::string> bodies_ ABSL_GUARDED_BY(mu_);  // the requests, as they came
  std::string lora_auth_ ABSL_GUARDED_BY(mu_);            // the last adapter load's key
  std::unique_ptr<http::Server> server_;
};

class RouterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = testing::WriteModel(testing::SmallModel("llama", dir_.Sub("m")));
    for (int i = 1; i <= 12; ++i) prompt_.push_back(i);
  }
  std::unique_ptr<Router> Start(const std::vector<std::string>& leaders,
                                const std::string& keys_file = "",
                                const std::string& token_file = "", int queue_max = 256,
                                SloTargets slo = {}) {
    RouterOptions o;
    o.queue_max = queue_max;
    o.queue_timeout = 3s;
    o.slo = slo;
    o.model_name = "m";
    o.host = "127.0.0.1";
    o.port = 0;
    o.leaders = leaders;
    o.model_path = model_;
    o.model_label = "m";
    o.api_keys_file = keys_file;
    o.leader_token_file = token_file;
    o.resolve_every = 100ms;
    auto r = Router::Start(o);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *std::move(r) : nullptr;
  }
  // /readyz's count of routable replicas, once it reaches `want` (or the last seen).
  int Routable(Router& r, int want) {
    int n = -1;
    for (int i = 0; i < 100 && n != want; ++i) {
      auto res = http::Fetch("127.0.0.1", r.port(), "GET", "/readyz", {}, "", 5s);
      n = res.ok() && res->status == 200
              ? std::atoi(res->body.substr(res->body.find("replicas\":") + 10).c_str())
              : 0;
      if (n != want) std::this_thread::sleep_for(50ms);
    }
    return n;
  }
  std::string Body(bool stream = false, const std::string& model = "m",
                   const std::string& extra = "") {
    std::string ids;
    for (int32_t t : prompt_) absl::StrAppend(&ids, ids.empty() ? "" : ",", t);
    return absl::StrCat("{\"model\": \"", model, "\", \"prompt\": [", ids, "]",
                        stream ? ", \"stream\": true" : "", extra, "}");
  }
  absl::StatusOr<http::ClientResponse> Post(Router& r, bool stream = false,
                                            http::Headers headers = {},
                                            const std::string& model = "m") {
    headers.emplace_back("Content-Type", "application/json");
    return http::Fetch("127.0.0.1", r.port(), "POST", "/v1/completions", headers,
                       Body(stream, model), 10s);
  }
  static std::string Header(const http::ClientResponse& r, const std::string& name) {
    for (const auto& [k, v] : r.headers) {
      if (k == name) return v;
    }
    return "";
  }
  // Its /metrics, with the router token when the test gave one (`token_`).
  std::string Metrics(Router& r) {
    http::Headers h;
    if (!token_.empty()) h.emplace_back("Authorization", "Bearer " + token_);
    return http::Fetch("127.0.0.1", r.port(), "GET", "/metrics", h, "", 5s)->body;
  }
  // The requests the router holds, once they are `want` (or the last seen after 2 s).
  int QueueDepth(Router& r, int want) {
    const std::string series = "shardserve_router_queue_depth{model=\"m\"} ";
    int n = -1;
    for (int i = 0; i < 100 && n != want; ++i) {
      const std::string m = Metrics(r);
      const size_t at = m.find(series);
      n = at == std::string::npos ? -1 : std::atoi(m.c_str() + at + series.size());
      if (n != want) std::this_thread::sleep_for(20ms);
    }
    return n;
  }

  testing::TempDir dir_;
  std::string model_;
  std::string token_;
  std::vector<int32_t> prompt_;
};

TEST_F(RouterTest, ThePromptGoesWhereItsBlocksAreCachedAndFailsOverOn503) {
  FakeLeader a("A", HashBlocks(prompt_, 4)), b("B", {});
  auto router = Start({a.address(), b.address()});
  ASSERT_NE(router, nullptr);
  ASSERT_EQ(Routable(*router, 2), 2);
  for (int i = 0; i < 3; ++i) {  // every time, not by turn
    auto r = Post(*router);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->body, "{\"from\":\"A\"}");
    EXPECT_EQ(Header(*r, "x-shardserve-replica"), a.address());
  }
  EXPECT_EQ(b.requests_.load(), 0);
  // A drains (503): the request goes on to B.
  a.status_ = 503;
  auto r = Post(*router);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, "{\"from\":\"B\"}");
  const std::string m = Metrics(*router);
  EXPECT_THAT(m, HasSubstr("shardserve_router_decisions_total{model=\"m\",reason=\"prefix\"} 4"));
  EXPECT_THAT(m, HasSubstr("shardserve_router_failovers_total{model=\"m\"} 1"));
  EXPECT_THAT(m, HasSubstr("shardserve_router_prompt_tokens_total{model=\"m\"} 48"));
  EXPECT_THAT(m, HasSubstr("shardserve_router_expected_cached_tokens_total{model=\"m\"} 48"));
  EXPECT_THAT(m, HasSubstr(absl::StrCat("shardserve_router_replica_cached_blocks{model=\"m\","
                                        "replica=\"",
                                        a.address(), "\"} 3")));
  // Its stream ends: A is no longer routed by its cache; the prompt goes by load.
  a.stop_stream_ = true;
  a.status_ = 200;
  EXPECT_EQ(Routable(*router, 1), 1);
  EXPECT_THAT(Metrics(*router), HasSubstr("state=\"unroutable\"} 1"));
}

// A request of a LoRA adapter goes to the replica whose load reports say the adapter is in one
// of its slots; a request of the base goes by load (in turn between idle replicas).
TEST_F(RouterTest, AnAdaptersRequestGoesWhereTheAdapterIsLoaded) {
  FakeLeader a("A", {}, {"legal"}), b("B", {}, {"sql", "legal"});
  auto router = Start({a.address(), b.address()});
  ASSERT_EQ(Routable(*router, 2), 2);
  // The load reports come every 50 ms: wait until the router has routed by B's adapters (a
  // request B got in turn, before its report came, says nothing).
  const std::string by_adapter =
      "shardserve_router_decisions_total{model=\"m\",reason=\"adapter\"}";
  for (int i = 0; i < 200 && Metrics(*router).find(by_adapter) == std::string::npos; ++i) {
    ASSERT_TRUE(Post(*router, false, {}, "sql").ok());
    std::this_thread::sleep_for(50ms);
  }
  ASSERT_THAT(Metrics(*router), HasSubstr(by_adapter));
  const int before = a.requests_.load();
  for (int i = 0; i < 4; ++i) {
    auto r = Post(*router, false, {}, "sql");
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->body, "{\"from\":\"B\"}");
  }
  EXPECT_EQ(a.requests_.load(), before);
  std::set<std::string> bases;  // both load 'legal' and the base: in turn
  for (int i = 0; i < 4; ++i) bases.insert(Post(*router, false, {}, "legal")->body);
  for (int i = 0; i < 4; ++i) bases.insert(Post(*router)->body);
  EXPECT_EQ(bases.size(), 2u);
}

// A replica that answers 404 for an adapter's request (it missed a runtime load) is passed over
// for one that serves it; when none does, the client hears the last one's 404. The base model's
// 404 is the replica's answer.
TEST_F(RouterTest, AnAdapterAReplicaDoesNotKnowIsAskedOfTheOthers) {
  FakeLeader a("A", {}), b("B", {});
  auto router = Start({a.address(), b.address()});
  ASSERT_EQ(Routable(*router, 2), 2);
  a.status_ = 404;
  for (int i = 0; i < 4; ++i) {  // both idle: A comes first in turn at least once
    auto r = Post(*router, false, {}, "math");
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->body, "{\"from\":\"B\"}");
  }
  EXPECT_GT(a.requests_.load(), 0);
  EXPECT_THAT(Metrics(*router), HasSubstr(absl::StrCat("shardserve_router_failovers_total{model="
                                                       "\"m\"} ",
                                                       a.requests_.load(), "\n")));
  b.status_ = 404;
  auto none = Post(*router, false, {}, "math");
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->status, 404);
  b.status_ = 200;
  int base_404 = 0;
  for (int i = 0; i < 4; ++i) base_404 += Post(*router)->status == 404;
  EXPECT_GT(base_404, 0);
}

// An admin's adapter load goes to every replica, with the admin's key; the answer says whether
// every one took it, and each one's answer when not.
TEST_F(RouterTest, AdapterLoadsGoToEveryReplica) {
  FakeLeader a("A", {}), b("B", {});
  auto router = Start({a.address(), b.address()});
  ASSERT_EQ(Routable(*router, 2), 2);
  auto load = [&] {
    return http::Fetch("127.0.0.1", router->port(), "POST", "/v1/load_lora_adapter",
                       {{"Authorization", "Bearer admin"}, {"Content-Type", "application/json"}},
                       R"({"lora_name":"sql","lora_path":"sql"})", 10s);
  };
  auto r = load();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 200);
  EXPECT_THAT(r->body, HasSubstr("Bearer admin"));  // the leaders saw the admin's key
  EXPECT_EQ(Header(*r, "x-shardserve-replicas"), "2");
  EXPECT_EQ(a.lora_calls_.load(), 1);
  EXPECT_EQ(b.lora_calls_.load(), 1);
  b.lora_status_ = 400;  // one refuses: 502 naming each one's answer
  r = load();
  EXPECT_EQ(r->status, 502);
  EXPECT_THAT(r->body, HasSubstr(absl::StrCat(b.address(), ": 400 B")));
  EXPECT_THAT(r->body, HasSubstr(absl::StrCat(a.address(), ": 200 A")));
  a.lora_status_ = 403;  // both refuse alike: their status
  b.lora_status_ = 403;
  EXPECT_EQ(load()->status, 403);
}

// A load some leader took is replayed, with the admin's key, to the replicas that did not take
// it: one that failed the load (5xx) until it takes it, and a leader's new run (which holds no
// runtime adapter); a refusal of its own (4xx) is not retried; an unload forgets it.
TEST_F(RouterTest, RuntimeAdaptersReachReplicasThatMissedThem) {
  FakeLeader a("A", {}), b("B", {});
  auto router = Start({a.address(), b.address()});
  ASSERT_EQ(Routable(*router, 2), 2);
  auto post = [&](const std::string& path, const std::string& body) {
    return http::Fetch("127.0.0.1", router->port(), "POST", path,
                       {{"Authorization", "Bearer admin"}, {"Content-Type", "application/json"}},
                       body, 10s);
  };
  auto until = [](const std::function<bool()>& f) {
    for (int i = 0; i < 200 && !f(); ++i) std::this_thread::sleep_for(20ms);
    return f();
  };
  b.lora_status_ = 503;  // B fails the load: the admin hears 502, the router goes on trying B
  auto r = post("/v1/load_lora_adapter", R"({"lora_name":"sql","lora_path":"sql"})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 502);
  EXPECT_TRUE(until([&] { return b.lora_calls_.load() >= 3; })) << b.lora_calls_.load();
  b.lora_status_ = 200;
  int calls = 0;
  EXPECT_TRUE(until([&] {  // taken: the calls stop
    const int before = b.lora_calls_.load();
    std::this_thread::sleep_for(300ms);
    calls = b.lora_calls_.load();
    return calls == before;
  }));
  EXPECT_EQ(a.lora_calls_.load(), 1);  // A took it at once
  {
    absl::MutexLock lock(&b.mu_);
    EXPECT_EQ(b.lora_auth_, "Bearer admin");
  }
  ++a.run_;  // A's leader starts anew: the router replays the load to it
  EXPECT_TRUE(until([&] { return a.lora_calls_.load() == 2; })) << a.lora_calls_.load();
  a.lora_status_ = 400;  // a refusal of its own ends the replays to it
  ++a.run_;
  EXPECT_TRUE(until([&] { return a.lora_calls_.load() == 3; })) << a.lora_calls_.load();
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ(a.lora_calls_.load(), 3);
  // Unloaded: a new run of B is not given it.
  post("/v1/unload_lora_adapter", R"({"lora_name":"sql"})");
  ++b.run_;
  ASSERT_EQ(Routable(*router, 2), 2);
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ(b.lora_calls_.load(), calls);
}

TEST_F(RouterTest, StreamsArePassedOnAsTheyCome) {
  FakeLeader a("A", HashBlocks(prompt_, 4)), b("B", {});
  auto router = Start({a.address(), b.address()});
  ASSERT_EQ(Routable(*router, 2), 2);
  auto call = http::UpstreamCall::Start("127.0.0.1", router->port(), "POST", "/v1/completions",
                                        {{"content-type", "application/json"}}, Body(true), 5s, 5s);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ((*call)->head().status, 200);
  EXPECT_EQ((*call)->head().content_type, "text/event-stream");
  // The first piece arrives while the leader still holds back the rest.
  std::string body;
  bool done = false;
  while (body.find("A0") == std::string::npos && !done) {
    auto piece = (*call)->Read(5s, &done);
    ASSERT_TRUE(piece.ok()) << "the first piece did not come before the rest: " << piece.status();
    body += *piece;
  }
  EXPECT_EQ(body, "data: A0\n\n");
  a.go_.Notify();
  while (!done) {
    auto piece = (*call)->Read(5s, &done);
    ASSERT_TRUE(piece.ok()) << piece.status();
    body += *piece;
  }
  EXPECT_EQ(body, "data: A0\n\ndata: A1\n\ndata: A2\n\ndata: [DONE]\n\n");
}

TEST_F(RouterTest, KeysAreCheckedBeforeAnyReplicaIsAsked) {
  FakeLeader a("A", {});
  testing::WriteFile(dir_.Sub("keys"), "sk-router-test-0123456789\n");
  auto router = Start({a.address()}, dir_.Sub("keys"));
  ASSERT_EQ(Routable(*router, 1), 1);
  auto r = Post(*router);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 401);
  EXPECT_EQ(Header(*r, "www-authenticate"), "Bearer");
  EXPECT_THAT(r->body, HasSubstr("\"code\":\"invalid_api_key\""));  // the leaders' answer
  // Its metrics are the deployment's: without a router token, nobody with keys reads them.
  EXPECT_EQ(http::Fetch("127.0.0.1", router->port(), "GET", "/metrics",
                        {{"Authorization", "Bearer sk-router-test-0123456789"}}, "", 5s)
                ->status,
            403);
  EXPECT_EQ(a.requests_.load(), 0);
  r = Post(*router, false, {{"Authorization", "Bearer sk-router-test-0123456789"}});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(a.requests_.load(), 1);
}

// The expected hits and the replicas' load are read with the router token, never with a
// tenant's API key.
TEST_F(RouterTest, MetricsNeedTheRouterTokenNotAnApiKey) {
  FakeLeader a("A", {});
  testing::WriteFile(dir_.Sub("keys"), "sk-router-test-0123456789\n");
  testing::WriteFile(dir_.Sub("token"), "router-token-0123456789abcdef\n");
  auto router = Start({a.address()}, dir_.Sub("keys"), dir_.Sub("token"));
  ASSERT_NE(router, nullptr);
  auto metrics = [&](const std::string& key) {
    return http::Fetch("127.0.0.1", router->port(), "GET", "/metrics",
                       {{"Authorization", "Bearer " + key}}, "", 5s)
        ->status;
  };
  EXPECT_EQ(metrics("sk-router-test-0123456789"), 401);
  EXPECT_EQ(metrics("router-token-0123456789abcdef"), 200);
}

// A leader that dies in the middle of a stream: the client gets an error event (never a clean
// end that looks like a finished answer), and the replica is out of routing at once.
TEST_F(RouterTest, AStreamCutShortEndsWithAnErrorAndTakesItsReplicaOut) {
  FakeLeader a("A", HashBlocks(prompt_, 4)), b("B", {});
  a.die_mid_stream_ = true;
  auto router = Start({a.address(), b.address()});
  ASSERT_EQ(Routable(*router, 2), 2);
  auto call = http::UpstreamCall::Start("127.0.0.1", router->port(), "POST", "/v1/completions",
                                        {{"content-type", "application/json"}}, Body(true), 5s, 5s);
  ASSERT_TRUE(call.ok()) << call.status();
  std::string body;
  bool done = false;
  while (!done) {
    auto piece = (*call)->Read(10s, &done);
    if (!piece.ok()) break;
    body += *piece;
  }
  EXPECT_THAT(body, HasSubstr("data: A0"));
  EXPECT_THAT(body, HasSubstr("\"error\""));
  EXPECT_THAT(body, HasSubstr("stopped answering"));
  EXPECT_THAT(body, ::testing::Not(HasSubstr("[DONE]")));
  auto res = http::Fetch("127.0.0.1", router->port(), "GET", "/readyz", {}, "", 5s);
  ASSERT_TRUE(res.ok());
  EXPECT_THAT(res->body, HasSubstr("\"routable_replicas\":1")) << "A must be out at once";
  // The next request goes to B, though A caches its prompt.
  auto r = Post(*router);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->body, "{\"from\":\"B\"}");
}

// A stream whose replica goes before its first token migrates; when no other replica takes
// requests at that moment (B drains: moving off a drained node), the router waits for one and
// the stream goes on there, whole.
TEST_F(RouterTest, AMigrationWaitsForAReplicaThatTakesRequests) {
  FakeLeader a("A", HashBlocks(prompt_, 4)), b("B", {});
  a.die_at_start_ = true;
  a.go_.Notify();
  b.go_.Notify();
  b.accepting_ = false;
  auto router = Start({a.address(), b.address()});
  ASSERT_EQ(Routable(*router, 1), 1);
  std::thread back([&] {  // B takes requests again while the stream waits
    std::this_thread::sleep_for(700ms);
    b.accepting_ = true;
  });
  auto call =
      http::UpstreamCall::Start("127.0.0.1", router->port(), "POST", "/v1/completions",
                                {{"content-type", "application/json"}}, Body(true), 5s, 10s);
  ASSERT_TRUE(call.ok()) << call.status();
  std::string body;
  bool done = false;
  while (!done) {
    auto piece = (*call)->Read(10s, &done);
    if (!piece.ok()) break;
    body += *piece;
  }
  back.join();
  EXPECT_THAT(body, HasSubstr("data: B0"));
  EXPECT_THAT(body, HasSubstr("[DONE]"));
  EXPECT_THAT(body, ::testing::Not(HasSubstr("\"error\"")));
  EXPECT_EQ(a.requests_.load(), 1);
}

// A replica that drains (its leader stops taking requests) is not routed, and the router's
// /readyz follows the replicas still taking requests; with its queue, the router stays ready
// and says it holds.
TEST_F(RouterTest, ReadinessFollowsTheReplicasTakingRequests) {
  FakeLeader a("A", {});
  for (bool queue : {false, true}) {
    a.accepting_ = true;
    auto router = Start({a.address()}, "", "", queue ? 8 : 0);
    ASSERT_EQ(Routable(*router, 1), 1);
    a.accepting_ = false;
    EXPECT_EQ(Routable(*router, 0), 0);
    auto res = http::Fetch("127.0.0.1", router->port(), "GET", "/readyz", {}, "", 5s);
    ASSERT_TRUE(res.ok());
    EXPECT_EQ(res->status, queue ? 200 : 503);
    if (queue) EXPECT_THAT(res->body, HasSubstr("\"holding\":true"));
    a.accepting_ = true;
    EXPECT_EQ(Routable(*router, 1), 1);
  }
}

// The queue: while no replica takes requests (scaled to zero, restarting) a request is held,
// and answered once one does; past the queue's bound, or its timeout, a 503 that says which.
TEST_F(RouterTest, RequestsAreHeldUntilAReplicaTakesThem) {
  FakeLeader a("A", {});
  auto router = Start({a.address()}, "", "", /*queue_max=*/1);
  ASSERT_EQ(Routable(*router, 1), 1);  // followed, then draining: known, and takes nothing
  a.accepting_ = false;
  ASSERT_EQ(Routable(*router, 0), 0);
  std::thread held([&] {
    auto r = Post(*router);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->body, "{\"from\":\"A\"}");
  });
  EXPECT_EQ(QueueDepth(*router, 1), 1);
  // The queue holds one: the next is refused at once, by name.
  auto full = Post(*router);
  ASSERT_TRUE(full.ok());
  EXPECT_EQ(full->status, 503);
  EXPECT_THAT(full->body, HasSubstr("queue is full"));
  EXPECT_EQ(a.requests_.load(), 0);
  a.accepting_ = true;  // ready: the held request goes on
  held.join();
  EXPECT_EQ(a.requests_.load(), 1);
  EXPECT_EQ(QueueDepth(*router, 0), 0);
  // Nobody takes it within the queue's timeout (3 s here): 503 saying what it waited for.
  a.accepting_ = false;
  EXPECT_EQ(Routable(*router, 0), 0);
  auto late = Post(*router);
  ASSERT_TRUE(late.ok());
  EXPECT_EQ(late->status, 503);
  EXPECT_THAT(late->body, HasSubstr("no replica of the model was ready within 3 s"));
  const std::string m = Metrics(*router);
  EXPECT_THAT(m, HasSubstr("shardserve_router_queue_refused_total{model=\"m\",reason=\"full\"} 1"));
  EXPECT_THAT(m,
              HasSubstr("shardserve_router_queue_refused_total{model=\"m\",reason=\"timeout\"} 1"));
}

// A replica whose batch is full (by its reports and the router's own count) takes no more: the
// next requests wait in the router, and leave it by priority as room comes.
TEST_F(RouterTest, AFullBatchQueuesAtTheRouterAndTheMostUrgentGoesFirst) {
  FakeLeader a("A", {});
  a.max_batch_ = 1;  // room for 1 + 1 (a quarter, at least one)
  auto router = Start({a.address()});
  ASSERT_EQ(Routable(*router, 1), 1);
  auto post = [&](const std::string& extra) {
    return http::Fetch("127.0.0.1", router->port(), "POST", "/v1/completions",
                       {{"content-type", "application/json"}}, Body(true, "m", extra), 10s);
  };
  std::vector<std::thread> clients;
  for (int i = 0; i < 2; ++i) clients.emplace_back([&] { EXPECT_EQ(post("")->status, 200); });
  for (int i = 0; i < 100 && a.requests_.load() < 2; ++i) std::this_thread::sleep_for(20ms);
  ASSERT_EQ(a.requests_.load(), 2);  // both at the replica, held there by its stream
  clients.emplace_back([&] { EXPECT_EQ(post(", \"priority\": 5")->status, 200); });
  ASSERT_EQ(QueueDepth(*router, 1), 1);  // held before the next comes
  clients.emplace_back([&] { EXPECT_EQ(post(", \"priority\": -3")->status, 200); });
  ASSERT_EQ(QueueDepth(*router, 2), 2);
  EXPECT_EQ(a.requests_.load(), 2) << "the batch is full: the others wait at the router";
  a.released_ = 1;  // the first stream ends: room for one, the most urgent
  for (int i = 0; i < 100 && a.requests_.load() < 3; ++i) std::this_thread::sleep_for(20ms);
  EXPECT_EQ(QueueDepth(*router, 1), 1) << "room for one: the other stays held";
  {
    absl::MutexLock lock(&a.mu_);
    ASSERT_EQ(a.bodies_.size(), 3u);
    EXPECT_THAT(a.bodies_[2], HasSubstr("\"priority\": -3"));
  }
  a.go_.Notify();
  for (std::thread& t : clients) t.join();
  absl::MutexLock lock(&a.mu_);
  ASSERT_EQ(a.bodies_.size(), 4u);
  EXPECT_THAT(a.bodies_[3], HasSubstr("\"priority\": 5"));
}

// A tenant under its share of the replicas' batches is not held behind another tenant's flood:
// its request goes on at once (the leader makes room by weighted fair sharing), while the
// flooding tenant's next one waits at the router.
TEST_F(RouterTest, ATenantUnderItsShareIsNotHeldBehindAFlood) {
  FakeLeader a("A", {});
  a.max_batch_ = 1;  // room for 2
  testing::WriteFile(dir_.Sub("keys"), "sk-flood-0123456789abc\nsk-light-0123456789abc\n");
  token_ = "router-token-0123456789";
  testing::WriteFile(dir_.Sub("token"), token_ + "\n");
  auto router = Start({a.address()}, dir_.Sub("keys"), dir_.Sub("token"));
  ASSERT_EQ(Routable(*router, 1), 1);
  auto post = [&](const std::string& key) {
    return http::Fetch("127.0.0.1", router->port(), "POST", "/v1/completions",
                       {{"content-type", "application/json"}, {"authorization", "Bearer " + key}},
                       Body(true, "m", absl::StrCat(", \"user\": \"", key, "\"")), 10s);
  };
  std::vector<std::thread> clients;
  for (int i = 0; i < 3; ++i) {
    clients.emplace_back([&] { EXPECT_EQ(post("sk-flood-0123456789abc")->status, 200); });
    if (i == 1) {
      for (int k = 0; k < 100 && a.requests_.load() < 2; ++k) std::this_thread::sleep_for(20ms);
    }
  }
  ASSERT_EQ(QueueDepth(*router, 1), 1);
  EXPECT_EQ(a.requests_.load(), 2) << "the flood's third waits at the router";
  clients.emplace_back([&] { EXPECT_EQ(post("sk-light-0123456789abc")->status, 200); });
  for (int k = 0; k < 100 && a.requests_.load() < 3; ++k) std::this_thread::sleep_for(20ms);
  {
    absl::MutexLock lock(&a.mu_);
    ASSERT_EQ(a.bodies_.size(), 3u) << "the light tenant's request goes on at once";
    EXPECT_THAT(a.bodies_[2], HasSubstr("sk-light"));
  }
  a.go_.Notify();
  for (std::thread& t : clients) t.join();
  EXPECT_EQ(a.requests_.load(), 4);
}

// With latency targets, the router exports what its clients saw of each replica's streams.
TEST_F(RouterTest, TheRouterExportsHowFarEachReplicaIsFromTheTargets) {
  FakeLeader a("A", {});
  a.go_.Notify();
  auto router = Start({a.address()}, "", "", 256, SloTargets{0.5, 0.001, 90});
  ASSERT_EQ(Routable(*router, 1), 1);
  auto r = Post(*router, /*stream=*/true);
  ASSERT_TRUE(r.ok());
  const std::string m = Metrics(*router);
  const std::string series =
      absl::StrCat("shardserve_router_slo_ratio{model=\"m\",replica=\"", a.address(), "\",slo=\"");
  EXPECT_THAT(m, HasSubstr(series + "ttft\"}"));
  EXPECT_THAT(m, HasSubstr(series + "itl\"}"));
  EXPECT_THAT(m, HasSubstr("shardserve_router_slo_target_seconds{model=\"m\",replica=\""));
  const size_t ttft = m.find(series + "ttft\"} ");
  ASSERT_NE(ttft, std::string::npos);
  const double ratio = std::atof(m.c_str() + ttft + series.size() + 6);
  EXPECT_GT(ratio, 0);
  EXPECT_LT(ratio, 20);  // well under 10 s to the first event
}

TEST_F(RouterTest, BadLeaderSpecsAreNamed) {
  for (const char* bad : {"nohost", "host:0", "dns:name", "host:99999", ":80"}) {
    EXPECT_FALSE(CheckLeaderSpec(bad).ok()) << bad;
  }
  EXPECT_TRUE(CheckLeaderSpec("dns:tiny-leaders.default.svc:8000").ok());
  RouterOptions o;
  o.model_path = model_;
  EXPECT_THAT(std::string(Router::Start(o).status().message()), HasSubstr("no leaders"));
}

}  // namespace
}  // namespace shardserve
