#include "router/router.h"

#include <netdb.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/log.h"
#include "common/status.h"
#include "common/text.h"
#include "http/server.h"
#include "http/upstream.h"
#include "metrics/slo.h"
#include "model/config.h"
#include "router/fair_queue.h"
#include "serve/api_keys.h"
#include "serve/flow_control.h"
#include "serve/kv_events.h"
#include "serve/kv_handoff.h"
#include "serve/openai.h"
#include "serve/prefix_cache.h"
#include "serve/prompts.h"
#include "serve/responses.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace shardserve {
namespace {

using Clock = std::chrono::steady_clock;
using ojson = nlohmann::ordered_json;
using json = nlohmann::json;

// A replica whose stream says nothing for this long is not routed by its cache.
constexpr auto kStale = std::chrono::milliseconds(2000);
// A replica the leaders' list drops (its pod deleted, or its readiness probe late under load)
// while its own stream says it takes requests stays routed this long at most: its stream says
// when it drains, and a probe's hiccup does not empty the router.
constexpr auto kUnlistedGrace = std::chrono::seconds(10);
constexpr size_t kMaxAnswerBytes = 64 << 20;
// Request migration: a request goes on elsewhere at most this many times.
constexpr int kMaxMigrations = 3;
// A stream's progress lines past this many tokens: the stream is no longer resumed.
constexpr size_t kMaxProgressTokens = 1 << 20;

struct LeaderSpec {
  bool dns = false;
  std::string host;
  int port = 0;
  bool prefill = false;  // a prefill replica's (RouterOptions::prefill_leaders)
};
struct Resolved {
  std::string host;
  int port = 0;
  bool prefill = false;
};

// The last event of a relayed stream that broke off: an OpenAI error body, so that a client
// sees an error and never a finished answer.
// A Responses stream's is its typed error event.
std::string BrokenStreamEvent(const std::string& why, bool responses) {
  const std::string message = absl::StrCat("the model replica stopped answering: ", why);
  if (responses) {
    json event = {
        {"type", "error"}, {"code", "server_error"}, {"message", message}, {"param", nullptr}};
    return absl::StrCat("event: error\ndata: ", event.dump(), "\n\n");
  }
  json body = {
      {"error",
       {{"message", message}, {"type", "server_error"}, {"param", nullptr}, {"code", 502}}}};
  return absl::StrCat("data: ", body.dump(), "\n\n");
}

// Whether a relayed stream's last bytes end it as its server ends one: [DONE] (or an error
// event) for the chat and completions; a Responses stream's last event is response.completed,
// response.incomplete, response.failed or error (`last_event`: the type of the last one seen).
bool StreamFinished(const std::string& tail, const std::string& last_event, bool responses) {
  if (responses) {
    return last_event == "response.completed" || last_event == "response.incomplete" ||
           last_event == "response.failed" || last_event == "error";
  }
  return absl::StrContains(tail, "[DONE]") || absl::StrContains(tail, "\"error\"");
}

absl::StatusOr<LeaderSpec> ParseLeaderSpec(const std::string& spec) {
  LeaderSpec out;
  std::string rest = spec;
  if (absl::StartsWith(rest, "dns:")) {
    out.dns = true;
    rest = rest.substr(4);
  }
  const size_t colon = rest.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(rest.substr(colon + 1), &port) || port < 1 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("leader '", spec, "' is not HOST:PORT or dns:NAME:PORT (a port in 1-65535)"));
  }
  out.host = rest.substr(0, colon);
  out.port = port;
  return out;
}

// Request migration: what the client has of a request's answer, so that another replica can
// go on with it when the one answering fails or drains. The leader reports a stream's progress
// to the router in SSE comments, which the router takes out: ": seed N" (the seed its sampler
// started from) and ": tokens ID,ID" (the tokens behind the event that follows, or behind none),
// and ": failed" before the error event of a failure of its replica.
struct Progress {
  int legs = 0;              // replicas that took the request
  bool stream_open = false;  // the client's stream started (its head sent)
  int64_t blocks = 0;        // events sent on to the client
  bool reported = false;     // the leader reports the stream's progress (": seed")
  bool finished = false;     // the choice's finish_reason went out
  bool resumable = true;     // false: a replica refused to resume it
  std::vector<int32_t> tokens;
  uint64_t seed = 0;
  std::string id;  // the stream's, from its first event
  int64_t created = 0;
  bool draining = false;          // the last leg ended because its replica drains
  int64_t completion_tokens = 0;  // a whole answer's usage (a stream's: its tokens)
  std::string why;                // why the last leg ended
  // Latency as the client sees it (spec.serving.slo): the request's arrival at the router, its
  // last event carrying tokens; the event just sent carried some.
  Clock::time_point arrived, last_token;
  bool token_event = false;
  // Nothing reached the client (the request is sent again), or a reported stream not finished.
  bool CanResume() const {
    return resumable &&
           (blocks == 0 || (reported && !finished && tokens.size() < kMaxProgressTokens));
  }
};

// What the router knows of one replica; its thread follows the leader's KV events.
struct Replica {
  std::string address, host;
  int port = 0;
  bool prefill = false;  // serves disaggregated requests' prefill legs only
  std::thread thread;
  absl::Notification stop;
  std::atomic<int64_t> in_flight{0};
  std::unique_ptr<SloWindow> slo;  // what the clients saw of its answers (null: no target)

  absl::Mutex mu;
  bool live ABSL_GUARDED_BY(mu) = false;  // a snapshot was read and the stream goes on
  Clock::time_point last_message ABSL_GUARDED_BY(mu);
  int64_t block_size ABSL_GUARDED_BY(mu) = 0;
  std::string epoch ABSL_GUARDED_BY(mu);  // the leader's run, from its hello
  std::string model ABSL_GUARDED_BY(mu);  // the model it serves, from its hello
  BlockHashSet cached ABSL_GUARDED_BY(mu), building ABSL_GUARDED_BY(mu);
  bool in_snapshot ABSL_GUARDED_BY(mu) = false;
  ReplicaLoad load ABSL_GUARDED_BY(mu);
  // An answer from it broke off: not routed until then (its KV events stream, if it is really
  // gone, breaks within kStale and keeps it out).
  Clock::time_point out_until ABSL_GUARDED_BY(mu);
  std::string why ABSL_GUARDED_BY(mu);  // why it is not live (logged on change)
  // When the leaders' list stopped naming it (Clock's epoch: it names it).
  Clock::time_point unlisted_since ABSL_GUARDED_BY(mu);
  // The runtime LoRA adapters (Router::Impl::runtime_adapters) this run of its leader
  // (adapters_epoch) has answered for: took, or refused with a 4xx of its own.
  std::set<std::string> adapters_given ABSL_GUARDED_BY(mu);
  std::string adapters_epoch ABSL_GUARDED_BY(mu);
};

// The first line of the token file (the leaders accept it as a key file).
absl::StatusOr<std::string> ReadToken(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("cannot read the token file ", path));
  std::string line;
  while (std::getline(in, line)) {
    line = std::string(absl::StripAsciiWhitespace(line));
    if (!line.empty() && line[0] != '#') return line;
  }
  return absl::InvalidArgumentError(absl::StrCat("the token file ", path, " holds no token"));
}

}  // namespace

absl::Status CheckLeaderSpec(const std::string& spec) { return ParseLeaderSpec(spec).status(); }

struct Router::Impl {
  RouterOptions options;
  std::vector<LeaderSpec> specs;
  std::unique_ptr<Tokenizer> tokenizer;
  ChatTemplate chat;
  std::unique_ptr<PromptBuilder> prompts;
  int64_t context = 0;
  std::unique_ptr<ApiKeys> keys;
  std::string leader_token;
  std::unique_ptr<ApiKeys> metrics_keys;  // the router token, for /metrics
  std::unique_ptr<FlowControl> flow;

  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  std::map<std::string, std::string> labels;
  prometheus::Family<prometheus::Counter>* requests = nullptr;
  prometheus::Family<prometheus::Counter>* decisions = nullptr;
  prometheus::Family<prometheus::Counter>* disaggregated = nullptr;
  prometheus::Family<prometheus::Counter>* migrations = nullptr;
  prometheus::Counter *failovers = nullptr, *prompt_tokens = nullptr, *expected_cached = nullptr;
  prometheus::Histogram* overhead = nullptr;
  prometheus::Family<prometheus::Gauge>* replicas_gauge = nullptr;
  prometheus::Family<prometheus::Gauge>*in_flight_g = nullptr, *running_g = nullptr,
  *waiting_g = nullptr, *kv_g = nullptr, *cached_g = nullptr;
  prometheus::Gauge* queued_g = nullptr;
  prometheus::Histogram* queue_wait = nullptr;
  prometheus::Family<prometheus::Counter>* queue_refused = nullptr;

  absl::Mutex mu;
  std::map<std::string, std::shared_ptr<Replica>> replicas ABSL_GUARDED_BY(mu);
  absl::Notification stopping;
  std::thread discovery;
  // LoRA adapters loaded at runtime through this router and not unloaded since, by name: the
  // load's body and the admin's headers, replayed by SyncAdapters to a replica that has not
  // answered for them (one the router found later, a leader's new run, one that failed the
  // load). adapters_mu orders a fan-out and a replay pass.
  struct RuntimeAdapter {
    std::string body;
    http::Headers headers;
  };
  absl::Mutex adapters_mu;
  std::map<std::string, RuntimeAdapter> runtime_adapters ABSL_GUARDED_BY(adapters_mu);
  std::thread adapter_sync;
  std::atomic<uint64_t> turn{0};
  std::atomic<int> active{0};
  std::unique_ptr<http::Server> http, metrics_http;

  // The queue (RouterOptions::queue_max): requests waiting for room in a replica's batch.
  absl::Mutex queue_mu;
  absl::CondVar queue_cv;  // something changed: room may have come
  FairQueue queue ABSL_GUARDED_BY(queue_mu);
  std::set<uint64_t> let_out ABSL_GUARDED_BY(queue_mu);  // taken from the queue, not yet seen
  int64_t granted ABSL_GUARDED_BY(queue_mu) = 0;         // let through, not yet at a replica
  uint64_t next_ticket ABSL_GUARDED_BY(queue_mu) = 0;
  // The generation requests let through, until they end: by tenant (and each tenant's queued
  // ones), in all, and their priorities.
  struct TenantLoad {
    int64_t in_flight = 0, queued = 0;
    double weight = 1;
  };
  std::map<std::string, TenantLoad> tenant_load ABSL_GUARDED_BY(queue_mu);
  int64_t admitted ABSL_GUARDED_BY(queue_mu) = 0;
  std::multiset<int64_t> priorities ABSL_GUARDED_BY(queue_mu);
  // The queue's priority of a request that is not a generation (it waits for a replica, not
  // for room): before any.
  static constexpr int64_t kNotBatch = std::numeric_limits<int64_t>::min();

  void InitMetrics() {
    auto& r = *registry;
    labels = {{"model", options.model_label}};
    requests = &prometheus::BuildCounter()
                    .Name("shardserve_router_requests_total")
                    .Help("Requests the router answered, by HTTP status")
                    .Register(r);
    decisions = &prometheus::BuildCounter()
                     .Name("shardserve_router_decisions_total")
                     .Help("Generation requests routed, by why their replica was chosen")
                     .Register(r);
    disaggregated = &prometheus::BuildCounter()
                         .Name("shardserve_router_disaggregated_total")
                         .Help(
                             "Requests routed to a prefill replica, then a decode replica "
                             "(paired), or served by a decode replica alone after the prefill "
                             "replicas failed them (prefill_failed)")
                         .Register(r);
    failovers = &prometheus::BuildCounter()
                     .Name("shardserve_router_failovers_total")
                     .Help("Requests sent on to another replica after one did not answer")
                     .Register(r)
                     .Add(labels);
    migrations = &prometheus::BuildCounter()
                      .Name("shardserve_router_migrations_total")
                      .Help(
                          "Requests sent on to another replica after the answering one failed "
                          "(failure) or drained (drain) mid-answer; failed: none could go on "
                          "with it")
                      .Register(r);
    prompt_tokens = &prometheus::BuildCounter()
                         .Name("shardserve_router_prompt_tokens_total")
                         .Help("Prompt tokens of the generation requests routed")
                         .Register(r)
                         .Add(labels);
    expected_cached = &prometheus::BuildCounter()
                           .Name("shardserve_router_expected_cached_tokens_total")
                           .Help("Prompt tokens the chosen replicas were known to cache")
                           .Register(r)
                           .Add(labels);
    overhead = &prometheus::BuildHistogram()
                    .Name("shardserve_router_overhead_seconds")
                    .Help("A request's time in the router before it is sent to a replica")
                    .Register(r)
                    .Add(labels, prometheus::Histogram::BucketBoundaries{0.0001, 0.00025, 0.0005,
                                                                         0.001, 0.0025, 0.005, 0.01,
                                                                         0.025, 0.05, 0.1, 0.25});
    replicas_gauge = &prometheus::BuildGauge()
                          .Name("shardserve_router_replicas")
                          .Help(
                              "Replicas the router knows, by state (routable: its KV events "
                              "stream is live)")
                          .Register(r);
    auto gauge = [&](const char* name, const char* help) {
      return &prometheus::BuildGauge().Name(name).Help(help).Register(r);
    };
    in_flight_g = gauge("shardserve_router_replica_in_flight",
                        "This router's requests in progress at the replica");
    running_g = gauge("shardserve_router_replica_running",
                      "Sequences running at the replica (its leader's report)");
    waiting_g = gauge("shardserve_router_replica_waiting",
                      "Requests waiting at the replica (its leader's report)");
    kv_g = gauge("shardserve_router_replica_kv_usage_ratio",
                 "Share of the replica's KV blocks in use (its leader's report)");
    cached_g = gauge("shardserve_router_replica_cached_blocks",
                     "KV blocks the replica caches, as the router knows them");
    queued_g = &gauge("shardserve_router_queue_depth",
                      "Requests the router holds: no replica has room in its batch, or none is "
                      "ready (scaled to zero)")
                    ->Add(labels);
    queue_wait = &prometheus::BuildHistogram()
                      .Name("shardserve_router_queue_wait_seconds")
                      .Help("A generation request's time in the router's queue")
                      .Register(r)
                      .Add(labels, prometheus::Histogram::BucketBoundaries{0.001, 0.005, 0.025, 0.1,
                                                                           0.25, 0.5, 1, 2.5, 5, 10,
                                                                           30, 60, 120, 300});
    queue_refused = &prometheus::BuildCounter()
                         .Name("shardserve_router_queue_refused_total")
                         .Help(
                             "Requests the queue answered 503: it was full (full), or no "
                             "replica had room within the queue's timeout (timeout)")
                         .Register(r);
  }

  std::map<std::string, std::string> ReplicaLabels(const Replica& r) const {
    auto l = labels;
    l["replica"] = r.address;
    return l;
  }

  void CountRequest(int status) {
    auto l = labels;
    l["code"] = std::to_string(status);
    requests->Add(l).Increment();
  }

  http::Response Error(int status, const std::string& message, const std::string& type) {
    CountRequest(status);
    json body = {
        {"error", {{"message", message}, {"type", type}, {"param", nullptr}, {"code", nullptr}}}};
    http::Response r{status, "application/json", body.dump(), {}};
    if (status == 503) r.headers.emplace_back("Retry-After", "1");
    return r;
  }

  // The 401 of a request without a known key, as the leaders answer it (the same body).
  std::optional<http::Response> Deny(const http::Request& req) {
    if (keys == nullptr) return std::nullopt;
    absl::Status st = keys->Check(req.Header("authorization"));
    if (st.ok()) return std::nullopt;
    CountRequest(401);
    http::Response r{401, "application/json", DumpJson(ErrorBody(st)), {}};
    r.headers.emplace_back("WWW-Authenticate", "Bearer");
    return r;
  }

  // /metrics: with the router token; a router without one shows its page only when it has no
  // API keys either (an open deployment).
  std::optional<http::Response> DenyMetrics(const http::Request& req) {
    absl::Status st;
    if (metrics_keys != nullptr) {
      st = metrics_keys->Check(req.Header("authorization"));
    } else if (keys != nullptr) {
      st = absl::PermissionDeniedError(
          "the router's metrics are read with its router token (SHARDSERVE_ROUTER_TOKEN_FILE), "
          "and it has none");
    }
    if (st.ok()) return std::nullopt;
    const int code = st.code() == absl::StatusCode::kPermissionDenied ? 403 : 401;
    CountRequest(code);
    http::Response r{code, "application/json", DumpJson(ErrorBody(st)), {}};
    if (code == 401) r.headers.emplace_back("WWW-Authenticate", "Bearer");
    return r;
  }

  // ---- following the leaders

  void Forget(Replica& r, const std::string& why) {
    absl::MutexLock lock(&r.mu);
    if (r.live || r.why != why)
      LogInfo("router: replica ", r.address, " not routed by cache: ", why);
    r.live = false;
    r.why = why;
    r.cached.clear();
    r.building.clear();
    r.in_snapshot = false;
  }

  absl::Status Apply(Replica& r, const std::string& line) {
    ASSIGN_OR_RETURN(KvMessage m, DecodeKvMessage(line));
    absl::MutexLock lock(&r.mu);
    r.last_message = Clock::now();
    switch (m.type) {
      case KvMessage::Type::kHello:
        if (!r.epoch.empty() && r.epoch != m.epoch) {
          LogInfo("router: replica ", r.address, " is a new run of its leader (", m.epoch,
                  " after ", r.epoch, "): its cache is read anew");
        }
        r.epoch = m.epoch;
        r.model = m.model;
        r.block_size = m.block_size;
        r.in_snapshot = true;
        r.building.clear();
        break;
      case KvMessage::Type::kReset:
        r.in_snapshot = true;
        r.building.clear();
        break;
      case KvMessage::Type::kSnapshot:
        if (!r.in_snapshot) return absl::DataLossError("a snapshot piece outside a snapshot");
        r.building.insert(m.hashes.begin(), m.hashes.end());
        if (m.last) {
          r.cached.swap(r.building);
          r.building.clear();
          r.in_snapshot = false;
          if (!r.live) {
            LogInfo("router: replica ", r.address, " of model '", r.model, "' routable (",
                    r.cached.size(), " cached blocks)");
          }
          r.live = true;
          r.why.clear();
        }
        break;
      case KvMessage::Type::kStored:
      case KvMessage::Type::kRemoved: {
        BlockHashSet& set = r.in_snapshot ? r.building : r.cached;
        for (const BlockHash& h : m.hashes) {
          if (m.type == KvMessage::Type::kStored) {
            set.insert(h);
          } else {
            set.erase(h);
          }
        }
        break;
      }
      case KvMessage::Type::kLoad:
        r.load = m.load;
        break;
    }
    return absl::OkStatus();
  }

  void Follow(Replica& r) {
    http::Headers headers;
    if (!leader_token.empty()) headers.emplace_back("authorization", "Bearer " + leader_token);
    auto backoff = std::chrono::milliseconds(200);
    while (!r.stop.HasBeenNotified()) {
      auto call = http::UpstreamCall::Start(r.host, r.port, "GET", "/v1/kv-events", headers, "",
                                            options.connect_timeout, options.connect_timeout);
      absl::Status end;
      if (!call.ok()) {
        end = call.status();
      } else if ((*call)->head().status != 200) {
        end = absl::UnavailableError(
            absl::StrCat("GET /v1/kv-events answered ", (*call)->head().status));
      } else {
        backoff = std::chrono::milliseconds(200);
        {
          absl::MutexLock lock(&r.mu);
          r.last_message = Clock::now();
        }
        end = ReadStream(r, **call);
      }
      Forget(r, std::string(end.message()));
      if (r.stop.WaitForNotificationWithTimeout(absl::FromChrono(backoff))) break;
      backoff = std::min(backoff * 2, std::chrono::milliseconds(5000));
    }
  }

  absl::Status ReadStream(Replica& r, http::UpstreamCall& call) {
    std::string pending;
    while (!r.stop.HasBeenNotified()) {
      bool done = false;
      absl::StatusOr<std::string> piece = call.Read(std::chrono::milliseconds(250), &done);
      if (!piece.ok()) {
        if (piece.status().code() != absl::StatusCode::kDeadlineExceeded) return piece.status();
        absl::MutexLock lock(&r.mu);
        if (Clock::now() - r.last_message > kStale) {
          return absl::UnavailableError("its KV events stream said nothing for 2 s");
        }
        continue;
      }
      if (done) return absl::UnavailableError("the leader ended its KV events stream");
      pending += *piece;
      size_t start = 0, nl;
      while ((nl = pending.find('\n', start)) != std::string::npos) {
        RETURN_IF_ERROR(Apply(r, pending.substr(start, nl - start)));
        start = nl + 1;
      }
      pending.erase(0, start);
      if (start > 0) Kick();  // a load report, or the replica routable: room may have come
      if (pending.size() > kMaxKvEventLine) {
        return absl::DataLossError("a KV events line over 1 MiB");
      }
    }
    return absl::CancelledError("stopped");
  }

  // The addresses the specs name now ("host:port"). `*unsure`: a lookup failed for another
  // reason than the name having no address (no leader ready): a DNS server slow or restarting
  // says nothing of the leaders.
  std::map<std::string, Resolved> Resolve(bool* unsure) {
    std::map<std::string, Resolved> out;
    *unsure = false;
    for (const LeaderSpec& s : specs) {
      if (!s.dns) {
        out[absl::StrCat(s.host, ":", s.port)] = {s.host, s.port, s.prefill};
        continue;
      }
      addrinfo hints{};
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      addrinfo* res = nullptr;
      if (const int rc = getaddrinfo(s.host.c_str(), nullptr, &hints, &res); rc != 0) {
        if (rc != EAI_NONAME && rc != EAI_NODATA) {
          *unsure = true;
          LogWarning("router: cannot look up ", s.host, " (", gai_strerror(rc),
                     "); the replicas known stay");
        }
        continue;  // none ready yet, or unknown now
      }
      for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
        char ip[NI_MAXHOST];
        if (getnameinfo(a->ai_addr, a->ai_addrlen, ip, sizeof(ip), nullptr, 0, NI_NUMERICHOST) !=
            0) {
          continue;
        }
        const bool v6 = a->ai_family == AF_INET6;
        out[absl::StrCat(v6 ? "[" : "", ip, v6 ? "]" : "", ":", s.port)] = {ip, s.port, s.prefill};
      }
      freeaddrinfo(res);
    }
    return out;
  }

  void Discover() {
    do {
      bool unsure = false;
      auto want = Resolve(&unsure);
      std::vector<std::shared_ptr<Replica>> gone;
      {
        absl::MutexLock lock(&mu);
        for (auto it = replicas.begin(); it != replicas.end();) {
          if (unsure || KeepUnlisted(*it->second, want.count(it->first) > 0)) {
            ++it;
            continue;
          }
          gone.push_back(it->second);
          it = replicas.erase(it);
        }
        for (const auto& [address, at] : want) {
          if (replicas.count(address)) continue;
          auto r = std::make_shared<Replica>();
          r->address = address;
          r->host = at.host;
          r->port = at.port;
          r->prefill = at.prefill;
          if (options.slo.any()) r->slo = std::make_unique<SloWindow>(options.slo);
          {
            absl::MutexLock rl(&r->mu);
            r->why = "its KV events stream is not read yet";
          }
          r->thread = std::thread([this, r] { Follow(*r); });
          replicas[address] = r;
          LogInfo("router: following replica ", address);
        }
      }
      for (auto& r : gone) {
        LogInfo("router: replica ", r->address, " is gone from the leaders' list");
        r->stop.Notify();
        r->thread.join();
        for (auto* f : {in_flight_g, running_g, waiting_g, kv_g, cached_g}) {
          f->Remove(&f->Add(ReplicaLabels(*r)));
        }
      }
      PublishReplicas();
    } while (!stopping.WaitForNotificationWithTimeout(absl::FromChrono(options.resolve_every)));
  }

  // Whether r stays followed though the leaders' list does not name it (`listed`: it does).
  bool KeepUnlisted(Replica& r, bool listed) {
    absl::MutexLock lock(&r.mu);
    if (listed) {
      r.unlisted_since = {};
      return true;
    }
    const auto now = Clock::now();
    if (r.unlisted_since == Clock::time_point{}) {
      r.unlisted_since = now;
      if (Routable(r)) {
        LogInfo("router: replica ", r.address,
                " is gone from the leaders' list but takes requests: routed until its stream "
                "says it drains (at most ",
                std::chrono::duration_cast<std::chrono::seconds>(kUnlistedGrace).count(), " s)");
      }
    }
    return Routable(r) && now - r.unlisted_since < kUnlistedGrace;
  }

  std::vector<std::shared_ptr<Replica>> Snapshot() {
    absl::MutexLock lock(&mu);
    std::vector<std::shared_ptr<Replica>> out;
    for (const auto& [a, r] : replicas) out.push_back(r);
    return out;
  }

  // Its cache is known, it said something lately, it takes requests (not draining) and no
  // answer of it broke off just now.
  bool Routable(Replica& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(r.mu) {
    const auto now = Clock::now();
    return r.live && now - r.last_message <= kStale && r.load.accepting && now >= r.out_until;
  }

  // An answer of r broke off (its leader died, or the connection did): r is out at once.
  void MarkOut(Replica& r, const std::string& why) {
    absl::MutexLock lock(&r.mu);
    r.out_until = Clock::now() + kStale;
    LogWarning("router: replica ", r.address, " taken out of routing: ", why);
  }

  void PublishReplicas() {
    int routable = 0, other = 0;
    for (auto& r : Snapshot()) {
      absl::MutexLock lock(&r->mu);
      (Routable(*r) ? routable : other)++;
      const auto l = ReplicaLabels(*r);
      in_flight_g->Add(l).Set(static_cast<double>(r->in_flight.load()));
      running_g->Add(l).Set(static_cast<double>(r->load.running));
      waiting_g->Add(l).Set(static_cast<double>(r->load.waiting));
      kv_g->Add(l).Set(r->load.kv_blocks > 0 ? static_cast<double>(r->load.kv_used) /
                                                   static_cast<double>(r->load.kv_blocks)
                                             : 0.0);
      cached_g->Add(l).Set(static_cast<double>(r->cached.size()));
    }
    auto l = labels;
    l["state"] = "routable";
    replicas_gauge->Add(l).Set(routable);
    l["state"] = "unroutable";
    replicas_gauge->Add(l).Set(other);
  }

  http::Response MetricsPage() {
    PublishReplicas();
    std::vector<prometheus::MetricFamily> families = registry->Collect();
    if (options.slo.any()) {
      std::vector<std::pair<std::map<std::string, std::string>, SloWindow*>> windows;
      const std::vector<std::shared_ptr<Replica>> reps = Snapshot();
      for (const auto& r : reps) {
        if (r->slo) windows.emplace_back(ReplicaLabels(*r), r->slo.get());
      }
      for (auto& f : SloFamilies("shardserve_router", windows)) families.push_back(std::move(f));
    }
    return http::Response{
        200, "text/plain; version=0.0.4", prometheus::TextSerializer().Serialize(families), {}};
  }

  // ---- the queue

  bool Queueing() const { return options.queue_max > 0 && options.queue_timeout.count() > 0; }

  // What the routable (decode) replicas hold: their number, the requests they take at once
  // (each one's batch and a quarter: a few waiting at the leader keep its batch full while the
  // router reacts), and the room left (less each one's requests, by its last report or this
  // router's count there, whichever is more). A leader that does not report its batch takes
  // any number.
  struct Room {
    int64_t routable = 0, capacity = 0, free = 0;
  };
  Room RoomNow() {
    constexpr int64_t kAny = int64_t{1} << 40;
    Room out;
    for (auto& r : Snapshot()) {
      if (r->prefill) continue;
      absl::MutexLock lock(&r->mu);
      if (!Routable(*r)) continue;
      ++out.routable;
      if (r->load.max_batch <= 0) {
        out.capacity = out.free = kAny;
        continue;
      }
      const int64_t cap = r->load.max_batch + std::max<int64_t>(1, r->load.max_batch / 4);
      const int64_t used = std::max(r->load.running + r->load.waiting, r->in_flight.load());
      out.capacity += cap;
      out.free += std::max<int64_t>(0, cap - used);
    }
    out.capacity = std::min(out.capacity, kAny);
    out.free = std::min(out.free, kAny);
    return out;
  }

  // Room may have come (a load report, a request done): the waiters look again.
  void Kick() { queue_cv.SignalAll(); }

  // Whether a generation request of `tenant` at `priority` goes on though the batches are full:
  // its tenant holds less than its weighted share of the replicas' capacity (among the tenants
  // with requests in flight or waiting), or it is more urgent than a request in flight; the
  // leader then makes room (weighted fair sharing, priority preemption), so a flood holds the
  // router's queue and not a light tenant. At most twice the capacity in flight at once.
  bool MayPass(const TenantClass& tenant, int64_t priority, const Room& room)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(queue_mu) {
    if (room.routable == 0 || admitted >= 2 * room.capacity) return false;
    double weights = tenant.weight;
    int64_t mine = 0;
    for (const auto& [name, t] : tenant_load) {
      if (name == tenant.name) {
        mine = t.in_flight;
      } else {
        weights += t.weight;
      }
    }
    if (static_cast<double>(mine + 1) <=
        static_cast<double>(room.capacity) * tenant.weight / weights) {
      return true;
    }
    return !priorities.empty() && priority < *priorities.rbegin();
  }

  // A generation request of `tenant` at `priority` goes on (Done() when it ends).
  void Admit(const std::string& tenant, double weight, int64_t priority)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(queue_mu) {
    TenantLoad& t = tenant_load[tenant];
    t.weight = weight;
    ++t.in_flight;
    ++admitted;
    priorities.insert(priority);
  }

  void Done(const std::string& tenant, int64_t priority) {
    {
      absl::MutexLock lock(&queue_mu);
      auto it = tenant_load.find(tenant);
      if (it != tenant_load.end() && --it->second.in_flight <= 0 && it->second.queued <= 0) {
        tenant_load.erase(it);
      }
      --admitted;
      if (auto p = priorities.find(priority); p != priorities.end()) priorities.erase(p);
    }
    Kick();
  }

  // Lets out of the queue, in its order, as many as the replicas have room for.
  void LetOut() ABSL_EXCLUSIVE_LOCKS_REQUIRED(queue_mu) {
    if (queue.empty()) return;
    int64_t out = 0;
    for (int64_t room = RoomNow().free - granted; room > 0 && !queue.empty(); --room, ++out) {
      LetOutOf(*queue.Pop());
    }
    if (out == 0) return;  // (waking the others for nothing would have them wake each other)
    queued_g->Set(static_cast<double>(queue.size()));
    queue_cv.SignalAll();
  }

  void LetOutOf(const FairQueue::Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(queue_mu) {
    let_out.insert(e.id);
    ++granted;
    if (e.priority == kNotBatch) return;
    --tenant_load[e.tenant].queued;
    Admit(e.tenant, e.weight, e.priority);
  }

  // A place at a replica for a request: a generation request (`batch`) waits in the queue,
  // by `priority` and its tenant's weight, until a replica has room in its batch or its tenant
  // may pass (MayPass); any other only until some replica is routable. OK: go on (then
  // Placed() once it is at a replica or goes nowhere, and for a generation request Done() when
  // it ends); ResourceExhausted: the queue is full; DeadlineExceeded: the queue's timeout
  // passed; Cancelled: the client left.
  absl::Status Enter(bool batch, int64_t priority, const TenantClass& tenant, http::Exchange& ex,
                     Clock::time_point arrived) {
    absl::MutexLock lock(&queue_mu);
    Room room = RoomNow();
    const bool now = !Queueing() || (batch ? (queue.empty() && room.free - granted > 0) ||
                                                 MayPass(tenant, priority, room)
                                           : queue.empty() && room.routable > 0);
    if (now) {
      ++granted;
      if (batch) {
        Admit(tenant.name, tenant.weight, priority);
        queue_wait->Observe(0);
      }
      return absl::OkStatus();
    }
    if (queue.size() >= static_cast<size_t>(options.queue_max)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the router's queue is full (", queue.size(),
                       " requests wait for room in the replicas' batches); try again later"));
    }
    const uint64_t id = ++next_ticket;
    const FairQueue::Entry entry{id, batch ? priority : kNotBatch, tenant.name, tenant.weight};
    queue.Push(entry);
    if (batch) ++tenant_load[tenant.name].queued;
    queued_g->Set(static_cast<double>(queue.size()));
    const auto deadline = arrived + options.queue_timeout;
    for (;;) {
      if (batch) LetOut();
      room = RoomNow();
      if (let_out.count(id) == 0 && (batch ? MayPass(tenant, priority, room) : room.routable > 0) &&
          queue.Remove(id)) {
        LetOutOf(entry);
        queued_g->Set(static_cast<double>(queue.size()));
      }
      if (let_out.erase(id) > 0) {
        if (batch)
          queue_wait->Observe(std::chrono::duration<double>(Clock::now() - arrived).count());
        return absl::OkStatus();
      }
      const bool late = Clock::now() >= deadline;
      if (late || ex.ClientGone()) {
        queue.Remove(id);
        if (batch && --tenant_load[tenant.name].queued <= 0 &&
            tenant_load[tenant.name].in_flight <= 0) {
          tenant_load.erase(tenant.name);
        }
        queued_g->Set(static_cast<double>(queue.size()));
        if (!late) return absl::CancelledError("the client left");
        const int64_t seconds =
            std::chrono::duration_cast<std::chrono::seconds>(options.queue_timeout).count();
        return absl::DeadlineExceededError(
            room.routable == 0
                ? absl::StrCat("no replica of the model was ready within ", seconds,
                               " s (scaled to zero and starting, or restarting)")
                : absl::StrCat("no replica had room in its batch within ", seconds, " s"));
      }
      queue_cv.WaitWithTimeout(&queue_mu, absl::Milliseconds(100));
    }
  }

  // A request let through by Enter() is at a replica (its in_flight counts it), or goes nowhere.
  void Placed() {
    {
      absl::MutexLock lock(&queue_mu);
      --granted;
    }
    Kick();
  }

  // ---- requests

  // The prompt's tokens as the leader would feed them (the first prompt of a completion), and
  // the salt of its block names as the leader computes it.
  struct Prompt {
    std::vector<int32_t> tokens;
    std::string salt;
    std::string adapter;   // the LoRA adapter its `model` names (empty: the base)
    int64_t priority = 0;  // the request's `priority` (vLLM's)
    // Its prefill may run on a prefill replica (completions and chat whose prompt is not
    // scored: echo with logprobs needs every prompt row where the answer is made).
    bool disaggregable = false;
  };
  absl::StatusOr<Prompt> PromptOf(const http::Request& http_req, bool chat, bool responses) {
    const std::string& body = http_req.body;
    if (JsonNestsDeeperThan(body, 64)) return absl::InvalidArgumentError("too deeply nested");
    ojson parsed = ojson::parse(body, nullptr, /*allow_exceptions=*/false);
    if (parsed.is_discarded()) return absl::InvalidArgumentError("not JSON");
    if (responses) {  // the chat a Responses request stands for
      ASSIGN_OR_RETURN(parsed, ResponsesToChat(parsed));
    }
    ASSIGN_OR_RETURN(ApiRequest req, ParseApiRequest(parsed, chat));
    Prompt p;
    p.priority = req.priority;
    p.disaggregable = !responses && !(req.echo && req.logprobs) && req.kv_transfer.is_null();
    if (!options.model_name.empty() && req.model != options.model_name) p.adapter = req.model;
    p.salt = PrefixCacheSalt(options.prefix_cache_per_key && keys != nullptr,
                             http_req.Header("authorization"), req.cache_salt, p.adapter);
    if (chat) {
      ASSIGN_OR_RETURN(p.tokens, prompts->Chat(req, context));
    } else if (req.prompt_ids.empty()) {
      return absl::InvalidArgumentError("no prompt");
    } else if (!req.prompt_ids[0].empty()) {
      p.tokens = req.prompt_ids[0];
    } else {
      ASSIGN_OR_RETURN(p.tokens, prompts->Tokenize(req.prompt_texts[0], true, context, "prompt"));
    }
    return p;
  }

  // The replicas in the order to try them for a prompt (null: not a generation request), and
  // each one's cached share of it.
  struct Ranked {
    Ranking rank;
    std::vector<Candidate> cands;
    int64_t block_size = 0;
  };
  Ranked RankFor(const std::vector<std::shared_ptr<Replica>>& reps, const Prompt* prompt) {
    Ranked out;
    // Each replica's match: the prompt's chain of full blocks (by block size), from the first.
    std::map<int64_t, std::vector<BlockHash>> chains;
    out.cands.resize(reps.size());
    for (size_t i = 0; i < reps.size(); ++i) {
      Replica& r = *reps[i];
      absl::MutexLock lock(&r.mu);
      Candidate& c = out.cands[i];
      c.routable = Routable(r);
      c.in_flight = r.in_flight.load();
      c.running = r.load.running;
      c.waiting = r.load.waiting;
      c.max_batch = r.load.max_batch;
      c.kv_usage = r.load.kv_blocks > 0
                       ? static_cast<double>(r.load.kv_used) / static_cast<double>(r.load.kv_blocks)
                       : 0.0;
      if (prompt != nullptr && !prompt->adapter.empty()) {
        const auto& loaded = r.load.adapters;
        c.adapter_loaded = std::find(loaded.begin(), loaded.end(), prompt->adapter) != loaded.end();
        c.adapter_room = static_cast<int64_t>(loaded.size()) < r.load.max_loras;
      }
      if (prompt == nullptr || !c.routable || r.block_size <= 0) continue;
      out.block_size = r.block_size;
      auto [it, fresh] = chains.try_emplace(r.block_size);
      if (fresh) it->second = HashBlocks(prompt->tokens, r.block_size, prompt->salt);
      for (const BlockHash& h : it->second) {
        if (!r.cached.contains(h)) break;
        ++c.matched_blocks;
      }
    }
    const int64_t prompt_blocks = prompt == nullptr ? -1
                                  : out.block_size > 0
                                      ? static_cast<int64_t>(prompt->tokens.size()) / out.block_size
                                      : 0;
    out.rank = RankReplicas(out.cands, prompt_blocks, options.weights, turn++);
    return out;
  }

  // This router's count of its requests at a replica, while one is there.
  struct AtReplica {
    Impl& s;
    Replica& r;
    AtReplica(Impl& impl, Replica& replica) : s(impl), r(replica) { ++r.in_flight; }
    ~AtReplica() {
      --r.in_flight;
      s.Kick();
    }
  };

  // A disaggregated request's prefill leg: the request, with do_remote_decode, to the best
  // prefill replica that answers. The decode leg's body (the request with the handoff), or the
  // answer to give the client (a 4xx the request itself earned), or an error: the decode replica
  // then serves the request alone.
  struct PrefillLeg {
    std::string decode_body;
    std::optional<http::Response> answer;
  };
  absl::StatusOr<PrefillLeg> Prefill(const http::Request& req, http::Exchange& ex,
                                     const std::vector<std::shared_ptr<Replica>>& reps,
                                     const Prompt& prompt, const http::Headers& headers) {
    ojson body = ojson::parse(req.body, nullptr, /*allow_exceptions=*/false);
    if (!body.is_object()) return absl::InvalidArgumentError("not a JSON object");
    ojson leg = body;
    leg["kv_transfer_params"] = {{"do_remote_decode", true}};
    leg["stream"] = false;
    leg.erase("stream_options");
    const std::string leg_body = leg.dump();
    const Ranked ranked = RankFor(reps, &prompt);
    std::string last_error = "no prefill replica is routable";
    for (size_t k : ranked.rank.order) {
      Replica& r = *reps[k];
      if (!ranked.cands[k].routable) continue;
      AtReplica at(*this, r);
      auto call =
          http::UpstreamCall::Start(r.host, r.port, req.method, req.target, headers, leg_body,
                                    options.connect_timeout, options.answer_timeout);
      if (!call.ok()) {
        last_error = absl::StrCat(r.address, ": ", call.status().message());
        if (call.status().code() == absl::StatusCode::kUnavailable) continue;  // nothing done
        return absl::UnavailableError(last_error);
      }
      std::string answer;
      const auto deadline = Clock::now() + options.answer_timeout;
      for (bool end = false; !end;) {
        absl::StatusOr<std::string> piece = (*call)->Read(std::chrono::milliseconds(200), &end);
        if (!piece.ok() && piece.status().code() == absl::StatusCode::kDeadlineExceeded &&
            Clock::now() < deadline) {
          if (ex.ClientGone()) {  // the prefill replica frees the offers it made
            (*call)->Close();
            return absl::CancelledError("the client left");
          }
          continue;
        }
        if (!piece.ok()) {
          MarkOut(r, std::string(piece.status().message()));
          return absl::UnavailableError(absl::StrCat(r.address, ": ", piece.status().message()));
        }
        if (answer.size() + piece->size() > kMaxAnswerBytes) {
          return absl::UnavailableError(absl::StrCat(r.address, ": an answer over 64 MiB"));
        }
        answer += *piece;
      }
      const int status = (*call)->head().status;
      if (status == 503 || status == 429) {  // not ready, draining or full: another may take it
        last_error = absl::StrCat(r.address, " answered ", status);
        continue;
      }
      if (status >= 400 && status < 500) {  // the request's own fault: the client hears it
        CountRequest(status);
        return PrefillLeg{"", http::Response{status, "application/json", std::move(answer), {}}};
      }
      const json parsed = json::parse(answer, nullptr, /*allow_exceptions=*/false);
      if (status != 200 || !parsed.is_object() || !parsed.contains("kv_transfer_params")) {
        return absl::UnavailableError(absl::StrCat(r.address, " answered ", status));
      }
      body["kv_transfer_params"] = ojson::parse(parsed["kv_transfer_params"].dump());
      return PrefillLeg{body.dump(), std::nullopt};
    }
    return absl::UnavailableError(last_error);
  }

  void Proxy(const http::Request& req, http::Exchange& ex, bool generation, bool chat,
             bool responses = false) {
    const auto t0 = Clock::now();
    ++active;
    struct Done {
      std::atomic<int>& n;
      ~Done() { --n; }
    } done{active};
    if (auto denied = Deny(req)) return ex.Respond(*std::move(denied));
    // The fields of the router's own legs (it sends them with its token) are never a client's.
    if (generation) {
      if (auto refused = RouterFields(req)) return ex.Respond(*std::move(refused));
    }
    // Flow control: the key's limits (its tenant's); without keys every request is one tenant.
    const TenantClass tenant = flow->Tenant(keys != nullptr ? req.Header("authorization") : "");
    if (generation) {
      int64_t retry_after = 0;
      if (absl::Status s = flow->Admit(tenant, &retry_after); !s.ok()) {
        http::Response r = Error(429, std::string(s.message()), "rate_limit_error");
        r.headers.emplace_back("Retry-After", absl::StrCat(std::max<int64_t>(1, retry_after)));
        return ex.Respond(std::move(r));
      }
    }
    // What the request's tokens count in its tenant's minute: its prompt's and what it got.
    Progress p;
    p.arrived = t0;
    int64_t prompt_used = 0;
    struct Count {
      FlowControl& flow;
      const TenantClass& tenant;
      const Progress& p;
      const int64_t& prompt;
      ~Count() {
        flow.Record(tenant,
                    prompt + (p.completion_tokens > 0 ? p.completion_tokens
                                                      : static_cast<int64_t>(p.tokens.size())));
      }
    } count{*flow, tenant, p, prompt_used};
    std::optional<Prompt> prompt;
    if (generation) {
      if (auto built = PromptOf(req, chat, responses); built.ok()) prompt = *std::move(built);
      if (prompt) prompt_used = static_cast<int64_t>(prompt->tokens.size());
    }
    // The queue: until a replica has room (no tenant's key jumps ahead of its class).
    const auto queued = Clock::now();
    const int64_t priority = std::max(prompt ? prompt->priority : 0, tenant.priority);
    if (absl::Status s = Enter(generation, priority, tenant, ex, t0); !s.ok()) {
      if (s.code() == absl::StatusCode::kCancelled) return;
      auto l = labels;
      l["reason"] = s.code() == absl::StatusCode::kResourceExhausted ? "full" : "timeout";
      queue_refused->Add(l).Increment();
      return ex.Respond(Error(503, std::string(s.message()), "server_error"));
    }
    const auto waited = Clock::now() - queued;
    // Placed once at a replica (or not sent); a generation request's tenant load until it ends.
    struct Admitted {
      Impl& s;
      const bool generation;
      const std::string& tenant;
      const int64_t priority;
      bool placed = false;
      void operator()() {
        if (!placed) s.Placed();
        placed = true;
      }
      ~Admitted() {
        (*this)();
        if (generation) s.Done(tenant, priority);
      }
    } placed{*this, generation, tenant.name, priority};
    std::vector<std::shared_ptr<Replica>> reps, prefill_reps;
    for (auto& r : Snapshot()) (r->prefill ? prefill_reps : reps).push_back(std::move(r));
    if (reps.empty()) {
      return ex.Respond(Error(503, "no replica of the model is known yet", "server_error"));
    }
    http::Headers headers;
    for (const char* h : {"authorization", "content-type", "accept", "x-request-id"}) {
      if (req.HasHeader(h)) headers.emplace_back(h, req.Header(h));
    }
    // The router's token: a leg of a disaggregated request, a resumed stream, and a stream's
    // progress (request migration) are the router's.
    if (!leader_token.empty()) {
      headers.emplace_back(kRouterHeader, absl::StrCat("Bearer ", leader_token));
    }
    // Disaggregated: the prompt computed on a prefill replica, its KV handed to the decode leg.
    std::string body = req.body;
    if (prompt && prompt->disaggregable && !prefill_reps.empty() &&
        static_cast<int64_t>(prompt->tokens.size()) >= options.disaggregate_min_tokens) {
      absl::StatusOr<PrefillLeg> leg = Prefill(req, ex, prefill_reps, *prompt, headers);
      auto l = labels;
      if (leg.ok() && leg->answer) return ex.Respond(*std::move(leg->answer));
      if (leg.ok()) {
        body = std::move(leg->decode_body);
        l["outcome"] = "paired";
      } else if (leg.status().code() == absl::StatusCode::kCancelled) {
        return;
      } else {
        LogWarning("router: prefill failed (", leg.status().message(),
                   "); a decode replica serves the request alone");
        l["outcome"] = "prefill_failed";
      }
      disaggregated->Add(l).Increment();
    }
    const Ranked ranked = RankFor(reps, prompt ? &*prompt : nullptr);
    const Ranking& rank = ranked.rank;
    if (generation) {
      auto l = labels;
      l["reason"] = ChoiceReasonName(rank.reason);
      decisions->Add(l).Increment();
      if (prompt) {
        prompt_tokens->Increment(static_cast<double>(prompt->tokens.size()));
        expected_cached->Increment(
            static_cast<double>(ranked.cands[rank.order[0]].matched_blocks * ranked.block_size));
      }
    }
    overhead->Observe(std::chrono::duration<double>(Clock::now() - t0 - waited).count());
    // Each replica in the ranking's order at most once: the next when one refuses the
    // connection or answers 503 before doing anything, or when the answer breaks off and the
    // request can go on elsewhere (request migration: Progress). A migration that finds no
    // replica taking requests (the others moving off a drained node, or one the router has not
    // found yet) waits for one, as a new request waits in the queue, and goes on there.
    std::string last_error = "no replica is known";
    Ranking resume_rank;  // the ranking of a migration's later round, over `reps` then
    const Ranking* order = &rank;
    const auto resume_until = Clock::now() + std::min<std::chrono::milliseconds>(
                                                 options.queue_timeout, std::chrono::seconds(60));
    for (bool again = true; again;) {
      again = false;
      for (size_t k = 0; k < order->order.size(); ++k) {
        Replica& r = *reps[order->order[k]];
        const bool more = k + 1 < order->order.size();
        if (p.legs > 0) {  // a migration goes to a replica that takes requests now
          absl::MutexLock lock(&r.mu);
          if (!Routable(r)) continue;
        }
        AtReplica at(*this, r);
        placed();
        // The first leg sends the request as it is (or its disaggregated decode leg); a migrated
        // one the client's request again, with the stream's progress when some of it was sent.
        const std::string leg_body = p.legs == 0     ? body
                                     : p.blocks == 0 ? req.body
                                                     : ResumeBody(req.body, p);
        auto call =
            http::UpstreamCall::Start(r.host, r.port, req.method, req.target, headers, leg_body,
                                      options.connect_timeout, options.answer_timeout);
        if (!call.ok()) {
          last_error = absl::StrCat(r.address, ": ", call.status().message());
          // Nothing reached the leader: another may answer.
          if (call.status().code() == absl::StatusCode::kUnavailable && more) {
            failovers->Increment();
            continue;
          }
          // It had the request and went before its answer's head (a whole answer's comes at its
          // end): another answers it, as for an answer that breaks off. (What the router serves
          // is generation and tokenization: asked again, the same.)
          if (call.status().code() != absl::StatusCode::kDeadlineExceeded && more &&
              p.legs < kMaxMigrations && p.CanResume()) {
            ++p.legs;
            MarkOut(r, std::string(call.status().message()));
            auto l = labels;
            l["reason"] = "failure";
            migrations->Add(l).Increment();
            continue;
          }
          const int status =
              call.status().code() == absl::StatusCode::kDeadlineExceeded ? 504 : 502;
          return Fail(ex, p, status, absl::StrCat("the replica did not answer: ", last_error),
                      responses);
        }
        if ((*call)->head().status == 503 && more) {  // not ready, or draining: nothing was done
          last_error = absl::StrCat(r.address, " answered 503");
          failovers->Increment();
          continue;
        }
        // A replica that does not know the adapter the request names did nothing either: it
        // missed a runtime load (through another router, or before this router replays it to a
        // new run of its leader) that the others took. The last replica's 404 is the client's.
        if ((*call)->head().status == 404 && prompt && !prompt->adapter.empty() && more) {
          last_error = absl::StrCat(r.address, " does not serve '", prompt->adapter, "'");
          failovers->Increment();
          continue;
        }
        ++p.legs;
        if (Relay(**call, r, ex, responses, p, more)) return;
        last_error = p.why;
        if (!p.CanResume() || p.legs > kMaxMigrations) break;
        auto l = labels;
        l["reason"] = p.draining ? "drain" : "failure";
        migrations->Add(l).Increment();
        LogInfo("router: a request answered by ", r.address, " goes on elsewhere (", p.why, "; ",
                p.tokens.size(), " tokens sent)");
      }
      if (p.legs > 0 && p.CanResume() && p.legs <= kMaxMigrations) {
        std::vector<std::shared_ptr<Replica>> next = RoutableReplicas(resume_until, ex);
        if (!next.empty()) {
          reps = std::move(next);
          resume_rank = RankFor(reps, prompt ? &*prompt : nullptr).rank;
          order = &resume_rank;
          again = true;
        }
      }
    }
    if (p.legs > 1) {
      auto l = labels;
      l["reason"] = "failed";
      migrations->Add(l).Increment();
    }
    Fail(ex, p, p.legs > 0 ? 502 : 503,
         p.legs > 0 ? absl::StrCat("the replica's answer broke off and no other replica resumed "
                                   "it (",
                                   p.legs, " tried): ", last_error)
                    : absl::StrCat("no replica of the model answered: ", last_error),
         responses);
  }

  // The (decode) replicas that take requests, once there is one: polled until `until` or the
  // client goes; none then.
  std::vector<std::shared_ptr<Replica>> RoutableReplicas(Clock::time_point until,
                                                         http::Exchange& ex) {
    for (;;) {
      std::vector<std::shared_ptr<Replica>> out;
      for (auto& r : Snapshot()) {
        absl::MutexLock lock(&r->mu);
        if (!r->prefill && Routable(*r)) out.push_back(r);
      }
      if (!out.empty() || Clock::now() >= until || ex.ClientGone() || stopping.HasBeenNotified()) {
        return out;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  // A client's request carrying a field only the router sends (a disaggregated leg's
  // kv_transfer_params, a migrated stream's shardserve_resume): 401, as a leader answers it
  // without the router's token (which the router adds to what it relays).
  std::optional<http::Response> RouterFields(const http::Request& req) {
    if (!absl::StrContains(req.body, "kv_transfer_params") &&
        !absl::StrContains(req.body, "shardserve_resume")) {
      return std::nullopt;
    }
    const ojson body = ojson::parse(req.body, nullptr, /*allow_exceptions=*/false);
    if (!body.is_object()) return std::nullopt;  // the leader names what is wrong with it
    for (const char* field : {"kv_transfer_params", "shardserve_resume"}) {
      if (auto it = body.find(field); it != body.end() && !it->is_null()) {
        return Error(
            401,
            absl::StrCat("'", field, "' is the model's router's own: a client may not send it"),
            "invalid_request_error");
      }
    }
    return std::nullopt;
  }

  // The client hears that its request failed: an error answer, or, once its stream started, an
  // error event ending it (never [DONE]).
  void Fail(http::Exchange& ex, const Progress& p, int status, const std::string& why,
            bool responses) {
    if (!p.stream_open) return ex.Respond(Error(status, why, "server_error"));
    ex.Write(BrokenStreamEvent(why, responses));
    ex.End();
  }

  // The client's request body with the stream's progress ("shardserve_resume": the tokens the
  // client has, the stream's id, time and seed), for the replica that resumes it.
  static std::string ResumeBody(const std::string& request_body, const Progress& p) {
    ojson body = ojson::parse(request_body, nullptr, /*allow_exceptions=*/false);
    if (!body.is_object()) return request_body;  // the leader read it: never so
    ojson resume = {{"tokens", p.tokens}, {"seed", p.seed}};
    if (!p.id.empty()) resume["id"] = p.id;
    if (p.created > 0) resume["created"] = p.created;
    body["shardserve_resume"] = std::move(resume);
    return body.dump();
  }

  // POST /v1/load_lora_adapter and /v1/unload_lora_adapter: an admin's call, sent to every
  // replica this router follows, at once (each leader checks the admin key; the router holds
  // none of its own). 200 with the leaders' answer when every one answered 200; else the status
  // they all answered (a 4xx the call earned), or 502, with each replica's answer. A load some
  // leader took is remembered and replayed to replicas that did not answer for it
  // (SyncAdapters); an unload forgets it.
  void FanOut(const http::Request& req, http::Exchange& ex) {
    const std::vector<std::shared_ptr<Replica>> reps = Snapshot();
    if (reps.empty()) {
      return ex.Respond(Error(503, "no replica of the model is known yet", "server_error"));
    }
    http::Headers headers;
    for (const char* h : {"authorization", "content-type"}) {
      if (req.HasHeader(h)) headers.emplace_back(h, req.Header(h));
    }
    const bool load = req.target == "/v1/load_lora_adapter";
    const ojson body = ojson::parse(req.body, nullptr, /*allow_exceptions=*/false);
    const std::string name =
        body.is_object() && body.contains("lora_name") && body["lora_name"].is_string()
            ? body["lora_name"].get<std::string>()
            : "";
    absl::MutexLock order(&adapters_mu);
    if (!load) runtime_adapters.erase(name);
    std::vector<Answer> answers(reps.size());
    {
      const auto timeout =
          std::min<std::chrono::milliseconds>(options.answer_timeout, std::chrono::seconds(120));
      std::vector<std::thread> calls;
      for (size_t i = 0; i < reps.size(); ++i) {
        calls.emplace_back(
            [&, i] { answers[i] = Call(*reps[i], req.target, headers, req.body, timeout); });
      }
      for (std::thread& t : calls) t.join();
    }
    std::set<int> statuses;
    std::vector<std::string> each;
    for (size_t i = 0; i < reps.size(); ++i) {
      statuses.insert(answers[i].status);
      each.push_back(
          absl::StrCat(reps[i]->address, ": ",
                       answers[i].status == 0 ? "no answer" : absl::StrCat(answers[i].status), " ",
                       answers[i].body.substr(0, 300)));
    }
    if (load && !name.empty() && statuses.count(200)) {
      runtime_adapters[name] = RuntimeAdapter{req.body, headers};
      for (size_t i = 0; i < reps.size(); ++i) Given(*reps[i], name, answers[i].status);
    }
    if (statuses == std::set<int>{200}) {
      CountRequest(200);
      http::Response r{200, "text/plain", answers[0].body, {}};
      r.headers.emplace_back("x-shardserve-replicas", absl::StrCat(reps.size()));
      return ex.Respond(std::move(r));
    }
    const int status = statuses.size() == 1 && *statuses.begin() >= 400 && *statuses.begin() < 500
                           ? *statuses.begin()
                           : 502;
    ex.Respond(Error(
        status,
        absl::StrCat(req.target, " on ", reps.size(), " replica(s): ", absl::StrJoin(each, "; ")),
        status == 502 ? "server_error" : "invalid_request_error"));
  }

  struct Answer {
    int status = 0;  // 0: none came
    std::string body;
  };
  static Answer Call(const Replica& r, const std::string& target, const http::Headers& headers,
                     const std::string& body, std::chrono::milliseconds timeout) {
    auto a = http::Fetch(r.host, r.port, "POST", target, headers, body, timeout);
    return a.ok() ? Answer{a->status, std::move(a->body)}
                  : Answer{0, std::string(a.status().message())};
  }

  // r's leader answered `status` for the runtime adapter `name`: taken (2xx) or refused by its
  // own word (4xx, "already loaded" included: the admin's to fix, not retried); no answer or a
  // 5xx is tried again.
  static void Given(Replica& r, const std::string& name, int status) {
    if (status < 200 || status >= 500) return;
    absl::MutexLock lock(&r.mu);
    if (r.adapters_epoch != r.epoch) {  // a new run of the leader holds none of them
      r.adapters_given.clear();
      r.adapters_epoch = r.epoch;
    }
    r.adapters_given.insert(name);
  }

  // Every resolve_every: the runtime adapters a live replica's leader (this run of it) has not
  // answered for are loaded on it, with the admin's headers of the load, one call at a time.
  void SyncAdapters() {
    do {
      absl::MutexLock order(&adapters_mu);
      for (const std::shared_ptr<Replica>& r : Snapshot()) {
        std::vector<std::string> missing;
        {
          absl::MutexLock lock(&r->mu);
          if (!r->live || r->epoch.empty()) continue;
          if (r->adapters_epoch != r->epoch) {
            r->adapters_given.clear();
            r->adapters_epoch = r->epoch;
          }
          for (const auto& [name, a] : runtime_adapters) {
            if (!r->adapters_given.count(name)) missing.push_back(name);
          }
        }
        for (const std::string& name : missing) {
          if (stopping.HasBeenNotified()) return;
          const RuntimeAdapter& a = runtime_adapters.at(name);
          const Answer answer =
              Call(*r, "/v1/load_lora_adapter", a.headers, a.body, std::chrono::seconds(10));
          LogInfo("router: the runtime LoRA adapter '", name, "' replayed to replica ", r->address,
                  ": ", answer.status == 0 ? "no answer" : absl::StrCat(answer.status), " ",
                  answer.body.substr(0, 200));
          Given(*r, name, answer.status);
        }
      }
    } while (!stopping.WaitForNotificationWithTimeout(absl::FromChrono(options.resolve_every)));
  }

  // The leader's answer, passed on: a whole answer with its length, a stream event by event,
  // its progress lines taken out (Progress). True when the request is over (answered, or the
  // client gone); false when the leg broke off (p.why says how) and the request may go on
  // elsewhere: an answer that breaks off, or a stream that ends unfinished or with its replica's
  // failure, takes the replica out of routing at once; a stream whose replica drains is left for
  // another that takes requests, at an event's end. `more`: other replicas follow in the
  // ranking (a whole answer of 5xx is then not the last word).
  bool Relay(http::UpstreamCall& call, Replica& replica, http::Exchange& ex, bool responses,
             Progress& p, bool more) {
    const std::string& address = replica.address;
    const auto& head = call.head();
    http::Response out{head.status, head.content_type, "", {}};
    bool streamed = true;
    for (const auto& [k, v] : head.headers) {
      if (k == "retry-after" || k == "www-authenticate" || k == "cache-control") {
        out.headers.emplace_back(k, v);
      }
      if (k == "content-length") streamed = false;
    }
    out.headers.emplace_back("x-shardserve-replica", address);
    const auto deadline = Clock::now() + options.answer_timeout;
    if (!streamed) {
      for (;;) {
        bool end = false;
        absl::StatusOr<std::string> piece = call.Read(std::chrono::milliseconds(1000), &end);
        if (!piece.ok() && piece.status().code() == absl::StatusCode::kDeadlineExceeded &&
            Clock::now() < deadline && !ex.ClientGone()) {
          continue;
        }
        if (!piece.ok() && ex.ClientGone()) return true;
        if (!piece.ok()) {
          MarkOut(replica, std::string(piece.status().message()));
          p.why = absl::StrCat(address, ": its answer broke off: ", piece.status().message());
          return false;
        }
        if (out.body.size() + piece->size() > kMaxAnswerBytes) {
          p.why = absl::StrCat(address, ": an answer over 64 MiB");
          p.resumable = false;
          return false;
        }
        out.body += *piece;
        if (!end) continue;
        if (p.stream_open) {  // a replica would not resume the stream: what it said ends it
          p.why = absl::StrCat(address, " answered ", head.status, ": ", out.body.substr(0, 300));
          p.resumable = false;
          return false;
        }
        if (head.status >= 500 && more) {  // its replica failed it: another answers it whole
          MarkOut(replica, absl::StrCat("it answered ", head.status));
          p.why = absl::StrCat(address, " answered ", head.status, ": ", out.body.substr(0, 300));
          return false;
        }
        if (head.status == 200) {  // its usage, for the tenant's minute
          const json answer = json::parse(out.body, nullptr, /*allow_exceptions=*/false);
          if (answer.is_object() && answer.contains("usage") && answer["usage"].is_object() &&
              answer["usage"].contains("completion_tokens") &&
              answer["usage"]["completion_tokens"].is_number_integer()) {
            p.completion_tokens = answer["usage"]["completion_tokens"].get<int64_t>();
          }
        }
        CountRequest(head.status);
        ex.Respond(std::move(out));
        return true;
      }
    }
    if (!p.stream_open) {
      CountRequest(head.status);
      if (!ex.StartStream(out)) return true;
      p.stream_open = true;
    }
    std::string block;       // the event being read
    std::string tail;        // the last bytes sent on
    std::string last_event;  // a Responses stream's last event type ("event: TYPE" lines)
    auto checked = Clock::now();
    for (;;) {
      bool end = false;
      absl::StatusOr<std::string> piece = call.Read(std::chrono::milliseconds(200), &end);
      if (!piece.ok() && piece.status().code() == absl::StatusCode::kDeadlineExceeded &&
          Clock::now() < deadline) {
        if (ex.ClientGone()) {  // the leader frees the sequence
          call.Close();
          return true;
        }
        piece = std::string();
      } else if (!piece.ok()) {
        if (p.finished && !responses) return EndFinished(ex);
        MarkOut(replica, absl::StrCat("its answer stream broke off: ", piece.status().message()));
        p.why = absl::StrCat(address, ": its answer stream broke off: ", piece.status().message());
        return false;
      }
      block += *piece;
      for (size_t at; (at = block.find("\n\n")) != std::string::npos;) {
        const std::string event = block.substr(0, at);
        block.erase(0, at + 2);
        switch (Forward(event, ex, responses, p, tail, last_event)) {
          case Sent::kOn:
            ObserveLatency(replica, p);
            break;
          case Sent::kClientGone:
            call.Close();
            return true;
          case Sent::kFailed:
            MarkOut(replica, "its replica failed mid-answer");
            p.why = absl::StrCat(address, ": its replica failed mid-answer");
            return false;
        }
      }
      if (block.size() > kMaxAnswerBytes) {
        p.why = absl::StrCat(address, ": an event over 64 MiB");
        p.resumable = false;
        return false;
      }
      if (end) {
        // A stream the leader ended without its last event was cut short: its process stopped
        // in the middle.
        if (StreamFinished(tail, last_event, responses)) {
          ex.End();
          return true;
        }
        if (p.finished && !responses) return EndFinished(ex);
        MarkOut(replica, "its answer stream ended unfinished");
        p.why = absl::StrCat(address, ": its answer stream ended unfinished");
        return false;
      }
      // A replica that drains hands its reported streams to one that takes requests.
      if (p.reported && !p.finished && Clock::now() - checked >= std::chrono::milliseconds(200)) {
        checked = Clock::now();
        if (Draining(replica) && AnotherRoutable(replica)) {
          call.Close();
          p.draining = true;
          p.why = absl::StrCat(address, " drains");
          return false;
        }
      }
    }
  }

  enum class Sent { kOn, kClientGone, kFailed };
  // One event of a leader's stream: its progress lines read into p, the rest sent on.
  Sent Forward(const std::string& event, http::Exchange& ex, bool responses, Progress& p,
               std::string& tail, std::string& last_event) {
    std::string kept;
    bool carried = false;  // a progress line gave the event's tokens
    for (absl::string_view line : absl::StrSplit(event, '\n')) {
      if (!absl::StartsWith(line, ":")) {
        absl::StrAppend(&kept, line, "\n");
        if (responses && absl::StartsWith(line, "event: "))
          last_event = std::string(line.substr(7));
        continue;
      }
      if (absl::ConsumePrefix(&line, ": tokens ")) {
        carried = true;
        for (absl::string_view t : absl::StrSplit(line, ',')) {
          int32_t id;
          if (!absl::SimpleAtoi(t, &id) || id < 0 || p.tokens.size() >= kMaxProgressTokens) {
            p.reported = false;  // not a progress the router can resume from
            continue;
          }
          p.tokens.push_back(id);
        }
      } else if (absl::ConsumePrefix(&line, ": seed ")) {
        p.reported = absl::SimpleAtoi(line, &p.seed);
      } else if (line == ": failed") {
        return Sent::kFailed;
      }
    }
    if (kept.empty()) return Sent::kOn;
    if (p.id.empty() && absl::StartsWith(kept, "data: {")) {
      const json first = json::parse(kept.substr(6), nullptr, /*allow_exceptions=*/false);
      if (first.is_object() && first.contains("id") && first["id"].is_string()) {
        p.id = first["id"].get<std::string>();
        if (first.contains("created") && first["created"].is_number_unsigned()) {
          p.created = first["created"].get<int64_t>();
        }
      }
    }
    if (absl::StrContains(kept, "\"finish_reason\":\"")) p.finished = true;
    kept += "\n";
    if (!ex.Write(kept)) return Sent::kClientGone;
    ++p.blocks;
    p.token_event = carried || !p.reported;
    tail += kept;
    if (tail.size() > 64) tail.erase(0, tail.size() - 64);
    return Sent::kOn;
  }

  // The latency the client saw of an event just sent (its first tokens', from the request's
  // arrival here; a later one's, from the event before), counted for the replica it came from.
  static void ObserveLatency(Replica& replica, Progress& p) {
    if (!p.token_event) return;
    p.token_event = false;
    const auto now = Clock::now();
    if (replica.slo) {
      const bool first = p.last_token == Clock::time_point{};
      replica.slo->Observe(
          first ? SloKind::kTtft : SloKind::kItl,
          std::chrono::duration<double>(now - (first ? p.arrived : p.last_token)).count());
    }
    p.last_token = now;
  }

  // A stream whose choice finished but whose leader went before its end: the answer is whole
  // (only a usage event may be missing).
  bool EndFinished(http::Exchange& ex) {
    ex.Write("data: [DONE]\n\n");
    ex.End();
    return true;
  }

  bool Draining(Replica& r) {
    absl::MutexLock lock(&r.mu);
    return r.live && !r.load.accepting;
  }

  // Another replica (of r's role) takes requests now.
  bool AnotherRoutable(const Replica& r) {
    for (auto& o : Snapshot()) {
      if (o.get() == &r || o->prefill != r.prefill) continue;
      absl::MutexLock lock(&o->mu);
      if (Routable(*o)) return true;
    }
    return false;
  }
};

Router::Router(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Router::~Router() { Stop(std::chrono::milliseconds(0)); }

int Router::port() const { return impl_->http->port(); }

void Router::Stop(std::chrono::milliseconds drain) {
  if (!impl_ || impl_->stopping.HasBeenNotified()) return;
  const auto deadline = Clock::now() + drain;
  while (impl_->active.load() > 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  impl_->stopping.Notify();
  if (impl_->http) impl_->http->Stop();
  if (impl_->metrics_http) impl_->metrics_http->Stop();
  if (impl_->discovery.joinable()) impl_->discovery.join();
  if (impl_->adapter_sync.joinable()) impl_->adapter_sync.join();
  for (auto& r : impl_->Snapshot()) {
    r->stop.Notify();
    if (r->thread.joinable()) r->thread.join();
  }
}

absl::StatusOr<std::unique_ptr<Router>> Router::Start(const RouterOptions& options) {
  auto impl = std::make_unique<Impl>();
  Impl* s = impl.get();
  s->options = options;
  if (options.leaders.empty()) {
    return absl::InvalidArgumentError("no leaders: give --leader HOST:PORT or dns:NAME:PORT");
  }
  for (const std::string& l : options.leaders) {
    ASSIGN_OR_RETURN(LeaderSpec spec, ParseLeaderSpec(l));
    s->specs.push_back(spec);
  }
  for (const std::string& l : options.prefill_leaders) {
    ASSIGN_OR_RETURN(LeaderSpec spec, ParseLeaderSpec(l));
    spec.prefill = true;
    s->specs.push_back(spec);
  }
  if (!options.prefill_leaders.empty() && options.leader_token_file.empty()) {
    return absl::InvalidArgumentError(
        "prefill leaders need the router's token (--leader-token-file): the replicas take a "
        "disaggregated request's legs from the router only");
  }
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(options.model_path));
  s->context = config.max_context;
  ASSIGN_OR_RETURN(s->tokenizer, Tokenizer::Load(options.model_path));
  s->chat = ChatTemplate::ForModel(options.model_path, *s->tokenizer, options.chat_template);
  s->prompts =
      std::make_unique<PromptBuilder>(s->tokenizer.get(), &s->chat, options.special_tokens_as_text,
                                      options.trust_request_chat_template);
  ASSIGN_OR_RETURN(s->keys, ApiKeys::Open(options.api_key, options.api_keys_file));
  ASSIGN_OR_RETURN(s->flow, FlowControl::Open(options.flow_control_file, options.flow_share));
  if (!options.leader_token_file.empty()) {
    ASSIGN_OR_RETURN(s->leader_token, ReadToken(options.leader_token_file));
    ASSIGN_OR_RETURN(s->metrics_keys, ApiKeys::Open("", options.leader_token_file));
  }
  s->InitMetrics();

  http::ServerOptions server;
  server.host = options.host;
  server.port = options.port;
  server.max_body_bytes = options.max_body_bytes;
  server.max_blocking = options.max_blocking + std::max(0, options.queue_max);  // held ones too
  server.error = [s](int status, const std::string& reason) {
    return s->Error(status, reason, status >= 500 ? "server_error" : "invalid_request_error");
  };
  http::Routes routes;
  routes.PostBlocking("/v1/completions", [s](const http::Request& req, http::Exchange& ex) {
    s->Proxy(req, ex, true, false);
  });
  routes.PostBlocking("/v1/chat/completions", [s](const http::Request& req, http::Exchange& ex) {
    s->Proxy(req, ex, true, true);
  });
  routes.PostBlocking("/v1/responses", [s](const http::Request& req, http::Exchange& ex) {
    s->Proxy(req, ex, true, true, /*responses=*/true);
  });
  for (const char* path : {"/tokenize", "/detokenize"}) {
    routes.PostBlocking(path, [s](const http::Request& req, http::Exchange& ex) {
      s->Proxy(req, ex, false, false);
    });
  }
  for (const char* path : {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}) {
    routes.PostBlocking(path,
                        [s](const http::Request& req, http::Exchange& ex) { s->FanOut(req, ex); });
  }
  routes.GetBlocking("/v1/models", [s](const http::Request& req, http::Exchange& ex) {
    s->Proxy(req, ex, false, false);
  });
  routes.Get("/healthz", [](const http::Request&) {
    return http::Response{200, "application/json", "{\"status\":\"ok\"}", {}};
  });
  routes.Get("/readyz", [s](const http::Request&) {
    int routable = 0;
    for (auto& r : s->Snapshot()) {
      absl::MutexLock lock(&r->mu);
      routable += s->Routable(*r);
    }
    // With its queue, the router takes requests while no replica does (scaled to zero, or
    // restarting): it holds them until one does.
    if (routable > 0 || s->Queueing()) {
      return http::Response{
          200,
          "application/json",
          json{{"ready", true}, {"routable_replicas", routable}, {"holding", routable == 0}}.dump(),
          {}};
    }
    return http::Response{
        503,
        "application/json",
        json{{"ready", false}, {"reason", "no replica's KV events stream is live"}}.dump(),
        {}};
  });
  routes.Get("/metrics", [s](const http::Request& req) {
    // The router's figures (expected hits, every replica's load) are the deployment's: read
    // with the router token, never with a tenant's API key.
    if (auto denied = s->DenyMetrics(req)) return *std::move(denied);
    return s->MetricsPage();
  });
  if (options.prefix_cache_per_key && s->keys == nullptr) {  // else it would isolate nothing
    return absl::FailedPreconditionError(
        "prefix cache isolation perKey names block chains by API key, and the router has none");
  }
  ASSIGN_OR_RETURN(s->http, http::Server::Start(server, std::move(routes)));
  if (options.metrics_port >= 0) {  // as a rank's metrics port: read without a token
    http::Routes metrics;
    metrics.Get("/metrics", [s](const http::Request&) { return s->MetricsPage(); });
    http::ServerOptions page;
    page.host = options.host;
    page.port = options.metrics_port;
    page.max_body_bytes = 0;
    page.max_blocking = 0;
    auto started = http::Server::Start(page, std::move(metrics));
    if (!started.ok()) {
      return absl::UnavailableError(absl::StrCat("cannot serve the router's metrics on port ",
                                                 options.metrics_port, ": ",
                                                 started.status().message()));
    }
    s->metrics_http = *std::move(started);
  }
  s->discovery = std::thread([s] { s->Discover(); });
  s->adapter_sync = std::thread([s] { s->SyncAdapters(); });
  if (s->keys == nullptr) {
    LogWarning("router: no API keys: anyone who reaches ", options.host, ":", s->http->port(),
               " can use the model");
  }
  return std::unique_ptr<Router>(new Router(std::move(impl)));
}

}  // namespace shardserve
