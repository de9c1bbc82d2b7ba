// Request parsing (pure) and the text stream's stop-string handling.
#include "serve/openai.h"

#include <gtest/gtest.h>

#include "devtools/bpe_trainer.h"
#include "devtools/corpus.h"
#include "serve/text_stream.h"
#include "tokenizer/tokenizer.h"

namespace shardserve {
namespace {

using json = nlohmann::json;

TEST(OpenAiParse, AcceptsTheOpenAiShapes) {
  auto r = ParseApiRequest(json::parse(R"({"model": "m", "prompt": [[1, 2], "hi"],
      "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "x",
      "logprobs": 2, "stream": true, "stream_options": {"include_usage": true}, "user": "u"})"),
                           false);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->prompt_ids[0], (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(r->prompt_texts[1], "hi");
  EXPECT_EQ(r->params.max_tokens, 5);
  EXPECT_FLOAT_EQ(r->params.temperature, 0.5f);
  EXPECT_EQ(r->params.top_logprobs, 2);
  EXPECT_TRUE(r->logprobs && r->stream && r->include_usage && r->seed_set);
  EXPECT_EQ(r->stop, std::vector<std::string>{"x"});

  auto c = ParseApiRequest(json::parse(R"({"model": "m", "messages": [
      {"role": "developer", "content": "s"},
      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
      "max_completion_tokens": 7, "logprobs": true, "top_logprobs": 3})"),
                           true);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->messages[0].role, "system");
  EXPECT_EQ(c->messages[1].content, "a\nb");  // joined as vLLM joins text parts
  EXPECT_EQ(c->messages[1].parts, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(c->params.max_tokens, 7);
  EXPECT_EQ(c->params.top_logprobs, 3);
  EXPECT_FLOAT_EQ(c->params.temperature, 1.0f);  // OpenAI's default

  auto penalized = ParseApiRequest(json::parse(R"({"model": "m", "prompt": "x",
      "presence_penalty": -1.5, "frequency_penalty": 2, "repetition_penalty": 1.3,
      "logit_bias": {"12": -100, "7": 4.5}, "min_tokens": 3, "max_tokens": 4})"),
                                   false);
  ASSERT_TRUE(penalized.ok()) << penalized.status();
  const SamplingParams& p = penalized->params;
  EXPECT_FLOAT_EQ(p.presence_penalty, -1.5f);
  EXPECT_FLOAT_EQ(p.frequency_penalty, 2.0f);
  EXPECT_FLOAT_EQ(p.repetition_penalty, 1.3f);
  EXPECT_EQ(p.logit_bias, (std::vector<std::pair<int32_t, float>>{{12, -100.0f}, {7, 4.5f}}));
  EXPECT_EQ(p.min_tokens, 3);
}

TEST(OpenAiParse, RefusalsNameTheParameter) {
  struct Case {
    const char* body;
    bool chat;
    const char* param;
  };
  const Case cases[] = {
      {R"({"prompt": "x"})", false, "model"},
      {R"({"model": "m"})", false, "prompt"},
      {R"({"model": "m", "prompt": []})", false, "prompt"},
      {R"({"model": "m", "prompt": [1, -2]})", false, "prompt"},
      {R"({"model": "m", "prompt": "x", "max_tokens": 0})", false, "max_tokens"},
      {R"({"model": "m", "prompt": "x", "max_tokens": 2.5})", false, "max_tokens"},
      {R"({"model": "m", "prompt": "x", "temperature": "hot"})", false, "temperature"},
      {R"({"model": "m", "prompt": "x", "top_p": 0})", false, "top_p"},
      {R"({"model": "m", "prompt": "x", "n": 17})", false, "n"},
      {R"({"model": "m", "prompt": "x", "n": 0})", false, "n"},
      {R"({"model": "m", "prompt": [[1], [2], [3], [4], [5], [6], [7], [8], [9]], "n": 16})", false,
       "n"},
      {R"({"model": "m", "prompt": "x", "prompt_logprobs": 1})", false, "prompt_logprobs"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "echo": true})", true,
       "echo"},
      {R"({"model": "m", "prompt": "x", "n": 3, "best_of": 2})", false, "best_of"},
      {R"({"model": "m", "prompt": "x", "best_of": 3, "stream": true})", false, "best_of"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "best_of": 2})", true,
       "best_of"},
      {R"({"model": "m", "prompt": "x", "stop": ["a", 1]})", false, "stop"},
      {R"({"model": "m", "prompt": "x", "logprobs": 50})", false, "logprobs"},
      {R"({"model": "m", "prompt": "x", "stream_options": {}})", false, "stream_options"},
      {R"({"model": "m", "prompt": "x", "frequency_penalty": 2.5})", false, "frequency_penalty"},
      {R"({"model": "m", "prompt": "x", "presence_penalty": "a"})", false, "presence_penalty"},
      {R"({"model": "m", "prompt": "x", "repetition_penalty": 0})", false, "repetition_penalty"},
      {R"({"model": "m", "prompt": "x", "logit_bias": {"a": 1}})", false, "logit_bias"},
      {R"({"model": "m", "prompt": "x", "logit_bias": {"3": 101}})", false, "logit_bias"},
      {R"({"model": "m", "prompt": "x", "logit_bias": [1]})", false, "logit_bias"},
      {R"({"model": "m", "prompt": "x", "min_tokens": -1})", false, "min_tokens"},
      {R"({"model": "m", "prompt": "x", "min_tokens": 5, "max_tokens": 4})", false, "min_tokens"},
      {R"({"model": "m", "prompt": "x", "suffix": "y"})", false, "suffix"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}],
           "tools": [{"type": "function", "function": {"name": "f g"}}]})",
       true, "tools[0].function.name"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}],
           "tools": [{"type": "function", "function": {"name": "f"}},
                     {"type": "function", "function": {"name": "f"}}]})",
       true, "tools[1].function.name"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}],
           "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]})",
       true, "tools[0].function.parameters"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}],
           "tools": [{"type": "retrieval"}]})",
       true, "tools[0]"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}],
           "tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}],
           "tool_choice": "required"})",
       true, "tools[0].function.strict"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}],
           "tool_choice": "required"})",
       true, "tool_choice"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}],
           "tools": [{"type": "function", "function": {"name": "f"}}],
           "tool_choice": {"type": "function", "function": {"name": "g"}}})",
       true, "tool_choice"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}],
           "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
           "guided_regex": "a"})",
       true, "guided_regex"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "maybe"})",
       true, "tool_choice"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "functions": []})", true,
       "functions"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}],
           "parallel_tool_calls": "no"})",
       true, "parallel_tool_calls"},
      {R"({"model": "m", "prompt": "x", "tools": []})", false, "tools"},
      {R"({"model": "m", "prompt": "x", "parallel_tool_calls": true})", false,
       "parallel_tool_calls"},
      {R"({"model": "m", "messages": [{"role": "tool", "content": "42"}]})", true,
       "messages[0].tool_call_id"},
      {R"({"model": "m", "messages": [{"role": "function", "content": "42", "name": "f"}]})", true,
       "messages[0].role"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "assistant",
           "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]})",
       true, "messages[1].tool_calls[0].function.arguments"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x",
           "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]})",
       true, "messages[0].tool_calls"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "assistant",
           "tool_calls": [{"type": 5, "function": {"name": "f"}}]}]})",
       true, "messages[1].tool_calls[0]"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "assistant",
           "tool_calls": [{"type": "function", "function": {"name": 7}}]}]})",
       true, "messages[1].tool_calls[0]"},
      {R"({"model": "m", "messages": [{"role": "tool", "content": "x", "tool_call_id": 3}]})", true,
       "messages[0].tool_call_id"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x", "name": ["a"]}]})", true,
       "messages[0].name"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}],
           "response_format": {"type": "xml"}})",
       true, "response_format"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}],
           "response_format": {"type": "json_schema", "json_schema": {"name": "a"}}})",
       true, "response_format.json_schema.schema"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}],
           "response_format": {"type": "json_schema"}})",
       true, "response_format.json_schema"},
      {R"({"model": "m", "prompt": "x", "guided_regex": "a+", "guided_choice": ["a"]})", false,
       "guided_choice"},
      {R"({"model": "m", "prompt": "x", "guided_choice": []})", false, "guided_choice"},
      {R"({"model": "m", "prompt": "x", "guided_json": 7})", false, "guided_json"},
      {R"({"model": "m", "prompt": "x", "structured_outputs": {"structural_tag": "t"}})", false,
       "structured_outputs.structural_tag"},
      {R"({"model": "m", "prompt": "x", "structured_outputs": {"regex": 3}})", false,
       "structured_outputs.regex"},
      {R"({"model": "m", "prompt": "x", "structured_outputs": "json"})", false,
       "structured_outputs"},
      {R"({"model": "m", "prompt": "x", "guided_regex": "a", "structured_outputs": {"regex": "b"}})",
       false, "structured_outputs.regex"},
      {R"({"model": "m", "prompt": "x", "guided_regex": "a", "guided_decoding_backend": "xgrammar"})",
       false, "guided_decoding_backend"},
      {R"({"model": "m", "prompt": "x", "guided_json": {}, "guided_whitespace_pattern": " "})",
       false, "guided_whitespace_pattern"},
      {R"({"model": "m", "prompt": "x", "guided_grammar": {"start": 1}})", false, "guided_grammar"},
      {R"({"model": "m", "prompt": "x", "guided_regex": "a+", "min_tokens": 2})", false,
       "min_tokens"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}],
           "tools": [{"type": "function", "function": {"name": "f"}}],
           "guided_grammar": "start: \"a\""})",
       true, "guided_grammar"},
      {R"({"model": "m", "messages": []})", true, "messages"},
      {R"({"model": "m", "messages": [{"role": "user"}]})", true, "messages[0].content"},
      {R"({"model": "m", "messages": [{"role": "bot", "content": "x"}]})", true,
       "messages[0].role"},
      {R"({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", true,
       "top_logprobs"},
  };
  for (const Case& c : cases) {
    auto r = ParseApiRequest(json::parse(c.body), c.chat);
    ASSERT_FALSE(r.ok()) << c.body;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.body;
    EXPECT_EQ(ErrorParam(r.status()), c.param) << c.body << ": " << r.status();
    const json body = ErrorBody(r.status());
    EXPECT_EQ(body["error"]["param"], c.param);
    EXPECT_EQ(body["error"]["type"], "invalid_request_error");
  }
}

// Structured output's fields become one grammar: OpenAI's response_format (the schema as the
// client wrote it) and vLLM's guided_* extensions (a choice list as Lark literals).
TEST(OpenAiParse, StructuredOutputFields) {
  auto grammar = [](const char* extra, bool chat = true) {
    const std::string body =
        std::string(R"({"model": "m", "messages": [{"role": "user", "content": "x"}], )") + extra +
        "}";
    auto r = ParseApiRequest(nlohmann::ordered_json::parse(body), chat);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() && r->grammar ? r->grammar->kind + " " + r->grammar->data + " " + r->grammar_param
                                : std::string("none");
  };
  EXPECT_EQ(grammar(R"("response_format": {"type": "text"})"), "none");
  EXPECT_EQ(grammar(R"("response_format": {"type": "json_object"})"),
            "json_object  response_format");
  EXPECT_EQ(grammar(R"("response_format": {"type": "json_schema", "json_schema": {"name": "p",
      "strict": true, "schema": {"type": "object", "required": ["b", "a"]}}})"),
            R"(json_schema {"type":"object","required":["b","a"]} response_format)");
  EXPECT_EQ(grammar(R"("guided_json": "{\"type\": \"integer\"}")"),
            R"(json_schema {"type": "integer"} guided_json)");
  EXPECT_EQ(grammar(R"("guided_regex": "[0-9]+")"), "regex [0-9]+ guided_regex");
  EXPECT_EQ(grammar(R"("structured_outputs": {"regex": "a+"})"),
            "regex a+ structured_outputs.regex");
  EXPECT_EQ(grammar(R"("structured_outputs": {"choice": ["x"]})"),
            R"(lark start: "x" structured_outputs.choice)");
  EXPECT_EQ(grammar(R"("structured_outputs": {"json_object": true})"),
            "json_object  structured_outputs.json_object");
  EXPECT_EQ(grammar(R"("guided_regex": "b", "guided_decoding_backend": "llguidance")"),
            "regex b guided_regex");
  EXPECT_EQ(grammar(R"("guided_grammar": "start: \"a\"")"), R"(lark start: "a" guided_grammar)");
  EXPECT_EQ(grammar(R"("guided_choice": ["yes", "n\"o"])"),
            R"(lark start: "yes" | "n\"o" guided_choice)");
}

// Tools reach the template in the client's key order; a tool round trip's messages (an
// assistant's calls, their arguments sent as a JSON string, and the tool's answer) are kept for
// it with the arguments as an object; tool_choice defaults to auto with tools, none without.
TEST(OpenAiParse, ToolsAndToolMessages) {
  const auto body = nlohmann::ordered_json::parse(R"({"model": "m", "messages": [
      {"role": "user", "content": "weather?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
       "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"days\": 2}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"}],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters":
      {"type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {"type": "integer"}}}}}],
    "parallel_tool_calls": false})");
  auto r = ParseApiRequest(body, true);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tool_choice, "auto");
  EXPECT_FALSE(r->parallel_tool_calls);
  EXPECT_EQ(r->tools.dump(), body["tools"].dump());  // the keys' order kept (zeta before alpha)
  ASSERT_EQ(r->messages.size(), 3u);
  EXPECT_TRUE(r->messages[1].content_null);
  EXPECT_EQ(r->messages[1].tool_calls.dump(),
            R"([{"id":"call_1","type":"function","function":{"name":"get_weather",)"
            R"("arguments":{"city":"Oslo","days":2}}}])");
  EXPECT_EQ(r->messages[2].role, "tool");
  EXPECT_EQ(r->messages[2].tool_call_id, "call_1");
  EXPECT_EQ(r->messages[2].name, "get_weather");
  auto none = ParseApiRequest(
      nlohmann::ordered_json::parse(R"({"model": "m", "messages": [{"role": "user", "content":
          "x"}], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"})"),
      true);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->tool_choice, "none");
  auto named = ParseApiRequest(nlohmann::ordered_json::parse(R"({"model": "m", "messages": [
      {"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f",
      "strict": true}}], "tool_choice": {"type": "function", "function": {"name": "f"}}})"),
                               true);
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(named->tool_choice, "function");
  EXPECT_EQ(named->tool_choice_name, "f");
  auto plain =
      ParseApiRequest(nlohmann::ordered_json::parse(
                          R"({"model": "m", "messages": [{"role": "user", "content": "x"}]})"),
                      true);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->tool_choice, "none");
  EXPECT_TRUE(plain->tools.is_null());
}

TEST(TextStream, HoldsBackAPossibleStopStringAndCutsBeforeIt) {
  auto trained = TrainBpeTokenizer(DefaultCorpus(), TokenizerStyle::kByteLevel, 300);
  auto tok = Tokenizer::FromJson(trained->json, "test");
  ASSERT_TRUE(tok.ok());
  const std::string text = "the cat sat on the mat. END of story";
  auto ids = *(*tok)->Encode(text, false);
  TextStream stream(tok->get(), {"END"});
  std::string out;
  bool stopped = false;
  for (int32_t id : ids) {
    auto d = stream.Add({id});
    EXPECT_EQ(d.token_texts.size(), 1u);
    out += d.text;
    // Never more than what precedes the stop string.
    EXPECT_LE(out.size(), text.find("END"));
    if (d.stopped) {
      stopped = true;
      break;
    }
  }
  EXPECT_TRUE(stopped);
  EXPECT_EQ(out, "the cat sat on the mat. ");

  TextStream plain(tok->get(), {"zzz"});
  std::string all;
  for (int32_t id : ids) all += plain.Add({id}).text;
  all += plain.Flush();
  EXPECT_EQ(all, text);
}

int32_t IdOf(const Tokenizer& tok, const char* token) {
  const std::optional<int32_t> id = tok.TokenId(token);
  EXPECT_TRUE(id.has_value()) << token;
  return id.value_or(0);
}

// The text a stream hands out for `ids`, token by token and then flushed, joined.
std::string StreamAll(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  TextStream stream(&tok, {});
  std::string out;
  for (int32_t id : ids) out += stream.Add({id}).text;
  return out + stream.Flush();
}

// SentencePiece byte fallback (as `tokenizers` decodes it): a run of byte tokens decodes as one,
// valid UTF-8 or else U+FFFD per byte, so the stream holds a run until it ends; the text after a
// byte that formed no character still flows (a stream once stopped emitting for good there), and
// the joined stream is the decode of all tokens.
TEST(TextStream, ByteFallbackRunsComeOutWholeAndNeverStopTheText) {
  auto trained = TrainBpeTokenizer(DefaultCorpus(), TokenizerStyle::kSentencePiece, 300);
  auto tok = Tokenizer::FromJson(trained->json, "test");
  ASSERT_TRUE(tok.ok()) << tok.status();
  auto byte = [&](const char* t) {
    const int32_t id = IdOf(**tok, t);
    EXPECT_TRUE((*tok)->IsByteFallbackToken(id)) << t;
    return id;
  };
  const std::vector<int32_t> cat = *(*tok)->Encode("the cat", false),
                             sat = *(*tok)->Encode(" sat on the mat", false);
  const std::vector<int32_t> han = {byte("<0xE4>"), byte("<0xB8>"), byte("<0xAD>")};  // 中
  const std::string r = "\xEF\xBF\xBD";
  struct Case {
    std::vector<std::vector<int32_t>> parts;
    std::string run;  // what the byte run decodes to
  };
  const std::vector<Case> cases = {
      {{cat, han, sat}, "\xE4\xB8\xAD"},                       // a whole character
      {{cat, {han[0], han[1]}, sat}, r + r},                   // cut short: per byte
      {{cat, han, {han[0], han[1]}, sat}, r + r + r + r + r},  // one invalid run of five
      {{cat, {han[2]}, sat, {han[0]}}, r},                     // a lone continuation; and
  };                                                           // a byte at the very end
  for (const Case& c : cases) {
    std::vector<int32_t> ids;
    for (const auto& p : c.parts) ids.insert(ids.end(), p.begin(), p.end());
    const std::string all = (*tok)->Decode(ids, true);
    EXPECT_NE(all.find(c.run), std::string::npos) << all;
    EXPECT_EQ(StreamAll(**tok, ids), all);
  }

  // The character's three bytes: nothing until the run ends, then the character with the
  // token that ended it.
  TextStream stream(tok->get(), {});
  stream.Add(cat);
  for (int32_t b : han) EXPECT_EQ(stream.Add({b}).text, "");
  const auto word = std::find_if(sat.begin(), sat.end(),
                                 [&](int32_t id) { return !(*tok)->IsByteFallbackToken(id); });
  ASSERT_NE(word, sat.end());
  const std::string next = stream.Add({*word}).text;
  EXPECT_NE(next.find("\xE4\xB8\xAD"), std::string::npos) << next;
}

// Byte-level BPE decodes bytes with from_utf8_lossy, as `tokenizers` does: one U+FFFD per
// maximal invalid run (a cut-short character's bytes together), not one per byte.
TEST(TextStream, ByteLevelInvalidRunsAreOneReplacementEach) {
  auto trained = TrainBpeTokenizer(DefaultCorpus(), TokenizerStyle::kByteLevel, 300);
  auto tok = Tokenizer::FromJson(trained->json, "test");
  ASSERT_TRUE(tok.ok()) << tok.status();
  // GPT-2's byte alphabet: 0xE4 is "ä", 0xB8 is "¸", 0x80 is "Ģ", 0xC0 (never valid) is "À".
  const int32_t e4 = IdOf(**tok, "\xC3\xA4"), b8 = IdOf(**tok, "\xC2\xB8"),
                x80 = IdOf(**tok, "\xC4\xA2"), c0 = IdOf(**tok, "\xC3\x80");
  const std::vector<int32_t> h = *(*tok)->Encode("h", false);
  struct Case {
    std::vector<int32_t> ids;
    std::string want;
  };
  const std::string r = "\xEF\xBF\xBD";
  const std::vector<Case> cases = {
      {{e4, b8, h[0]}, r + "h"},                  // E4 B8: one cut-short character
      {{e4, h[0], b8, h[0]}, r + "h" + r + "h"},  // a lead, and a lone continuation
      {{c0, x80, h[0]}, r + r + "h"},             // C0 never starts a character: each byte alone
      {{e4, b8}, r},                              // cut short by the end
  };
  for (const Case& c : cases) {
    EXPECT_EQ((*tok)->Decode(c.ids, true), c.want);
    EXPECT_EQ(StreamAll(**tok, c.ids), c.want);
  }
}

}  // namespace
}  // namespace shardserve

namespace shardserve {
namespace {

// A strict function with tool_choice auto is taken (the server constrains its calls, the output
// text or calls), its field named for the errors of that grammar.
TEST(OpenAiParse, StrictWithAutoIsNamed) {
  auto r = ParseApiRequest(json::parse(R"({"model": "m", "messages": [{"role": "user",
      "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}},
      {"type": "function", "function": {"name": "g", "strict": true}}]})"),
                           true);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tool_choice, "auto");
  EXPECT_EQ(r->strict_param, "tools[1].function.strict");
}

}  // namespace
}  // namespace shardserve
