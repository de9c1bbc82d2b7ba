#include "serve/prefix_cache.h"

#include <openssl/sha.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace shardserve {

BlockHash HashBlock(const std::optional<BlockHash>& parent, const int32_t* tokens, int64_t n,
                    std::string_view salt) {
  SHA256_CTX ctx;
  SHA256_Init(&ctx);
  // 0: a first block, 1: a later one, 2: a first block with a salt (its length, then its bytes).
  const uint8_t first = parent ? 1 : salt.empty() ? 0 : 2;
  SHA256_Update(&ctx, &first, 1);
  if (parent) SHA256_Update(&ctx, parent->data(), parent->size());
  if (!parent && !salt.empty()) {
    const uint64_t len = salt.size();
    uint8_t b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<uint8_t>(len >> (8 * i));
    SHA256_Update(&ctx, b, 8);
    SHA256_Update(&ctx, salt.data(), salt.size());
  }
  for (int64_t i = 0; i < n; ++i) {  // little-endian ids, whatever the host
    const uint32_t t = static_cast<uint32_t>(tokens[i]);
    const uint8_t b[4] = {static_cast<uint8_t>(t), static_cast<uint8_t>(t >> 8),
                          static_cast<uint8_t>(t >> 16), static_cast<uint8_t>(t >> 24)};
    SHA256_Update(&ctx, b, 4);
  }
  uint8_t digest[SHA256_DIGEST_LENGTH];
  SHA256_Final(digest, &ctx);
  BlockHash h;
  std::memcpy(h.data(), digest, h.size());
  return h;
}

std::vector<BlockHash> HashBlocks(const std::vector<int32_t>& tokens, int64_t block_size,
                                  std::string_view salt) {
  std::vector<BlockHash> out;
  const int64_t full = static_cast<int64_t>(tokens.size()) / block_size;
  for (int64_t b = 0; b < full; ++b) {
    out.push_back(HashBlock(b == 0 ? std::nullopt : std::optional(out.back()),
                            tokens.data() + b * block_size, block_size, salt));
  }
  return out;
}

std::string PrefixCacheSalt(bool per_key, std::string_view authorization,
                            std::string_view cache_salt, std::string_view adapter) {
  std::string tenant;
  if (per_key) {
    // The key as ApiKeys reads it: after "Bearer ", trimmed.
    absl::string_view key =
        absl::StripAsciiWhitespace(absl::string_view(authorization.data(), authorization.size()));
    if (absl::StartsWithIgnoreCase(key, "bearer ")) key = absl::StripAsciiWhitespace(key.substr(7));
    uint8_t digest[SHA256_DIGEST_LENGTH];
    SHA256(reinterpret_cast<const uint8_t*>(key.data()), key.size(), digest);
    tenant.assign(reinterpret_cast<const char*>(digest), sizeof(digest));
  }
  if (tenant.empty() && cache_salt.empty() && adapter.empty()) return "";
  // Unambiguous: the adapter (its length, then its bytes) after a marker of its own, or none;
  // the tenant's 32 bytes (or none) with a marker; then the request's salt.
  std::string out;
  if (!adapter.empty()) {
    adapter = adapter.substr(0, 255);
    out.push_back('a');
    out.push_back(static_cast<char>(adapter.size()));
    out.append(adapter.data(), adapter.size());
  }
  absl::StrAppend(&out, tenant.empty() ? "-" : "k", tenant,
                  absl::string_view(cache_salt.data(), cache_salt.size()));
  return out;
}

BlockPool::BlockPool(int64_t num_blocks, int64_t block_size, bool caching)
    : num_blocks_(num_blocks), block_size_(block_size), caching_(caching), blocks_(num_blocks) {
  free_.reserve(num_blocks);
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

std::vector<int32_t> BlockPool::Match(const std::vector<BlockHash>& hashes) {
  std::vector<int32_t> out;
  if (!caching_) return out;
  for (const BlockHash& h : hashes) {
    auto it = by_hash_.find(h);
    if (it == by_hash_.end()) break;
    Block& b = blocks_[it->second];
    if (b.refs++ == 0) lru_.erase(b.lru);
    out.push_back(it->second);
  }
  return out;
}

int32_t BlockPool::Allocate() {
  int32_t id;
  if (!free_.empty()) {
    id = free_.back();
    free_.pop_back();
  } else {  // the least recently used cached block, forgotten
    id = lru_.front();
    lru_.pop_front();
    by_hash_.erase(*blocks_[id].hash);
    events_.push_back({*blocks_[id].hash, false});
    blocks_[id].hash.reset();
  }
  blocks_[id].refs = 1;
  return id;
}

void BlockPool::Release(const std::vector<int32_t>& ids) {
  // Most recently used go last, the sequence's last block before its first: of a chain, the tail
  // is evicted before the blocks it follows, never the head before its tail.
  for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
    Block& b = blocks_[*it];
    if (--b.refs > 0) continue;
    if (b.hash) {
      b.lru = lru_.insert(lru_.end(), *it);
    } else {
      free_.push_back(*it);
    }
  }
}

void BlockPool::Register(int32_t id, const BlockHash& hash) {
  Block& b = blocks_[id];
  if (!caching_ || b.hash || by_hash_.count(hash)) return;
  b.hash = hash;
  by_hash_.emplace(hash, id);
  events_.push_back({hash, true});
}

}  // namespace shardserve
