// Kubernetes objects as placement reads them (plan/cluster_view.h).
#include "plan/cluster_view.h"

#include <gtest/gtest.h>

namespace shardserve {
namespace {

using json = nlohmann::json;

TEST(ClusterView, NodeFromObjectReadsWhatPlacementNeeds) {
  const json node = json::parse(R"({
    "metadata": {"name": "gpu-1", "labels": {"topology.kubernetes.io/zone": "a"}},
    "spec": {"unschedulable": true,
             "taints": [{"key": "gpu", "value": "yes", "effect": "NoSchedule"}]},
    "status": {"allocatable": {"nvidia.com/gpu": "8", "cpu": "64"},
               "conditions": [{"type": "Ready", "status": "False"}]}})");
  auto n = NodeFromObject(node, "nvidia.com/gpu");
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(n->name, "gpu-1");
  EXPECT_EQ(n->gpus, 8);
  EXPECT_EQ(n->labels.at("topology.kubernetes.io/zone"), "a");
  ASSERT_EQ(n->taints.size(), 1u);
  EXPECT_EQ(n->taints[0].effect, "NoSchedule");
  EXPECT_TRUE(n->unschedulable);
  EXPECT_FALSE(n->ready);
  // Another resource: none of it.
  EXPECT_EQ(NodeFromObject(node, "amd.com/gpu")->gpus, 0);
}

TEST(ClusterView, FractionalDevicesAreRefusedByName) {
  const json node = json::parse(
      R"({"metadata": {"name": "n"}, "status": {"allocatable": {"nvidia.com/gpu": "500m"}}})");
  auto n = NodeFromObject(node, "nvidia.com/gpu");
  ASSERT_FALSE(n.ok());
  EXPECT_NE(n.status().message().find("node n allocatable nvidia.com/gpu '500m'"),
            std::string::npos);
  EXPECT_FALSE(NodeFromObject(json::object(), "nvidia.com/gpu").ok());
}

TEST(ClusterView, PodRequestsPreferRequestsOverLimits) {
  const json pod = json::parse(R"({"metadata": {"name": "p"}, "spec": {"containers": [
      {"resources": {"limits": {"nvidia.com/gpu": "4"}}},
      {"resources": {"requests": {"nvidia.com/gpu": 2}, "limits": {"nvidia.com/gpu": 2}}}]},
      "status": {"phase": "Running"}})");
  EXPECT_EQ(*PodRequests(pod, "nvidia.com/gpu"), 6);
  EXPECT_TRUE(PodHoldsResources(pod));
  json done = pod;
  done["status"]["phase"] = "Succeeded";
  EXPECT_FALSE(PodHoldsResources(done));
}

TEST(ClusterView, PlacementRequestForCarriesTheSpec) {
  ShardedModelSpec s;
  s.tensor = 8;
  s.pipeline = 2;
  s.node_selector = {{"pool", "h100"}};
  s.tolerations.push_back({"gpu", "Exists", "", "NoSchedule", std::nullopt});
  s.topology_key = "rack";
  const PlacementRequest r = PlacementRequestFor(s, {0, 2});
  EXPECT_EQ(r.tensor, 8);
  EXPECT_EQ(r.pipeline, 2);
  EXPECT_EQ(r.replicas, (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(r.node_selector.at("pool"), "h100");
  ASSERT_EQ(r.tolerations.size(), 1u);
  EXPECT_EQ(r.tolerations[0].op, "Exists");
  EXPECT_EQ(r.topology_key, "rack");
}

}  // namespace
}  // namespace shardserve
