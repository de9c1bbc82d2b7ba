#include "operator/metrics_auth.h"

#include <openssl/sha.h>

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardserve::op {
namespace {

using json = nlohmann::json;

std::string Digest(const std::string& token) {
  unsigned char d[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), d);
  return std::string(reinterpret_cast<const char*>(d), sizeof(d));
}

}  // namespace

bool MetricsAuthorizer::TakeReview() {
  const absl::Time now = absl::Now();
  bucket_ = std::min(2 * kReviewsPerSecond,
                     bucket_ + absl::ToDoubleSeconds(now - bucket_time_) * kReviewsPerSecond);
  bucket_time_ = now;
  if (bucket_ < 1) return false;
  bucket_ -= 1;
  return true;
}

absl::Status MetricsAuthorizer::Review(const std::string& token) {
  auto review = client_->Create(k8s::kTokenReviews, "",
                                {{"apiVersion", "authentication.k8s.io/v1"},
                                 {"kind", "TokenReview"},
                                 {"spec", {{"token", token}}}});
  if (!review.ok()) {
    return absl::UnavailableError(
        absl::StrCat("the token could not be reviewed: ", review.status().message()));
  }
  const json status = review->value("status", json::object());
  if (!status.value("authenticated", false)) {
    return absl::UnauthenticatedError("the bearer token is not valid");
  }
  const json user = status.value("user", json::object());
  json spec = {{"nonResourceAttributes", {{"path", "/metrics"}, {"verb", "get"}}},
               {"user", user.value("username", "")}};
  for (const char* k : {"uid", "groups", "extra"}) {
    if (user.contains(k)) spec[k] = user[k];
  }
  auto access = client_->Create(
      k8s::kSubjectAccessReviews, "",
      {{"apiVersion", "authorization.k8s.io/v1"}, {"kind", "SubjectAccessReview"}, {"spec", spec}});
  if (!access.ok()) {
    return absl::UnavailableError(
        absl::StrCat("access could not be reviewed: ", access.status().message()));
  }
  if (!access->value("status", json::object()).value("allowed", false)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "'", user.value("username", "?"), "' may not get /metrics (RBAC: nonResourceURLs)"));
  }
  return absl::OkStatus();
}

absl::Status MetricsAuthorizer::Authorize(const std::string& header) {
  const absl::string_view h = absl::StripAsciiWhitespace(header);
  if (!absl::StartsWithIgnoreCase(h, "bearer ")) {
    return absl::UnauthenticatedError("/metrics needs 'Authorization: Bearer TOKEN'");
  }
  const std::string token(absl::StripAsciiWhitespace(h.substr(7)));
  if (token.empty() || token.size() > 16384) {
    return absl::UnauthenticatedError("the bearer token is empty or too long");
  }
  const std::string key = Digest(token);
  {
    absl::MutexLock lock(&mu_);
    auto it = cache_.find(key);
    if (it != cache_.end() && it->second.until > absl::Now()) return it->second.status;
    if (!TakeReview()) {
      return absl::UnavailableError("too many tokens to review: try again in a moment");
    }
  }
  absl::Status verdict = Review(token);
  if (absl::IsUnavailable(verdict)) return verdict;  // not a verdict: ask again next time
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  if (cache_.size() >= kMaxEntries) {
    for (auto it = cache_.begin(); it != cache_.end();) {
      it = it->second.until <= now ? cache_.erase(it) : std::next(it);
    }
    if (cache_.size() >= kMaxEntries) cache_.clear();
  }
  cache_[key] = {verdict, now + ttl_};
  return verdict;
}

}  // namespace shardserve::op
