#pragma once
// OpenAI's Responses API (POST /v1/responses), the part vLLM serves and the Agents SDK sends by
// default, over our chat completions: a request is read as the chat request it stands for
// (ResponsesToChat), and the chat's answer (reasoning, text, tool calls, whole or streamed) is
// written back as a response's output items and, streamed, as its typed events
// (ResponseBuilder). Nothing is stored: `store` true, `previous_response_id`, `conversation`
// and `background` are refused by name, as is any field we do not serve.
//
//   input                 text (one user message) or items: messages (roles user, system,
//                         developer, assistant; text or input_text / output_text parts),
//                         function_call (an assistant's call), function_call_output (the
//                         tool's answer), reasoning (given back to the next assistant turn as
//                         reasoning_content)
//   instructions          a system message first
//   tools, tool_choice    function tools ({type, name, description, parameters, strict}) as the
//                         chat's; the built-in tools (web search, files, ...) refused
//   text.format           text, json_object, json_schema {name, schema, strict}
//   reasoning.effort      the template's reasoning_effort variable (gpt-oss reads it)
//   max_output_tokens, temperature, top_p, parallel_tool_calls, stream, metadata, user
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "serve/tool_calls.h"

namespace shardserve {

// The chat completions body `body` stands for; InvalidArgument naming the field we do not serve
// (param: the Responses field).
absl::StatusOr<nlohmann::ordered_json> ResponsesToChat(const nlohmann::ordered_json& body);

// A response built as the chat's answer comes: its output items in order (reasoning, a message,
// function calls) and, for a stream, the events OpenAI's clients read, numbered in order.
class ResponseBuilder {
 public:
  // `request`: the Responses body (its settings are echoed in the response object).
  ResponseBuilder(const nlohmann::ordered_json& request, std::string id, int64_t created,
                  std::string model);

  // response.created and response.in_progress.
  std::vector<nlohmann::json> Start();
  // The events of one piece of the answer (each call's pieces as ToolCallParser gives them).
  std::vector<nlohmann::json> Add(const std::string& reasoning, const std::string& text,
                                  const std::vector<ToolCall>& calls);
  // Closes what is open; response.completed (response.incomplete when the answer ran out of
  // max_output_tokens). `usage`: the chat's.
  std::vector<nlohmann::json> Finish(const std::string& finish_reason, const nlohmann::json& usage);
  // The response object as it stands (whole after Finish).
  nlohmann::json Response() const;

 private:
  nlohmann::json Event(const std::string& type, nlohmann::json fields);
  // Closes the open item (its done events) before another kind begins.
  void Close(std::vector<nlohmann::json>& events);

  nlohmann::ordered_json request_;
  std::string id_, model_;
  int64_t created_;
  int sequence_ = 0;
  std::string status_ = "in_progress";
  nlohmann::json incomplete_ = nullptr, usage_ = nullptr;
  nlohmann::json output_ = nlohmann::json::array();  // the items, the open one last
  enum class Open { kNone, kReasoning, kMessage, kCall } open_ = Open::kNone;
  std::string text_;  // the open item's text (a reasoning's, a message's, a call's arguments)
  int call_index_ = -1;
};

}  // namespace shardserve
