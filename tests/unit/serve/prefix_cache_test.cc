// The leader's block pool: cached blocks are shared with reference counts, evicted least
// recently used (a chain's tail before its head) and only when no free block is left.
#include "serve/prefix_cache.h"

#include <gtest/gtest.h>

namespace shardserve {
namespace {

std::vector<BlockHash> Chain(const std::vector<int32_t>& tokens, int64_t bs) {
  std::vector<BlockHash> out;
  for (size_t b = 0; (b + 1) * bs <= tokens.size(); ++b) {
    out.push_back(HashBlock(out.empty() ? std::nullopt : std::optional(out.back()),
                            tokens.data() + b * bs, bs));
  }
  return out;
}

TEST(PrefixCacheTest, NamesAreHashChains) {
  const std::vector<int32_t> a = {1, 2, 3, 4, 5, 6}, b = {1, 2, 3, 4, 9, 9}, c = {9, 2, 3, 4};
  EXPECT_EQ(Chain(a, 2)[1], Chain(b, 2)[1]);  // same prefix, same names
  EXPECT_NE(Chain(a, 2)[2], Chain(b, 2)[2]);
  EXPECT_NE(Chain(a, 2)[1], Chain(c, 2)[1]);  // same block, other prefix: another name
  EXPECT_NE(HashBlock(std::nullopt, a.data(), 2), HashBlock(Chain(a, 2)[0], a.data(), 2));
}

// A salt (a request's cache_salt, a tenant's key under perKey isolation) enters the first name
// and so every name of the chain: equal tokens under other salts share nothing, and the names
// cannot be computed from the tokens alone.
TEST(PrefixCacheTest, SaltedChainsShareNothingWithOtherSalts) {
  const std::vector<int32_t> a = {1, 2, 3, 4, 5, 6};
  const auto plain = HashBlocks(a, 2), x = HashBlocks(a, 2, "x"), y = HashBlocks(a, 2, "y");
  for (size_t b = 0; b < plain.size(); ++b) {
    EXPECT_NE(plain[b], x[b]) << b;
    EXPECT_NE(x[b], y[b]) << b;
  }
  EXPECT_EQ(x, HashBlocks(a, 2, "x"));
  EXPECT_EQ(PrefixCacheSalt(false, "Bearer sk-one-0123456789abcdef", ""), "");
  const std::string one = PrefixCacheSalt(true, "Bearer sk-one-0123456789abcdef", "");
  const std::string two = PrefixCacheSalt(true, "Bearer sk-two-0123456789abcdef", "");
  EXPECT_FALSE(one.empty());
  EXPECT_NE(one, two);
  EXPECT_EQ(one, PrefixCacheSalt(true, "bearer  sk-one-0123456789abcdef ", ""));
  EXPECT_NE(one, PrefixCacheSalt(true, "Bearer sk-one-0123456789abcdef", "s"));
  EXPECT_NE(PrefixCacheSalt(false, "", "s"), PrefixCacheSalt(true, "Bearer k", "s"));
  EXPECT_EQ(one.find("sk-one"), std::string::npos) << "the key itself is never in a salt";
  // A LoRA adapter salts its blocks apart from the base's and every other adapter's, with or
  // without the other parts, unambiguously (an adapter is never read as a request's salt).
  const std::string sql = PrefixCacheSalt(false, "", "", "sql");
  EXPECT_FALSE(sql.empty());
  EXPECT_NE(sql, PrefixCacheSalt(false, "", "", "sq"));
  EXPECT_NE(sql, PrefixCacheSalt(false, "", "sql"));
  EXPECT_NE(PrefixCacheSalt(false, "", "l", "sq"), PrefixCacheSalt(false, "", "", "sql"));
  EXPECT_NE(PrefixCacheSalt(true, "Bearer k", "", "sql"), PrefixCacheSalt(true, "Bearer k", ""));
}

TEST(PrefixCacheTest, SharedThenEvictedLeastRecentlyUsedTailFirst) {
  BlockPool pool(4, 2, true);
  const auto names = Chain({1, 2, 3, 4, 5, 6}, 2);
  std::vector<int32_t> seq = {pool.Allocate(), pool.Allocate(), pool.Allocate()};
  EXPECT_EQ(pool.available(), 1);
  EXPECT_TRUE(pool.Match(names).empty());  // nothing named yet
  for (int i = 0; i < 3; ++i) pool.Register(seq[i], names[i]);
  EXPECT_EQ(pool.cached(), 3);
  // A second sequence shares the first two while the first still holds them.
  std::vector<int32_t> other = pool.Match({names[0], names[1]});
  EXPECT_EQ(other, std::vector<int32_t>({seq[0], seq[1]}));
  EXPECT_EQ(pool.available(), 1);
  pool.Release(seq);
  EXPECT_EQ(pool.available(), 2);  // the free one, and seq[2] (cached, held by none)
  pool.Release(other);
  EXPECT_EQ(pool.available(), 4);
  EXPECT_EQ(pool.used(), 0);
  // The free block goes first, then the chain's tail, then its head.
  const int32_t free_one = pool.Allocate();
  EXPECT_TRUE(free_one != seq[0] && free_one != seq[1] && free_one != seq[2]);
  EXPECT_EQ(pool.cached(), 3);
  EXPECT_EQ(pool.Allocate(), seq[2]);
  EXPECT_EQ(pool.cached(), 2);
  EXPECT_EQ(pool.Match(names), std::vector<int32_t>({seq[0], seq[1]}));  // the head survives
}

TEST(PrefixCacheTest, ANameCachedTwiceKeepsItsFirstBlockAndOffNothingIsShared) {
  BlockPool pool(4, 2, true);
  const auto names = Chain({1, 2}, 2);
  const int32_t a = pool.Allocate(), b = pool.Allocate();
  pool.Register(a, names[0]);
  pool.Register(b, names[0]);  // computed twice at once: b stays private
  EXPECT_EQ(pool.cached(), 1);
  pool.Release({a, b});
  EXPECT_EQ(pool.Match(names), std::vector<int32_t>({a}));
  BlockPool off(4, 2, false);
  const int32_t c = off.Allocate();
  off.Register(c, names[0]);
  off.Release({c});
  EXPECT_TRUE(off.Match(names).empty());
  EXPECT_EQ(off.available(), 4);
}

}  // namespace
}  // namespace shardserve
