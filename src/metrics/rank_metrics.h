#pragma once
// Prometheus metrics of one rank (DESIGN.md §6, a contract with dashboards/), labelled
// {model, replica, stage, tp_rank}, served by prometheus-cpp on the rank's own port:
//   shardserve_rank_up, shardserve_rank_forward_seconds (histogram),
//   shardserve_rank_comm_seconds{op} (histogram), shardserve_rank_comm_bytes_total{op},
//   shardserve_rank_weights_bytes, shardserve_rank_kv_cache_usage_ratio,
//   shardserve_rank_tokens_total.
// Thread-safe (prometheus-cpp metrics are).
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace prometheus {
class Counter;
class Exposer;
class Gauge;
class Histogram;
class Registry;
}  // namespace prometheus

namespace shardserve {

struct RankLabels {
  std::string model;
  std::string replica;
  std::string stage;
  std::string tp_rank;
};

class RankMetrics {
 public:
  // Serves /metrics on host:port (port 0: any free port); an error names the address.
  static absl::StatusOr<std::unique_ptr<RankMetrics>> Start(const std::string& host, int port,
                                                            const RankLabels& labels);
  ~RankMetrics();

  int port() const { return port_; }
  // The registry behind this rank's page; the leader adds its request metrics to it.
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }
  void SetUp(bool up);
  void ObserveForward(double seconds);
  void ObserveComm(const std::string& op, double seconds, size_t bytes);
  void SetWeightsBytes(double bytes);
  void SetKvCacheUsage(double ratio);
  void AddTokens(double tokens);

 private:
  RankMetrics() = default;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  RankLabels labels_;
  int port_ = 0;
  prometheus::Gauge* up_ = nullptr;
  prometheus::Histogram* forward_ = nullptr;
  prometheus::Gauge* weights_ = nullptr;
  prometheus::Gauge* kv_usage_ = nullptr;
  prometheus::Counter* tokens_ = nullptr;
  std::map<std::string, std::pair<prometheus::Histogram*, prometheus::Counter*>> comm_;
};

}  // namespace shardserve
