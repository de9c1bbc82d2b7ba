// The reconciler's pure decisions (operator/reconcile.h): scaling, gang failure and backoff,
// interrupted creation, unschedulable re-planning, rollouts within maxUnavailable/maxSurge, and
// the status with its conditions.
#include "operator/reconcile.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "absl/strings/match.h"
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
  PodBuilder& ReadySince(absl::Time t) {
    p_.ready_since = t;
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
  PodBuilder& Cordoned() {
    p_.node_cordoned = true;
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
  // Ready for a second (a Ready condition can flap just after a pod starts): it does not count
  // as serving yet, and the model is looked at again when it has been ready for min_ready.
  pods.resize(4);
  pods.push_back(PodBuilder(m, 2, 0).ReadySince(kNow - absl::Seconds(1)));
  pods.push_back(PodBuilder(m, 2, 1).ReadySince(kNow - absl::Seconds(3)));
  d = Decide(m, pods, json::object(), kNow, {});
  EXPECT_TRUE(d.deletes.empty());
  EXPECT_EQ(State(d, 2).phase, ReplicaPhase::kReady);
  EXPECT_EQ(d.requeue_after, absl::Seconds(4));
  // Ready for min_ready: replica 1 is next.
  pods.resize(4);
  pods.push_back(PodBuilder(m, 2, 0).ReadySince(kNow - absl::Seconds(5)));
  pods.push_back(PodBuilder(m, 2, 1).ReadySince(kNow - absl::Seconds(30)));
  d = Decide(m, pods, json::object(), kNow, {});
  EXPECT_EQ(Deleted(d), (std::vector<std::string>{"m-1-1", "m-1-0"}));
}

// A node drained (cordoned): the serving replicas with a pod there move one at a time within
// maxUnavailable (highest first), saying why; one that serves nothing goes at once.
TEST(Decide, ReplicasOnACordonedNodeMoveOneAtATime) {
  const ModelView m = ModelBuilder().Replicas(3).Build();
  std::vector<PodView> pods = {PodBuilder(m, 0, 0), PodBuilder(m, 0, 1).Cordoned(),
                               PodBuilder(m, 1, 0), PodBuilder(m, 1, 1).Cordoned(),
                               PodBuilder(m, 2, 0), PodBuilder(m, 2, 1)};
  Decision d = Decide(m, pods, json::object(), kNow, {});
  EXPECT_EQ(Deleted(d), (std::vector<std::string>{"m-1-1", "m-1-0"}));
  EXPECT_TRUE(absl::StrContains(State(d, 1).message, "being moved off cordoned node n1"))
      << State(d, 1).message;
  EXPECT_TRUE(absl::StrContains(State(d, 0).message, "on cordoned node n1; to be moved"))
      << State(d, 0).message;
  ASSERT_FALSE(d.events.empty());
  EXPECT_EQ(d.events.back().reason, "MovingReplica");
  EXPECT_TRUE(absl::StrContains(d.events.back().message, "2 of 3 replicas serving meanwhile"))
      << d.events.back().message;
  // Replica 1 being replaced (not ready): replica 0 waits.
  pods[2] = PodBuilder(m, 1, 0).NotReady();
  pods[3] = PodBuilder(m, 1, 1).NotReady();
  d = Decide(m, pods, json::object(), kNow, {});
  EXPECT_TRUE(d.deletes.empty());
  // A replica on the node that serves nothing goes at once.
  pods[0] = PodBuilder(m, 0, 0).NotReady();
  d = Decide(m, pods, json::object(), kNow, {});
  EXPECT_EQ(Deleted(d), (std::vector<std::string>{"m-0-1", "m-0-0"}));
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

// An inspection's key (InspectionKey): the models that read their model alike share it.
constexpr char kKey[] = "0123456789abcdef";

TEST(ReadShape, FromStatusWhileTheUriStaysTheSame) {
  const std::string uri = "hostpath:///models/llama";
  const ModelFootprint footprint = TinyLlama();
  const ModelShape shape = footprint.shape;
  const std::string report = FootprintToJson(footprint).dump();
  const json status = {{"model", ModelStatus(uri, kKey, footprint, std::nullopt)}};
  ShapeView v = ReadShape(uri, kKey, status, nullptr, nullptr);
  EXPECT_EQ(v.state, ShapeView::State::kKnown);
  EXPECT_EQ(v.footprint.shape, shape);
  EXPECT_EQ(v.footprint.kinds, footprint.kinds);
  EXPECT_FALSE(v.create_pod || v.delete_pod);
  // Known, and an inspect pod left over: it goes.
  const PodView done = InspectPod(uri, "Succeeded", report);
  EXPECT_TRUE(ReadShape(uri, kKey, status, nullptr, &done).delete_pod);
  // A status of an earlier operator, with a shape and no footprint: read again.
  json old = status;
  old["model"].erase("footprint");
  EXPECT_TRUE(ReadShape(uri, kKey, old, nullptr, nullptr).create_pod);
  // Another uri: read again.
  v = ReadShape("hostpath:///models/other", kKey, status, nullptr, nullptr);
  EXPECT_EQ(v.state, ShapeView::State::kReading);
  EXPECT_TRUE(v.create_pod);
  // The same uri read another way (another key: its credentials, its files): read again; a
  // status of an earlier operator, without a key, is taken.
  EXPECT_TRUE(ReadShape(uri, "fedcba9876543210", status, nullptr, nullptr).create_pod);
  json keyless = status;
  keyless["model"].erase("inspection");
  EXPECT_EQ(ReadShape(uri, kKey, keyless, nullptr, nullptr).state, ShapeView::State::kKnown);
}

// A model that has not read its model takes another's reading of the same key (status.model of
// that model) and creates no inspect pod; a reading of another key, or another's keyless one,
// is not taken.
TEST(ReadShape, AnotherModelsInspectionOfTheSameKey) {
  const std::string uri = "hostpath:///models/llama";
  const ModelFootprint footprint = TinyLlama();
  const json other = ModelStatus(uri, kKey, footprint, std::nullopt);
  ShapeView v = ReadShape(uri, kKey, json::object(), &other, nullptr);
  EXPECT_EQ(v.state, ShapeView::State::kKnown);
  EXPECT_EQ(v.footprint.shape, footprint.shape);
  EXPECT_FALSE(v.create_pod);
  const PodView running = InspectPod(uri, "Running");
  EXPECT_TRUE(ReadShape(uri, kKey, json::object(), &other, &running).delete_pod);
  EXPECT_TRUE(ReadShape(uri, "fedcba9876543210", json::object(), &other, nullptr).create_pod);
  json keyless = other;
  keyless.erase("inspection");
  EXPECT_TRUE(ReadShape(uri, kKey, json::object(), &keyless, nullptr).create_pod);
}

TEST(ReadShape, ARemoteModelNeedsTheRevisionItResolvedTo) {
  const std::string uri = "oci://r.io/m:v1";
  const ModelFootprint footprint = TinyLlama();
  json report = FootprintToJson(footprint);
  // Without a source (an older worker image): not known, the pod says why.
  const PodView without = InspectPod(uri, "Succeeded", report.dump());
  EXPECT_EQ(ReadShape(uri, kKey, json::object(), nullptr, &without).state,
            ShapeView::State::kFailed);
  const std::string digest = "sha256:" + std::string(64, 'b');
  report["source"] = {{"revision", digest}, {"dir", "oci/r.io/m/bbb"}, {"bytes", 10}, {"files", 2}};
  const PodView with = InspectPod(uri, "Succeeded", report.dump());
  ShapeView v = ReadShape(uri, kKey, json::object(), nullptr, &with);
  ASSERT_EQ(v.state, ShapeView::State::kKnown);
  ASSERT_TRUE(v.source);
  EXPECT_EQ(v.source->revision, digest);
  EXPECT_EQ(v.source->dir, "oci/r.io/m/bbb");
  // Kept in status.model, read back from there.
  const json status = {{"model", ModelStatus(uri, kKey, footprint, v.source)}};
  ShapeView again = ReadShape(uri, kKey, status, nullptr, nullptr);
  ASSERT_EQ(again.state, ShapeView::State::kKnown);
  EXPECT_EQ(again.source->dir, "oci/r.io/m/bbb");
  // A directory that would leave the cache is not taken (it becomes a mount's subPath).
  for (const char* dir : {"/etc", "oci/../../etc", ""}) {
    json bad = status;
    bad["model"]["source"]["dir"] = dir;
    EXPECT_TRUE(ReadShape(uri, kKey, bad, nullptr, nullptr).create_pod) << dir;
  }
}

TEST(ApplyDownloads, EachNodesDownloadInStatusWithItsEvents) {
  auto fetching = [](const std::string& name, const std::string& node, int64_t bytes) {
    PodView p;
    p.name = name;
    p.node = node;
    p.fetching = true;
    if (bytes >= 0) p.download = PodView::Download{bytes, 1000, 100.0, (1000.0 - bytes) / 100};
    return p;
  };
  PodView running;
  running.name = "m-0-1";
  running.node = "n3";
  const std::vector<PodView> pods = {fetching("m-0-0", "n1", 400), fetching("m-1-0", "n1", -1),
                                     fetching("m-1-1", "n2", 100), running,
                                     fetching("m-2-0", "n4", -1)};
  json status = {{"phase", "Progressing"}};
  std::vector<Event> events;
  ApplyDownloads(pods, "hf://o/m", json::object(), status, events);
  EXPECT_EQ(status["phase"], "Downloading");
  ASSERT_EQ(status["downloads"].size(), 3u);
  // A node whose fetch step has not said its numbers yet: its pods, no numbers.
  EXPECT_EQ(status["downloads"][2], json::parse(R"({"node": "n4", "pods": ["m-2-0"]})"));
  EXPECT_EQ(status["downloads"][0]["node"], "n1");
  EXPECT_EQ(status["downloads"][0]["bytes"], 400);
  EXPECT_EQ(status["downloads"][0]["totalBytes"], 1000);
  EXPECT_EQ(status["downloads"][0]["bytesPerSecond"], 100);
  EXPECT_EQ(status["downloads"][0]["etaSeconds"], 6);
  EXPECT_EQ(status["downloads"][0]["pods"], json::array({"m-0-0", "m-1-0"}));
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].reason, "Downloading");
  EXPECT_NE(events[0].message.find("node n1: fetching hf://o/m"), std::string::npos);
  // Done on n1: its Downloaded event; a degraded model stays Degraded.
  const json old = status;
  json next = {{"phase", "Degraded"}};
  events.clear();
  ApplyDownloads({pods[2], pods[4]}, "hf://o/m", old, next, events);
  EXPECT_EQ(next["phase"], "Degraded");
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].reason, "Downloaded");
  EXPECT_NE(events[0].message.find("node n1"), std::string::npos);
  // Nothing fetching: no downloads in status.
  json done = {{"phase", "Ready"}, {"downloads", json::array()}};
  ApplyDownloads({running}, "hf://o/m", next, done, events);
  EXPECT_FALSE(done.contains("downloads"));
}

TEST(ReadPod, AFailedFetchStepNamesWhy) {
  json pod = {{"metadata", {{"name", "m-0-0"}, {"uid", "u"}}},
              {"status",
               {{"phase", "Failed"},
                {"initContainerStatuses",
                 json::array({{{"name", "fetch"},
                               {"state",
                                {{"terminated",
                                  {{"exitCode", 1},
                                   {"reason", "Error"},
                                   {"message",
                                    "shardserve fetch: hf://o/m: model.safetensors has "
                                    "SHA-256 x where the source says y"}}}}}}})},
                {"containerStatuses",
                 json::array({{{"name", "worker"},
                               {"state", {{"waiting", {{"reason", "PodInitializing"}}}}}}})}}}};
  const PodView v = ReadPod(pod);
  EXPECT_NE(v.failure.find("container fetch exited with code 1"), std::string::npos) << v.failure;
  EXPECT_NE(v.failure.find("model.safetensors has SHA-256"), std::string::npos);
  pod["status"]["phase"] = "Pending";
  pod["status"]["initContainerStatuses"][0]["state"] = {{"running", json::object()}};
  EXPECT_TRUE(ReadPod(pod).fetching);
  // Ready: its fetch step is over, whatever a stale init status says.
  pod["status"]["conditions"] = json::array({{{"type", "Ready"}, {"status", "True"}}});
  EXPECT_FALSE(ReadPod(pod).fetching);
}

TEST(ReadShape, FromTheInspectPodsReport) {
  const std::string uri = "hostpath:///models/llama";
  const ModelFootprint footprint = TinyLlama();
  const std::string report = FootprintToJson(footprint).dump();
  const PodView running = InspectPod(uri, "Running");
  ShapeView v = ReadShape(uri, kKey, json::object(), nullptr, &running);
  EXPECT_EQ(v.state, ShapeView::State::kReading);
  EXPECT_FALSE(v.create_pod || v.delete_pod);
  EXPECT_EQ(v.message, "pod m-inspect is reading it");

  const PodView done = InspectPod(uri, "Succeeded", report);
  v = ReadShape(uri, kKey, json::object(), nullptr, &done);
  EXPECT_EQ(v.state, ShapeView::State::kKnown);
  EXPECT_EQ(v.footprint.shape, footprint.shape);
  EXPECT_EQ(v.footprint.params, footprint.params);
  EXPECT_TRUE(v.delete_pod);

  // A pod of an earlier uri is replaced, never believed.
  const PodView stale = InspectPod("hostpath:///models/old", "Succeeded", report);
  v = ReadShape(uri, kKey, json::object(), nullptr, &stale);
  EXPECT_EQ(v.state, ShapeView::State::kReading);
  EXPECT_TRUE(v.delete_pod);
  EXPECT_FALSE(v.create_pod);
}

TEST(ReadShape, AFailedOrGarbledReadingSaysWhyAndStays) {
  const std::string uri = "hostpath:///models/llama";
  const PodView failed = InspectPod(uri, "Failed", "config.json: not valid JSON");
  ShapeView v = ReadShape(uri, kKey, json::object(), nullptr, &failed);
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
    v = ReadShape(uri, kKey, json::object(), nullptr, &garbled);
    EXPECT_EQ(v.state, ShapeView::State::kFailed) << report;
    EXPECT_NE(v.message.find("not the model's footprint"), std::string::npos) << v.message;
  }
}

TEST(ReadShape, AnInspectPodThatCannotStartBlocksTheReplicasToPlace) {
  const std::string uri = "hostpath:///models/llama";
  PodView stuck = InspectPod(uri, "Pending");
  stuck.stuck = "pod m-inspect container inspect: ErrImagePull: no such image";
  const ShapeView v = ReadShape(uri, kKey, json::object(), nullptr, &stuck);
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
  WaitForShape(ReadShape(uri, kKey, json::object(), nullptr, &running), d);
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

// The informer caches pods cut down by SlimPod: what ReadPod reads of one must be what it reads of
// the whole pod (the Ready condition's time included, which a rollout waits on: without it every
// ready pod had been ready since ever, and Timing::min_ready held nothing back).
TEST(ReadPod, ReadsASlimmedPodAsTheWholeOne) {
  const json pod = json::parse(R"({
    "metadata": {"name": "m-1-0", "namespace": "ns", "uid": "u", "resourceVersion": "7",
                 "creationTimestamp": "2027-01-15T08:00:00Z",
                 "managedFields": [{"manager": "kubelet"}],
                 "labels": {"shardserve.io/replica": "1", "shardserve.io/stage": "0",
                            "shardserve.io/revision": "abc"},
                 "annotations": {"shardserve.io/placement": "a,b", "other": "x"},
                 "ownerReferences": [{"uid": "owner", "controller": true, "kind": "ShardedModel"}]},
    "spec": {"nodeName": "a", "volumes": [{"name": "shm"}],
             "containers": [{"name": "worker", "image": "w:1", "args": ["--rank", "0"],
                             "resources": {"limits": {"nvidia.com/gpu": "2", "cpu": "4"}}}]},
    "status": {"phase": "Running", "podIP": "10.0.0.5", "qosClass": "Burstable",
               "conditions": [{"type": "Ready", "status": "True",
                               "lastProbeTime": null,
                               "lastTransitionTime": "2027-01-15T08:01:30Z"},
                              {"type": "PodScheduled", "status": "True",
                               "lastTransitionTime": "2027-01-15T08:00:01Z"}],
               "containerStatuses": [{"name": "worker", "restartCount": 1, "ready": true,
                                      "state": {"running": {"startedAt": "2027-01-15T08:00:05Z"}}}]}})");
  json slim = pod;
  SlimPod(slim);
  EXPECT_FALSE(slim["metadata"].contains("managedFields"));
  EXPECT_FALSE(slim["spec"].contains("volumes"));
  const PodView whole = ReadPod(pod), cut = ReadPod(slim);
  EXPECT_EQ(cut.ready_since,
            absl::FromCivil(absl::CivilSecond(2027, 1, 15, 8, 1, 30), absl::UTCTimeZone()));
  EXPECT_EQ(cut.ready_since, whole.ready_since);
  EXPECT_EQ(cut.ready, whole.ready);
  EXPECT_EQ(cut.started, whole.started);
  EXPECT_EQ(cut.created, whole.created);
  EXPECT_EQ(cut.replica, whole.replica);
  EXPECT_EQ(cut.stage, whole.stage);
  EXPECT_EQ(cut.revision, whole.revision);
  EXPECT_EQ(cut.owner_uid, whole.owner_uid);
  EXPECT_EQ(cut.placement, whole.placement);
  EXPECT_EQ(cut.node, whole.node);
  EXPECT_EQ(cut.pod_ip, whole.pod_ip);
  EXPECT_EQ(cut.failure, whole.failure);
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
               "conditions": [{"type": "Ready", "status": "True",
                               "lastTransitionTime": "2027-01-15T08:01:30Z"}],
               "containerStatuses": [{"name": "worker", "restartCount": 1,
                                      "state": {"running": {}}}]}})");
  const PodView v = ReadPod(pod);
  EXPECT_EQ(v.replica, 1);
  EXPECT_EQ(v.stage, 0);
  EXPECT_EQ(v.revision, "abc");
  EXPECT_EQ(v.owner_uid, "owner");
  EXPECT_EQ(v.placement, (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(v.ready);
  EXPECT_EQ(v.ready_since,
            absl::FromCivil(absl::CivilSecond(2027, 1, 15, 8, 1, 30), absl::UTCTimeZone()));
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

// Decide's steps, each on its own (operator/reconcile.h, namespace decide).

// Observe: one index's pods as the reconciler reads them, a row per situation.
TEST(DecideSteps, ObserveReadsOneIndexsPods) {
  const ModelView m = ModelBuilder().Build();
  struct Row {
    const char* name;
    std::vector<PodView> pods;
    bool creating;
    bool ready, outdated, unbound;
    std::string failure;  // a substring; "" none
    std::vector<int64_t> missing;
    bool unschedulable, waiting;
  };
  PodView deleting = PodBuilder(m, 0, 1);
  deleting.deleting = true;
  PodView starting = PodBuilder(m, 0, 1).NotReady();
  starting.startup = "stage 1 rank 0: loading 41 %";
  const std::vector<Row> rows = {
      {"ready", Replica(m, 0), false, true, false, false, "", {}, false, false},
      {"not ready",
       {PodBuilder(m, 0, 0), starting},
       false,
       false,
       false,
       false,
       "",
       {},
       false,
       false},
      {"another revision",
       {PodBuilder(m, 0, 0).Revision("old"), PodBuilder(m, 0, 1)},
       false,
       true,
       true,
       false,
       "",
       {},
       false,
       false},
      {"a failed pod",
       {PodBuilder(m, 0, 0), PodBuilder(m, 0, 1).Failed()},
       false,
       false,
       false,
       false,
       "failed",
       {},
       false,
       false},
      {"a stage deleted",
       {PodBuilder(m, 0, 0), deleting},
       false,
       false,
       false,
       false,
       "was deleted",
       {1},
       false,
       false},
      {"a started stage gone",
       {PodBuilder(m, 0, 0)},
       false,
       false,
       false,
       false,
       "is gone",
       {1},
       false,
       false},
      {"creation interrupted",
       {PodBuilder(m, 0, 0)},
       true,
       false,
       false,
       false,
       "",
       {1},
       false,
       false},
      {"unschedulable past the timeout",
       {PodBuilder(m, 0, 0).Pending(true, absl::Minutes(3)), PodBuilder(m, 0, 1)},
       false,
       false,
       false,
       true,
       "",
       {},
       true,
       false},
      {"unschedulable within the timeout",
       {PodBuilder(m, 0, 0).Pending(true, absl::Seconds(30)), PodBuilder(m, 0, 1)},
       false,
       false,
       false,
       true,
       "",
       {},
       false,
       true},
      {"no pods", {}, false, false, false, false, "", {0, 1}, false, false},
  };
  for (const Row& row : rows) {
    std::vector<const PodView*> list;
    for (const PodView& p : row.pods) list.push_back(&p);
    absl::Duration requeue = absl::InfiniteDuration();
    const decide::Observed o = decide::Observe(0, list, row.creating, m, kNow, Timing(), requeue);
    EXPECT_EQ(o.ready, row.ready) << row.name;
    EXPECT_EQ(o.outdated, row.outdated) << row.name;
    EXPECT_EQ(o.unbound, row.unbound) << row.name;
    EXPECT_EQ(o.missing, row.missing) << row.name;
    if (row.failure.empty()) {
      EXPECT_EQ(o.failure, "") << row.name;
    } else {
      EXPECT_NE(o.failure.find(row.failure), std::string::npos) << row.name << ": " << o.failure;
    }
    EXPECT_EQ(!o.unschedulable.empty(), row.unschedulable) << row.name;
    EXPECT_EQ(!o.waiting.empty(), row.waiting) << row.name;
    if (row.waiting) EXPECT_EQ(requeue, absl::Seconds(90)) << row.name;  // the 2 min timeout
  }
  // What starting stages are doing is kept, and brings the next look forward.
  std::vector<const PodView*> list = {&starting};
  absl::Duration requeue = absl::InfiniteDuration();
  EXPECT_EQ(decide::Observe(0, list, false, m, kNow, Timing(), requeue).starting,
            "stage 1 rank 0: loading 41 %");
  EXPECT_EQ(requeue, absl::Seconds(5));
}

// ReachOf: surge replicas while outdated replicas remain, kept until every replica is ready.
TEST(DecideSteps, ReachOfSurgesOnlyDuringARollout) {
  auto observed = [](bool outdated, bool ready, bool live) {
    decide::Observed o;
    o.outdated = outdated;
    o.ready = ready;
    static const PodView pod;
    if (live) o.live = {&pod};
    return o;
  };
  struct Row {
    const char* name;
    std::map<int64_t, decide::Observed> obs;
    int64_t replicas, max_surge;
    bool surge;
    int64_t limit;
  };
  const std::vector<Row> rows = {
      {"steady",
       {{0, observed(false, true, true)}, {1, observed(false, true, true)}},
       2,
       1,
       false,
       2},
      {"an outdated replica",
       {{0, observed(true, true, true)}, {1, observed(false, true, true)}},
       2,
       1,
       true,
       3},
      {"outdated, no surge allowed", {{0, observed(true, true, true)}}, 1, 0, false, 1},
      {"surge kept while one is not ready",
       {{0, observed(false, false, true)}, {1, observed(false, true, true)}},
       1,
       1,
       true,
       2},
      {"surge dropped once all are ready",
       {{0, observed(false, true, true)}, {1, observed(false, true, true)}},
       1,
       1,
       false,
       1},
      {"an outdated surge replica is no surge",
       {{0, observed(false, false, true)}, {1, observed(true, true, true)}},
       1,
       1,
       false,
       1},
  };
  for (const Row& row : rows) {
    const decide::Reach r = decide::ReachOf(row.obs, row.replicas, row.max_surge);
    EXPECT_EQ(r.surge, row.surge) << row.name;
    EXPECT_EQ(r.limit, row.limit) << row.name;
  }
}

// Judge: one replica's phase and the action it needs, a row per branch.
TEST(DecideSteps, JudgeGivesEachReplicaItsPhaseAndAction) {
  const ModelView m = ModelBuilder().Build();
  const ModelView none = ModelBuilder().FailurePolicy("None").Build();
  PodView old = PodBuilder(m, 0, 0).Revision("old");
  PodView old1 = PodBuilder(m, 0, 1).Revision("old");
  PodView ready0 = PodBuilder(m, 0, 0), ready1 = PodBuilder(m, 0, 1);
  PodView unbound = PodBuilder(m, 0, 1).Pending(false, absl::Seconds(1));
  PodView unplanned = PodBuilder(m, 0, 0);
  unplanned.placement.clear();
  auto obs = [](std::vector<const PodView*> live) {
    decide::Observed o;
    o.live = live;
    o.pods = live;
    o.ready = !live.empty();
    return o;
  };
  ReplicaState fresh;
  ReplicaState backing_off;
  backing_off.last_failure = kNow - absl::Seconds(1);
  backing_off.backoff = absl::Seconds(4);
  backing_off.restarts = 1;
  backing_off.last_failure_message = "pod x failed";
  ReplicaState failed_before = backing_off;  // failed 1 s ago with a 4 s backoff: doubles
  struct Row {
    const char* name;
    decide::Observed o;
    ReplicaState record;
    const ModelView* model;
    ReplicaPhase phase;
    std::string message;  // a substring
    bool delete_live, place, outdated_serving, restart, replan;
    std::vector<int64_t> create_stages;
    absl::Duration requeue;
  };
  decide::Observed empty = obs({});
  decide::Observed leftovers = obs({});
  leftovers.pods = {&old};
  decide::Observed outdated_ready = obs({&old, &old1});
  outdated_ready.outdated = true;
  decide::Observed outdated_starting = outdated_ready;
  outdated_starting.ready = false;
  decide::Observed failed = obs({&ready0, &ready1});
  failed.ready = false;
  failed.failure = "pod m-0-1 failed";
  decide::Observed unschedulable = obs({&ready0, &unbound});
  unschedulable.ready = false;
  unschedulable.unschedulable = "pod m-0-1 stayed unschedulable for 121s";
  decide::Observed partial = obs({&ready0});
  partial.ready = false;
  partial.missing = {1};
  decide::Observed partial_unplanned = obs({&unplanned});
  partial_unplanned.ready = false;
  partial_unplanned.missing = {1};
  decide::Observed binding = obs({&ready0, &unbound});
  binding.ready = false;
  binding.unbound = true;
  decide::Observed starting = obs({&ready0, &ready1});
  starting.ready = false;
  starting.starting = "stage 1 rank 0: loading 41 %";
  decide::Observed stuck = starting;
  stuck.stuck = "stage 1: image w:1 cannot be pulled";
  const absl::Duration never = absl::InfiniteDuration();
  const std::vector<Row> rows = {
      {"nothing yet",
       empty,
       fresh,
       &m,
       ReplicaPhase::kPending,
       "placing",
       false,
       true,
       false,
       false,
       false,
       {},
       never},
      {"in its backoff",
       empty,
       backing_off,
       &m,
       ReplicaPhase::kFailed,
       "pod x failed; recreating in 3s (restart 1)",
       false,
       false,
       false,
       false,
       false,
       {},
       absl::Seconds(3)},
      {"old pods terminating",
       leftovers,
       fresh,
       &m,
       ReplicaPhase::kPending,
       "waiting for the previous pods to terminate",
       false,
       false,
       false,
       false,
       false,
       {},
       never},
      {"outdated and serving",
       outdated_ready,
       fresh,
       &m,
       ReplicaPhase::kReady,
       "to be replaced by",
       false,
       false,
       true,
       false,
       false,
       {},
       never},
      {"outdated, not serving",
       outdated_starting,
       fresh,
       &m,
       ReplicaPhase::kStarting,
       "to be replaced by",
       true,
       false,
       false,
       false,
       false,
       {},
       never},
      {"failed",
       failed,
       fresh,
       &m,
       ReplicaPhase::kFailed,
       "pod m-0-1 failed; recreating the replica in 2s (restart 1)",
       true,
       false,
       false,
       true,
       false,
       {},
       absl::Seconds(2)},
      {"failed again soon: the backoff doubles",
       failed,
       failed_before,
       &m,
       ReplicaPhase::kFailed,
       "recreating the replica in 8s (restart 2)",
       true,
       false,
       false,
       true,
       false,
       {},
       absl::Seconds(8)},
      {"failed under failurePolicy None",
       failed,
       fresh,
       &none,
       ReplicaPhase::kFailed,
       "failurePolicy None leaves it",
       false,
       false,
       false,
       false,
       false,
       {},
       never},
      {"unschedulable",
       unschedulable,
       fresh,
       &m,
       ReplicaPhase::kPending,
       "planning the replica again",
       true,
       false,
       false,
       false,
       true,
       {},
       never},
      {"created in part",
       partial,
       fresh,
       &m,
       ReplicaPhase::kPlacing,
       "completing the creation of 1 stage(s)",
       false,
       false,
       false,
       false,
       false,
       {1},
       never},
      {"created in part without a plan",
       partial_unplanned,
       fresh,
       &m,
       ReplicaPhase::kPending,
       "planning it again",
       true,
       false,
       false,
       false,
       false,
       {},
       never},
      {"ready",
       obs({&ready0, &ready1}),
       fresh,
       &m,
       ReplicaPhase::kReady,
       "",
       false,
       false,
       false,
       false,
       false,
       {},
       never},
      {"being bound",
       binding,
       fresh,
       &m,
       ReplicaPhase::kPlacing,
       "kube-scheduler",
       false,
       false,
       false,
       false,
       false,
       {},
       never},
      {"starting",
       starting,
       fresh,
       &m,
       ReplicaPhase::kStarting,
       "loading 41 %",
       false,
       false,
       false,
       false,
       false,
       {},
       never},
      {"stuck",
       stuck,
       fresh,
       &m,
       ReplicaPhase::kBlocked,
       "cannot be pulled",
       false,
       false,
       false,
       false,
       false,
       {},
       never},
  };
  for (const Row& row : rows) {
    const decide::Verdict v = decide::Judge(row.o, row.record, *row.model, kNow, Timing());
    EXPECT_EQ(v.state.phase, row.phase) << row.name << ": " << PhaseName(v.state.phase);
    EXPECT_NE(v.state.message.find(row.message), std::string::npos)
        << row.name << ": " << v.state.message;
    if (row.message.empty()) EXPECT_EQ(v.state.message, "") << row.name;
    EXPECT_EQ(v.delete_live, row.delete_live) << row.name;
    EXPECT_EQ(v.place, row.place) << row.name;
    EXPECT_EQ(v.outdated_serving, row.outdated_serving) << row.name;
    EXPECT_EQ(v.restart, row.restart) << row.name;
    EXPECT_EQ(v.replan, row.replan) << row.name;
    EXPECT_EQ(v.create_stages, row.create_stages) << row.name;
    EXPECT_EQ(v.requeue_after, row.requeue) << row.name;
  }
}

// ToReplace: serving outdated replicas go highest first while enough keep serving.
TEST(DecideSteps, ToReplaceKeepsEnoughServing) {
  struct Row {
    std::vector<int64_t> outdated;
    int64_t serving, min_serving;
    std::vector<int64_t> want;
  };
  const std::vector<Row> rows = {
      {{0, 1, 2}, 3, 2, {2}},     // maxUnavailable 1 of 3
      {{0, 1, 2}, 3, 1, {2, 1}},  // maxUnavailable 2
      {{0, 2}, 2, 2, {}},         // nothing to spare: one not serving already
      {{1, 0}, 4, 0, {1, 0}},     // with surge: all may go
      {{}, 3, 2, {}},
  };
  for (const Row& row : rows) {
    EXPECT_EQ(decide::ToReplace(row.outdated, row.serving, row.min_serving), row.want)
        << row.serving << " serving, at least " << row.min_serving;
  }
}

// The pass's own steps: the Event of what was placed, and the replicas by phase for the metrics.
TEST(DecideSteps, PlacedEventNamesEachReplicasNodes) {
  struct Row {
    std::map<int64_t, std::vector<std::string>> placed;
    std::optional<std::string> message;
  };
  const std::vector<Row> rows = {
      {{}, std::nullopt},
      {{{0, {"n1"}}}, "revision r1: replica 0 on n1"},
      {{{0, {"n1", "n2"}}, {2, {"n3", "n4"}}},
       "revision r1: replica 0 on n1, n2; replica 2 on n3, n4"},
  };
  for (const Row& row : rows) {
    PlacementOutcome outcome;
    outcome.placed = row.placed;
    outcome.unplaced = {{5, "no GPUs"}};  // what was not placed is not in it
    const std::optional<Event> e = PlacedEvent(outcome, "r1");
    ASSERT_EQ(e.has_value(), row.message.has_value());
    if (e) {
      EXPECT_EQ(e->reason, "PlacedReplicas");
      EXPECT_EQ(e->message, *row.message);
    }
  }
}

TEST(DecideSteps, ReplicasByPhaseCountsEachPhase) {
  Decision d;
  for (ReplicaPhase p : {ReplicaPhase::kReady, ReplicaPhase::kReady, ReplicaPhase::kFailed,
                         ReplicaPhase::kStarting}) {
    ReplicaState r;
    r.phase = p;
    d.replicas.push_back(r);
  }
  const std::map<std::string, int64_t> want = {{PhaseName(ReplicaPhase::kReady), 2},
                                               {PhaseName(ReplicaPhase::kFailed), 1},
                                               {PhaseName(ReplicaPhase::kStarting), 1}};
  EXPECT_EQ(ReplicasByPhase(d), want);
  EXPECT_TRUE(ReplicasByPhase(Decision()).empty());
}

}  // namespace
}  // namespace shardserve::op
