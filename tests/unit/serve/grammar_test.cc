// Structured output's matchers (llguidance) over our tokenizers: walks that take random allowed
// tokens end in text that follows the grammar, a token outside the mask is refused, and grammars
// that do not compile are refused with llguidance's message.
#include "serve/grammar.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "devtools/bpe_trainer.h"
#include "devtools/corpus.h"
#include "serve/grammar_workers.h"
#include "serve/reasoning.h"
#include "serve/tool_calls.h"

namespace shardserve {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

constexpr int32_t kEos = 2;  // the trained tokenizers' end of sequence

class GrammarTest : public ::testing::TestWithParam<TokenizerStyle> {
 protected:
  void SetUp() override {
    auto t = TrainBpeTokenizer(DefaultCorpus(), GetParam(), 700);
    ASSERT_TRUE(t.ok()) << t.status();
    auto tok = Tokenizer::FromJson(t->json, "test");
    ASSERT_TRUE(tok.ok()) << tok.status();
    tok_ = std::move(*tok);
    // A model vocabulary larger than the tokenizer's: the ids past it are never allowed.
    auto v = GrammarVocabulary::Create(*tok_, tok_->vocab_size() + 20, {kEos});
    ASSERT_TRUE(v.ok()) << v.status();
    vocab_ = *v;
  }

  // Takes random allowed tokens (the end id, once allowed, half the time) until the grammar
  // finishes; the text of the tokens before the end.
  std::string Walk(TokenConstraint& c, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<int32_t> ids;
    for (int step = 0; step < 2000 && !c.Finished(); ++step) {
      std::vector<uint32_t> mask;
      EXPECT_TRUE(c.Allowed(&mask).ok());
      std::vector<int32_t> allowed;
      for (size_t i = 0; i < mask.size() * 32; ++i) {
        if (mask[i / 32] >> (i % 32) & 1u) allowed.push_back(static_cast<int32_t>(i));
      }
      EXPECT_FALSE(allowed.empty());
      if (allowed.empty()) break;
      for (int32_t id : allowed) EXPECT_LT(id, tok_->vocab_size()) << "an id the tokenizer lacks";
      const bool end = std::count(allowed.begin(), allowed.end(), kEos) && rng() % 2 == 0;
      const int32_t id = end ? kEos : allowed[rng() % allowed.size()];
      const absl::Status accepted = c.Accept(id);
      EXPECT_TRUE(accepted.ok()) << accepted << " token " << id << " \"" << tok_->TokenBytes(id)
                                 << "\"";
      if (id == kEos) break;
      ids.push_back(id);
    }
    EXPECT_TRUE(c.Finished()) << "the walk did not finish: " << tok_->Decode(ids);
    return tok_->Decode(ids);
  }

  std::unique_ptr<Tokenizer> tok_;
  std::shared_ptr<const GrammarVocabulary> vocab_;
};

TEST_P(GrammarTest, JsonSchemaWalksGiveValidObjects) {
  const json schema = json::parse(R"({
    "type": "object",
    "properties": {
      "name": {"type": "string", "maxLength": 8},
      "age": {"type": "integer", "minimum": 0, "maximum": 120},
      "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
      "ok": {"type": "boolean"},
      "note": {"type": "string", "maxLength": 4}
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": false})");
  for (uint32_t seed = 0; seed < 20; ++seed) {
    auto c = vocab_->Compile({"json_schema", schema.dump()});
    ASSERT_TRUE(c.ok()) << c.status();
    const std::string text = Walk(**c, seed);
    const json v = json::parse(text, nullptr, false);
    ASSERT_TRUE(v.is_object()) << text;
    EXPECT_TRUE(v.contains("name") && v.contains("age") && v.contains("tags") && v.contains("ok"))
        << text;
    for (const auto& [k, x] : v.items()) {
      if (k == "name" || k == "note") {
        ASSERT_TRUE(x.is_string()) << text;
      } else if (k == "age") {
        ASSERT_TRUE(x.is_number_integer()) << text;
        EXPECT_GE(x.get<int64_t>(), 0);
        EXPECT_LE(x.get<int64_t>(), 120);
      } else if (k == "tags") {
        ASSERT_TRUE(x.is_array() && x.size() <= 3) << text;
        for (const json& t : x) EXPECT_TRUE(t == "red" || t == "green" || t == "blue") << text;
      } else if (k == "ok") {
        EXPECT_TRUE(x.is_boolean()) << text;
      } else {
        ADD_FAILURE() << "a property the schema does not allow: " << text;
      }
    }
    EXPECT_EQ(text.find(": "), std::string::npos) << "no whitespace by default: " << text;
  }
}

TEST_P(GrammarTest, RegexLarkAndJsonObjectWalks) {
  for (uint32_t seed = 0; seed < 10; ++seed) {
    auto re = vocab_->Compile({"regex", "[a-c]{3}-[0-9]{2,4}"});
    ASSERT_TRUE(re.ok()) << re.status();
    const std::string a = Walk(**re, seed);
    EXPECT_TRUE(std::regex_match(a, std::regex("[a-c]{3}-[0-9]{2,4}"))) << a;

    auto lark = vocab_->Compile({"lark", "start: \"yes\" | \"no\" | \"maybe so\""});
    ASSERT_TRUE(lark.ok()) << lark.status();
    const std::string b = Walk(**lark, seed);
    EXPECT_TRUE(b == "yes" || b == "no" || b == "maybe so") << b;
  }
  auto obj = vocab_->Compile({"json_object", ""});
  ASSERT_TRUE(obj.ok()) << obj.status();
  std::vector<uint32_t> mask;
  ASSERT_TRUE((*obj)->Allowed(&mask).ok());
  // Only tokens that start an object: every allowed token's text begins with '{'.
  for (size_t i = 0; i < mask.size() * 32; ++i) {
    if (mask[i / 32] >> (i % 32) & 1u) {
      EXPECT_EQ(tok_->TokenBytes(static_cast<int32_t>(i)).substr(0, 1), "{") << i;
    }
  }
}

// tool_choice required / a named function: walks of the call grammar parse, in each format, into
// calls of the functions allowed whose arguments follow their schemas.
TEST_P(GrammarTest, ToolCallGrammarsGiveCallsThatParse) {
  const auto tools = nlohmann::ordered_json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
      "properties": {"city": {"type": "string", "maxLength": 6},
                     "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
      "additionalProperties": false}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object",
      "properties": {}, "additionalProperties": false}}}])");
  for (const char* format : {"hermes", "llama3_json", "deepseek_v3", "deepseek_v31", "kimi_k2",
                             "pythonic", "qwen3_coder"}) {
    for (const auto& [choice, name] : {std::pair{"required", ""}, std::pair{"function", "now"},
                                       std::pair{"function", "get_weather"}}) {
      for (uint32_t seed = 0; seed < 6; ++seed) {
        auto c = vocab_->Compile(ToolCallGrammar(format, tools, choice, name, true));
        ASSERT_TRUE(c.ok()) << c.status();
        const std::string text = Walk(**c, seed);
        ToolCallParser parser(format, tools, true);
        ToolCallParser::Out out = parser.Add(text);
        ToolCallParser::Out rest = parser.Finish();
        out.calls.insert(out.calls.end(), rest.calls.begin(), rest.calls.end());
        ASSERT_GE(parser.calls(), 1) << format << " " << choice << ": " << text;
        std::map<int, std::pair<std::string, std::string>> calls;  // index: name, arguments
        for (const ToolCall& call : out.calls) {
          if (!call.name.empty()) calls[call.index].first = call.name;
          calls[call.index].second += call.arguments;
        }
        for (const auto& [index, call] : calls) {
          if (std::string(choice) == "function") EXPECT_EQ(call.first, name) << text;
          const json args = json::parse(call.second, nullptr, false);
          ASSERT_TRUE(args.is_object()) << text;
          if (call.first == "get_weather") {
            EXPECT_TRUE(args["unit"] == "c" || args["unit"] == "f") << text;
            EXPECT_TRUE(args["city"].is_string()) << text;
          } else {
            EXPECT_EQ(call.first, "now") << text;
          }
        }
      }
    }
  }
}

// Mistral's constrained calls: the [TOOL_CALLS] token (a special token, named by id in the
// grammar), then a JSON list that parses into calls.
// A tool whose parameters refer to their own $defs (pydantic's nested models, as LangChain sends
// them), constrained under tool_choice required and named, in every format: the references
// resolve where the parameters land in the call's schema.
TEST_P(GrammarTest, ToolParametersWithDefsAndRefsCompileAndFollowThem) {
  const auto tools = nlohmann::ordered_json::parse(R"([
    {"type": "function", "function": {"name": "plan_trip", "parameters": {
      "$defs": {"City": {"type": "object", "properties": {"name": {"enum": ["Oslo", "Rome"]}},
                         "required": ["name"], "additionalProperties": false}},
      "type": "object", "properties": {"to": {"$ref": "#/$defs/City"}},
      "required": ["to"], "additionalProperties": false}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object",
      "properties": {}, "additionalProperties": false}}}])");
  for (const char* format : {"hermes", "llama3_json", "pythonic", "qwen3_coder"}) {
    for (const auto& [choice, name] :
         {std::pair{"required", ""}, std::pair{"function", "plan_trip"}}) {
      auto c = vocab_->Compile(ToolCallGrammar(format, tools, choice, name, false));
      ASSERT_TRUE(c.ok()) << format << " " << choice << ": " << c.status();
      for (uint32_t seed = 0; seed < 4; ++seed) {
        auto walk = vocab_->Compile(ToolCallGrammar(format, tools, choice, name, false));
        const std::string text = Walk(**walk, seed);
        if (text.find("plan_trip") == std::string::npos) continue;
        EXPECT_TRUE(text.find("\"Oslo\"") != std::string::npos ||
                    text.find("\"Rome\"") != std::string::npos)
            << text;
      }
    }
  }
}

TEST(GrammarVocabularyTest, MistralCallsStartWithTheirToken) {
  auto t =
      TrainBpeTokenizer(DefaultCorpus(), TokenizerStyle::kSentencePiece, 700, {"[TOOL_CALLS]"});
  ASSERT_TRUE(t.ok()) << t.status();
  auto tok = Tokenizer::FromJson(t->json, "test");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::optional<int32_t> marker = (*tok)->TokenId("[TOOL_CALLS]");
  ASSERT_TRUE(marker && (*tok)->IsSpecial(*marker));
  auto vocab = GrammarVocabulary::Create(**tok, (*tok)->vocab_size(), {kEos});
  ASSERT_TRUE(vocab.ok()) << vocab.status();
  const auto tools = nlohmann::ordered_json::parse(R"([{"type": "function", "function": {
      "name": "pick", "parameters": {"type": "object", "properties": {"n": {"type": "integer",
      "minimum": 1, "maximum": 9}}, "required": ["n"], "additionalProperties": false}}}])");
  auto c = vocab.value()->Compile(
      ToolCallGrammar("mistral", tools, "required", "", true, {{"[TOOL_CALLS]", *marker}}));
  ASSERT_TRUE(c.ok()) << c.status();
  std::vector<uint32_t> mask;
  ASSERT_TRUE((*c)->Allowed(&mask).ok());
  for (size_t i = 0; i < mask.size() * 32; ++i) {  // the marker first, nothing else
    EXPECT_EQ(mask[i / 32] >> (i % 32) & 1u, i == static_cast<size_t>(*marker) ? 1u : 0u) << i;
  }
  std::mt19937 rng(3);
  std::vector<int32_t> ids;
  while (!(*c)->Finished() && ids.size() < 200) {
    ASSERT_TRUE((*c)->Allowed(&mask).ok());
    std::vector<int32_t> allowed;
    for (size_t i = 0; i < mask.size() * 32; ++i) {
      if (mask[i / 32] >> (i % 32) & 1u) allowed.push_back(static_cast<int32_t>(i));
    }
    const int32_t id =
        std::count(allowed.begin(), allowed.end(), kEos) ? kEos : allowed[rng() % allowed.size()];
    ASSERT_TRUE((*c)->Accept(id).ok());
    if (id != kEos) ids.push_back(id);
  }
  ToolCallParser parser("mistral", tools, true);
  ToolCallParser::Out out = parser.Add((*tok)->Decode(ids, true, {*marker}));
  ToolCallParser::Out rest = parser.Finish();
  out.calls.insert(out.calls.end(), rest.calls.begin(), rest.calls.end());
  ASSERT_GE(out.calls.size(), 1u) << (*tok)->Decode(ids);
  EXPECT_EQ(out.calls[0].name, "pick");
  const json args = json::parse(out.calls[0].arguments);
  EXPECT_TRUE(args["n"].is_number_integer() && args["n"] >= 1 && args["n"] <= 9);
  // tool_choice auto with a strict function: text, then perhaps the marker and calls.
  auto text_or_calls = ToolCallOrTextGrammar("mistral", tools, true, {{"[TOOL_CALLS]", *marker}});
  ASSERT_TRUE(text_or_calls.ok()) << text_or_calls.status();
  auto free = vocab.value()->Compile(*text_or_calls);
  ASSERT_TRUE(free.ok()) << free.status() << "\n" << text_or_calls->data;
  auto words = (*tok)->Encode("Sure.", false);
  ASSERT_TRUE(words.ok());
  for (int32_t id : *words) ASSERT_TRUE((*free)->Accept(id).ok());
  ASSERT_TRUE((*free)->Accept(*marker).ok()) << "the marker after text";
  std::vector<uint32_t> after;
  ASSERT_TRUE((*free)->Allowed(&after).ok());
  for (size_t i = 0; i < after.size() * 32; ++i) {
    if (after[i / 32] >> (i % 32) & 1u) {
      EXPECT_EQ((*tok)->TokenBytes(static_cast<int32_t>(i)).substr(0, 1), "[") << i;
    }
  }
}

TEST_P(GrammarTest, ATokenOutsideTheMaskIsRefused) {
  auto c = vocab_->Compile({"regex", "[0-9]+"});
  ASSERT_TRUE(c.ok()) << c.status();
  const std::optional<int32_t> x = tok_->Encode("x", false)->front();
  const absl::Status s = (*c)->Accept(*x);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("the output's grammar failed on token"));
}

// A schema whose $refs chain `n` definitions, and a Lark grammar whose rules chain `n` rules:
// each link one level of llguidance's compiler's recursion.
std::string RefChain(int n) {
  json defs = json::object();
  for (int i = 0; i < n; ++i)
    defs["d" + std::to_string(i)] = {{"$ref", "#/$defs/d" + std::to_string(i + 1)}};
  defs["d" + std::to_string(n)] = {{"type", "integer"}};
  return json{{"$defs", defs}, {"$ref", "#/$defs/d0"}}.dump();
}
std::string RuleChain(int n) {
  std::string lark = "start: r0\n";
  for (int i = 0; i < n; ++i) absl::StrAppend(&lark, "r", i, ": r", i + 1, "\n");
  absl::StrAppend(&lark, "r", n, ": \"x\"\n");
  return lark;
}

// Grammars that once crashed or stalled a replica: chains past the bounds are refused by name
// before llguidance sees them; chains within them compile on a grammar thread (whose stack holds
// the recursion an 8 MiB thread did not); nesting, size and pathological regexes are bounded.
TEST_P(GrammarTest, HostileGrammarsAreBoundedAndCompileOnAGrammarThread) {
  auto refused = [&](const Grammar& g) {
    const absl::Status s = CheckGrammarBounds(g);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << g.data.substr(0, 80);
    return std::string(s.message());
  };
  EXPECT_THAT(refused({"json_schema", RefChain(kMaxGrammarRefs + 1)}),
              HasSubstr(absl::StrCat("at most ", kMaxGrammarRefs, " are accepted")));
  EXPECT_THAT(refused({"lark", RuleChain(kMaxLarkRules)}),
              HasSubstr(absl::StrCat("rules; at most ", kMaxLarkRules)));
  EXPECT_THAT(refused({"regex", std::string(200, '(') + "a" + std::string(200, ')')}),
              HasSubstr("nests brackets deeper than 100"));
  EXPECT_THAT(refused({"regex", std::string(kMaxGrammarBytes + 1, 'a')}), HasSubstr("bytes long"));
  EXPECT_TRUE(CheckGrammarBounds({"regex", "\\(\\(\\(\\([(]"}).ok()) << "escaped brackets";

  GrammarWorkers workers(2, kGrammarStackBytes, 8);
  for (const Grammar& g : {Grammar{"json_schema", RefChain(kMaxGrammarRefs - 2)},
                           Grammar{"lark", RuleChain(kMaxLarkRules - 3)}}) {
    absl::Notification done;
    absl::Status status;
    ASSERT_TRUE(workers.Post([&] {
      status = vocab_->Compile(g).status();
      done.Notify();
    }));
    ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(120))) << g.kind;
    EXPECT_TRUE(status.ok()) << g.kind << ": " << status;
  }
}

// What a client gets wrong is told in our words: the kind of grammar and a one-line reason,
// never llguidance's parser state, a panic or a backtrace; a grammar that matches nothing is
// refused when compiled, not when generating.
TEST_P(GrammarTest, UserGrammarFailuresAreOneLineReasons) {
  for (
      const Grammar& g :
      {Grammar{"json_schema", R"({"$ref": "#"})"},
       Grammar{
           "json_schema",
           R"({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})"},
       Grammar{"lark", "start: start"}, Grammar{"json_schema", R"({"$ref": "#/$defs/missing"})"}}) {
    auto c = vocab_->Compile(g);
    ASSERT_FALSE(c.ok()) << g.data;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << g.data;
    const std::string m(c.status().message());
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    EXPECT_LT(m.size(), 500u) << m;
    EXPECT_THAT(m, ::testing::Not(HasSubstr("panicked"))) << m;
    EXPECT_THAT(m, ::testing::Not(HasSubstr("backtrace"))) << m;
    EXPECT_THAT(m, ::testing::AnyOf(HasSubstr("the JSON schema"), HasSubstr("the grammar"),
                                    HasSubstr("the regular expression")))
        << m;
  }
}

// One compiled grammar serves a request's sequences: each clone goes its own way.
TEST_P(GrammarTest, ClonesAreIndependent) {
  auto c = vocab_->Compile({"regex", "(ab|cd)"});
  ASSERT_TRUE(c.ok()) << c.status();
  std::unique_ptr<TokenConstraint> other = (*c)->Clone();
  const std::string a = Walk(**c, 1), b = Walk(*other, 2);
  EXPECT_TRUE(a == "ab" || a == "cd") << a;
  EXPECT_TRUE(b == "ab" || b == "cd") << b;
}

TEST_P(GrammarTest, GrammarsThatDoNotCompileAreRefusedWithTheReason) {
  auto refused = [&](const Grammar& g) {
    auto c = vocab_->Compile(g);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << g.data;
    return std::string(c.status().message());
  };
  EXPECT_THAT(refused({"json_schema", R"({"type": "frobnicate"})"}), HasSubstr("frobnicate"));
  EXPECT_THAT(refused({"json_schema", "{not json"}), HasSubstr("the schema is not JSON"));
  EXPECT_THAT(refused({"json_schema", std::string(100, '[') + std::string(100, ']')}),
              HasSubstr("nests deeper than 64"));
  EXPECT_FALSE(refused({"regex", "(unclosed"}).empty());
  EXPECT_FALSE(refused({"lark", "start: ("}).empty());
  EXPECT_THAT(refused({"yaml", "a: b"}), HasSubstr("no grammar of kind 'yaml'"));
  EXPECT_THAT(refused({"regex", std::string("a\0b", 3)}), HasSubstr("NUL"));
  EXPECT_THAT(refused({"json_schema", R"({"type": "object", "x-guidance": 3})"}),
              HasSubstr("x-guidance must be an object"));
  EXPECT_THAT(refused({"json_schema", R"({"type": "array", "contains": {"const": 1}})"}),
              HasSubstr("contains"));
}

// oneOf is taken as anyOf (real schemas' branches mostly exclude each other); a schema's own
// x-guidance keeps our defaults for what it does not set (no whitespace).
TEST_P(GrammarTest, OneOfAndOwnOptionsKeepTheDefaults) {
  const json schema = json::parse(R"({
    "oneOf": [{"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
               "required": ["a"],
               "additionalProperties": false},
              {"type": "object", "properties": {"b": {"enum": ["x", "y"]}}, "required": ["b"],
               "additionalProperties": false}],
    "x-guidance": {"item_separator": ","}})");
  for (uint32_t seed = 0; seed < 10; ++seed) {
    auto c = vocab_->Compile({"json_schema", schema.dump()});
    ASSERT_TRUE(c.ok()) << c.status();
    const std::string text = Walk(**c, seed);
    const json v = json::parse(text, nullptr, false);
    ASSERT_TRUE(v.is_object() && v.size() == 1) << text;
    EXPECT_TRUE((v.contains("a") && v["a"].is_number_integer()) ||
                (v.contains("b") && (v["b"] == "x" || v["b"] == "y")))
        << text;
    EXPECT_EQ(text.find(' '), std::string::npos) << "no whitespace: " << text;
  }
}

// Keywords llguidance lacks, taken where a sound stand-in exists (every answer still valid
// against the schema as written): a dialect of its own is read as the latest draft (llguidance
// would fetch it), an unknown format is an annotation, uniqueItems caps the array
// at one item, dependencies apply always, `not` of everything is false and `not` of types keeps
// the others. A property named like a keyword is a name, not a keyword.
TEST_P(GrammarTest, KeywordsLlguidanceLacksHaveSoundStandIns) {
  const json schema = json::parse(R"({
    "$schema": "http://iglucentral.com/schemas/com.snowplowanalytics.self-desc/schema/jsonschema/1-0-0#",
    "type": "object",
    "properties": {
      "format": {"type": "string", "format": "feed-onestop-id", "maxLength": 6},
      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": true},
      "street": {"type": "string", "maxLength": 4},
      "box": {"type": "integer", "minimum": 0, "maximum": 9},
      "gone": {"not": {}},
      "id": {"not": {"type": ["string", "object", "array", "boolean", "null"]}, "minimum": 0,
             "maximum": 99}
    },
    "required": ["format", "id"],
    "dependencies": {"box": ["street"], "format": {"properties": {"box": {"maximum": 3}}}},
    "additionalProperties": false})");
  for (uint32_t seed = 0; seed < 12; ++seed) {
    auto c = vocab_->Compile({"json_schema", schema.dump()});
    ASSERT_TRUE(c.ok()) << c.status();
    const std::string text = Walk(**c, seed);
    const json v = json::parse(text, nullptr, false);
    ASSERT_TRUE(v.is_object()) << text;
    EXPECT_TRUE(v["format"].is_string()) << text;
    EXPECT_TRUE(v["id"].is_number()) << text;
    if (v.contains("tags")) EXPECT_LE(v["tags"].size(), 1u) << text;
    EXPECT_FALSE(v.contains("gone")) << text;
    EXPECT_TRUE(v.contains("street")) << "dependencies apply always: " << text;
    if (v.contains("box")) EXPECT_LE(v["box"].get<int>(), 3) << text;
  }
  // What has no sound stand-in is refused by name.
  for (const auto& [refused, word] : std::vector<std::pair<std::string, std::string>>{
           {R"({"type": "array", "uniqueItems": true, "minItems": 2})", "uniqueItems"},
           {R"({"type": "string", "not": {"pattern": "^a"}})", "not"},
           {R"({"type": "number", "not": {"type": "integer"}})", "not"}}) {
    auto c = vocab_->Compile({"json_schema", refused});
    ASSERT_FALSE(c.ok()) << refused;
    EXPECT_THAT(std::string(c.status().message()), HasSubstr(word)) << c.status();
  }
}

// Structured output after the reasoning: behind the gate any token goes while the model reasons
// (save one that would close the block and carry text past it), and the grammar rules from the
// token after </think>; without a block the prompt opened, the first token may open one with
// <think> or start the answer.
TEST(ReasoningGateTest, TheGrammarStartsAfterTheReasoning) {
  auto t =
      TrainBpeTokenizer(DefaultCorpus(), TokenizerStyle::kByteLevel, 700, {"<think>", "</think>"});
  ASSERT_TRUE(t.ok()) << t.status();
  auto tok = Tokenizer::FromJson(t->json, "test");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const int32_t open = *(*tok)->TokenId("<think>"), close = *(*tok)->TokenId("</think>");
  auto vocab = GrammarVocabulary::Create(**tok, (*tok)->vocab_size(), {kEos});
  ASSERT_TRUE(vocab.ok()) << vocab.status();
  const ReasoningGate gate(**tok, (*tok)->vocab_size());
  auto allowed = [](TokenConstraint& c) {
    std::vector<uint32_t> mask;
    EXPECT_TRUE(c.Allowed(&mask).ok());
    std::set<int32_t> ids;
    for (size_t i = 0; i < mask.size() * 32; ++i) {
      if (mask[i / 32] >> (i % 32) & 1u) ids.insert(static_cast<int32_t>(i));
    }
    return ids;
  };
  auto inner = [&] { return *vocab.value()->Compile({"regex", "ab|cd"}); };
  const std::set<int32_t> answer = allowed(*inner());
  const auto a = (*tok)->Encode("a", false), x = (*tok)->Encode("x", false);
  ASSERT_TRUE(a.ok() && x.ok() && a->size() == 1 && x->size() == 1);

  // Opened by the prompt: free, then the grammar.
  auto c = gate.Wrap(inner(), /*in_block=*/true);
  const std::set<int32_t> free = allowed(*c);
  EXPECT_TRUE(free.count((*x)[0]) && free.count(close) && free.count(kEos));
  for (int32_t id = 0; id < (*tok)->vocab_size(); ++id) {
    const std::string bytes = (*tok)->TokenBytes(id);
    const size_t gt = bytes.find('>');
    EXPECT_EQ(
        free.count(id) == 0,
        gt != std::string::npos && bytes.find_first_not_of(" \t\r\n", gt + 1) != std::string::npos)
        << bytes;
  }
  ASSERT_TRUE(c->Accept((*x)[0]).ok()) << "reasoning is free text";
  EXPECT_FALSE(c->Finished());
  ASSERT_TRUE(c->Accept(close).ok());
  EXPECT_EQ(allowed(*c), answer) << "the grammar, from its start";
  auto clone = c->Clone();
  EXPECT_FALSE(c->Accept((*x)[0]).ok()) << "the answer follows the grammar";
  EXPECT_EQ(allowed(*clone), answer) << "a clone goes its own way";

  // Not opened by the prompt: <think> first opens it; anything else is the answer's start.
  auto opens = gate.Wrap(inner(), false);
  std::set<int32_t> first = answer;
  first.insert(open);
  EXPECT_EQ(allowed(*opens), first);
  ASSERT_TRUE(opens->Accept(open).ok());
  EXPECT_EQ(allowed(*opens), free);
  auto answers = gate.Wrap(inner(), false);
  ASSERT_TRUE(answers->Accept((*a)[0]).ok());
  EXPECT_FALSE(answers->Accept(open).ok()) << "no reasoning once the answer began";

  // gpt-oss's harmony: free through the analysis channel (and a "final" said there), the grammar
  // from the final channel's message.
  auto harmony = gate.WrapHarmony(inner());
  auto feed = [&](const std::string& text) {
    auto ids = (*tok)->Encode(text, false);
    ASSERT_TRUE(ids.ok());
    for (int32_t id : *ids) ASSERT_TRUE(harmony->Accept(id).ok()) << text;
  };
  feed("<|channel|>analysis<|message|>the final word<|end|><|start|>assistant");
  EXPECT_EQ(allowed(*harmony), free);
  feed("<|channel|>final");
  EXPECT_EQ(allowed(*harmony), free) << "the header is not over";
  feed("<|message|>");
  EXPECT_EQ(allowed(*harmony), answer);
}

// tool_choice auto with a JSON answer asked for: every walk is calls in the format or the
// answer in its schema, never anything else.
TEST_P(GrammarTest, CallsOrTheAnswer) {
  const auto tools = nlohmann::ordered_json::parse(R"([
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object",
      "properties": {}, "additionalProperties": false}}}])");
  auto answer = PreparedSchema(
      {"json_schema", R"({"type": "object", "properties": {"ok": {"type": "boolean"}},
                          "required": ["ok"], "additionalProperties": false})"});
  ASSERT_TRUE(answer.ok()) << answer.status();
  for (const char* format : {"hermes", "llama3_json", "deepseek_v31", "pythonic"}) {
    int calls = 0, answers = 0;
    for (uint32_t seed = 0; seed < 12; ++seed) {
      auto c = vocab_->Compile(ToolCallOrAnswerGrammar(format, tools, false, {}, *answer));
      ASSERT_TRUE(c.ok()) << format << ": " << c.status();
      const std::string text = Walk(**c, seed);
      ToolCallParser parser(format, tools, false);
      ToolCallParser::Out out = parser.Add(text);
      ToolCallParser::Out rest = parser.Finish();
      if (parser.calls() > 0) {
        ++calls;
        continue;
      }
      const json v = json::parse(out.content + rest.content, nullptr, false);
      EXPECT_TRUE(v.is_object() && v.size() == 1 && v["ok"].is_boolean()) << format << ": " << text;
      ++answers;
    }
    EXPECT_GT(calls + answers, 0) << format;
  }
}

// tool_choice auto with a strict function: the output is text, or calls that keep the schema;
// text first where the format has it (the lazy text ends at the calls' opener).
TEST_P(GrammarTest, TextOrStrictCalls) {
  const auto tools = nlohmann::ordered_json::parse(R"([
    {"type": "function", "function": {"name": "pick", "strict": true, "parameters": {
      "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
      "required": ["n"], "additionalProperties": false}}}])");
  for (const char* format :
       {"hermes", "qwen3_coder", "llama3_json", "pythonic", "deepseek_v31", "kimi_k2"}) {
    auto g = ToolCallOrTextGrammar(format, tools, true, {});
    ASSERT_TRUE(g.ok()) << format << ": " << g.status();
    for (uint32_t seed = 0; seed < 8; ++seed) {
      auto c = vocab_->Compile(*g);
      ASSERT_TRUE(c.ok()) << format << ": " << c.status() << "\n" << g->data;
      const std::string text = Walk(**c, seed);
      ToolCallParser parser(format, tools, true);
      ToolCallParser::Out out = parser.Add(text);
      ToolCallParser::Out rest = parser.Finish();
      out.calls.insert(out.calls.end(), rest.calls.begin(), rest.calls.end());
      std::map<int, std::string> args;
      for (const ToolCall& call : out.calls) args[call.index] += call.arguments;
      for (const auto& [index, a] : args) {
        const json v = json::parse(a, nullptr, false);
        EXPECT_TRUE(v.is_object() && v["n"].is_number_integer() && v["n"] >= 1 && v["n"] <= 9)
            << format << ": " << text;
      }
    }
  }
  // Text, then the opener: from there the call keeps the schema.
  auto g = ToolCallOrTextGrammar("hermes", tools, true, {});
  ASSERT_TRUE(g.ok());
  auto c = vocab_->Compile(*g);
  ASSERT_TRUE(c.ok()) << c.status();
  auto ids = tok_->Encode("Let me see. <tool_call>\n", false);
  ASSERT_TRUE(ids.ok());
  for (int32_t id : *ids) ASSERT_TRUE((*c)->Accept(id).ok()) << tok_->TokenBytes(id);
  std::vector<uint32_t> mask;
  ASSERT_TRUE((*c)->Allowed(&mask).ok());
  for (size_t i = 0; i < mask.size() * 32; ++i) {
    if (mask[i / 32] >> (i % 32) & 1u) {
      EXPECT_EQ(tok_->TokenBytes(static_cast<int32_t>(i)).substr(0, 1), "{") << i;
    }
  }
  EXPECT_FALSE(ToolCallOrTextGrammar("openai", tools, true, {}).ok()) << "harmony: refused";
}

TEST(GrammarVocabularyTest, NeedsAnEndOfSequence) {
  auto t = TrainBpeTokenizer(DefaultCorpus(), TokenizerStyle::kByteLevel, 300);
  ASSERT_TRUE(t.ok());
  auto tok = Tokenizer::FromJson(t->json, "test");
  ASSERT_TRUE(tok.ok());
  EXPECT_THAT(std::string(GrammarVocabulary::Create(**tok, 300, {}).status().message()),
              HasSubstr("needs the model's end-of-sequence token"));
}

INSTANTIATE_TEST_SUITE_P(Styles, GrammarTest,
                         ::testing::Values(TokenizerStyle::kByteLevel,
                                           TokenizerStyle::kSentencePiece),
                         [](const auto& info) {
                           return info.param == TokenizerStyle::kByteLevel ? "ByteLevel"
                                                                           : "SentencePiece";
                         });

}  // namespace
}  // namespace shardserve
