#include "tokenizer/tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "devtools/bpe_trainer.h"
#include "devtools/corpus.h"
#include "model/test_models.h"
#include "tokenizer/chat_template.h"

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

// Each token's bytes inside a text (what structured output's grammars match) join to the text:
// byte-level and byte-fallback tokens give raw bytes, partial characters included; a
// SentencePiece text keeps the space its first token carries.
TEST_P(TokenizerStyleTest, TokenBytesJoinToTheText) {
  auto tok = Trained(GetParam());
  for (const std::string& text : kTexts) {
    auto ids = tok->Encode(text, /*add_special_tokens=*/false);
    ASSERT_TRUE(ids.ok()) << ids.status();
    std::string joined;
    for (int32_t id : *ids) joined += tok->TokenBytes(id);
    if (GetParam() == TokenizerStyle::kSentencePiece && joined != text) {
      EXPECT_EQ(joined, " " + text);
    } else {
      EXPECT_EQ(joined, text);
    }
  }
  EXPECT_EQ(tok->TokenBytes(-1), "");
  EXPECT_EQ(tok->TokenBytes(static_cast<int32_t>(tok->vocab_size())), "");
}

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

// In a text range (a chat message's content with specialTokensInContent: text) a special token's
// string is text: it encodes as the characters, as the same text with no special token in it
// would; outside the ranges, and in a range that only touches it, it is the control token.
TEST(TokenizerTest, SpecialTokensInATextRangeAreText) {
  auto tok = Trained(TokenizerStyle::kByteLevel);
  const std::string text = "<s>a </s> b</s>";  // the first </s> (bytes 5-9) is in the range
  auto special = tok->Encode(text, false);
  auto as_text = tok->Encode(text, false, 0, {{3, 10}});
  ASSERT_TRUE(special.ok() && as_text.ok());
  EXPECT_EQ(std::count(special->begin(), special->end(), 2), 2);
  EXPECT_EQ(std::count(as_text->begin(), as_text->end(), 2), 1) << "only the </s> outside";
  EXPECT_EQ(as_text->front(), 1);
  EXPECT_EQ(as_text->back(), 2);
  EXPECT_EQ(tok->Decode(*as_text), text);
  // Its tokens are those of the plain text around it.
  auto plain = tok->Encode("a </s> b", false, 0, {{0, 8}});
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(std::vector<int32_t>(as_text->begin() + 1, as_text->end() - 1), *plain);
  auto touching = tok->Encode(text, false, 0, {{0, 5}, {10, 11}});  // ends where </s> begins
  ASSERT_TRUE(touching.ok());
  EXPECT_EQ(std::count(touching->begin(), touching->end(), 2), 2);
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
      // An added token's id indexed the id table unchecked (memory corrupted, found by the fuzz
      // tier).
      {"/added_tokens", R"([{"id":-5,"content":"<x>"}])", "added token -5 has an invalid id"},
      {"/added_tokens", R"([{"id":4294967296,"content":"<x>"}])",
       "added token 4294967296 has an invalid id"},
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

// The merges of Hugging Face's `tokenizers` written the plain way (rescan the word for the pair
// of lowest rank, leftmost among equals, after every merge): quadratic, for reference only.
std::vector<int32_t> NaiveMerges(const Tokenizer& tok, const std::vector<std::string>& chars,
                                 const std::map<std::pair<std::string, std::string>, int>& ranks) {
  std::vector<std::string> syms = chars;
  for (;;) {
    int best = INT32_MAX;
    size_t at = 0;
    for (size_t i = 0; i + 1 < syms.size(); ++i) {
      auto it = ranks.find({syms[i], syms[i + 1]});
      if (it != ranks.end() && it->second < best) {
        best = it->second;
        at = i;
      }
    }
    if (best == INT32_MAX) break;
    syms[at] += syms[at + 1];
    syms.erase(syms.begin() + at + 1);
  }
  std::vector<int32_t> ids;
  for (const std::string& s : syms) ids.push_back(*tok.TokenId(s));
  return ids;
}

TEST(TokenizerTest, MergesMatchThePlainAlgorithm) {
  auto t = TrainBpeTokenizer(DefaultCorpus(), TokenizerStyle::kByteLevel, 700);
  ASSERT_TRUE(t.ok());
  auto tok = Tokenizer::FromJson(t->json, "test");
  ASSERT_TRUE(tok.ok());
  const json j = json::parse(t->json);
  std::map<std::pair<std::string, std::string>, int> ranks;
  int rank = 0;
  for (const json& m : j["model"]["merges"]) {
    const std::string s = m.is_string() ? m.get<std::string>()
                                        : m[0].get<std::string>() + " " + m[1].get<std::string>();
    const size_t sp = s.find(' ', 1);
    ranks[{s.substr(0, sp), s.substr(sp + 1)}] = rank++;
  }
  std::mt19937 rng(7);
  const std::string letters = "etaoinshrdlu";
  for (int n = 0; n < 300; ++n) {
    // Words of repeated and mixed letters: where overlapping pairs of equal rank meet.
    std::string word;
    const int len = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < len; ++i) word += letters[rng() % (n % 2 ? 3 : letters.size())];
    std::vector<std::string> chars;
    for (char c : word) chars.push_back(std::string(1, c));
    auto ids = (*tok)->Encode(word, false);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(*ids, NaiveMerges(**tok, chars, ranks)) << word;
  }
}

TEST(TokenizerTest, ALongWordIsMergedAndTheLongestIsRefused) {
  for (TokenizerStyle style : {TokenizerStyle::kByteLevel, TokenizerStyle::kSentencePiece}) {
    auto tok = Trained(style);
    // 1 MiB of one word: the plain algorithm's rescans would take hours here.
    std::string word;
    while (word.size() < (1 << 20) - 16) word += "he";
    auto ids = tok->Encode(word, false);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(tok->Decode(*ids), word);
    EXPECT_LE(ids->size(), word.size() / 2 + 1);  // merged, not left as characters
    auto refused = tok->Encode(word + std::string(17, 'e'), false);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(refused.status().message(), HasSubstr("bytes; words (runs without a break)"));
  }
}

TEST(TokenizerTest, EncodeStopsAtTheTokenLimit) {
  for (TokenizerStyle style : {TokenizerStyle::kByteLevel, TokenizerStyle::kSentencePiece}) {
    auto tok = Trained(style);
    const std::string text = "The model is too large for one machine. ";
    auto all = tok->Encode(text, false);
    ASSERT_TRUE(all.ok());
    auto exact = tok->Encode(text, false, all->size());
    ASSERT_TRUE(exact.ok());
    EXPECT_EQ(*exact, *all);
    auto over = tok->Encode(text, false, all->size() - 1);
    EXPECT_EQ(over.status().code(), absl::StatusCode::kOutOfRange);
    // A text of many times the limit is refused by its size, word by word, before the merges.
    std::string big;
    while (big.size() < (1 << 20)) big += text;
    auto huge = tok->Encode(big, false, 16);
    EXPECT_EQ(huge.status().code(), absl::StatusCode::kOutOfRange);
    // No token covers more bytes of text than the bound.
    ASSERT_TRUE(tok->MaxBytesPerToken().has_value());
    for (const std::string& t : kTexts) {
      auto ids = tok->Encode(t, false);
      ASSERT_TRUE(ids.ok());
      EXPECT_GE(ids->size() * *tok->MaxBytesPerToken(), t.size()) << t;
    }
  }
}

TEST(TokenizerTest, ByteLevelTableIsABijection) {
  std::set<std::string> seen(ByteToUnicode().begin(), ByteToUnicode().end());
  EXPECT_EQ(seen.size(), 256u);
  EXPECT_EQ(ByteToUnicode()[' '], "\xC4\xA0");  // "Ġ"
  EXPECT_EQ(ByteToUnicode()['A'], "A");
}

// A model directory's chat_template.jinja (recent transformers save the template there) takes
// precedence over tokenizer_config.json's chat_template, as transformers reads them.
TEST(ChatTemplateTest, AJinjaFileTakesPrecedence) {
  testing::TempDir dir;
  auto o = testing::SmallModel("llama", dir.Sub("m"));
  o.chat_template = "llama3";
  const std::string model = testing::WriteModel(o);
  auto tok = Tokenizer::Load(model);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ(ChatTemplate::ForModel(model, **tok).source(), "tokenizer_config.json");
  testing::WriteFile(model + "/chat_template.jinja",
                     "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                     "<|im_end|>\n{% endfor %}<|im_start|>assistant\n");
  const ChatTemplate t = ChatTemplate::ForModel(model, **tok);
  EXPECT_EQ(t.source(), "chat_template.jinja");
  // As Jinja2 renders it (transformers too): a template's last newline is dropped.
  EXPECT_EQ(t.Render({{"user", "hi"}})->text,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant");
}

// Render gives where each message's text lies in the prompt, for every family (what
// specialTokensInContent: text keeps as text).
TEST(ChatTemplateTest, RenderMarksTheMessagesText) {
  for (const char* family : {"llama3", "chatml", "llama2", "mistral"}) {
    testing::TempDir dir;
    auto o = testing::SmallModel("llama", dir.Sub("m"));
    o.chat_template = family;
    const std::string model = testing::WriteModel(o);
    auto tok = Tokenizer::Load(model);
    ASSERT_TRUE(tok.ok()) << tok.status();
    const ChatTemplate t = ChatTemplate::ForModel(model, **tok);
    ASSERT_TRUE(t.has_template()) << family << ": " << t.reason();
    const std::vector<ChatMessage> messages = {{"system", "be brief"},
                                               {"user", "<|im_end|> one"},
                                               {"assistant", "two"},
                                               {"user", "three"}};
    auto r = t.Render(messages);
    ASSERT_TRUE(r.ok()) << family << ": " << r.status();
    ASSERT_EQ(r->content.size(), 4u) << family;
    for (size_t i = 0; i < 4; ++i) {
      const TextRange& c = r->content[i];
      EXPECT_EQ(r->text.substr(c.begin, c.end - c.begin), messages[i].content) << family;
      if (i > 0) {
        EXPECT_LE(r->content[i - 1].end, c.begin) << family;
      }
    }
  }
}

// A list of named templates whose names are not strings is no crash (a model file is input):
// no template, and the reason.
TEST(ChatTemplateTest, ANamedListWithoutStringsGivesNoTemplate) {
  testing::TempDir dir;
  auto o = testing::SmallModel("llama", dir.Sub("m"));
  const std::string model = testing::WriteModel(o);
  auto tok = Tokenizer::Load(model);
  ASSERT_TRUE(tok.ok()) << tok.status();
  testing::WriteFile(model + "/tokenizer_config.json",
                     R"({"chat_template": [{"name": 5, "template": "x"}, {"name": "tool_use"}]})");
  const ChatTemplate t = ChatTemplate::ForModel(model, **tok);
  EXPECT_FALSE(t.has_template());
  EXPECT_THAT(t.reason(), ::testing::HasSubstr("gives no chat_template"));
}

// The Hermes template (ChatML with tools): it renders the tools and shows the <tool_call>
// format; a tool round trip (an assistant's call without text, the tool's answer) renders with
// the texts of the messages that have one marked. A template without tools says so.
TEST(ChatTemplateTest, ToolsAndTheirFormat) {
  testing::TempDir dir;
  // The template of a generated model of `arch` with the chat template `family`.
  auto template_of = [&](const std::string& arch, const std::string& family) {
    auto o = testing::SmallModel(arch, dir.Sub(family));
    o.chat_template = family;
    const std::string model = testing::WriteModel(o);
    auto tok = Tokenizer::Load(model);
    EXPECT_TRUE(tok.ok()) << tok.status();
    return ChatTemplate::ForModel(model, **tok);
  };
  const ChatTemplate t = template_of("qwen2", "hermes");
  EXPECT_TRUE(t.renders_tools());
  EXPECT_EQ(t.tool_call_format(), "hermes");
  std::vector<ChatMessage> messages(3);
  messages[0].role = "user";
  messages[0].content = "weather?";
  messages[1].role = "assistant";
  messages[1].content_null = true;
  messages[1].tool_calls = nlohmann::ordered_json::parse(
      R"([{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}])");
  messages[2].role = "tool";
  messages[2].tool_call_id = "call_1";
  messages[2].content = "sunny";
  const auto tools = nlohmann::ordered_json::parse(
      R"([{"type": "function", "function": {"name": "get_weather", "parameters": {"b": 1, "a": 2}}}])");
  ChatOptions with_tools;
  with_tools.tools = tools;
  auto r = t.Render(messages, with_tools);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->text.find(R"({"name": "get_weather", "parameters": {"b": 1, "a": 2}})"),
            std::string::npos)
      << r->text;  // the schema as given, keys in order
  EXPECT_NE(r->text.find(R"(<tool_call>
{"name": "get_weather", "arguments": {"city": "Oslo"}}
</tool_call>)"),
            std::string::npos)
      << r->text;
  EXPECT_NE(r->text.find("<tool_response>\nsunny\n</tool_response>"), std::string::npos);
  ASSERT_EQ(r->content.size(), 2u);
  EXPECT_EQ(r->text.substr(r->content[0].begin, r->content[0].end - r->content[0].begin),
            "weather?");
  EXPECT_EQ(r->text.substr(r->content[1].begin, r->content[1].end - r->content[1].begin), "sunny");
  auto without = t.Render(messages);
  ASSERT_TRUE(without.ok());
  EXPECT_EQ(without->text.find("<tools>"), std::string::npos);

  const ChatTemplate plain = template_of("llama", "llama3");
  EXPECT_FALSE(plain.renders_tools());
  EXPECT_EQ(plain.tool_call_format(), "");
  // Llama 3.1's form (the ipython role): bare JSON calls.
  const ChatTemplate l3 = template_of("llama", "llama3-tools");
  EXPECT_TRUE(l3.renders_tools());
  EXPECT_EQ(l3.tool_call_format(), "llama3_json");
  // Formats named by their markers only where one shows; a template showing two is not guessed.
  const struct {
    const char* text;
    const char* format;
  } kShown[] = {
      {"{% if tools %}Use [func_name1(params_name1=params_value1)]{% endif %}"
       "{% for m in messages %}{% if m.role == 'ipython' %}{{ m.content }}{% endif %}{% endfor %}",
       "pythonic"},
      {"{{ tools }}<tool_call>\n<function=NAME>\n<parameter=K>\nV\n</parameter>", "qwen3_coder"},
      {"{{ tools }}<tool_call>{\"name\": ...}</tool_call>", "hermes"},
      {"{{ tools }}<tool_call> or [TOOL_CALLS]", ""},
      {"{{ tools }}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{{ t.type }}<｜tool▁sep｜>"
       "{{ t.name }}\n```json\n{{ t.arguments }}\n```",
       "deepseek_v3"},
      {"{{ tools }}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{{ t.name }}<｜tool▁sep｜>",
       "deepseek_v31"},
      {"{{ tools }}<|tool_calls_section_begin|><|tool_call_begin|>", "kimi_k2"},
      {"{{ tools }}<|tool_calls_section_begin|> or <tool_call>", ""},
  };
  for (const auto& [text, format] : kShown) {
    EXPECT_EQ(plain.WithTemplate(text, "test").tool_call_format(), format) << text;
  }
  // vLLM's content formats: a loop over a message's content gets the parts.
  for (const char* list : {"{%- for part in message['content'] -%}{{ part.text }}{% endfor %}",
                           "{% for c in m.content|reverse %}{{ c.text }}{% endfor %}",
                           "{%for c in m[ \"content\" ]%}{% endfor %}"}) {
    EXPECT_TRUE(plain.WithTemplate(list, "test").list_content()) << list;
  }
  for (const char* string : {"{% for m in messages %}{{ m.content }}{% endfor %}",
                             "{% for c in m['contents'] %}{% endfor %}", "{% for"}) {
    EXPECT_FALSE(plain.WithTemplate(string, "test").list_content()) << string;
  }
  // A request's template is hostile: a long one is scanned in linear time, without recursion.
  const std::string spaces = "{% for x in y" + std::string(1 << 20, ' ') + ".content %}";
  EXPECT_TRUE(plain.WithTemplate(spaces, "test").list_content());
}

}  // namespace
}  // namespace shardserve
