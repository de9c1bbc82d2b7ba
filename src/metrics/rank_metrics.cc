#include "metrics/rank_metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "http/server.h"

namespace shardserve {
namespace {

// Seconds from `from` to about 30 s, doubling.
prometheus::Histogram::BucketBoundaries SecondsBuckets(double from = 1e-4) {
  prometheus::Histogram::BucketBoundaries b;
  for (double v = from; v < 30; v *= 2) b.push_back(v);
  return b;
}

// shardserve_rank_resident_memory_bytes: the rank process's resident memory, read from
// /proc/self/statm when scraped.
class ResidentMemory : public prometheus::Collectable {
 public:
  explicit ResidentMemory(std::map<std::string, std::string> labels) : labels_(std::move(labels)) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    long pages = 0, resident = 0;
    if (FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
      std::fclose(f);
    }
    prometheus::MetricFamily family;
    family.name = "shardserve_rank_resident_memory_bytes";
    family.help = "Resident memory of this rank's process (weights, KV cache, buffers)";
    family.type = prometheus::MetricType::Gauge;
    prometheus::ClientMetric metric;
    for (const auto& [k, v] : labels_) metric.label.push_back({k, v});
    metric.gauge.value = static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE));
    family.metric.push_back(std::move(metric));
    return {std::move(family)};
  }

 private:
  std::map<std::string, std::string> labels_;
};

// A leader's page: its registry's metrics, and how far its replica is from its latency targets
// (computed when the page is read: the window moves on while nothing is observed).
class LeaderPage : public prometheus::Collectable {
 public:
  LeaderPage(std::shared_ptr<prometheus::Registry> registry, std::shared_ptr<SloWindow> slo,
             std::map<std::string, std::string> labels)
      : registry_(std::move(registry)), slo_(std::move(slo)), labels_(std::move(labels)) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> out = registry_->Collect();
    if (slo_) {
      for (auto& f : SloFamilies("shardserve", {{labels_, slo_.get()}}))
        out.push_back(std::move(f));
    }
    return out;
  }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<SloWindow> slo_;
  std::map<std::string, std::string> labels_;
};

constexpr const char* kOps[] = {"all_reduce", "all_gather", "reduce_scatter", "broadcast",
                                "send",       "recv",       "barrier"};

}  // namespace

std::string RoleLabel(const std::string& kv_role) {
  return kv_role.empty() ? "colocated" : kv_role;
}

absl::StatusOr<std::unique_ptr<RankMetrics>> RankMetrics::Start(const std::string& host, int port,
                                                                const RankLabels& labels) {
  std::unique_ptr<RankMetrics> m(new RankMetrics());
  m->labels_ = labels;
  const std::map<std::string, std::string> base = {{"model", labels.model},
                                                   {"replica", labels.replica},
                                                   {"stage", labels.stage},
                                                   {"tp_rank", labels.tp_rank}};
  m->registry_ = std::make_shared<prometheus::Registry>();
  auto& r = *m->registry_;
  m->up_ = &prometheus::BuildGauge()
                .Name("shardserve_rank_up")
                .Help("1 while the rank is connected, loaded and serving")
                .Register(r)
                .Add(base);
  m->forward_ = &prometheus::BuildHistogram()
                     .Name("shardserve_rank_forward_seconds")
                     .Help("Time of one forward pass of this rank's layers")
                     .Register(r)
                     .Add(base, SecondsBuckets());
  m->weights_ = &prometheus::BuildGauge()
                     .Name("shardserve_rank_weights_bytes")
                     .Help("Bytes of weights this rank holds (its slices)")
                     .Register(r)
                     .Add(base);
  auto with_role = base;  // what each role of a disaggregated model scales on
  with_role["role"] = RoleLabel(labels.role);
  m->kv_usage_ = &prometheus::BuildGauge()
                      .Name("shardserve_rank_kv_cache_usage_ratio")
                      .Help("Share of this rank's KV cache blocks in use")
                      .Register(r)
                      .Add(with_role);
  m->load_progress_ = &prometheus::BuildGauge()
                           .Name("shardserve_rank_load_progress_ratio")
                           .Help("Share of this rank's weights loaded (1 once loaded)")
                           .Register(r)
                           .Add(base);
  m->backend_info_ = &prometheus::BuildGauge()
                          .Name("shardserve_rank_backend_info")
                          .Help("1, labelled with the rank's backend and its CPU kernels' level")
                          .Register(r);
  m->tokens_ = &prometheus::BuildCounter()
                    .Name("shardserve_rank_tokens_total")
                    .Help("Tokens this rank has run through its layers")
                    .Register(r)
                    .Add(base);
  auto& comm_seconds = prometheus::BuildHistogram()
                           .Name("shardserve_rank_comm_seconds")
                           .Help("Time of one communication operation")
                           .Register(r);
  auto& comm_bytes = prometheus::BuildCounter()
                         .Name("shardserve_rank_comm_bytes_total")
                         .Help("Bytes this rank contributed to communication operations")
                         .Register(r);
  for (const char* op : kOps) {
    auto labels_op = base;
    labels_op["op"] = op;
    m->comm_[op] = {&comm_seconds.Add(labels_op, SecondsBuckets()), &comm_bytes.Add(labels_op)};
  }
  {
    absl::MutexLock lock(&m->mu_);
    m->collectables_ = {m->registry_, std::make_shared<ResidentMemory>(base)};
  }
  // Served by http::Server, not prometheus-cpp's civetweb Exposer: civetweb's threads have a
  // fixed 100 KB stack, too small for the static TLS that cuBLAS brings into a GPU rank's
  // process, and no deadline for a slow client. The page is answered on the I/O thread, so slow
  // or idle connections never delay a scrape or a probe.
  RankMetrics* self = m.get();
  http::Routes routes;
  routes.Get("/metrics", [self](const http::Request&) {
    std::vector<prometheus::MetricFamily> families;
    {
      absl::MutexLock lock(&self->mu_);
      for (const auto& c : self->collectables_) {
        auto more = c->Collect();
        families.insert(families.end(), more.begin(), more.end());
      }
    }
    return http::Response{
        200, "text/plain; version=0.0.4", prometheus::TextSerializer().Serialize(families), {}};
  });
  routes.Get("/startupz", [self](const http::Request&) {
    absl::MutexLock lock(&self->mu_);
    return http::Response{
        200, "application/json", nlohmann::json{{"state", self->startup_}}.dump(), {}};
  });
  http::ServerOptions options;
  options.host = host;
  options.port = port;
  options.max_body_bytes = 0;
  options.max_blocking = 0;
  auto server = http::Server::Start(options, std::move(routes));
  if (!server.ok()) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics: ", server.status().message()));
  }
  m->http_ = *std::move(server);
  m->port_ = m->http_->port();
  return m;
}

RankMetrics::~RankMetrics() = default;

void RankMetrics::SetModelFetch(const std::string& node, int64_t downloaded, bool cache_hit,
                                int64_t cache_bytes) {
  const std::map<std::string, std::string> labels = {{"model", labels_.model},
                                                     {"replica", labels_.replica},
                                                     {"stage", labels_.stage},
                                                     {"node", node}};
  auto& r = *registry_;
  prometheus::BuildGauge()
      .Name("shardserve_model_fetch_bytes")
      .Help("Bytes the pod's fetch step downloaded into its node's model cache (0: none)")
      .Register(r)
      .Add(labels)
      .Set(static_cast<double>(downloaded));
  prometheus::BuildGauge()
      .Name("shardserve_model_cache_hit")
      .Help(
          "1 when the pod found its model without downloading it (in the node's cache, or a "
          "volume)")
      .Register(r)
      .Add(labels)
      .Set(cache_hit ? 1 : 0);
  prometheus::BuildGauge()
      .Name("shardserve_model_cache_bytes")
      .Help("Bytes in the node's model cache when the pod's fetch step ended (0: no cache)")
      .Register(r)
      .Add(labels)
      .Set(static_cast<double>(cache_bytes));
}

LeaderMetrics::LeaderMetrics(std::shared_ptr<prometheus::Registry> registry,
                             const std::string& model, const std::string& replica,
                             const std::string& role, const SloTargets& slo)
    : labels_{{"model", model}, {"replica", replica}} {
  prometheus::Registry& r = *registry;
  if (slo.any()) slo_ = std::make_shared<SloWindow>(slo);
  page_ = std::make_shared<LeaderPage>(std::move(registry), slo_, labels_);
  auto with_role = labels_;
  with_role["role"] = RoleLabel(role);
  running_ = &prometheus::BuildGauge()
                  .Name("shardserve_running_sequences")
                  .Help("Sequences in the replica's running batch")
                  .Register(r)
                  .Add(with_role);
  queued_prompt_tokens_ = &prometheus::BuildGauge()
                               .Name("shardserve_queued_prompt_tokens")
                               .Help(
                                   "Prompt tokens still to compute: the waiting requests' and "
                                   "the running sequences' not yet fed")
                               .Register(r)
                               .Add(with_role);
  requests_ = &prometheus::BuildCounter()
                   .Name("shardserve_requests_total")
                   .Help("API requests answered, by HTTP status code")
                   .Register(r);
  queue_depth_ = &prometheus::BuildGauge()
                      .Name("shardserve_request_queue_depth")
                      .Help("Generation requests waiting to join the running batch")
                      .Register(r)
                      .Add(labels_);
  ttft_ = &prometheus::BuildHistogram()
               .Name("shardserve_time_to_first_token_seconds")
               .Help("Time from a request's arrival to its first generated token")
               .Register(r)
               .Add(labels_, SecondsBuckets(1e-3));
  itl_ = &prometheus::BuildHistogram()
              .Name("shardserve_inter_token_latency_seconds")
              .Help("Time between consecutive generated tokens of one sequence")
              .Register(r)
              .Add(labels_, SecondsBuckets(1e-3));
  generated_ = &prometheus::BuildCounter()
                    .Name("shardserve_generated_tokens_total")
                    .Help("Tokens generated for clients")
                    .Register(r)
                    .Add(labels_);
  grammar_mask_ = &prometheus::BuildHistogram()
                       .Name("shardserve_grammar_mask_seconds")
                       .Help(
                           "The leader's structured-output mask of allowed tokens, computed "
                           "for one token of one sequence")
                       .Register(r)
                       .Add(labels_, SecondsBuckets(1e-6));
  prefix_queried_ = &prometheus::BuildCounter()
                         .Name("shardserve_prefix_cache_queried_tokens_total")
                         .Help("Prompt tokens looked up in the prefix cache")
                         .Register(r)
                         .Add(labels_);
  prefix_hit_ = &prometheus::BuildCounter()
                     .Name("shardserve_prefix_cache_hit_tokens_total")
                     .Help("Prompt tokens found in the prefix cache (their prefill skipped)")
                     .Register(r)
                     .Add(labels_);
  spec_drafts_ = &prometheus::BuildCounter()
                      .Name("shardserve_spec_decode_drafts_total")
                      .Help("Speculative decoding: decode steps of a sequence that drafted tokens")
                      .Register(r)
                      .Add(labels_);
  spec_drafted_ = &prometheus::BuildCounter()
                       .Name("shardserve_spec_decode_draft_tokens_total")
                       .Help("Speculative decoding: tokens drafted for the model to verify")
                       .Register(r)
                       .Add(labels_);
  spec_accepted_ = &prometheus::BuildCounter()
                        .Name("shardserve_spec_decode_accepted_tokens_total")
                        .Help("Speculative decoding: drafted tokens the verification kept")
                        .Register(r)
                        .Add(labels_);
  auto& blocks = prometheus::BuildGauge()
                     .Name("shardserve_prefix_cache_blocks")
                     .Help(
                         "The replica's KV blocks: held by sequences (used), or holding a "
                         "cached prefix (cached; held or not)")
                     .Register(r);
  auto with = [&](const char* state) {
    auto l = labels_;
    l["state"] = state;
    return l;
  };
  blocks_used_ = &blocks.Add(with("used"));
  blocks_cached_ = &blocks.Add(with("cached"));
  kv_transfer_seconds_ = &prometheus::BuildHistogram()
                              .Name("shardserve_kv_transfer_seconds")
                              .Help(
                                  "Disaggregated decode: a prompt's KV taken from a prefill "
                                  "replica, every rank's share, until the last arrived")
                              .Register(r)
                              .Add(labels_, SecondsBuckets(1e-4));
  kv_transfer_bytes_ = &prometheus::BuildCounter()
                            .Name("shardserve_kv_transfer_bytes_total")
                            .Help("Disaggregated decode: KV bytes taken from prefill replicas")
                            .Register(r)
                            .Add(labels_);
  auto& transfers = prometheus::BuildCounter()
                        .Name("shardserve_kv_transfers_total")
                        .Help(
                            "Disaggregated decode: prompts whose KV was taken from a prefill "
                            "replica (pulled) or not (failed: prefilled here instead)")
                        .Register(r);
  auto outcome = [&](const char* o) {
    auto l = labels_;
    l["outcome"] = o;
    return l;
  };
  kv_pulled_ = &transfers.Add(outcome("pulled"));
  kv_failed_ = &transfers.Add(outcome("failed"));
  lora_info_ = &prometheus::BuildGauge()
                    .Name("shardserve_lora_requests_info")
                    .Help(
                        "LoRA adapters of the running sequences and of the waiting requests "
                        "(labels, as vLLM's vllm:lora_requests_info); the value is when they "
                        "were last set, in Unix seconds")
                    .Register(r);
}

void LeaderMetrics::SetLoraRequests(const std::vector<std::string>& running,
                                    const std::vector<std::string>& waiting, int max_lora) {
  auto labels = labels_;
  labels["running_lora_adapters"] = absl::StrJoin(running, ",");
  labels["waiting_lora_adapters"] = absl::StrJoin(waiting, ",");
  labels["max_lora"] = std::to_string(max_lora);
  absl::MutexLock lock(&lora_mu_);
  if (lora_series_ == nullptr || labels != lora_labels_) {  // one series: the current state
    if (lora_series_ != nullptr) lora_info_->Remove(lora_series_);
    lora_series_ = &lora_info_->Add(labels);
    lora_labels_ = std::move(labels);
  }
  lora_series_->SetToCurrentTime();
}

void LeaderMetrics::SetBacklog(int running, int64_t prompt_tokens) {
  running_->Set(running);
  queued_prompt_tokens_->Set(static_cast<double>(prompt_tokens));
}

void LeaderMetrics::ObserveKvTransfer(double seconds, int64_t bytes, bool pulled) {
  kv_transfer_seconds_->Observe(seconds);
  kv_transfer_bytes_->Increment(static_cast<double>(bytes));
  (pulled ? kv_pulled_ : kv_failed_)->Increment();
}

void LeaderMetrics::CountPrefixLookup(int64_t queried, int64_t hit) {
  prefix_queried_->Increment(static_cast<double>(queried));
  prefix_hit_->Increment(static_cast<double>(hit));
}

void LeaderMetrics::CountSpeculation(int64_t drafted, int64_t accepted) {
  spec_drafts_->Increment();
  spec_drafted_->Increment(static_cast<double>(drafted));
  spec_accepted_->Increment(static_cast<double>(accepted));
}

void LeaderMetrics::SetCacheBlocks(int64_t used, int64_t cached) {
  blocks_used_->Set(static_cast<double>(used));
  blocks_cached_->Set(static_cast<double>(cached));
}

void LeaderMetrics::ObserveGrammarMask(double seconds) { grammar_mask_->Observe(seconds); }

void LeaderMetrics::CountRequest(int http_status) {
  auto labels = labels_;
  labels["code"] = std::to_string(http_status);
  requests_->Add(labels).Increment();
}
void LeaderMetrics::SetQueueDepth(double depth) { queue_depth_->Set(depth); }
void LeaderMetrics::ObserveFirstToken(double seconds) {
  ttft_->Observe(seconds);
  if (slo_) slo_->Observe(SloKind::kTtft, seconds);
}
void LeaderMetrics::ObserveInterToken(double seconds) {
  itl_->Observe(seconds);
  if (slo_) slo_->Observe(SloKind::kItl, seconds);
}
void LeaderMetrics::AddGenerated(double tokens) { generated_->Increment(tokens); }

void RankMetrics::Expose(std::shared_ptr<prometheus::Collectable> more) {
  absl::MutexLock lock(&mu_);
  collectables_.push_back(std::move(more));
}

void RankMetrics::SetUp(bool up) { up_->Set(up ? 1 : 0); }
void RankMetrics::SetStartup(const std::string& state) {
  absl::MutexLock lock(&mu_);
  startup_ = state;
}
void RankMetrics::SetLoadProgress(double ratio) {
  load_progress_->Set(ratio);
  SetStartup(absl::StrCat("loading ", static_cast<int>(ratio * 100), " %"));
}
void RankMetrics::SetBackend(const std::string& backend, const std::string& kernels) {
  std::map<std::string, std::string> labels = {
      {"model", labels_.model},     {"replica", labels_.replica}, {"stage", labels_.stage},
      {"tp_rank", labels_.tp_rank}, {"backend", backend},         {"kernels", kernels}};
  backend_info_->Add(labels).Set(1);
}
void RankMetrics::ObserveForward(double seconds) { forward_->Observe(seconds); }
void RankMetrics::SetWeightsBytes(double bytes) { weights_->Set(bytes); }
void RankMetrics::SetKvCacheUsage(double ratio) { kv_usage_->Set(ratio); }
void RankMetrics::AddTokens(double tokens) { tokens_->Increment(tokens); }

void RankMetrics::ObserveComm(const std::string& op, double seconds, size_t bytes) {
  auto it = comm_.find(op);
  if (it == comm_.end()) return;
  it->second.first->Observe(seconds);
  it->second.second->Increment(static_cast<double>(bytes));
}

}  // namespace shardserve
