#include "operator/operator_metrics.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "http/server.h"

namespace shardserve::op {
namespace {

constexpr const char* kStates[] = {"Pending", "Placing", "Starting", "Ready", "Failed"};

// {namespace, model} of a model key "namespace/name" (the ShardedModel's name is the `model`
// label of every shardserve metric).
std::map<std::string, std::string> ModelLabels(const std::string& key) {
  const size_t slash = key.find('/');
  if (slash == std::string::npos) return {{"namespace", ""}, {"model", key}};
  return {{"namespace", key.substr(0, slash)}, {"model", key.substr(slash + 1)}};
}

}  // namespace

OperatorMetrics::OperatorMetrics() : registry_(std::make_shared<prometheus::Registry>()) {
  auto& r = *registry_;
  reconciles_ = &prometheus::BuildCounter()
                     .Name("shardserve_operator_reconcile_total")
                     .Help("Reconciles of a ShardedModel, by result (success, error, requeue)")
                     .Register(r);
  // 0.1 ms to 30 s in steps of 1.5x, fine enough for p50/p99 by interpolation.
  prometheus::Histogram::BucketBoundaries b;
  for (double v = 1e-4; v < 30; v *= 1.5) b.push_back(v);
  reconcile_seconds_ = &prometheus::BuildHistogram()
                            .Name("shardserve_operator_reconcile_seconds")
                            .Help(
                                "Time of one reconcile pass of a ShardedModel: reading the caches, "
                                "deciding, placing (its writes are carried out after it)")
                            .Register(r)
                            .Add({}, b);
  reconcile_api_seconds_ =
      &prometheus::BuildHistogram()
           .Name("shardserve_operator_reconcile_api_seconds")
           .Help(
               "Time to carry out a reconcile pass's apiserver writes, from the "
               "pass's end (waiting for a writer thread included)")
           .Register(r)
           .Add({}, b);
  replicas_ = &prometheus::BuildGauge()
                   .Name("shardserve_model_replicas")
                   .Help("Replicas of a ShardedModel by state")
                   .Register(r);
  restarts_ = &prometheus::BuildCounter()
                   .Name("shardserve_replica_restarts_total")
                   .Help("Whole replicas recreated after a failure")
                   .Register(r);
  placement_failures_ = &prometheus::BuildCounter()
                             .Name("shardserve_placement_failures_total")
                             .Help("Replicas that could not be placed, by reason")
                             .Register(r);
  leader_ = &prometheus::BuildGauge()
                 .Name("shardserve_operator_leader")
                 .Help("1 while this operator holds the leader lease")
                 .Register(r)
                 .Add({});
  // Counters brought up to the client's own counts at scrape time.
  api_requests_ = &prometheus::BuildCounter()
                       .Name("shardserve_operator_api_requests_total")
                       .Help("Requests the operator sent to the Kubernetes API")
                       .Register(r)
                       .Add({});
  throttled_ = &prometheus::BuildCounter()
                    .Name("shardserve_operator_client_throttled_seconds_total")
                    .Help("Time requests waited for the operator's client-side rate limit")
                    .Register(r)
                    .Add({});
  cache_objects_ = &prometheus::BuildGauge()
                        .Name("shardserve_operator_cache_objects")
                        .Help("Objects in the operator's informer caches")
                        .Register(r);
  cache_bytes_ = &prometheus::BuildGauge()
                      .Name("shardserve_operator_cache_bytes")
                      .Help("Bytes of the objects in the operator's informer caches")
                      .Register(r);
}

void OperatorMetrics::SetSampler(std::function<Sampled()> sampler) {
  absl::MutexLock lock(&mu_);
  sampler_ = std::move(sampler);
}

OperatorMetrics::~OperatorMetrics() = default;

void OperatorMetrics::ObserveReconcile(const std::string& result, double seconds) {
  reconciles_->Add({{"result", result}}).Increment();
  reconcile_seconds_->Observe(seconds);
}

void OperatorMetrics::ObserveReconcileApi(double seconds) {
  reconcile_api_seconds_->Observe(seconds);
}

void OperatorMetrics::SetReplicas(const std::string& model,
                                  const std::map<std::string, int64_t>& by_state) {
  absl::MutexLock lock(&mu_);
  auto& gauges = model_replicas_[model];
  if (gauges.empty()) {
    // The model's counters start at 0, so rates and increases have a series from the start.
    model_counters_[model] = {&restarts_->Add(ModelLabels(model))};
    for (const char* reason : {"InsufficientGPUs", "Unschedulable"}) {
      auto labels = ModelLabels(model);
      labels["reason"] = reason;
      model_counters_[model].push_back(&placement_failures_->Add(labels));
    }
  }
  for (const char* state : kStates) {
    auto [it, added] = gauges.try_emplace(state, nullptr);
    if (added) {
      auto labels = ModelLabels(model);
      labels["state"] = state;
      it->second = &replicas_->Add(labels);
    }
    auto n = by_state.find(state);
    it->second->Set(n == by_state.end() ? 0 : static_cast<double>(n->second));
  }
}

void OperatorMetrics::AddRestarts(const std::string& model, int64_t n) {
  restarts_->Add(ModelLabels(model)).Increment(static_cast<double>(n));
}

void OperatorMetrics::AddPlacementFailure(const std::string& model, const std::string& reason) {
  auto labels = ModelLabels(model);
  labels["reason"] = reason;
  placement_failures_->Add(labels).Increment();
}

void OperatorMetrics::ForgetModel(const std::string& model) {
  absl::MutexLock lock(&mu_);
  auto it = model_replicas_.find(model);
  if (it == model_replicas_.end()) return;
  for (auto& [state, gauge] : it->second) replicas_->Remove(gauge);
  model_replicas_.erase(it);
  auto& counters = model_counters_[model];
  restarts_->Remove(counters.front());
  for (size_t i = 1; i < counters.size(); ++i) placement_failures_->Remove(counters[i]);
  model_counters_.erase(model);
}

void OperatorMetrics::SetLeader(bool leader) { leader_->Set(leader ? 1 : 0); }

void OperatorMetrics::Sample() {
  std::function<Sampled()> sampler;
  {
    absl::MutexLock lock(&mu_);
    sampler = sampler_;
  }
  if (!sampler) return;
  const Sampled s = sampler();
  api_requests_->Increment(std::max(0.0, s.api_requests - api_requests_->Value()));
  throttled_->Increment(std::max(0.0, s.throttled_seconds - throttled_->Value()));
  for (const auto& [resource, v] : s.caches) {
    cache_objects_->Add({{"resource", resource}}).Set(v.first);
    cache_bytes_->Add({{"resource", resource}}).Set(v.second);
  }
}

absl::Status OperatorMetrics::Serve(const std::string& host, int port,
                                    std::function<std::string()> ready,
                                    std::function<absl::Status(const std::string&)> authorize) {
  auto page = [this] {
    Sample();
    return http::Response{200,
                          "text/plain; version=0.0.4",
                          prometheus::TextSerializer().Serialize(registry_->Collect()),
                          {}};
  };
  http::Routes routes;
  if (authorize) {
    // Asking the apiserver takes a round trip: off the I/O thread.
    routes.GetBlocking("/metrics", [page, authorize](const http::Request& req, http::Exchange& ex) {
      const absl::Status s = authorize(req.Header("authorization"));
      if (s.ok()) return ex.Respond(page());
      const int code = s.code() == absl::StatusCode::kUnauthenticated    ? 401
                       : s.code() == absl::StatusCode::kPermissionDenied ? 403
                                                                         : 503;
      http::Response r{code, "text/plain", std::string(s.message()) + "\n", {}};
      if (code == 401) r.headers.emplace_back("WWW-Authenticate", "Bearer");
      ex.Respond(std::move(r));
    });
  } else {
    routes.Get("/metrics", [page](const http::Request&) { return page(); });
  }
  routes.Get("/healthz", [](const http::Request&) {
    return http::Response{200, "text/plain", "ok\n", {}};
  });
  routes.Get("/readyz", [ready](const http::Request&) {
    const std::string why = ready();
    return http::Response{
        why.empty() ? 200 : 503, "text/plain", why.empty() ? "ok\n" : why + "\n", {}};
  });
  http::ServerOptions options;
  options.host = host;
  options.port = port;
  options.max_body_bytes = 0;
  options.max_blocking = 16;
  ASSIGN_OR_RETURN(http_, http::Server::Start(options, std::move(routes)));
  port_ = http_->port();
  return absl::OkStatus();
}

}  // namespace shardserve::op
