#pragma once
// An informer: lists a resource, then watches it from the list's resourceVersion (with
// bookmarks), keeping a local cache indexed by namespace/name and by label. When the watch ends
// it resumes from the last resourceVersion; a 410 Gone (the version was compacted away) lists
// again and reports the difference as events; any other error retries with exponential backoff.
// Handlers run on the informer's thread, in order; they should only enqueue keys.
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "k8s/client.h"

namespace shardserve::k8s {

// The cache: objects by "namespace/name" (or "name" for cluster objects), with an index of
// label "key=value" to keys. Objects are kept in CBOR (about a tenth of a JSON tree's memory)
// and decoded on read. Thread-safe; Get/List return copies.
class Store {
 public:
  static std::string KeyOf(const json& object);

  std::optional<json> Get(const std::string& key) const;
  std::vector<json> List() const;
  std::vector<std::string> Keys() const;
  std::vector<json> ByLabel(const std::string& label, const std::string& value) const;
  std::vector<json> InNamespace(const std::string& ns) const;
  size_t size() const;
  size_t bytes() const;  // of the cached objects (CBOR), keys and index excluded

  // Informer side: returns the previous object, if any.
  std::optional<json> Upsert(json object);
  std::optional<json> Remove(const std::string& key);

 private:
  void IndexLocked(const std::string& key, const json& object, bool add)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  mutable absl::Mutex mu_;
  std::map<std::string, std::vector<uint8_t>> objects_ ABSL_GUARDED_BY(mu_);  // CBOR
  std::map<std::string, std::set<std::string>> by_label_ ABSL_GUARDED_BY(mu_);
};

struct EventHandlers {
  std::function<void(const json& object)> on_add;
  std::function<void(const json& old_object, const json& object)> on_update;
  std::function<void(const json& object)> on_delete;
};

struct InformerOptions {
  std::string namespace_;  // "" = every namespace
  std::string label_selector;
  int watch_timeout_seconds = 300;
  std::chrono::milliseconds min_backoff{100};
  std::chrono::milliseconds max_backoff{30000};
  // Applied to every object before it is cached (default: drop metadata.managedFields, which
  // the operator never reads and which would double the cache).
  std::function<void(json& object)> transform;
};

class Informer {
 public:
  Informer(Client* client, ResourceType type, InformerOptions options, EventHandlers handlers);
  ~Informer();
  Informer(const Informer&) = delete;
  Informer& operator=(const Informer&) = delete;

  void Start();
  void Stop();
  // True once the first list is in the cache (false on timeout or stop).
  bool WaitForSync(std::chrono::milliseconds timeout);
  const Store& store() const { return store_; }

  int64_t lists() const { return lists_.load(); }    // 1 + relists (410s, errors)
  int64_t events() const { return events_.load(); }  // watch events handled
  std::string last_error() const;

 private:
  void Run();
  absl::Status ListAndReplace(std::string& resource_version);
  void Apply(const std::string& type, json object);
  void Backoff(std::chrono::milliseconds& delay);

  Client* client_;
  ResourceType type_;
  InformerOptions options_;
  EventHandlers handlers_;
  Store store_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  mutable absl::Mutex mu_;
  absl::CondVar cv_;
  std::unique_ptr<WatchCancel> cancel_ ABSL_GUARDED_BY(mu_);  // of the watch in progress
  bool synced_ ABSL_GUARDED_BY(mu_) = false;
  std::string last_error_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> lists_{0}, events_{0};
};

}  // namespace shardserve::k8s
