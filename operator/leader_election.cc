#include "operator/leader_election.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/log.h"

namespace shardserve::op {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

std::string MicroTime(absl::Time t) {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", t, absl::UTCTimeZone());
}

// Sleeps `d` in small steps, returning early when `stop` is set.
void SleepUnlessStopped(std::chrono::milliseconds d, const std::atomic<bool>& stop) {
  const auto until = Clock::now() + d;
  while (!stop.load() && Clock::now() < until) {
    std::this_thread::sleep_for(
        std::min<Clock::duration>(until - Clock::now(), std::chrono::milliseconds(50)));
  }
}

}  // namespace

LeaderElector::LeaderElector(k8s::Client* client, LeaderElectionOptions options)
    : client_(client), options_(std::move(options)) {}

bool LeaderElector::TryAcquireOrRenew() {
  const std::string now = MicroTime(absl::Now());
  const int duration_s = static_cast<int>(
      std::chrono::duration_cast<std::chrono::seconds>(options_.lease_duration).count());
  auto lease = client_->Get(k8s::kLeases, options_.namespace_, options_.name);
  if (!lease.ok() && k8s::ApiNotFound(lease.status())) {
    json fresh = {{"apiVersion", "coordination.k8s.io/v1"},
                  {"kind", "Lease"},
                  {"metadata", {{"name", options_.name}, {"namespace", options_.namespace_}}},
                  {"spec",
                   {{"holderIdentity", options_.identity},
                    {"leaseDurationSeconds", duration_s},
                    {"acquireTime", now},
                    {"renewTime", now},
                    {"leaseTransitions", 0}}}};
    auto created = client_->Create(k8s::kLeases, options_.namespace_, fresh);
    leading_ = created.ok();
    return created.ok();
  }
  if (!lease.ok()) {
    LogWarning("leader election: reading lease ", options_.namespace_, "/", options_.name, ": ",
               lease.status().message());
    return false;
  }
  json& spec = (*lease)["spec"];
  const std::string holder = spec.value("holderIdentity", "");
  const std::string record = holder + "|" + spec.value("renewTime", "");
  if (record != observed_record_) {
    observed_record_ = record;
    observed_at_ = Clock::now();
  }
  const auto held_for = std::chrono::seconds(spec.value("leaseDurationSeconds", duration_s));
  const bool mine = holder == options_.identity;
  if (!mine && !holder.empty() && Clock::now() < observed_at_ + held_for) {
    leading_ = false;
    return false;  // someone else holds a live lease
  }
  if (!mine) {
    spec["acquireTime"] = now;
    spec["leaseTransitions"] = spec.value("leaseTransitions", 0) + 1;
  }
  spec["holderIdentity"] = options_.identity;
  spec["leaseDurationSeconds"] = duration_s;
  spec["renewTime"] = now;
  (*lease)["metadata"].erase("managedFields");
  auto updated =
      client_->Request("PUT", k8s::kLeases.Path(options_.namespace_, options_.name), &*lease);
  if (!updated.ok() && !k8s::ApiConflict(updated.status())) {
    LogWarning("leader election: updating lease: ", updated.status().message());
  }
  leading_ = updated.ok();
  return updated.ok();
}

bool LeaderElector::Acquire(const std::atomic<bool>& stop) {
  bool announced = false;
  while (!stop.load()) {
    if (TryAcquireOrRenew()) {
      LogInfo("leader election: ", options_.identity, " holds lease ", options_.namespace_, "/",
              options_.name);
      return true;
    }
    if (!announced) {
      LogInfo("leader election: ", options_.identity, " waits for lease ", options_.namespace_, "/",
              options_.name);
      announced = true;
    }
    SleepUnlessStopped(options_.retry_period, stop);
  }
  return false;
}

bool LeaderElector::Hold(const std::atomic<bool>& stop) {
  auto last_renew = Clock::now();
  while (!stop.load()) {
    SleepUnlessStopped(options_.retry_period, stop);
    if (stop.load()) break;
    if (TryAcquireOrRenew()) {
      last_renew = Clock::now();
    } else if (Clock::now() - last_renew > options_.renew_deadline) {
      leading_ = false;
      LogWarning(
          "leader election: ", options_.identity, " lost lease ", options_.namespace_, "/",
          options_.name, " (not renewed for ",
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - last_renew).count(),
          " ms)");
      return false;
    }
  }
  return true;
}

void LeaderElector::Release() {
  if (!leading_.exchange(false)) return;
  auto lease = client_->Get(k8s::kLeases, options_.namespace_, options_.name);
  if (!lease.ok() || (*lease)["spec"].value("holderIdentity", "") != options_.identity) return;
  (*lease)["spec"]["holderIdentity"] = "";
  (*lease)["spec"]["leaseDurationSeconds"] = 1;
  (*lease)["metadata"].erase("managedFields");
  auto r = client_->Request("PUT", k8s::kLeases.Path(options_.namespace_, options_.name), &*lease);
  if (!r.ok()) {
    LogWarning("leader election: releasing lease: ", r.status().message());
  }
}

}  // namespace shardserve::op
