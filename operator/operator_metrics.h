#pragma once
// The operator's Prometheus metrics (DESIGN.md §6, a contract with dashboards/) and its HTTP
// endpoints: /metrics, /healthz (the process answers) and /readyz (caches synced and, with
// leader election, leading or standing by).
// Per-model series carry {namespace, model}: the ShardedModel, as the ranks' `model` label.
//   shardserve_operator_reconcile_total{result}   success | error | requeue
//   shardserve_operator_reconcile_seconds          histogram of a pass (read, decide, place)
//   shardserve_operator_reconcile_api_seconds      its apiserver writes, carried out after it
//   shardserve_model_replicas{model,state}         Pending | Placing | Starting | Ready | Failed
//   shardserve_replica_restarts_total{model}
//   shardserve_placement_failures_total{model,reason}
//   shardserve_operator_leader                     1 while this process holds the lease
//   shardserve_operator_api_requests_total         requests sent to the apiserver
//   shardserve_operator_client_throttled_seconds_total   time waiting for the client rate limit
//   shardserve_operator_cache_objects{resource}, shardserve_operator_cache_bytes{resource}
// The functions take the model key "namespace/name". Thread-safe.
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace prometheus {
class Counter;
template <typename T>
class Family;
class Gauge;
class Histogram;
class Registry;
}  // namespace prometheus

namespace shardserve::http {
class Server;
}

namespace shardserve::op {

class OperatorMetrics {
 public:
  OperatorMetrics();
  ~OperatorMetrics();

  void ObserveReconcile(const std::string& result, double seconds);
  void ObserveReconcileApi(double seconds);
  // Replicas of `model` by state; states not given are 0.
  void SetReplicas(const std::string& model, const std::map<std::string, int64_t>& by_state);
  void AddRestarts(const std::string& model, int64_t n);
  void AddPlacementFailure(const std::string& model, const std::string& reason);
  // The model is gone: its series go too.
  void ForgetModel(const std::string& model);
  void SetLeader(bool leader);
  // Figures read at scrape time from their owners (the client, the informer caches).
  struct Sampled {
    double api_requests = 0;
    double throttled_seconds = 0;
    std::map<std::string, std::pair<double, double>> caches;  // resource -> objects, bytes
  };
  void SetSampler(std::function<Sampled()> sampler);

  prometheus::Registry& registry() { return *registry_; }

  // Serves /metrics, /healthz and /readyz on host:port (0: any); `ready` answers /readyz with
  // "" when ready or the reason it is not. With `authorize`, /metrics asks it first, given the
  // request's Authorization header: OK serves the page, Unauthenticated answers 401,
  // PermissionDenied 403, anything else 503 (see metrics_auth.h). The probes stay open.
  absl::Status Serve(const std::string& host, int port, std::function<std::string()> ready,
                     std::function<absl::Status(const std::string&)> authorize = nullptr);
  int port() const { return port_; }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* reconciles_;
  prometheus::Histogram* reconcile_seconds_;
  prometheus::Histogram* reconcile_api_seconds_;
  prometheus::Family<prometheus::Gauge>* replicas_;
  prometheus::Family<prometheus::Counter>* restarts_;
  prometheus::Family<prometheus::Counter>* placement_failures_;
  prometheus::Gauge* leader_;
  prometheus::Counter* api_requests_;
  prometheus::Counter* throttled_;
  prometheus::Family<prometheus::Gauge>* cache_objects_;
  prometheus::Family<prometheus::Gauge>* cache_bytes_;
  std::function<Sampled()> sampler_;
  absl::Mutex mu_;
  std::map<std::string, std::map<std::string, prometheus::Gauge*>> model_replicas_
      ABSL_GUARDED_BY(mu_);
  // restarts first
  std::map<std::string, std::vector<prometheus::Counter*>> model_counters_ ABSL_GUARDED_BY(mu_);
  void Sample();  // the sampled figures into their series

  std::unique_ptr<http::Server> http_;
  int port_ = 0;
};

}  // namespace shardserve::op
