#pragma once
// A block-allocated KV cache: fixed-size blocks of `block_size` positions handed out from a free
// list, so a sequence holds only the blocks its length needs (no max-length preallocation).
// Layout per layer: [block][kv_head][slot][head_dim] for K and for V, F32. Memory is reserved
// once and committed by the OS page by page as blocks are first written.
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"

namespace shardserve {

struct SequenceKv {
  std::vector<int32_t> blocks;  // block table: position p lives in blocks[p / block_size]
  int64_t length = 0;           // positions already written
};

class KvCache {
 public:
  KvCache(int64_t num_layers, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
          int64_t num_blocks);
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  // Blocks needed to hold `positions` positions.
  int64_t BlocksFor(int64_t positions) const { return (positions + block_size_ - 1) / block_size_; }
  // Grows seq's block table to hold `positions` positions; ResourceExhausted (nothing taken)
  // when the free list is too short.
  absl::Status Reserve(SequenceKv& seq, int64_t positions);
  // Returns all of seq's blocks to the free list and empties it.
  void Release(SequenceKv& seq);

  // [block_size][head_dim] slabs of one layer, block and KV head.
  float* K(int64_t layer, int64_t block, int64_t kv_head) { return Slab(0, layer, block, kv_head); }
  float* V(int64_t layer, int64_t block, int64_t kv_head) { return Slab(1, layer, block, kv_head); }

  int64_t block_size() const { return block_size_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size()); }
  size_t bytes() const { return static_cast<size_t>(total_floats_) * sizeof(float); }

 private:
  float* Slab(int kv, int64_t layer, int64_t block, int64_t kv_head) {
    return data_.get() + ((((layer * 2 + kv) * num_blocks_ + block) * num_kv_heads_ + kv_head) *
                          block_size_ * head_dim_);
  }

  int64_t num_layers_, num_kv_heads_, head_dim_, block_size_, num_blocks_;
  int64_t total_floats_;
  std::unique_ptr<float[]> data_;  // uninitialized on purpose: pages commit on first write
  std::vector<int32_t> free_;
};

}  // namespace shardserve
