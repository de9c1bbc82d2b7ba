#include "operator/controller.h"

#include <openssl/rand.h>

#include <cstdio>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/status.h"
#include "http/client.h"
#include "plan/cluster_view.h"

namespace shardserve::op {
namespace {

// A fresh secret for a replica's rendezvous: 32 random bytes, hex.
absl::StatusOr<std::string> NewSecretValue() {
  unsigned char raw[32];
  if (RAND_bytes(raw, sizeof(raw)) != 1) return absl::InternalError("no random bytes");
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(raw), sizeof(raw)));
}

using k8s::kNodes;
using k8s::kPods;
using k8s::kServices;
using k8s::kShardedModels;

// How long a write is remembered when the informer never shows it (a lost watch event).
constexpr absl::Duration kMemoryTtl = absl::Seconds(60);
// How long a bound pod may mount its volumes before its events are read for a failure.
constexpr absl::Duration kMountGrace = absl::Seconds(10);
// Asking a starting rank what it is doing (its /startupz): how long, and how much it may say.
constexpr std::chrono::milliseconds kStartupAsk(500);
constexpr size_t kStartupBytes = 4096;
// A pod's look (what it says while not ready) is asked again once this old.
constexpr absl::Duration kLookAgain = absl::Seconds(1);
// How often status.downloads is refreshed while a node fetches a remote model.
constexpr absl::Duration kDownloadLook = absl::Seconds(2);

// The fields of a Node that placement reads; heartbeats and images are dropped, so a node's
// periodic status update does not look like a change.
void SlimNode(json& node) {
  json meta = Pick(node["metadata"], {"name", "resourceVersion", "labels"});
  json status = {{"allocatable", node["status"].value("allocatable", json::object())}};
  for (const json& c : node["status"].value("conditions", json::array())) {
    if (c.value("type", "") == "Ready")
      status["conditions"] = json::array({Pick(c, {"type", "status"})});
  }
  node = {{"metadata", meta},
          {"spec", Pick(node["spec"], {"taints", "unschedulable"})},
          {"status", status}};
}

// Two slimmed objects that differ at most in resourceVersion.
bool SameButVersion(const json& a, const json& b) {
  json x = a, y = b;
  x["metadata"].erase("resourceVersion");
  y["metadata"].erase("resourceVersion");
  return x == y;
}

std::string ModelKeyOfPod(const json& pod) {
  const json& labels = pod["metadata"].value("labels", json::object());
  if (!labels.contains(kModelLabel)) return "";
  return absl::StrCat(pod["metadata"].value("namespace", ""), "/",
                      labels[kModelLabel].get<std::string>());
}

std::string ObjectHash(const json& object) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : object.dump()) h = (h ^ c) * 1099511628211ull;
  return absl::StrCat(absl::Hex(h & 0xffffffffffffull, absl::kZeroPad12));
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Runs fn(0..n-1), at most kParallelWrites at a time; returns when all are done.
constexpr size_t kParallelWrites = 8;
void ForEachParallel(size_t n, const std::function<void(size_t)>& fn) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < n; i = next++) fn(i);
  };
  std::vector<std::thread> threads;
  for (size_t t = 1; t < std::min(n, kParallelWrites); ++t) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
}

// Independent writes, together (as ForEachParallel); the first error in their order, if any.
absl::Status AllOf(const std::vector<std::function<absl::Status()>>& writes) {
  std::vector<absl::Status> results(writes.size());
  ForEachParallel(writes.size(), [&](size_t i) { results[i] = writes[i](); });
  for (absl::Status& s : results) RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

}  // namespace

GpuLedger::Usage GpuLedger::UsageOf(const json& pod) {
  Usage u;
  if (!PodHoldsResources(pod)) return u;
  const json& spec = pod.value("spec", json::object());
  u.node = spec.value("nodeName", "");
  if (u.node.empty()) {
    // Ours, not yet bound: it holds its planned node.
    PodView v = ReadPod(pod);
    if (v.stage >= 0 && v.stage < static_cast<int64_t>(v.placement.size())) {
      u.node = v.placement[v.stage];
    }
  }
  if (u.node.empty()) return u;
  for (const json& c : spec.value("containers", json::array())) {
    const json res = c.value("resources", json::object());
    const json requests = res.value("requests", json::object());
    for (const char* kind : {"requests", "limits"}) {
      const json quantities = res.value(kind, json::object());
      for (const auto& [k, v] : quantities.items()) {
        if (!Extended(k) || (std::string(kind) == "limits" && requests.contains(k))) continue;
        int64_t n = 0;
        if (v.is_number_integer()) n = v.get<int64_t>();
        if (v.is_string()) (void)absl::SimpleAtoi(v.get<std::string>(), &n);
        u.resources[k] += n;
      }
    }
  }
  return u;
}

void GpuLedger::Set(const std::string& pod_key, Usage usage) {
  absl::MutexLock lock(&mu_);
  if (usage.node.empty()) {
    pods_.erase(pod_key);
  } else {
    pods_[pod_key] = std::move(usage);
  }
}

void GpuLedger::Remove(const std::string& pod_key) {
  absl::MutexLock lock(&mu_);
  pods_.erase(pod_key);
}

std::map<std::string, int64_t> GpuLedger::Requested(const std::string& resource) const {
  absl::MutexLock lock(&mu_);
  std::map<std::string, int64_t> out;
  for (const auto& [key, u] : pods_) {
    auto it = u.resources.find(resource);
    if (it != u.resources.end()) out[u.node] += it->second;
  }
  return out;
}

Controller::Controller(k8s::Client* client, ControllerOptions options, OperatorMetrics* metrics)
    : client_(client), options_(std::move(options)), metrics_(metrics), recorder_(client) {
  k8s::InformerOptions mo;
  mo.namespace_ = options_.namespace_;
  // A model, and the model that owns it (a prefill role's change or loss wakes its decode role,
  // which keeps it as it should be).
  auto enqueue_model = [this](const json& o) {
    Enqueue(k8s::Store::KeyOf(o));
    for (const json& r : o["metadata"].value("ownerReferences", json::array())) {
      if (r.value("kind", "") == "ShardedModel" && r.value("controller", false)) {
        Enqueue(absl::StrCat(o["metadata"].value("namespace", ""), "/", r.value("name", "")));
      }
    }
  };
  models_ = std::make_unique<k8s::Informer>(
      client_, kShardedModels, mo,
      k8s::EventHandlers{enqueue_model,
                         [enqueue_model](const json& old, const json& o) {
                           // Our own status writes come back as updates; only spec and lifecycle
                           // matter.
                           const json& a = old["metadata"];
                           const json& b = o["metadata"];
                           if (a.value("generation", 0) != b.value("generation", 0) ||
                               a.contains("deletionTimestamp") != b.contains("deletionTimestamp") ||
                               a.value("uid", "") != b.value("uid", "")) {
                             enqueue_model(o);
                           }
                         },
                         enqueue_model});

  k8s::InformerOptions po;
  po.transform = SlimPod;
  auto on_pod = [this](const json* old, const json* pod) {
    if (old && pod && SameButVersion(*old, *pod)) return;  // a change of nothing we read
    const json& any = pod ? *pod : *old;
    const std::string key = k8s::Store::KeyOf(any);
    GpuLedger::Usage before = old ? GpuLedger::UsageOf(*old) : GpuLedger::Usage{};
    GpuLedger::Usage after = pod ? GpuLedger::UsageOf(*pod) : GpuLedger::Usage{};
    if (pod) {
      ledger_.Set(key, after);
    } else {
      ledger_.Remove(key);
    }
    const std::string model = ModelKeyOfPod(any);
    if (!model.empty()) Enqueue(model);
    if (!before.node.empty() && (after.node.empty() || after.resources != before.resources)) {
      EnqueueWaiting();  // GPUs freed
    }
  };
  pods_ = std::make_unique<k8s::Informer>(
      client_, kPods, po,
      k8s::EventHandlers{[on_pod](const json& o) { on_pod(nullptr, &o); },
                         [on_pod](const json& old, const json& o) { on_pod(&old, &o); },
                         [on_pod](const json& o) { on_pod(&o, nullptr); }});

  k8s::InformerOptions no;
  no.transform = SlimNode;
  nodes_ =
      std::make_unique<k8s::Informer>(client_, kNodes, no,
                                      k8s::EventHandlers{[this](const json& o) {
                                                           UpdateNode(&o, nullptr);
                                                           EnqueueWaiting();
                                                         },
                                                         [this](const json& old, const json& o) {
                                                           if (SameButVersion(old, o)) return;
                                                           UpdateNode(&o, nullptr);
                                                           EnqueueWaiting();
                                                           EnqueueOnNode(o);
                                                         },
                                                         [this](const json& o) {
                                                           UpdateNode(nullptr, &o);
                                                           EnqueueWaiting();
                                                         }});

  k8s::InformerOptions so;
  so.namespace_ = options_.namespace_;
  so.label_selector = kModelLabel;
  auto on_service = [this](const json& o) {
    const std::string key = ModelKeyOfPod(o);
    if (!key.empty()) Enqueue(key);
  };
  services_ = std::make_unique<k8s::Informer>(
      client_, kServices, so,
      k8s::EventHandlers{on_service, [on_service](const json&, const json& o) { on_service(o); },
                         on_service});
}

Controller::~Controller() { Stop(); }

absl::Status Controller::StartCaches(std::chrono::milliseconds sync_timeout) {
  for (auto* inf : {nodes_.get(), pods_.get(), services_.get(), models_.get()}) inf->Start();
  for (auto* inf : {nodes_.get(), pods_.get(), services_.get(), models_.get()}) {
    if (!inf->WaitForSync(sync_timeout)) {
      return absl::UnavailableError(absl::StrCat("the caches did not fill within ",
                                                 sync_timeout.count(), " ms: ", inf->last_error()));
    }
  }
  synced_ = true;
  return absl::OkStatus();
}

void Controller::StartWorkers() {
  for (int i = 0; i < options_.concurrency; ++i) writers_.emplace_back([this] { Writer(); });
  for (int i = 0; i < options_.concurrency; ++i) workers_.emplace_back([this] { Worker(); });
}

void Controller::Stop() {
  if (stopped_.exchange(true)) return;
  queue_.ShutDown();
  for (auto& t : workers_) t.join();
  workers_.clear();
  {
    absl::MutexLock l(&writes_mu_);  // the writes handed over are carried out first
    writers_stop_ = true;
  }
  for (auto& t : writers_) t.join();
  writers_.clear();
  for (auto* inf : {models_.get(), pods_.get(), nodes_.get(), services_.get()}) inf->Stop();
}

void Controller::UpdateNode(const json* node, const json* gone) {
  absl::MutexLock lock(&nodes_mu_);
  for (auto& [resource, table] : node_infos_) {
    if (gone) {
      table.erase((*gone)["metadata"].value("name", ""));
      continue;
    }
    auto n = NodeFromObject(*node, resource);
    if (n.ok()) {
      table[n->name] = std::move(*n);
    } else {
      LogInfo(absl::StrCat("node ", (*node)["metadata"].value("name", ""),
                           " is not used for placement: ", n.status().message()));
      table.erase((*node)["metadata"].value("name", ""));
    }
  }
}

std::vector<NodeInfo> Controller::Nodes(const std::string& resource) {
  absl::MutexLock lock(&nodes_mu_);
  auto [it, added] = node_infos_.try_emplace(resource);
  if (added) {  // first model with this resource: read every node once, then keep up by events
    for (const json& o : nodes_->store().List()) {
      auto n = NodeFromObject(o, resource);
      if (n.ok()) it->second[n->name] = std::move(*n);
    }
  }
  std::vector<NodeInfo> out;
  out.reserve(it->second.size());
  for (const auto& [name, n] : it->second) out.push_back(n);
  return out;
}

std::map<std::string, std::pair<double, double>> Controller::CacheSizes() const {
  std::map<std::string, std::pair<double, double>> out;
  const std::pair<const char*, const k8s::Informer*> caches[] = {{"shardedmodels", models_.get()},
                                                                 {"pods", pods_.get()},
                                                                 {"nodes", nodes_.get()},
                                                                 {"services", services_.get()}};
  for (const auto& [name, inf] : caches) {
    out[name] = {static_cast<double>(inf->store().size()),
                 static_cast<double>(inf->store().bytes())};
  }
  return out;
}

void Controller::Enqueue(const std::string& key) { queue_.Add(key); }

void Controller::EnqueueOnNode(const json& node) {
  const std::string name = node["metadata"].value("name", "");
  for (const json& pod : pods_->store().List()) {
    if (!pod.contains("spec") || pod["spec"].value("nodeName", "") != name) continue;
    if (const std::string key = ModelKeyOfPod(pod); !key.empty()) queue_.Add(key);
  }
}

void Controller::EnqueueWaiting() {
  std::vector<std::string> keys;
  {
    absl::MutexLock lock(&mu_);
    keys.assign(waiting_.begin(), waiting_.end());
  }
  for (const std::string& k : keys) queue_.Add(k);
}

void Controller::Worker() {
  while (auto key = queue_.Get()) {
    const auto start = std::chrono::steady_clock::now();
    absl::Duration requeue = absl::InfiniteDuration();
    Writes writes = Reconcile(*key, requeue);
    const double pass_seconds = SecondsSince(start);
    if (!writes) {
      Finish(*key, absl::OkStatus(), requeue, pass_seconds);
      continue;
    }
    absl::MutexLock l(&writes_mu_);
    writes_.push_back([this, key = *key, requeue, pass_seconds, w = std::move(writes)] {
      const auto handed = std::chrono::steady_clock::now();
      const absl::Status s = w();
      metrics_->ObserveReconcileApi(SecondsSince(handed));
      Finish(key, s, requeue, pass_seconds);
    });
  }
}

void Controller::Writer() {
  for (;;) {
    std::function<void()> job;
    {
      absl::MutexLock l(&writes_mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(writes_mu_) {
        return writers_stop_ || !writes_.empty();
      };
      writes_mu_.Await(absl::Condition(&ready));
      if (writes_.empty()) return;
      job = std::move(writes_.front());
      writes_.pop_front();
    }
    job();
  }
}

void Controller::Finish(const std::string& key, const absl::Status& s, absl::Duration requeue,
                        double pass_seconds) {
  if (!s.ok()) {
    LogWarning("model ", key, ": reconcile failed, retrying with backoff: ", s.message());
    metrics_->ObserveReconcile("error", pass_seconds);
    queue_.AddRateLimited(key);
  } else {
    queue_.Forget(key);
    if (requeue != absl::InfiniteDuration()) {
      metrics_->ObserveReconcile("requeue", pass_seconds);
      queue_.AddAfter(key, absl::ToChronoMilliseconds(std::max(requeue, absl::Milliseconds(1))));
    } else {
      metrics_->ObserveReconcile("success", pass_seconds);
    }
  }
  queue_.Done(key);
}

void Controller::Forget(const std::string& key) {
  {
    absl::MutexLock lock(&mu_);
    memory_.erase(key);
    waiting_.erase(key);
  }
  metrics_->ForgetModel(key);
}

namespace {

// A string field of an event, "" when absent, null or of another type.
std::string Field(const json& e, const char* key) {
  auto it = e.find(key);
  return it != e.end() && it->is_string() ? it->get<std::string>() : std::string();
}

}  // namespace

Controller::Look Controller::EventsOf(const std::string& ns, const PodView& pod) {
  Look news;
  k8s::ListOptions o;
  o.field_selector = absl::StrCat("involvedObject.uid=", pod.uid);
  o.limit = 100;
  absl::StatusOr<json> list = client_->List(k8s::kEvents, ns, o);
  if (!list.ok() || !list->contains("items") || !(*list)["items"].is_array()) return news;
  const json *mount = nullptr, *pull = nullptr;
  auto when = [](const json& e) {
    const std::string last = Field(e, "lastTimestamp");
    return last.empty() ? Field(e, "eventTime") : last;
  };
  for (const json& e : (*list)["items"]) {
    if (!e.is_object()) continue;
    const std::string reason = Field(e, "reason");
    if (reason == "FailedMount" && (mount == nullptr || when(e) >= when(*mount))) mount = &e;
    if ((reason == "Pulling" || reason == "Pulled") &&
        (pull == nullptr || when(e) >= when(*pull))) {
      pull = &e;
    }
  }
  if (mount != nullptr) {
    news.mount_failure =
        absl::StrCat("pod ", pod.name, ": FailedMount: ", LastLine(Field(*mount, "message")));
  }
  news.pulling = pull != nullptr && Field(*pull, "reason") == "Pulling";
  return news;
}

std::string Controller::RanksStarting(const PodView& pod, int64_t tensor) {
  std::vector<std::string> states;
  for (int64_t t = 0; t < tensor; ++t) {
    absl::StatusOr<std::string> body =
        http::Get(pod.pod_ip, kMetricsPortBase + t, "/startupz", kStartupAsk, kStartupBytes);
    if (!body.ok()) {
      if (t == 0) return absl::StrCat("stage ", pod.stage, ": starting its ranks");
      states.push_back("not answering");
      continue;
    }
    const json j = json::parse(*body, nullptr, false);
    const std::string state = j.is_object() ? Field(j, "state") : "";
    // A rank's own words, bounded: one line, at most 160 characters.
    states.push_back(state.empty() ? "starting" : LastLine(state).substr(0, 160));
  }
  if (states.empty()) return "";
  if (std::all_of(states.begin(), states.end(), [&](const auto& x) { return x == states[0]; })) {
    return absl::StrCat("stage ", pod.stage, ": ", states[0]);
  }
  std::string out;
  for (int64_t t = 0; t < tensor; ++t) {
    absl::StrAppend(&out, t == 0 ? "" : "; ", "stage ", pod.stage, " rank ", pod.stage * tensor + t,
                    ": ", states[t]);
  }
  return out;
}

Controller::Look Controller::FetchProgress(const PodView& pod) {
  Look look;
  absl::StatusOr<std::string> body =
      http::Get(pod.pod_ip, kMetricsPortBase, "/startupz", kStartupAsk, kStartupBytes);
  if (!body.ok()) return look;
  const json j = json::parse(*body, nullptr, false);
  if (!j.is_object()) return look;
  const std::string state = Field(j, "state");
  if (!state.empty()) {
    look.startup = absl::StrCat("stage ", pod.stage, ": ", LastLine(state).substr(0, 200));
  }
  const json d = j.value("download", json());
  if (d.is_object() && d.value("bytes", json()).is_number_integer() &&
      d.value("total", json()).is_number_integer() && d.value("rate", json()).is_number() &&
      d.value("eta", json()).is_number()) {
    PodView::Download dl;
    dl.bytes = std::max<int64_t>(0, d["bytes"].get<int64_t>());
    dl.total = std::max<int64_t>(0, d["total"].get<int64_t>());
    dl.rate = std::max(0.0, d["rate"].get<double>());
    dl.eta = d["eta"].get<double>();
    look.download = dl;
  }
  return look;
}

Controller::Look::Kind Controller::LookKindOf(const PodView& v, int64_t tensor) {
  if (v.deleting) return Look::Kind::kNone;
  if (v.creating && v.stuck.empty()) return Look::Kind::kEvents;
  if (v.fetching && !v.pod_ip.empty()) return Look::Kind::kFetch;
  if (tensor > 0 && v.phase == "Running" && !v.ready && !v.pod_ip.empty()) {
    return Look::Kind::kRanks;
  }
  return Look::Kind::kNone;
}

Controller::Look Controller::Ask(const std::string& ns, const ToLook& t) {
  Look look;
  switch (t.kind) {
    case Look::Kind::kEvents:
      look = EventsOf(ns, t.pod);
      break;
    case Look::Kind::kFetch:
      look = FetchProgress(t.pod);
      break;
    case Look::Kind::kRanks:
      look.startup = RanksStarting(t.pod, t.tensor);
      break;
    case Look::Kind::kNone:
      break;
  }
  look.kind = t.kind;
  look.at = absl::Now();
  return look;
}

PodView Controller::ReadPodOf(const std::string& ns, const json& pod, absl::Time now,
                              int64_t tensor, Memory& mem, std::vector<ToLook>& to_look) {
  PodView v = ReadPod(pod);
  const Look::Kind kind = LookKindOf(v, tensor);
  if (kind == Look::Kind::kNone) return v;
  Look look;  // not asked yet: as a pod that does not answer
  look.kind = kind;
  if (auto it = mem.looks.find(v.uid); it != mem.looks.end() && it->second.kind == kind) {
    look = it->second;
  }
  if (now - look.at >= kLookAgain) to_look.push_back({v, kind, tensor});
  switch (kind) {
    case Look::Kind::kEvents:
      if (now - v.created > kMountGrace) v.stuck = look.mount_failure;
      v.startup = absl::StrCat(
          "stage ", v.stage, ": ",
          look.pulling ? absl::StrCat("pulling image ", v.image) : "creating its container");
      break;
    case Look::Kind::kFetch:
      v.startup = !look.startup.empty() ? look.startup
                                        : absl::StrCat("stage ", v.stage, ": fetching the model");
      v.download = look.download;
      break;
    default:
      v.startup = !look.startup.empty() ? look.startup
                                        : absl::StrCat("stage ", v.stage, ": starting its ranks");
  }
  return v;
}

std::vector<PodView> Controller::PodsOf(const ModelView& m, Memory& mem, absl::Time now,
                                        std::vector<ToLook>& to_look) {
  std::vector<PodView> out;
  std::set<std::string> seen;
  std::map<std::string, bool> cordoned;  // the pods' nodes: marked unschedulable (a drain's first
                                         // step)?
  auto is_cordoned = [&](const std::string& name) {
    auto [it, fresh] = cordoned.try_emplace(name, false);
    if (fresh) {
      const std::optional<json> node = nodes_->store().Get(name);
      const json u =
          node && node->contains("spec") ? (*node)["spec"].value("unschedulable", json()) : json();
      it->second = u.is_boolean() && u.get<bool>();
    }
    return it->second;
  };
  for (const json& pod : pods_->store().ByLabel(kModelLabel, m.model.name)) {
    if (pod["metadata"].value("namespace", "") != m.model.namespace_) continue;
    const std::string role = pod["metadata"]["labels"].value(kRoleLabel, "");
    if (role == kInspectRole || role == kRouterRole) continue;  // not a replica's
    PodView v = ReadPodOf(m.model.namespace_, pod, now, m.model.spec.tensor, mem, to_look);
    v.node_cordoned = !v.node.empty() && is_cordoned(v.node);
    seen.insert(v.name);
    // Created by us but seen here before the informer delivered the creation: now seen.
    if (auto it = mem.created.find(v.name); it != mem.created.end()) mem.created.erase(it);
    if (auto it = mem.deleted.find(v.uid); it != mem.deleted.end()) {
      if (v.deleting || now > it->second + kMemoryTtl) {
        mem.deleted.erase(it);
      } else {
        v.deleting = true;  // our delete has not reached the cache yet
      }
    }
    out.push_back(std::move(v));
  }
  for (auto it = mem.created.begin(); it != mem.created.end();) {
    if (now > it->second.second + kMemoryTtl) {
      it = mem.created.erase(it);
    } else {
      out.push_back(it->second.first);
      ++it;
    }
  }
  return out;
}

PlacementOutcome Controller::Place(const ModelView& m, const Decision& d, std::vector<json>& pods) {
  const ShardedModelSpec& spec = m.model.spec;
  PlacementOutcome outcome;
  absl::MutexLock lock(&place_mu_);
  // Reserved now, so the next placement (any worker) sees these GPUs taken.
  auto reserve = [&](json pod) {
    ledger_.Set(absl::StrCat(m.model.namespace_, "/", pod["metadata"]["name"].get<std::string>()),
                GpuLedger::UsageOf(pod));
    pods.push_back(std::move(pod));
  };
  // Stages of an interrupted creation keep the GPUs of their plan, before anything new is placed.
  for (const StageCreate& c : d.creates) reserve(BuildStagePod(m, c.replica, c.stage, c.nodes));
  if (d.place.empty()) return outcome;
  const std::vector<int64_t>& replicas = d.place;
  const std::map<std::string, int64_t> requested = ledger_.Requested(spec.gpu_resource);
  std::vector<NodeInfo> nodes = Nodes(spec.gpu_resource);
  for (NodeInfo& n : nodes) {
    if (auto it = requested.find(n.name); it != requested.end()) n.requested = it->second;
  }
  auto result = PlaceReplicas(m.memory ? MemoryAwareRequest(spec, *m.memory, replicas)
                                       : PlacementRequestFor(spec, replicas),
                              std::move(nodes));
  if (!result.ok()) {
    for (int64_t r : replicas) outcome.unplaced[r] = std::string(result.status().message());
    return outcome;
  }
  outcome.unplaced = result->unplaced;
  for (const ReplicaPlacement& p : result->placed) {
    outcome.placed[p.replica] = p.nodes;
    for (int64_t s = 0; s < spec.pipeline; ++s) reserve(BuildStagePod(m, p.replica, s, p.nodes));
  }
  return outcome;
}

absl::StatusOr<SpecPlan> Controller::PlanModel(const ModelView& m, const json& old_status) {
  ShardedModelSpec spec = m.model.spec;
  // Sizes chosen for this revision stay while it does: a node that comes or goes does not roll
  // the replicas.
  const json& plan = old_status.is_object() ? old_status.value("plan", json::object()) : json();
  if ((spec.tensor_auto || spec.pipeline_auto) && plan.is_object() &&
      plan.value("auto", "") == m.revision && plan.value("tensor", int64_t{0}) >= 1 &&
      plan.value("pipeline", int64_t{0}) >= 1) {
    spec.tensor = plan.value("tensor", int64_t{1});
    spec.pipeline = plan.value("pipeline", int64_t{1});
    spec.tensor_auto = spec.pipeline_auto = false;
  }
  return PlanSpec(*m.footprint, spec, Nodes(spec.gpu_resource));
}

bool Controller::RoutersReady(const ModelView& m) {
  for (const json& pod : pods_->store().ByLabel(kModelLabel, m.model.name)) {
    if (pod["metadata"].value("namespace", "") != m.model.namespace_ ||
        pod["metadata"]["labels"].value(kRoleLabel, "") != kRouterRole ||
        pod["metadata"].contains("deletionTimestamp")) {
      continue;
    }
    for (const json& c : pod.value("status", json::object()).value("conditions", json::array())) {
      if (c.value("type", "") == "Ready" && c.value("status", "") == "True") return true;
    }
  }
  return false;
}

absl::Status Controller::EnsureChildren(const ModelView& m, Memory& mem) {
  // The model's Service goes to its routers once one is ready (several replicas), else to its
  // leaders: scaling up, or routers that are all down, never leave it without endpoints.
  std::vector<std::pair<const k8s::ResourceType*, json>> children = {
      {&kServices, BuildWorkersService(m)},
      {&kServices, BuildLeaderService(m, Routed(m) && RoutersReady(m))},
      {&kServices, BuildLeadersService(m)}};
  // A prefill role is routed by its decode role's routers.
  if (m.kv_role != "prefill") children.push_back({&k8s::kDeployments, BuildRouterDeployment(m)});
  if (options_.network_policies)
    children.push_back({&k8s::kNetworkPolicies, BuildNetworkPolicy(m)});
  // A disaggregated model's prefill role: a ShardedModel it owns (its own replicas, placement,
  // rollout and scale subresource); gone when the model is no longer disaggregated.
  const std::string prefill_key =
      absl::StrCat(m.model.namespace_, "/", PrefillModelName(m.model.name));
  const std::optional<json> prefill = models_->store().Get(prefill_key);
  if (m.kv_role == "decode") {
    const std::optional<json> self =
        models_->store().Get(absl::StrCat(m.model.namespace_, "/", m.model.name));
    if (!self) return absl::OkStatus();  // deleted meanwhile: the GC takes the rest
    children.push_back(
        {&kShardedModels, BuildPrefillModel(m, *self, prefill ? &*prefill : nullptr)});
  } else if (prefill && m.kv_role.empty()) {
    const json& meta = (*prefill)["metadata"];
    for (const json& o : meta.value("ownerReferences", json::array())) {
      if (o.value("uid", "") != m.uid || !o.value("controller", false)) continue;
      absl::Status s = client_->Delete(kShardedModels, m.model.namespace_, meta.value("name", ""),
                                       meta.value("uid", ""));
      if (!s.ok() && !k8s::ApiConflict(s)) {
        return absl::Status(
            s.code(), absl::StrCat("deleting the prefill role ", prefill_key, ": ", s.message()));
      }
    }
  }
  for (auto& [type, obj] : children) {
    const std::string hash = ObjectHash(obj);
    obj["metadata"]["annotations"]["shardserve.io/spec-hash"] = hash;
    const std::string name = obj["metadata"]["name"];
    const std::string key = absl::StrCat(m.model.namespace_, "/", name);
    const std::string memo = type->plural + "/" + name;
    // Services and ShardedModels are watched: one deleted by hand is made again. A NetworkPolicy
    // or a Deployment is written once per change of this process's wish.
    const bool watched = type == &kServices || type == &kShardedModels;
    std::optional<json> cached;
    if (type == &kServices) cached = services_->store().Get(key);
    if (type == &kShardedModels) cached = prefill;
    const std::string have = cached ? (*cached)["metadata"]
                                          .value("annotations", json::object())
                                          .value("shardserve.io/spec-hash", "")
                             : watched ? ""
                                       : mem.children[memo];
    if (have == hash) continue;
    // A new object is created (cheaper than an apply); one that drifted is applied over.
    absl::StatusOr<json> written = cached ? client_->Apply(*type, m.model.namespace_, obj)
                                          : client_->Create(*type, m.model.namespace_, obj);
    if (!written.ok() && k8s::ApiAlreadyExists(written.status())) {
      written = client_->Apply(*type, m.model.namespace_, obj);
    }
    if (!written.ok()) {
      return absl::Status(written.status().code(), absl::StrCat("writing ", type->kind, " ", key,
                                                                ": ", written.status().message()));
    }
    mem.children[memo] = hash;
  }
  return absl::OkStatus();
}

Controller::Writes Controller::Reconcile(const std::string& key, absl::Duration& requeue_after) {
  requeue_after = absl::InfiniteDuration();
  std::optional<json> object = models_->store().Get(key);
  if (!object) {
    Forget(key);
    return Writes();
  }
  const json& meta = (*object)["metadata"];
  if (meta.contains("deletionTimestamp")) return Writes();  // the GC takes the children
  const std::string uid = meta.value("uid", "");
  const int64_t generation = meta.value("generation", int64_t{0});
  const absl::Time now = absl::Now();

  // A key is reconciled, and its writes carried out, by one thread at a time, so `mem`, this
  // key's, is used without the lock (the map's nodes stay where they are).
  Memory* mem_ptr;
  json old_status;
  {
    absl::MutexLock lock(&mu_);
    Memory& m = memory_[key];
    if (m.uid != uid) {
      m = Memory();
      m.uid = uid;
    }
    old_status = !m.status.is_null() ? m.status : object->value("status", json::object());
    mem_ptr = &m;
  }
  Memory& mem = *mem_ptr;

  Pass pass;
  auto view = ReadModel(*object, options_.defaults, options_.policy);
  if (!view.ok()) {
    pass.status = InvalidStatus(generation, std::string(view.status().message()), old_status, now,
                                pass.events);
  } else {
    pass = Assess(key, *std::move(view), generation, old_status, mem, now);
  }
  {
    absl::MutexLock l(&mu_);
    if (pass.waiting) {
      waiting_.insert(key);
    } else {
      waiting_.erase(key);
    }
  }
  requeue_after = pass.requeue_after;
  // The looks of the pods read: theirs only are kept.
  std::set<std::string> read;
  for (const PodView& p : pass.pods) read.insert(p.uid);
  if (pass.inspect_pod) read.insert(pass.inspect_pod->uid);
  for (auto it = mem.looks.begin(); it != mem.looks.end();) {
    it = read.count(it->first) ? std::next(it) : mem.looks.erase(it);
  }
  return [this, key, object = *std::move(object), pass = std::move(pass), &mem, now] {
    return CarryOut(key, object, pass, mem, now);
  };
}

absl::Status Controller::CarryOut(const std::string& key, const json& object, const Pass& pass,
                                  Memory& mem, absl::Time now) {
  // The status goes first: it records the plan of each replica being created (so creation
  // interrupted by a crash is completed, not taken for a failure) and restart counts before
  // the pods go. With it go the inspect pod's change, the secrets the new pods mount, and the
  // pods' looks to ask again.
  std::vector<Writes> first = {[&] { return WriteStatus(object, mem, pass.status); }};
  const std::string ns = object["metadata"].value("namespace", "");
  std::vector<Look> answers(pass.to_look.size());
  for (size_t i = 0; i < answers.size(); ++i) {
    first.push_back([&, i] {
      answers[i] = Ask(ns, pass.to_look[i]);
      return absl::OkStatus();
    });
  }
  if (pass.model) {
    first.push_back([&] { return Inspect(*pass.model, pass.shape, pass.inspect_pod); });
  }
  absl::Status done = absl::OkStatus();
  if (pass.decision) {
    absl::StatusOr<std::vector<Writes>> secrets = Secrets(*pass.model, pass.to_create, mem);
    if (secrets.ok()) {
      first.insert(first.end(), secrets->begin(), secrets->end());
    } else {
      done = secrets.status();
    }
  }
  if (done.ok()) done = AllOf(first);
  bool news = false;
  for (size_t i = 0; i < answers.size(); ++i) {
    if (answers[i].kind == Look::Kind::kNone) continue;  // not asked (an error before)
    Look& kept = mem.looks[pass.to_look[i].pod.uid];
    Look seen;  // what the pass saw
    seen.kind = answers[i].kind;
    if (kept.kind == seen.kind) seen = kept;
    news = news || !seen.SameNews(answers[i]);
    kept = std::move(answers[i]);
  }
  if (news) queue_.Add(key);  // taken again once these writes are done
  if (done.ok() && pass.decision) {
    done = Act(*pass.model, *pass.decision, pass.to_create, pass.pods, mem, now);
  }
  if (!done.ok()) {  // the GPUs reserved for pods not created go back
    for (const json& p : pass.to_create) {
      const std::string n = p["metadata"]["name"];
      if (!mem.created.count(n)) {
        ledger_.Remove(absl::StrCat(pass.model->model.namespace_, "/", n));
      }
    }
    return done;
  }
  for (const Event& e : pass.events) recorder_.Record(object, e);
  return absl::OkStatus();
}

Controller::Pass Controller::Assess(const std::string& key, ModelView m, int64_t generation,
                                    const json& old_status, Memory& mem, absl::Time now) {
  Pass pass;
  // The model's shape, then the layer split (computed here, once, for every rank).
  // One inspection per source (InspectionKey) in a namespace: this model's status, another's,
  // or the inspect pod every model of the key waits on.
  const std::string& ns = m.model.namespace_;
  const std::string inspection = InspectionKey(m);
  if (std::optional<json> pod =
          pods_->store().Get(absl::StrCat(ns, "/", InspectPodName(inspection)))) {
    pass.inspect_pod = ReadPodOf(ns, *pod, now, 0, mem, pass.to_look);
  }
  const json own = old_status.is_object() ? old_status.value("model", json()) : json();
  std::optional<json> shared;
  if (!own.is_object() || own.value("uri", "") != m.model.spec.model_uri ||
      own.value("inspection", inspection) != inspection) {
    shared = SharedInspection(ns, inspection);
  }
  pass.shape =
      ReadShape(m.model.spec.model_uri, inspection, old_status, shared ? &*shared : nullptr,
                pass.inspect_pod ? &*pass.inspect_pod : nullptr);
  const ShapeView& shape = pass.shape;
  std::string unplannable;
  if (shape.state == ShapeView::State::kKnown) {
    m.footprint = shape.footprint;
    m.source = shape.source;
    m.inspection = inspection;
    {
      absl::MutexLock l(&mu_);
      inspections_[absl::StrCat(ns, "/", inspection)] =
          ModelStatus(m.model.spec.model_uri, inspection, *m.footprint, m.source);
    }
    auto plan = PlanModel(m, old_status);
    if (plan.ok()) {
      m.stage_layers = plan->choice.layers;
      SetParallelism(m, plan->choice.tensor, plan->choice.pipeline);
      m.memory = *std::move(plan);
    } else {
      unplannable = std::string(plan.status().message());
    }
  } else if (shape.state == ShapeView::State::kFailed) {
    unplannable = absl::StrCat("spec.model.uri '", m.model.spec.model_uri, "': ", shape.message);
  }
  if (!unplannable.empty()) {  // the replicas that run keep running, as for an invalid spec
    pass.status = InvalidStatus(generation, unplannable, old_status, now, pass.events);
    if (m.footprint) {
      pass.status["model"] =
          ModelStatus(m.model.spec.model_uri, m.inspection, *m.footprint, m.source);
    } else {
      pass.status.erase("model");  // of an earlier uri
    }
    pass.model = std::move(m);
    return pass;
  }
  pass.pods = PodsOf(m, mem, now, pass.to_look);
  Decision d = Decide(m, pass.pods, old_status, now, options_.timing);
  PlacementOutcome outcome;
  if (shape.state == ShapeView::State::kKnown) {
    outcome = Place(m, d, pass.to_create);
  } else {
    WaitForShape(shape, d);  // no stage pod before its layers are known
    // A volume that cannot be mounted shows only in Events (MountFailure): look again.
    d.requeue_after = std::min(d.requeue_after, kMountGrace);
  }
  ApplyPlacement(outcome, m.revision, d);
  pass.waiting = !outcome.unplaced.empty();
  if (!outcome.unplaced.empty()) {
    d.requeue_after = std::min(d.requeue_after, options_.timing.placement_retry);
    for (size_t i = 0; i < outcome.unplaced.size(); ++i) {
      metrics_->AddPlacementFailure(key, "InsufficientGPUs");
    }
  }
  for (int64_t i = 0; i < d.replans; ++i) metrics_->AddPlacementFailure(key, "Unschedulable");
  if (d.restarts > 0) metrics_->AddRestarts(key, d.restarts);
  pass.status = BuildStatus(m, generation, d, outcome, old_status, now, pass.events);
  ApplyDownloads(pass.pods, m.model.spec.model_uri, old_status, pass.status, pass.events);
  // A download changes no object while it runs: look again for its progress.
  if (pass.status.contains("downloads")) d.requeue_after = std::min(d.requeue_after, kDownloadLook);
  pass.events.insert(pass.events.begin(), d.events.begin(), d.events.end());
  if (std::optional<Event> e = PlacedEvent(outcome, m.revision)) pass.events.push_back(*e);
  metrics_->SetReplicas(key, ReplicasByPhase(d));
  pass.requeue_after = d.requeue_after;
  pass.decision = std::move(d);
  pass.model = std::move(m);
  return pass;
}

std::optional<json> Controller::SharedInspection(const std::string& ns, const std::string& key) {
  const std::string at = absl::StrCat(ns, "/", key);
  {
    absl::MutexLock l(&mu_);
    if (auto it = inspections_.find(at); it != inspections_.end()) return it->second;
  }
  // Not seen since this operator started: a model's status may hold it (read once; a pass
  // that finds it remembers it).
  for (const json& other : models_->store().InNamespace(ns)) {
    const json model = other.value("status", json::object()).value("model", json());
    if (model.is_object() && model.value("inspection", "") == key) return model;
  }
  return std::nullopt;
}

absl::Status Controller::Inspect(const ModelView& m, const ShapeView& shape,
                                 const std::optional<PodView>& pod) {
  const std::string& ns = m.model.namespace_;
  if (shape.delete_pod && pod) RETURN_IF_ERROR(client_->Delete(kPods, ns, pod->name, pod->uid));
  if (shape.create_pod) {
    auto created = client_->Create(kPods, ns, BuildInspectPod(m));
    if (!created.ok() && !k8s::ApiAlreadyExists(created.status())) {
      return absl::Status(created.status().code(),
                          absl::StrCat("creating the pod that reads the model's shape: ",
                                       created.status().message()));
    }
  }
  return absl::OkStatus();
}

absl::Status Controller::WriteStatus(const json& object, Memory& mem, const json& status) {
  const json seen = object.value("status", json::object());
  if (status != mem.status && status != seen) {
    // What the server holds: the status read, and what this operator last wrote over it (the
    // cache may not have it yet). A member no longer wanted (a node's download done) is nulled.
    json held = seen;
    if (mem.status.is_object()) held.merge_patch(mem.status);
    const json& meta = object["metadata"];
    auto patched =
        client_->MergePatch(kShardedModels, meta.value("namespace", ""), meta.value("name", ""),
                            {{"status", k8s::MergePatchBetween(held, status)}}, "status");
    if (!patched.ok() && !k8s::ApiNotFound(patched.status())) {  // NotFound: deleted meanwhile
      return absl::Status(patched.status().code(),
                          absl::StrCat("writing status: ", patched.status().message()));
    }
  }
  mem.status = status;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<Controller::Writes>> Controller::Secrets(
    const ModelView& m, const std::vector<json>& to_create, Memory& mem) {
  // A replica's pods mount its rendezvous secret: it is created before they are (only when a
  // replica's pods are, so rarely), never read back (RBAC: create only); one that exists is kept.
  std::set<int64_t> replicas;
  for (const json& pod : to_create) {
    int64_t r;
    if (absl::SimpleAtoi(pod["metadata"]["labels"].value(kReplicaLabel, ""), &r))
      replicas.insert(r);
  }
  // The token the routers prove to the leaders' KV events: before any leader or router mounts
  // it, once per model (kept, as the rendezvous secrets are); a prefill role mounts its decode
  // role's.
  const std::string token_memo = "secrets/" + RouterTokenSecretName(m.model.name);
  struct Secret {
    json object;
    std::string what;  // for an error
    bool token = false;
  };
  std::vector<Secret> secrets;
  if (m.kv_role != "prefill" && mem.children[token_memo].empty()) {
    absl::StatusOr<std::string> value = NewSecretValue();
    if (!value.ok()) return value.status();
    secrets.push_back({BuildRouterTokenSecret(m, *value), "the router token", true});
  }
  for (int64_t r : replicas) {
    absl::StatusOr<std::string> value = NewSecretValue();
    if (!value.ok()) return value.status();
    secrets.push_back({BuildRendezvousSecret(m, r, *value),
                       absl::StrCat("the rendezvous secret of replica ", r)});
  }
  std::vector<Writes> writes;
  for (Secret& secret : secrets) {
    writes.push_back([this, &m, &mem, token_memo, secret = std::move(secret)] {
      auto created = client_->Create(k8s::kSecrets, m.model.namespace_, secret.object);
      if (!created.ok() && !k8s::ApiAlreadyExists(created.status())) {
        return absl::Status(created.status().code(), absl::StrCat("creating ", secret.what, ": ",
                                                                  created.status().message()));
      }
      // The pass's other first writes leave mem.children alone.
      if (secret.token) mem.children[token_memo] = "created";
      return absl::OkStatus();
    });
  }
  return writes;
}

absl::Status Controller::Act(const ModelView& m, const Decision& d,
                             const std::vector<json>& to_create, const std::vector<PodView>& pods,
                             Memory& mem, absl::Time now) {
  // The writes of one pass are independent: services, deletions and creations go out together
  // (as client-go's controllers create a gang of pods in parallel), at most kParallelWrites at
  // once; the client's rate limit still applies to each.
  const size_t n_deletes = d.deletes.size();
  const size_t n = 1 + n_deletes + to_create.size();
  std::vector<absl::Status> results(n);
  std::vector<std::optional<PodView>> created(to_create.size());
  for (const PodRef& p : d.deletes) mem.deleted[p.uid] = now;
  ForEachParallel(n, [&](size_t i) {
    if (i == 0) {
      results[i] = EnsureChildren(m, mem);
    } else if (i <= n_deletes) {
      const PodRef& p = d.deletes[i - 1];
      absl::Status s = client_->Delete(kPods, m.model.namespace_, p.name, p.uid);
      if (!s.ok() && !k8s::ApiConflict(s)) {
        results[i] =
            absl::Status(s.code(), absl::StrCat("deleting pod ", p.name, ": ", s.message()));
      }
    } else {
      const json& pod = to_create[i - 1 - n_deletes];
      auto r = client_->Create(kPods, m.model.namespace_, pod);
      if (r.ok()) {
        json slim = *r;
        SlimPod(slim);
        created[i - 1 - n_deletes] = ReadPod(slim);
      } else if (!k8s::ApiAlreadyExists(r.status())) {
        results[i] = absl::Status(r.status().code(),
                                  absl::StrCat("creating pod ", pod["metadata"].value("name", ""),
                                               ": ", r.status().message()));
      }
    }
  });
  for (size_t i = 0; i < n_deletes; ++i) {
    if (!results[1 + i].ok()) mem.deleted.erase(d.deletes[i].uid);
  }
  for (const auto& v : created) {
    if (v) mem.created[v->name] = {*v, now};
  }
  for (const absl::Status& s : results) RETURN_IF_ERROR(s);
  if (!options_.disruption_budgets) return absl::OkStatus();
  std::vector<PodView> leaders;
  for (const PodView& p : pods) {
    if (p.stage == 0 && !p.deleting && !p.uid.empty()) leaders.push_back(p);
  }
  for (const auto& v : created) {
    if (v && v->stage == 0) leaders.push_back(*v);
  }
  std::set<std::string> current;  // the pods gone are forgotten
  for (const PodView& p : leaders) current.insert(p.uid);
  for (auto it = mem.budgeted.begin(); it != mem.budgeted.end();) {
    it = current.count(*it) ? std::next(it) : mem.budgeted.erase(it);
  }
  std::vector<const PodView*> unbudgeted;
  for (const PodView& p : leaders) {
    if (!mem.budgeted.count(p.uid)) unbudgeted.push_back(&p);
  }
  std::vector<absl::Status> budgets(unbudgeted.size());
  ForEachParallel(unbudgeted.size(), [&](size_t i) {
    const PodView& p = *unbudgeted[i];
    auto made = client_->Create(k8s::kPodDisruptionBudgets, m.model.namespace_,
                                BuildDisruptionBudget(m, p.replica, p.name, p.uid));
    if (!made.ok() && !k8s::ApiAlreadyExists(made.status())) {
      budgets[i] = absl::Status(made.status().code(),
                                absl::StrCat("creating the disruption budget of replica ",
                                             p.replica, ": ", made.status().message()));
    }
  });
  for (size_t i = 0; i < unbudgeted.size(); ++i) {
    if (budgets[i].ok()) mem.budgeted.insert(unbudgeted[i]->uid);
  }
  for (const absl::Status& st : budgets) RETURN_IF_ERROR(st);
  return absl::OkStatus();
}

}  // namespace shardserve::op
