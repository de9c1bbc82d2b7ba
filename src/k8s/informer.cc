#include "k8s/informer.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardserve::k8s {

std::string Store::KeyOf(const json& object) {
  const json& meta = object["metadata"];
  const std::string ns = meta.value("namespace", "");
  const std::string name = meta.value("name", "");
  return ns.empty() ? name : ns + "/" + name;
}

void Store::IndexLocked(const std::string& key, const json& object, bool add) {
  auto labels = object["metadata"].find("labels");
  if (labels == object["metadata"].end() || !labels->is_object()) return;
  for (const auto& [k, v] : labels->items()) {
    if (!v.is_string()) continue;
    const std::string idx = k + "=" + v.get<std::string>();
    if (add) {
      by_label_[idx].insert(key);
    } else if (auto it = by_label_.find(idx); it != by_label_.end()) {
      it->second.erase(key);
      if (it->second.empty()) by_label_.erase(it);
    }
  }
}

std::optional<json> Store::Upsert(json object) {
  const std::string key = KeyOf(object);
  std::vector<uint8_t> packed = json::to_cbor(object);
  absl::MutexLock lock(&mu_);
  std::optional<json> old;
  if (auto it = objects_.find(key); it != objects_.end()) {
    old = json::from_cbor(it->second);
    IndexLocked(key, *old, false);
  }
  IndexLocked(key, object, true);
  objects_[key] = std::move(packed);
  return old;
}

std::optional<json> Store::Remove(const std::string& key) {
  absl::MutexLock lock(&mu_);
  auto it = objects_.find(key);
  if (it == objects_.end()) return std::nullopt;
  json old = json::from_cbor(it->second);
  IndexLocked(key, old, false);
  objects_.erase(it);
  return old;
}

std::optional<json> Store::Get(const std::string& key) const {
  absl::MutexLock lock(&mu_);
  auto it = objects_.find(key);
  if (it == objects_.end()) return std::nullopt;
  return json::from_cbor(it->second);
}

std::vector<json> Store::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<json> out;
  out.reserve(objects_.size());
  for (const auto& [k, v] : objects_) out.push_back(json::from_cbor(v));
  return out;
}

std::vector<json> Store::ByLabel(const std::string& label, const std::string& value) const {
  absl::MutexLock lock(&mu_);
  std::vector<json> out;
  auto it = by_label_.find(label + "=" + value);
  if (it == by_label_.end()) return out;
  for (const std::string& key : it->second) out.push_back(json::from_cbor(objects_.at(key)));
  return out;
}

std::vector<json> Store::InNamespace(const std::string& ns) const {
  absl::MutexLock lock(&mu_);
  std::vector<json> out;
  for (auto it = objects_.lower_bound(ns + "/"); it != objects_.end(); ++it) {
    if (it->first.compare(0, ns.size() + 1, ns + "/") != 0) break;
    out.push_back(json::from_cbor(it->second));
  }
  return out;
}

std::vector<std::string> Store::Keys() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> out;
  out.reserve(objects_.size());
  for (const auto& [k, v] : objects_) out.push_back(k);
  return out;
}

size_t Store::bytes() const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [k, v] : objects_) n += v.size();
  return n;
}

size_t Store::size() const {
  absl::MutexLock lock(&mu_);
  return objects_.size();
}

Informer::Informer(Client* client, ResourceType type, InformerOptions options,
                   EventHandlers handlers)
    : client_(client),
      type_(std::move(type)),
      options_(std::move(options)),
      handlers_(std::move(handlers)) {
  if (!options_.transform) {
    options_.transform = [](json& o) { o["metadata"].erase("managedFields"); };
  }
}

Informer::~Informer() { Stop(); }

void Informer::Start() {
  stop_.store(false);
  thread_ = std::thread([this] { Run(); });
}

void Informer::Stop() {
  stop_.store(true);
  {
    absl::MutexLock lock(&mu_);
    if (cancel_) cancel_->Cancel();
    cv_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
}

bool Informer::WaitForSync(std::chrono::milliseconds timeout) {
  const absl::Time deadline = absl::Now() + absl::FromChrono(timeout);
  absl::MutexLock lock(&mu_);
  while (!synced_ && !stop_.load()) {
    if (cv_.WaitWithDeadline(&mu_, deadline)) break;
  }
  return synced_;
}

std::string Informer::last_error() const {
  absl::MutexLock lock(&mu_);
  return last_error_;
}

void Informer::Apply(const std::string& type, json object) {
  options_.transform(object);
  ++events_;
  if (type == "DELETED") {
    std::optional<json> old = store_.Remove(Store::KeyOf(object));
    if (handlers_.on_delete) handlers_.on_delete(old ? *old : object);
    return;
  }
  std::optional<json> old = store_.Upsert(object);
  if (!old) {
    if (handlers_.on_add) handlers_.on_add(object);
  } else if (handlers_.on_update) {
    handlers_.on_update(*old, object);
  }
}

absl::Status Informer::ListAndReplace(std::string& resource_version) {
  ListOptions lo;
  lo.label_selector = options_.label_selector;
  std::set<std::string> seen;
  ASSIGN_OR_RETURN(resource_version,
                   client_->ListPages(type_, options_.namespace_, lo, [&](json& page) {
                     for (json& item : page["items"]) {
                       // List items carry no apiVersion/kind; the watch's do. Make them alike.
                       item["apiVersion"] = type_.api_version();
                       item["kind"] = type_.kind;
                       options_.transform(item);
                       const std::string key = Store::KeyOf(item);
                       seen.insert(key);
                       std::optional<json> old = store_.Get(key);
                       if (!old) {
                         store_.Upsert(item);
                         if (handlers_.on_add) handlers_.on_add(item);
                       } else if ((*old)["metadata"].value("resourceVersion", "") !=
                                  item["metadata"].value("resourceVersion", "")) {
                         store_.Upsert(item);
                         if (handlers_.on_update) handlers_.on_update(*old, item);
                       }
                     }
                     page = json();
                     return absl::OkStatus();
                   }));
  ++lists_;
  // Whatever vanished while we were not watching is a delete.
  for (const std::string& key : store_.Keys()) {
    if (seen.count(key)) continue;
    std::optional<json> old = store_.Remove(key);
    if (old && handlers_.on_delete) handlers_.on_delete(*old);
  }
  {
    absl::MutexLock lock(&mu_);
    synced_ = true;
    cv_.SignalAll();
  }
  return absl::OkStatus();
}

void Informer::Backoff(std::chrono::milliseconds& delay) {
  const absl::Time deadline = absl::Now() + absl::FromChrono(delay);
  absl::MutexLock lock(&mu_);
  while (!stop_.load()) {
    if (cv_.WaitWithDeadline(&mu_, deadline)) break;
  }
  delay = std::min(options_.max_backoff, delay * 2);
}

void Informer::Run() {
  auto delay = options_.min_backoff;
  while (!stop_.load()) {
    std::string rv;
    if (absl::Status s = ListAndReplace(rv); !s.ok()) {
      {
        absl::MutexLock lock(&mu_);
        last_error_ = std::string(s.message());
      }
      Backoff(delay);
      continue;
    }
    delay = options_.min_backoff;
    while (!stop_.load()) {
      WatchCancel* cancel;
      {
        absl::MutexLock lock(&mu_);
        cancel_ = std::make_unique<WatchCancel>();
        cancel = cancel_.get();
        if (stop_.load()) break;
      }
      WatchOptions wo;
      wo.resource_version = rv;
      wo.label_selector = options_.label_selector;
      wo.timeout_seconds = options_.watch_timeout_seconds;
      const absl::Status s = client_->Watch(
          type_, options_.namespace_, wo,
          [&](const std::string& type, const json& object) {
            rv = object["metadata"].value("resourceVersion", rv);
            if (type != "BOOKMARK") Apply(type, object);
            delay = options_.min_backoff;
            return !stop_.load();
          },
          cancel);
      if (stop_.load()) break;
      if (s.ok()) continue;  // the server ended the stream: resume from rv
      {
        absl::MutexLock lock(&mu_);
        last_error_ = std::string(s.message());
      }
      if (ApiGone(s)) break;  // rv was compacted away: list again
      Backoff(delay);
    }
  }
}

}  // namespace shardserve::k8s
