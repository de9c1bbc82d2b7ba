#include "serve/kv_layout.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace shardserve {

KvShare KvShareOf(const KvRoleShape& shape, int stage, int tp_rank) {
  KvShare s;
  s.layer_begin = shape.stages[stage].first;
  s.layer_end = shape.stages[stage].second;
  if (shape.latent) return s;  // one tensor, whole on every rank
  const int64_t T = shape.tp;
  if (shape.kv_heads >= T) {
    s.heads = shape.kv_heads / T;
    s.head_begin = tp_rank * s.heads;
  } else {  // more ranks than KV heads: the one its query heads read (as BindWeights)
    s.heads = 1;
    s.head_begin = tp_rank * shape.kv_heads / T;
  }
  return s;
}

std::vector<KvSegment> OfferedKv(const KvStorage& kv, int64_t layers,
                                 const std::vector<int32_t>& blocks) {
  std::vector<KvSegment> out;
  const int parts = kv.block_data(0, 1, 0) == nullptr ? 1 : 2;  // a latent cache: one tensor
  out.reserve(static_cast<size_t>(layers) * parts * blocks.size());
  for (int64_t l = 0; l < layers; ++l) {
    for (int part = 0; part < parts; ++part) {
      for (int32_t b : blocks) out.push_back({kv.block_data(l, part, b), kv.block_bytes()});
    }
  }
  return out;
}

absl::StatusOr<std::vector<KvPullPlan>> PlanKvPull(const KvRoleShape& prefill,
                                                   const KvRoleShape& decode, int stage,
                                                   int tp_rank, const KvStorage& kv,
                                                   const std::vector<int32_t>& blocks,
                                                   size_t skip_blocks) {
  if (prefill.kv_heads != decode.kv_heads || prefill.latent != decode.latent ||
      prefill.block_size != decode.block_size || prefill.dtype != decode.dtype ||
      prefill.stages.empty() || decode.stages.empty() ||
      prefill.stages.back().second != decode.stages.back().second) {
    return absl::InvalidArgumentError(
        absl::StrCat("the prefill and decode roles hold different KV caches (KV heads ",
                     prefill.kv_heads, " / ", decode.kv_heads, ", block size ", prefill.block_size,
                     " / ", decode.block_size, ", values ", prefill.dtype, " / ", decode.dtype,
                     ", layers ", prefill.stages.empty() ? 0 : prefill.stages.back().second, " / ",
                     decode.stages.empty() ? 0 : decode.stages.back().second, ")"));
  }
  if (stage < 0 || stage >= static_cast<int>(decode.stages.size()) || tp_rank < 0 ||
      tp_rank >= decode.tp) {
    return absl::InvalidArgumentError(
        absl::StrCat("no decode rank (stage ", stage, ", tp ", tp_rank, ")"));
  }
  const KvShare mine = KvShareOf(decode, stage, tp_rank);
  const int parts = decode.latent ? 1 : 2;
  const size_t slab = kv.block_bytes() / static_cast<size_t>(mine.heads);  // one head's bytes
  const size_t n = blocks.size();
  std::vector<KvPullPlan> plans;
  auto plan_for = [&](int s, int r) -> KvPullPlan& {
    for (KvPullPlan& p : plans) {
      if (p.stage == s && p.tp_rank == r) return p;
    }
    plans.push_back({s, r, {}});
    return plans.back();
  };
  for (int s = 0; s < static_cast<int>(prefill.stages.size()); ++s) {
    const int64_t l0 = std::max(mine.layer_begin, prefill.stages[s].first);
    const int64_t l1 = std::min(mine.layer_end, prefill.stages[s].second);
    if (l0 >= l1) continue;
    // Each of my heads from the first prefill rank of the stage that holds it, in runs.
    for (int64_t h = mine.head_begin; h < mine.head_begin + mine.heads;) {
      int from = -1;
      KvShare theirs;
      for (int r = 0; r < prefill.tp && from < 0; ++r) {
        theirs = KvShareOf(prefill, s, r);
        if (h >= theirs.head_begin && h < theirs.head_begin + theirs.heads) from = r;
      }
      if (from < 0) return absl::InternalError(absl::StrCat("no prefill rank holds KV head ", h));
      const int64_t count =
          std::min(mine.head_begin + mine.heads, theirs.head_begin + theirs.heads) - h;
      KvPullPlan& plan = plan_for(s, from);
      for (int64_t l = l0; l < l1; ++l) {
        for (int part = 0; part < parts; ++part) {
          for (size_t i = skip_blocks; i < n; ++i) {
            const size_t segment =
                ((static_cast<size_t>(l - prefill.stages[s].first) * parts + part) * n) + i;
            plan.ranges.push_back(
                {static_cast<uint32_t>(segment),
                 static_cast<uint64_t>(h - theirs.head_begin) * slab,
                 static_cast<uint64_t>(count) * slab,
                 static_cast<char*>(kv.block_data(l - mine.layer_begin, part, blocks[i])) +
                     static_cast<size_t>(h - mine.head_begin) * slab});
          }
        }
      }
      h += count;
    }
  }
  return plans;
}

}  // namespace shardserve
