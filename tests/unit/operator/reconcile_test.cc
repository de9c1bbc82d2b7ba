// The reconciler's pure decisions (operator/reconcile.h): scaling, gang failure and backoff,
// interrupted creation, unschedulable re-planning, rollouts within maxUnavailable/maxSurge, and
// the status with its conditions.
#include "operator/reconcile.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "model/footprint.h"

namespace shardserve::op {
namespace {

const absl::Time kNow = absl::FromUnixSeconds(1'800'000'000);

// A ShardedModel as the apiserver returns it, built fluently.
class ModelBuilder {
 public:
  ModelBuilder() {
    object_ = json::parse(R"({
      "apiVersion": "shardserve.io/v1alpha1", "kind": "ShardedModel",
      "metadata": {"name": "m", "namespace": "ns", "uid": "uid-m", "generation": 1},
      "spec": {"replicas": 1, "model": {"name": "llama", "uri": "hostpath:///models/llama"},
               "parallelism": {"tensor": 2, "pipeline": 2},
               "worker": {"image": "w:1"}}})");
  }
  ModelBuilder& Replicas(int64_t n) {
    object_["spec"]["replicas"] = n;
    return *this;
  }
  ModelBuilder& Image(const std::string& image) {
    object_["spec"]["worker"]["image"] = image;
    return *this;
  }
  ModelBuilder& Rollout(int64_t max_unavailable, int64_t max_surge) {
    object_["spec"]["rollout"] = {{"maxUnavailable", max_unavailable}, {"maxSurge", max_surge}};
    return *this;
  }
  ModelBuilder& FailurePolicy(const std::string& p) {
    object_["spec"]["failurePolicy"] = p;
    return *this;
  }
  ModelView Build() const {
    auto v = ReadModel(object_, {}, {{"/models"}, {}});
    EXPECT_TRUE(v.ok()) << v.status();
    return *v;
  }

 private:
  json object_;
};

// A running, ready stage pod of `m`, changed fluently.
class PodBuilder {
 public:
  PodBuilder(const ModelView& m, int64_t replica, int64_t stage) {
    p_.name = PodName(m.model.name, replica, stage);
    p_.uid = p_.name + "-uid";
    p_.owner_uid = m.uid;
    p_.replica = replica;
    p_.stage = stage;
    p_.revision = m.revision;
    p_.placement = {"n0", "n1"};
    p_.node = p_.placement[stage];
    p_.phase = "Running";
    p_.ready = p_.started = true;
    p_.created = kNow - absl::Minutes(5);
  }
  PodBuilder& Revision(const std::string& r) {
    p_.revision = r;
    return *this;
  }
  PodBuilder& NotReady() {
    p_.ready = false;
    return *this;
  }
  PodBuilder& Failed() {
    p_.phase = "Failed";
    p_.ready = false;
    p_.failure = "pod " + p_.name + " failed";
    return *this;
  }
  PodBuilder& Pending(bool unschedulable, absl::Duration age) {
    p_.phase = "Pending";
    p_.ready = p_.started = false;
    p_.node.clear();
    p_.unschedulable = unschedulable;
    p_.unschedulable_message = "0/2 nodes are available";
    p_.created = kNow - age;
    return *this;
  }
  PodBuilder& Owner(const std::string& uid) {
    p_.owner_uid = uid;
    return *this;
  }
  operator PodView() const { return p_; }

 private:
  PodView p_;
};

std::vector<PodView> Replica(const ModelView& m, int64_t r) {
  return {PodBuilder(m, r, 0), PodBuilder(m, r, 1)};
}

std::vector<PodView> Replicas(const ModelView& m, int64_t n) {
  std::vector<PodView> out;
  for (int64_t r = 0; r < n; ++r) {
    for (const PodView& p : Replica(m, r)) out.push_back(p);
  }
  return out;
}

std::vector<std::string> Deleted(const Decision& d) {
  std::vector<std::string> out;
  for (const PodRef& p : d.deletes) out.push_back(p.name);
  return out;
}

const ReplicaState& State(const Decision& d, int64_t index) {
  for (const ReplicaState& r : d.replicas) {
    if (r.index == index) return r;
  }
  static ReplicaState none;
  ADD_FAILURE() << "no replica " << index;
  return none;
}

json StatusWith(int64_t index, const std::string& phase, int64_t restarts = 0,
                absl::Time last_failure = absl::InfinitePast(), int64_t backoff_s = 0) {
  json e = {{"index", index}, {"phase", phase}, {"restarts", restarts}};
  if (last_failure != absl::InfinitePast()) {
    e["lastFailureTime"] = Rfc3339(last_failure);
    e["backoffSeconds"] = backoff_s;
  }
  return {{"replicaStatuses", json::array({e})}};
}

TEST(Decide, NewModelPlacesEveryReplica) {
  const ModelView m = ModelBuilder().Replicas(2).Build();
  const Decision d = Decide(m, {}, json::object(), kNow, {});
  EXPECT_EQ(d.place, (std::vector<int64_t>{0, 1}));
  EXPECT_TRUE(d.deletes.empty());
  EXPECT_EQ(d.replicas.size(), 2u);
}

TEST(Decide, ReadyReplicasNeedNothing) {
  const ModelView m = ModelBuilder().Replicas(2).Build();
  const Decision d = Decide(m, Replicas(m, 2), json::object(), kNow, {});
  EXPECT_TRUE(d.place.empty());
  EXPECT_TRUE(d.deletes.empty());
  EXPECT_EQ(State(d, 1).phase, ReplicaPhase::kReady);
  EXPECT_TRUE(State(d, 1).updated);
}

TEST(Decide, ScaleDownRemovesWholeReplicasHighestFirst) {
  const ModelView m = ModelBuilder().Replicas(1).Build();
  const Decision d = Decide(m, Replicas(m, 3), json::object(), kNow, {});
  EXPECT_EQ(Deleted(d), (std::vector<std::string>{"m-2-1", "m-2-0", "m-1-1", "m-1-0"}));
  EXPECT_EQ(d.replicas.size(), 1u);
}

TEST(Decide, AFailedPodRecreatesTheWholeReplicaWithBackoff) {
  const ModelView m = ModelBuilder().Build();
  Timing t;
  std::vector<PodView> pods = {PodBuilder(m, 0, 0), PodBuilder(m, 0, 1).Failed()};
  Decision d = Decide(m, pods, json::object(), kNow, t);
  EXPECT_EQ(Deleted(d), (std::vector<std::string>{"m-0-1", "m-0-0"}));
  EXPECT_EQ(d.restarts, 1);
  EXPECT_EQ(State(d, 0).phase, ReplicaPhase::kFailed);
  EXPECT_EQ(State(d, 0).restarts, 1);
  EXPECT_EQ(State(d, 0).backoff, t.backoff_base);
  EXPECT_NE(State(d, 0).message.find("m-0-1 failed"), std::string::npos);

  // Failing again soon after: the backoff doubles.
  d = Decide(m, pods, StatusWith(0, "Ready", 1, kNow - absl::Seconds(30), 2), kNow, t);
  EXPECT_EQ(State(d, 0).restarts, 2);
  EXPECT_EQ(State(d, 0).backoff, absl::Seconds(4));
  // After running longer than backoff_reset: back to the base.
  d = Decide(m, pods, StatusWith(0, "Ready", 5, kNow - absl::Hours(1), 64), kNow, t);
  EXPECT_EQ(State(d, 0).restarts, 6);
  EXPECT_EQ(State(d, 0).backoff, t.backoff_base);
}

TEST(Decide, ARecreatedReplicaWaitsOutItsBackoff) {
  const ModelView m = ModelBuilder().Build();
  Decision d = Decide(m, {}, StatusWith(0, "Failed", 3, kNow - absl::Seconds(1), 8), kNow, {});
  EXPECT_TRUE(d.place.empty());
  EXPECT_EQ(State(d, 0).phase, ReplicaPhase::kFailed);
  EXPECT_EQ(d.requeue_after, absl::Seconds(7));
  d = Decide(m, {}, StatusWith(0, "Failed", 3, kNow - absl::Seconds(9), 8), kNow, {});
  EXPECT_EQ(d.place, (std::vector<int64_t>{0}));
  // Its old pods still terminating: still Failed (not Pending) until the backoff ends.
  PodView going = PodBuilder(m, 0, 0);
  going.deleting = true;
  d = Decide(m, {going}, StatusWith(0, "Failed", 3, kNow - absl::Seconds(1), 8), kNow, {});
  EXPECT_EQ(State(d, 0).phase, ReplicaPhase::kFailed);
  EXPECT_TRUE(d.place.empty());
}

TEST(Decide, DeletedStageIsAFailureButOldPodsGoingAwayAreNot) {
  const ModelView m = ModelBuilder().Build();
  PodView gone = PodBuilder(m, 0, 1);
  gone.deleting = true;
  Decision d = Decide(m, {PodBuilder(m, 0, 0), gone}, json::object(), kNow, {});
  EXPECT_EQ(Deleted(d), (std::vector<std::string>{"m-0-0"}));
  EXPECT_EQ(d.restarts, 1);
  // Every pod already terminating (the operator deleted them): wait, place nothing yet.
  PodView also = PodBuilder(m, 0, 0);
  also.deleting = true;
  d = Decide(m, {also, gone}, json::object(), kNow, {});
  EXPECT_TRUE(d.deletes.empty());
  EXPECT_TRUE(d.place.empty());
  EXPECT_EQ(d.restarts, 0);
}

TEST(Decide, FailurePolicyNoneLeavesTheReplica) {
  const ModelView m = ModelBuilder().FailurePolicy("None").Build();
  const Decision d =
      Decide(m, {PodBuilder(m, 0, 0), PodBuilder(m, 0, 1).Failed()}, json::object(), kNow, {});
  EXPECT_TRUE(d.deletes.empty());
  EXPECT_EQ(d.restarts, 0);
  EXPECT_EQ(State(d, 0).phase, ReplicaPhase::kFailed);
}

TEST(Decide, InterruptedCreationIsCompletedOnItsPlan) {
  const ModelView m = ModelBuilder().Build();
  const std::vector<PodView> half = {PodBuilder(m, 0, 0)};
  Decision d = Decide(m, half, StatusWith(0, "Placing"), kNow, {});
  ASSERT_EQ(d.creates.size(), 1u);
  EXPECT_EQ(d.creates[0].stage, 1);
  EXPECT_EQ(d.creates[0].nodes, (std::vector<std::string>{"n0", "n1"}));
  EXPECT_TRUE(d.deletes.empty());
  EXPECT_EQ(d.restarts, 0);
  // The same picture after the replica had been Starting: a stage is gone, a failure.
  d = Decide(m, half, StatusWith(0, "Ready"), kNow, {});
  EXPECT_TRUE(d.creates.empty());
  EXPECT_EQ(d.restarts, 1);
}

TEST(Decide, UnschedulablePodsAreReplannedAfterTheTimeout) {
  const ModelView m = ModelBuilder().Build();
  Timing t;
  t.unschedulable_timeout = absl::Minutes(2);
  std::vector<PodView> pods = {PodBuilder(m, 0, 0).Pending(true, absl::Seconds(30)),
                               PodBuilder(m, 0, 1).Pending(false, absl::Seconds(30))};
  Decision d = Decide(m, pods, StatusWith(0, "Placing"), kNow, t);
  EXPECT_TRUE(d.deletes.empty());
  EXPECT_EQ(State(d, 0).phase, ReplicaPhase::kPlacing);
  EXPECT_NE(State(d, 0).message.find("0/2 nodes are available"), std::string::npos);
  EXPECT_EQ(d.requeue_after, absl::Seconds(90));
  pods = {PodBuilder(m, 0, 0).Pending(true, absl::Minutes(3)),
          PodBuilder(m, 0, 1).Pending(false, absl::Minutes(3))};
  d = Decide(m, pods, StatusWith(0, "Placing"), kNow, t);
  EXPECT_EQ(Deleted(d).size(), 2u);
  EXPECT_EQ(d.replans, 1);
  EXPECT_EQ(d.restarts, 0);
}

TEST(Decide, PodsOfAnEarlierModelOfTheSameNameGoAndHoldTheirIndex) {
  const ModelView m = ModelBuilder().Build();
  const Decision d = Decide(m, {PodBuilder(m, 0, 0).Owner("old-uid")}, json::object(), kNow, {});
  EXPECT_EQ(Deleted(d), (std::vector<std::string>{"m-0-0"}));
  EXPECT_TRUE(d.place.empty());
}

TEST(Decide, RolloutTakesDownOneServingReplicaAtATimeHighestFirst) {
  const ModelView old_m = ModelBuilder().Replicas(3).Build();
  const ModelView m = ModelBuilder().Replicas(3).Image("w:2").Build();
  ASSERT_NE(old_m.revision, m.revision);
  Decision d = Decide(m, Replicas(old_m, 3), json::object(), kNow, {});
  EXPECT_EQ(Deleted(d), (std::vector<std::string>{"m-2-1", "m-2-0"}));
  EXPECT_TRUE(d.place.empty());
  // Replica 2 gone: it is placed at the new revision; no other serving replica goes meanwhile.
  std::vector<PodView> pods = Replicas(old_m, 2);
  d = Decide(m, pods, json::object(), kNow, {});
  EXPECT_TRUE(d.deletes.empty());
  EXPECT_EQ(d.place, (std::vector<int64_t>{2}));
  // Replica 2 at the new revision, starting: still nothing else goes.
  pods.push_back(PodBuilder(m, 2, 0).NotReady());
  pods.push_back(PodBuilder(m, 2, 1).NotReady());
  d = Decide(m, pods, json::object(), kNow, {});
  EXPECT_TRUE(d.deletes.empty());
  // Ready: replica 1 is next.
  pods.resize(4);
  for (const PodView& p : Replica(m, 2)) pods.push_back(p);
  d = Decide(m, pods, json::object(), kNow, {});
  EXPECT_EQ(Deleted(d), (std::vector<std::string>{"m-1-1", "m-1-0"}));
}

TEST(Decide, OutdatedReplicasThatServeNothingGoAtOnce) {
  const ModelView old_m = ModelBuilder().Replicas(2).Build();
  const ModelView m = ModelBuilder().Replicas(2).Image("w:3").Build();
  std::vector<PodView> pods = {PodBuilder(old_m, 0, 0).NotReady(), PodBuilder(old_m, 0, 1),
                               PodBuilder(old_m, 1, 0).NotReady(), PodBuilder(old_m, 1, 1)};
  const Decision d = Decide(m, pods, json::object(), kNow, {});
  EXPECT_EQ(Deleted(d).size(), 4u);
}

TEST(Decide, MaxSurgeAddsAReplicaFirstAndRemovesItAtTheEnd) {
  const ModelView old_m = ModelBuilder().Replicas(1).Rollout(0, 1).Build();
  const ModelView m = ModelBuilder().Replicas(1).Rollout(0, 1).Image("w:2").Build();
  // Outdated replica 0 serves: a surge replica 1 is placed, replica 0 stays.
  Decision d = Decide(m, Replicas(old_m, 1), json::object(), kNow, {});
  EXPECT_TRUE(d.deletes.empty());
  EXPECT_EQ(d.place, (std::vector<int64_t>{1}));
  // Surge ready: replica 0 goes.
  std::vector<PodView> pods = Replica(old_m, 0);
  for (const PodView& p : Replica(m, 1)) pods.push_back(p);
  d = Decide(m, pods, json::object(), kNow, {});
  EXPECT_EQ(Deleted(d), (std::vector<std::string>{"m-0-1", "m-0-0"}));
  // Replica 0 updated and ready: the surge goes.
  pods = Replica(m, 0);
  for (const PodView& p : Replica(m, 1)) pods.push_back(p);
  d = Decide(m, pods, json::object(), kNow, {});
  EXPECT_EQ(Deleted(d), (std::vector<std::string>{"m-1-1", "m-1-0"}));
}

TEST(Decide, ANewerChangeSupersedesARolloutInProgress) {
  const ModelView v1 = ModelBuilder().Replicas(2).Build();
  const ModelView v2 = ModelBuilder().Replicas(2).Image("w:2").Build();
  const ModelView v3 = ModelBuilder().Replicas(2).Image("w:3").Build();
  // Replica 1 was being created at v2 (not ready), replica 0 serves v1.
  std::vector<PodView> pods = Replica(v1, 0);
  pods.push_back(PodBuilder(v2, 1, 0).NotReady());
  pods.push_back(PodBuilder(v2, 1, 1).NotReady());
  const Decision d = Decide(v3, pods, json::object(), kNow, {});
  EXPECT_EQ(Deleted(d), (std::vector<std::string>{"m-1-1", "m-1-0"}));
}

TEST(BuildStatus, AllReadyIsCompleteAndAvailable) {
  const ModelView m = ModelBuilder().Replicas(2).Build();
  const Decision d = Decide(m, Replicas(m, 2), json::object(), kNow, {});
  std::vector<Event> events;
  const json s = BuildStatus(m, 7, d, {}, json::object(), kNow, events);
  EXPECT_EQ(s["observedGeneration"], 7);
  EXPECT_EQ(s["readyReplicas"], 2);
  EXPECT_EQ(s["updatedReplicas"], 2);
  EXPECT_EQ(s["ready"], "2/2");
  EXPECT_EQ(s["gpus"], 8);
  EXPECT_EQ(s["phase"], "Ready");
  EXPECT_EQ(s["selector"], "shardserve.io/model=m,shardserve.io/role=leader");
  std::map<std::string, std::string> by_type;
  for (const json& c : s["conditions"]) by_type[c["type"]] = c["status"];
  EXPECT_EQ(by_type, (std::map<std::string, std::string>{{"Available", "True"},
                                                         {"Degraded", "False"},
                                                         {"Invalid", "False"},
                                                         {"Placed", "True"},
                                                         {"Progressing", "False"}}));
}

// TinyLlama-1.1B's footprint (22 layers, 4 KV heads, BF16).
ModelFootprint TinyLlama() {
  auto f = FootprintFromConfig(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
      "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
      "num_key_value_heads": 4, "vocab_size": 32000, "torch_dtype": "bfloat16"})");
  EXPECT_TRUE(f.ok()) << f.status();
  return *f;
}

TEST(BuildStatus, ShowsTheModelsShapeAndEachStagesLayers) {
  ModelView m = ModelBuilder().Build();
  const Decision d = Decide(m, Replicas(m, 1), json::object(), kNow, {});
  std::vector<Event> events;
  json s = BuildStatus(m, 1, d, {}, json::object(), kNow, events);
  EXPECT_FALSE(s["plan"].contains("stageLayers")) << "not before the shape is known";
  EXPECT_FALSE(s.contains("model"));
  m.footprint = TinyLlama();
  m.stage_layers = {{0, 12}, {12, 22}};
  s = BuildStatus(m, 1, d, {}, json::object(), kNow, events);
  EXPECT_EQ(s["plan"]["stageLayers"], json::array({"0-11", "12-21"}));
  EXPECT_FALSE(s["plan"].contains("stageMemory")) << "no memory plan given";
  EXPECT_EQ(s["model"]["uri"], "hostpath:///models/llama");
  EXPECT_EQ(s["model"]["shape"]["layers"], 22);
  EXPECT_EQ(s["model"]["footprint"]["kinds"][0]["kvHeads"], 4);
  // With the memory plan: each stage's bytes and the GPU memory they were checked against.
  ShardedModelSpec spec = m.model.spec;
  spec.pipeline = 2;
  auto plan = PlanSpec(*m.footprint, spec, {});
  ASSERT_TRUE(plan.ok()) << plan.status();
  m.memory = *plan;
  s = BuildStatus(m, 1, d, {}, json::object(), kNow, events);
  ASSERT_EQ(s["plan"]["stageMemory"].size(), 2u);
  EXPECT_NE(s["plan"]["stageMemory"][1].get<std::string>().find("stage 1 needs "),
            std::string::npos);
  EXPECT_NE(s["plan"]["gpuMemory"].get<std::string>().find("unknown"), std::string::npos);
}

// The inspect pod, as ReadPod reads it.
PodView InspectPod(const std::string& uri, const std::string& phase,
                   const std::string& report = "") {
  json pod = {
      {"metadata",
       {{"name", "m-inspect"}, {"uid", "u-i"}, {"annotations", {{kModelUriAnnotation, uri}}}}},
      {"status", {{"phase", phase}}}};
  if (phase == "Succeeded" || phase == "Failed") {
    pod["status"]["containerStatuses"] = json::array(
        {{{"name", "inspect"},
          {"state",
           {{"terminated",
             {{"exitCode", phase == "Failed" ? 1 : 0}, {"reason", "x"}, {"message", report}}}}}}});
  }
  return ReadPod(pod);
}

TEST(ReadShape, FromStatusWhileTheUriStaysTheSame) {
  const std::string uri = "hostpath:///models/llama";
  const ModelFootprint footprint = TinyLlama();
  const ModelShape shape = footprint.shape;
  const std::string report = FootprintToJson(footprint).dump();
  const json status = {{"model", ModelStatus(uri, footprint)}};
  ShapeView v = ReadShape(uri, status, nullptr);
  EXPECT_EQ(v.state, ShapeView::State::kKnown);
  EXPECT_EQ(v.footprint.shape, shape);
  EXPECT_EQ(v.footprint.kinds, footprint.kinds);
  EXPECT_FALSE(v.create_pod || v.delete_pod);
  // Known, and an inspect pod left over: it goes.
  const PodView done = InspectPod(uri, "Succeeded", report);
  EXPECT_TRUE(ReadShape(uri, status, &done).delete_pod);
  // A status of an earlier operator, with a shape and no footprint: read again.
  json old = status;
  old["model"].erase("footprint");
  EXPECT_TRUE(ReadShape(uri, old, nullptr).create_pod);
  // Another uri: read again.
  v = ReadShape("hostpath:///models/other", status, nullptr);
  EXPECT_EQ(v.state, ShapeView::State::kReading);
  EXPECT_TRUE(v.create_pod);
}

TEST(ReadShape, FromTheInspectPodsReport) {
  const std::string uri = "hostpath:///models/llama";
  const ModelFootprint footprint = TinyLlama();
  const std::string report = FootprintToJson(footprint).dump();
  const PodView running = InspectPod(uri, "Running");
  ShapeView v = ReadShape(uri, json::object(), &running);
  EXPECT_EQ(v.state, ShapeView::State::kReading);
  EXPECT_FALSE(v.create_pod || v.delete_pod);
  EXPECT_EQ(v.message, "pod m-inspect is reading it");

  const PodView done = InspectPod(uri, "Succeeded", report);
  v = ReadShape(uri, json::object(), &done);
  EXPECT_EQ(v.state, ShapeView::State::kKnown);
  EXPECT_EQ(v.footprint.shape, footprint.shape);
  EXPECT_EQ(v.footprint.params, footprint.params);
  EXPECT_TRUE(v.delete_pod);

  // A pod of an earlier uri is replaced, never believed.
  const PodView stale = InspectPod("hostpath:///models/old", "Succeeded", report);
  v = ReadShape(uri, json::object(), &stale);
  EXPECT_EQ(v.state, ShapeView::State::kReading);
  EXPECT_TRUE(v.delete_pod);
  EXPECT_FALSE(v.create_pod);
}

TEST(ReadShape, AFailedOrGarbledReadingSaysWhyAndStays) {
  const std::string uri = "hostpath:///models/llama";
  const PodView failed = InspectPod(uri, "Failed", "config.json: not valid JSON");
  ShapeView v = ReadShape(uri, json::object(), &failed);
  EXPECT_EQ(v.state, ShapeView::State::kFailed);
  EXPECT_NE(v.message.find("the model cannot be read: pod m-inspect container inspect exited "
                           "with code 1 (x): config.json: not valid JSON"),
            std::string::npos)
      << v.message;
  EXPECT_NE(v.message.find("(delete pod m-inspect to read it again)"), std::string::npos);
  EXPECT_FALSE(v.delete_pod) << "kept: it says why";
  EXPECT_FALSE(v.create_pod);

  for (const std::string report : {"", "{", "{\"layers\": 22}", "[1,2]", "\xff\xfe"}) {
    const PodView garbled = InspectPod(uri, "Succeeded", report);
    v = ReadShape(uri, json::object(), &garbled);
    EXPECT_EQ(v.state, ShapeView::State::kFailed) << report;
    EXPECT_NE(v.message.find("not the model's footprint"), std::string::npos) << v.message;
  }
}

TEST(ReadShape, AnInspectPodThatCannotStartBlocksTheReplicasToPlace) {
  const std::string uri = "hostpath:///models/llama";
  PodView stuck = InspectPod(uri, "Pending");
  stuck.stuck = "pod m-inspect container inspect: ErrImagePull: no such image";
  const ShapeView v = ReadShape(uri, json::object(), &stuck);
  EXPECT_EQ(v.state, ShapeView::State::kReading);
  EXPECT_TRUE(v.blocked);
  const ModelView m = ModelBuilder().Replicas(2).Build();
  Decision d = Decide(m, {}, json::object(), kNow, {});
  ASSERT_EQ(d.place.size(), 2u);
  WaitForShape(v, d);
  EXPECT_TRUE(d.place.empty());
  EXPECT_EQ(State(d, 1).phase, ReplicaPhase::kBlocked);
  EXPECT_EQ(State(d, 1).message, "waiting for the model's shape: " + stuck.stuck);
  std::vector<Event> events;
  const json s = BuildStatus(m, 1, d, {}, json::object(), kNow, events);
  EXPECT_EQ(s["phase"], "Degraded");
  for (const json& c : s["conditions"]) {
    if (c["type"] == "Placed") {
      EXPECT_EQ(c["status"], "Unknown");
      EXPECT_EQ(c["reason"], "ReadingModel");
    }
  }
  // Still reading, nothing in its way: Pending.
  const PodView running = InspectPod(uri, "Running");
  d = Decide(m, {}, json::object(), kNow, {});
  WaitForShape(ReadShape(uri, json::object(), &running), d);
  EXPECT_EQ(State(d, 0).phase, ReplicaPhase::kPending);
  EXPECT_EQ(State(d, 0).message, "waiting for the model's shape: pod m-inspect is reading it");
}

TEST(BuildStatus, UnplacedReplicasSayWhyAndTransitionsAreEvents) {
  const ModelView m = ModelBuilder().Replicas(1).Build();
  Decision d = Decide(m, {}, json::object(), kNow, {});
  PlacementOutcome outcome;
  outcome.unplaced[0] = "replica 0 needs 2 nodes with 2 free nvidia.com/gpu; 1 has them";
  ApplyPlacement(outcome, m.revision, d);
  std::vector<Event> events;
  const json first = BuildStatus(m, 1, d, outcome, json::object(), kNow, events);
  EXPECT_EQ(first["phase"], "Pending");
  EXPECT_EQ(first["replicaStatuses"][0]["message"], outcome.unplaced[0]);
  json placed;
  for (const json& c : first["conditions"]) {
    if (c["type"] == "Placed") placed = c;
  }
  EXPECT_EQ(placed["status"], "False");
  EXPECT_EQ(placed["reason"], "InsufficientGPUs");
  EXPECT_TRUE(std::any_of(events.begin(), events.end(), [](const Event& e) {
    return e.reason == "InsufficientGPUs" && e.type == "Warning";
  }));
  // Later, the same status: the transition time holds and no event repeats.
  events.clear();
  const json again = BuildStatus(m, 1, d, outcome, first, kNow + absl::Minutes(1), events);
  EXPECT_EQ(again, first);
  EXPECT_TRUE(events.empty());
}

TEST(InvalidStatus, KeepsWhatRunsAndSaysWhy) {
  std::vector<Event> events;
  const json old = {{"readyReplicas", 2}, {"phase", "Ready"}};
  const json s = InvalidStatus(3, "spec.model.uri is bad", old, kNow, events);
  EXPECT_EQ(s["readyReplicas"], 2);
  EXPECT_EQ(s["phase"], "Invalid");
  EXPECT_EQ(s["conditions"][0]["type"], "Invalid");
  EXPECT_EQ(s["conditions"][0]["status"], "True");
  EXPECT_EQ(s["conditions"][0]["message"], "spec.model.uri is bad");
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].type, "Warning");
}

TEST(ReadPod, ReadsLabelsPlanAndTrouble) {
  const json pod = json::parse(R"({
    "metadata": {"name": "m-1-0", "uid": "u", "creationTimestamp": "2027-01-15T08:00:00Z",
                 "labels": {"shardserve.io/replica": "1", "shardserve.io/stage": "0",
                            "shardserve.io/revision": "abc"},
                 "annotations": {"shardserve.io/placement": "a,b"},
                 "ownerReferences": [{"uid": "owner", "controller": true}]},
    "spec": {"nodeName": "a"},
    "status": {"phase": "Running",
               "conditions": [{"type": "Ready", "status": "True"}],
               "containerStatuses": [{"name": "worker", "restartCount": 1,
                                      "state": {"running": {}}}]}})");
  const PodView v = ReadPod(pod);
  EXPECT_EQ(v.replica, 1);
  EXPECT_EQ(v.stage, 0);
  EXPECT_EQ(v.revision, "abc");
  EXPECT_EQ(v.owner_uid, "owner");
  EXPECT_EQ(v.placement, (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(v.ready);
  EXPECT_TRUE(v.started);
  EXPECT_EQ(v.created,
            absl::FromCivil(absl::CivilSecond(2027, 1, 15, 8, 0, 0), absl::UTCTimeZone()));
  EXPECT_EQ(v.failure, "pod m-1-0 restarted 1 time(s)");

  json unsched = pod;
  unsched["spec"].erase("nodeName");
  unsched["status"] = json::parse(R"({"phase": "Pending", "conditions": [
      {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
       "message": "0/3 nodes are available"}]})");
  const PodView u = ReadPod(unsched);
  EXPECT_TRUE(u.unschedulable);
  EXPECT_FALSE(u.started);
  EXPECT_EQ(u.unschedulable_message, "0/3 nodes are available");
  EXPECT_TRUE(u.failure.empty());
}

TEST(ReadPod, QuotesWhyAContainerEndedOrCannotStart) {
  json pod = json::parse(R"({
    "metadata": {"name": "m-0-1", "uid": "u",
                 "labels": {"shardserve.io/replica": "0", "shardserve.io/stage": "1"}},
    "spec": {"nodeName": "a"},
    "status": {"phase": "Failed", "containerStatuses": [{"name": "worker", "state": {
      "terminated": {"exitCode": 1, "reason": "Error",
                     "message": "rank 3 (stage 1, tp 1): heads do not divide\n\n"}}}]}})");
  EXPECT_EQ(ReadPod(pod).failure,
            "pod m-0-1 container worker exited with code 1 (Error): rank 3 (stage 1, tp 1): "
            "heads do not divide");

  pod["status"] = json::parse(R"({"phase": "Pending", "containerStatuses": [{"name": "worker",
      "state": {"waiting": {"reason": "ImagePullBackOff",
                            "message": "Back-off pulling image \"x:absent\""}}}]})");
  PodView v = ReadPod(pod);
  EXPECT_EQ(v.stuck,
            "pod m-0-1 container worker: ImagePullBackOff: Back-off pulling image \"x:absent\"");
  EXPECT_TRUE(v.failure.empty());
  EXPECT_FALSE(v.creating);

  pod["status"]["containerStatuses"][0]["state"]["waiting"] = {{"reason", "ContainerCreating"}};
  v = ReadPod(pod);
  EXPECT_TRUE(v.stuck.empty());
  EXPECT_TRUE(v.creating);  // the controller reads its FailedMount events, if any
}

TEST(ReadPod, ReadsTheAddressAndImageAStartingPodIsAskedAbout) {
  const json pod = json::parse(R"({
    "metadata": {"name": "m-0-1", "uid": "u",
                 "labels": {"shardserve.io/replica": "0", "shardserve.io/stage": "1"}},
    "spec": {"nodeName": "a", "containers": [{"name": "worker", "image": "reg/worker:1"}]},
    "status": {"phase": "Running", "podIP": "10.244.2.7",
               "conditions": [{"type": "Ready", "status": "False"}]}})");
  const PodView v = ReadPod(pod);
  EXPECT_EQ(v.pod_ip, "10.244.2.7");
  EXPECT_EQ(v.image, "reg/worker:1");
  EXPECT_FALSE(v.ready);
  EXPECT_TRUE(v.startup.empty());  // the controller asks the kubelet's events or the ranks
}

// A starting replica says what each stage's pod is doing, in stage order, and is looked at
// again soon (a pull's or a load's progress changes no watched object); without a word from
// the pods it says what it waits for.
TEST(Decide, AStartingReplicaSaysWhatEachStageIsDoing) {
  const ModelView m = ModelBuilder().Build();
  PodView leader = PodBuilder(m, 0, 0).NotReady();
  leader.startup =
      "stage 0: waiting at the rendezvous for rank 2 (stage 1, tp 0), rank 3 "
      "(stage 1, tp 1)";
  PodView pulling = PodBuilder(m, 0, 1).NotReady();
  pulling.phase = "Pending";
  pulling.started = false;
  pulling.creating = true;
  pulling.startup = "stage 1: pulling image w:1";
  Decision d = Decide(m, {pulling, leader}, json::object(), kNow, {});
  EXPECT_EQ(State(d, 0).phase, ReplicaPhase::kStarting);
  EXPECT_EQ(State(d, 0).message, leader.startup + "; " + pulling.startup);
  EXPECT_LE(d.requeue_after, absl::Seconds(5));
  EXPECT_TRUE(d.deletes.empty());

  pulling.startup = "stage 1 rank 2: loading 41 %; stage 1 rank 3: loading 40 %";
  pulling.phase = "Running";
  d = Decide(m, {leader, pulling}, json::object(), kNow, {});
  EXPECT_EQ(State(d, 0).message, leader.startup + "; " + pulling.startup);

  d = Decide(m, {PodBuilder(m, 0, 0).NotReady(), PodBuilder(m, 0, 1)}, json::object(), kNow, {});
  EXPECT_EQ(State(d, 0).message, "waiting for every rank to be ready");
}

TEST(LastLine, IsTheLastNonEmptyLineBoundedOnACharacter) {
  EXPECT_EQ(LastLine("a\n  b c  \n\n \n"), "b c");
  EXPECT_EQ(LastLine(""), "");
  const std::string long_line = std::string(299, 'x') + "\xc3\xa9" + "tail";
  EXPECT_EQ(LastLine(long_line), std::string(299, 'x') + "...");
}

TEST(Decide, APodThatCannotStartBlocksItsReplicaWithoutRecreatingIt) {
  const ModelView m = ModelBuilder().Build();
  PodView stuck = PodBuilder(m, 0, 1).NotReady();
  stuck.phase = "Pending";
  stuck.stuck = "pod m-0-1: FailedMount: hostPath type check failed: /models/x is not a directory";
  const Decision d = Decide(m, {PodBuilder(m, 0, 0), stuck}, json::object(), kNow, {});
  EXPECT_EQ(State(d, 0).phase, ReplicaPhase::kBlocked);
  EXPECT_EQ(State(d, 0).message, stuck.stuck);
  EXPECT_TRUE(d.deletes.empty());
  EXPECT_EQ(d.restarts, 0);

  std::vector<Event> events;
  const json status = BuildStatus(m, 1, d, {}, json::object(), kNow, events);
  EXPECT_EQ(status["phase"], "Degraded");
  EXPECT_EQ(status["replicaStatuses"][0]["phase"], "Blocked");
  bool degraded = false;
  for (const json& c : status["conditions"]) {
    if (c["type"] == "Degraded") {
      degraded = c["status"] == "True" && c["reason"] == "ReplicaBlocked" &&
                 c["message"].get<std::string>().find("not a directory") != std::string::npos;
    }
  }
  EXPECT_TRUE(degraded);
}

TEST(Decide, AFailedReplicaKeepsSayingWhyThroughItsBackoff) {
  const ModelView m = ModelBuilder().Build();
  const std::vector<PodView> pods = {PodBuilder(m, 0, 0), PodBuilder(m, 0, 1).Failed()};
  Decision d = Decide(m, pods, json::object(), kNow, {});
  std::vector<Event> events;
  const json status = BuildStatus(m, 1, d, {}, json::object(), kNow, events);
  EXPECT_EQ(status["replicaStatuses"][0]["lastFailureMessage"], "pod m-0-1 failed");
  // The pods gone, the replica waits out its backoff: the cause is still in its message.
  d = Decide(m, {}, status, kNow + absl::Milliseconds(500), {});
  EXPECT_EQ(State(d, 0).phase, ReplicaPhase::kFailed);
  EXPECT_EQ(State(d, 0).message.rfind("pod m-0-1 failed; recreating in", 0), 0u)
      << State(d, 0).message;
}

}  // namespace
}  // namespace shardserve::op
