// shardserve-operator: reconciles ShardedModels into gang-placed worker pods (DESIGN.md §2-4).
//
//   shardserve-operator [--kubeconfig FILE] [--namespace NS] [--listen HOST:PORT]
//                       [--qps N] [--burst N] [--concurrency N]
//                       [--leader-elect] [--leader-election-namespace NS]
//                       [--leader-election-id NAME] [--lease-duration S] [--renew-deadline S]
//                       [--retry-period S]
//                       [--unschedulable-timeout S] [--restart-backoff S]
//                       [--restart-backoff-max S] [--placement-retry S]
//                       [--worker-defaults FILE.json] [--network-policies]
//                       [--allowed-host-paths DIR,DIR] [--allowed-images PREFIX,PREFIX]
//                       [--no-disruption-budgets] [--metrics-auth kubernetes|none]
//
// --worker-defaults: env, resources and security contexts for every worker pod
// (operator/builders.h); --network-policies: a NetworkPolicy per model, so only its own pods
// reach its ranks; --allowed-host-paths / --allowed-images: what a model may ask for (none
// listed: no hostPath model, any image); a PodDisruptionBudget per replica gang unless
// --no-disruption-budgets; --metrics-auth kubernetes: /metrics only for whom the apiserver
// authenticates and RBAC allows (operator/metrics_auth.h).
//
// SIGTERM/SIGINT stop it cleanly: the workers finish their current key and the lease is handed
// back, so a standby takes over at once. Losing the lease ends the process (exit 1), so two
// operators never act together.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/args.h"
#include "common/log.h"
#include "common/status.h"
#include "common/text.h"
#include "k8s/client.h"
#include "k8s/config.h"
#include "operator/controller.h"
#include "operator/leader_election.h"
#include "operator/metrics_auth.h"
#include "operator/operator_metrics.h"

namespace shardserve::op {
namespace {

constexpr char kUsage[] =
    "[--kubeconfig FILE] [--namespace NS] [--listen HOST:PORT]\n"
    "         [--qps N] [--burst N] [--concurrency N] [--leader-elect]\n"
    "         [--leader-election-namespace NS] [--leader-election-id NAME]\n"
    "         [--lease-duration S] [--renew-deadline S] [--retry-period S]\n"
    "         [--unschedulable-timeout S] [--restart-backoff S] [--restart-backoff-max S]\n"
    "         [--placement-retry S] [--worker-defaults FILE.json] [--network-policies]\n"
    "         [--allowed-host-paths DIR,DIR] [--allowed-images PREFIX,PREFIX]\n"
    "         [--no-disruption-budgets] [--metrics-auth kubernetes|none]\n"
    "(reconciles ShardedModels: places their replicas' pods, recreates failed replicas, rolls\n"
    "updates, reports status, events and metrics)";

absl::StatusOr<absl::Duration> Seconds(const Args& a, const std::string& flag, double def) {
  ASSIGN_OR_RETURN(double v, a.GetDouble(flag, def));
  if (v <= 0) return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be positive"));
  return absl::Seconds(v);
}

absl::Status Run(const std::vector<std::string>& argv) {
  ASSIGN_OR_RETURN(
      Args a,
      Args::Parse(argv,
                  {"kubeconfig", "namespace", "listen", "qps", "burst", "concurrency",
                   "leader-election-namespace", "leader-election-id", "lease-duration",
                   "renew-deadline", "retry-period", "unschedulable-timeout", "restart-backoff",
                   "restart-backoff-max", "placement-retry", "worker-defaults",
                   "allowed-host-paths", "allowed-images", "metrics-auth"},
                  {"leader-elect", "network-policies", "no-disruption-budgets"},
                  "shardserve-operator", kUsage));
  // Signals go to the main thread's sigwait below, never to a worker.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  ControllerOptions co;
  co.namespace_ = a.GetOr("namespace", "");
  ASSIGN_OR_RETURN(int64_t concurrency, a.GetInt("concurrency", 4));
  if (concurrency < 1) return absl::InvalidArgumentError("--concurrency must be at least 1");
  co.concurrency = static_cast<int>(concurrency);
  ASSIGN_OR_RETURN(co.timing.unschedulable_timeout, Seconds(a, "unschedulable-timeout", 120));
  ASSIGN_OR_RETURN(co.timing.backoff_base, Seconds(a, "restart-backoff", 2));
  ASSIGN_OR_RETURN(co.timing.backoff_max, Seconds(a, "restart-backoff-max", 300));
  ASSIGN_OR_RETURN(co.timing.placement_retry, Seconds(a, "placement-retry", 30));
  co.network_policies = a.Has("network-policies");
  co.disruption_budgets = !a.Has("no-disruption-budgets");
  for (const auto& [flag, list] : {std::pair{"allowed-host-paths", &co.policy.host_paths},
                                   std::pair{"allowed-images", &co.policy.image_prefixes}}) {
    for (absl::string_view v : absl::StrSplit(a.GetOr(flag, ""), ',', absl::SkipWhitespace())) {
      list->emplace_back(v);
    }
  }
  for (const std::string& dir : co.policy.host_paths) {
    if (dir.empty() || dir[0] != '/') {
      return absl::InvalidArgumentError(
          absl::StrCat("--allowed-host-paths: '", dir, "' is not an absolute directory"));
    }
  }
  const std::string metrics_auth = a.GetOr("metrics-auth", "none");
  if (metrics_auth != "kubernetes" && metrics_auth != "none") {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-auth '", metrics_auth, "' must be kubernetes or none"));
  }
  if (auto path = a.Get("worker-defaults")) {
    ASSIGN_OR_RETURN(std::string text, ReadFileToString(*path));
    json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) {
      return absl::InvalidArgumentError(absl::StrCat("--worker-defaults ", *path, ": not JSON"));
    }
    auto defaults = ReadWorkerDefaults(j);
    if (!defaults.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--worker-defaults ", *path, ": ", defaults.status().message()));
    }
    co.defaults = *std::move(defaults);
  }

  k8s::ClientOptions client_options;
  ASSIGN_OR_RETURN(client_options.qps, a.GetDouble("qps", 200));
  ASSIGN_OR_RETURN(int64_t burst, a.GetInt("burst", 400));
  if (client_options.qps <= 0 || burst < 1) {
    return absl::InvalidArgumentError("--qps must be positive and --burst at least 1");
  }
  client_options.burst = static_cast<int>(burst);
  client_options.user_agent = "shardserve-operator";
  k8s::KubeConfig config;
  if (auto path = a.Get("kubeconfig")) {
    ASSIGN_OR_RETURN(config, k8s::LoadKubeconfig(*path));
  } else {
    ASSIGN_OR_RETURN(config, k8s::DefaultConfig());
  }
  ASSIGN_OR_RETURN(auto client, k8s::Client::Create(config, client_options));

  const std::string listen = a.GetOr("listen", "0.0.0.0:8080");
  const size_t colon = listen.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(listen.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--listen '", listen, "' must be HOST:PORT (PORT 0 picks a free one)"));
  }

  const bool elect = a.Has("leader-elect");
  LeaderElectionOptions lo;
  lo.namespace_ = a.GetOr("leader-election-namespace", config.namespace_);
  lo.name = a.GetOr("leader-election-id", "shardserve-operator");
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  lo.identity = absl::StrCat(host, "_", getpid());
  SetLogIdentity(absl::StrCat("operator ", host));
  ASSIGN_OR_RETURN(absl::Duration lease, Seconds(a, "lease-duration", 15));
  ASSIGN_OR_RETURN(absl::Duration renew, Seconds(a, "renew-deadline", 10));
  ASSIGN_OR_RETURN(absl::Duration retry, Seconds(a, "retry-period", 2));
  if (!(retry < renew && renew < lease)) {
    return absl::InvalidArgumentError(
        "--retry-period < --renew-deadline < --lease-duration must hold");
  }
  lo.lease_duration = absl::ToChronoMilliseconds(lease);
  lo.renew_deadline = absl::ToChronoMilliseconds(renew);
  lo.retry_period = absl::ToChronoMilliseconds(retry);

  MetricsAuthorizer authorizer(client.get());  // outlives the server that asks it
  OperatorMetrics metrics;
  LeaderElector elector(client.get(), lo);
  Controller controller(client.get(), co, &metrics);
  metrics.SetSampler([&] {
    return OperatorMetrics::Sampled{static_cast<double>(client->requests()),
                                    client->throttled_seconds(), controller.CacheSizes()};
  });
  std::function<absl::Status(const std::string&)> authorize;
  if (metrics_auth == "kubernetes") {
    authorize = [&authorizer](const std::string& h) { return authorizer.Authorize(h); };
  }
  RETURN_IF_ERROR(metrics.Serve(
      listen.substr(0, colon), port,
      [&]() -> std::string { return controller.synced() ? "" : "caches not synced yet"; },
      authorize));
  LogInfo("shardserve-operator: serving /metrics, /healthz, /readyz on ", listen.substr(0, colon),
          ":", metrics.port());

  std::atomic<bool> stop{false};
  std::thread runner([&] {
    // Caches first, leading or not: a standby that takes over has its world already read.
    absl::Status s = controller.StartCaches(std::chrono::minutes(5));
    if (!s.ok()) {
      LogError("shardserve-operator: ", s.message());
      _exit(1);
    }
    LogInfo("shardserve-operator: caches synced");
    if (elect) {
      if (!elector.Acquire(stop)) return;
      metrics.SetLeader(true);
    }
    controller.StartWorkers();
    LogInfo("shardserve-operator: reconciling ShardedModels",
            co.namespace_.empty() ? "" : " in namespace ", co.namespace_);
    if (elect && !elector.Hold(stop)) {
      LogError("shardserve-operator: lost the lease; exiting so that one leader acts");
      _exit(1);
    }
  });
  int sig = 0;
  sigwait(&stop_signals, &sig);
  LogInfo("shardserve-operator: signal ", sig, ", stopping");
  stop = true;
  runner.join();
  controller.Stop();
  if (elect) elector.Release();
  return absl::OkStatus();
}

}  // namespace
}  // namespace shardserve::op

int main(int argc, char** argv) {
  const absl::Status s = shardserve::op::Run(std::vector<std::string>(argv + 1, argv + argc));
  if (shardserve::IsHelp(s)) {
    std::fputs(std::string(s.message()).c_str(), stdout);
    return 0;
  }
  if (!s.ok()) {
    std::fprintf(stderr, "shardserve-operator: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  return 0;
}
