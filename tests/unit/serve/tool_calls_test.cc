#include "serve/tool_calls.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace shardserve {
namespace {

using json = nlohmann::ordered_json;

const json kTools = json::parse(R"([
  {"type": "function", "function": {"name": "get_weather"}},
  {"type": "function", "function": {"name": "add"}}])");

// The output fed in pieces of `step` bytes, then finished: the content and the calls it gave,
// each call's pieces joined (`pieces`: how many entries came).
ToolCallParser::Out Feed(ToolCallParser& p, const std::string& text, size_t step,
                         std::vector<std::string>* contents = nullptr, size_t* pieces = nullptr) {
  ToolCallParser::Out all;
  auto take = [&](ToolCallParser::Out o) {
    if (contents != nullptr && !o.content.empty()) contents->push_back(o.content);
    all.content += o.content;
    for (ToolCall& c : o.calls) {
      if (pieces != nullptr) ++*pieces;
      if (c.index == static_cast<int>(all.calls.size())) {
        EXPECT_FALSE(c.id.empty() || c.name.empty()) << "a call's first piece names it";
        all.calls.push_back(c);
      } else {
        ASSERT_EQ(c.index, static_cast<int>(all.calls.size()) - 1) << "pieces of the last call";
        EXPECT_TRUE(c.id.empty() && c.name.empty());
        all.calls.back().arguments += c.arguments;
      }
    }
  };
  for (size_t at = 0; at < text.size(); at += step) take(p.Add(text.substr(at, step)));
  take(p.Finish());
  return all;
}

TEST(ToolCallParser, HermesCallsWhateverTheChunking) {
  const std::string text =
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
      "\"Oslo\", \"when\": {\"day\": 2}}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", "
      "\"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>";
  for (size_t step : {1, 3, 7, 1000}) {
    ToolCallParser p("hermes", kTools, true);
    size_t pieces = 0;
    const ToolCallParser::Out out = Feed(p, text, step, nullptr, &pieces);
    EXPECT_EQ(out.content, "Let me check.\n\n") << step;  // the white space between calls too
    ASSERT_EQ(out.calls.size(), 2u) << step;
    EXPECT_EQ(out.calls[0].index, 0);
    EXPECT_EQ(out.calls[0].name, "get_weather");
    // The arguments as the model wrote them, streamed as they came.
    EXPECT_EQ(out.calls[0].arguments, R"({"city": "Oslo", "when": {"day": 2}})");
    EXPECT_EQ(out.calls[1].index, 1);
    EXPECT_EQ(out.calls[1].arguments, R"({"a": 1, "b": 2})");
    if (step == 1) EXPECT_GT(pieces, 40u);
    EXPECT_EQ(out.calls[0].id.rfind("call_", 0), 0u);
    EXPECT_EQ(out.calls[0].id.size(), 29u);
    EXPECT_NE(out.calls[0].id, out.calls[1].id);
    EXPECT_EQ(p.calls(), 2);
  }
}

// Text is shown as it comes, except what may begin a call's tag.
TEST(ToolCallParser, HermesStreamsTextAndHoldsBackATagsStart) {
  ToolCallParser p("hermes", kTools, true);
  ToolCallParser::Out a = p.Add("Sure <tool");
  EXPECT_EQ(a.content, "Sure ");
  ToolCallParser::Out b = p.Add("box> is a word");
  EXPECT_EQ(b.content, "<toolbox> is a word");
  EXPECT_TRUE(p.Finish().content.empty());
  EXPECT_EQ(p.calls(), 0);
}

// A call that does not parse, or names a function not given, stays text; an unclosed call at the
// end counts when it parses; parallel_tool_calls false keeps the first.
TEST(ToolCallParser, HermesMalformedUnclosedAndSingle) {
  {
    ToolCallParser p("hermes", kTools, true);
    const std::string bad = "<tool_call>{\"name\": \"get_weather\" \"arguments\": {}}</tool_call>";
    ToolCallParser::Out out = Feed(p, bad, 5);
    EXPECT_EQ(out.content, bad);
    EXPECT_TRUE(out.calls.empty());
  }
  {
    // Once announced, a call stays one (its arguments were streamed): cut short, it has what the
    // model wrote, as vLLM's streaming gives it.
    ToolCallParser p("hermes", kTools, true);
    ToolCallParser::Out out =
        Feed(p, "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"ci</tool_call>", 5);
    ASSERT_EQ(out.calls.size(), 1u);
    EXPECT_EQ(out.calls[0].arguments, "{\"ci");
  }
  {
    ToolCallParser p("hermes", kTools, true);
    const std::string other = "<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>";
    ToolCallParser::Out out = Feed(p, other, 4);
    EXPECT_EQ(out.content, other);
    EXPECT_TRUE(out.calls.empty());
  }
  {
    ToolCallParser p("hermes", kTools, true);
    ToolCallParser::Out out =
        Feed(p, "<tool_call>\n{\"name\": \"add\", \"arguments\": \"{\\\"a\\\": 1}\"}\n", 6);
    ASSERT_EQ(out.calls.size(), 1u);  // unclosed, and the arguments a JSON string: whole
    EXPECT_EQ(out.calls[0].arguments, R"({"a":1})");
  }
  {
    ToolCallParser p("hermes", kTools, true);
    ToolCallParser::Out out =  // the keys the other way round: read whole at the closing tag
        Feed(p, "<tool_call>{\"arguments\": {\"a\": [1, \"}\"]}, \"name\": \"add\"}</tool_call>",
             2);
    ASSERT_EQ(out.calls.size(), 1u);
    EXPECT_EQ(out.calls[0].arguments, R"({"a":[1,"}"]})");
  }
  {
    ToolCallParser p("hermes", kTools, true);
    ToolCallParser::Out out =  // unclosed after streamed arguments
        Feed(p, "<tool_call>{\"name\": \"add\", \"arguments\": {\"s\": \"a\\\"}\"}}", 3);
    ASSERT_EQ(out.calls.size(), 1u);
    EXPECT_EQ(out.calls[0].arguments, R"({"s": "a\"}"})");
    EXPECT_EQ(out.content, "");
  }
  {
    ToolCallParser p("hermes", kTools, false);
    ToolCallParser::Out out =
        Feed(p,
             "<tool_call>{\"name\": \"add\", \"arguments\": {}}</tool_call><tool_call>{\"name\": "
             "\"get_weather\", \"arguments\": {}}</tool_call>",
             9);
    ASSERT_EQ(out.calls.size(), 1u);
    EXPECT_EQ(out.calls[0].name, "add");
  }
}

TEST(ToolCallParser, Llama3JsonOutputIsCallsOrText) {
  {
    ToolCallParser p("llama3_json", kTools, true);
    ToolCallParser::Out out = Feed(
        p,
        " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"a;b\"}}; {\"name\": \"add\", "
        "\"parameters\": {\"a\": 1}}",
        4);
    EXPECT_EQ(out.content, "");
    ASSERT_EQ(out.calls.size(), 2u);
    EXPECT_EQ(out.calls[0].arguments, R"({"city":"a;b"})");
    EXPECT_EQ(out.calls[1].name, "add");
  }
  {
    ToolCallParser p("llama3_json", kTools, true);
    std::vector<std::string> pieces;
    ToolCallParser::Out out = Feed(p, "The weather is {fine}.", 3, &pieces);
    EXPECT_EQ(out.content, "The weather is {fine}.");
    EXPECT_GT(pieces.size(), 3u);  // streamed as it came
    EXPECT_TRUE(out.calls.empty());
  }
  {
    ToolCallParser p("llama3_json", kTools, true);
    ToolCallParser::Out out = Feed(p, "{\"name\": \"add\", \"parameters\": {}} and more", 5);
    EXPECT_EQ(out.content, "{\"name\": \"add\", \"parameters\": {}} and more");
    EXPECT_TRUE(out.calls.empty());
    EXPECT_EQ(p.calls(), 0);
  }
}

// Pythonic calls (Llama 3.2 / 4): an output that is a Python list of calls, its arguments Python
// literals turned into JSON; anything else, or a list that is not all calls, stays text.
TEST(ToolCallParser, PythonicListOfCalls) {
  for (size_t step : {1, 3, 100}) {
    ToolCallParser p("pythonic", kTools, true);
    ToolCallParser::Out out =
        Feed(p,
             "[get_weather(city='Oslo, \\'N\\'', days=3, metric=True, extra=None), "
             "add(a=-1.5e2, b=[1, (2, 3)], c={'k': \"v\"},)]",
             step);
    EXPECT_EQ(out.content, "") << step;
    ASSERT_EQ(out.calls.size(), 2u) << step;
    EXPECT_EQ(out.calls[0].name, "get_weather");
    EXPECT_EQ(out.calls[0].arguments,
              R"({"city":"Oslo, 'N'","days":3,"metric":true,"extra":null})");
    EXPECT_EQ(out.calls[1].arguments, R"({"a":-150.0,"b":[1,[2,3]],"c":{"k":"v"}})");
  }
  for (const char* text :
       {"[get_weather(city='Oslo')] and more", "[unknown_fn()]", "[get_weather(city=os.getcwd())]",
        "[get_weather('Oslo')]", "The list [1, 2] is short.", "[get_weather(city='Oslo'"}) {
    ToolCallParser p("pythonic", kTools, true);
    ToolCallParser::Out out = Feed(p, text, 4);
    EXPECT_EQ(out.content, text);
    EXPECT_TRUE(out.calls.empty()) << text;
  }
  ToolCallParser one("pythonic", kTools, false);  // parallel_tool_calls false: the first only
  EXPECT_EQ(Feed(one, "[add(a=1), add(a=2)]", 2).calls.size(), 1u);
}

// Qwen3-Coder's XML calls: text, then <tool_call> blocks, each value typed by the function's
// schema (a string parameter stays text, others are JSON).
TEST(ToolCallParser, Qwen3CoderXmlCalls) {
  const json tools = json::parse(R"([{"type": "function", "function": {"name": "get_weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"},
        "days": {"type": "integer"}, "opts": {"type": "object"}}}}}])");
  for (size_t step : {1, 7, 1000}) {
    ToolCallParser p("qwen3_coder", tools, true);
    ToolCallParser::Out out =
        Feed(p,
             "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n"
             "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"x\": [1]}\n"
             "</parameter>\n</function>\n</tool_call>",
             step);
    EXPECT_EQ(out.content, "Let me check.\n") << step;
    ASSERT_EQ(out.calls.size(), 1u) << step;
    EXPECT_EQ(out.calls[0].name, "get_weather");
    EXPECT_EQ(out.calls[0].arguments, R"({"city":"42","days":3,"opts":{"x":[1]}})");
  }
  ToolCallParser p("qwen3_coder", tools, true);
  const std::string unknown =
      "<tool_call>\n<function=rm_rf>\n<parameter=path>\n/\n</parameter>\n</function>\n"
      "</tool_call>";
  ToolCallParser::Out out = Feed(p, unknown, 5);
  EXPECT_EQ(out.content, unknown);  // a function not given stays text
  EXPECT_TRUE(out.calls.empty());
}

// Mistral's format: text streamed up to the [TOOL_CALLS] marker (its start held back), then a
// JSON list of calls read whole at the end; a list that is not calls stays text, marker and all.
TEST(ToolCallParser, MistralListAfterTheMarker) {
  const std::string text =
      "Checking.[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}, "
      "\"id\": \"abc123def\"}, {\"name\": \"add\", \"arguments\": {\"a\": 1}}]";
  for (size_t step : {1, 4, 1000}) {
    ToolCallParser p("mistral", kTools, true);
    std::vector<std::string> pieces;
    const ToolCallParser::Out out = Feed(p, text, step, &pieces);
    EXPECT_EQ(out.content, "Checking.") << step;
    ASSERT_EQ(out.calls.size(), 2u) << step;
    EXPECT_EQ(out.calls[0].name, "get_weather");
    EXPECT_EQ(out.calls[0].arguments, R"({"city":"Oslo"})");
    EXPECT_EQ(out.calls[1].name, "add");
    if (step == 1) EXPECT_GT(pieces.size(), 5u);  // the text before the marker streamed
  }
  ToolCallParser one("mistral", kTools, false);  // parallel_tool_calls false: the first only
  EXPECT_EQ(Feed(one, text, 7).calls.size(), 1u);
  ToolCallParser bad("mistral", kTools, true);
  const std::string broken = "Hm [TOOL_CALLS] [{\"name\": \"nope\", \"arguments\": {}}]";
  const ToolCallParser::Out out = Feed(bad, broken, 3);
  EXPECT_EQ(out.content, broken);
  EXPECT_TRUE(out.calls.empty());
  ToolCallParser plain("mistral", kTools, true);
  EXPECT_EQ(Feed(plain, "[TOOL_CALLS is not the marker]", 2).content,
            "[TOOL_CALLS is not the marker]");
}

// Sections of calls: DeepSeek-V3's (the type, then the name and a ```json fence), V3.1's (name,
// separator, arguments) and Kimi K2's (functions.NAME:INDEX); text before the section streams,
// each call is announced once its arguments begin and they stream as written, and a call that
// does not have that shape, or names a function not given, stays text.
TEST(ToolCallParser, SectionsOfCalls) {
  const std::string v3 =
      "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
      "```json\n{\"city\": \"Oslo\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function"
      "<｜tool▁sep｜>add\n```json\n{\"a\": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
  const std::string v31 =
      "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
      "{\"city\": \"Oslo\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": 1}"
      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
  const std::string kimi =
      "Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
      "<|tool_call_argument_begin|>{\"city\": \"Oslo\"}<|tool_call_end|><|tool_call_begin|>"
      "functions.add:1<|tool_call_argument_begin|>{\"a\": 1}<|tool_call_end|>"
      "<|tool_calls_section_end|>";
  for (const auto& [format, text] : std::vector<std::pair<std::string, std::string>>{
           {"deepseek_v3", v3}, {"deepseek_v31", v31}, {"deepseek_v3", v31}, {"kimi_k2", kimi}}) {
    for (size_t step : {1, 5, 1000}) {
      ToolCallParser p(format, kTools, true);
      const ToolCallParser::Out out = Feed(p, text, step);
      EXPECT_EQ(out.content, "Let me look.") << format << " " << step;
      ASSERT_EQ(out.calls.size(), 2u) << format << " " << step;
      EXPECT_EQ(out.calls[0].name, "get_weather");
      EXPECT_EQ(out.calls[0].arguments, R"({"city": "Oslo"})") << "as written, streamed";
      EXPECT_EQ(out.calls[1].name, "add");
      EXPECT_EQ(out.calls[1].arguments, R"({"a": 1})");
    }
    // A call is announced once its arguments begin, which then stream.
    ToolCallParser p(format, kTools, true);
    const size_t args = text.find("{\"city");
    const ToolCallParser::Out early = p.Add(text.substr(0, args + 4));
    ASSERT_EQ(early.calls.size(), 2u) << format;
    EXPECT_EQ(early.calls[0].name, "get_weather");
    EXPECT_EQ(early.calls[1].arguments, "{\"ci");
  }
  ToolCallParser bad("deepseek_v31", kTools, true);
  const std::string unknown =
      "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>rm_rf<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
      "<｜tool▁calls▁end｜>";
  const ToolCallParser::Out out = Feed(bad, unknown, 3);
  EXPECT_EQ(out.content, "<｜tool▁call▁begin｜>rm_rf<｜tool▁sep｜>{}<｜tool▁call▁end｜>");
  EXPECT_TRUE(out.calls.empty());
  // Cut off in its arguments (max_tokens): announced, what came of them given (as Hermes').
  ToolCallParser broken("kimi_k2", kTools, true);
  const ToolCallParser::Out cut =
      Feed(broken,
           "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0"
           "<|tool_call_argument_begin|>{\"a\": ",
           4);
  ASSERT_EQ(cut.calls.size(), 1u);
  EXPECT_EQ(cut.calls[0].name, "add");
  EXPECT_EQ(cut.calls[0].arguments, "{\"a\": ");
  EXPECT_EQ(cut.content, "");
  // Cut off before its arguments: no call, the text stays.
  ToolCallParser early("kimi_k2", kTools, true);
  EXPECT_EQ(Feed(early, "<|tool_calls_section_begin|><|tool_call_begin|>functions.ad", 3).content,
            "<|tool_call_begin|>functions.ad");
}

}  // namespace
}  // namespace shardserve
