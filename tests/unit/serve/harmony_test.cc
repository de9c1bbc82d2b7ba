#include "serve/harmony.h"

#include <gtest/gtest.h>

#include <string>

namespace shardserve {
namespace {

using json = nlohmann::ordered_json;

const json kTools = json::parse(R"([{"type": "function", "function": {"name": "get_weather"}}])");

// The output fed in pieces of `step` bytes, then finished; each call's pieces joined (its first
// names it).
HarmonyParser::Out Feed(HarmonyParser& p, const std::string& text, size_t step) {
  HarmonyParser::Out all;
  auto take = [&](HarmonyParser::Out o) {
    all.reasoning += o.reasoning;
    all.content += o.content;
    for (ToolCall& c : o.calls) {
      if (c.index == static_cast<int>(all.calls.size())) {
        EXPECT_FALSE(c.id.empty() || c.name.empty());
        all.calls.push_back(c);
      } else {
        ASSERT_FALSE(all.calls.empty());
        all.calls.back().arguments += c.arguments;
      }
    }
  };
  for (size_t at = 0; at < text.size(); at += step) take(p.Add(text.substr(at, step)));
  take(p.Finish());
  return all;
}

// gpt-oss's messages: the analysis channel is reasoning, the final channel content, a
// commentary message to a function a call (its recipient before or after the channel), a
// commentary message to nobody a preamble (content); the stop tokens never appear in the text.
TEST(HarmonyParser, ChannelsAndCalls) {
  for (size_t step : {1, 3, 1000}) {
    HarmonyParser answer(kTools, true);
    HarmonyParser::Out out = Feed(answer,
                                  "<|channel|>analysis<|message|>User wants a < b.<|end|>"
                                  "<|start|>assistant<|channel|>final<|message|>Yes, a < b.",
                                  step);
    EXPECT_EQ(out.reasoning, "User wants a < b.") << step;
    EXPECT_EQ(out.content, "Yes, a < b.") << step;
    EXPECT_TRUE(out.calls.empty());

    for (const std::string header :
         {"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
          "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"}) {
      HarmonyParser call(kTools, true);
      out = Feed(
          call,
          "<|channel|>analysis<|message|>Need weather.<|end|>" + header + "{\"city\": \"Oslo\"}",
          step);
      EXPECT_EQ(out.reasoning, "Need weather.") << step;
      EXPECT_EQ(out.content, "");
      ASSERT_EQ(out.calls.size(), 1u) << header << " " << step;
      EXPECT_EQ(out.calls[0].name, "get_weather");
      EXPECT_EQ(out.calls[0].arguments, R"({"city": "Oslo"})") << "as written, streamed";
      EXPECT_EQ(call.calls(), 1);
    }

    HarmonyParser preamble(kTools, true);
    out = Feed(preamble,
               "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>"
               "commentary to=functions.rm_rf <|constrain|>json<|message|>{}",
               step);
    EXPECT_EQ(out.content, "Checking.{}") << "a function not given: text";
    EXPECT_TRUE(out.calls.empty());
  }
  // An output that never opens a message is its answer; a body ending mid-marker keeps the text.
  HarmonyParser plain(kTools, true);
  EXPECT_EQ(Feed(plain, "Just words <| here", 2).content, "Just words <| here");
  // A call is announced with its header, before its arguments.
  HarmonyParser announced(kTools, true);
  HarmonyParser::Out first =
      announced.Add("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>");
  ASSERT_EQ(first.calls.size(), 1u);
  EXPECT_EQ(first.calls[0].name, "get_weather");
  EXPECT_EQ(announced.Add("{\"ci").calls[0].arguments, "{\"ci");
  HarmonyParser streamed(kTools, true);
  EXPECT_EQ(streamed.Add("<|channel|>final<|message|>Hel").content, "Hel");
  EXPECT_EQ(streamed.Add("lo<|e").content, "lo") << "the start of a terminator is held back";
  EXPECT_EQ(streamed.Add("nd|>").content, "");
}

}  // namespace
}  // namespace shardserve
