#include "operator/reconcile.h"

#include <algorithm>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/text.h"

namespace shardserve::op {
namespace {

int64_t LabelInt(const json& labels, const char* key) {
  int64_t v = -1;
  if (!labels.is_object() || !labels.contains(key) || !labels[key].is_string()) return -1;
  return absl::SimpleAtoi(labels[key].get<std::string>(), &v) && v >= 0 ? v : -1;
}

absl::Time ParseTime(const json& v) {
  absl::Time t;
  std::string err;
  if (v.is_string() && absl::ParseTime(absl::RFC3339_full, v.get<std::string>(), &t, &err)) {
    return t;
  }
  return absl::InfinitePast();
}

// How often a starting replica's message is brought up to date.
constexpr absl::Duration kStartupRefresh = absl::Seconds(5);

// Waiting reasons a container does not leave by itself: its image, or its configuration.
bool Stuck(const std::string& reason) {
  return reason == "ErrImagePull" || reason == "ImagePullBackOff" || reason == "InvalidImageName" ||
         reason == "ErrImageNeverPull" || reason == "CreateContainerConfigError" ||
         reason == "CreateContainerError" || reason == "RunContainerError";
}

std::string Seconds(absl::Duration d) {
  return absl::StrCat(std::max<int64_t>(1, absl::ToInt64Seconds(absl::Ceil(d, absl::Seconds(1)))),
                      "s");
}

std::string OldPhase(const json& status, int64_t index) {
  if (!status.is_object()) return "";
  for (const json& e : status.value("replicaStatuses", json::array())) {
    if (e.value("index", int64_t{-1}) == index) return e.value("phase", "");
  }
  return "";
}

ReplicaState RecordOf(const json& status, int64_t index) {
  ReplicaState r;
  r.index = index;
  if (!status.is_object() || !status.contains("replicaStatuses")) return r;
  for (const json& e : status["replicaStatuses"]) {
    if (e.value("index", int64_t{-1}) != index) continue;
    r.restarts = e.value("restarts", int64_t{0});
    r.last_failure = ParseTime(e.value("lastFailureTime", json()));
    r.last_failure_message = e.value("lastFailureMessage", "");
    r.backoff = absl::Seconds(e.value("backoffSeconds", int64_t{0}));
  }
  return r;
}

void DeleteLive(const decide::Observed& o, Decision& d) {
  for (const PodView* p : o.live) d.deletes.push_back({p->name, p->uid});
}

}  // namespace

const char* PhaseName(ReplicaPhase p) {
  switch (p) {
    case ReplicaPhase::kPending:
      return "Pending";
    case ReplicaPhase::kPlacing:
      return "Placing";
    case ReplicaPhase::kStarting:
      return "Starting";
    case ReplicaPhase::kReady:
      return "Ready";
    case ReplicaPhase::kFailed:
      return "Failed";
    case ReplicaPhase::kBlocked:
      return "Blocked";
  }
  return "Pending";
}

std::string Rfc3339(absl::Time t) {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", t, absl::UTCTimeZone());
}

std::string LastLine(const std::string& message, size_t max) {
  std::vector<absl::string_view> lines = absl::StrSplit(
      message, '\n', [](absl::string_view l) { return !absl::StripAsciiWhitespace(l).empty(); });
  if (lines.empty()) return "";
  std::string line(absl::StripAsciiWhitespace(lines.back()));
  if (line.size() > max) {
    size_t cut = max;
    while (cut > 0 && (static_cast<unsigned char>(line[cut]) & 0xC0) == 0x80) --cut;
    line = line.substr(0, cut) + "...";
  }
  return line;
}

json Pick(const json& from, std::initializer_list<const char*> keys) {
  json out = json::object();
  if (!from.is_object()) return out;
  for (const char* k : keys) {
    if (auto it = from.find(k); it != from.end()) out[k] = *it;
  }
  return out;
}

bool Extended(const std::string& resource) { return resource.find('/') != std::string::npos; }

// The fields of a Pod the controller reads (about a tenth of the object): every pod in the
// cluster is cached, since each holds GPUs somewhere.
void SlimPod(json& pod) {
  json meta = Pick(pod["metadata"], {"name", "namespace", "uid", "resourceVersion", "labels",
                                     "creationTimestamp", "deletionTimestamp"});
  const json& annotations = pod["metadata"].value("annotations", json::object());
  for (const char* kept : {kPlacementAnnotation, kModelUriAnnotation}) {
    if (annotations.contains(kept)) meta["annotations"][kept] = annotations[kept];
  }
  for (const json& o : pod["metadata"].value("ownerReferences", json::array())) {
    if (o.value("controller", false))
      meta["ownerReferences"] = json::array({Pick(o, {"uid", "controller"})});
  }
  json containers = json::array();
  for (const json& c : pod["spec"].value("containers", json::array())) {
    json resources = json::object();
    const json given = c.value("resources", json::object());
    for (const char* kind : {"requests", "limits"}) {
      const json quantities = given.value(kind, json::object());
      for (const auto& [k, v] : quantities.items()) {
        if (Extended(k)) resources[kind][k] = v;
      }
    }
    json kept = {{"resources", resources}};
    if (c.contains("image")) kept["image"] = c["image"];  // quoted while it is pulled
    containers.push_back(std::move(kept));
  }
  // podIP: where a starting pod's ranks are asked what they are doing.
  json status = Pick(pod["status"], {"phase", "reason", "podIP"});
  // lastTransitionTime: since when a pod is Ready (PodView::ready_since; a replica serves a
  // rollout only once its pods have been Ready for Timing::min_ready).
  for (const json& c : pod["status"].value("conditions", json::array())) {
    status["conditions"].push_back(
        Pick(c, {"type", "status", "reason", "message", "lastTransitionTime"}));
  }
  for (const char* list : {"initContainerStatuses", "containerStatuses"}) {
    for (const json& c : pod["status"].value(list, json::array())) {
      json cs = Pick(c, {"name", "restartCount"});
      if (c.contains("state")) {
        if (c["state"].contains("running")) cs["state"]["running"] = json::object();
        // Why a container ended or cannot start, as one line (reconcile.cc quotes it); whole (4
        // KiB, what Kubernetes keeps) for an ended one: an inspect pod's report is read back.
        for (const char* state : {"terminated", "waiting"}) {
          if (!c["state"].contains(state) || !c["state"][state].is_object()) continue;
          json& out = cs["state"][state];
          out = Pick(c["state"][state], {"exitCode", "reason"});
          const json& message = c["state"][state].value("message", json());
          if (message.is_string()) {
            out["message"] = LastLine(message.get<std::string>(),
                                      std::string(state) == "terminated" ? 4096 : 300);
          }
        }
      }
      status[list].push_back(std::move(cs));
    }
  }
  json spec = {{"containers", containers}};
  if (pod["spec"].contains("nodeName")) spec["nodeName"] = pod["spec"]["nodeName"];
  pod = {{"metadata", meta}, {"spec", spec}, {"status", status}};
}

PodView ReadPod(const json& pod) {
  PodView v;
  const json& meta = pod.value("metadata", json::object());
  v.name = meta.value("name", "");
  v.uid = meta.value("uid", "");
  const json labels = meta.value("labels", json::object());
  v.replica = LabelInt(labels, kReplicaLabel);
  v.stage = LabelInt(labels, kStageLabel);
  v.revision = labels.value(kRevisionLabel, "");
  for (const json& o : meta.value("ownerReferences", json::array())) {
    if (o.value("controller", false)) v.owner_uid = o.value("uid", "");
  }
  const json annotations = meta.value("annotations", json::object());
  v.model_uri = annotations.value(kModelUriAnnotation, "");
  const std::string placement = annotations.value(kPlacementAnnotation, "");
  if (!placement.empty()) v.placement = absl::StrSplit(placement, ',');
  v.deleting = meta.contains("deletionTimestamp") && !meta["deletionTimestamp"].is_null();
  v.created = ParseTime(meta.value("creationTimestamp", json()));
  v.node = pod.value("spec", json::object()).value("nodeName", "");
  const json& status = pod.value("status", json::object());
  v.phase = status.value("phase", "Pending");
  v.pod_ip = status.value("podIP", "");
  for (const json& c : pod.value("spec", json::object()).value("containers", json::array())) {
    if (v.image.empty()) v.image = c.value("image", "");
  }
  v.started = v.phase != "Pending";
  for (const json& c : status.value("conditions", json::array())) {
    const std::string type = c.value("type", "");
    if (type == "Ready") {
      v.ready = c.value("status", "") == "True";
      if (v.ready) v.ready_since = ParseTime(c.value("lastTransitionTime", json()));
    }
    if (type == "PodScheduled" && c.value("status", "") == "False" &&
        c.value("reason", "") == "Unschedulable") {
      v.unschedulable = true;
      v.unschedulable_message = c.value("message", "");
    }
  }
  // The init containers first (a remote model's fetch step: running, or failed naming why),
  // then the containers.
  for (const char* list : {"initContainerStatuses", "containerStatuses"}) {
    const bool init = list[0] == 'i';
    for (const json& c : status.value(list, json::array())) {
      const json& state = c.value("state", json::object());
      if (init && state.contains("running") && c.value("name", "") == "fetch") v.fetching = true;
      if (!init) {
        v.restarts += c.value("restartCount", int64_t{0});
        if (state.contains("running")) v.started = true;
      }
      const json& waiting = state.value("waiting", json());
      if (waiting.is_object() && waiting.value("reason", "") == "ContainerCreating") {
        v.creating = true;
      }
      if (waiting.is_object() && v.stuck.empty() && Stuck(waiting.value("reason", ""))) {
        v.stuck =
            absl::StrCat("pod ", v.name, " container ", c.value("name", ""), ": ",
                         waiting.value("reason", ""), ": ", LastLine(waiting.value("message", "")));
      }
      const json& term = state.value("terminated", json());
      // Whole: an inspect pod's report (the model's footprint) is read back; Kubernetes keeps
      // 4 KiB.
      if (!init && term.is_object()) v.report = LastLine(term.value("message", ""), 4096);
      // An init container that ended well is a step done, not a failure.
      if (term.is_object() && (!init || term.value("exitCode", 0) != 0) && v.failure.empty()) {
        v.failure =
            absl::StrCat("pod ", v.name, " container ", c.value("name", ""), " exited with code ",
                         term.value("exitCode", 0), " (", term.value("reason", "no reason"), ")");
        const std::string why = LastLine(term.value("message", ""));
        if (!why.empty()) absl::StrAppend(&v.failure, ": ", why);
      }
    }
  }
  // A ready pod's containers run: whatever an init container's status still says, it fetches no
  // more.
  if (v.ready) v.fetching = false;
  if (v.phase == "Failed" || v.phase == "Succeeded") {
    if (v.failure.empty()) {
      v.failure = absl::StrCat(
          "pod ", v.name, " ", v.phase == "Failed" ? "failed" : "exited",
          status.contains("reason") ? absl::StrCat(" (", status.value("reason", ""), ")") : "");
    }
  } else if (v.restarts > 0) {
    v.failure = absl::StrCat("pod ", v.name, " restarted ", v.restarts, " time(s)");
  } else {
    v.failure.clear();  // a running container's last termination is history
  }
  return v;
}

json ModelStatus(const std::string& uri, const std::string& key, const ModelFootprint& footprint,
                 const std::optional<ModelView::Source>& source) {
  json out = {{"uri", uri},
              {"inspection", key},
              {"shape", ShapeToJson(footprint.shape)},
              {"footprint", FootprintToJson(footprint)}};
  if (source) {
    out["source"] = {{"revision", source->revision},
                     {"dir", source->dir},
                     {"bytes", source->bytes},
                     {"files", source->files}};
  }
  return out;
}

std::optional<ModelView::Source> SourceFromJson(const json& j) {
  if (!j.is_object()) return std::nullopt;
  ModelView::Source s;
  const json revision = j.value("revision", json()), dir = j.value("dir", json());
  const json bytes = j.value("bytes", json()), files = j.value("files", json());
  if (!revision.is_string() || !dir.is_string() || !bytes.is_number_integer() ||
      !files.is_number_integer()) {
    return std::nullopt;
  }
  s.revision = revision.get<std::string>();
  s.dir = dir.get<std::string>();
  s.bytes = bytes.get<int64_t>();
  s.files = files.get<int64_t>();
  // A directory under the node's cache (it becomes a mount's subPath): relative, no '..', and a
  // revision as the fetch step takes it (one argument, printable).
  const auto printable = [](const std::string& t) {
    return !t.empty() && t.size() <= 512 &&
           std::all_of(t.begin(), t.end(), [](char c) { return c > 0x20 && c < 0x7f; });
  };
  if (!printable(s.revision) || !printable(s.dir) || s.dir[0] == '/' ||
      s.dir.find("..") != std::string::npos || s.bytes < 0 || s.files < 0) {
    return std::nullopt;
  }
  return s;
}

ShapeView ReadShape(const std::string& uri, const std::string& key, const json& status,
                    const json* shared, const PodView* pod) {
  ShapeView out;
  const auto parsed = ParseModelUri(uri);
  const bool remote = parsed.ok() && parsed->remote();
  const json own = status.is_object() ? status.value("model", json::object()) : json::object();
  for (const json* model : {&own, shared}) {
    if (model == nullptr || !model->is_object() || model->value("uri", "") != uri ||
        model->value("inspection", model == &own ? key : "") != key) {
      continue;
    }
    auto footprint = FootprintFromJson(model->value("footprint", json()));
    auto source = SourceFromJson(model->value("source", json()));
    // A status without them (an earlier operator's) is read again.
    if (footprint.ok() && (source || !remote)) {
      out.state = ShapeView::State::kKnown;
      out.footprint = *footprint;
      out.source = source;
      out.delete_pod = pod != nullptr;
      return out;
    }
  }
  if (pod == nullptr) {
    out.message = "creating the pod that reads it";
    out.create_pod = true;
    return out;
  }
  if (pod->deleting) {
    out.message = absl::StrCat("pod ", pod->name, " is going");
    return out;
  }
  if (pod->model_uri != uri) {  // it read the model before a change of spec.model.uri
    out.message = absl::StrCat("pod ", pod->name, " read another uri; replacing it");
    out.delete_pod = true;
    return out;
  }
  if (pod->phase == "Succeeded") {
    const json report = json::parse(pod->report, nullptr, false);
    auto footprint = FootprintFromJson(report);
    auto source = SourceFromJson(report.is_object() ? report.value("source", json()) : json());
    if (footprint.ok() && (source || !remote)) {
      out.state = ShapeView::State::kKnown;
      out.footprint = *footprint;
      out.source = source;
      out.delete_pod = true;
      return out;
    }
    if (footprint.ok())
      footprint = absl::InvalidArgumentError("no source (revision, dir) for a remote model");
    out.state = ShapeView::State::kFailed;
    out.message = absl::StrCat("pod ", pod->name, " reported '", pod->report.substr(0, 200),
                               "', not the model's footprint: ", footprint.status().message(),
                               " (delete the pod to read the model again)");
    return out;
  }
  if (pod->phase == "Failed") {
    out.state = ShapeView::State::kFailed;
    out.message = absl::StrCat("the model cannot be read: ", pod->failure, " (delete pod ",
                               pod->name, " to read it again)");
    return out;
  }
  out.blocked = !pod->stuck.empty();
  out.message =
      out.blocked ? pod->stuck
      : pod->unschedulable
          ? absl::StrCat("pod ", pod->name, " cannot be scheduled: ", pod->unschedulable_message)
          : absl::StrCat("pod ", pod->name, " is reading it");
  return out;
}

void WaitForShape(const ShapeView& shape, Decision& d) {
  d.shape_wait = absl::StrCat("waiting for the model's shape: ", shape.message);
  const std::set<int64_t> place(d.place.begin(), d.place.end());
  for (ReplicaState& r : d.replicas) {
    if (!place.count(r.index)) continue;
    r.phase = shape.blocked ? ReplicaPhase::kBlocked : ReplicaPhase::kPending;
    r.message = d.shape_wait;
  }
  d.place.clear();
  d.creates.clear();
}

// `creating`: the last status had the replica Placing, so stages missing without a trace of
// deletion are an interrupted creation, not a failure.
namespace decide {

Observed Observe(int64_t index, const std::vector<const PodView*>& pods, bool creating,
                 const ModelView& m, absl::Time now, const Timing& timing,
                 absl::Duration& requeue) {
  Observed o;
  o.index = index;
  o.pods = pods;
  const int64_t P = m.model.spec.pipeline;
  std::set<int64_t> stages;
  std::vector<std::pair<int64_t, std::string>> starting;  // by stage
  bool deleted_pod = false;
  for (const PodView* p : pods) {
    o.started |= p->started;
    if (p->deleting) {
      deleted_pod = true;
      continue;
    }
    o.live.push_back(p);
    stages.insert(p->stage);
    if (p->revision != m.revision || p->stage >= P) o.outdated = true;
    if (p->node.empty()) o.unbound = true;
    if (p->node_cordoned && o.cordoned.empty()) o.cordoned = p->node;
    if (o.failure.empty() && !p->failure.empty()) o.failure = p->failure;
    if (o.stuck.empty() && !p->stuck.empty()) o.stuck = p->stuck;
    if (!p->ready && !p->startup.empty()) {
      starting.emplace_back(p->stage, p->startup);
      // Progress (a pull, loading) shows in no watched object: look again.
      requeue = std::min(requeue, kStartupRefresh);
    }
    // Volumes that cannot be mounted show only in events, which nothing watches: look again.
    if (p->creating && p->stuck.empty()) requeue = std::min(requeue, absl::Seconds(10));
    if (p->phase == "Pending" && p->unschedulable && o.unschedulable.empty()) {
      const absl::Time deadline = p->created + timing.unschedulable_timeout;
      if (now >= deadline) {
        o.unschedulable = absl::StrCat("pod ", p->name, " stayed unschedulable for ",
                                       Seconds(now - p->created), ": ", p->unschedulable_message);
      } else {
        requeue = std::min(requeue, deadline - now);
        o.waiting = absl::StrCat("pod ", p->name, " is unschedulable (", p->unschedulable_message,
                                 "); planning the replica again in ", Seconds(deadline - now),
                                 " if it stays so");
      }
    }
  }
  for (int64_t s = 0; s < P; ++s) {
    if (!stages.count(s)) o.missing.push_back(s);
  }
  std::sort(starting.begin(), starting.end());
  for (const auto& [stage, what] : starting) {
    absl::StrAppend(&o.starting, o.starting.empty() ? "" : "; ", what);
  }
  if (!o.live.empty() && o.failure.empty() && !o.missing.empty() &&
      (deleted_pod || (o.started && !creating))) {
    o.failure = absl::StrCat("stage ", o.missing.front(), " pod ",
                             PodName(m.model.name, index, o.missing.front()),
                             deleted_pod ? " was deleted" : " is gone");
  }
  o.ready = !o.live.empty() && o.missing.empty() && o.failure.empty() &&
            std::all_of(o.live.begin(), o.live.end(),
                        [](const PodView* p) { return p->phase == "Running" && p->ready; });
  if (o.ready) {
    for (const PodView* p : o.live) o.ready_since = std::max(o.ready_since, p->ready_since);
  }
  return o;
}

Reach ReachOf(const std::map<int64_t, Observed>& obs, int64_t replicas, int64_t max_surge) {
  bool outdated_left = false, surge_exists = false, base_unready = false;
  for (const auto& [index, o] : obs) {
    if (index < replicas && o.outdated) outdated_left = true;
    if (index < replicas && !o.ready) base_unready = true;
    if (index >= replicas && !o.live.empty() && !o.outdated) surge_exists = true;
  }
  Reach r;
  r.surge = max_surge > 0 && (outdated_left || (surge_exists && base_unready));
  r.limit = r.surge ? replicas + max_surge : replicas;
  return r;
}

Verdict Judge(const Observed& o, ReplicaState r, const ModelView& m, absl::Time now,
              const Timing& timing) {
  const ShardedModelSpec& spec = m.model.spec;
  const int64_t index = o.index;
  Verdict v;
  r.revision = o.live.empty() ? m.revision : o.live.front()->revision;
  r.exists = !o.live.empty();
  r.updated = r.exists && !o.outdated && o.missing.empty();
  for (int64_t s = 0; s < spec.pipeline && r.exists; ++s) {
    std::string node;
    for (const PodView* p : o.live) {
      if (p->stage == s)
        node = p->node.empty() && s < static_cast<int64_t>(p->placement.size()) ? p->placement[s]
                                                                                : p->node;
    }
    r.nodes.push_back(node);
  }

  if (o.live.empty()) {
    if (r.last_failure + r.backoff > now) {
      r.phase = ReplicaPhase::kFailed;
      r.message = absl::StrCat(r.last_failure_message.empty() ? "" : r.last_failure_message + "; ",
                               "recreating in ", Seconds(r.last_failure + r.backoff - now),
                               " (restart ", r.restarts, ")");
      v.requeue_after = r.last_failure + r.backoff - now;
    } else if (!o.pods.empty()) {
      r.phase = ReplicaPhase::kPending;
      r.message = "waiting for the previous pods to terminate";
    } else {
      r.phase = ReplicaPhase::kPending;
      r.message = "placing";
      v.place = true;
    }
  } else if (o.outdated) {
    r.phase = o.ready ? ReplicaPhase::kReady : ReplicaPhase::kStarting;
    r.message = absl::StrCat("at revision ", r.revision, "; to be replaced by ", m.revision);
    if (o.ready) {
      v.outdated_serving = true;
    } else {
      v.events.push_back(
          {"Normal", "RollingReplica",
           absl::StrCat("replacing replica ", index, " (not serving) with revision ", m.revision)});
      v.delete_live = true;
    }
  } else if (!o.cordoned.empty() && o.failure.empty()) {
    r.phase = o.ready ? ReplicaPhase::kReady : ReplicaPhase::kStarting;
    r.message = absl::StrCat("on cordoned node ", o.cordoned, "; to be moved");
    if (o.ready) {
      v.cordoned_serving = true;
    } else {
      v.events.push_back({"Normal", "MovingReplica",
                          absl::StrCat("moving replica ", index,
                                       " (not serving) off cordoned node ", o.cordoned)});
      v.delete_live = true;
    }
  } else if (!o.failure.empty()) {
    r.phase = ReplicaPhase::kFailed;
    if (spec.failure_policy == "None") {
      r.message = absl::StrCat(o.failure, "; failurePolicy None leaves it");
    } else {
      const bool recent = r.last_failure + timing.backoff_reset > now;
      r.backoff = recent && r.backoff > absl::ZeroDuration()
                      ? std::min(r.backoff * 2, timing.backoff_max)
                      : timing.backoff_base;
      r.last_failure = now;
      r.last_failure_message = o.failure;
      ++r.restarts;
      v.restart = true;
      r.message = absl::StrCat(o.failure, "; recreating the replica in ", Seconds(r.backoff),
                               " (restart ", r.restarts, ")");
      v.events.push_back(
          {"Warning", "RecreatingReplica", absl::StrCat("replica ", index, ": ", r.message)});
      v.requeue_after = r.backoff;
      v.delete_live = true;
    }
  } else if (!o.unschedulable.empty()) {
    r.phase = ReplicaPhase::kPending;
    r.message = absl::StrCat(o.unschedulable, "; planning the replica again");
    v.replan = true;
    v.events.push_back({"Warning", "Replanning", absl::StrCat("replica ", index, ": ", r.message)});
    v.delete_live = true;
  } else if (!o.missing.empty()) {
    // Created in part (the operator stopped half-way): the rest goes on the same plan.
    const std::vector<std::string>& plan = o.live.front()->placement;
    if (static_cast<int64_t>(plan.size()) == spec.pipeline) {
      r.phase = ReplicaPhase::kPlacing;
      r.message = absl::StrCat("completing the creation of ", o.missing.size(), " stage(s)");
      r.nodes = plan;
      v.create_stages = o.missing;
    } else {
      r.phase = ReplicaPhase::kPending;
      r.message = "created in part without a plan; planning it again";
      v.delete_live = true;
    }
  } else if (o.ready) {
    r.phase = ReplicaPhase::kReady;
    r.message = "";
  } else if (o.unbound) {
    r.phase = ReplicaPhase::kPlacing;
    r.message = o.waiting.empty()
                    ? "waiting for kube-scheduler to bind the pods to their planned nodes"
                    : o.waiting;
  } else {
    r.phase = ReplicaPhase::kStarting;
    r.message = o.starting.empty() ? "waiting for every rank to be ready" : o.starting;
  }
  // A pod that cannot start by itself blocks its replica; recreating it would not help, a new
  // spec (or a fixed node) does.
  if (r.phase == ReplicaPhase::kStarting && !o.stuck.empty()) {
    r.phase = ReplicaPhase::kBlocked;
    r.message = o.stuck;
  }
  v.state = std::move(r);
  return v;
}

std::vector<int64_t> ToReplace(std::vector<int64_t> outdated_serving, int64_t serving,
                               int64_t min_serving) {
  std::sort(outdated_serving.rbegin(), outdated_serving.rend());
  std::vector<int64_t> out;
  for (int64_t index : outdated_serving) {
    if (serving - 1 < min_serving) break;
    --serving;
    out.push_back(index);
  }
  return out;
}

}  // namespace decide

Decision Decide(const ModelView& m, const std::vector<PodView>& pods, const json& status,
                absl::Time now, const Timing& timing) {
  using decide::Observed;
  Decision d;
  const ShardedModelSpec& spec = m.model.spec;
  const int64_t N = spec.replicas;
  const int64_t U = std::max<int64_t>(spec.max_unavailable, spec.max_surge == 0 ? 1 : 0);

  // Pods of an earlier model of the same name (another uid) wait for the garbage collector; they
  // are deleted here too and hold their index until gone.
  std::vector<PodView> views = pods;
  std::map<int64_t, std::vector<const PodView*>> by_index;
  for (PodView& p : views) {
    if (p.replica < 0 || p.stage < 0) continue;
    if (!p.owner_uid.empty() && p.owner_uid != m.uid) {
      if (!p.deleting) d.deletes.push_back({p.name, p.uid});
      p.deleting = true;
    }
    by_index[p.replica].push_back(&p);
  }
  for (int64_t i = 0; i < N; ++i) by_index[i];

  std::map<int64_t, Observed> obs;
  for (const auto& [index, list] : by_index) {
    obs[index] = decide::Observe(index, list, OldPhase(status, index) == "Placing", m, now, timing,
                                 d.requeue_after);
  }
  const decide::Reach reach = decide::ReachOf(obs, N, spec.max_surge);
  for (int64_t i = N; i < reach.limit; ++i) {
    if (!obs.count(i)) obs[i] = decide::Observe(i, {}, false, m, now, timing, d.requeue_after);
  }

  int64_t serving = 0;
  std::vector<int64_t> outdated_serving;
  std::set<int64_t> cordoned;  // among them, those on a cordoned node (moved, not rolled)
  for (auto& [index, o] : obs) {
    if (index >= reach.limit || (index >= N && o.outdated)) {
      if (!o.live.empty()) {
        d.events.push_back({"Normal", index >= N && reach.surge ? "RemovingSurge" : "ScalingDown",
                            absl::StrCat("deleting replica ", index)});
        DeleteLive(o, d);
      }
      continue;
    }
    decide::Verdict v = decide::Judge(o, RecordOf(status, index), m, now, timing);
    if (v.delete_live) DeleteLive(o, d);
    if (v.place) d.place.push_back(index);
    for (int64_t s : v.create_stages) d.creates.push_back({index, s, v.state.nodes});
    if (v.state.phase == ReplicaPhase::kReady) {
      // Serving for a rollout only once it has stayed ready for timing.min_ready.
      const absl::Time settled = o.ready_since + timing.min_ready;
      if (settled <= now) {
        ++serving;
      } else {
        d.requeue_after = std::min(d.requeue_after, settled - now);
      }
    }
    if (v.outdated_serving || v.cordoned_serving) outdated_serving.push_back(index);
    if (v.cordoned_serving) cordoned.insert(index);
    d.restarts += v.restart ? 1 : 0;
    d.replans += v.replan ? 1 : 0;
    d.requeue_after = std::min(d.requeue_after, v.requeue_after);
    d.events.insert(d.events.end(), v.events.begin(), v.events.end());
    d.replicas.push_back(std::move(v.state));
  }

  // Serving outdated replicas, and serving ones on cordoned nodes, go one at a time (highest
  // index first) within maxUnavailable.
  for (int64_t index : decide::ToReplace(outdated_serving, serving, std::max<int64_t>(0, N - U))) {
    --serving;
    const bool move = cordoned.count(index) > 0;
    d.events.push_back({"Normal", move ? "MovingReplica" : "RollingReplica",
                        absl::StrCat(move ? absl::StrCat("moving replica ", index,
                                                         " off cordoned node ", obs[index].cordoned)
                                          : absl::StrCat("replacing replica ", index,
                                                         " with revision ", m.revision),
                                     " (", serving, " of ", N, " replicas serving meanwhile)")});
    DeleteLive(obs[index], d);
    for (ReplicaState& r : d.replicas) {
      if (r.index != index) continue;
      r.message = move ? absl::StrCat("being moved off cordoned node ", obs[index].cordoned)
                       : absl::StrCat("being replaced by revision ", m.revision);
    }
  }

  // Deletes: highest replica first, each pod once.
  std::stable_sort(d.deletes.begin(), d.deletes.end(),
                   [&](const PodRef& a, const PodRef& b) { return a.name > b.name; });
  d.deletes.erase(std::unique(d.deletes.begin(), d.deletes.end(),
                              [](const PodRef& a, const PodRef& b) { return a.uid == b.uid; }),
                  d.deletes.end());
  return d;
}

std::optional<Event> PlacedEvent(const PlacementOutcome& outcome, const std::string& revision) {
  if (outcome.placed.empty()) return std::nullopt;
  std::vector<std::string> placed;
  for (const auto& [replica, nodes] : outcome.placed) {
    placed.push_back(absl::StrCat(replica, " on ", absl::StrJoin(nodes, ", ")));
  }
  return Event{
      "Normal", "PlacedReplicas",
      absl::StrCat("revision ", revision, ": replica ", absl::StrJoin(placed, "; replica "))};
}

void ApplyDownloads(const std::vector<PodView>& pods, const std::string& uri,
                    const json& old_status, json& status, std::vector<Event>& events) {
  // The pods of a node that fetch at once wait for one download and say its numbers: a node's
  // is the furthest any of its pods reports.
  std::map<std::string, std::optional<PodView::Download>> by_node;
  std::map<std::string, std::vector<std::string>> pods_of;
  for (const PodView& p : pods) {
    if (!p.fetching || p.node.empty() || p.deleting) continue;
    pods_of[p.node].push_back(p.name);
    std::optional<PodView::Download>& d = by_node[p.node];
    if (p.download && (!d || p.download->bytes >= d->bytes)) d = p.download;
  }
  std::set<std::string> before;
  for (const json& e : old_status.value("downloads", json::array())) {
    if (e.is_object() && e.value("node", json()).is_string()) before.insert(e["node"]);
  }
  json downloads = json::array();
  for (const auto& [node, d] : by_node) {
    json e = {{"node", node}, {"pods", pods_of[node]}};  // numbers once its fetch step says them
    if (d) {
      e["bytes"] = d->bytes;
      e["totalBytes"] = d->total;
      e["bytesPerSecond"] = static_cast<int64_t>(d->rate);
      if (d->eta >= 0) e["etaSeconds"] = static_cast<int64_t>(d->eta);
    }
    downloads.push_back(std::move(e));
    if (!before.count(node)) {
      events.push_back(
          {"Normal", "Downloading",
           absl::StrCat("node ", node, ": fetching ", uri,
                        d && d->total > 0 ? absl::StrCat(" (", HumanBytes(d->total), ")") : "",
                        " into its model cache")});
    }
  }
  for (const std::string& node : before) {
    if (!by_node.count(node)) {
      events.push_back({"Normal", "Downloaded",
                        absl::StrCat("node ", node, ": ", uri, " is in its model cache")});
    }
  }
  if (downloads.empty()) {
    status.erase("downloads");
    return;
  }
  status["downloads"] = downloads;
  const std::string phase = status.value("phase", "");
  if (phase == "Progressing" || phase == "Pending") status["phase"] = "Downloading";
}

std::map<std::string, int64_t> ReplicasByPhase(const Decision& d) {
  std::map<std::string, int64_t> by_phase;
  for (const ReplicaState& r : d.replicas) ++by_phase[PhaseName(r.phase)];
  return by_phase;
}

void ApplyPlacement(const PlacementOutcome& outcome, const std::string& revision, Decision& d) {
  for (ReplicaState& r : d.replicas) {
    if (auto it = outcome.placed.find(r.index); it != outcome.placed.end()) {
      r.phase = ReplicaPhase::kPlacing;
      r.nodes = it->second;
      r.revision = revision;
      r.exists = r.updated = true;
      r.message = "pods created on their planned nodes";
    } else if (auto it = outcome.unplaced.find(r.index); it != outcome.unplaced.end()) {
      r.phase = ReplicaPhase::kPending;
      r.message = it->second;
    }
  }
}

namespace {

struct Condition {
  std::string type, status, reason, message;
  bool bad = false;  // a transition into this state is a Warning
  // A bad state that is expected when the model is new (Available=False): no Event then.
  bool expected_at_start = false;
};

json Conditions(const std::vector<Condition>& wanted, int64_t generation, const json& old_status,
                absl::Time now, std::vector<Event>& events) {
  std::map<std::string, json> old;
  if (old_status.is_object()) {
    for (const json& c : old_status.value("conditions", json::array())) {
      old[c.value("type", "")] = c;
    }
  }
  json out = json::array();
  for (const Condition& c : wanted) {
    json j = {{"type", c.type},
              {"status", c.status},
              {"reason", c.reason},
              {"message", c.message},
              {"observedGeneration", generation}};
    auto it = old.find(c.type);
    if (it != old.end() && it->second.value("status", "") == c.status) {
      j["lastTransitionTime"] = it->second.value("lastTransitionTime", Rfc3339(now));
    } else {
      j["lastTransitionTime"] = Rfc3339(now);
      if (it != old.end() || (c.bad && !c.expected_at_start)) {
        events.push_back({c.bad ? "Warning" : "Normal", c.reason,
                          absl::StrCat(c.type, "=", c.status, ": ", c.message)});
      }
    }
    out.push_back(std::move(j));
  }
  return out;
}

}  // namespace

json BuildStatus(const ModelView& m, int64_t generation, const Decision& d,
                 const PlacementOutcome& outcome, const json& old_status, absl::Time now,
                 std::vector<Event>& events) {
  const ShardedModelSpec& spec = m.model.spec;
  const int64_t N = spec.replicas;
  int64_t existing = 0, ready = 0, updated = 0, failed = 0, blocked = 0, outdated = 0, surge = 0;
  std::vector<std::string> failures, waiting;
  json replicas = json::array();
  for (const ReplicaState& r : d.replicas) {
    existing += r.exists;
    updated += r.updated;
    ready += r.phase == ReplicaPhase::kReady;
    surge += r.index >= N;
    outdated += r.exists && r.revision != m.revision;
    if (r.phase == ReplicaPhase::kFailed || r.phase == ReplicaPhase::kBlocked) {
      ++(r.phase == ReplicaPhase::kFailed ? failed : blocked);
      failures.push_back(absl::StrCat("replica ", r.index, ": ", r.message));
    }
    if (r.phase != ReplicaPhase::kReady) waiting.push_back(absl::StrCat(r.index));
    json e = {{"index", r.index},       {"phase", PhaseName(r.phase)}, {"nodes", r.nodes},
              {"restarts", r.restarts}, {"revision", r.revision},      {"message", r.message}};
    if (r.last_failure != absl::InfinitePast()) {
      e["lastFailureTime"] = Rfc3339(r.last_failure);
      e["lastFailureMessage"] = r.last_failure_message;
      e["backoffSeconds"] = absl::ToInt64Seconds(r.backoff);
    }
    replicas.push_back(std::move(e));
  }
  const int64_t min_available = N == 0 ? 0 : std::max<int64_t>(1, N - spec.max_unavailable);
  const bool complete =
      ready == N && updated == N && existing == N && surge == 0 && d.deletes.empty();

  std::vector<Condition> c;
  c.push_back({"Invalid", "False", "Valid", "the spec is valid"});
  if (!d.shape_wait.empty()) {
    c.push_back({"Placed", "Unknown", "ReadingModel", d.shape_wait});  // nothing planned yet
  } else if (!outcome.unplaced.empty()) {
    std::vector<std::string> why;
    for (const auto& [index, message] : outcome.unplaced) why.push_back(message);
    c.push_back({"Placed", "False", "InsufficientGPUs", absl::StrJoin(why, "; "), true});
  } else if (d.replans > 0) {
    c.push_back({"Placed", "False", "Unschedulable",
                 "pods stayed unschedulable on their planned nodes; planning again", true});
  } else {
    c.push_back({"Placed", "True", "Placed", absl::StrCat("every replica has its nodes")});
  }
  if (ready >= min_available) {
    c.push_back({"Available", "True", "MinimumReplicasAvailable",
                 absl::StrCat(ready, " of ", N, " replicas ready")});
  } else {
    c.push_back({"Available", "False", "MinimumReplicasUnavailable",
                 absl::StrCat(ready, " of ", N, " replicas ready; ", min_available, " needed"),
                 true, true});
  }
  if (complete) {
    c.push_back({"Progressing", "False", "Complete",
                 absl::StrCat("all ", N, " replicas ready at revision ", m.revision)});
  } else if (outdated > 0) {
    c.push_back({"Progressing", "True", "RollingUpdate",
                 absl::StrCat(updated, " of ", N, " replicas at revision ", m.revision)});
  } else if (existing != N) {
    c.push_back(
        {"Progressing", "True", "Scaling", absl::StrCat(existing, " of ", N, " replicas exist")});
  } else {
    c.push_back({"Progressing", "True", "ReplicasStarting",
                 absl::StrCat("waiting for replica(s) ", absl::StrJoin(waiting, ", "))});
  }
  if (failed + blocked > 0) {
    c.push_back({"Degraded", "True", failed > 0 ? "ReplicaFailed" : "ReplicaBlocked",
                 absl::StrJoin(failures, "; "), true});
  } else {
    c.push_back({"Degraded", "False", "AsExpected", "no replica has failed"});
  }

  std::string phase = "Progressing";
  if (failed + blocked > 0) {
    phase = "Degraded";
  } else if (complete) {
    phase = "Ready";
  } else if (existing == 0 && N > 0) {
    phase = "Pending";
  }
  json plan = {{"tensor", spec.tensor},
               {"pipeline", spec.pipeline},
               {"gpusPerReplica", spec.gpus_per_replica()}};
  if (!m.stage_layers.empty()) {
    plan["stageLayers"] = json::array();
    for (const LayerRange& r : m.stage_layers) plan["stageLayers"].push_back(FormatLayerRange(r));
  }
  if (m.memory) {
    const ParallelismChoice& c = m.memory->choice;
    plan["stageMemory"] = json::array();
    for (size_t s = 0; s < c.stages.size(); ++s) {
      plan["stageMemory"].push_back(DescribeStage(static_cast<int64_t>(s), c.tensor, c.stages[s]));
    }
    plan["gpuMemory"] = m.memory->gpu_memory > 0
                            ? FormatGiB(static_cast<double>(m.memory->gpu_memory))
                            : "unknown (no nvidia.com/gpu.memory label, no spec.worker.gpuMemory)";
  }
  if (!m.auto_for.empty()) plan["auto"] = m.auto_for;
  json out = {
      {"observedGeneration", generation},
      {"replicas", existing},
      {"readyReplicas", ready},
      {"updatedReplicas", updated},
      {"ready", absl::StrCat(ready, "/", N)},
      {"gpus", existing * spec.gpus_per_replica()},
      {"phase", phase},
      {"revision", m.revision},
      {"selector", absl::StrCat(kModelLabel, "=", m.model.name, ",", kRoleLabel, "=leader")},
      {"plan", plan},
      {"replicaStatuses", replicas},
      {"conditions", Conditions(c, generation, old_status, now, events)}};
  if (m.footprint) {
    out["model"] = ModelStatus(spec.model_uri, m.inspection, *m.footprint, m.source);
  }
  return out;
}

json InvalidStatus(int64_t generation, const std::string& message, const json& old_status,
                   absl::Time now, std::vector<Event>& events) {
  json s = old_status.is_object() ? old_status : json::object();
  std::vector<Condition> c = {{"Invalid", "True", "InvalidSpec", message, true}};
  json old_conditions = s.value("conditions", json::array());
  json conditions = Conditions(c, generation, s, now, events);
  for (const json& o : old_conditions) {
    if (o.value("type", "") != "Invalid") conditions.push_back(o);
  }
  s["conditions"] = conditions;
  s["observedGeneration"] = generation;
  s["phase"] = "Invalid";
  if (!s.contains("ready")) s["ready"] = "0/0";
  return s;
}

}  // namespace shardserve::op
