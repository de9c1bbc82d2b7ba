#pragma once
// Which bytes of a sequence's KV cache move between the ranks of two replicas of one model that
// are sharded differently (disaggregated serving: a prefill role and a decode role, each with its
// own tensor and pipeline sizes). A rank holds the KV of its stage's layers and of its share of
// the KV heads (as Transformer::BindWeights shares them: kv_heads / tp each, or, with more ranks
// than KV heads, the one head its query heads read; a latent cache whole on every rank). The
// prefill rank offers, for one sequence, each of its layers' K and V block by block
// (OfferedKv); a decode rank pulls, from each prefill rank holding some of its layers and heads,
// exactly those heads of those layers into its own blocks (PlanKvPull) — the KV heads re-sliced
// when the two roles' TP differ, the layers regrouped when their PP differs.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "backend/backend.h"
#include "comm/kv_transfer.h"

namespace shardserve {

// How one role holds the model's KV cache.
struct KvRoleShape {
  int tp = 1;
  std::vector<std::pair<int64_t, int64_t>> stages;  // each PP stage's layers [begin, end)
  int64_t kv_heads = 1;  // the model's KV heads (a latent cache: 1, on every rank)
  bool latent = false;
  int64_t block_size = 16;    // positions per KV block
  std::string dtype = "F32";  // the values' (DTypeName of the cache's KvFormat)
};

// One rank's share: global layers [layer_begin, layer_end), KV heads [head_begin, +heads).
struct KvShare {
  int64_t layer_begin = 0, layer_end = 0;
  int64_t head_begin = 0, heads = 1;
};
KvShare KvShareOf(const KvRoleShape& shape, int stage, int tp_rank);

// What a rank offers for a sequence whose blocks are `blocks`: for each of its `layers` layers,
// K then V (a latent cache: its one tensor), each block in order.
std::vector<KvSegment> OfferedKv(const KvStorage& kv, int64_t layers,
                                 const std::vector<int32_t>& blocks);

// The ranges one decode rank pulls from one prefill rank.
struct KvPullPlan {
  int stage = 0, tp_rank = 0;  // the prefill rank
  std::vector<KvRange> ranges;
};

// What decode rank (stage, tp_rank), whose cache is `kv` and whose blocks for the sequence are
// `blocks` (as many as the prefill side offered), pulls from the prefill role's ranks, leaving
// out the first `skip_blocks` blocks (those its prefix cache holds already). InvalidArgument when
// the two roles cannot exchange (another model's layers or heads, a block count or size apart).
absl::StatusOr<std::vector<KvPullPlan>> PlanKvPull(const KvRoleShape& prefill,
                                                   const KvRoleShape& decode, int stage,
                                                   int tp_rank, const KvStorage& kv,
                                                   const std::vector<int32_t>& blocks,
                                                   size_t skip_blocks);

}  // namespace shardserve
