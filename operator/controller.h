#pragma once
// The ShardedModel controller: informers on ShardedModels, Pods, Nodes and Services feed a work
// queue of model keys ("namespace/name"); worker threads reconcile a key at a time (never one key
// twice at once). A reconcile re-reads the world from the caches, decides (operator/reconcile.h),
// places replicas against a GPU ledger shared by every worker, and writes through one writer:
// pods created (never applied over), pods deleted with a uid precondition, Services (and
// NetworkPolicies) created or applied server-side, status merge-patched only when it changed, and
// Events (posted off the reconcile path by an EventRecorder).
//
// Between a write and the informer seeing it the controller remembers what it did (pods it
// created, pods it deleted, the status it wrote), so a quick second reconcile neither places a
// replica twice nor counts a failure twice. Errors requeue the key with backoff; a spec the
// operator cannot act on is a condition, not a retry loop.
#include <atomic>
#include <chrono>
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
  int concurrency = 4;     // worker threads
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

  // One pass for one model; `requeue_after` is when to look again without an event.
  absl::Status Reconcile(const std::string& key, absl::Duration& requeue_after);

 private:
  struct Memory {  // what this controller did that the caches may not show yet
    std::string uid;
    std::map<std::string, std::pair<PodView, absl::Time>> created;  // pod name
    std::map<std::string, absl::Time> deleted;                      // pod uid
    json status;                                                    // as last written
    std::map<std::string, std::string> children;                    // "plural/name" -> hash written
    std::set<std::string> budgeted;  // leader pod uids whose disruption budget exists
  };

  // One pass's findings: the status to write, its Events, and what to carry out once the status
  // is written; Reconcile writes, carries out and records them in one place.
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
    absl::Duration requeue_after = absl::InfiniteDuration();
  };
  // The pass for a valid spec: the model's shape and memory plan (or why there is none: an
  // Invalid status, the running replicas left alone), the decision and its placement, the
  // status that describes them.
  Pass Assess(const std::string& key, ModelView m, int64_t generation, const json& old_status,
              Memory& mem, absl::Time now);

  void Worker();
  void Enqueue(const std::string& key);
  void EnqueueWaiting();
  // The models with a pod on `node` (changed: cordoned, say) are looked at again.
  void EnqueueOnNode(const json& node);
  std::vector<PodView> PodsOf(const ModelView& m, Memory& mem, absl::Time now);
  // What a pod's kubelet says of it while its containers are being created: why its volumes
  // cannot be mounted (its latest FailedMount), and whether an image pull is under way (a
  // Pulling event not yet followed by Pulled). Nothing when the events cannot be read.
  struct KubeletNews {
    std::string mount_failure;
    bool pulling = false;
  };
  KubeletNews EventsOf(const std::string& ns, const PodView& pod);
  // What the `tensor` ranks of a running pod that is not ready say they are doing (each rank's
  // /startupz, bounded in time and size), as the replica's status quotes it.
  // What a pod's fetch step says (its /startupz): into its startup line and its download.
  void FetchProgress(PodView& pod);
  std::string RanksStarting(const PodView& pod, int64_t tensor);
  // ReadPod, and for a pod that is not ready, what holds it: for one whose volumes stay
  // unmounted past a grace period, why (stuck); otherwise what it is doing (startup), from its
  // events or its ranks (`tensor` of them; 0: ask none).
  PodView ReadPodOf(const std::string& ns, const json& pod, absl::Time now, int64_t tensor);
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
  // Carries a decision out: the rendezvous secret of each replica being created, services,
  // deletions (remembered), creations (remembered), then a disruption budget for every leader
  // pod (`pods`, and those just created) that has none yet.
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
  std::atomic<bool> synced_{false};
  std::atomic<bool> stopped_{false};
};

}  // namespace shardserve::op
