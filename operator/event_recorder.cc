#include "operator/event_recorder.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"

namespace shardserve::op {

EventRecorder::EventRecorder(k8s::Client* client, size_t max_queued)
    : client_(client), max_queued_(max_queued), thread_([this] { Run(); }) {}

EventRecorder::~EventRecorder() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
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
                 {{"apiVersion", "shardserve.io/v1alpha1"},
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
  std::lock_guard<std::mutex> lock(mu_);
  if (queue_.size() >= max_queued_) {
    LogWarning("event recorder: ", queue_.size(), " events queued; dropping the oldest");
    queue_.pop_front();
  }
  queue_.emplace_back(ns, std::move(event));
  cv_.notify_all();
}

void EventRecorder::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and everything is posted
    auto [ns, event] = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    auto r = client_->Create(k8s::kEvents, ns, event);
    if (!r.ok()) {
      LogWarning("event recorder: event ", event.value("reason", ""),
                 " not recorded: ", r.status().message());
    }
    lock.lock();
  }
}

}  // namespace shardserve::op
