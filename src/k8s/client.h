#pragma once
// A Kubernetes API client over cpprestsdk: verified TLS with the config's CA, client-certificate
// or bearer-token authentication, client-side QPS/burst limits, typed paths for what the operator
// needs (Pods, Nodes, Services, Events, Leases, ShardedModels and their status and scale
// subresources) and watch streams. Objects are JSON (nlohmann). Every call returns a Status; the
// apiserver's Status message is kept, and the reason is queryable (ApiNotFound, ApiConflict,
// ApiGone, ...). No exception escapes. Thread-safe.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "k8s/config.h"

namespace shardserve::k8s {

using json = nlohmann::json;

struct ResourceType {
  std::string group;  // "" for the core group
  std::string version;
  std::string plural;
  std::string kind;
  bool namespaced = true;

  // /api/v1/namespaces/NS/pods/NAME/SUB, /apis/GROUP/VERSION/... for named groups.
  std::string Path(const std::string& ns, const std::string& name = "",
                   const std::string& subresource = "") const;
  std::string api_version() const { return group.empty() ? version : group + "/" + version; }
};

extern const ResourceType kPods, kNodes, kServices, kEvents, kLeases, kShardedModels,
    kNetworkPolicies, kSecrets, kPodDisruptionBudgets, kTokenReviews, kSubjectAccessReviews,
    kDeployments;

// The apiserver's verdict, kept on a Status.
bool ApiNotFound(const absl::Status& s);
bool ApiAlreadyExists(const absl::Status& s);
bool ApiConflict(const absl::Status& s);  // 409 on an update: the object changed since it was read
bool ApiGone(const absl::Status& s);      // 410: a resourceVersion too old to watch from

// The JSON merge patch (RFC 7386) that turns `from` into `to`: a member `to` lacks is null (a
// merge patch that leaves a member out keeps it), objects are compared member by member, anything
// else (arrays included) is replaced whole.
json MergePatchBetween(const json& from, const json& to);

struct ClientOptions {
  double qps = 50;  // client-side rate limit (token bucket), as client-go's defaults scaled up
  int burst = 100;
  std::chrono::seconds timeout{30};
  std::string field_manager = "shardserve-operator";  // server-side apply owner
  std::string user_agent = "shardserve";
};

struct ListOptions {
  std::string label_selector;
  std::string field_selector;
  std::string resource_version;  // "" = most recent (quorum read)
  int64_t limit = 500;           // page size; List follows `continue` to the end
};

struct WatchOptions {
  std::string resource_version;
  std::string label_selector;
  std::string field_selector;
  int timeout_seconds = 300;  // the server ends the stream after this; the caller re-watches
  bool bookmarks = true;
};

// A watch event: ADDED, MODIFIED, DELETED, BOOKMARK or ERROR (object is then a Status).
using WatchHandler = std::function<bool(const std::string& type, const json& object)>;

// Ends a watch in progress from another thread (it then returns Cancelled). Thread-safe.
class WatchCancel {
 public:
  WatchCancel();
  ~WatchCancel();
  void Cancel();
  bool cancelled() const;
  struct Impl;
  Impl* impl() const { return impl_.get(); }

 private:
  std::unique_ptr<Impl> impl_;
};

class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Create(const KubeConfig& config,
                                                        ClientOptions options = {});
  ~Client();

  const KubeConfig& config() const { return config_; }
  const ClientOptions& options() const { return options_; }

  // One request; the JSON answer, or the error with the apiserver's message.
  absl::StatusOr<json> Request(const std::string& method, const std::string& path_and_query,
                               const json* body = nullptr,
                               const std::string& content_type = "application/json");

  absl::StatusOr<json> Get(const ResourceType& rt, const std::string& ns, const std::string& name,
                           const std::string& subresource = "");
  // Every page, items concatenated; metadata.resourceVersion of the list in the result.
  absl::StatusOr<json> List(const ResourceType& rt, const std::string& ns,
                            const ListOptions& options = {});
  // The same, page by page (so a large list is never whole in memory); returns the list's
  // resourceVersion.
  absl::StatusOr<std::string> ListPages(const ResourceType& rt, const std::string& ns,
                                        const ListOptions& options,
                                        const std::function<absl::Status(json& page)>& on_page);
  absl::StatusOr<json> Create(const ResourceType& rt, const std::string& ns, const json& object);
  // Server-side apply with the client's field manager (force: take over conflicting fields).
  absl::StatusOr<json> Apply(const ResourceType& rt, const std::string& ns, const json& object,
                             bool force = true);
  absl::StatusOr<json> MergePatch(const ResourceType& rt, const std::string& ns,
                                  const std::string& name, const json& patch,
                                  const std::string& subresource = "");
  // Optimistic concurrency: reads the object, lets `mutate` change its status, PUTs the status
  // subresource with the read resourceVersion; a 409 re-reads and tries again (up to
  // `attempts`), it is not an error. mutate returning false means nothing to write.
  absl::StatusOr<json> UpdateStatus(const ResourceType& rt, const std::string& ns,
                                    const std::string& name,
                                    const std::function<bool(json& object)>& mutate,
                                    int attempts = 16);
  // Deletes with preconditions (uid and/or resourceVersion; empty = none) and a propagation
  // policy (Background, Foreground or Orphan; empty = the server's default). NotFound is OK.
  absl::Status Delete(const ResourceType& rt, const std::string& ns, const std::string& name,
                      const std::string& uid = "", const std::string& resource_version = "",
                      const std::string& propagation = "");
  // Streams events until the handler returns false, the server ends the stream (OK), or an error
  // (Unavailable; an ERROR event with code 410 is reported as ApiGone).
  absl::Status Watch(const ResourceType& rt, const std::string& ns, const WatchOptions& options,
                     const WatchHandler& handler, const WatchCancel* cancel = nullptr);

  // Requests sent, and time spent waiting for the client-side rate limit.
  int64_t requests() const { return requests_.load(); }
  double throttled_seconds() const;

  struct Impl;

 private:
  Client(const KubeConfig& config, ClientOptions options);
  void Throttle();
  absl::Status Unreachable(const std::string& what, const std::string& error) const;

  KubeConfig config_;
  ClientOptions options_;
  TokenSource tokens_;
  std::unique_ptr<Impl> impl_;
  std::atomic<int64_t> requests_{0};
  // SHARDSERVE_K8S_TRACE=1: every request is logged with its code and time (as kubectl -v=6).
  const bool trace_ = std::getenv("SHARDSERVE_K8S_TRACE") != nullptr;
  mutable absl::Mutex bucket_mu_;
  double bucket_tokens_ ABSL_GUARDED_BY(bucket_mu_);
  std::chrono::steady_clock::time_point bucket_time_ ABSL_GUARDED_BY(bucket_mu_);
  double throttled_ ABSL_GUARDED_BY(bucket_mu_) = 0;
};

}  // namespace shardserve::k8s
