#include "model/kv_cache.h"

#include "absl/strings/str_cat.h"

namespace shardserve {

KvCache::KvCache(int64_t block_size, int64_t num_blocks, std::unique_ptr<KvStorage> storage)
    : block_size_(block_size), num_blocks_(num_blocks), storage_(std::move(storage)) {
  free_.reserve(num_blocks);
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

absl::Status KvCache::Reserve(SequenceKv& seq, int64_t positions) {
  const int64_t need = BlocksFor(positions) - static_cast<int64_t>(seq.blocks.size());
  if (need <= 0) return absl::OkStatus();
  if (follow_) {
    return absl::DataLossError(absl::StrCat("a block table of ", seq.blocks.size(), " blocks for ",
                                            positions, " positions"));
  }
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
