#pragma once
// The replica's KV blocks as the leader hands them out (DESIGN.md §5): every rank follows the
// block tables the steps carry. With prefix caching, a full block is named by the hash chain of
// its tokens (SHA-256 of the previous block's name and its own token ids: equal names, equal
// prefixes, so equal contents for the one model a replica serves); when its sequences end it stays
// cached, and a later sequence that starts with the same blocks takes them (reference counted,
// shared read-only) and skips their prefill. Cached blocks no sequence holds are evicted least
// recently used, only when the free blocks run out. Not thread-safe: the engine's thread owns it.
#include <array>
#include <cstdint>
#include <list>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace shardserve {

using BlockHash = std::array<uint8_t, 16>;  // the first 16 bytes of the SHA-256

// The name of the block after `parent` (nullopt: the first block) holding `tokens`. A salt
// (PrefixCacheSalt) enters the first block's name, so every name of the chain: only sequences
// with the same salt share blocks, and a name cannot be computed from the tokens alone.
BlockHash HashBlock(const std::optional<BlockHash>& parent, const int32_t* tokens, int64_t n,
                    std::string_view salt = "");
// The names of the full blocks of `tokens`, in order (the chain a prompt's prefix is matched by).
std::vector<BlockHash> HashBlocks(const std::vector<int32_t>& tokens, int64_t block_size,
                                  std::string_view salt = "");

// The salt of a request's block names: with spec.serving.prefixCacheIsolation perKey, the
// tenant's (the SHA-256 of its API key, from the Authorization header: `authorization`); and
// the request's own cache_salt (vLLM's); and the LoRA adapter it runs (its name, at most 255
// bytes; "": the base model), since a block computed under one adapter holds other KV than the
// same tokens under another. Empty when none applies. The leaders and the router compute it
// alike.
std::string PrefixCacheSalt(bool per_key, std::string_view authorization,
                            std::string_view cache_salt, std::string_view adapter = "");

struct BlockHashHasher {
  size_t operator()(const BlockHash& h) const {
    size_t v;
    static_assert(sizeof(v) <= sizeof(BlockHash));
    std::copy_n(h.data(), sizeof(v), reinterpret_cast<uint8_t*>(&v));
    return v;
  }
};

// A name that became cached (stored) or stopped being cached (evicted): what a router learns the
// replica's cache from (serve/kv_events.h).
struct KvEvent {
  BlockHash hash;
  bool stored = true;  // else removed
};

class BlockPool {
 public:
  BlockPool(int64_t num_blocks, int64_t block_size, bool caching);

  int64_t block_size() const { return block_size_; }
  int64_t num_blocks() const { return num_blocks_; }
  bool caching() const { return caching_; }
  // Blocks a sequence can still take: free, and cached ones no sequence holds (evictable).
  int64_t available() const { return static_cast<int64_t>(free_.size() + lru_.size()); }
  // Blocks held by sequences.
  int64_t used() const { return num_blocks_ - available(); }
  // Blocks that hold a cached prefix (held or not).
  int64_t cached() const { return static_cast<int64_t>(by_hash_.size()); }

  // The cached blocks named by `hashes` from the first, as far as they go in order; each is
  // taken (its reference count raised).
  std::vector<int32_t> Match(const std::vector<BlockHash>& hashes);
  // A block for a sequence to fill: a free one, else the least recently used cached block no
  // sequence holds (forgotten). Check available() first.
  int32_t Allocate();
  // A sequence's blocks given back: cached ones no sequence holds any more become evictable
  // (most recently used last), the others free.
  void Release(const std::vector<int32_t>& blocks);
  // Block `b`, now full and written, holds the block named `hash`: later sequences may share
  // it. A name already cached keeps its block (b stays private to its sequence).
  void Register(int32_t b, const BlockHash& hash);
  // The names stored and evicted since the last call, in order.
  std::vector<KvEvent> TakeEvents() { return std::exchange(events_, {}); }

 private:
  struct Block {
    int32_t refs = 0;
    std::optional<BlockHash> hash;     // set while it is cached
    std::list<int32_t>::iterator lru;  // valid while refs == 0 and cached
  };
  int64_t num_blocks_, block_size_;
  bool caching_;
  std::vector<Block> blocks_;
  std::vector<int32_t> free_;
  std::list<int32_t> lru_;  // cached, held by no sequence: least recently used first
  std::unordered_map<BlockHash, int32_t, BlockHashHasher> by_hash_;
  std::vector<KvEvent> events_;
};

}  // namespace shardserve
