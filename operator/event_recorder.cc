#include "operator/event_recorder.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "api/sharded_model.h"
#include "common/log.h"

namespace shardserve::op {

EventRecorder::EventRecorder(k8s::Client* client, size_t max_queued)
    : client_(client), max_queued_(max_queued), thread_([this] { Run(); }) {}

EventRecorder::~EventRecorder() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  thread_.join();
}

void EventRecorder::Record(const json& model, const Event& e) {
  const json& meta = model["metadata"];
  const std::string ns = meta.value("namespace", "default");
  const std::string name = meta.value("name", "");
  LogInfo("model ", ns, "/", name, ": ", e.reason, ": ", e.message);
  const std::string now = Rfc3339(absl::Now());
  json event = {{"apiVersion", "v1"},
                {"kind", "Event"},
                {"metadata", {{"generateName", name + "."}, {"namespace", ns}}},
                {"involvedObject",
                 {{"apiVersion", kApiVersion},
                  {"kind", "ShardedModel"},
                  {"name", name},
                  {"namespace", ns},
                  {"uid", meta.value("uid", "")},
                  {"resourceVersion", meta.value("resourceVersion", "")}}},
                {"type", e.type},
                {"reason", e.reason},
                {"message", e.message.substr(0, 1024)},
                {"source", {{"component", "shardserve-operator"}}},
                {"firstTimestamp", now},
                {"lastTimestamp", now},
                {"count", 1}};
  absl::MutexLock lock(&mu_);
  if (queue_.size() >= max_queued_) {
    LogWarning("event recorder: ", queue_.size(), " events queued; dropping the oldest");
    queue_.pop_front();
  }
  queue_.emplace_back(ns, std::move(event));
  cv_.SignalAll();
}

void EventRecorder::Run() {
  while (true) {
    std::pair<std::string, json> next;
    {
      absl::MutexLock lock(&mu_);
      while (!stop_ && queue_.empty()) cv_.Wait(&mu_);
      if (queue_.empty()) return;  // stopping, and everything is posted
      next = std::move(queue_.front());
      queue_.pop_front();
    }
    auto& [ns, event] = next;
    auto r = client_->Create(k8s::kEvents, ns, event);
    if (!r.ok()) {
      LogWarning("event recorder: event ", event.value("reason", ""),
                 " not recorded: ", r.status().message());
    }
  }
}

}  // namespace shardserve::op
