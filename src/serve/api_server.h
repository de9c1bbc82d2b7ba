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
class Registry;
}

namespace shardserve {

class LeaderMetrics;

struct ServeConfig {
  std::string host = "0.0.0.0";
  int port = 8000;
  std::string model_name = "model";
  std::string metrics_model;  // the `model` label of the request metrics ("": model_name)
  std::string model_dir;
  std::string replica = "0";
  int max_batch = 32;
  int max_queue = 128;
  int64_t max_step_tokens = 512;
  size_t max_body_bytes = 4 << 20;
  int64_t drain_seconds = 5;  // on SIGTERM, requests in progress may finish for this long
  // A request's head must arrive within header_timeout, its body within body_timeout.
  std::chrono::milliseconds header_timeout{10000};
  std::chrono::milliseconds body_timeout{60000};
  size_t max_connections = 4096;
  bool metrics_need_key = true;  // with API keys, /metrics needs one too
  std::string api_key;           // SHARDSERVE_API_KEY (ApiKeys)
  std::string api_keys_file;     // SHARDSERVE_API_KEYS_FILE
};

// The address and batch of the worker contract (`env`: api_host, api_port, max_batch_size), then
// the server's tunables from this process's environment, SHARDSERVE_MAX_QUEUE,
// SHARDSERVE_MAX_STEP_TOKENS, SHARDSERVE_MAX_BODY_BYTES, SHARDSERVE_DRAIN_SECONDS,
// SHARDSERVE_HTTP_HEADER_TIMEOUT_MS, SHARDSERVE_HTTP_BODY_TIMEOUT_MS,
// SHARDSERVE_HTTP_MAX_CONNECTIONS and SHARDSERVE_API_METRICS_AUTH (true|false), over the given
// defaults (model name, directory and replica come from the rank's config), and the API keys:
// SHARDSERVE_API_KEY, and the contract's SHARDSERVE_API_KEYS_FILE. Errors name the variable.
absl::StatusOr<ServeConfig> ServeConfigFrom(ServeConfig defaults, const WorkerEnv& env);

class ApiServer {
 public:
  // Loads the tokenizer and the chat template of config.model_dir, binds and starts serving.
  static absl::StatusOr<std::unique_ptr<ApiServer>> Start(const ServeConfig& config);
  ~ApiServer();

  int port() const { return port_; }
  // The rank's own registry joins this server's /metrics; `expose` puts the request metrics on
  // the rank's page too. Either may be null.
  void AttachRankMetrics(std::shared_ptr<prometheus::Registry> rank,
                         const std::function<void(std::shared_ptr<prometheus::Registry>)>& expose);
  // Generation is served by `engine` (ready) or not at all (null; `reason` for /readyz).
  void SetEngine(Engine* engine, const std::string& reason = "");
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
