#include "serve/responses.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "serve/openai.h"

namespace shardserve {
namespace {

using ojson = nlohmann::ordered_json;
using json = nlohmann::json;
using ::testing::HasSubstr;

// A Responses request is the chat it stands for: instructions first, a call and its output the
// assistant's tool_calls and a tool message, reasoning given back to the next assistant turn,
// flat function tools nested as the chat's, text.format as response_format.
TEST(ResponsesToChat, ItemsBecomeTheChat) {
  auto chat = ResponsesToChat(ojson::parse(R"({
    "model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "stream": true,
    "input": [
      {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
      {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]},
      {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
      {"type": "function_call", "call_id": "c2", "name": "get", "arguments": "{\"a\": 1}"},
      {"type": "function_call_output", "call_id": "c1", "output": "3"},
      {"type": "message", "role": "developer", "content": "Use metric."}],
    "tools": [{"type": "function", "name": "get", "parameters": {"type": "object"},
               "strict": null}],
    "tool_choice": {"type": "function", "name": "get"},
    "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    "reasoning": {"effort": "low"}})"));
  ASSERT_TRUE(chat.ok()) << chat.status();
  const ojson& m = (*chat)["messages"];
  ASSERT_EQ(m.size(), 5u) << chat->dump();
  EXPECT_EQ(m[0], ojson::parse(R"({"role": "system", "content": "Be brief."})"));
  EXPECT_EQ(m[1]["content"][0]["text"], "Weather?");
  EXPECT_EQ(m[2]["role"], "assistant");
  EXPECT_EQ(m[2]["reasoning_content"], "Hm.");
  ASSERT_EQ(m[2]["tool_calls"].size(), 2u) << "parallel calls: one assistant turn";
  EXPECT_EQ(m[2]["tool_calls"][1]["function"]["arguments"], "{\"a\": 1}");
  EXPECT_EQ(m[3], ojson::parse(R"({"role": "tool", "tool_call_id": "c1", "content": "3"})"));
  EXPECT_EQ(m[4]["role"], "developer");
  EXPECT_EQ((*chat)["tools"][0], ojson::parse(R"({"type": "function", "function": {
      "name": "get", "parameters": {"type": "object"}}})"));
  EXPECT_EQ((*chat)["tool_choice"]["function"]["name"], "get");
  EXPECT_EQ((*chat)["response_format"]["json_schema"]["name"], "x");
  EXPECT_EQ((*chat)["chat_template_kwargs"]["reasoning_effort"], "low");
  EXPECT_EQ((*chat)["max_tokens"], 9);
  EXPECT_EQ((*chat)["stream_options"]["include_usage"], true);
  EXPECT_TRUE(ParseApiRequest(*chat, true).ok()) << "the chat's own parser takes it";
}

TEST(ResponsesToChat, WhatIsNotServedIsRefusedByName) {
  for (const auto& [body, param] : std::vector<std::pair<std::string, std::string>>{
           {R"({"input": "x", "store": true})", "store"},
           {R"({"input": "x", "previous_response_id": "resp_1"})", "previous_response_id"},
           {R"({"input": "x", "background": true})", "background"},
           {R"({"input": "x", "include": ["reasoning.encrypted_content"]})", "include"},
           {R"({"input": "x", "truncation": "auto"})", "truncation"},
           {R"({"input": "x", "tools": [{"type": "web_search"}]})", "tools[0].type"},
           {R"({"input": "x", "tools": [{"type": 5}]})", "tools[0].type"},
           {R"({"input": "x", "tool_choice": {"type": 5}})", "tool_choice"},
           {R"({"input": "x", "text": {"verbosity": "low"}})", "text.verbosity"},
           {R"({"input": "x", "reasoning": {"summary": "auto"}})", "reasoning.summary"},
           {R"({"input": [{"type": "item_reference", "id": "x"}]})", "input[0].type"},
           {R"({"input": [{"role": "user", "content": [{"type": "input_image"}]}]})",
            "input[0].content[0]"},
           {R"({"input": [{"type": "reasoning", "encrypted_content": "zz"}]})",
            "input[0].encrypted_content"},
           {R"({"input": []})", "input"},
           {R"({"model": "m"})", "input"},
           {R"({"input": "x", "max_tool_calls": 3})", "max_tool_calls"}}) {
    auto chat = ResponsesToChat(ojson::parse(body));
    ASSERT_FALSE(chat.ok()) << body;
    EXPECT_EQ(ErrorParam(chat.status()), param) << body << ": " << chat.status();
  }
}

// The answer's pieces as items and typed events: a reasoning item, then a message, then a call;
// each opened, its deltas, closed in order; numbered from 0; incomplete at max tokens.
TEST(ResponseBuilder, ItemsAndEventsInOrder) {
  ResponseBuilder b(ojson::parse(R"({"input": "x", "metadata": {"k": "v"}})"), "resp_1", 7, "m");
  std::vector<json> events = b.Start();
  auto add = [&](std::vector<json> more) { events.insert(events.end(), more.begin(), more.end()); };
  add(b.Add("Think", "", {}));
  add(b.Add("ing.", "Hel", {}));
  add(b.Add("", "lo", {}));
  add(b.Add("", "", {{0, "call_1", "get", "{\"a\""}}));
  add(b.Add("", "", {{0, "", "", ": 1}"}}));
  add(b.Finish("length", {{"prompt_tokens", 5}, {"completion_tokens", 6}}));
  std::vector<std::string> types;
  for (size_t i = 0; i < events.size(); ++i) {
    EXPECT_EQ(events[i]["sequence_number"], i);
    types.push_back(events[i]["type"]);
  }
  EXPECT_THAT(
      types,
      ::testing::ElementsAre(
          "response.created", "response.in_progress", "response.output_item.added",
          "response.reasoning_text.delta", "response.reasoning_text.delta",
          "response.reasoning_text.done", "response.output_item.done", "response.output_item.added",
          "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
          "response.output_text.done", "response.content_part.done", "response.output_item.done",
          "response.output_item.added", "response.function_call_arguments.delta",
          "response.function_call_arguments.delta", "response.function_call_arguments.done",
          "response.output_item.done", "response.incomplete"));
  const json r = b.Response();
  EXPECT_EQ(r["status"], "incomplete");
  EXPECT_EQ(r["incomplete_details"]["reason"], "max_output_tokens");
  EXPECT_EQ(r["output"][0]["content"][0]["text"], "Thinking.");
  EXPECT_EQ(r["output"][1]["content"][0]["text"], "Hello");
  EXPECT_EQ(r["output"][2]["call_id"], "call_1");
  EXPECT_EQ(r["output"][2]["arguments"], "{\"a\": 1}");
  EXPECT_EQ(r["usage"]["input_tokens"], 5);
  EXPECT_EQ(r["usage"]["total_tokens"], 11);
  EXPECT_EQ(r["metadata"]["k"], "v");
  EXPECT_EQ(r["store"], false);
}

}  // namespace
}  // namespace shardserve
