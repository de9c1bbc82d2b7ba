// The leader's LoRA adapters and their slots: free slots first, then the least recently used
// slot whose adapter runs nothing; a running adapter is never evicted; a name served twice is
// refused; an unloaded adapter takes no request and goes once idle, freeing its slot.
#include "serve/adapter_registry.h"

#include <gtest/gtest.h>

namespace shardserve {
namespace {

TEST(AdapterRegistry, FreeSlotsFirstThenTheLeastRecentlyUsedIdleOne) {
  AdapterRegistry r(2);
  const int64_t a = *r.Add("a", "/a"), b = *r.Add("b", "/b"), c = *r.Add("c", "/c");
  EXPECT_EQ(r.Add("a", "/other").status().code(), absl::StatusCode::kAlreadyExists);
  for (int64_t id : {a, b}) {
    auto p = r.Place(id);
    ASSERT_TRUE(p && p->install && !p->evicted);
    r.Installed(id, p->slot);
  }
  EXPECT_NE(r.Get(a)->slot, r.Get(b)->slot);
  auto own = r.Place(a);
  ASSERT_TRUE(own && !own->install);
  EXPECT_EQ(own->slot, r.Get(a)->slot);
  r.Started(a);
  r.Started(b);
  EXPECT_FALSE(r.Place(c).has_value()) << "both slots' adapters run";
  r.Finished(b);
  r.Finished(a);  // a used last: b is the least recently used
  auto p = r.Place(c);
  ASSERT_TRUE(p && p->install && p->evicted == b);
  r.Installed(c, p->slot);
  EXPECT_EQ(r.Get(b)->slot, -1);
  EXPECT_EQ(r.Get(c)->slot, p->slot);
}

TEST(AdapterRegistry, AnUnloadedAdapterGoesOnceItRunsNothing) {
  AdapterRegistry r(1);
  const int64_t a = *r.Add("a", "/a");
  r.Installed(a, r.Place(a)->slot);
  r.Started(a);
  ASSERT_TRUE(r.Remove("a").ok());
  EXPECT_EQ(r.Find("a"), nullptr) << "no new request names it";
  EXPECT_EQ(r.Remove("a").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(r.Reap().empty()) << "it still runs a sequence";
  r.Finished(a);
  const auto gone = r.Reap();
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].id, a);
  const int64_t again = *r.Add("a", "/a2");
  EXPECT_NE(again, a) << "a name loaded again is a new adapter";
  auto p = r.Place(again);
  ASSERT_TRUE(p && p->install && !p->evicted) << "the slot was freed";
}

}  // namespace
}  // namespace shardserve
