// The operator's pure builders: the pod of a stage carries the contract of DESIGN.md §4.
#include "operator/builders.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>

#include "api/router_env.h"
#include "comm/shm_comm.h"

namespace shardserve::op {
namespace {

json Model(const std::string& uri = "pvc://store/llama/70b") {
  return json::parse(R"({
    "apiVersion": "shardserve.io/v1alpha1", "kind": "ShardedModel",
    "metadata": {"name": "llama", "namespace": "ml", "uid": "u-1", "generation": 3},
    "spec": {"replicas": 2,
             "model": {"name": "llama-3-70b", "uri": ")" +
                     uri + R"("},
             "parallelism": {"tensor": 4, "pipeline": 2},
             "worker": {"image": "w:1", "nodeSelector": {"pool": "gpu"},
                        "tolerations": [{"key": "gpu", "operator": "Exists"},
                                        {"key": "drain", "operator": "Equal", "value": "soon",
                                         "effect": "NoExecute", "tolerationSeconds": 30}],
                        "resources": {"requests": {"memory": "64Gi"}},
                        "env": [{"name": "NCCL_DEBUG", "value": "WARN"},
                                {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef":
                                    {"name": "hf", "key": "token", "optional": true}}}]},
             "serving": {"port": 8000, "maxBatchSize": 16, "maxSequenceLength": 8192}}})");
}

std::string Env(const json& pod, const std::string& name) {
  for (const json& e : pod["spec"]["containers"][0]["env"]) {
    if (e["name"] == name) return e.value("value", "");
  }
  return "<absent>";
}

TEST(Builders, StagePodCarriesThePodContract) {
  auto m = ReadModel(Model());
  ASSERT_TRUE(m.ok()) << m.status();
  const json leader = BuildStagePod(*m, 1, 0, {"node-a", "node-b"});
  const json worker = BuildStagePod(*m, 1, 1, {"node-a", "node-b"});
  EXPECT_EQ(leader["metadata"]["name"], "llama-1-0");
  EXPECT_EQ(leader["metadata"]["namespace"], "ml");
  EXPECT_EQ(leader["spec"]["hostname"], "llama-1-0");
  EXPECT_EQ(leader["spec"]["subdomain"], "llama-workers");
  EXPECT_EQ(leader["metadata"]["labels"][kRoleLabel], "leader");
  EXPECT_EQ(worker["metadata"]["labels"][kRoleLabel], "worker");
  EXPECT_EQ(worker["metadata"]["labels"][kReplicaLabel], "1");
  EXPECT_EQ(worker["metadata"]["labels"][kStageLabel], "1");
  EXPECT_EQ(leader["metadata"]["labels"][kRevisionLabel], m->revision);
  // Every pod carries the replica's whole plan (an interrupted creation is completed on it).
  EXPECT_EQ(worker["metadata"]["annotations"][kPlacementAnnotation], "node-a,node-b");
  const json& owner = leader["metadata"]["ownerReferences"][0];
  EXPECT_EQ(owner["uid"], "u-1");
  EXPECT_EQ(owner["controller"], true);
  // Pinned to the planned node; kube-scheduler still binds it and accounts the GPUs.
  EXPECT_EQ(
      worker["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"][0]["matchFields"][0]["values"][0],
      "node-b");
  const json& c = leader["spec"]["containers"][0];
  EXPECT_EQ(c["resources"]["limits"]["nvidia.com/gpu"], "4");
  EXPECT_EQ(c["resources"]["requests"]["memory"], "64Gi");
  EXPECT_EQ(Env(worker, "SHARDSERVE_TP"), "4");
  EXPECT_EQ(Env(worker, "SHARDSERVE_PP"), "2");
  EXPECT_EQ(Env(worker, "SHARDSERVE_STAGE"), "1");
  EXPECT_EQ(Env(worker, "SHARDSERVE_REPLICA"), "1");
  EXPECT_EQ(Env(worker, "SHARDSERVE_LEADER_ADDR"), "llama-1-0.llama-workers.ml.svc:29500");
  EXPECT_EQ(Env(worker, "SHARDSERVE_MODEL_PATH"), "/models/llama/70b");
  EXPECT_EQ(Env(worker, "SHARDSERVE_MODEL_NAME"), "llama-3-70b");
  EXPECT_EQ(Env(worker, "SHARDSERVE_MICROBATCHES"), "2");
  EXPECT_EQ(Env(worker, "NCCL_DEBUG"), "WARN");
  EXPECT_EQ(leader["spec"]["volumes"][1]["persistentVolumeClaim"]["claimName"], "store");
  EXPECT_EQ(leader["spec"]["nodeSelector"]["pool"], "gpu");
  EXPECT_EQ(leader["spec"]["tolerations"][0],
            json::parse(R"({"key": "gpu", "operator": "Exists"})"));
  EXPECT_EQ(leader["spec"]["tolerations"][1],
            json::parse(R"({"key": "drain", "operator": "Equal", "value": "soon",
                            "effect": "NoExecute", "tolerationSeconds": 30})"));
  // A model's env passes as written, valueFrom sources too.
  for (const json& e : worker["spec"]["containers"][0]["env"]) {
    if (e["name"] == "HF_TOKEN") {
      EXPECT_EQ(e["valueFrom"], json::parse(R"({"secretKeyRef":
                                               {"name": "hf", "key": "token", "optional": true}})"));
    }
  }
  // Ports: the API on the leader only; rendezvous; metrics 9400 + tp_rank.
  std::vector<int> leader_ports, worker_ports;
  for (const json& p : c["ports"]) leader_ports.push_back(p["containerPort"]);
  for (const json& p : worker["spec"]["containers"][0]["ports"]) {
    worker_ports.push_back(p["containerPort"]);
  }
  EXPECT_EQ(leader_ports, (std::vector<int>{29500, 8000, 9400, 9401, 9402, 9403}));
  EXPECT_EQ(worker_ports, (std::vector<int>{29500, 9400, 9401, 9402, 9403}));
  EXPECT_EQ(c["readinessProbe"]["httpGet"]["path"], "/readyz");
  EXPECT_EQ(c["readinessProbe"]["timeoutSeconds"], 5);  // not 1 s: a loaded replica answers late
  EXPECT_EQ(c["command"], json::array({"shardserve-worker", "launch"}));
  // A failing rank's reason reaches the pod's status; a deleted pod keeps serving while the
  // Service forgets it, then drains.
  EXPECT_EQ(Env(worker, "SHARDSERVE_TERMINATION_LOG"), "/dev/termination-log");
  EXPECT_EQ(Env(worker, "SHARDSERVE_PEER_TIMEOUT_MS"), std::to_string(kPeerTimeoutMs));
  EXPECT_EQ(c["terminationMessagePath"], "/dev/termination-log");
  EXPECT_EQ(c["terminationMessagePolicy"], "FallbackToLogsOnError");
  EXPECT_EQ(c["lifecycle"]["preStop"]["sleep"]["seconds"], kPreStopSeconds);
}

TEST(Builders, StagePodsCarryThePlansLayers) {
  auto m = ReadModel(Model());
  ASSERT_TRUE(m.ok()) << m.status();
  m->stage_layers = {{0, 41}, {41, 80}};
  EXPECT_EQ(Env(BuildStagePod(*m, 0, 1, {"a", "b"}), "SHARDSERVE_STAGE_LAYERS"), "0-40,41-79");
}

TEST(Builders, InspectPodReadsTheModelWhereTheRanksWill) {
  auto m = ReadModel(Model());
  ASSERT_TRUE(m.ok()) << m.status();
  const json pod = BuildInspectPod(*m);
  const json stage = BuildStagePod(*m, 0, 0, {"a", "b"});
  EXPECT_EQ(pod["metadata"]["name"], "inspect-" + InspectionKey(*m));
  EXPECT_EQ(pod["metadata"]["annotations"][kInspectionAnnotation], InspectionKey(*m));
  EXPECT_EQ(pod["metadata"]["labels"][kModelLabel], "llama");
  EXPECT_EQ(pod["metadata"]["labels"][kRoleLabel], kInspectRole);
  EXPECT_FALSE(pod["metadata"]["labels"].contains(kReplicaLabel));
  EXPECT_EQ(pod["metadata"]["annotations"][kModelUriAnnotation], "pvc://store/llama/70b");
  EXPECT_EQ(pod["metadata"]["ownerReferences"][0]["uid"], "u-1");
  const json& c = pod["spec"]["containers"][0];
  EXPECT_EQ(c["command"], json::array({"shardserve-worker", "inspect"}));
  EXPECT_EQ(c["image"], "w:1");
  EXPECT_EQ(Env(pod, "SHARDSERVE_MODEL_PATH"), Env(stage, "SHARDSERVE_MODEL_PATH"));
  EXPECT_EQ(Env(pod, "SHARDSERVE_TERMINATION_LOG"), c["terminationMessagePath"].get<std::string>());
  EXPECT_EQ(c["terminationMessagePolicy"], "FallbackToLogsOnError");
  EXPECT_EQ(c["resources"]["requests"], json::parse(R"({"cpu": "100m", "memory": "256Mi"})"))
      << "stated, for namespaces whose quota wants them";
  EXPECT_EQ(c["resources"]["limits"], json::parse(R"({"cpu": "1", "memory": "2Gi"})"))
      << "and no GPU";
  EXPECT_EQ(pod["spec"]["volumes"][0], stage["spec"]["volumes"][1]) << "the same model volume";
  EXPECT_EQ(pod["spec"]["nodeSelector"], stage["spec"]["nodeSelector"]);
  EXPECT_EQ(pod["spec"]["tolerations"], stage["spec"]["tolerations"]);
  EXPECT_EQ(pod["spec"]["restartPolicy"], "Never");
  EXPECT_EQ(pod["spec"]["activeDeadlineSeconds"], kInspectDeadlineSeconds);
  EXPECT_EQ(pod["spec"]["automountServiceAccountToken"], false);
}

// One inspection per source: another model's name, image, replicas or scheduling read the same
// files the same way (one key); another uri, another revision, other files or other credentials
// do not.
TEST(Builders, AnInspectionIsOfWhatItReads) {
  auto key = [](const std::function<void(json&)>& edit, const std::string& uri) {
    json o = Model(uri);
    edit(o);
    auto m = ReadModel(o);
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? InspectionKey(*m) : "";
  };
  const auto same = [](json&) {};
  const std::string pvc = key(same, "pvc://store/llama/70b");
  EXPECT_EQ(pvc.size(), 16u);
  EXPECT_EQ(key(
                [](json& o) {
                  o["metadata"]["name"] = "other";
                  o["metadata"]["uid"] = "u-2";
                  o["spec"]["replicas"] = 5;
                  o["spec"]["worker"]["image"] = "w:2";
                  o["spec"]["worker"]["nodeSelector"] = {{"pool", "b"}};
                },
                "pvc://store/llama/70b"),
            pvc);
  EXPECT_NE(key(same, "pvc://store/llama/8b"), pvc);
  const std::string hf = key(same, "hf://meta/llama@v1");
  EXPECT_NE(key(same, "hf://meta/llama@v2"), hf);
  EXPECT_NE(key([](json& o) { o["spec"]["model"]["secret"] = "hf-token"; }, "hf://meta/llama@v1"),
            hf);
  EXPECT_NE(key([](json& o) { o["spec"]["model"]["files"] = {"*.gguf"}; }, "hf://meta/llama@v1"),
            hf);
}

TEST(Builders, WithoutPlatformDefaultsTheRanksCanReadTheirSecrets) {
  // The mounted Secrets are mode 0440: the ranks' user needs the pod's fsGroup.
  auto m = ReadModel(Model(), WorkerDefaults{});
  ASSERT_TRUE(m.ok()) << m.status();
  const json pod = BuildStagePod(*m, 0, 0, {"node-a", "node-b"});
  EXPECT_EQ(pod["spec"]["securityContext"]["fsGroup"], 65532);
  EXPECT_EQ(pod["spec"]["containers"][0]["securityContext"]["runAsUser"], 65532);
  EXPECT_EQ(pod["spec"]["containers"][0]["securityContext"]["runAsGroup"], 65532);
  for (const json& v : pod["spec"]["volumes"]) {
    if (v.contains("secret")) {
      EXPECT_EQ(v["secret"]["defaultMode"], 0440);
    }
  }
}

TEST(Builders, ServicesAndRevisions) {
  auto m = ReadModel(Model());
  ASSERT_TRUE(m.ok());
  const json workers = BuildWorkersService(*m);
  EXPECT_EQ(workers["metadata"]["name"], "llama-workers");
  EXPECT_EQ(workers["spec"]["clusterIP"], "None");
  EXPECT_EQ(workers["spec"]["publishNotReadyAddresses"], true);
  const json api = BuildLeaderService(*m);
  EXPECT_EQ(api["metadata"]["name"], "llama");
  EXPECT_EQ(api["spec"]["selector"][kRoleLabel], "leader");
  EXPECT_EQ(api["spec"]["ports"][0]["port"], 8000);

  // The revision follows what shapes pods (image), not replicas.
  json scaled = Model();
  scaled["spec"]["replicas"] = 5;
  json reimaged = Model();
  reimaged["spec"]["worker"]["image"] = "w:2";
  EXPECT_EQ(ReadModel(scaled)->revision, m->revision);
  EXPECT_NE(ReadModel(reimaged)->revision, m->revision);

  auto hostpath = ReadModel(Model("hostpath:///data/llama"), {}, {{"/data"}, {}});
  ASSERT_TRUE(hostpath.ok());
  EXPECT_EQ(BuildStagePod(*hostpath, 0, 0, {"n", "n"})["spec"]["volumes"][1]["hostPath"]["path"],
            "/data/llama");
  auto local = ReadModel(Model("file:///tmp/llama"));
  EXPECT_NE(local.status().message().find("only shardserve local"), std::string::npos);
}

// The mount of `volume` in `container` (null: none).
json MountOf(const json& container, const std::string& volume) {
  for (const json& m : container.value("volumeMounts", json::array())) {
    if (m["name"] == volume) return m;
  }
  return nullptr;
}

// The value after `flag` in a command (null: absent).
json FlagOf(const json& command, const std::string& flag) {
  for (size_t i = 0; i + 1 < command.size(); ++i) {
    if (command[i] == flag) return command[i + 1];
  }
  return nullptr;
}

TEST(Builders, ARemoteModelIsFetchedIntoTheNodesCacheAndEachPodSeesOnlyItsOwn) {
  json object = Model("hf://org/llama@main");
  object["spec"]["model"]["files"] = json::array({"*.safetensors", "*.json"});
  object["spec"]["model"]["secret"] = "hub-token";
  auto d = ReadWorkerDefaults(
      json::parse(R"({"modelCache": {"hostPath": "/var/cache/models", "sizeLimit": "100Gi"}})"));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->model_cache.size_limit, int64_t{100} << 30);
  EXPECT_FALSE(ReadWorkerDefaults(json::parse(R"({"modelCache": {"hostPath": "rel"}})")).ok());
  // The chart's default: no limit.
  auto unlimited = ReadWorkerDefaults(json::parse(R"({"modelCache": {"sizeLimit": "0"}})"));
  ASSERT_TRUE(unlimited.ok()) << unlimited.status();
  EXPECT_EQ(unlimited->model_cache.size_limit, 0);
  auto m = ReadModel(object, *d);
  ASSERT_TRUE(m.ok()) << m.status();
  // Before the inspect pod resolved it, its routers (built with the other children) wait.
  const json early = BuildRouterDeployment(*m);
  EXPECT_EQ(early["spec"]["replicas"], 0);
  EXPECT_TRUE(
      FlagOf(early["spec"]["template"]["spec"]["initContainers"][0]["command"], "--revision")
          .is_null());
  const std::string commit(40, 'a');
  m->source = ModelView::Source{commit, "hf/org--llama/" + commit, 1000, 3};

  const json pod = BuildStagePod(*m, 1, 0, {"n1", "n2"});
  ASSERT_EQ(pod["spec"]["initContainers"].size(), 1u);
  const json& fetch = pod["spec"]["initContainers"][0];
  const json& worker = pod["spec"]["containers"][0];
  EXPECT_EQ(fetch["name"], "fetch");
  EXPECT_EQ(fetch["image"], "w:1");
  EXPECT_EQ(fetch["command"][0], "shardserve");
  EXPECT_EQ(fetch["command"][1], "fetch");
  EXPECT_EQ(FlagOf(fetch["command"], "--uri"), "hf://org/llama@main");
  EXPECT_EQ(FlagOf(fetch["command"], "--revision"), commit) << "the revision inspect resolved";
  EXPECT_EQ(FlagOf(fetch["command"], "--files"), "*.safetensors,*.json");
  EXPECT_EQ(FlagOf(fetch["command"], "--cache-limit"), std::to_string(int64_t{100} << 30));
  EXPECT_EQ(FlagOf(fetch["command"], "--progress-port"), std::to_string(kMetricsPortBase));
  // The credentials reach the fetch step only.
  EXPECT_FALSE(MountOf(fetch, "model-credentials").is_null());
  EXPECT_EQ(FlagOf(fetch["command"], "--credentials"),
            MountOf(fetch, "model-credentials")["mountPath"]);
  EXPECT_TRUE(MountOf(worker, "model-credentials").is_null());
  // The fetch step mounts the node's whole cache; the ranks their model's directory, read-only.
  json cache_volume;
  for (const json& v : pod["spec"]["volumes"]) {
    if (v["name"] == "model-cache") cache_volume = v;
  }
  EXPECT_EQ(cache_volume["hostPath"]["path"], "/var/cache/models");
  EXPECT_EQ(cache_volume["hostPath"]["type"], "DirectoryOrCreate");
  EXPECT_FALSE(MountOf(fetch, "model-cache").contains("subPath"));
  EXPECT_EQ(FlagOf(fetch["command"], "--cache"), MountOf(fetch, "model-cache")["mountPath"]);
  const json ranks_mount = MountOf(worker, "model-cache");
  EXPECT_EQ(ranks_mount["subPath"], "hf/org--llama/" + commit);
  EXPECT_EQ(ranks_mount["readOnly"], true);
  EXPECT_EQ(Env(pod, "SHARDSERVE_MODEL_PATH"), ranks_mount["mountPath"].get<std::string>());
  EXPECT_EQ(Env(pod, "SHARDSERVE_FETCH_REPORT"), FlagOf(fetch["command"], "--report"));
  // As root (the node's directory), without a capability or a way to gain one.
  EXPECT_EQ(fetch["securityContext"]["runAsUser"], 0);
  EXPECT_EQ(fetch["securityContext"]["allowPrivilegeEscalation"], false);
  EXPECT_EQ(fetch["securityContext"]["capabilities"]["drop"], json::array({"ALL"}));
  EXPECT_EQ(worker["securityContext"]["runAsUser"], 65532);
  // Endpoints and regions from the model's env reach the fetch step.
  EXPECT_NE(fetch["env"].dump().find("NCCL_DEBUG"), std::string::npos);

  // The inspect pod lists it (and pins the revision) with the credentials, into a scratch dir.
  const json inspect = BuildInspectPod(*m);
  EXPECT_EQ(Env(inspect, "SHARDSERVE_MODEL_URI"), "hf://org/llama@main");
  EXPECT_EQ(Env(inspect, "SHARDSERVE_MODEL_FILES"), "*.safetensors,*.json");
  EXPECT_EQ(Env(inspect, "SHARDSERVE_CREDENTIALS_DIR"),
            MountOf(inspect["spec"]["containers"][0], "model-credentials")["mountPath"]);
  EXPECT_EQ(inspect["spec"]["volumes"].dump().find("hostPath"), std::string::npos);

  // A router fetches the small files (its tokenizer) into its own pod, never the node's cache.
  const json router = BuildRouterDeployment(*m)["spec"]["template"];
  const json& rfetch = router["spec"]["initContainers"][0];
  EXPECT_NE(std::find(rfetch["command"].begin(), rfetch["command"].end(), "--small"),
            rfetch["command"].end());
  EXPECT_EQ(router["spec"]["volumes"].dump().find("hostPath"), std::string::npos);
  EXPECT_EQ(rfetch["securityContext"]["runAsUser"], 65532);
  EXPECT_EQ(FlagOf(rfetch["command"], "--revision"), commit);
  EXPECT_EQ(BuildRouterDeployment(*m)["spec"]["replicas"], 2);

  // A model read from a volume has no fetch step.
  auto pvc = ReadModel(Model(), *d);
  EXPECT_FALSE(BuildStagePod(*pvc, 0, 0, {"n1", "n2"})["spec"].contains("initContainers"));
}

TEST(Builders, WorkerDefaultsFromThePlatformUnderTheModelsOwn) {
  auto d = ReadWorkerDefaults(json::parse(R"({
      "env": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "NCCL_IB_DISABLE", "value": "1"}],
      "securityContext": {"runAsUser": 65532, "runAsNonRoot": true},
      "podSecurityContext": {"fsGroup": 65532}})"));
  ASSERT_TRUE(d.ok()) << d.status();
  auto m = ReadModel(Model(), *d);  // the model sets NCCL_DEBUG=WARN itself
  ASSERT_TRUE(m.ok());
  const json pod = BuildStagePod(*m, 0, 0, {"a", "b"});
  EXPECT_EQ(Env(pod, "NCCL_IB_DISABLE"), "1");
  EXPECT_EQ(Env(pod, "NCCL_DEBUG"), "WARN");
  int nccl_debug = 0;
  for (const json& e : pod["spec"]["containers"][0]["env"]) nccl_debug += e["name"] == "NCCL_DEBUG";
  EXPECT_EQ(nccl_debug, 1);
  EXPECT_EQ(pod["spec"]["containers"][0]["securityContext"]["runAsUser"], 65532);
  EXPECT_EQ(pod["spec"]["securityContext"]["fsGroup"], 65532);

  EXPECT_NE(ReadWorkerDefaults(json::parse(R"({"evn": []})")).status().message().find("'evn'"),
            std::string::npos);
  EXPECT_NE(ReadWorkerDefaults(json::parse(R"({"env": [{"value": "x"}]})"))
                .status()
                .message()
                .find("worker defaults: env[0].name is required"),
            std::string::npos);
  EXPECT_NE(ReadWorkerDefaults(json::parse(R"({"env": [{"name": "A", "value": "x",
                                                       "valueFrom": {"fieldRef": {}}}]})"))
                .status()
                .message()
                .find("env[0] sets both value and valueFrom"),
            std::string::npos);
  EXPECT_FALSE(ReadWorkerDefaults(json::parse(R"({"securityContext": []})")).ok());
}

const json* Volume(const json& pod, const std::string& name) {
  for (const json& v : pod["spec"]["volumes"]) {
    if (v["name"] == name) return &v;
  }
  return nullptr;
}

const json* EnvEntry(const json& pod, const std::string& name) {
  for (const json& e : pod["spec"]["containers"][0]["env"]) {
    if (e["name"] == name) return &e;
  }
  return nullptr;
}

// Least privilege on every pod (the outside tester's findings): no ServiceAccount token, the
// platform's requests and limits where the model sets none, /dev/shm bounded by what the TP
// group maps, the replica's rendezvous secret on every stage, the API keys on the leader.
TEST(Builders, PodsHoldOnlyWhatTheyNeed) {
  auto d = ReadWorkerDefaults(json::parse(R"({"resources": {
      "requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "64Gi"}}})"));
  ASSERT_TRUE(d.ok()) << d.status();
  json object = Model();
  object["spec"]["serving"]["apiKeySecret"] = "llama-keys";
  auto m = ReadModel(object, *d);
  ASSERT_TRUE(m.ok()) << m.status();
  const json leader = BuildStagePod(*m, 1, 0, {"a", "b"});
  const json worker = BuildStagePod(*m, 1, 1, {"a", "b"});
  for (const json* pod : {&leader, &worker}) {
    EXPECT_EQ((*pod)["spec"]["automountServiceAccountToken"], false);
    const json& r = (*pod)["spec"]["containers"][0]["resources"];
    EXPECT_EQ(r["requests"]["memory"], "64Gi");  // the model's own
    EXPECT_EQ(r["requests"]["cpu"], "2");        // the platform's
    EXPECT_EQ(r["limits"]["memory"], "64Gi");
    EXPECT_EQ(r["limits"]["nvidia.com/gpu"], "4");
    const json* shm = Volume(*pod, "shm");
    ASSERT_NE(shm, nullptr);
    const int64_t limit = std::stoll((*shm)["emptyDir"]["sizeLimit"].get<std::string>());
    EXPECT_GE(limit, static_cast<int64_t>(ShmSegmentBytes(4)));
    EXPECT_EQ(limit, ShmSizeBytes(4));
    const json* rendezvous = Volume(*pod, "rendezvous");
    ASSERT_NE(rendezvous, nullptr);
    EXPECT_EQ((*rendezvous)["secret"]["secretName"], "llama-1-rendezvous");
    EXPECT_EQ((*rendezvous)["secret"]["defaultMode"], 0440);
    EXPECT_EQ(Env(*pod, "SHARDSERVE_RENDEZVOUS_SECRET_FILE"),
              "/var/run/shardserve/rendezvous/secret");
    const json* ip = EnvEntry(*pod, "SHARDSERVE_POD_IP");
    ASSERT_NE(ip, nullptr);
    EXPECT_EQ((*ip)["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP");
  }
  EXPECT_GT(ShmSizeBytes(8), ShmSizeBytes(4));
  ASSERT_NE(Volume(leader, "api-keys"), nullptr);
  EXPECT_EQ((*Volume(leader, "api-keys"))["secret"]["secretName"], "llama-keys");
  EXPECT_EQ(Env(leader, "SHARDSERVE_API_KEYS_FILE"), "/var/run/shardserve/api-keys");
  EXPECT_EQ(Volume(worker, "api-keys"), nullptr);
  EXPECT_EQ(Env(worker, "SHARDSERVE_API_KEYS_FILE"), "<absent>");
  EXPECT_EQ(Env(BuildStagePod(*ReadModel(Model()), 0, 0, {"a", "b"}), "SHARDSERVE_API_KEYS_FILE"),
            "<absent>");
  EXPECT_FALSE(ReadWorkerDefaults(json::parse(R"({"resources": {"request": {}}})")).ok());
}

// Several replicas: two router pods in the worker image in front of the leaders (found through
// the headless <name>-leaders), with the model's files, the keys and the router token; the
// model's Service goes to them once one is ready, to the leaders otherwise and with one replica.
TEST(Builders, RoutersStandInFrontOfSeveralReplicas) {
  json object = Model();
  object["spec"]["serving"]["apiKeySecret"] = "llama-keys";
  object["spec"]["worker"]["env"].push_back(
      {{"name", "SHARDSERVE_MAX_BODY_BYTES"}, {"value", "65536"}});
  auto m = ReadModel(object);
  ASSERT_TRUE(m.ok()) << m.status();
  const json d = BuildRouterDeployment(*m);
  EXPECT_EQ(d["kind"], "Deployment");
  EXPECT_EQ(d["metadata"]["name"], "llama-router");
  EXPECT_EQ(d["spec"]["replicas"], 2);
  const json& pod = d["spec"]["template"];
  EXPECT_EQ(pod["metadata"]["labels"][kRoleLabel], "router");
  EXPECT_EQ(d["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"]);
  const json& c = pod["spec"]["containers"][0];
  EXPECT_EQ(c["image"], "w:1");
  EXPECT_EQ(c["command"][0], "shardserve-router");
  EXPECT_EQ(pod["spec"]["automountServiceAccountToken"], false);
  EXPECT_EQ(pod["spec"]["nodeSelector"]["pool"], "gpu");  // where the model's files are
  json as_pod = {{"spec", pod["spec"]}};
  EXPECT_EQ(Env(as_pod, "SHARDSERVE_ROUTER_LEADERS"), "dns:llama-leaders.ml.svc:8000");
  EXPECT_EQ(Env(as_pod, "SHARDSERVE_MODEL_PATH"), "/models/llama/70b");
  EXPECT_EQ(Env(as_pod, "SHARDSERVE_API_KEYS_FILE"), "/var/run/shardserve/api-keys");
  EXPECT_EQ(Env(as_pod, "SHARDSERVE_ROUTER_TOKEN_FILE"), "/var/run/shardserve/router-token/token");
  EXPECT_EQ(Env(as_pod, "SHARDSERVE_MAX_BODY_BYTES"), "65536");  // the leaders' bound
  EXPECT_EQ(Env(as_pod, "NCCL_DEBUG"), "<absent>");              // not the rest of their env
  // The router reads its environment through its contract's table: every setting as the model
  // gives it to its leaders.
  std::map<std::string, std::string> vars;
  for (const json& e : c["env"]) vars[e["name"]] = e["value"];
  auto r = RouterEnv::FromEnv([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->leaders, "dns:llama-leaders.ml.svc:8000");
  EXPECT_EQ(r->deployment, "llama");
  EXPECT_EQ(r->max_body_bytes, 65536);
  EXPECT_FALSE(r->prefix_cache_per_key);
  for (const auto& [name, value] : vars) {
    const auto names = RouterEnv::Names();
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end())
        << name << " is written but not in the router's table";
  }
  json isolated = object;
  isolated["spec"]["serving"]["prefixCacheIsolation"] = "perKey";
  isolated["spec"]["serving"]["specialTokensInContent"] = "text";
  auto isolated_model = ReadModel(isolated);
  ASSERT_TRUE(isolated_model.ok()) << isolated_model.status();
  const json iso_deployment = BuildRouterDeployment(*isolated_model);
  std::map<std::string, std::string> iso;
  for (const json& e : iso_deployment["spec"]["template"]["spec"]["containers"][0]["env"]) {
    iso[e["name"]] = e["value"];
  }
  EXPECT_EQ(iso["SHARDSERVE_PREFIX_CACHE_ISOLATION"], "perKey");
  EXPECT_EQ(iso["SHARDSERVE_SPECIAL_TOKENS_IN_CONTENT"], "text");
  // spec.serving.chatTemplate from a ConfigMap: the leaders and routers read its key (the
  // kubelet fills the variable in); a request's own templates where trusted.
  json templated = object;
  templated["spec"]["serving"]["chatTemplate"] = {{"configMap", {{"name", "tpl"}, {"key", "t"}}}};
  templated["spec"]["serving"]["trustRequestChatTemplate"] = true;
  auto templated_model = ReadModel(templated);
  ASSERT_TRUE(templated_model.ok()) << templated_model.status();
  const json ref = {{"configMapKeyRef", {{"name", "tpl"}, {"key", "t"}}}};
  auto env_of = [](const json& container) {
    std::map<std::string, json> out;
    for (const json& e : container["env"]) out[e["name"]] = e;
    return out;
  };
  auto router_env =
      env_of(BuildRouterDeployment(*templated_model)["spec"]["template"]["spec"]["containers"][0]);
  EXPECT_EQ(router_env["SHARDSERVE_CHAT_TEMPLATE"]["valueFrom"], ref);
  EXPECT_EQ(router_env["SHARDSERVE_TRUST_REQUEST_CHAT_TEMPLATE"]["value"], "true");
  auto leader_env =
      env_of(BuildStagePod(*templated_model, 0, 0, {"a", "b"})["spec"]["containers"][0]);
  EXPECT_EQ(leader_env["SHARDSERVE_CHAT_TEMPLATE"]["valueFrom"], ref);
  EXPECT_EQ(leader_env["SHARDSERVE_TRUST_REQUEST_CHAT_TEMPLATE"]["value"], "true");
  EXPECT_FALSE(env_of(BuildStagePod(*templated_model, 0, 1, {"a", "b"})["spec"]["containers"][0])
                   .count("SHARDSERVE_CHAT_TEMPLATE"));
  ASSERT_NE(Volume(as_pod, "router-token"), nullptr);
  EXPECT_EQ((*Volume(as_pod, "router-token"))["secret"]["secretName"], "llama-router-token");
  ASSERT_NE(Volume(as_pod, "model"), nullptr);
  // The leaders read the same token; the other stages do not mount it.
  const json leader = BuildStagePod(*m, 0, 0, {"a", "b"}),
             worker = BuildStagePod(*m, 0, 1, {"a", "b"});
  EXPECT_EQ(Env(leader, "SHARDSERVE_ROUTER_TOKEN_FILE"), "/var/run/shardserve/router-token/token");
  EXPECT_NE(Volume(leader, "router-token"), nullptr);
  EXPECT_EQ(Volume(worker, "router-token"), nullptr);
  EXPECT_EQ(BuildRouterTokenSecret(*m, "t")["stringData"]["token"], "t");
  const json leaders = BuildLeadersService(*m);
  EXPECT_EQ(leaders["metadata"]["name"], "llama-leaders");
  EXPECT_EQ(leaders["spec"]["clusterIP"], "None");
  EXPECT_EQ(leaders["spec"]["publishNotReadyAddresses"], false);
  EXPECT_EQ(leaders["spec"]["selector"][kRoleLabel], "leader");
  EXPECT_EQ(BuildLeaderService(*m, true)["spec"]["selector"][kRoleLabel], "router");
  EXPECT_EQ(BuildLeaderService(*m, false)["spec"]["selector"][kRoleLabel], "leader");
  json one = object;
  one["spec"]["replicas"] = 1;
  auto single = ReadModel(one);
  EXPECT_EQ(BuildRouterDeployment(*single)["spec"]["replicas"], 0);
  EXPECT_EQ(BuildLeaderService(*single, true)["spec"]["selector"][kRoleLabel], "leader");
}

json Disaggregated() {
  json m = Model();
  m["spec"]["disaggregation"] = {{"prefill",
                                  {{"replicas", 3},
                                   {"parallelism", {{"tensor", 2}, {"pipeline", 1}}},
                                   {"nodeSelector", {{"pool", "prefill"}}},
                                   {"rollout", {{"maxUnavailable", 0}, {"maxSurge", 1}}}}},
                                 {"minPromptTokens", 512}};
  return m;
}

// The prefill role as the apiserver would return what BuildPrefillModel wrote.
json Stored(json prefill, const std::string& uid = "u-2") {
  prefill["metadata"]["uid"] = uid;
  return prefill;
}

TEST(Builders, ADisaggregatedModelIsTheDecodeRoleAndOwnsItsPrefillRole) {
  const json object = Disaggregated();
  auto m = ReadModel(object);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->kv_role, "decode");
  EXPECT_EQ(Env(BuildStagePod(*m, 0, 0, {"a", "b"}), "SHARDSERVE_KV_ROLE"), "decode");
  // Its routers run even with one decode replica, and pair the roles.
  json one = object;
  one["spec"]["replicas"] = 1;
  auto single = ReadModel(one);
  ASSERT_TRUE(single.ok());
  const json router = BuildRouterDeployment(*single);
  EXPECT_EQ(router["spec"]["replicas"], kRouterPods);
  std::map<std::string, std::string> env;
  for (const json& e : router["spec"]["template"]["spec"]["containers"][0]["env"]) {
    env[e["name"]] = e.value("value", "");
  }
  EXPECT_EQ(env["SHARDSERVE_ROUTER_PREFILL_LEADERS"], "dns:llama-prefill-leaders.ml.svc:8000");
  EXPECT_EQ(env["SHARDSERVE_ROUTER_DISAGGREGATE_MIN_TOKENS"], "512");
  // Becoming disaggregated changes the pods: the replicas roll.
  EXPECT_NE(m->revision, ReadModel(Model())->revision);

  // The prefill role: a ShardedModel of its own, owned by the model, its shape and placement.
  const json prefill = BuildPrefillModel(*m, object, nullptr);
  EXPECT_EQ(prefill["kind"], "ShardedModel");
  EXPECT_EQ(prefill["metadata"]["name"], "llama-prefill");
  EXPECT_EQ(prefill["metadata"]["namespace"], "ml");
  EXPECT_EQ(prefill["metadata"]["ownerReferences"][0]["uid"], "u-1");
  EXPECT_EQ(prefill["metadata"]["ownerReferences"][0]["controller"], true);
  const json& ps = prefill["spec"];
  EXPECT_EQ(ps["replicas"], 3);
  EXPECT_EQ(ps["parallelism"], json({{"tensor", 2}, {"pipeline", 1}}));
  EXPECT_EQ(ps["worker"]["nodeSelector"], json({{"pool", "prefill"}}));
  EXPECT_EQ(ps["worker"]["image"], "w:1");  // the rest is the model's
  EXPECT_EQ(ps["rollout"], json({{"maxUnavailable", 0}, {"maxSurge", 1}}));
  EXPECT_EQ(ps["prefillOf"], "llama");
  EXPECT_FALSE(ps.contains("disaggregation"));

  // Read back, it is the prefill role: KV role prefill, its leaders mount the model's router
  // token, no routers of its own, its ranks reachable from the decode role's.
  auto p = ReadModel(Stored(prefill));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->kv_role, "prefill");
  EXPECT_EQ(p->model.spec.tensor, 2);
  EXPECT_EQ(p->model.spec.replicas, 3);
  EXPECT_FALSE(Routed(*p));
  const json leader = BuildStagePod(*p, 0, 0, {"a"});
  EXPECT_EQ(leader["metadata"]["name"], "llama-prefill-0-0");
  EXPECT_EQ(Env(leader, "SHARDSERVE_KV_ROLE"), "prefill");
  EXPECT_EQ(Env(leader, "SHARDSERVE_DEPLOYMENT"), "llama");  // its metrics are the model's
  EXPECT_EQ(leader["spec"]["nodeSelector"], json({{"pool", "prefill"}}));
  bool token = false;
  for (const json& v : leader["spec"]["volumes"]) {
    if (v["name"] == "router-token") token = v["secret"]["secretName"] == "llama-router-token";
  }
  EXPECT_TRUE(token) << leader["spec"]["volumes"].dump();
  const json policy = BuildNetworkPolicy(*p);
  EXPECT_EQ(policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"][0]["values"],
            json({"llama-prefill", "llama"}));
  EXPECT_EQ(
      BuildNetworkPolicy(
          *m)["spec"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"][0]["values"],
      json({"llama", "llama-prefill"}));
}

TEST(Builders, ThePrefillRolesReplicasAreItsOwnUntilTheModelsFieldChanges) {
  json object = Disaggregated();
  auto m = ReadModel(object);
  ASSERT_TRUE(m.ok());
  json stored = Stored(BuildPrefillModel(*m, object, nullptr));
  EXPECT_EQ(stored["spec"]["replicas"], 3);
  // kubectl scale (or KEDA) on the prefill role: kept.
  stored["spec"]["replicas"] = 5;
  EXPECT_EQ(BuildPrefillModel(*m, object, &stored)["spec"]["replicas"], 5);
  // The model's spec.disaggregation.prefill.replicas changed: applied.
  object["spec"]["disaggregation"]["prefill"]["replicas"] = 2;
  auto changed = ReadModel(object);
  ASSERT_TRUE(changed.ok());
  const json applied = BuildPrefillModel(*changed, object, &stored);
  EXPECT_EQ(applied["spec"]["replicas"], 2);
  EXPECT_EQ(applied["metadata"]["annotations"][kPrefillReplicasAnnotation], "2");
}

TEST(Builders, APrefillRoleNotOwnedByItsModelIsRefused) {
  json m = Model();
  m["spec"]["prefillOf"] = "other";
  auto read = ReadModel(m);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(read.status().message().find("is not other-prefill owned by ShardedModel 'other'"),
            std::string::npos)
      << read.status();
  m["metadata"]["ownerReferences"] = json::array(
      {{{"kind", "ShardedModel"}, {"name", "other"}, {"uid", "u-9"}, {"controller", false}}});
  EXPECT_FALSE(ReadModel(m).ok());  // a reference that is not its controller's
  m["metadata"]["ownerReferences"][0]["controller"] = true;
  EXPECT_FALSE(ReadModel(m).ok());  // owned, but not named as its prefill role
  m["metadata"]["name"] = "other-prefill";
  EXPECT_TRUE(ReadModel(m).ok());
  // A name too long for its prefill role, both fields at once.
  json longer = Disaggregated();
  longer["metadata"]["name"] = std::string(38, 'a');
  EXPECT_NE(ReadModel(longer).status().message().find("at most 37 characters"), std::string::npos);
  json both = Disaggregated();
  both["spec"]["prefillOf"] = "x";
  EXPECT_NE(ReadModel(both).status().message().find("cannot be set together"), std::string::npos);
}

TEST(Builders, HostPathsAndImagesOnlyAsThePlatformAllows) {
  const ModelPolicy policy{{"/data", "/models/"}, {"registry.example/ml/", "w:"}};
  EXPECT_TRUE(ReadModel(Model("hostpath:///data/llama"), {}, policy).ok());
  EXPECT_TRUE(ReadModel(Model("hostpath:///models/a//b"), {}, policy).ok());
  EXPECT_TRUE(ReadModel(Model("hostpath:///data"), {}, policy).ok());
  for (const char* uri : {"hostpath:///data-other/x", "hostpath:///etc", "hostpath:///",
                          "hostpath:///data/../etc", "hostpath:///data/./x"}) {
    auto m = ReadModel(Model(uri), {}, policy);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << uri;
    EXPECT_NE(m.status().message().find("spec.model.uri"), std::string::npos) << uri;
  }
  auto none = ReadModel(Model("hostpath:///data/llama"));
  EXPECT_NE(none.status().message().find("none: hostPath models are off"), std::string::npos)
      << none.status();
  EXPECT_TRUE(ReadModel(Model(), {}, {{}, {"w:"}}).ok());
  auto image = ReadModel(Model(), {}, {{}, {"registry.example/ml/"}});
  EXPECT_NE(image.status().message().find("spec.worker.image 'w:1'"), std::string::npos)
      << image.status();
}

// spec.adapters: each adapter's volume (a claim or a host directory the platform allows) mounted
// read-only on every stage pod, the ranks told where (SHARDSERVE_LORA_ADAPTERS) and how many they
// hold; a change of the adapters rolls the replicas; file:// is shardserve local's only.
TEST(Builders, LoraAdaptersAreMountedWhereTheRanksReadThem) {
  json obj = Model();
  obj["spec"]["adapters"] = {{{"name", "sql"}, {"uri", "pvc://loras/sql/v2"}},
                             {{"name", "chat"}, {"uri", "hostpath:///data/loras/chat"}}};
  obj["spec"]["lora"] = {{"maxLoras", 3}, {"maxLoraRank", 32}};
  const ModelPolicy policy{{"/data"}, {}};
  auto m = ReadModel(obj, {}, policy);
  ASSERT_TRUE(m.ok()) << m.status();
  for (int stage : {0, 1}) {
    const json pod = BuildStagePod(*m, 0, stage, {"node-a", "node-b"});
    EXPECT_EQ(
        Env(pod, "SHARDSERVE_LORA_ADAPTERS"),
        R"([{"name":"sql","path":"/adapters/0/sql/v2"},{"name":"chat","path":"/adapters/1"}])");
    EXPECT_EQ(Env(pod, "SHARDSERVE_MAX_LORAS"), "3");
    EXPECT_EQ(Env(pod, "SHARDSERVE_MAX_LORA_RANK"), "32");
    std::map<std::string, json> volumes, mounts;
    for (const json& v : pod["spec"]["volumes"]) volumes[v["name"]] = v;
    for (const json& v : pod["spec"]["containers"][0]["volumeMounts"]) mounts[v["name"]] = v;
    EXPECT_EQ(volumes["adapter-0"]["persistentVolumeClaim"]["claimName"], "loras");
    EXPECT_EQ(volumes["adapter-1"]["hostPath"]["path"], "/data/loras/chat");
    EXPECT_EQ(mounts["adapter-0"]["mountPath"], "/adapters/0");
    EXPECT_EQ(mounts["adapter-1"]["readOnly"], true);
  }
  // Adapters loaded at runtime: the admins' keys on the leader only, their directory on every
  // stage pod.
  obj["spec"]["lora"]["adminKeySecret"] = "lora-admins";
  obj["spec"]["lora"]["source"] = "pvc://loras/dynamic";
  auto runtime = ReadModel(obj, {}, policy);
  ASSERT_TRUE(runtime.ok()) << runtime.status();
  const json leader = BuildStagePod(*runtime, 0, 0, {"node-a", "node-b"});
  const json worker = BuildStagePod(*runtime, 0, 1, {"node-a", "node-b"});
  EXPECT_EQ(Env(leader, "SHARDSERVE_ADMIN_KEYS_FILE"), "/var/run/shardserve/admin-keys");
  EXPECT_EQ(Env(worker, "SHARDSERVE_ADMIN_KEYS_FILE"), "<absent>");
  for (const json* pod : {&leader, &worker}) {
    EXPECT_EQ(Env(*pod, "SHARDSERVE_LORA_ROOT"), "/adapters/dynamic/dynamic");
    EXPECT_NE(pod->dump().find(R"("claimName":"loras")"), std::string::npos);
  }
  EXPECT_NE(leader.dump().find(R"("secretName":"lora-admins")"), std::string::npos);
  EXPECT_EQ(worker.dump().find("lora-admins"), std::string::npos);
  obj["spec"]["lora"]["source"] = "file:///data/loras";
  EXPECT_NE(ReadModel(obj, {}, policy).status().message().find("spec.lora.source"),
            std::string::npos);
  obj["spec"]["lora"].erase("adminKeySecret");
  obj["spec"]["lora"].erase("source");

  auto plain = ReadModel(Model(), {}, policy);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(Env(BuildStagePod(*plain, 0, 0, {"a", "b"}), "SHARDSERVE_MAX_LORAS"), "<absent>");
  EXPECT_NE(plain->revision, m->revision) << "adding adapters rolls the replicas";
  obj["spec"]["adapters"][1]["uri"] = "hostpath:///etc/loras";
  auto outside = ReadModel(obj, {}, policy);
  EXPECT_NE(outside.status().message().find("spec.adapters[1].uri: the host path '/etc/loras'"),
            std::string::npos)
      << outside.status();
  obj["spec"]["adapters"][1]["uri"] = "file:///data/loras/chat";
  auto local = ReadModel(obj, {}, policy);
  EXPECT_NE(local.status().message().find("only shardserve local reads"), std::string::npos)
      << local.status();
  // A remote adapter: a step of each stage pod fetches it (with the model's credentials) into a
  // volume of the pod, which the rank reads through the step's link.
  obj["spec"]["adapters"][1]["uri"] = "s3://bucket/loras/chat";
  obj["spec"]["model"]["secret"] = "s3-creds";
  auto remote = ReadModel(obj, {}, policy);
  ASSERT_TRUE(remote.ok()) << remote.status();
  for (int stage : {0, 1}) {
    const json pod = BuildStagePod(*remote, 0, stage, {"node-a", "node-b"});
    EXPECT_EQ(Env(pod, "SHARDSERVE_LORA_ADAPTERS"),
              R"([{"name":"sql","path":"/adapters/0/sql/v2"},)"
              R"({"name":"chat","path":"/adapters/1/adapter"}])");
    ASSERT_EQ(pod["spec"]["initContainers"].size(), 1u);
    const json& step = pod["spec"]["initContainers"][0];
    EXPECT_EQ(step["name"], "fetch-adapter-1");
    EXPECT_EQ(step["command"],
              json({"shardserve", "fetch", "--uri", "s3://bucket/loras/chat", "--cache",
                    "/adapters/1/cache", "--credentials", "/var/run/shardserve/model-credentials",
                    "--link", "/adapters/1/adapter"}))
        << step["command"];
    EXPECT_EQ(step["volumeMounts"][0], json({{"name", "adapter-1"}, {"mountPath", "/adapters/1"}}));
    std::map<std::string, json> volumes, mounts;
    for (const json& v : pod["spec"]["volumes"]) volumes[v["name"]] = v;
    for (const json& v : pod["spec"]["containers"][0]["volumeMounts"]) mounts[v["name"]] = v;
    EXPECT_TRUE(volumes["adapter-1"].contains("emptyDir"));
    EXPECT_EQ(volumes["model-credentials"]["secret"]["secretName"], "s3-creds");
    EXPECT_EQ(mounts["adapter-1"],
              json({{"name", "adapter-1"}, {"mountPath", "/adapters/1"}, {"readOnly", true}}));
    EXPECT_FALSE(mounts.count("model-credentials")) << "the rank never reads the credentials";
  }
  // A remote model and two remote adapters: their fetch steps share the credentials' volume.
  obj["spec"]["model"]["uri"] = "s3://bucket/llama";
  obj["spec"]["adapters"][0]["uri"] = "hf://org/sql-lora";
  auto both = ReadModel(obj, {}, policy);
  ASSERT_TRUE(both.ok()) << both.status();
  const json pod = BuildStagePod(*both, 0, 0, {"node-a", "node-b"});
  std::vector<std::string> steps, volumes;
  for (const json& c : pod["spec"]["initContainers"]) steps.push_back(c["name"]);
  for (const json& v : pod["spec"]["volumes"]) volumes.push_back(v["name"]);
  EXPECT_EQ(steps, (std::vector<std::string>{"fetch", "fetch-adapter-0", "fetch-adapter-1"}));
  EXPECT_EQ(std::count(volumes.begin(), volumes.end(), "model-credentials"), 1);
}

// spec.serving.flowControl: the config's ConfigMap (or Secret) mounted on the leaders and the
// routers, each told where it is; the routers share the limits (each 1/kRouterPods); the other
// ranks have none. Both sources at once, or a bad key, are refused by name.
// spec.serving.speculative.draftModel: the leader alone runs the draft model, so only the stage-0
// pod mounts it (a claim, a host GGUF file the platform allows) or fetches it (a remote one, a
// step of its own with the model's credentials), and its rank is told where; file:// is refused.
TEST(Builders, TheDraftModelIsTheLeadersOnly) {
  json obj = Model();
  obj["spec"]["serving"] = {
      {"speculative", {{"method", "draft"}, {"draftModel", "pvc://store/llama/1b"}}}};
  auto m = ReadModel(obj);
  ASSERT_TRUE(m.ok()) << m.status();
  const json leader = BuildStagePod(*m, 0, 0, {"a", "b"});
  const json worker = BuildStagePod(*m, 0, 1, {"a", "b"});
  EXPECT_EQ(Env(leader, "SHARDSERVE_SPECULATIVE_METHOD"), "draft");
  EXPECT_EQ(Env(leader, "SHARDSERVE_DRAFT_MODEL"), "/draft/llama/1b");
  EXPECT_EQ(Env(worker, "SHARDSERVE_DRAFT_MODEL"), "<absent>");
  EXPECT_EQ(worker.dump().find("/draft"), std::string::npos);
  std::map<std::string, json> volumes, mounts;
  for (const json& v : leader["spec"]["volumes"]) volumes[v["name"]] = v;
  for (const json& v : leader["spec"]["containers"][0]["volumeMounts"]) mounts[v["name"]] = v;
  EXPECT_EQ(volumes["draft"]["persistentVolumeClaim"]["claimName"], "store");
  EXPECT_EQ(mounts["draft"],
            json({{"name", "draft"}, {"mountPath", "/draft"}, {"readOnly", true}}));

  obj["spec"]["serving"]["speculative"]["draftModel"] = "hostpath:///data/llama-q4k.gguf";
  auto host = ReadModel(obj, {}, {{"/data"}, {}});
  ASSERT_TRUE(host.ok()) << host.status();
  const json on_host = BuildStagePod(*host, 0, 0, {"a", "b"});
  EXPECT_EQ(Env(on_host, "SHARDSERVE_DRAFT_MODEL"), "/draft");
  EXPECT_NE(on_host.dump().find(R"({"hostPath":{"path":"/data/llama-q4k.gguf"},"name":"draft"})"),
            std::string::npos)
      << "a file as well as a directory";
  EXPECT_NE(ReadModel(obj).status().message().find("spec.serving.speculative.draftModel"),
            std::string::npos);

  obj["spec"]["serving"]["speculative"]["draftModel"] = "hf://org/llama-1b";
  obj["spec"]["model"]["secret"] = "hf-token";
  auto remote = ReadModel(obj);
  ASSERT_TRUE(remote.ok()) << remote.status();
  const json fetched = BuildStagePod(*remote, 0, 0, {"a", "b"});
  EXPECT_EQ(Env(fetched, "SHARDSERVE_DRAFT_MODEL"), "/draft/model");
  ASSERT_EQ(fetched["spec"]["initContainers"].size(), 1u);
  const json& step = fetched["spec"]["initContainers"][0];
  EXPECT_EQ(step["name"], "fetch-draft");
  EXPECT_EQ(
      step["command"],
      json({"shardserve", "fetch", "--uri", "hf://org/llama-1b", "--cache", "/draft/cache",
            "--credentials", "/var/run/shardserve/model-credentials", "--link", "/draft/model"}))
      << step["command"];
  EXPECT_FALSE(BuildStagePod(*remote, 0, 1, {"a", "b"})["spec"].contains("initContainers"));

  obj["spec"]["serving"]["speculative"]["draftModel"] = "file:///data/llama-1b";
  obj["spec"]["model"].erase("secret");
  EXPECT_NE(ReadModel(obj).status().message().find(
                "spec.serving.speculative.draftModel 'file:///data/llama-1b' is a file:// uri"),
            std::string::npos);
}

TEST(Builders, FlowControlIsMountedOnTheLeadersAndRouters) {
  json object = Model();
  object["spec"]["serving"]["flowControl"] = {{"configMap", "tenants"}, {"key", "limits.yaml"}};
  auto m = ReadModel(object);
  ASSERT_TRUE(m.ok()) << m.status();
  const json leader = BuildStagePod(*m, 0, 0, {"node-a", "node-b"});
  const json worker = BuildStagePod(*m, 0, 1, {"node-a", "node-b"});
  EXPECT_EQ(Env(leader, "SHARDSERVE_FLOW_CONTROL_FILE"),
            "/var/run/shardserve/flow-control/limits.yaml");
  EXPECT_EQ(Env(worker, "SHARDSERVE_FLOW_CONTROL_FILE"), "<absent>");
  EXPECT_NE(leader.dump().find(R"("configMap":{"name":"tenants"})"), std::string::npos);
  const json d = BuildRouterDeployment(*m);
  json as_pod = {{"spec", d["spec"]["template"]["spec"]}};
  EXPECT_EQ(Env(as_pod, "SHARDSERVE_FLOW_CONTROL_FILE"),
            "/var/run/shardserve/flow-control/limits.yaml");
  EXPECT_EQ(Env(as_pod, "SHARDSERVE_ROUTER_FLOW_SHARE"), std::to_string(kRouterPods));
  EXPECT_NE(as_pod.dump().find(R"("mountPath":"/var/run/shardserve/flow-control")"),
            std::string::npos);
  object["spec"]["serving"]["flowControl"] = {{"secret", "tenant-keys"}};
  m = ReadModel(object);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_NE(BuildStagePod(*m, 0, 0, {"a", "b"}).dump().find(R"("secretName":"tenant-keys")"),
            std::string::npos);
  EXPECT_EQ(Env(BuildStagePod(*m, 0, 0, {"a", "b"}), "SHARDSERVE_FLOW_CONTROL_FILE"),
            "/var/run/shardserve/flow-control/flow.yaml");
  object["spec"]["serving"]["flowControl"] = {{"secret", "a"}, {"configMap", "b"}};
  EXPECT_NE(ReadModel(object).status().message().find("configMap or secret, not both"),
            std::string::npos);
  object["spec"]["serving"]["flowControl"] = {{"secret", "a"}, {"key", "../x"}};
  EXPECT_NE(ReadModel(object).status().message().find("spec.serving.flowControl.key '../x'"),
            std::string::npos);
  object["spec"]["serving"]["flowControl"] = {{"secrets", "a"}};
  EXPECT_NE(ReadModel(object).status().message().find("spec.serving.flowControl"),
            std::string::npos);
}

// spec.serving.slo and .queue: on the leaders and routers as their env; a model with targets,
// or none of its replicas left (scaled to zero), keeps its routers, which Prometheus scrapes on
// the ranks' metrics port.
TEST(Builders, LatencyTargetsAndScaleToZeroKeepTheRouters) {
  json object = Model();
  object["spec"]["replicas"] = 1;
  auto m = ReadModel(object);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(Routed(*m));  // one replica, no targets: its leader is the Service
  object["spec"]["replicas"] = 0;
  m = ReadModel(object);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(Routed(*m)) << "scaled to zero: the routers hold the requests";
  object["spec"]["replicas"] = 1;
  object["spec"]["serving"]["slo"] = {{"ttftMilliseconds", 800}, {"itlMilliseconds", 60}};
  object["spec"]["serving"]["queue"] = {{"maxRequests", 32}, {"timeoutSeconds", 300}};
  m = ReadModel(object);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(Routed(*m));
  const json leader = BuildStagePod(*m, 0, 0, {"node-a", "node-b"});
  EXPECT_EQ(Env(leader, "SHARDSERVE_SLO_TTFT_MS"), "800");
  EXPECT_EQ(Env(leader, "SHARDSERVE_SLO_ITL_MS"), "60");
  const json d = BuildRouterDeployment(*m);
  EXPECT_EQ(d["spec"]["replicas"], kRouterPods);
  json as_pod = {{"spec", d["spec"]["template"]["spec"]}};
  EXPECT_EQ(Env(as_pod, "SHARDSERVE_SLO_TTFT_MS"), "800");
  EXPECT_EQ(Env(as_pod, "SHARDSERVE_ROUTER_QUEUE_MAX"), "32");
  EXPECT_EQ(Env(as_pod, "SHARDSERVE_ROUTER_QUEUE_TIMEOUT_MS"), "300000");
  EXPECT_EQ(Env(as_pod, "SHARDSERVE_ROUTER_METRICS_PORT"), std::to_string(kMetricsPortBase));
  EXPECT_NE(as_pod.dump().find(R"({"containerPort":9400,"name":"metrics-0"})"), std::string::npos)
      << as_pod.dump();
  for (const auto& [field, value, named] :
       {std::tuple{"slo", json{{"percentile", 100}}, "spec.serving.slo.percentile"},
        std::tuple{"slo", json{{"ttftMs", 1}}, "spec.serving.slo"},
        std::tuple{"queue", json{{"maxRequests", 5000}}, "spec.serving.queue.maxRequests"}}) {
    json bad = object;
    bad["spec"]["serving"][field] = value;
    EXPECT_NE(ReadModel(bad).status().message().find(named), std::string::npos) << value;
  }
}

TEST(Builders, RendezvousSecretAndDisruptionBudget) {
  auto m = ReadModel(Model());
  ASSERT_TRUE(m.ok());
  const json secret = BuildRendezvousSecret(*m, 1, "s3cr3t-0123456789abcdef");
  EXPECT_EQ(secret["kind"], "Secret");
  EXPECT_EQ(secret["metadata"]["name"], "llama-1-rendezvous");
  EXPECT_EQ(secret["metadata"]["namespace"], "ml");
  EXPECT_EQ(secret["metadata"]["ownerReferences"][0]["uid"], "u-1");
  EXPECT_EQ(secret["stringData"]["secret"], "s3cr3t-0123456789abcdef");
  const json pdb = BuildDisruptionBudget(*m, 1, "llama-1-0", "abcdef0123456789");
  EXPECT_EQ(pdb["apiVersion"], "policy/v1");
  EXPECT_EQ(pdb["metadata"]["name"], "llama-1-0-abcdef01");
  EXPECT_EQ(pdb["metadata"]["ownerReferences"][0]["kind"], "Pod");
  EXPECT_EQ(pdb["metadata"]["ownerReferences"][0]["uid"], "abcdef0123456789");
  EXPECT_EQ(pdb["spec"]["minAvailable"], 2);  // every stage of the gang
  EXPECT_EQ(pdb["spec"]["selector"]["matchLabels"][kReplicaLabel], "1");
  EXPECT_EQ(pdb["spec"]["selector"]["matchLabels"][kModelLabel], "llama");
  EXPECT_EQ(pdb["spec"]["unhealthyPodEvictionPolicy"], "AlwaysAllow");
}

TEST(Builders, NetworkPolicyLetsOnlyTheModelsPodsReachItsRanks) {
  auto m = ReadModel(Model());
  ASSERT_TRUE(m.ok());
  const json np = BuildNetworkPolicy(*m);
  EXPECT_EQ(np["metadata"]["name"], "llama-workers");
  EXPECT_EQ(np["spec"]["podSelector"]["matchLabels"][kModelLabel], "llama");
  const json& ingress = np["spec"]["ingress"];
  ASSERT_EQ(ingress.size(), 2u);
  // From the model's own pods: every port (rendezvous, TCP/NCCL communication).
  EXPECT_EQ(ingress[0]["from"][0]["podSelector"]["matchLabels"][kModelLabel], "llama");
  EXPECT_FALSE(ingress[0].contains("ports"));
  // From anywhere: the API and the tp_rank metrics ports only.
  std::vector<int> ports;
  for (const json& p : ingress[1]["ports"]) ports.push_back(p["port"]);
  EXPECT_EQ(ports, (std::vector<int>{8000, 9400, 9401, 9402, 9403}));
  EXPECT_FALSE(ingress[1].contains("from"));
}

}  // namespace
}  // namespace shardserve::op
