#include "metrics/slo.h"

#include <prometheus/metric_family.h>

#include <algorithm>
#include <cmath>

namespace shardserve {

void SloWindow::Observe(SloKind kind, double seconds, Clock::time_point now) {
  absl::MutexLock lock(&mu_);
  std::deque<Sample>& q = Of(kind);
  q.push_back({now, seconds});
  while (q.size() > kMaxSloSamples || (!q.empty() && now - q.front().at > window_)) q.pop_front();
}

double SloWindow::Ratio(SloKind kind, Clock::time_point now) {
  const double target = kind == SloKind::kTtft ? targets_.ttft_seconds : targets_.itl_seconds;
  if (target <= 0) return 0;
  std::vector<double> recent;
  {
    absl::MutexLock lock(&mu_);
    std::deque<Sample>& q = Of(kind);
    while (!q.empty() && now - q.front().at > window_) q.pop_front();
    recent.reserve(q.size());
    for (const Sample& s : q) recent.push_back(s.seconds);
  }
  if (recent.empty()) return 0;
  // The nearest rank: the smallest sample at or above `percentile` % of them.
  const double rank = std::ceil(targets_.percentile / 100.0 * static_cast<double>(recent.size()));
  const size_t k =
      static_cast<size_t>(std::clamp(rank, 1.0, static_cast<double>(recent.size()))) - 1;
  std::nth_element(recent.begin(), recent.begin() + static_cast<std::ptrdiff_t>(k), recent.end());
  return recent[k] / target;
}

std::vector<prometheus::MetricFamily> SloFamilies(
    const std::string& prefix,
    const std::vector<std::pair<std::map<std::string, std::string>, SloWindow*>>& windows) {
  prometheus::MetricFamily ratio, target;
  ratio.name = prefix + "_slo_ratio";
  ratio.help =
      "The last 30 s's latency percentile over its target (spec.serving.slo): 1 at the target, "
      "above it behind; 0 with no request in the window";
  ratio.type = prometheus::MetricType::Gauge;
  target.name = prefix + "_slo_target_seconds";
  target.help = "The latency target (spec.serving.slo)";
  target.type = prometheus::MetricType::Gauge;
  for (const auto& [labels, w] : windows) {
    for (const auto& [kind, name, seconds] :
         {std::tuple{SloKind::kTtft, "ttft", w->targets().ttft_seconds},
          std::tuple{SloKind::kItl, "itl", w->targets().itl_seconds}}) {
      if (seconds <= 0) continue;
      prometheus::ClientMetric m;
      for (const auto& [k, v] : labels) m.label.push_back({k, v});
      m.label.push_back({"slo", name});
      m.gauge.value = w->Ratio(kind);
      ratio.metric.push_back(m);
      m.gauge.value = seconds;
      target.metric.push_back(std::move(m));
    }
  }
  return {std::move(ratio), std::move(target)};
}

}  // namespace shardserve
