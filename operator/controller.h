#pragma once
// The ShardedModel controller: informers on ShardedModels, Pods, Nodes and Services feed a work
// queue of model keys ("namespace/name"); worker threads reconcile a key at a time (never one key
// twice at once). A reconcile (a pass) re-reads the world from the caches, decides
// (operator/reconcile.h) and places replicas against a GPU ledger shared by every worker; its
// writes are then carried out by a writer thread while the worker takes the next key: status
// merge-patched only when it changed (with the secrets new pods mount and the inspect pod), then
// pods created (never applied over), pods deleted with a uid precondition, Services (and
// NetworkPolicies) created or applied server-side, then disruption budgets; Events are posted
// off both paths by an EventRecorder. The key stays taken until its writes are done, so a pass
// never sees the world before its predecessor's writes: an event meanwhile queues the key again.
// An apiserver slow to answer (its own p99 for one write is hundreds of milliseconds on a busy
// control plane) so holds up that model's writes, not every model's decisions.
//
// Between a write and the informer seeing it the controller remembers what it did (pods it
// created, pods it deleted, the status it wrote), so a quick second reconcile neither places a
// replica twice nor counts a failure twice. Errors requeue the key with backoff; a spec the
// operator cannot act on is a condition, not a retry loop.
#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "k8s/client.h"
#include "k8s/informer.h"
#include "k8s/workqueue.h"
#include "operator/event_recorder.h"
#include "operator/operator_metrics.h"
#include "operator/reconcile.h"
#include "plan/placement.h"

namespace shardserve::op {

struct ControllerOptions {
  std::string namespace_;  // ShardedModels of this namespace only; "" = all
  int concurrency = 4;     // worker threads; as many writer threads carry out their writes
  Timing timing;
  WorkerDefaults defaults;         // applied to every worker pod
  ModelPolicy policy;              // what a model may ask for (host paths, images)
  bool network_policies = false;   // a NetworkPolicy per model
  bool disruption_budgets = true;  // a PodDisruptionBudget per replica gang
};

// GPUs (any extended resource, "vendor/name") held per node by pods: bound pods count on their
// node, our unbound pods on their planned node. Thread-safe.
class GpuLedger {
 public:
  struct Usage {
    std::string node;
    std::map<std::string, int64_t> resources;
  };
  static Usage UsageOf(const json& pod);  // empty node: holds nothing
  void Set(const std::string& pod_key, Usage usage);
  void Remove(const std::string& pod_key);
  std::map<std::string, int64_t> Requested(const std::string& resource) const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, Usage> pods_ ABSL_GUARDED_BY(mu_);
};

class Controller {
 public:
  Controller(k8s::Client* client, ControllerOptions options, OperatorMetrics* metrics);
  ~Controller();

  // Starts the informers and waits for their caches (error if they do not fill within
  // `sync_timeout`). Events queue keys from then on; a standby keeps its caches warm this way.
  absl::Status StartCaches(std::chrono::milliseconds sync_timeout);
  // Starts the workers that reconcile the queued keys (once leading).
  void StartWorkers();
  void Stop();
  bool synced() const { return synced_.load(); }
  // Objects and bytes of each informer cache, by resource.
  std::map<std::string, std::pair<double, double>> CacheSizes() const;

 private:
  // What a pod not ready says of itself, when last asked: its kubelet's events while its
  // containers are being created, its fetch step's /startupz, or its ranks' /startupz. A pass reads
  // the memory of it; asking (network reads, bounded in time) is done with the pass's writes,
  // and an answer that changes what a pass saw looks at the model again.
  struct Look {
    enum class Kind { kNone, kEvents, kFetch, kRanks };
    Kind kind = Kind::kNone;
    absl::Time at = absl::InfinitePast();
    // kEvents: why its volumes cannot be mounted (its latest FailedMount), and whether an image
    // pull is under way (a Pulling event not yet followed by Pulled).
    std::string mount_failure;
    bool pulling = false;
    // kFetch, kRanks: the pod's startup line ("" before an answer), the fetch step's download.
    std::string startup;
    std::optional<PodView::Download> download;
    // The same news (a download's progress aside, which the pass asks for on its own clock).
    bool SameNews(const Look& o) const {
      return kind == o.kind && mount_failure == o.mount_failure && pulling == o.pulling &&
             startup == o.startup && download.has_value() == o.download.has_value();
    }
  };
  // A pod to ask (the `tensor` ranks of a running one), found by a pass.
  struct ToLook {
    PodView pod;
    Look::Kind kind;
    int64_t tensor;
  };
  struct Memory {  // what this controller did that the caches may not show yet
    std::string uid;
    std::map<std::string, std::pair<PodView, absl::Time>> created;  // pod name
    std::map<std::string, absl::Time> deleted;                      // pod uid
    json status;                                                    // as last written
    std::map<std::string, std::string> children;                    // "plural/name" -> hash written
    std::set<std::string> budgeted;     // leader pod uids whose disruption budget exists
    std::map<std::string, Look> looks;  // by pod uid, the model's pods' only
  };

  // One pass's findings: the status to write, its Events, and what to carry out once the status
  // is written; CarryOut writes, carries out and records them in one place.
  struct Pass {
    json status;
    std::vector<Event> events;
    bool waiting = false;            // replicas wait for GPUs (EnqueueWaiting looks again)
    std::optional<ModelView> model;  // a valid spec: the inspect pod's part of `shape` is done
    ShapeView shape;
    std::optional<PodView> inspect_pod;
    std::optional<Decision> decision;  // decided: what Act carries out
    std::vector<json> to_create;       // the pods placed (their GPUs reserved)
    std::vector<PodView> pods;         // the model's pods as read
    std::vector<ToLook> to_look;       // pods whose look is to be asked again
    absl::Duration requeue_after = absl::InfiniteDuration();
  };
  // The pass for a valid spec: the model's shape and memory plan (or why there is none: an
  // Invalid status, the running replicas left alone), the decision and its placement, the
  // status that describes them.
  Pass Assess(const std::string& key, ModelView m, int64_t generation, const json& old_status,
              Memory& mem, absl::Time now);

  // A pass's writes, carried out after it.
  using Writes = std::function<absl::Status()>;
  // One pass for one model up to its writes; `requeue_after` is when to look again without an
  // event. No writes: the model is gone or being deleted.
  Writes Reconcile(const std::string& key, absl::Duration& requeue_after);
  // Carries a pass's writes out, in the order above; the GPUs reserved for pods not created go
  // back on an error.
  absl::Status CarryOut(const std::string& key, const json& object, const Pass& pass, Memory& mem,
                        absl::Time now);
  // A pass of `key` (and its writes) ended: metrics, a requeue or backoff, and the key free again.
  void Finish(const std::string& key, const absl::Status& s, absl::Duration requeue,
              double pass_seconds);

  void Worker();
  void Writer();  // runs the writes handed over by workers, in order
  void Enqueue(const std::string& key);
  void EnqueueWaiting();
  // The models with a pod on `node` (changed: cordoned, say) are looked at again.
  void EnqueueOnNode(const json& node);
  // The look a pod wants (kNone: a ready, deleting or pending pod).
  static Look::Kind LookKindOf(const PodView& v, int64_t tensor);
  // Asks a pod (nothing when it cannot be asked: an empty look of that kind).
  Look Ask(const std::string& ns, const ToLook& t);
  Look EventsOf(const std::string& ns, const PodView& pod);       // kEvents
  Look FetchProgress(const PodView& pod);                         // kFetch
  std::string RanksStarting(const PodView& pod, int64_t tensor);  // kRanks: the startup line
  // ReadPod, and for a pod that is not ready, what holds it (its look, remembered in `mem`;
  // `to_look` gets it when none is fresh): for one whose volumes stay unmounted past a grace
  // period, why (stuck); otherwise what it is doing (startup), from its events or its ranks
  // (`tensor` of them; 0: ask none).
  PodView ReadPodOf(const std::string& ns, const json& pod, absl::Time now, int64_t tensor,
                    Memory& mem, std::vector<ToLook>& to_look);
  std::vector<PodView> PodsOf(const ModelView& m, Memory& mem, absl::Time now,
                              std::vector<ToLook>& to_look);
  // Under one lock for every worker: reserves the GPUs of `d.creates`, then plans `d.place`
  // against the ledger and reserves what it placed. `pods` gets every pod to create.
  PlacementOutcome Place(const ModelView& m, const Decision& d, std::vector<json>& pods);
  // Another model's status.model of inspection `key` in `ns` (remembered, else looked for in the
  // models' cache), or none.
  std::optional<json> SharedInspection(const std::string& ns, const std::string& key);
  // The inspect pod's part of `shape`: created for a new uri, deleted once read (or stale).
  absl::Status Inspect(const ModelView& m, const ShapeView& shape,
                       const std::optional<PodView>& pod);
  // Merge-patches status when it differs from what was last written (or is cached).
  absl::Status WriteStatus(const json& object, Memory& mem, const json& status);
  // The secrets a decision's new pods mount (the model's router token once, the rendezvous secret
  // of each replica being created), each a write to carry out before the pods go.
  absl::StatusOr<std::vector<Writes>> Secrets(const ModelView& m,
                                              const std::vector<json>& to_create, Memory& mem);
  // Carries a decision out: services, deletions (remembered), creations (remembered), then a
  // disruption budget for every leader pod (`pods`, and those just created) that has none yet.
  absl::Status Act(const ModelView& m, const Decision& d, const std::vector<json>& to_create,
                   const std::vector<PodView>& pods, Memory& mem, absl::Time now);
  // The model's Services (and NetworkPolicy, when enabled), written when missing or drifted.
  // A router pod of the model is ready (the Service may go to the routers).
  bool RoutersReady(const ModelView& m);
  absl::Status EnsureChildren(const ModelView& m, Memory& mem);
  // Nodes as placement reads them for `resource`, kept current by the node informer.
  std::vector<NodeInfo> Nodes(const std::string& resource);
  // The memory plan of m (its footprint known): the sizes it fixes, or those chosen for auto (kept
  // from old_status while the revision they were chosen for stays).
  absl::StatusOr<SpecPlan> PlanModel(const ModelView& m, const json& old_status);
  void UpdateNode(const json* node, const json* gone);
  void Forget(const std::string& key);

  k8s::Client* client_;
  ControllerOptions options_;
  OperatorMetrics* metrics_;
  k8s::WorkQueue queue_;
  std::unique_ptr<k8s::Informer> models_, pods_, nodes_, services_;
  EventRecorder recorder_;
  GpuLedger ledger_;
  absl::Mutex nodes_mu_;
  // by resource, name
  std::map<std::string, std::map<std::string, NodeInfo>> node_infos_ ABSL_GUARDED_BY(nodes_mu_);
  absl::Mutex place_mu_;  // one placement at a time: plan, then reserve in the ledger
  absl::Mutex mu_;
  std::map<std::string, Memory> memory_ ABSL_GUARDED_BY(mu_);  // by model key
  std::set<std::string> waiting_ ABSL_GUARDED_BY(mu_);  // models with replicas that did not fit
  // Inspections done (status.model of some model), by namespace/InspectionKey: a model of the
  // same key takes it without an inspect pod of its own (SharedInspection).
  std::map<std::string, json> inspections_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> workers_;
  absl::Mutex writes_mu_;
  std::deque<std::function<void()>> writes_ ABSL_GUARDED_BY(writes_mu_);  // at most one a key
  bool writers_stop_ ABSL_GUARDED_BY(writes_mu_) = false;
  std::vector<std::thread> writers_;
  std::atomic<bool> synced_{false};
  std::atomic<bool> stopped_{false};
};

}  // namespace shardserve::op
