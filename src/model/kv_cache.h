#pragma once
// The block tables of a block-allocated KV cache: fixed-size blocks of `block_size` positions
// handed out from a free list, so a sequence holds only the blocks its length needs (no
// max-length preallocation). The storage is the backend's (Backend::AllocKv): per layer
// [block][kv_head][slot][head_dim] for K and for V, F32.
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "backend/backend.h"

namespace shardserve {

struct SequenceKv {
  std::vector<int32_t> blocks;  // block table: position p lives in blocks[p / block_size]
  int64_t length = 0;           // positions already written
};

class KvCache {
 public:
  KvCache(int64_t block_size, int64_t num_blocks, std::unique_ptr<KvStorage> storage = nullptr);
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  // Blocks needed to hold `positions` positions.
  int64_t BlocksFor(int64_t positions) const { return (positions + block_size_ - 1) / block_size_; }
  // Grows seq's block table to hold `positions` positions; ResourceExhausted (nothing taken)
  // when the free list is too short.
  absl::Status Reserve(SequenceKv& seq, int64_t positions);
  // Returns all of seq's blocks to the free list and empties it.
  void Release(SequenceKv& seq);
  // The block tables come from elsewhere (a replica's leader, serve/prefix_cache.h): Reserve
  // takes nothing from the free list and fails (DataLoss) when a table is too short.
  void FollowTables() { follow_ = true; }

  // The backend's storage (null for block tables alone).
  const KvStorage* storage() const { return storage_.get(); }
  int64_t block_size() const { return block_size_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size()); }

 private:
  int64_t block_size_, num_blocks_;
  std::vector<int32_t> free_;
  bool follow_ = false;
  std::unique_ptr<KvStorage> storage_;
};

}  // namespace shardserve
