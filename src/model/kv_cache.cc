#include "model/kv_cache.h"

#include "absl/strings/str_cat.h"

namespace shardserve {

KvCache::KvCache(int64_t num_layers, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                 int64_t num_blocks)
    : num_layers_(num_layers),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      block_size_(block_size),
      num_blocks_(num_blocks),
      total_floats_(num_layers * 2 * num_blocks * num_kv_heads * block_size * head_dim),
      data_(new float[total_floats_]) {
  free_.reserve(num_blocks);
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

absl::Status KvCache::Reserve(SequenceKv& seq, int64_t positions) {
  const int64_t need = BlocksFor(positions) - static_cast<int64_t>(seq.blocks.size());
  if (need <= 0) return absl::OkStatus();
  if (need > free_blocks()) {
    return absl::ResourceExhaustedError(absl::StrCat("KV cache full: ", positions,
                                                     " positions need ", need, " more blocks, ",
                                                     free_blocks(), " free of ", num_blocks_));
  }
  for (int64_t i = 0; i < need; ++i) {
    seq.blocks.push_back(free_.back());
    free_.pop_back();
  }
  return absl::OkStatus();
}

void KvCache::Release(SequenceKv& seq) {
  for (auto it = seq.blocks.rbegin(); it != seq.blocks.rend(); ++it) free_.push_back(*it);
  seq.blocks.clear();
  seq.length = 0;
}

}  // namespace shardserve
