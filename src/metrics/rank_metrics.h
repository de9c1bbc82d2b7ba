#pragma once
// Prometheus metrics of one rank (DESIGN.md §6, a contract with dashboards/), labelled
// {model, replica, stage, tp_rank}, served (http/server.h) on the rank's own port:
//   shardserve_rank_up, shardserve_rank_forward_seconds (histogram),
//   shardserve_rank_comm_seconds{op} (histogram), shardserve_rank_comm_bytes_total{op},
//   shardserve_rank_weights_bytes, shardserve_rank_kv_cache_usage_ratio,
//   shardserve_rank_tokens_total, shardserve_rank_resident_memory_bytes,
//   shardserve_rank_load_progress_ratio.
// The same port answers GET /startupz with what the rank is doing while it starts, as
// {"state": "..."} ("waiting at the rendezvous for stage 1 tp 0", "loading 41 %", "serving"):
// the operator quotes it in the replica's status.
// Thread-safe (prometheus-cpp metrics are).
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "metrics/slo.h"

namespace prometheus {
class Collectable;
class Counter;
template <typename T>
class Family;
class Gauge;
class Histogram;
class Registry;
}  // namespace prometheus

namespace shardserve {

namespace http {
class Server;
}

struct RankLabels {
  std::string model;
  std::string replica;
  std::string stage;
  std::string tp_rank;
  std::string role;  // disaggregated serving's ("prefill", "decode"; "" colocated)
};

// The `role` label of a replica's metrics: "colocated", "prefill" or "decode".
std::string RoleLabel(const std::string& kv_role);

class RankMetrics;

// The leader's request metrics (DESIGN.md §6), labelled {model, replica}:
//   shardserve_requests_total{code}, shardserve_request_queue_depth,
//   shardserve_time_to_first_token_seconds, shardserve_inter_token_latency_seconds
//   (histograms), shardserve_generated_tokens_total, shardserve_grammar_mask_seconds (histogram:
//   the leader's structured-output mask for one token of one sequence),
//   shardserve_prefix_cache_queried_tokens_total and _hit_tokens_total (prompt tokens looked up
//   in the prefix cache, and found), shardserve_prefix_cache_blocks{state="used"|"cached"};
//   shardserve_running_sequences and shardserve_queued_prompt_tokens (prompt tokens still to
//   compute), labelled with the replica's `role` (colocated, prefill, decode: what each role
//   scales on); disaggregated decode: shardserve_kv_transfer_seconds (histogram),
//   shardserve_kv_transfer_bytes_total and shardserve_kv_transfers_total{outcome="pulled"|
//   "failed"}.
// Registered into the registry of the leader rank's page. Thread-safe.
class LeaderMetrics {
 public:
  // `role`: disaggregated serving's ("prefill", "decode"; "" colocated), the `role` label of
  // the backlog gauges.
  // `slo`: spec.serving.slo's targets (metrics/slo.h), shardserve_slo_ratio and
  // shardserve_slo_target_seconds on the leader's page when one is set.
  LeaderMetrics(std::shared_ptr<prometheus::Registry> registry, const std::string& model,
                const std::string& replica, const std::string& role = "",
                const SloTargets& slo = {});
  // The leader's page: the registry's metrics and its latency targets'.
  std::shared_ptr<prometheus::Collectable> Page() const { return page_; }
  void CountRequest(int http_status);
  void SetQueueDepth(double depth);
  void ObserveFirstToken(double seconds);
  void ObserveInterToken(double seconds);
  void AddGenerated(double tokens);
  void ObserveGrammarMask(double seconds);
  void CountPrefixLookup(int64_t queried, int64_t hit);
  // Speculative decoding: one sequence's decode step drafted `drafted` tokens, `accepted` kept.
  void CountSpeculation(int64_t drafted, int64_t accepted);
  void SetCacheBlocks(int64_t used, int64_t cached);
  // Disaggregated decode: a prompt's KV taken from a prefill replica (pulled), or not (failed:
  // prefilled here), its bytes over every rank and its seconds.
  void ObserveKvTransfer(double seconds, int64_t bytes, bool pulled);
  void SetBacklog(int running, int64_t prompt_tokens);
  // LoRA (a replica holding up to max_lora adapters): the adapters of the running sequences and
  // of the waiting requests, as vLLM's vllm:lora_requests_info gives them to the Inference
  // Extension's endpoint picker (its --lora-info-metric): one series whose labels
  // running_lora_adapters and waiting_lora_adapters are comma-separated names and max_lora the
  // bound, its value the time (Unix seconds) they were last set.
  void SetLoraRequests(const std::vector<std::string>& running,
                       const std::vector<std::string>& waiting, int max_lora);

 private:
  std::map<std::string, std::string> labels_;
  std::shared_ptr<SloWindow> slo_;  // null without a target
  std::shared_ptr<prometheus::Collectable> page_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Gauge* queue_depth_;
  prometheus::Histogram* ttft_;
  prometheus::Histogram* itl_;
  prometheus::Counter* generated_;
  prometheus::Histogram* grammar_mask_;
  prometheus::Counter *prefix_queried_, *prefix_hit_;
  prometheus::Counter *spec_drafts_, *spec_drafted_, *spec_accepted_;
  prometheus::Gauge *blocks_used_, *blocks_cached_;
  prometheus::Histogram* kv_transfer_seconds_;
  prometheus::Gauge *running_, *queued_prompt_tokens_;
  prometheus::Counter *kv_transfer_bytes_, *kv_pulled_, *kv_failed_;
  prometheus::Family<prometheus::Gauge>* lora_info_;
  absl::Mutex lora_mu_;
  prometheus::Gauge* lora_series_ ABSL_GUARDED_BY(lora_mu_) = nullptr;
  std::map<std::string, std::string> lora_labels_ ABSL_GUARDED_BY(lora_mu_);
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
  // Serves `more` on this rank's page as well.
  void Expose(std::shared_ptr<prometheus::Collectable> more);
  void SetUp(bool up);
  // What the rank is doing while it starts (GET /startupz).
  void SetStartup(const std::string& state);
  // The share of this rank's weights loaded, in [0, 1]; the state reads "loading N %".
  void SetLoadProgress(double ratio);
  // shardserve_rank_backend_info{backend, kernels} 1: the backend the rank runs (cpu, cuda) and,
  // on the CPU, its kernels' level (backend/cpu/cpu_features.h: avx2, avx512).
  void SetBackend(const std::string& backend, const std::string& kernels);
  void ObserveForward(double seconds);
  void ObserveComm(const std::string& op, double seconds, size_t bytes);
  void SetWeightsBytes(double bytes);
  void SetKvCacheUsage(double ratio);
  void AddTokens(double tokens);
  // How the pod's model reached its node (a stage's first rank sets it once): the bytes its fetch
  // step downloaded (0: none, the model was in the node's cache or is read from a volume),
  // whether it was in the cache already, and the node cache's bytes; labelled with the `node`.
  void SetModelFetch(const std::string& node, int64_t downloaded, bool cache_hit,
                     int64_t cache_bytes);

 private:
  RankMetrics() = default;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<http::Server> http_;
  absl::Mutex mu_;
  std::vector<std::shared_ptr<prometheus::Collectable>> collectables_ ABSL_GUARDED_BY(mu_);
  std::string startup_ ABSL_GUARDED_BY(mu_) = "starting";
  RankLabels labels_;
  int port_ = 0;
  prometheus::Gauge* up_ = nullptr;
  prometheus::Histogram* forward_ = nullptr;
  prometheus::Gauge* weights_ = nullptr;
  prometheus::Gauge* kv_usage_ = nullptr;
  prometheus::Gauge* load_progress_ = nullptr;
  prometheus::Family<prometheus::Gauge>* backend_info_ = nullptr;
  prometheus::Counter* tokens_ = nullptr;
  std::map<std::string, std::pair<prometheus::Histogram*, prometheus::Counter*>> comm_;
};

}  // namespace shardserve
