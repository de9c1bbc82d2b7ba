#pragma once
// Flow control between tenants (issue 55): the API key is the tenant. A config file (YAML, from
// a ConfigMap or Secret mounted on the leaders and routers: spec.serving.flowControl) gives each
// tenant's class, and `default` every other key's:
//
//   tenants:
//     - name: batch-jobs              # a name for metrics and errors (never the key)
//       keySha256: 9f86d0...           # the key's SHA-256 (hex), or `key:` itself (in a Secret)
//       priority: 10                   # the most urgent priority its requests may ask
//       weight: 1                      # its share of the batch against the others'
//       requestsPerSecond: 5           # 0 or absent: no limit
//       tokensPerMinute: 20000         # prompt and completion tokens; 0 or absent: no limit
//   default: {priority: 0, weight: 1, requestsPerSecond: 0, tokensPerMinute: 0}
//
// Priorities are vLLM's: a request's `priority` (default 0), lower runs first; a tenant's
// requests run at max(its class's priority, the request's), so no key jumps ahead of its class.
// Within a priority the batch is shared between tenants in proportion to their weights
// (weighted fair sharing: the next slot goes to the waiting tenant with the fewest running
// sequences per weight), and under memory pressure the lowest priority is preempted first.
//
// Limits: a token bucket of requestsPerSecond (a second's worth of burst) and a sliding minute
// of tokens; a request past either is answered 429 with Retry-After, naming the limit. The
// file is read again when it changes (checked every second), so a limit changes without a
// restart; a file that no longer parses keeps the last good config and says why once. With
// `share` n > 1 (n routers in front of the model, each seeing about 1/n of a key's requests)
// every limit is divided by n. Thread-safe.
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace shardserve {

struct TenantClass {
  std::string name;      // the configured name, or "key-<first 12 hex digits of its SHA-256>"
  int64_t priority = 0;  // the most urgent its requests may ask
  double weight = 1.0;   // > 0
  double requests_per_second = 0;  // 0: no limit
  int64_t tokens_per_minute = 0;   // 0: no limit
};

struct FlowConfig {
  std::map<std::string, TenantClass> by_digest;  // hex SHA-256 of the key -> class
  TenantClass fallback;                          // every other key's (`default`)
};

// The config from its YAML text; InvalidArgument naming the entry and field that is wrong.
absl::StatusOr<FlowConfig> ParseFlowConfig(const std::string& yaml);

class FlowControl {
 public:
  using Clock = std::chrono::steady_clock;
  // From the file (empty: every tenant the default class, with no limits); InvalidArgument
  // naming the file and what is wrong in it.
  static absl::StatusOr<std::unique_ptr<FlowControl>> Open(const std::string& file, int share = 1);

  // The tenant of a request's Authorization header ("Bearer KEY"; none: the anonymous tenant,
  // named "anonymous") and its class.
  TenantClass Tenant(std::string_view authorization);
  // A request of `tenant` arriving now: OK, or ResourceExhausted naming the limit it is past
  // ("requestsPerSecond 5 of tenant batch-jobs"), with *retry_after the seconds until it
  // would be taken.
  absl::Status Admit(const TenantClass& tenant, int64_t* retry_after, Clock::time_point now);
  absl::Status Admit(const TenantClass& tenant, int64_t* retry_after) {
    return Admit(tenant, retry_after, Clock::now());
  }
  // Tokens a request of `tenant` used (its prompt and completion), counted in its minute.
  void Record(const TenantClass& tenant, int64_t tokens, Clock::time_point now);
  void Record(const TenantClass& tenant, int64_t tokens) { Record(tenant, tokens, Clock::now()); }

 private:
  FlowControl(std::string file, int share) : file_(std::move(file)), share_(share) {}
  void RefreshLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  struct Usage {
    double bucket = -1;  // requests that may start now (-1: full, not yet used)
    Clock::time_point filled;
    int64_t seconds[60] = {};  // tokens by second of the minute, at `second_of`
    int64_t second_of[60] = {};
  };

  const std::string file_;
  const int share_;
  absl::Mutex mu_;
  FlowConfig config_ ABSL_GUARDED_BY(mu_);
  std::string text_ ABSL_GUARDED_BY(mu_);  // the file's contents the config came from
  Clock::time_point checked_ ABSL_GUARDED_BY(mu_);
  std::string last_error_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Usage> usage_ ABSL_GUARDED_BY(mu_);  // by tenant name
};

}  // namespace shardserve
