// shardserve-router: the front of a model's replicas (router/router.h). Flags, each over the
// router's contract (api/router_env.h: what the operator and `shardserve local` set):
//   --leader HOST:PORT | dns:NAME:PORT   (repeatable, or comma-separated;
//   SHARDSERVE_ROUTER_LEADERS): the replicas' leaders (with prefill leaders: the decode replicas')
//   --prefill-leader ... (SHARDSERVE_ROUTER_PREFILL_LEADERS): disaggregated serving's prefill
//   replicas; --disaggregate-min-tokens N (SHARDSERVE_ROUTER_DISAGGREGATE_MIN_TOKENS, 0): shorter
//   prompts are served by a decode replica alone
//   --model DIR                         (SHARDSERVE_MODEL_PATH): the tokenizer and chat template
//   --port N (SHARDSERVE_ROUTER_PORT, 8000)  --host ADDR (0.0.0.0)
//   --api-key-file FILE (SHARDSERVE_API_KEYS_FILE)  --leader-token-file FILE
//   (SHARDSERVE_ROUTER_TOKEN_FILE)  --model-label NAME (SHARDSERVE_DEPLOYMENT)
//   --special-tokens-as-text (SHARDSERVE_SPECIAL_TOKENS_IN_CONTENT=text); SHARDSERVE_MAX_BODY_BYTES
//   and SHARDSERVE_PREFIX_CACHE_ISOLATION (none | perKey) as the leaders have them;
//   SHARDSERVE_FLOW_CONTROL_FILE as the leaders have it, SHARDSERVE_ROUTER_FLOW_SHARE (1): the
//   model's routers, each enforcing 1/n of every limit
//   SHARDSERVE_ROUTER_QUEUE_MAX (256) and SHARDSERVE_ROUTER_QUEUE_TIMEOUT_MS (120000): the
//   requests held while no replica has room, and how long each; SHARDSERVE_SLO_TTFT_MS,
//   SHARDSERVE_SLO_ITL_MS and SHARDSERVE_SLO_PERCENTILE as the leaders have them;
//   SHARDSERVE_ROUTER_METRICS_PORT (-1: none): /metrics without the token on a port of its own
//   --prefix-weight W --load-weight W --kv-weight W
// Runs until SIGINT/SIGTERM, then finishes the requests in progress (up to 30 s).
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "api/router_env.h"
#include "api/worker_env.h"
#include "common/args.h"
#include "common/log.h"
#include "common/status.h"
#include "router/router.h"

namespace {

absl::Status Run(int argc, char** argv) {
  using namespace shardserve;
  ASSIGN_OR_RETURN(
      Args a,
      Args::Parse(std::vector<std::string>(argv + 1, argv + argc),
                  {"leader", "prefill-leader", "disaggregate-min-tokens", "model", "port", "host",
                   "api-key-file", "leader-token-file", "model-label", "prefix-weight",
                   "load-weight", "kv-weight"},
                  {"special-tokens-as-text"}, "shardserve-router",
                  "Routes a model's requests to the replica that caches their prompt's prefix."));
  // The contract (api/router_env.h), then the flags over it.
  ASSIGN_OR_RETURN(RouterEnv env, RouterEnv::FromEnv());
  RouterOptions o;
  o.leaders = absl::StrSplit(a.GetOr("leader", env.leaders), ',', absl::SkipWhitespace());
  o.prefill_leaders =
      absl::StrSplit(a.GetOr("prefill-leader", env.prefill_leaders), ',', absl::SkipWhitespace());
  ASSIGN_OR_RETURN(o.disaggregate_min_tokens,
                   a.GetInt("disaggregate-min-tokens", env.disaggregate_min_tokens));
  if (o.disaggregate_min_tokens < 0) {
    return absl::InvalidArgumentError("--disaggregate-min-tokens must be >= 0");
  }
  o.model_path = a.GetOr("model", env.model_path);
  if (o.model_path.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--model (or ", kModelPathEnv, ") names the model directory"));
  }
  ASSIGN_OR_RETURN(int64_t port, a.GetInt("port", env.port));
  if (port < 0 || port > 65535) return absl::InvalidArgumentError("--port must be in 0-65535");
  o.port = static_cast<int>(port);
  o.host = a.GetOr("host", "0.0.0.0");
  o.api_keys_file = a.GetOr("api-key-file", env.api_keys_file);
  o.api_key = env.api_key;
  o.leader_token_file = a.GetOr("leader-token-file", env.token_file);
  o.model_label = a.GetOr("model-label", env.deployment);
  o.special_tokens_as_text = a.Has("special-tokens-as-text") || env.special_tokens_as_text;
  o.prefix_cache_per_key = env.prefix_cache_per_key;
  o.model_name = env.model_name;
  o.chat_template = env.chat_template;
  o.trust_request_chat_template = env.trust_request_chat_template;
  // The leaders' body bound, so that what they refuse is refused here before it is tokenized.
  o.max_body_bytes = static_cast<size_t>(env.max_body_bytes);
  o.flow_control_file = env.flow_control_file;
  o.flow_share = env.flow_share;
  o.queue_max = env.queue_max;
  o.queue_timeout = std::chrono::milliseconds(env.queue_timeout_ms);
  o.slo = {env.slo_ttft_ms / 1000.0, env.slo_itl_ms / 1000.0,
           static_cast<double>(env.slo_percentile)};
  o.metrics_port = env.metrics_port;
  ASSIGN_OR_RETURN(o.weights.prefix, a.GetDouble("prefix-weight", o.weights.prefix));
  ASSIGN_OR_RETURN(o.weights.load, a.GetDouble("load-weight", o.weights.load));
  ASSIGN_OR_RETURN(o.weights.kv, a.GetDouble("kv-weight", o.weights.kv));

  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);
  ASSIGN_OR_RETURN(std::unique_ptr<Router> router, Router::Start(o));
  std::printf("shardserve-router: http://%s:%d/v1 in front of %s\n", o.host.c_str(), router->port(),
              absl::StrJoin(o.leaders, ", ").c_str());
  std::fflush(stdout);
  int sig = 0;
  sigwait(&set, &sig);
  LogInfo("router: stopping (signal ", sig, ")");
  router->Stop(std::chrono::seconds(30));
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::Status s = Run(argc, argv);
  if (shardserve::IsHelp(s)) {
    std::printf("%s\n", std::string(s.message()).c_str());
    return 0;
  }
  if (!s.ok()) {
    std::fprintf(stderr, "shardserve-router: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
