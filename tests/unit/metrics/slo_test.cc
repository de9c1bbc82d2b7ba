// Latency targets (metrics/slo.h): the window's percentile over the target, samples older than
// the window forgotten (an idle replica reads 0), at most kMaxSloSamples kept.
#include "metrics/slo.h"

#include <gtest/gtest.h>
#include <prometheus/metric_family.h>

namespace shardserve {
namespace {

using namespace std::chrono_literals;

TEST(SloWindow, RatioIsThePercentileOverTheTarget) {
  SloWindow w({/*ttft=*/0.5, /*itl=*/0.05, /*percentile=*/90});
  const auto t0 = SloWindow::Clock::now();
  EXPECT_EQ(w.Ratio(SloKind::kTtft, t0), 0);                             // nothing yet
  for (int i = 1; i <= 10; ++i) w.Observe(SloKind::kTtft, 0.1 * i, t0);  // 0.1 .. 1.0
  EXPECT_DOUBLE_EQ(w.Ratio(SloKind::kTtft, t0), 0.9 / 0.5);              // p90 is 0.9
  w.Observe(SloKind::kItl, 0.025, t0);
  EXPECT_DOUBLE_EQ(w.Ratio(SloKind::kItl, t0), 0.5);
  // 31 s on, every sample is out of the window: an idle replica is not behind.
  EXPECT_EQ(w.Ratio(SloKind::kTtft, t0 + 31s), 0);
  EXPECT_EQ(w.Ratio(SloKind::kItl, t0 + 31s), 0);
}

TEST(SloWindow, NoTargetNoRatioAndTheSamplesAreBounded) {
  SloWindow w({0, 0.01, 50});
  const auto t0 = SloWindow::Clock::now();
  w.Observe(SloKind::kTtft, 3, t0);
  EXPECT_EQ(w.Ratio(SloKind::kTtft, t0), 0);
  for (size_t i = 0; i < kMaxSloSamples; ++i) w.Observe(SloKind::kItl, 1.0, t0);
  for (size_t i = 0; i < kMaxSloSamples; ++i) w.Observe(SloKind::kItl, 0.01, t0);
  EXPECT_DOUBLE_EQ(w.Ratio(SloKind::kItl, t0), 1.0);  // the older, slower ones are gone
}

TEST(SloWindow, FamiliesNameEachTargetThatIsSet) {
  SloWindow w({0.2, 0, 90});
  w.Observe(SloKind::kTtft, 0.4);
  auto families = SloFamilies("shardserve", {{{{"replica", "0"}}, &w}});
  ASSERT_EQ(families.size(), 2u);
  EXPECT_EQ(families[0].name, "shardserve_slo_ratio");
  ASSERT_EQ(families[0].metric.size(), 1u);  // no itl target: no itl series
  EXPECT_DOUBLE_EQ(families[0].metric[0].gauge.value, 2.0);
  EXPECT_EQ(families[0].metric[0].label.back().value, "ttft");
  EXPECT_EQ(families[1].name, "shardserve_slo_target_seconds");
  EXPECT_DOUBLE_EQ(families[1].metric[0].gauge.value, 0.2);
}

}  // namespace
}  // namespace shardserve
