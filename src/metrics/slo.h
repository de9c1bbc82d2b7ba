#pragma once
// Latency targets (spec.serving.slo, issue 55) and how far the recent latencies are from them:
// what an autoscaler scales on. A window keeps the time to first token and the inter-token
// latency of the last 30 s (at most kMaxSloSamples of each: under a heavy load, the latest);
// its ratio for a target is the window's percentile (p90 unless spec.serving.slo.percentile
// says otherwise) over the target: 1 at the target, 2 twice as slow, 0 with no sample in the
// window (an idle replica is not behind, and a model with no traffic may scale to zero).
//
// Exported by each leader (its replica's, measured where the engine serves) as
//   shardserve_slo_ratio{slo="ttft"|"itl"} and shardserve_slo_target_seconds{slo}
// and by each router (what its clients saw, its own queue included, per replica that answered)
// as shardserve_router_slo_ratio{slo, replica}. Thread-safe.
#include <chrono>
#include <cstddef>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace prometheus {
struct MetricFamily;
}  // namespace prometheus

namespace shardserve {

inline constexpr size_t kMaxSloSamples = 8192;

struct SloTargets {
  double ttft_seconds = 0;  // 0: no target
  double itl_seconds = 0;
  double percentile = 90;  // in (0, 100)
  bool any() const { return ttft_seconds > 0 || itl_seconds > 0; }
};

enum class SloKind { kTtft, kItl };

class SloWindow {
 public:
  using Clock = std::chrono::steady_clock;
  explicit SloWindow(SloTargets targets, std::chrono::seconds window = std::chrono::seconds(30))
      : targets_(targets), window_(window) {}
  const SloTargets& targets() const { return targets_; }
  void Observe(SloKind kind, double seconds, Clock::time_point now = Clock::now());
  // The window's percentile over the target (0: no target, or no sample in the window).
  double Ratio(SloKind kind, Clock::time_point now = Clock::now());

 private:
  struct Sample {
    Clock::time_point at;
    double seconds;
  };
  std::deque<Sample>& Of(SloKind kind) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return kind == SloKind::kTtft ? ttft_ : itl_;
  }
  const SloTargets targets_;
  const std::chrono::seconds window_;
  absl::Mutex mu_;
  std::deque<Sample> ttft_ ABSL_GUARDED_BY(mu_), itl_ ABSL_GUARDED_BY(mu_);
};

// The families `prefix`_slo_ratio and `prefix`_slo_target_seconds of the windows, each labelled
// with its labels and slo="ttft"|"itl" (the targets that are set).
std::vector<prometheus::MetricFamily> SloFamilies(
    const std::string& prefix,
    const std::vector<std::pair<std::map<std::string, std::string>, SloWindow*>>& windows);

}  // namespace shardserve
