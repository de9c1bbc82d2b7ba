#pragma once
// The leader's OpenAI-compatible HTTP API (DESIGN.md §5), on http::Server (http/server.h):
//   POST /v1/completions, POST /v1/chat/completions (JSON or server-sent events ending in
//   [DONE]), GET /v1/models, GET /healthz (the process serves), GET /readyz (every rank of the
//   replica is connected and loaded, and the replica is healthy), GET /metrics (this rank's
//   page plus the request metrics).
// With API keys (serve/api_keys.h), every endpoint but /healthz and /readyz (and /metrics when
// metrics_need_key is false) needs `Authorization: Bearer KEY`, else 401 with an OpenAI error
// body. Generation takes only JSON bodies (415 otherwise). A prompt is tokenized within the
// context's bound: one too long is refused by its size before any work, or as soon as its tokens
// exceed the context. Bad requests get a 4xx with an OpenAI error body; a full queue gets 429
// with Retry-After; a client that disconnects has its sequences cancelled at once. Health probes
// are answered on the server's I/O thread, however many clients are slow. The server starts
// before the replica is loaded (readyz false) and serves generation once SetEngine is called.
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>

#include "absl/status/statusor.h"
#include "api/worker_env.h"
#include "serve/engine.h"

namespace prometheus {
class Collectable;
class Registry;
}  // namespace prometheus

namespace shardserve {

class LeaderMetrics;

// The API's settings: the worker contract (its model, its API's address and limits, its keys:
// api/worker_env.h owns their names, defaults and bounds) and the address the leader listens on.
struct ServeConfig {
  WorkerEnv env;
  // env.api_host when set; else loopback for a replica whose ranks are all on this machine (its
  // leader address is loopback), else every address.
  std::string host;
};

ServeConfig ServeConfigFrom(const WorkerEnv& env, bool local);

class ApiServer {
 public:
  // Loads the tokenizer and the chat template of config.model_dir, binds and starts serving.
  static absl::StatusOr<std::unique_ptr<ApiServer>> Start(const ServeConfig& config);
  ~ApiServer();

  int port() const { return port_; }
  // The rank's own registry joins this server's /metrics; `expose` puts the request metrics on
  // the rank's page too. Either may be null.
  void AttachRankMetrics(
      std::shared_ptr<prometheus::Registry> rank,
      const std::function<void(std::shared_ptr<prometheus::Collectable>)>& expose);
  // Generation is served by `engine` (ready) or not at all (null; `reason` for /readyz).
  void SetEngine(Engine* engine, const std::string& reason = "");
  // A prefill replica's KV as the decode replicas find it (serve/kv_handoff.h).
  void SetKvSource(const KvRoleShape& shape, std::vector<std::string> addresses);
  // Figures the engine reports into the request metrics.
  EngineObserver Observer();
  // Waits until the generation requests in progress have been answered (at most `timeout`),
  // then stops listening.
  void Stop(std::chrono::milliseconds timeout);

  struct Impl;

 private:
  explicit ApiServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace shardserve
