// Gang placement: table-driven cases of where replicas go, and the reasons when they cannot.
#include "plan/placement.h"

#include <gtest/gtest.h>

namespace shardserve {
namespace {

NodeInfo Node(const std::string& name, int64_t gpus, const std::string& zone = "zone-a") {
  NodeInfo n;
  n.name = name;
  n.gpus = gpus;
  if (!zone.empty()) n.labels["topology.kubernetes.io/zone"] = zone;
  return n;
}

PlacementRequest Request(int64_t tensor, int64_t pipeline, std::vector<int64_t> replicas = {0}) {
  PlacementRequest r;
  r.tensor = tensor;
  r.pipeline = pipeline;
  r.replicas = std::move(replicas);
  return r;
}

TEST(Placement, StagesOnDistinctNodesInsideOneZone) {
  struct Case {
    const char* what;
    PlacementRequest request;
    std::vector<NodeInfo> nodes;
    std::vector<std::vector<std::string>> want;  // per placed replica, nodes per stage
    std::vector<std::string> domains;
  };
  NodeInfo busy = Node("busy", 8);
  busy.requested = 4;
  NodeInfo big = Node("big", 16);
  const Case cases[] = {
      {"two stages, two nodes",
       Request(8, 2),
       {Node("a", 8), Node("b", 8)},
       {{"a", "b"}},
       {"zone-a"}},
      {"the zone that holds the whole replica",
       Request(8, 2),
       {Node("a1", 8, "zone-a"), Node("b1", 8, "zone-b"), Node("b2", 8, "zone-b")},
       {{"b1", "b2"}},
       {"zone-b"}},
      {"distinct nodes before doubling up",
       Request(8, 2),
       {big, Node("a", 8), Node("c", 8)},
       {{"a", "c"}},
       {"zone-a"}},
      {"one node with the GPUs for both stages",
       Request(8, 2),
       {big},
       {{"big", "big"}},
       {"zone-a"}},
      {"GPUs already requested count",
       Request(4, 2),
       {busy, Node("a", 4), Node("z", 8)},
       {{"a", "busy"}},
       {"zone-a"}},
      {"replicas do not double-book",
       Request(8, 2, {0, 1}),
       {Node("a", 8), Node("b", 8), Node("c", 8), Node("d", 8)},
       {{"a", "b"}, {"c", "d"}},
       {"zone-a", "zone-a"}},
      {"across zones when no zone can hold it",
       Request(8, 2),
       {Node("a", 8, "zone-a"), Node("b", 8, "zone-b")},
       {{"a", "b"}},
       {""}},
  };
  for (const Case& c : cases) {
    auto r = PlaceReplicas(c.request, c.nodes);
    ASSERT_TRUE(r.ok()) << c.what;
    ASSERT_EQ(r->placed.size(), c.want.size()) << c.what;
    EXPECT_TRUE(r->unplaced.empty()) << c.what;
    for (size_t i = 0; i < c.want.size(); ++i) {
      EXPECT_EQ(r->placed[i].nodes, c.want[i]) << c.what;
      EXPECT_EQ(r->placed[i].domain, c.domains[i]) << c.what;
    }
  }
}

TEST(Placement, ReasonsSayWhatIsMissing) {
  NodeInfo tainted = Node("tainted", 8);
  tainted.taints.push_back({"dedicated", "other-team", "NoSchedule"});
  NodeInfo labelled = Node("labelled", 8);
  labelled.labels["gpu-type"] = "h100";
  tainted.labels["gpu-type"] = "h100";
  NodeInfo small = Node("small", 4);
  small.labels["gpu-type"] = "h100";
  NodeInfo other = Node("other", 8);
  NodeInfo cordoned = Node("cordoned", 8);
  cordoned.unschedulable = true;
  PlacementRequest r = Request(8, 2);
  r.node_selector["gpu-type"] = "h100";
  auto out = PlaceReplicas(r, {tainted, labelled, small, other, cordoned});
  ASSERT_TRUE(out.ok());
  EXPECT_TRUE(out->placed.empty());
  EXPECT_EQ(out->unplaced.at(0),
            "replica 0 needs 2 nodes with 8 free nvidia.com/gpu; 1 has them (of 5 nodes: 1 not "
            "ready or cordoned, 1 by nodeSelector, 1 by an untolerated taint, 1 with fewer free "
            "GPUs (at most 4))");

  // A toleration lets the tainted node in; then the replica fits.
  r.tolerations.push_back({"dedicated", "Exists", "", "", std::nullopt});
  r.node_selector["gpu-type"] = "h100";
  out = PlaceReplicas(r, {tainted, labelled, small, other, cordoned});
  ASSERT_TRUE(out.ok());
  ASSERT_EQ(out->placed.size(), 1u);
  EXPECT_EQ(out->placed[0].nodes, (std::vector<std::string>{"labelled", "tainted"}));

  // The second replica finds what the first left: nothing.
  out = PlaceReplicas(Request(8, 2, {0, 1}), {Node("a", 8), Node("b", 8), Node("c", 8)});
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->placed.size(), 1u);
  EXPECT_EQ(out->unplaced.at(1),
            "replica 1 needs 2 nodes with 8 free nvidia.com/gpu; 1 has them "
            "(of 3 nodes: 2 with fewer free GPUs (at most 0))");
  EXPECT_EQ(PlaceReplicas(Request(0, 1), {}).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardserve
