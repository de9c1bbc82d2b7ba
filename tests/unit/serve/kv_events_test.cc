// The leader's KV events (serve/kv_events.h): the pool reports what it stores and evicts, the log
// gives a subscriber a snapshot and then what follows it (or tells it to start again when it
// fell behind), and every message decodes to what was encoded; malformed lines are errors.
#include "serve/kv_events.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace shardserve {
namespace {

using ::testing::HasSubstr;

BlockHash H(uint8_t b) {
  BlockHash h{};
  h[0] = b;
  h[15] = static_cast<uint8_t>(255 - b);
  return h;
}

TEST(KvEventsTest, ThePoolReportsStoredAndEvictedNames) {
  BlockPool pool(2, 4, true);
  const int32_t a = pool.Allocate(), b = pool.Allocate();
  pool.Register(a, H(1));
  pool.Register(b, H(2));
  pool.Release({a, b});
  std::vector<KvEvent> e = pool.TakeEvents();
  ASSERT_EQ(e.size(), 2u);
  EXPECT_TRUE(e[0].stored && e[0].hash == H(1) && e[1].hash == H(2));
  pool.Allocate();  // evicts the least recently used: the chain's tail, H(2)
  e = pool.TakeEvents();
  ASSERT_EQ(e.size(), 1u);
  EXPECT_FALSE(e[0].stored);
  EXPECT_EQ(e[0].hash, H(2));
  EXPECT_TRUE(pool.TakeEvents().empty());
}

TEST(KvEventsTest, SubscribersGetASnapshotThenWhatFollows) {
  KvEventLog log(4);
  log.Apply({{H(1), true}, {H(2), true}});
  uint64_t pos = 0;
  std::vector<BlockHash> snap = log.Snapshot(&pos);
  EXPECT_EQ(snap.size(), 2u);
  log.Apply({{H(1), false}, {H(3), true}});
  std::vector<KvEvent> events;
  ASSERT_TRUE(log.Since(&pos, std::chrono::milliseconds(0), &events));
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].hash, H(1));
  EXPECT_FALSE(events[0].stored);
  events.clear();
  EXPECT_TRUE(log.Since(&pos, std::chrono::milliseconds(10), &events));  // nothing new: waits
  EXPECT_TRUE(events.empty());
  // More than the backlog holds since pos: start again from a snapshot.
  for (int i = 0; i < 5; ++i) log.Apply({{H(static_cast<uint8_t>(10 + i)), true}});
  EXPECT_FALSE(log.Since(&pos, std::chrono::milliseconds(0), &events));
  EXPECT_EQ(log.Snapshot(&pos).size(), 7u);  // 2, 3 and 10-14
}

TEST(KvEventsTest, MessagesRoundTripAndBadLinesAreNamed) {
  auto hello = DecodeKvMessage(EncodeKvHello("m", 16, "abc"));
  ASSERT_TRUE(hello.ok()) << hello.status();
  EXPECT_EQ(hello->type, KvMessage::Type::kHello);
  EXPECT_EQ(hello->block_size, 16);
  std::vector<BlockHash> many;
  for (int i = 0; i < 5000; ++i) many.push_back(H(static_cast<uint8_t>(i)));
  std::vector<std::string> pieces = EncodeKvSnapshot(many);
  ASSERT_EQ(pieces.size(), 2u);  // at most kKvHashesPerMessage a line
  auto last = DecodeKvMessage(pieces[1]);
  ASSERT_TRUE(last.ok());
  EXPECT_TRUE(last->last);
  EXPECT_EQ(last->hashes.size(), 5000u - kKvHashesPerMessage);
  EXPECT_EQ(EncodeKvSnapshot({}).size(), 1u);
  std::vector<std::string> ev = EncodeKvEvents({{H(1), true}, {H(2), true}, {H(3), false}});
  ASSERT_EQ(ev.size(), 2u);
  auto removed = DecodeKvMessage(ev[1]);
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(removed->type, KvMessage::Type::kRemoved);
  EXPECT_EQ(removed->hashes, std::vector<BlockHash>{H(3)});
  auto load = DecodeKvMessage(EncodeKvLoad({1, 2, 8, 30, 100}));
  ASSERT_TRUE(load.ok());
  EXPECT_EQ(load->load.kv_used, 30);
  EXPECT_TRUE(load->load.accepting);
  ReplicaLoad draining{1, 2, 8, 30, 100};
  draining.accepting = false;
  auto drained = DecodeKvMessage(EncodeKvLoad(draining));
  ASSERT_TRUE(drained.ok());
  EXPECT_FALSE(drained->load.accepting);
  EXPECT_EQ(EncodeKvLoad(draining).find("adapters"), std::string::npos);  // a base-only replica
  ReplicaLoad lora{1, 2, 8, 30, 100};
  lora.max_loras = 4;
  lora.adapters = {"sql", "legal"};
  auto with_adapters = DecodeKvMessage(EncodeKvLoad(lora));
  ASSERT_TRUE(with_adapters.ok());
  EXPECT_EQ(with_adapters->load.max_loras, 4);
  EXPECT_EQ(with_adapters->load.adapters, (std::vector<std::string>{"sql", "legal"}));
  for (const auto& [line, why] : std::vector<std::pair<std::string, std::string>>{
           {"not json", "not a JSON object"},
           {R"({"type":"dance"})", "unknown type 'dance'"},
           {R"({"type":"stored","hashes":["zz"]})", "not 32 hex digits"},
           {R"({"type":"stored","hashes":["0123456789abcdef0123456789abcdeg"]})", "hex"},
           {R"({"type":"load","waiting":-1})", "'waiting'"},
           {R"({"type":"load","waiting":0,"running":0,"max_batch":1,"kv_used":0,"kv_blocks":1,)"
            R"("accepting":true,"max_loras":1,"adapters":["a","b"]})",
            "at most max_loras"},
           {R"({"type":"load","waiting":0,"running":0,"max_batch":1,"kv_used":0,"kv_blocks":1,)"
            R"("accepting":true,"max_loras":2,"adapters":[""]})",
            "1-256 bytes"},
           {R"({"type":"hello","model":"m","block_size":0,"epoch":"e"})", "block_size"}}) {
    auto m = DecodeKvMessage(line);
    ASSERT_FALSE(m.ok()) << line;
    EXPECT_THAT(std::string(m.status().message()), HasSubstr(why)) << line;
  }
  EXPECT_FALSE(DecodeKvMessage(std::string(kMaxKvEventLine + 1, ' ')).ok());
}

}  // namespace
}  // namespace shardserve
