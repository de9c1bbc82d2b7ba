#include "serve/responses.h"

#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "serve/openai.h"

namespace shardserve {
namespace {

using ojson = nlohmann::ordered_json;
using json = nlohmann::json;

// The Responses fields we read; any other is refused by name.
constexpr std::string_view kFields[] = {"model",
                                        "input",
                                        "instructions",
                                        "tools",
                                        "tool_choice",
                                        "text",
                                        "reasoning",
                                        "max_output_tokens",
                                        "temperature",
                                        "top_p",
                                        "stream",
                                        "metadata",
                                        "user",
                                        "store",
                                        "previous_response_id",
                                        "conversation",
                                        "background",
                                        "include",
                                        "truncation",
                                        "service_tier",
                                        "parallel_tool_calls"};

bool Given(const ojson& body, const char* key) {
  return body.contains(key) && !body[key].is_null();
}

// A member that is a string, else "" (the client's types are never trusted).
std::string StringAt(const ojson& object, const char* key) {
  return object.is_object() && object.contains(key) && object[key].is_string()
             ? object[key].get<std::string>()
             : "";
}

// A list of text parts (input_text, output_text, refusal) or a string, as the chat's content.
absl::StatusOr<ojson> Content(const ojson& content, const std::string& param) {
  if (content.is_string()) return content;
  if (!content.is_array()) {
    return BadParam(param, absl::StrCat("'", param, "' must be a string or a list of parts"));
  }
  ojson parts = ojson::array();
  for (size_t i = 0; i < content.size(); ++i) {
    const ojson& part = content[i];
    const std::string type = StringAt(part, "type");
    if (type != "input_text" && type != "output_text" && type != "text" && type != "refusal") {
      return BadParam(absl::StrCat(param, "[", i, "]"),
                      absl::StrCat("'", param, "[", i, "]' is a '", type,
                                   "' part; this model reads text (input_text, output_text)"));
    }
    const char* key = type == "refusal" ? "refusal" : "text";
    if (!part.contains(key) || !part[key].is_string()) {
      return BadParam(absl::StrCat(param, "[", i, "]"),
                      absl::StrCat("'", param, "[", i, "].", key, "' must be a string"));
    }
    parts.push_back({{"type", "text"}, {"text", part[key]}});
  }
  return parts;
}

// The text of a reasoning item given back: its content's texts, else its summary's.
std::string ReasoningText(const ojson& item) {
  std::vector<std::string> texts;
  for (const char* key : {"content", "summary"}) {
    if (!item.contains(key) || !item[key].is_array()) continue;
    for (const ojson& part : item[key]) {
      if (part.is_object() && part.contains("text") && part["text"].is_string()) {
        texts.push_back(part["text"].get<std::string>());
      }
    }
    if (!texts.empty()) break;
  }
  return absl::StrJoin(texts, "\n");
}

// `input` (text, or a list of items) as chat messages after `messages`' own.
absl::Status Input(const ojson& input, ojson& messages) {
  if (input.is_string()) {
    messages.push_back({{"role", "user"}, {"content", input}});
    return absl::OkStatus();
  }
  if (!input.is_array() || input.empty()) {
    return BadParam("input", "'input' must be a string or a non-empty list of items");
  }
  ojson reasoning = nullptr;  // a reasoning item's text, for the assistant turn that follows
  auto assistant_turn = [&]() -> ojson& {
    if (messages.empty() || messages.back()["role"] != "assistant") {
      messages.push_back({{"role", "assistant"}, {"content", nullptr}});
    }
    ojson& turn = messages.back();
    if (!reasoning.is_null()) {
      turn["reasoning_content"] = reasoning;
      reasoning = nullptr;
    }
    return turn;
  };
  for (size_t i = 0; i < input.size(); ++i) {
    const ojson& item = input[i];
    const std::string param = absl::StrCat("input[", i, "]");
    if (!item.is_object()) return BadParam(param, absl::StrCat("'", param, "' must be an object"));
    const std::string type = item.contains("type") && item["type"].is_string()
                                 ? item["type"].get<std::string>()
                                 : (item.contains("role") ? "message" : "");
    if (type == "message") {
      if (!item.contains("role") || !item["role"].is_string()) {
        return BadParam(param + ".role", absl::StrCat("'", param, ".role' must be a string"));
      }
      const std::string role = item["role"].get<std::string>();
      if (role != "user" && role != "system" && role != "developer" && role != "assistant") {
        return BadParam(param + ".role",
                        absl::StrCat("'", param, ".role' is '", role,
                                     "'; a message is user, system, developer or assistant"));
      }
      if (!item.contains("content")) {
        return BadParam(param + ".content", absl::StrCat("'", param, ".content' is required"));
      }
      ASSIGN_OR_RETURN(ojson content, Content(item["content"], param + ".content"));
      if (role == "assistant") {
        ojson& turn = assistant_turn();
        if (!turn["content"].is_null() || turn.contains("tool_calls")) {
          messages.push_back({{"role", "assistant"}, {"content", nullptr}});
        }
        messages.back()["content"] = std::move(content);
      } else {
        messages.push_back({{"role", role}, {"content", std::move(content)}});
      }
    } else if (type == "function_call") {
      for (const char* key : {"call_id", "name", "arguments"}) {
        if (!item.contains(key) || !item[key].is_string()) {
          return BadParam(absl::StrCat(param, ".", key),
                          absl::StrCat("'", param, ".", key, "' must be a string"));
        }
      }
      ojson& turn = assistant_turn();
      if (!turn.contains("tool_calls")) turn["tool_calls"] = ojson::array();
      turn["tool_calls"].push_back(
          {{"id", item["call_id"]},
           {"type", "function"},
           {"function", {{"name", item["name"]}, {"arguments", item["arguments"]}}}});
    } else if (type == "function_call_output") {
      if (!item.contains("call_id") || !item["call_id"].is_string()) {
        return BadParam(param + ".call_id",
                        absl::StrCat("'", param, ".call_id' must be a string naming the call"));
      }
      if (!item.contains("output")) {
        return BadParam(param + ".output", absl::StrCat("'", param, ".output' is required"));
      }
      ASSIGN_OR_RETURN(ojson output, Content(item["output"], param + ".output"));
      messages.push_back(
          {{"role", "tool"}, {"tool_call_id", item["call_id"]}, {"content", std::move(output)}});
    } else if (type == "reasoning") {
      if (Given(item, "encrypted_content")) {
        return BadParam(param + ".encrypted_content",
                        absl::StrCat("'", param,
                                     ".encrypted_content' is not supported: give the reasoning "
                                     "as its content"));
      }
      reasoning = ReasoningText(item);
    } else {
      return BadParam(param + ".type",
                      absl::StrCat("'", param, ".type' '", type,
                                   "' is not served (message, function_call, "
                                   "function_call_output, reasoning; nothing is stored to "
                                   "reference)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ojson> ResponsesToChat(const ojson& body) {
  if (!body.is_object()) return BadParam("", "the request body must be a JSON object");
  for (const auto& [key, value] : body.items()) {
    if (std::find(std::begin(kFields), std::end(kFields), key) == std::end(kFields)) {
      return BadParam(key, absl::StrCat("'", key, "' is not a Responses field shardserve serves"));
    }
  }
  // Nothing is stored: what needs a stored response is refused.
  if (body.contains("store") && body["store"] != false && !body["store"].is_null()) {
    return BadParam("store", "'store' true is not supported: responses are not stored");
  }
  for (const char* key : {"previous_response_id", "conversation"}) {
    if (Given(body, key)) {
      return BadParam(key, absl::StrCat("'", key,
                                        "' is not supported: responses are not stored; send the "
                                        "conversation in 'input'"));
    }
  }
  if (Given(body, "background") && body["background"] != false) {
    return BadParam("background", "'background' true is not supported: responses are not stored");
  }
  if (Given(body, "include") && !(body["include"].is_array() && body["include"].empty())) {
    return BadParam("include", "'include' is not supported (no item carries more than it has)");
  }
  if (Given(body, "truncation") && body["truncation"] != "disabled") {
    return BadParam("truncation",
                    "'truncation' must be \"disabled\": a prompt longer than the context is "
                    "refused, never cut");
  }
  if (Given(body, "service_tier") && body["service_tier"] != "auto" &&
      body["service_tier"] != "default") {
    return BadParam("service_tier", "'service_tier' must be \"auto\" or \"default\"");
  }

  ojson chat = ojson::object();
  if (body.contains("model")) chat["model"] = body["model"];
  ojson messages = ojson::array();
  if (Given(body, "instructions")) {
    if (!body["instructions"].is_string()) {
      return BadParam("instructions", "'instructions' must be a string");
    }
    messages.push_back({{"role", "system"}, {"content", body["instructions"]}});
  }
  if (!body.contains("input")) return BadParam("input", "'input' is required");
  RETURN_IF_ERROR(Input(body["input"], messages));
  chat["messages"] = std::move(messages);

  if (Given(body, "tools")) {
    if (!body["tools"].is_array()) return BadParam("tools", "'tools' must be a list");
    ojson tools = ojson::array();
    for (size_t i = 0; i < body["tools"].size(); ++i) {
      const ojson& t = body["tools"][i];
      const std::string param = absl::StrCat("tools[", i, "]");
      if (StringAt(t, "type") != "function") {
        return BadParam(param + ".type",
                        absl::StrCat("'", param,
                                     ".type' must be \"function\": built-in tools (web search, "
                                     "file search, computer use, MCP, ...) are not served"));
      }
      ojson fn = ojson::object();
      for (const auto& [key, value] : t.items()) {
        if (key == "type") continue;
        if (key != "name" && key != "description" && key != "parameters" && key != "strict") {
          return BadParam(absl::StrCat(param, ".", key),
                          absl::StrCat("'", param, ".", key, "' is not a function tool's field"));
        }
        if (!value.is_null()) fn[key] = value;
      }
      tools.push_back({{"type", "function"}, {"function", std::move(fn)}});
    }
    chat["tools"] = std::move(tools);
  }
  if (Given(body, "tool_choice")) {
    const ojson& choice = body["tool_choice"];
    if (choice.is_object()) {
      if (StringAt(choice, "type") != "function" || !choice.contains("name")) {
        return BadParam("tool_choice",
                        "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                        "{\"type\": \"function\", \"name\": ...}");
      }
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", choice["name"]}}}};
    } else {
      chat["tool_choice"] = choice;  // the chat's parser names what is wrong
    }
  }
  if (Given(body, "parallel_tool_calls")) chat["parallel_tool_calls"] = body["parallel_tool_calls"];

  if (Given(body, "text")) {
    const ojson& text = body["text"];
    if (!text.is_object()) return BadParam("text", "'text' must be an object");
    for (const auto& [key, value] : text.items()) {
      if (key != "format" && !value.is_null()) {
        return BadParam(absl::StrCat("text.", key),
                        absl::StrCat("'text.", key, "' is not supported"));
      }
    }
    if (Given(text, "format")) {
      const ojson& format = text["format"];
      const std::string type = StringAt(format, "type");
      if (type == "json_object") {
        chat["response_format"] = {{"type", "json_object"}};
      } else if (type == "json_schema") {
        ojson schema = ojson::object();
        for (const char* key : {"name", "schema", "strict", "description"}) {
          if (format.contains(key)) schema[key] = format[key];
        }
        chat["response_format"] = {{"type", "json_schema"}, {"json_schema", std::move(schema)}};
      } else if (type != "text") {
        return BadParam("text.format",
                        "'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} "
                        "or {\"type\": \"json_schema\", ...}");
      }
    }
  }
  if (Given(body, "reasoning")) {
    const ojson& reasoning = body["reasoning"];
    if (!reasoning.is_object()) return BadParam("reasoning", "'reasoning' must be an object");
    for (const auto& [key, value] : reasoning.items()) {
      if (value.is_null()) continue;
      if (key != "effort") {
        return BadParam(
            absl::StrCat("reasoning.", key),
            absl::StrCat("'reasoning.", key, "' is not supported (no summaries are written)"));
      }
      // The template's own variable (gpt-oss's); one that does not read it refuses it by name.
      chat["chat_template_kwargs"] = {{"reasoning_effort", value}};
    }
  }
  for (const auto& [from, to] :
       {std::pair{"max_output_tokens", "max_tokens"}, std::pair{"temperature", "temperature"},
        std::pair{"top_p", "top_p"}, std::pair{"user", "user"}}) {
    if (Given(body, from)) chat[to] = body[from];
  }
  if (Given(body, "stream") && body["stream"] == true) {
    chat["stream"] = true;
    chat["stream_options"] = {{"include_usage", true}};
  }
  return chat;
}

ResponseBuilder::ResponseBuilder(const ojson& request, std::string id, int64_t created,
                                 std::string model)
    : request_(request), id_(std::move(id)), model_(std::move(model)), created_(created) {}

json ResponseBuilder::Response() const {
  auto echo = [&](const char* key, json fallback) {
    return request_.contains(key) && !request_[key].is_null() ? json::parse(request_[key].dump())
                                                              : fallback;
  };
  return {{"id", id_},
          {"object", "response"},
          {"created_at", created_},
          {"status", status_},
          {"error", nullptr},
          {"incomplete_details", incomplete_},
          {"instructions", echo("instructions", nullptr)},
          {"max_output_tokens", echo("max_output_tokens", nullptr)},
          {"metadata", echo("metadata", json::object())},
          {"model", model_},
          {"output", output_},
          {"parallel_tool_calls", echo("parallel_tool_calls", true)},
          {"previous_response_id", nullptr},
          {"reasoning", echo("reasoning", json{{"effort", nullptr}, {"summary", nullptr}})},
          {"store", false},
          {"temperature", echo("temperature", 1.0)},
          {"text", echo("text", json{{"format", {{"type", "text"}}}})},
          {"tool_choice", echo("tool_choice", "auto")},
          {"tools", echo("tools", json::array())},
          {"top_p", echo("top_p", 1.0)},
          {"truncation", "disabled"},
          {"usage", usage_}};
}

json ResponseBuilder::Event(const std::string& type, json fields) {
  fields["type"] = type;
  fields["sequence_number"] = sequence_++;
  return fields;
}

std::vector<json> ResponseBuilder::Start() {
  std::vector<json> events;
  events.push_back(Event("response.created", {{"response", Response()}}));
  events.push_back(Event("response.in_progress", {{"response", Response()}}));
  return events;
}

void ResponseBuilder::Close(std::vector<json>& events) {
  if (open_ == Open::kNone) return;
  const int index = static_cast<int>(output_.size()) - 1;
  json& item = output_.back();
  const std::string item_id = item["id"];
  if (open_ == Open::kReasoning) {
    events.push_back(Event(
        "response.reasoning_text.done",
        {{"item_id", item_id}, {"output_index", index}, {"content_index", 0}, {"text", text_}}));
    item["content"] = json::array({{{"type", "reasoning_text"}, {"text", text_}}});
  } else if (open_ == Open::kMessage) {
    const json part = {{"type", "output_text"}, {"text", text_}, {"annotations", json::array()}};
    events.push_back(Event("response.output_text.done", {{"item_id", item_id},
                                                         {"output_index", index},
                                                         {"content_index", 0},
                                                         {"text", text_},
                                                         {"logprobs", json::array()}}));
    events.push_back(Event(
        "response.content_part.done",
        {{"item_id", item_id}, {"output_index", index}, {"content_index", 0}, {"part", part}}));
    item["content"] = json::array({part});
    item["status"] = "completed";
  } else {
    events.push_back(Event("response.function_call_arguments.done", {{"item_id", item_id},
                                                                     {"output_index", index},
                                                                     {"name", item["name"]},
                                                                     {"arguments", text_}}));
    item["arguments"] = text_;
    item["status"] = "completed";
  }
  events.push_back(Event("response.output_item.done", {{"output_index", index}, {"item", item}}));
  open_ = Open::kNone;
  text_.clear();
}

std::vector<json> ResponseBuilder::Add(const std::string& reasoning, const std::string& text,
                                       const std::vector<ToolCall>& calls) {
  std::vector<json> events;
  auto open = [&](Open kind, json item) {
    Close(events);
    open_ = kind;
    output_.push_back(item);
    events.push_back(Event("response.output_item.added",
                           {{"output_index", output_.size() - 1}, {"item", std::move(item)}}));
  };
  if (!reasoning.empty()) {
    if (open_ != Open::kReasoning) {
      open(Open::kReasoning, {{"type", "reasoning"},
                              {"id", RandomId("rs_")},
                              {"summary", json::array()},
                              {"content", json::array()}});
    }
    text_ += reasoning;
    events.push_back(Event("response.reasoning_text.delta", {{"item_id", output_.back()["id"]},
                                                             {"output_index", output_.size() - 1},
                                                             {"content_index", 0},
                                                             {"delta", reasoning}}));
  }
  if (!text.empty()) {
    if (open_ != Open::kMessage) {
      open(Open::kMessage, {{"type", "message"},
                            {"id", RandomId("msg_")},
                            {"status", "in_progress"},
                            {"role", "assistant"},
                            {"content", json::array()}});
      events.push_back(Event(
          "response.content_part.added",
          {{"item_id", output_.back()["id"]},
           {"output_index", output_.size() - 1},
           {"content_index", 0},
           {"part", {{"type", "output_text"}, {"text", ""}, {"annotations", json::array()}}}}));
    }
    text_ += text;
    events.push_back(Event("response.output_text.delta", {{"item_id", output_.back()["id"]},
                                                          {"output_index", output_.size() - 1},
                                                          {"content_index", 0},
                                                          {"delta", text},
                                                          {"logprobs", json::array()}}));
  }
  for (const ToolCall& call : calls) {
    if (call.index != call_index_) {  // a new call: its first piece names it
      call_index_ = call.index;
      open(Open::kCall, {{"type", "function_call"},
                         {"id", RandomId("fc_")},
                         {"call_id", call.id},
                         {"name", call.name},
                         {"arguments", ""},
                         {"status", "in_progress"}});
    }
    if (call.arguments.empty()) continue;
    text_ += call.arguments;
    events.push_back(
        Event("response.function_call_arguments.delta", {{"item_id", output_.back()["id"]},
                                                         {"output_index", output_.size() - 1},
                                                         {"delta", call.arguments}}));
  }
  return events;
}

std::vector<json> ResponseBuilder::Finish(const std::string& finish_reason, const json& usage) {
  std::vector<json> events;
  Close(events);
  const bool cut = finish_reason == "length";
  status_ = cut ? "incomplete" : "completed";
  if (cut) {
    incomplete_ = {{"reason", "max_output_tokens"}};
    for (json& item : output_) {
      if (item["type"] == "message") item["status"] = "incomplete";
    }
  }
  const int64_t prompt = usage.value("prompt_tokens", 0),
                completion = usage.value("completion_tokens", 0);
  usage_ = {{"input_tokens", prompt},
            {"input_tokens_details",
             {{"cached_tokens", usage.contains("prompt_tokens_details")
                                    ? usage["prompt_tokens_details"].value("cached_tokens", 0)
                                    : 0}}},
            {"output_tokens", completion},
            {"total_tokens", prompt + completion}};
  events.push_back(
      Event(cut ? "response.incomplete" : "response.completed", {{"response", Response()}}));
  return events;
}

}  // namespace shardserve
