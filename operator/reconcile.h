#pragma once
// The reconciler's decisions, pure (STYLE.md: level-triggered, by key): from a ShardedModel, its
// pods as the informer cache shows them, the status it wrote last time and the time, what to do
// now, and the status that describes it. No I/O; the controller reads the world, runs placement,
// and writes through one writer.
//
//   Decide()       pods to delete, pods to create (a replica whose creation was interrupted),
//                  replicas to place, each replica's phase, Events, when to look again
//   BuildStatus()  status.* with conditions Available / Progressing / Degraded / Placed / Invalid
//                  (transition times kept when a condition's status holds), and an Event per
//                  condition transition
//
// Rules (DESIGN.md §2-4):
//   - A replica is a gang: P pods <name>-<r>-<s>, created together on planned nodes; the plan is
//     kept on every pod (annotation shardserve.io/placement) so an interrupted creation is
//     completed on the same nodes.
//   - Scaling: indices >= spec.replicas are removed whole, highest index first.
//   - Failure (a pod Failed or Succeeded, a container restarted, a stage deleted or missing after
//     the replica started): RecreateReplica deletes the whole replica and places it again after
//     an exponential backoff (base, doubled per consecutive failure, capped; reset after a replica
//     ran `backoff_reset`); the restart count lives in status.replicaStatuses. None leaves it.
//   - Pods unschedulable for `unschedulable_timeout`: the replica is deleted and re-planned.
//   - Rollout: a replica whose pods carry another revision is outdated. Outdated replicas that
//     serve nothing go at once; serving ones go one by one, highest index first, while the ready
//     replicas stay >= spec.replicas - maxUnavailable; maxSurge places extra replicas at indices
//     >= spec.replicas while outdated ones remain, removed when every replica is updated and
//     ready. An index is placed again only once all its old pods are gone, so without surge the
//     rollout never needs more GPUs than the model holds. A newer change supersedes: anything not
//     at the newest revision is outdated.
//   - Drain: a replica with a pod on a cordoned node (spec.unschedulable, as `kubectl drain` or
//     `cordon` leaves it) is moved as an outdated one is: at once when it serves nothing, else
//     one at a time within maxUnavailable (its router moves its streams to the others: request
//     migration); placement leaves the node out. The PodDisruptionBudgets keep evictions from
//     taking a serving replica apart meanwhile.
#include <initializer_list>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "operator/builders.h"

namespace shardserve::op {

// A pod of a model, as the reconciler reads it.
struct PodView {
  std::string name, uid, owner_uid;
  int64_t replica = -1, stage = -1;
  std::string revision;
  std::vector<std::string> placement;  // the replica's planned node per stage
  std::string node;                    // spec.nodeName once bound
  std::string phase;                   // Pending, Running, Succeeded, Failed, Unknown
  bool ready = false;                  // condition Ready=True
  // Since when, while ready: the condition's lastTransitionTime (InfinitePast: not said).
  absl::Time ready_since = absl::InfinitePast();
  bool deleting = false;       // metadata.deletionTimestamp set
  bool unschedulable = false;  // PodScheduled=False, reason Unschedulable
  std::string unschedulable_message;
  bool node_cordoned = false;  // bound to a node marked unschedulable (cordoned, drained)
  bool started = false;        // has run: phase past Pending
  int64_t restarts = 0;        // container restarts
  std::string failure;         // why it failed ("" while it has not)
  std::string stuck;      // why it cannot start (its image, a volume), "" when nothing holds it
  bool creating = false;  // bound, its containers not yet created (volumes being mounted)
  bool fetching = false;  // its fetch step (a remote model into the node's cache) runs
  // What the fetch step says of the node's download (its /startupz): bytes, total, rate, ETA.
  struct Download {
    int64_t bytes = 0, total = 0;
    double rate = 0, eta = -1;
  };
  std::optional<Download> download;
  std::string model_uri;  // the inspect pod's: the uri it reads (kModelUriAnnotation)
  std::string report;     // the termination message of its (last) ended container
  std::string pod_ip;     // status.podIP
  std::string image;      // its container's
  // What it is doing while it is not ready ("stage 1: pulling image X", "stage 1 rank 3: loading
  // 41 %"): from its kubelet's events and its ranks' own account; "" when nothing says.
  std::string startup;
  absl::Time created = absl::InfinitePast();
};

PodView ReadPod(const json& pod);
// The keys of `from` (an object; else none) among `keys`.
json Pick(const json& from, std::initializer_list<const char*> keys);
// An extended resource (a name with a domain: nvidia.com/gpu), not cpu or memory.
bool Extended(const std::string& resource);
// A Pod cut in place to the fields the controller reads (ReadPod's and the placement's), as the
// informer caches every pod.
void SlimPod(json& pod);

// What the controller knows of the model's shape, the layer split's input (plan/layer_split.h).
// status.model keeps it with the uri it was read from; for a new uri, an inspect pod
// (BuildInspectPod) reads the model's files where the ranks will, and reports the shape as its
// termination message.
struct ShapeView {
  enum class State { kKnown, kReading, kFailed };
  State state = State::kReading;
  ModelFootprint footprint;  // kKnown: what the memory plan weighs, with the model's shape
  // kKnown, a remote model: the revision the inspect pod resolved and its cache directory
  std::optional<ModelView::Source> source;
  std::string message;      // kReading: what it waits on; kFailed: why
  bool blocked = false;     // kReading: the inspect pod cannot start (its image, its volume)
  bool create_pod = false;  // no inspect pod reads this uri: create one
  bool delete_pod = false;  // the inspect pod has done its work (or reads another uri)
};
// From status.model while it is of `uri` and of the inspection `key` (InspectionKey; a status
// that names none is an earlier operator's, of its uri), else from `shared` (another model's
// status.model of the same key; null: none), else from the inspect pod (null: none). A failed
// reading stays (its pod says why) until the uri changes or someone deletes the pod.
ShapeView ReadShape(const std::string& uri, const std::string& key, const json& status,
                    const json* shared, const PodView* inspect_pod);
// status.model: {"uri": ..., "inspection": key, "shape": {...}, "footprint": {...}, "source":
// {...}}; a remote model's source: {"revision", "dir", "bytes", "files"} (SourceFromJson checks
// what it reads back: the directory becomes a mount's subPath).
json ModelStatus(const std::string& uri, const std::string& key, const ModelFootprint& footprint,
                 const std::optional<ModelView::Source>& source);
std::optional<ModelView::Source> SourceFromJson(const json& j);

struct Timing {
  absl::Duration unschedulable_timeout = absl::Minutes(2);
  absl::Duration backoff_base = absl::Seconds(2);
  absl::Duration backoff_max = absl::Minutes(5);
  absl::Duration backoff_reset = absl::Minutes(10);
  absl::Duration placement_retry = absl::Seconds(30);
  // A ready replica counts as serving, for a rollout or a move to take another down, once every
  // pod of it has been Ready this long (a Deployment's minReadySeconds): a pod whose Ready
  // condition flaps just after it starts (seen in e2e.real_nodes: True, then False for a second)
  // must not let the last serving replica go.
  absl::Duration min_ready = absl::Seconds(5);
};

// The last non-empty line of a message (a container's termination message: the first failing
// rank's error, or with FallbackToLogsOnError the tail of its log), at most `max` bytes.
std::string LastLine(const std::string& message, size_t max = 300);

// kBlocked: a pod cannot start for a reason that does not pass by itself (its image cannot be
// pulled, a volume cannot be mounted); the replica is left as it is, its message says why.
enum class ReplicaPhase { kPending, kPlacing, kStarting, kReady, kFailed, kBlocked };
const char* PhaseName(ReplicaPhase p);

struct ReplicaState {
  int64_t index = 0;
  ReplicaPhase phase = ReplicaPhase::kPending;
  std::vector<std::string> nodes;
  std::string revision;
  std::string message;
  int64_t restarts = 0;
  absl::Time last_failure = absl::InfinitePast();
  std::string last_failure_message;  // why it last failed
  absl::Duration backoff = absl::ZeroDuration();
  bool exists = false;   // has pods that are not being deleted
  bool updated = false;  // every stage at the current revision
};

struct Event {
  std::string type;  // Normal | Warning
  std::string reason;
  std::string message;
};

struct PodRef {
  std::string name, uid;
};

struct StageCreate {
  int64_t replica = 0, stage = 0;
  std::vector<std::string> nodes;  // the replica's plan
};

struct Decision {
  std::vector<ReplicaState> replicas;  // by index: [0, spec.replicas) and surge replicas
  std::vector<PodRef> deletes;         // highest replica first
  std::vector<StageCreate> creates;    // stages missing from an interrupted creation
  std::vector<int64_t> place;          // replica indices to plan and create now
  std::vector<Event> events;
  std::string shape_wait;  // set by WaitForShape: why nothing is placed
  int64_t restarts = 0;    // replicas recreated after a failure in this pass
  int64_t replans = 0;     // replicas re-planned after staying unschedulable
  absl::Duration requeue_after = absl::InfiniteDuration();
};

Decision Decide(const ModelView& m, const std::vector<PodView>& pods, const json& status,
                absl::Time now, const Timing& timing);

// Decide's steps, each pure and each with its table test (reconcile_test.cc): Observe reads one
// index's pods, ReachOf says how far the replicas reach (surge), Judge gives one replica its
// phase and what to do about it, ToReplace picks the serving outdated replicas a rollout takes
// down now.
namespace decide {

// What the reconciler sees of one replica index.
struct Observed {
  int64_t index = 0;
  std::vector<const PodView*> pods;               // every pod, deleting ones included
  std::vector<const PodView*> live;               // not being deleted
  bool outdated = false;                          // a live pod at another revision
  bool ready = false;                             // every stage live, Running and Ready
  absl::Time ready_since = absl::InfinitePast();  // ready: since its last pod became Ready
  std::string failure;                            // why the replica failed
  std::string unschedulable;                      // a pod unschedulable past the timeout
  std::string waiting;                            // a pod unschedulable, not yet for that long
  std::string stuck;             // a pod that cannot start (image, volume, configuration)
  std::string starting;          // what its pods that are not ready are doing
  std::vector<int64_t> missing;  // stages without a live pod
  bool unbound = false;          // a live pod not yet bound to its node
  bool started = false;          // a pod of it has run
  std::string cordoned;          // the cordoned node a live pod of it runs on
};
// `creating`: the last status had the replica Placing, so stages missing without a trace of
// deletion are an interrupted creation, not a failure. `requeue` is lowered to when the pods
// should be looked at again (a deadline, progress that no watched object shows).
Observed Observe(int64_t index, const std::vector<const PodView*>& pods, bool creating,
                 const ModelView& m, absl::Time now, const Timing& timing, absl::Duration& requeue);

// Surge replicas (indices >= spec.replicas) are made while outdated replicas remain and kept
// until every replica is ready; `limit` is one past the highest index wanted.
struct Reach {
  bool surge = false;
  int64_t limit = 0;
};
Reach ReachOf(const std::map<int64_t, Observed>& obs, int64_t replicas, int64_t max_surge);

// One replica's state (from `record`, what the last status kept of it) and what to do about it.
struct Verdict {
  ReplicaState state;
  bool delete_live = false;            // delete its live pods
  bool place = false;                  // plan and create it
  std::vector<int64_t> create_stages;  // complete an interrupted creation on its plan
  bool outdated_serving = false;       // serves at an older revision: ToReplace decides
  bool cordoned_serving = false;       // serves on a cordoned node: ToReplace decides
  bool restart = false;                // recreated after a failure
  bool replan = false;                 // re-planned after staying unschedulable
  std::vector<Event> events;
  absl::Duration requeue_after = absl::InfiniteDuration();
};
Verdict Judge(const Observed& o, ReplicaState record, const ModelView& m, absl::Time now,
              const Timing& timing);

// Of the serving replicas at an older revision, those to take down now: highest index first,
// while at least `min_serving` of the `serving` replicas keep serving.
std::vector<int64_t> ToReplace(std::vector<int64_t> outdated_serving, int64_t serving,
                               int64_t min_serving);

}  // namespace decide

// What placement made of Decision::place.
struct PlacementOutcome {
  std::map<int64_t, std::vector<std::string>> placed;  // replica -> node per stage
  std::map<int64_t, std::string> unplaced;             // replica -> why
};

// While the model's shape is not known (a ShapeView that is kReading) nothing is placed or
// created: the replicas to place stay Pending, or Blocked when the inspect pod cannot start, and
// say why.
void WaitForShape(const ShapeView& shape, Decision& d);

// Folds the placement into the decision's replicas (Placing or Pending with the reason).
void ApplyPlacement(const PlacementOutcome& outcome, const std::string& revision, Decision& d);

// The Event of the replicas placed in this pass ("revision R: replica 0 on n1, n2; replica 1
// on ..."), none when none were.
std::optional<Event> PlacedEvent(const PlacementOutcome& outcome, const std::string& revision);
// status.downloads: each node where pods fetch the remote model `uri` (their fetch steps'
// /startupz), its bytes, total, rate and ETA; the phase Downloading while a download runs and
// nothing has failed; events Downloading and Downloaded as a node's download starts and ends.
void ApplyDownloads(const std::vector<PodView>& pods, const std::string& uri,
                    const json& old_status, json& status, std::vector<Event>& events);

// How many replicas are in each phase (by PhaseName), for the operator's metrics.
std::map<std::string, int64_t> ReplicasByPhase(const Decision& d);

// The whole status for a valid spec; `events` gets one per condition transition.
json BuildStatus(const ModelView& m, int64_t generation, const Decision& d,
                 const PlacementOutcome& outcome, const json& old_status, absl::Time now,
                 std::vector<Event>& events);

// The status of a spec the operator cannot act on: Invalid=True with the message; the rest of
// the old status (its replicas keep running) is kept.
json InvalidStatus(int64_t generation, const std::string& message, const json& old_status,
                   absl::Time now, std::vector<Event>& events);

std::string Rfc3339(absl::Time t);  // RFC 3339, seconds, UTC

}  // namespace shardserve::op
