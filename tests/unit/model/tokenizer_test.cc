#include "model/tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "model/bpe_trainer.h"
#include "model/corpus.h"

namespace shardserve {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

const std::vector<std::string> kTexts = {
    "The model is too large for one machine.",
    " leading space and trailing space ",
    "tabs\tand\nnew lines\r\n\n  and   runs of spaces",
    "caf\xC3\xA9 na\xC3\xAFve \xE4\xBD\xA0\xE5\xA5\xBD \xF0\x9F\x98\x80 emoji",
    "numbers 1234567 3.14159 and punctuation!?;:",
    "x",
};

std::unique_ptr<Tokenizer> Trained(TokenizerStyle style, int64_t vocab = 700) {
  auto t = TrainBpeTokenizer(DefaultCorpus(), style, vocab);
  EXPECT_TRUE(t.ok()) << t.status();
  auto tok = Tokenizer::FromJson(t->json, "test");
  EXPECT_TRUE(tok.ok()) << tok.status();
  return std::move(*tok);
}

class TokenizerStyleTest : public ::testing::TestWithParam<TokenizerStyle> {};

TEST_P(TokenizerStyleTest, DecodeInvertsEncode) {
  auto tok = Trained(GetParam());
  for (const std::string& text : kTexts) {
    auto ids = tok->Encode(text, /*add_special_tokens=*/false);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(tok->Decode(*ids), text);
  }
}

TEST(TokenizerTest, ByteLevelRoundTripsSpecialTokensInText) {
  auto tok = Trained(TokenizerStyle::kByteLevel);
  // Literal "▁" and added tokens inside text round-trip exactly in byte-level BPE. (In the
  // SentencePiece style "▁" means a space and each section after an added token gets its own
  // "▁" prefix, as in Hugging Face's Llama 2 tokenizers.)
  for (const std::string text : {"<s>specials</s> inside <s>",
                                 "\xE2\x96\x81"
                                 "already"}) {
    auto ids = tok->Encode(text, false);
    ASSERT_TRUE(ids.ok());
    EXPECT_EQ(tok->Decode(*ids), text);
  }
  const std::string text = "<s>specials</s> inside <s>";
  auto ids = tok->Encode(text, false);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(std::count(ids->begin(), ids->end(), 1), 2);
  EXPECT_EQ(tok->Decode(*ids), text);
}

TEST_P(TokenizerStyleTest, MergesCompressAndSpecialsAreAtomic) {
  auto tok = Trained(GetParam());
  const std::string text = "the model and the process";
  auto ids = tok->Encode(text, false);
  ASSERT_TRUE(ids.ok());
  EXPECT_LT(ids->size(), text.size() / 2) << "trained merges should shorten common words";
  auto with_bos = tok->Encode(text, true);
  ASSERT_EQ(with_bos->size(), ids->size() + 1);
  EXPECT_EQ((*with_bos)[0], 1);
  auto specials = tok->Encode("a</s>b", false);
  EXPECT_THAT(*specials, ::testing::Contains(2));
  EXPECT_TRUE(tok->IsSpecial(2));
  EXPECT_EQ(tok->Decode(*specials, /*skip_special_tokens=*/true),
            GetParam() == TokenizerStyle::kByteLevel ? "ab" : "a b");
}

TEST_P(TokenizerStyleTest, UnknownIdsAreSkippedOnDecode) {
  auto tok = Trained(GetParam());
  auto ids = tok->Encode("hello", false);
  std::vector<int32_t> with_unknown = *ids;
  with_unknown.insert(with_unknown.begin() + 1, 999999);
  with_unknown.push_back(-4);
  EXPECT_EQ(tok->Decode(with_unknown), "hello");
}

INSTANTIATE_TEST_SUITE_P(Styles, TokenizerStyleTest,
                         ::testing::Values(TokenizerStyle::kByteLevel,
                                           TokenizerStyle::kSentencePiece));

TEST(TokenizerTest, SentencePieceFallsBackToBytes) {
  auto tok = Trained(TokenizerStyle::kSentencePiece);
  auto ids = tok->Encode("\xE2\x82\xAC", false);  // the euro sign is not in the corpus
  ASSERT_TRUE(ids.ok());
  // "▁" (in the vocab) then three byte tokens <0xE2> <0x82> <0xAC> (ids 3 + byte).
  EXPECT_THAT(*ids, ::testing::ElementsAre(::testing::_, 3 + 0xE2, 3 + 0x82, 3 + 0xAC));
  EXPECT_EQ(tok->Decode(*ids), "\xE2\x82\xAC");
}

TEST(TokenizerTest, TrainerRefusesTooSmallVocab) {
  EXPECT_THAT(
      std::string(TrainBpeTokenizer("abc", TokenizerStyle::kByteLevel, 100).status().message()),
      HasSubstr("too small for the tokenizer's 259 base tokens"));
}

TEST(TokenizerTest, RefusesComponentsItDoesNotImplement) {
  auto base =
      json::parse(TrainBpeTokenizer(DefaultCorpus(), TokenizerStyle::kByteLevel, 300)->json);
  struct Case {
    std::string path, value, message;
  };
  const std::vector<Case> cases = {
      {"/model/type", R"("WordPiece")", "model type 'WordPiece' (only BPE) is not supported"},
      {"/pre_tokenizer", R"({"type":"Whitespace"})", "pre-tokenizer 'Whitespace' is not supported"},
      {"/normalizer", R"({"type":"Lowercase"})", "normalizer 'Lowercase' is not supported"},
      {"/decoder", R"({"type":"WordPiece"})", "decoder 'WordPiece' is not supported"},
      {"/post_processor", R"({"type":"RobertaProcessing"})",
       "post-processor 'RobertaProcessing' is not supported"},
      {"/model/merges", R"([["zz","qq"]])", "merge 'zz qq' uses or makes a token not in the"},
  };
  for (const Case& c : cases) {
    json j = base;
    j[json::json_pointer(c.path)] = json::parse(c.value);
    auto t = Tokenizer::FromJson(j.dump(), "tokenizer.json");
    ASSERT_FALSE(t.ok()) << c.path;
    EXPECT_THAT(std::string(t.status().message()), HasSubstr(c.message));
  }
  EXPECT_THAT(std::string(Tokenizer::FromJson("[1,", "t.json").status().message()),
              HasSubstr("t.json: not valid JSON"));
}

TEST(TokenizerTest, ByteLevelTableIsABijection) {
  std::set<std::string> seen(ByteToUnicode().begin(), ByteToUnicode().end());
  EXPECT_EQ(seen.size(), 256u);
  EXPECT_EQ(ByteToUnicode()[' '], "\xC4\xA0");  // "Ġ"
  EXPECT_EQ(ByteToUnicode()['A'], "A");
}

}  // namespace
}  // namespace shardserve
