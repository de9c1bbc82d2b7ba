// The step protocol and the framing every control message shares (serve/step_wire.h,
// comm/json_frame.h): round trips, and each malformed message refused naming what is wrong.
#include "serve/step_wire.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "comm/json_frame.h"

namespace shardserve {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

// Reads from a byte string, as a socket or a communicator would deliver it.
ReadExactly From(const std::string& bytes) {
  auto pos = std::make_shared<size_t>(0);
  return [bytes, pos](void* data, size_t n) -> absl::Status {
    if (*pos + n > bytes.size()) return absl::UnavailableError("the peer closed");
    std::memcpy(data, bytes.data() + *pos, n);
    *pos += n;
    return absl::OkStatus();
  };
}

std::string Error(const absl::Status& s) { return std::string(s.message()); }

TEST(JsonFrameTest, RoundTripsAndRefusesWhatIsTooLongOrNotAnObject) {
  const json m = {{"type", "ping"}, {"n", 3}};
  const std::string frame = EncodeJsonFrame(m);
  ASSERT_EQ(frame.size(), 4 + m.dump().size());
  EXPECT_EQ(frame[0], static_cast<char>(m.dump().size()));  // little-endian length
  auto back = ReadJsonFrame(From(frame), 1024, "a test message");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, m);

  auto big = ReadJsonFrame(From(frame), 4, "a test message");
  EXPECT_THAT(Error(big.status()),
              HasSubstr(absl::StrCat("a test message of ", m.dump().size(), " bytes (at most 4)")));
  auto array = ReadJsonFrame(From(EncodeJsonFrame(json::array({1}))), 1024, "a test message");
  EXPECT_THAT(Error(array.status()), HasSubstr("a test message is not a JSON object"));
  auto garbage = ReadJsonFrame(From(std::string("\x03\0\0\0{x:", 7)), 1024, "a test message");
  EXPECT_THAT(Error(garbage.status()), HasSubstr("is not a JSON object"));
  auto cut = ReadJsonFrame(From(frame.substr(0, 10)), 1024, "a test message");
  EXPECT_THAT(Error(cut.status()), HasSubstr("the peer closed"));
}

TEST(JsonFrameTest, TypedFieldsNameTheField) {
  const json m = {{"i", 5}, {"s", "abc"}, {"b", true}, {"a", {1}}, {"big", UINT64_MAX}};
  EXPECT_EQ(*JsonInt(m, "i", 0, 10), 5);
  EXPECT_THAT(Error(JsonInt(m, "i", 6, 10).status()), HasSubstr("'i' is 5, outside [6, 10]"));
  EXPECT_THAT(Error(JsonInt(m, "s", 0, 10).status()),
              HasSubstr("'s' is missing or not an integer"));
  EXPECT_THAT(Error(JsonInt(m, "big", 0, INT64_MAX).status()), HasSubstr("'big' is"));
  EXPECT_THAT(Error(JsonString(m, "s", 2).status()), HasSubstr("'s' is longer than 2 bytes"));
  EXPECT_THAT(Error(JsonString(m, "x", 2).status()), HasSubstr("'x' is missing or not a string"));
  EXPECT_THAT(Error(JsonBool(m, "i").status()), HasSubstr("'i' is missing or not a boolean"));
  EXPECT_THAT(Error(JsonArray(m, "b").status()), HasSubstr("'b' is missing or not an array"));
  EXPECT_TRUE(JsonArray(m, "a").ok());
}

StepDesc SomeStep() {
  StepDesc d;
  d.microbatch = 1;
  d.release = {7, 9};
  StepChunk prompt;
  prompt.seq = 3;
  prompt.tokens = {1, 2, 3};
  prompt.sample = true;
  SamplingParams p;
  p.temperature = 0.5f;
  p.top_p = 0.9f;
  p.top_k = 40;
  p.seed = UINT64_MAX;  // any 64-bit seed survives the trip
  p.top_logprobs = 2;
  p.logit_bias = {{5, -100.0f}, {6, 2.5f}};
  p.min_tokens = 3;
  p.end_ids = {2, 9};
  p.repetition_penalty = 1.2f;
  p.frequency_penalty = -0.5f;
  p.presence_penalty = 0.25f;
  prompt.params = p;
  prompt.draws = 5;
  prompt.prompt_tokens = 3;
  prompt.start = 2;  // a cached start, and the tokens the sampler reads first
  prompt.history = {11, 12};
  prompt.offer = KvTicket{};
  (*prompt.offer)[31] = 0xAB;                      // disaggregated prefill: offered once computed
  prompt.allowed = {0x80000001u, 0, 0xDEADBEEFu};  // structured output's mask
  prompt.score_from = 1;                           // echo with logprobs: rows 1 and 2 scored
  prompt.score = {8, 9};
  prompt.score_top = 4;
  StepChunk decode;
  decode.seq = 4;
  decode.tokens = {42};
  decode.sample = false;
  decode.lora_slot = 3;  // a LoRA adapter's sequence
  decode.next = 21;      // a prompt chunk before the last: the token after it (MTP)
  StepChunk drafted;     // speculative decoding: two drafts after its token, two rewound
  drafted.seq = 5;
  drafted.tokens = {7, 8, 9};
  drafted.drafts = 2;
  drafted.rewind = 2;
  drafted.allowed = {1, 2, 3, 4, 5, 6};  // under a grammar: a mask of 2 words for each of 3 rows
  d.chunks = {prompt, decode, drafted};
  return d;
}

TEST(StepWireTest, StepsAndResultsRoundTrip) {
  const StepDesc d = SomeStep();
  const json wire = json::parse(EncodeJsonFrame(EncodeStep(d)).substr(4));
  ASSERT_EQ(*DecodeStepMessageType(wire), StepMessageType::kStep);
  auto back = DecodeStep(wire);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->microbatch, 1);
  EXPECT_EQ(back->release, d.release);
  ASSERT_EQ(back->chunks.size(), 3u);
  EXPECT_EQ(back->chunks[0].tokens, d.chunks[0].tokens);
  EXPECT_EQ(std::tuple(back->chunks[2].drafts, back->chunks[2].rewind), std::tuple(2, 2));
  EXPECT_EQ(RowMasks(back->chunks[2]),
            (std::vector<std::vector<uint32_t>>{{1, 2}, {3, 4}, {5, 6}}));
  EXPECT_EQ(std::tuple(back->chunks[0].drafts, back->chunks[0].rewind), std::tuple(0, 0));
  ASSERT_TRUE(back->chunks[0].params.has_value());
  EXPECT_EQ(back->chunks[0].params->seed, UINT64_MAX);
  EXPECT_EQ(back->chunks[0].params->top_k, 40);
  EXPECT_FLOAT_EQ(back->chunks[0].params->top_p, 0.9f);
  EXPECT_EQ(back->chunks[0].draws, 5);
  EXPECT_EQ(back->chunks[0].prompt_tokens, 3);
  EXPECT_EQ(std::tuple(back->chunks[0].start, back->chunks[0].history),
            std::tuple(2, std::vector<int32_t>{11, 12}));
  EXPECT_EQ(back->chunks[0].offer, d.chunks[0].offer);
  EXPECT_FALSE(back->chunks[1].offer.has_value());
  const SamplingParams& p = *back->chunks[0].params;
  EXPECT_EQ(p.logit_bias, d.chunks[0].params->logit_bias);
  EXPECT_EQ(std::tuple(p.min_tokens, p.end_ids, p.repetition_penalty, p.frequency_penalty,
                       p.presence_penalty),
            std::tuple(3, std::vector<int64_t>{2, 9}, 1.2f, -0.5f, 0.25f));
  EXPECT_EQ(back->chunks[0].allowed, d.chunks[0].allowed);
  EXPECT_EQ(
      std::tuple(back->chunks[0].score_from, back->chunks[0].score, back->chunks[0].score_top),
      std::tuple(1, std::vector<int32_t>{8, 9}, 4));
  EXPECT_TRUE(back->chunks[1].score.empty());
  EXPECT_EQ(std::tuple(back->chunks[0].lora_slot, back->chunks[1].lora_slot), std::tuple(-1, 3));
  EXPECT_FALSE(back->chunks[1].params.has_value());
  EXPECT_FALSE(back->chunks[1].sample);
  EXPECT_TRUE(back->chunks[1].allowed.empty());
  EXPECT_EQ(std::tuple(back->chunks[0].next, back->chunks[1].next), std::tuple(-1, 21));
  EXPECT_EQ(*DecodeStepMessageType(EncodePing()), StepMessageType::kPing);
  EXPECT_EQ(*DecodeStepMessageType(EncodeStop()), StepMessageType::kStop);

  StepResult r;
  r.microbatch = 1;
  r.tokens.push_back({3, 17, -0.25f, {{17, -0.25f}, {5, -2.0f}}});
  r.prompt.push_back({3, 8, -1.5f, {{2, -0.5f}}});
  r.drafts.push_back({3, 44, 0, {}});
  auto rback = DecodeStepResult(json::parse(EncodeStepResult(r).dump()));
  ASSERT_TRUE(rback.ok()) << rback.status();
  ASSERT_EQ(rback->drafts.size(), 1u);
  EXPECT_EQ(std::tuple(rback->drafts[0].seq, rback->drafts[0].token), std::tuple(3, 44));
  ASSERT_EQ(rback->prompt.size(), 1u);
  EXPECT_EQ(std::tuple(rback->prompt[0].seq, rback->prompt[0].token, rback->prompt[0].logprob,
                       rback->prompt[0].top.size()),
            std::tuple(3, 8, -1.5f, 1u));
  ASSERT_EQ(rback->tokens.size(), 1u);
  EXPECT_EQ(rback->tokens[0].token, 17);
  EXPECT_EQ(rback->tokens[0].top.size(), 2u);
  EXPECT_FLOAT_EQ(rback->tokens[0].top[1].logprob, -2.0f);
}

KvImport SomeImport() {
  KvImport im;
  im.seq = 9;
  for (size_t i = 0; i < im.ticket.size(); ++i) im.ticket[i] = static_cast<uint8_t>(i * 7);
  im.source.tp = 2;
  im.source.stages = {{0, 3}, {3, 5}};
  im.source.kv_heads = 4;
  im.source.block_size = 16;
  im.addresses = {std::string("\0a\xff", 3), "b", "c", "d"};  // binary UCX addresses
  im.positions = 40;
  im.blocks = {7, 3, 5};
  im.skip_blocks = 1;
  return im;
}

TEST(StepWireTest, KvImportsAndTheirAnswersRoundTrip) {
  const KvImport im = SomeImport();
  const json wire = json::parse(EncodeJsonFrame(EncodeKvImport(im)).substr(4));
  ASSERT_EQ(*DecodeStepMessageType(wire), StepMessageType::kKvImport);
  auto back = DecodeKvImport(wire);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(std::tuple(back->seq, back->ticket, back->addresses, back->positions, back->blocks,
                       back->skip_blocks),
            std::tuple(im.seq, im.ticket, im.addresses, im.positions, im.blocks, im.skip_blocks));
  EXPECT_EQ(std::tuple(back->source.tp, back->source.stages, back->source.kv_heads,
                       back->source.latent, back->source.block_size),
            std::tuple(2, im.source.stages, 4, false, 16));

  const json ok = EncodeKvImported(9, absl::OkStatus(), 4096);
  const json refused = EncodeKvImported(9, absl::PermissionDeniedError("no offer"), 0);
  EXPECT_TRUE(IsKvImported(ok));
  EXPECT_FALSE(IsKvImported(EncodeStepResult(StepResult{})));
  absl::Status transfer = absl::UnknownError("unset");
  int64_t bytes = -1;
  ASSERT_TRUE(DecodeKvImported(ok, 9, &transfer, &bytes).ok());
  EXPECT_TRUE(transfer.ok()) << transfer;
  EXPECT_EQ(bytes, 4096);
  ASSERT_TRUE(DecodeKvImported(refused, 9, &transfer, &bytes).ok());
  EXPECT_EQ(transfer, absl::PermissionDeniedError("no offer"));
  EXPECT_THAT(Error(DecodeKvImported(ok, 8, &transfer, &bytes)),
              HasSubstr("a KV import answer for sequence 9, expected 8"));
  EXPECT_THAT(Error(DecodeKvImported({{"type", "kv_imported"}}, 9, &transfer, &bytes)),
              HasSubstr("a malformed KV import answer"));

  EXPECT_EQ(*KvTicketFromHex(KvTicketHex(im.ticket)), im.ticket);
  EXPECT_THAT(Error(KvTicketFromHex("abc").status()), HasSubstr("a KV ticket is 64 hex digits"));
  EXPECT_FALSE(KvTicketFromHex(std::string(64, 'g')).ok());
}

TEST(StepWireTest, MalformedKvImportsNameTheField) {
  const json good = EncodeKvImport(SomeImport());
  auto refused = [&](auto mutate) {
    json m = good;
    mutate(m);
    auto d = DecodeKvImport(m);
    EXPECT_FALSE(d.ok());
    return Error(d.status());
  };
  EXPECT_THAT(refused([](json& m) { m["addresses"].erase(0); }),
              HasSubstr("a malformed KV import: 3 exporter addresses for 4 prefill ranks"));
  EXPECT_THAT(refused([](json& m) { m["addresses"][1] = "@@"; }),
              HasSubstr("an exporter address is not base64"));
  EXPECT_THAT(refused([](json& m) { m["skip_blocks"] = 4; }), HasSubstr("'skip_blocks' is 4"));
  EXPECT_THAT(refused([](json& m) { m["ticket"] = "00"; }), HasSubstr("a KV ticket is"));
  EXPECT_THAT(refused([](json& m) {
                m["source"]["stages"] = {{3, 1}};
              }),
              HasSubstr("a KV shape's stage is not [begin, end) of layers"));
  EXPECT_THAT(refused([](json& m) { m["source"]["tp"] = 0; }), HasSubstr("'tp' is 0"));
  EXPECT_THAT(refused([](json& m) { m["blocks"] = {-1}; }), HasSubstr("'blocks'"));
}

TEST(StepWireTest, MalformedStepsNameTheField) {
  const json good = EncodeStep(SomeStep());
  auto refused = [&](auto mutate) {
    json m = good;
    mutate(m);
    auto d = DecodeStep(m);
    EXPECT_FALSE(d.ok());
    return Error(d.status());
  };
  EXPECT_THAT(refused([](json& m) { m.erase("mb"); }),
              HasSubstr("a malformed step: 'mb' is missing or not an integer"));
  EXPECT_THAT(refused([](json& m) { m["release"] = "all"; }),
              HasSubstr("'release' is missing or not an array"));
  EXPECT_THAT(refused([](json& m) {
                m["chunks"][1]["tokens"] = {1, -4};
              }),
              HasSubstr("chunk of sequence 4: token -4 is out of range"));
  EXPECT_THAT(refused([](json& m) { m["chunks"][0]["params"]["top_p"] = 7; }),
              HasSubstr("chunk of sequence 3: top_p must be in (0, 1]"));
  EXPECT_THAT(refused([](json& m) { m["chunks"][0]["params"].erase("seed"); }),
              HasSubstr("'seed' is missing or not an unsigned integer"));
  EXPECT_THAT(refused([](json& m) { m["chunks"][0].erase("draws"); }),
              HasSubstr("'draws' is missing or not an integer"));
  EXPECT_THAT(refused([](json& m) { m["chunks"][0]["history"] = {11}; }),
              HasSubstr("chunk of sequence 3: a history of 1 tokens for a start of 2"));
  EXPECT_THAT(refused([](json& m) { m["chunks"][0]["offer"] = "xyz"; }),
              HasSubstr("chunk of sequence 3: a KV ticket is 64 hex digits"));
  EXPECT_THAT(refused([](json& m) { m["chunks"][0]["sample"] = 1; }),
              HasSubstr("'sample' is missing or not a boolean"));
  EXPECT_THAT(refused([](json& m) { m["chunks"] = {7}; }), HasSubstr("a chunk is not an object"));
  // Drafts need a sampled chunk with a token before them; a rewind is a count.
  EXPECT_THAT(refused([](json& m) { m["chunks"][2]["drafts"] = 3; }),
              HasSubstr("chunk of sequence 5: 3 drafts in a chunk of 3 tokens"));
  EXPECT_THAT(refused([](json& m) { m["chunks"][1]["drafts"] = 1; }),
              HasSubstr("chunk of sequence 4: 1 drafts in a chunk of 1 tokens not sampled"));
  EXPECT_THAT(refused([](json& m) { m["chunks"][2]["rewind"] = -1; }), HasSubstr("'rewind'"));
  // The token after a chunk is the leader's only where the chunk is not sampled.
  EXPECT_THAT(refused([](json& m) { m["chunks"][2]["next"] = 7; }),
              HasSubstr("chunk of sequence 5: a sampled chunk's next token is its sampling's"));
  EXPECT_THAT(refused([](json& m) { m["chunks"][1]["next"] = -2; }), HasSubstr("'next'"));
  for (const json& bad : {json("@@@"), json(7), json("AAA"), json("")}) {
    EXPECT_THAT(
        refused([&](json& m) { m["chunks"][0]["allowed"] = bad; }),
        HasSubstr("chunk of sequence 3: 'allowed' is not the base64 masks of its 1 sampled rows"));
  }
  // Scored rows past the chunk's end (3 tokens): a step is input too.
  EXPECT_THAT(refused([](json& m) { m["chunks"][0]["score_from"] = 2; }),
              HasSubstr("chunk of sequence 3: 2 scored rows from row 2 of a chunk of 3"));
  EXPECT_THAT(refused([](json& m) {
                m["chunks"][0]["score"] = {1, 2, 3, 4};
              }),
              HasSubstr("4 scored rows from row 1"));
  EXPECT_THAT(refused([](json& m) { m["chunks"][0]["score"] = {-1}; }), HasSubstr("'score'"));
  EXPECT_THAT(
      refused([](json& m) { m["chunks"][1]["allowed"] = "AAAAAA=="; }),
      HasSubstr("chunk of sequence 4: 'allowed' is not the base64 masks of its 1 sampled rows"));
  // A chunk with 2 drafts has 3 masks of one size: 2 words do not divide into 3.
  EXPECT_THAT(refused([](json& m) { m["chunks"][2]["allowed"] = "AAAAAAAAAAA="; }),
              HasSubstr("chunk of sequence 5: 'allowed' is not the base64 masks of its 3 sampled"));
  EXPECT_THAT(Error(DecodeStepMessageType({{"type", "dance"}}).status()),
              HasSubstr("a step message of unknown type 'dance'"));
  EXPECT_THAT(Error(DecodeStepMessageType({{"kind", "step"}}).status()),
              HasSubstr("'type' is missing or not a string"));
  EXPECT_THAT(Error(DecodeStepResult({{"mb", 0}, {"results", {{{"seq", 1}}}}}).status()),
              HasSubstr("malformed step results: 'token' is missing or not an integer"));
  EXPECT_THAT(Error(DecodeStepResult(
                        {{"mb", 0},
                         {"results", {{{"seq", 1}, {"token", 2}, {"logprob", 0}, {"top", {{1}}}}}}})
                        .status()),
              HasSubstr("sequence 1: an alternative is not [token, logprob]"));
}

// LoRA orders (runtime adapters) to every rank, and an install's answer: each op round-trips with
// its fields; a bad op, a missing path, a foreign slot's answer are errors naming what is wrong.
TEST(StepWireTest, LoraOrdersAndAnswersRoundTrip) {
  for (const LoraOrder& o :
       {LoraOrder{LoraOrder::Op::kPrepare, 7, "/adapters/dynamic/sql", -1},
        LoraOrder{LoraOrder::Op::kInstall, 7, "", 2}, LoraOrder{LoraOrder::Op::kEvict, 7, "", 2},
        LoraOrder{LoraOrder::Op::kForget, 7, "", -1}}) {
    const json wire = json::parse(EncodeJsonFrame(EncodeLoraOrder(o)).substr(4));
    ASSERT_EQ(*DecodeStepMessageType(wire), StepMessageType::kLora);
    auto back = DecodeLoraOrder(wire);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(std::tuple(back->op, back->id, back->path, back->slot),
              std::tuple(o.op, o.id, o.path, o.slot));
  }
  EXPECT_THAT(
      std::string(
          DecodeLoraOrder(json{{"type", "lora"}, {"op", "zap"}, {"id", 1}}).status().message()),
      HasSubstr("unknown op 'zap'"));
  EXPECT_THAT(
      std::string(
          DecodeLoraOrder(json{{"type", "lora"}, {"op", "prepare"}, {"id", 1}}).status().message()),
      HasSubstr("path"));
  absl::Status result;
  const json failed = EncodeLoraInstalled(2, absl::InvalidArgumentError("bad adapter"));
  ASSERT_TRUE(IsLoraInstalled(failed));
  ASSERT_TRUE(DecodeLoraInstalled(failed, 2, &result).ok());
  EXPECT_EQ(result, absl::InvalidArgumentError("bad adapter"));
  ASSERT_TRUE(DecodeLoraInstalled(EncodeLoraInstalled(2, absl::OkStatus()), 2, &result).ok());
  EXPECT_TRUE(result.ok());
  EXPECT_FALSE(DecodeLoraInstalled(failed, 3, &result).ok()) << "another slot's answer";
}

}  // namespace
}  // namespace shardserve
