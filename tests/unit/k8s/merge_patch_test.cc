#include <gtest/gtest.h>

#include "k8s/client.h"

namespace shardserve::k8s {
namespace {

TEST(MergePatchBetween, TurnsOneObjectIntoTheOther) {
  const json from = {{"phase", "Downloading"},
                     {"downloads", {{{"node", "a"}}, {{"node", "b"}}}},
                     {"model", {{"footprint", 1}, {"source", {{"revision", "r"}}}}},
                     {"same", 3}};
  const json to = {{"phase", "Ready"},
                   {"downloads", {{{"node", "a"}}}},
                   {"model", {{"source", {{"revision", "r"}}}}},
                   {"same", 3},
                   {"new", true}};
  const json patch = MergePatchBetween(from, to);
  EXPECT_EQ(patch, json({{"phase", "Ready"},
                         {"downloads", {{{"node", "a"}}}},  // an array is replaced whole
                         {"model", {{"footprint", nullptr}}},
                         {"new", true}}));
  json applied = from;
  applied.merge_patch(patch);
  EXPECT_EQ(applied, to);
  // A member gone is null: a patch that leaves it out would keep it.
  json dropped = from;
  dropped.merge_patch(MergePatchBetween(from, {{"phase", "Ready"}}));
  EXPECT_EQ(dropped, json({{"phase", "Ready"}}));
  EXPECT_EQ(MergePatchBetween(from, from), json::object());
  EXPECT_EQ(MergePatchBetween(json(), to), to);
}

}  // namespace
}  // namespace shardserve::k8s
