#pragma once
// shardserve-router (DESIGN.md §1): the front of a model with several replicas. It sends each
// request to the replica whose prefix cache holds the longest start of its prompt, weighed
// against the replicas' load (router/choice.h), and streams the answer back unchanged.
//
//   - Replicas: the leaders' API addresses, given as HOST:PORT or as dns:NAME:PORT (every address
//     NAME resolves to, looked up again every few seconds: a headless Service of the leaders);
//     a leader that is gone from the list is forgotten, a new one followed.
//   - What each caches: the leader's own report, GET /v1/kv-events (serve/kv_events.h), read
//     from a snapshot on, with the leader's token. A stream that breaks, or says nothing for
//     2 s, forgets the replica's cache until it is read again from a new snapshot (a recreated
//     replica starts empty, and says so).
//   - The prompt: the request rendered and tokenized as the leader does (serve/prompts.h, the
//     model's tokenizer and chat template), its full blocks named by the same hash chain.
//   - The API keys: with keys, a request without a valid one is answered 401 here, as the
//     leader would; the header goes on to the leader, which checks it again.
//   - Failover: a replica that refuses the connection or answers 503 before any byte of the
//     answer is sent on is skipped for the next in the ranking; the client sees an error only
//     when none answers.
//   - A replica whose answer breaks off is taken out of routing at once; a stream cut short ends
//     with an error event (no [DONE]). /readyz: ready while some replica is routable (its KV
//     events live and it takes requests: a draining replica does not count), or while none is
//     and the router holds requests in its queue (RouterOptions::queue_max; "holding": true).
//   - /metrics (with the router token; never with an API key: the expected hits and the
//     replicas' load are the deployment's, not a tenant's):
//   shardserve_router_requests_total{code}, _decisions_total{reason}, _queue_depth,
//     _queue_wait_seconds, _queue_refused_total{reason}, _slo_ratio{replica, slo} and
//     _slo_target_seconds (metrics/slo.h, with latency targets),
//     _failovers_total, _prompt_tokens_total and _expected_cached_tokens_total (the hit rate it
//     expected), _overhead_seconds (a request's time in the router before it is sent on),
//     _replicas{state}, and per replica (label `replica`, its address) _replica_in_flight,
//     _replica_running, _replica_waiting, _replica_kv_usage_ratio, _replica_cached_blocks.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "api/worker_env.h"
#include "metrics/slo.h"
#include "router/choice.h"

namespace shardserve {

struct RouterOptions {
  std::string host = "0.0.0.0";
  int port = 8000;
  std::vector<std::string> leaders;  // HOST:PORT or dns:NAME:PORT
  // Disaggregated serving (serve/kv_handoff.h): the prefill replicas' leaders. With them,
  // `leaders` are the decode replicas; a generation request of at least disaggregate_min_tokens
  // prompt tokens is prefilled on a prefill replica (chosen by prefix and load) and decoded on a
  // decode replica (by prefix, load and KV room), its KV crossing between their ranks; a shorter
  // one, or one a prefill replica cannot take, is served by a decode replica alone.
  std::vector<std::string> prefill_leaders;
  int64_t disaggregate_min_tokens = 0;
  std::string model_path;   // the tokenizer and chat template
  std::string model_label;  // the metrics' `model`
  bool special_tokens_as_text = false;
  std::string chat_template;                 // spec.serving.chatTemplate, "" for the model's
  bool trust_request_chat_template = false;  // spec.serving.trustRequestChatTemplate
  std::string api_key, api_keys_file;        // the clients' keys, as the leaders have them
  std::string leader_token_file;             // proves the router to the leaders' /v1/kv-events
  // spec.serving.prefixCacheIsolation perKey: block names salted with the client's key, as the
  // leaders name them.
  bool prefix_cache_per_key = false;
  // The base model's served name: a request's `model` other than it names a LoRA adapter, whose
  // blocks the leaders salt with its name (serve/prefix_cache.h). "": every request's is the base.
  std::string model_name;
  // Flow control (serve/flow_control.h): each key's limits are checked here (a 429 naming the
  // limit, with Retry-After), 1/flow_share of each (the model's routers), and the tokens of
  // what it relays counted; the leaders take the tenant's priority and weight from the same file.
  std::string flow_control_file;
  int flow_share = 1;
  // The queue: a generation request waits here while no replica has room in its batch (each
  // replica's running and waiting requests, by its reports and this router's own, below its
  // batch and a quarter), or none is ready (scaled to zero, restarting): at most queue_max of
  // them (past it, 503 naming the queue), each at most queue_timeout (then 503 saying what it
  // waited for). They leave by priority (the request's `priority`, bounded by its tenant's
  // class, lower first), then weighted fair between tenants (router/fair_queue.h), as a
  // replica has room.
  int queue_max = 256;
  std::chrono::milliseconds queue_timeout{120000};
  // Latency targets (metrics/slo.h): what the clients see of each replica's answers (the time
  // from a request's arrival here to its stream's first token, the gaps between its events).
  SloTargets slo;
  int metrics_port = -1;  // /metrics without a token on this port as well (-1: none)
  ChoiceWeights weights;
  std::chrono::milliseconds resolve_every{2000};
  std::chrono::milliseconds connect_timeout{2000};
  std::chrono::milliseconds answer_timeout{600000};  // a leader's whole answer
  // The leaders' bound: a body they would refuse is refused here before it is tokenized.
  size_t max_body_bytes = static_cast<size_t>(WorkerEnv::Defaults().max_body_bytes);
  int max_blocking = 256;
};

// "HOST:PORT" or "dns:NAME:PORT", checked; InvalidArgument names the bad entry.
absl::Status CheckLeaderSpec(const std::string& spec);

class Router {
 public:
  // Loads the tokenizer, binds host:port and starts following the leaders.
  static absl::StatusOr<std::unique_ptr<Router>> Start(const RouterOptions& options);
  ~Router();
  int port() const;
  // Stops listening and following; waits for the requests in progress (at most `drain`).
  void Stop(std::chrono::milliseconds drain);

  struct Impl;

 private:
  explicit Router(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardserve
