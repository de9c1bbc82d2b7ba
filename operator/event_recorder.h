#pragma once
// Records Kubernetes Events for ShardedModels off the reconcile path, as client-go's recorder
// does: Record() logs the line and queues the Event; one thread posts them in order. The queue
// is bounded (the oldest are dropped, and said so in the log) so an apiserver that does not take
// Events cannot grow the operator's memory. Thread-safe.
#include <deque>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "k8s/client.h"
#include "operator/reconcile.h"

namespace shardserve::op {

class EventRecorder {
 public:
  explicit EventRecorder(k8s::Client* client, size_t max_queued = 4096);
  ~EventRecorder();  // posts what is queued, then stops

  // `model` is the ShardedModel object the Event is about.
  void Record(const json& model, const Event& event);

 private:
  void Run();

  k8s::Client* client_;
  size_t max_queued_;
  absl::Mutex mu_;
  absl::CondVar cv_;
  std::deque<std::pair<std::string, json>> queue_ ABSL_GUARDED_BY(mu_);  // namespace, Event
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace shardserve::op
