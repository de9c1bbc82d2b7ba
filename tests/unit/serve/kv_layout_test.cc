// A sequence's KV moved between two roles sharded differently: each prefill rank's CPU cache
// offered through its own KvExporter, each decode rank pulling what PlanKvPull names into its own
// cache over UCX; every decode slab must then hold the values of its global (layer, K/V, head,
// position) — the heads re-sliced across TP, the layers regrouped across PP, prefix blocks left.
#include "serve/kv_layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>

#include "backend/cpu/cpu_backend.h"

namespace shardserve {
namespace {

constexpr int64_t kLayers = 4, kHeadDim = 8, kBlockSize = 4;

// The value of element d of head h at position p of layer l's K (kv 0) or V.
// The bytes of one cached value (its dtype's size, at most 4) that name where it belongs; 0xFF..
// where nothing was written.
uint32_t Value(int64_t l, int kv, int64_t h, int64_t p, int64_t d) {
  uint32_t x = static_cast<uint32_t>(((l * 2 + kv) * 64 + h) * 1000 + p * 10 + d + 1);
  x *= 2654435761u;  // spread the name over the low bytes (1- and 2-byte values)
  return x ^ (x >> 16);
}
void Put(void* slab, int64_t i, size_t es, uint32_t v) {
  std::memcpy(static_cast<char*>(slab) + i * es, &v, es);
}
uint32_t Get(const void* slab, int64_t i, size_t es) {
  uint32_t v = 0;
  std::memcpy(&v, static_cast<const char*>(slab) + i * es, es);
  return v;
}

struct Rank {
  std::unique_ptr<KvStorage> kv;
  KvShare share;
  std::vector<int32_t> blocks;  // the sequence's
};

std::vector<std::pair<int64_t, int64_t>> Stages(int pp) {
  std::vector<std::pair<int64_t, int64_t>> s;
  for (int i = 0; i < pp; ++i) s.push_back({kLayers * i / pp, kLayers * (i + 1) / pp});
  return s;
}

// The ranks of a role with their caches (a sequence of `n` blocks at scattered block ids).
std::map<std::pair<int, int>, Rank> MakeRole(Backend& be, const KvRoleShape& shape, size_t n,
                                             int32_t first_block, bool fill) {
  std::map<std::pair<int, int>, Rank> ranks;
  for (int s = 0; s < static_cast<int>(shape.stages.size()); ++s) {
    for (int r = 0; r < shape.tp; ++r) {
      Rank rank;
      rank.share = KvShareOf(shape, s, r);
      const int64_t layers = rank.share.layer_end - rank.share.layer_begin;
      KvFormat format;
      format.dtype = *ParseDType(shape.dtype);
      auto kv = shape.latent
                    ? be.AllocLatentKv(layers, 32, kBlockSize, kHeadDim - 2, 2, format)
                    : be.AllocKv(layers, 32, rank.share.heads, kBlockSize, kHeadDim, format);
      EXPECT_TRUE(kv.ok()) << kv.status();
      rank.kv = std::move(*kv);
      for (size_t i = 0; i < n; ++i) rank.blocks.push_back((first_block + 7 * i) % 32);
      const int parts = shape.latent ? 1 : 2;
      const size_t es = DTypeSize(rank.kv->format.dtype);
      for (int64_t l = 0; l < layers; ++l) {
        for (int part = 0; part < parts; ++part) {
          for (size_t i = 0; i < n; ++i) {
            void* slab = rank.kv->block_data(l, part, rank.blocks[i]);
            for (int64_t h = 0; h < rank.share.heads; ++h) {
              for (int64_t p = 0; p < kBlockSize; ++p) {
                for (int64_t d = 0; d < kHeadDim; ++d) {
                  Put(slab, (h * kBlockSize + p) * kHeadDim + d, es,
                      fill ? Value(rank.share.layer_begin + l, part, rank.share.head_begin + h,
                                   static_cast<int64_t>(i) * kBlockSize + p, d)
                           : 0xFFFFFFFFu);
                }
              }
            }
          }
        }
      }
      ranks.emplace(std::make_pair(s, r), std::move(rank));
    }
  }
  return ranks;
}

// Moves a sequence of `n` blocks from a prefill role to a decode role, the decode side holding
// the first `skip` blocks already, and checks every decode slab.
void Move(const KvRoleShape& prefill, const KvRoleShape& decode, size_t n, size_t skip) {
  SCOPED_TRACE(::testing::Message()
               << "prefill TP " << prefill.tp << " PP " << prefill.stages.size() << ", decode TP "
               << decode.tp << " PP " << decode.stages.size() << ", kv heads " << decode.kv_heads
               << (decode.latent ? " latent" : "") << " " << decode.dtype);
  auto be = cpu::NewBackend(1);
  auto from = MakeRole(*be, prefill, n, 3, true);
  auto to = MakeRole(*be, decode, n, 11, false);
  auto ticket = NewKvTicket();
  ASSERT_TRUE(ticket.ok());
  std::map<std::pair<int, int>, std::unique_ptr<KvExporter>> exporters;
  for (auto& [at, rank] : from) {
    auto e = KvExporter::Create();
    ASSERT_TRUE(e.ok()) << e.status();
    ASSERT_TRUE(
        (*e)->Offer(*ticket,
                    OfferedKv(*rank.kv, rank.share.layer_end - rank.share.layer_begin, rank.blocks),
                    absl::Now() + absl::Seconds(60))
            .ok());
    exporters[at] = std::move(*e);
  }
  auto puller = KvPuller::Create();
  ASSERT_TRUE(puller.ok());
  for (auto& [at, rank] : to) {
    auto plans = PlanKvPull(prefill, decode, at.first, at.second, *rank.kv, rank.blocks, skip);
    ASSERT_TRUE(plans.ok()) << plans.status();
    for (const KvPullPlan& plan : *plans) {
      absl::Status s = (*puller)->Pull(exporters.at({plan.stage, plan.tp_rank})->address(), *ticket,
                                       plan.ranges, absl::Seconds(10));
      ASSERT_TRUE(s.ok()) << s;
    }
    const int parts = decode.latent ? 1 : 2;
    const size_t es = DTypeSize(rank.kv->format.dtype);
    const uint32_t mask = es == 4 ? 0xFFFFFFFFu : (1u << (8 * es)) - 1;
    for (int64_t l = 0; l < rank.share.layer_end - rank.share.layer_begin; ++l) {
      for (int part = 0; part < parts; ++part) {
        for (size_t i = 0; i < n; ++i) {
          const void* slab = rank.kv->block_data(l, part, rank.blocks[i]);
          for (int64_t h = 0; h < rank.share.heads; ++h) {
            for (int64_t p = 0; p < kBlockSize; ++p) {
              for (int64_t d = 0; d < kHeadDim; ++d) {
                const uint32_t want =
                    (i < skip ? 0xFFFFFFFFu
                              : Value(rank.share.layer_begin + l, part, rank.share.head_begin + h,
                                      static_cast<int64_t>(i) * kBlockSize + p, d)) &
                    mask;
                ASSERT_EQ(Get(slab, (h * kBlockSize + p) * kHeadDim + d, es), want)
                    << "decode rank (" << at.first << ", " << at.second << ") layer " << l
                    << " part " << part << " block " << i << " head " << h;
              }
            }
          }
        }
      }
    }
  }
}

KvRoleShape Shape(int tp, int pp, int64_t kv_heads, bool latent = false,
                  const char* dtype = "F32") {
  return {tp, Stages(pp), kv_heads, latent, kBlockSize, dtype};
}

TEST(KvLayoutTest, SharesAsTheModelBindsThem) {
  KvShare s = KvShareOf(Shape(2, 2, 4), 1, 1);
  EXPECT_EQ(s.layer_begin, 2);
  EXPECT_EQ(s.layer_end, 4);
  EXPECT_EQ(s.head_begin, 2);
  EXPECT_EQ(s.heads, 2);
  s = KvShareOf(Shape(4, 1, 2), 0, 3);  // more ranks than KV heads: the one its queries read
  EXPECT_EQ(s.head_begin, 1);
  EXPECT_EQ(s.heads, 1);
}

TEST(KvLayoutTest, HeadsResliceAcrossTensorParallelSizes) {
  Move(Shape(2, 1, 4), Shape(1, 1, 4), 5, 0);  // prefill TP 2, decode TP 1
  Move(Shape(1, 1, 4), Shape(2, 1, 4), 5, 0);  // and the reverse
  Move(Shape(4, 1, 4), Shape(2, 1, 4), 3, 0);
  Move(Shape(4, 1, 2), Shape(1, 1, 2), 3, 0);  // replicated heads on the prefill side
  Move(Shape(1, 1, 2), Shape(4, 1, 2), 3, 0);  // and on the decode side
}

TEST(KvLayoutTest, LayersRegroupAcrossPipelineSizes) {
  Move(Shape(1, 2, 4), Shape(2, 1, 4), 4, 0);
  Move(Shape(2, 1, 4), Shape(1, 4, 4), 4, 0);
  Move(Shape(2, 2, 4), Shape(2, 2, 4), 2, 0);
}

TEST(KvLayoutTest, PrefixBlocksTheDecodeSideHoldsStay) {
  Move(Shape(2, 1, 4), Shape(1, 2, 4), 6, 4);  // only blocks 4 and 5 move
}

TEST(KvLayoutTest, ALatentCacheMovesWholeFromOneRank) {
  Move(Shape(2, 1, 1, true), Shape(1, 2, 1, true), 3, 1);
}

// BF16 and FP8 caches move value for value, their heads resliced and layers regrouped alike.
TEST(KvLayoutTest, CachesOfEachDtypeMove) {
  for (const char* dtype : {"BF16", "F16", "F8_E4M3"}) {
    Move(Shape(1, 2, 4, false, dtype), Shape(2, 1, 4, false, dtype), 5, 1);
    Move(Shape(2, 1, 1, true, dtype), Shape(1, 2, 1, true, dtype), 3, 0);
  }
}

TEST(KvLayoutTest, RolesOfDifferentCachesAreRefused) {
  auto be = cpu::NewBackend(1);
  auto kv = be->AllocKv(4, 8, 4, kBlockSize, kHeadDim, KvFormat{});
  ASSERT_TRUE(kv.ok());
  KvRoleShape other = Shape(1, 1, 4);
  other.block_size = 8;
  EXPECT_TRUE(
      absl::IsInvalidArgument(PlanKvPull(other, Shape(1, 1, 4), 0, 0, **kv, {1, 2}, 0).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      PlanKvPull(Shape(1, 1, 2), Shape(1, 1, 4), 0, 0, **kv, {1, 2}, 0).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      PlanKvPull(Shape(1, 1, 4), Shape(1, 1, 4), 1, 0, **kv, {1, 2}, 0).status()));
  // Values of another dtype: refused by name.
  EXPECT_THAT(PlanKvPull(Shape(1, 1, 4, false, "BF16"), Shape(1, 1, 4), 0, 0, **kv, {1, 2}, 0)
                  .status()
                  .message(),
              ::testing::HasSubstr("values BF16 / F32"));
}

}  // namespace
}  // namespace shardserve
