#pragma once
// The router's contract (DESIGN.md §1), as WorkerEnv is the worker's: every SHARDSERVE_* variable
// shardserve-router reads, with its default and its bounds, in one table (router_env.cc). The
// operator (operator/builders.cc) and `shardserve local` write it with ToEnv(); router/main.cc
// reads it once with FromEnv() (its flags may then override a setting). A new setting is one field
// here and one line in the table.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "api/worker_env.h"

namespace shardserve {

struct ShardedModelSpec;

struct RouterEnv {
  // The leaders' API addresses, comma-separated: HOST:PORT or dns:NAME:PORT (router/router.h).
  std::string leaders;
  // Disaggregated serving: the prefill replicas' leaders (then `leaders` are the decode
  // replicas'), and the prompts shorter than this that a decode replica serves alone.
  std::string prefill_leaders;
  int64_t disaggregate_min_tokens = 0;
  int port = kDefaultApiPort;
  std::string model_path;            // the tokenizer and chat template
  std::string deployment = "model";  // the metrics' `model` label
  std::string model_name;            // the base model's served name (RouterOptions::model_name)
  std::string api_key;               // the clients' keys, as the leaders have them
  std::string api_keys_file;
  std::string token_file;  // the router token: its proof to the leaders, and what reads /metrics
  // Flow control (serve/flow_control.h): the config file, as the leaders have it, and the
  // routers of the model (each enforces 1/n of every limit).
  std::string flow_control_file;
  int flow_share = 1;
  // The router's queue (router/router.h): requests held while every replica is busy or none is
  // ready (scaled to zero), at most queue_max, each at most queue_timeout_ms.
  int queue_max = 256;
  int queue_timeout_ms = 120000;
  // Latency targets (spec.serving.slo), as the leaders have them.
  int slo_ttft_ms = 0;
  int slo_itl_ms = 0;
  int slo_percentile = 90;
  // The port of its /metrics without a token (the ranks' metrics port, which Prometheus'
  // PodMonitor scrapes); -1: its metrics only on its API port, with the router token.
  int metrics_port = -1;
  // As the leaders have them (WorkerEnv): a chat message's special-token strings as text; the
  // API key salting every block name; the body bound.
  bool special_tokens_as_text = false;
  std::string chat_template;  // spec.serving.chatTemplate (inline or from its ConfigMap)
  bool trust_request_chat_template = false;
  bool prefix_cache_per_key = false;
  int64_t max_body_bytes = WorkerEnv::Defaults().max_body_bytes;

  // The variables to set: the leaders and the model always, the rest where they differ from the
  // defaults above.
  std::vector<std::pair<std::string, std::string>> ToEnv() const;
  // What the router reads; an unset variable keeps its default, a bad one is an error naming it.
  static absl::StatusOr<RouterEnv> FromEnv(const EnvLookup& env = ProcessEnv);
  // Every variable of the table, in its order.
  static std::vector<std::string> Names();
  static const RouterEnv& Defaults();

  bool operator==(const RouterEnv&) const = default;
};

// The serving settings a model's router takes from its spec, as the leaders take theirs
// (ApplyServing): special tokens, prefix cache isolation, the body bound its env may set.
void ApplyServing(const ShardedModelSpec& spec, RouterEnv& r);

}  // namespace shardserve
