#pragma once
// Who may read the operator's /metrics, asked of the apiserver as controller-runtime's
// WithAuthenticationAndAuthorization and kube-rbac-proxy do: the request's bearer token is
// reviewed (TokenReview), then the user it names is asked for `get` on the non-resource URL
// /metrics (SubjectAccessReview), so whoever may read it is decided by RBAC (the chart's
// ClusterRole <release>-metrics-reader). Verdicts are cached per token (its SHA-256) for `ttl`,
// at most kMaxEntries of them; reviews beyond kReviewsPerSecond are refused (503) rather than
// sent, so a flood of made-up tokens neither loads the apiserver nor eats the operator's own
// client budget. Thread-safe.
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "k8s/client.h"

namespace shardserve::op {

class MetricsAuthorizer {
 public:
  static constexpr size_t kMaxEntries = 1024;
  static constexpr double kReviewsPerSecond = 5;

  explicit MetricsAuthorizer(k8s::Client* client, absl::Duration ttl = absl::Seconds(30))
      : client_(client), ttl_(ttl) {}

  // OK, Unauthenticated (no token or one the apiserver does not know: 401), PermissionDenied
  // (the user may not get /metrics: 403), Unavailable (the apiserver could not be asked: 503).
  absl::Status Authorize(const std::string& authorization_header);

 private:
  absl::Status Review(const std::string& token);
  bool TakeReview() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  k8s::Client* client_;
  const absl::Duration ttl_;
  absl::Mutex mu_;
  struct Verdict {
    absl::Status status;
    absl::Time until;
  };
  std::map<std::string, Verdict> cache_ ABSL_GUARDED_BY(mu_);  // by the token's digest
  double bucket_ ABSL_GUARDED_BY(mu_) = 2 * kReviewsPerSecond;
  absl::Time bucket_time_ ABSL_GUARDED_BY(mu_) = absl::Now();
};

}  // namespace shardserve::op
