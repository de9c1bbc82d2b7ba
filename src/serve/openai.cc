#include "serve/openai.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace shardserve {
namespace {

using json = nlohmann::ordered_json;  // request bodies keep their keys' order (tool schemas)
constexpr char kParamPayload[] = "type.shardserve.io/param";
constexpr int kMaxStops = 16;
constexpr size_t kMaxStopTokenIds = 256;
constexpr char kHttpPayload[] = "type.shardserve.io/http-status";
constexpr char kRetryAfterPayload[] = "type.shardserve.io/retry-after";
constexpr int64_t kMaxPriority = 1 << 20;
constexpr int kMaxTopLogprobs = 20;
constexpr size_t kMaxLogitBias = 1024;
constexpr size_t kMaxTools = 128;
constexpr int64_t kMaxChoices = 16;    // n, best_of
constexpr size_t kMaxSequences = 128;  // prompts x best_of
constexpr size_t kMaxCacheSalt = 1024;
constexpr size_t kMaxResumedTokens = 1 << 20;  // a resumed output: a context's worth
constexpr size_t kMaxGuidedChoices = 2000;
constexpr size_t kMaxTemplateBytes = 256 << 10;  // a request's own chat_template
constexpr size_t kMaxKwargsBytes = 64 << 10;     // chat_template_kwargs, written as JSON
constexpr size_t kMaxDocuments = 256;

// Typed field access: absent and null read as "not given"; a wrong type names the field.
absl::StatusOr<std::optional<double>> Number(const json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_number()) return BadParam(name, absl::StrCat("'", name, "' must be a number"));
  const double v = it->get<double>();
  if (!std::isfinite(v)) return BadParam(name, absl::StrCat("'", name, "' must be finite"));
  return v;
}

absl::StatusOr<std::optional<int64_t>> Integer(const json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (it->is_number_unsigned() &&
      it->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return BadParam(name, absl::StrCat("'", name, "' is out of range"));
  }
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_number_float()) {
    const double v = it->get<double>();
    if (v == std::floor(v) && std::fabs(v) < 9e15) return static_cast<int64_t>(v);
  }
  return BadParam(name, absl::StrCat("'", name, "' must be an integer"));
}

absl::StatusOr<std::optional<bool>> Boolean(const json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean()) return BadParam(name, absl::StrCat("'", name, "' must be a boolean"));
  return it->get<bool>();
}

// A non-negative integer that fits a token id.
bool IsInt32(const json& t) {
  if (t.is_number_unsigned()) return t.get<uint64_t>() <= std::numeric_limits<int32_t>::max();
  return t.is_number_integer() && t.get<int64_t>() >= 0 &&
         t.get<int64_t>() <= std::numeric_limits<int32_t>::max();
}

absl::StatusOr<std::vector<int32_t>> TokenIds(const json& v, const std::string& param) {
  std::vector<int32_t> ids;
  for (const json& t : v) {
    if (!IsInt32(t)) {
      return BadParam(param, absl::StrCat("'", param, "' token ids must be non-negative integers"));
    }
    ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  if (ids.empty()) return BadParam(param, absl::StrCat("'", param, "' must not be empty"));
  return ids;
}

absl::Status ParsePrompt(const json& body, ApiRequest& r) {
  auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) return BadParam("prompt", "'prompt' is required");
  const json& p = *it;
  if (p.is_string()) {
    r.prompt_texts.push_back(p.get<std::string>());
    r.prompt_ids.emplace_back();
    return absl::OkStatus();
  }
  if (!p.is_array() || p.empty()) {
    return BadParam("prompt",
                    "'prompt' must be a string, a list of token ids, or a non-empty list of them");
  }
  if (p[0].is_number()) {
    ASSIGN_OR_RETURN(std::vector<int32_t> ids, TokenIds(p, "prompt"));
    r.prompt_texts.emplace_back();
    r.prompt_ids.push_back(std::move(ids));
    return absl::OkStatus();
  }
  for (const json& e : p) {
    if (e.is_string()) {
      r.prompt_texts.push_back(e.get<std::string>());
      r.prompt_ids.emplace_back();
    } else if (e.is_array()) {
      ASSIGN_OR_RETURN(std::vector<int32_t> ids, TokenIds(e, "prompt"));
      r.prompt_texts.emplace_back();
      r.prompt_ids.push_back(std::move(ids));
    } else {
      return BadParam("prompt", "'prompt' list entries must be strings or lists of token ids");
    }
  }
  return absl::OkStatus();
}

// An assistant message's tool_calls as the template receives them: [{id, type: "function",
// function: {name, arguments}}], the arguments a JSON object (OpenAI sends them as a JSON string;
// templates index and tojson them, as vLLM passes them).
absl::StatusOr<json> ToolCallsOfMessage(const json& calls, const std::string& param) {
  if (!calls.is_array() || calls.size() > kMaxTools) {
    return BadParam(param,
                    absl::StrCat("'", param, "' must be a list of at most ", kMaxTools, " calls"));
  }
  json out = json::array();
  for (size_t j = 0; j < calls.size(); ++j) {
    const std::string at = absl::StrCat(param, "[", j, "]");
    const json& c = calls[j];
    auto fn = c.is_object() ? c.find("function") : c.end();
    auto type = c.is_object() ? c.find("type") : c.end();
    if (!c.is_object() || (type != c.end() && *type != "function") || fn == c.end() ||
        !fn->is_object() || !fn->contains("name") || !(*fn)["name"].is_string()) {
      return BadParam(at, absl::StrCat("'", at,
                                       "' must be {\"type\": \"function\", "
                                       "\"function\": {\"name\": ..., \"arguments\": ...}}"));
    }
    json args = fn->contains("arguments") ? (*fn)["arguments"] : json::object();
    if (args.is_string()) {
      json parsed = json::parse(args.get<std::string>(), nullptr, /*allow_exceptions=*/false);
      if (parsed.is_discarded() || !parsed.is_object()) {
        return BadParam(at + ".function.arguments",
                        absl::StrCat("'", at,
                                     ".function.arguments' must be a JSON object (as a "
                                     "string or an object)"));
      }
      args = std::move(parsed);
    } else if (!args.is_object()) {
      return BadParam(at + ".function.arguments",
                      absl::StrCat("'", at, ".function.arguments' must be a JSON object"));
    }
    json call = json::object();
    if (c.contains("id") && c["id"].is_string()) call["id"] = c["id"];
    call["type"] = "function";
    call["function"] = {{"name", (*fn)["name"]}, {"arguments", std::move(args)}};
    out.push_back(std::move(call));
  }
  return out;
}

// tools: [{type: "function", function: {name, description?, parameters?, strict?}}], each
// name [A-Za-z0-9_-]{1,64} (OpenAI's rule) and unique.
absl::Status ParseTools(const json& body, ApiRequest& r) {
  if (auto it = body.find("functions"); it != body.end() && !it->is_null()) {
    return BadParam("functions",
                    "'functions' (deprecated function calling) is not supported; "
                    "use 'tools'");
  }
  if (auto it = body.find("function_call"); it != body.end() && !it->is_null()) {
    return BadParam("function_call",
                    "'function_call' (deprecated function calling) is not "
                    "supported; use 'tool_choice'");
  }
  std::string strict_at;  // the first function with strict: true
  auto tools = body.find("tools");
  if (tools != body.end() && !tools->is_null()) {
    if (!tools->is_array() || tools->size() > kMaxTools) {
      return BadParam("tools",
                      absl::StrCat("'tools' must be a list of at most ", kMaxTools, " functions"));
    }
    for (size_t i = 0; i < tools->size(); ++i) {
      const std::string at = absl::StrCat("tools[", i, "]");
      const json& t = (*tools)[i];
      auto fn = t.is_object() ? t.find("function") : t.end();
      if (!t.is_object() || !t.contains("type") || t["type"] != "function" || fn == t.end() ||
          !fn->is_object()) {
        return BadParam(at, absl::StrCat("'", at,
                                         "' must be {\"type\": \"function\", "
                                         "\"function\": {...}}"));
      }
      auto name = fn->find("name");
      if (name == fn->end() || !name->is_string() || name->get<std::string>().empty() ||
          name->get<std::string>().size() > 64 ||
          name->get<std::string>().find_first_not_of(
              "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-") !=
              std::string::npos) {
        return BadParam(at + ".function.name",
                        absl::StrCat("'", at,
                                     ".function.name' must be 1 to 64 letters, digits, "
                                     "'_' or '-'"));
      }
      for (size_t j = 0; j < i; ++j) {
        if ((*tools)[j]["function"]["name"] == *name) {
          return BadParam(at + ".function.name",
                          absl::StrCat("'", at, ".function.name' '", name->get<std::string>(),
                                       "' is given twice"));
        }
      }
      if (auto strict = fn->find("strict");
          strict != fn->end() && !(strict->is_null() || strict->is_boolean())) {
        return BadParam(at + ".function.strict",
                        absl::StrCat("'", at, ".function.strict' must be a boolean"));
      } else if (strict != fn->end() && *strict == true && strict_at.empty()) {
        strict_at = at + ".function.strict";
      }
      if (auto params = fn->find("parameters");
          params != fn->end() && !params->is_null() && !params->is_object()) {
        return BadParam(at + ".function.parameters",
                        absl::StrCat("'", at,
                                     ".function.parameters' must be a JSON Schema "
                                     "object"));
      }
    }
    if (!tools->empty()) r.tools = *tools;
  }
  r.tool_choice = r.tools.is_null() ? "none" : "auto";  // OpenAI's defaults
  if (auto it = body.find("tool_choice"); it != body.end() && !it->is_null()) {
    if (it->is_string() && (*it == "none" || *it == "auto" || *it == "required")) {
      r.tool_choice = it->get<std::string>();
    } else if (it->is_object() && it->contains("type") && (*it)["type"] == "function" &&
               it->contains("function") && (*it)["function"].is_object() &&
               (*it)["function"].contains("name") && (*it)["function"]["name"].is_string()) {
      r.tool_choice = "function";
      r.tool_choice_name = (*it)["function"]["name"].get<std::string>();
      const bool given =
          r.tools.is_array() && std::any_of(r.tools.begin(), r.tools.end(), [&](const json& t) {
            return t["function"]["name"] == r.tool_choice_name;
          });
      if (!given) {
        return BadParam("tool_choice",
                        absl::StrCat("'tool_choice' names the function '", r.tool_choice_name,
                                     "', which 'tools' does not give"));
      }
    } else {
      return BadParam("tool_choice",
                      "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}");
    }
  }
  if (r.tool_choice == "auto" && r.tools.is_null()) r.tool_choice = "none";
  if (r.tool_choice == "required" && r.tools.is_null()) {
    return BadParam("tool_choice", "'tool_choice' \"required\" needs 'tools'");
  }
  // A function's strict schema is kept by constraining its calls: always where a call must come
  // (required, named); with auto, by a grammar of text or calls (the server's, per format).
  r.strict_param = strict_at;
  ASSIGN_OR_RETURN(auto parallel, Boolean(body, "parallel_tool_calls"));
  r.parallel_tool_calls = parallel.value_or(true);
  return absl::OkStatus();
}

absl::Status ParseMessages(const json& body, ApiRequest& r) {
  auto it = body.find("messages");
  if (it == body.end() || !it->is_array() || it->empty()) {
    return BadParam("messages", "'messages' must be a non-empty list");
  }
  for (size_t i = 0; i < it->size(); ++i) {
    const json& m = (*it)[i];
    const std::string param = absl::StrCat("messages[", i, "]");
    if (!m.is_object()) return BadParam(param, absl::StrCat("'", param, "' must be an object"));
    ChatMessage msg;
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) {
      return BadParam(param + ".role", absl::StrCat("'", param, ".role' must be a string"));
    }
    msg.role = role->get<std::string>();
    if (msg.role == "developer") msg.role = "system";
    if (msg.role == "function") {
      return BadParam(param + ".role", absl::StrCat("'", param,
                                                    ".role' 'function' (the deprecated function "
                                                    "calling) is not supported; use 'tool'"));
    }
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" &&
        msg.role != "tool") {
      return BadParam(param + ".role", absl::StrCat("'", param, ".role' is '", msg.role,
                                                    "'; expected system, user, assistant or tool"));
    }
    if (auto name = m.find("name"); name != m.end() && !name->is_null()) {
      if (!name->is_string()) {
        return BadParam(param + ".name", absl::StrCat("'", param, ".name' must be a string"));
      }
      msg.name = name->get<std::string>();
    }
    if (msg.role == "tool") {
      auto id = m.find("tool_call_id");
      if (id == m.end() || !id->is_string()) {
        return BadParam(param + ".tool_call_id",
                        absl::StrCat("'", param,
                                     ".tool_call_id' must be a string naming the call "
                                     "this message answers"));
      }
      msg.tool_call_id = id->get<std::string>();
    }
    if (auto reasoning = m.find("reasoning_content");
        reasoning != m.end() && !reasoning->is_null()) {
      if (msg.role != "assistant" || !reasoning->is_string()) {
        return BadParam(
            param + ".reasoning_content",
            absl::StrCat("'", param, ".reasoning_content' is an assistant message's text"));
      }
      msg.reasoning_content = *reasoning;
    }
    if (auto calls = m.find("tool_calls"); calls != m.end() && !calls->is_null()) {
      if (msg.role != "assistant") {
        return BadParam(param + ".tool_calls",
                        absl::StrCat("'", param, ".tool_calls' belongs to assistant messages"));
      }
      ASSIGN_OR_RETURN(msg.tool_calls, ToolCallsOfMessage(*calls, param + ".tool_calls"));
    }
    auto content = m.find("content");
    if (content == m.end() || content->is_null()) {
      if (!msg.tool_calls.empty()) {  // an assistant's turn of calls alone: "" as vLLM gives it
        msg.content_null = true;
        r.messages.push_back(std::move(msg));
        continue;
      }
      return BadParam(param + ".content", absl::StrCat("'", param, ".content' is required"));
    }
    if (content->is_string()) {
      msg.content = content->get<std::string>();
    } else if (content->is_array()) {
      // Text parts (vLLM's text types); a string-style template gets them joined by "\n".
      for (const json& part : *content) {
        auto type = part.is_object() ? part.find("type") : part.end();
        auto text = part.is_object() ? part.find("text") : part.end();
        const bool text_type = type != part.end() && type->is_string() &&
                               (*type == "text" || *type == "input_text" ||
                                *type == "output_text" || *type == "refusal");
        if (!part.is_object() || !text_type || text == part.end() || !text->is_string()) {
          return BadParam(param + ".content",
                          absl::StrCat("'", param,
                                       ".content' parts must be {\"type\": \"text\", \"text\": "
                                       "...}; this model reads text only"));
        }
        msg.parts.push_back(part["text"].get<std::string>());
      }
      msg.content = absl::StrJoin(msg.parts, "\n");
      msg.content_null = msg.parts.empty();  // no part: "" (or []) as vLLM gives it
    } else {
      return BadParam(param + ".content",
                      absl::StrCat("'", param, ".content' must be a string or a list of parts"));
    }
    r.messages.push_back(std::move(msg));
  }
  return absl::OkStatus();
}

absl::Status ParseStop(const json& body, ApiRequest& r) {
  auto it = body.find("stop");
  if (it != body.end() && !it->is_null()) {
    if (it->is_string()) {
      r.stop.push_back(it->get<std::string>());
    } else if (it->is_array() && it->size() <= kMaxStops) {
      for (const json& s : *it) {
        if (!s.is_string()) return BadParam("stop", "'stop' entries must be strings");
        r.stop.push_back(s.get<std::string>());
      }
    } else {
      return BadParam("stop",
                      absl::StrCat("'stop' must be a string or a list of at most ", kMaxStops));
    }
    for (const std::string& s : r.stop) {
      if (s.empty()) return BadParam("stop", "'stop' strings must not be empty");
    }
  }
  it = body.find("stop_token_ids");
  if (it != body.end() && !it->is_null()) {
    if (!it->is_array()) return BadParam("stop_token_ids", "'stop_token_ids' must be a list");
    if (it->size() > kMaxStopTokenIds) {
      return BadParam("stop_token_ids",
                      absl::StrCat("'stop_token_ids' may hold at most ", kMaxStopTokenIds));
    }
    for (const json& t : *it) {
      if (!IsInt32(t)) {
        return BadParam("stop_token_ids", "'stop_token_ids' entries must be token ids");
      }
      r.params.stop_token_ids.push_back(t.get<int64_t>());
    }
  }
  return absl::OkStatus();
}

// OpenAI's logit_bias: {"token id": bias in [-100, 100]}, at most kMaxLogitBias entries.
absl::Status ParseLogitBias(const json& body, SamplingParams& p) {
  auto it = body.find("logit_bias");
  if (it == body.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_object() || it->size() > kMaxLogitBias) {
    return BadParam("logit_bias", absl::StrCat("'logit_bias' must be an object of at most ",
                                               kMaxLogitBias, " token ids"));
  }
  for (auto e = it->begin(); e != it->end(); ++e) {
    int32_t id;
    if (!absl::SimpleAtoi(e.key(), &id) || id < 0) {
      return BadParam("logit_bias",
                      absl::StrCat("'logit_bias' key '", e.key(), "' is not a token id"));
    }
    if (!e.value().is_number() || !(e.value().get<double>() >= -100) ||
        !(e.value().get<double>() <= 100)) {
      return BadParam("logit_bias", absl::StrCat("'logit_bias' of token ", id,
                                                 " must be a number in [-100, 100]"));
    }
    p.logit_bias.emplace_back(id, e.value().get<float>());
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status BadParam(const std::string& param, const std::string& message) {
  absl::Status s = absl::InvalidArgumentError(message);
  s.SetPayload(kParamPayload, absl::Cord(param));
  return s;
}

std::string ErrorParam(const absl::Status& status) {
  auto p = status.GetPayload(kParamPayload);
  return p ? std::string(*p) : std::string();
}

namespace {

// Structured output: response_format (OpenAI's json_object and json_schema) or one of vLLM's
// guided_json, guided_regex, guided_grammar (a Lark grammar, llguidance's dialect), guided_choice.
absl::Status ParseStructuredOutput(const json& body, ApiRequest& r) {
  std::string from;  // the field that set r.grammar
  auto set = [&](const char* field, std::string kind, std::string data) -> absl::Status {
    if (!from.empty()) {
      return BadParam(field, absl::StrCat("'", field, "' and '", from,
                                          "' each constrain the output: give one"));
    }
    from = field;
    r.grammar = Grammar{std::move(kind), std::move(data)};
    r.grammar_param = field;
    return absl::OkStatus();
  };
  if (auto it = body.find("response_format"); it != body.end() && !it->is_null()) {
    auto type = it->is_object() ? it->find("type") : it->end();
    if (type == it->end() || !type->is_string()) {
      return BadParam("response_format", "'response_format' must be an object with a 'type'");
    }
    if (*type == "json_object") {
      RETURN_IF_ERROR(set("response_format", "json_object", ""));
    } else if (*type == "json_schema") {
      auto js = it->find("json_schema");
      if (js == it->end() || !js->is_object()) {
        return BadParam("response_format.json_schema",
                        "'response_format.json_schema' must be an object with the 'schema'");
      }
      auto schema = js->find("schema");
      if (schema == js->end() || !(schema->is_object() || schema->is_boolean())) {
        return BadParam("response_format.json_schema.schema",
                        "'response_format.json_schema.schema' must be a JSON schema (an object)");
      }
      // strict or not, the schema is enforced (as vLLM does).
      RETURN_IF_ERROR(set("response_format", "json_schema", schema->dump()));
    } else if (*type != "text") {
      return BadParam("response_format",
                      "'response_format.type' must be \"text\", \"json_object\" or "
                      "\"json_schema\"");
    }
  }
  // vLLM's: guided_json, guided_regex, guided_grammar, guided_choice in the body, or the same as
  // json, regex, grammar, choice in its newer structured_outputs object.
  auto guided = [&](const json& from, const std::string& prefix, bool nested) -> absl::Status {
    for (const char* key : {"json", "regex", "grammar", "choice"}) {
      const std::string field = prefix + key;
      auto it = from.find(nested ? std::string(key) : field);
      if (it == from.end() || it->is_null()) continue;
      const std::string k = key;
      if (k == "json") {
        if (!it->is_string() && !it->is_object()) {
          return BadParam(
              field, absl::StrCat("'", field, "' must be a JSON schema (an object or its text)"));
        }
        RETURN_IF_ERROR(set(field.c_str(), "json_schema",
                            it->is_string() ? it->get<std::string>() : it->dump()));
      } else if (k == "choice") {
        if (!it->is_array() || it->empty() ||
            !std::all_of(it->begin(), it->end(), [](const json& c) { return c.is_string(); })) {
          return BadParam(field, absl::StrCat("'", field, "' must be a list of strings"));
        }
        // Each choice is an item of one Earley row, whose width llguidance bounds (2,000).
        if (it->size() > kMaxGuidedChoices) {
          return BadParam(field,
                          absl::StrCat("'", field, "' has ", it->size(), " choices; at most ",
                                       kMaxGuidedChoices, " are accepted"));
        }
        std::string lark = "start: ";  // the choices as literals (JSON string syntax)
        for (size_t i = 0; i < it->size(); ++i) {
          absl::StrAppend(&lark, i ? " | " : "", json((*it)[i].get<std::string>()).dump());
        }
        RETURN_IF_ERROR(set(field.c_str(), "lark", lark));
      } else {
        if (!it->is_string())
          return BadParam(field, absl::StrCat("'", field, "' must be a string"));
        RETURN_IF_ERROR(
            set(field.c_str(), k == "regex" ? "regex" : "lark", it->get<std::string>()));
      }
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(guided(body, "guided_", false));
  if (auto so = body.find("structured_outputs"); so != body.end() && !so->is_null()) {
    if (!so->is_object()) {
      return BadParam("structured_outputs", "'structured_outputs' must be an object");
    }
    for (const auto& [key, value] : so->items()) {
      if (key == "json_object" && value.is_boolean()) continue;
      if (key != "json" && key != "regex" && key != "grammar" && key != "choice") {
        return BadParam("structured_outputs." + key,
                        absl::StrCat("'structured_outputs.", key,
                                     "' is not supported (json, regex, grammar, choice and "
                                     "json_object are)"));
      }
    }
    RETURN_IF_ERROR(guided(*so, "structured_outputs.", true));
    if (auto jo = so->find("json_object"); jo != so->end() && *jo == true) {
      RETURN_IF_ERROR(set("structured_outputs.json_object", "json_object", ""));
    }
  }
  // The engine is llguidance whatever a client names; another is refused rather than ignored,
  // as is a whitespace pattern (JSON comes without whitespace; a schema's x-guidance sets it).
  if (auto it = body.find("guided_decoding_backend"); it != body.end() && !it->is_null()) {
    if (!it->is_string() || (*it != "auto" && *it != "llguidance" && *it != "guidance")) {
      return BadParam("guided_decoding_backend",
                      "'guided_decoding_backend' must be auto or llguidance (the one engine "
                      "here)");
    }
  }
  if (auto it = body.find("guided_whitespace_pattern"); it != body.end() && !it->is_null()) {
    return BadParam("guided_whitespace_pattern",
                    "'guided_whitespace_pattern' is not supported; a JSON schema's \"x-guidance\" "
                    "options (whitespace_pattern) set it");
  }
  // With tools: a call that must come (required, named) leaves no answer for the grammar to
  // shape; with auto, the output is a call or the answer (a JSON schema's or object's).
  if (r.grammar && r.tool_choice == "auto" && r.grammar->kind != "json_schema" &&
      r.grammar->kind != "json_object") {
    return BadParam(r.grammar_param, absl::StrCat("'", r.grammar_param,
                                                  "' with tools (tool_choice \"auto\") is "
                                                  "served for a JSON schema or object only: the "
                                                  "output is a call or the answer"));
  }
  if (r.grammar && r.params.min_tokens > 0) {
    return BadParam("min_tokens", absl::StrCat("'min_tokens' with '", r.grammar_param,
                                               "' is not supported: the grammar decides where "
                                               "the output ends"));
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

// How the chat template renders the messages: vLLM's add_generation_prompt,
// continue_final_message, chat_template_kwargs, documents and a request's own chat_template
// (which the server takes only where the deployment trusts them).
absl::Status ParseChatOptions(const json& body, ApiRequest& r) {
  ChatOptions& o = r.chat_options;
  auto flag = [&](const char* name) -> absl::StatusOr<std::optional<bool>> {
    auto it = body.find(name);
    if (it == body.end() || it->is_null()) return std::nullopt;
    if (!it->is_boolean()) return BadParam(name, absl::StrCat("'", name, "' must be a boolean"));
    return it->get<bool>();
  };
  ASSIGN_OR_RETURN(const std::optional<bool> generation, flag("add_generation_prompt"));
  ASSIGN_OR_RETURN(const std::optional<bool> continuing, flag("continue_final_message"));
  ASSIGN_OR_RETURN(const std::optional<bool> reasoning, flag("include_reasoning"));
  r.include_reasoning = reasoning.value_or(true);
  o.continue_final_message = continuing.value_or(false);
  if (o.continue_final_message && generation.value_or(false)) {
    return BadParam("continue_final_message",
                    "'continue_final_message' and 'add_generation_prompt' cannot both be true: "
                    "the prompt either continues the final message or starts a new one");
  }
  o.add_generation_prompt = generation.value_or(!o.continue_final_message);
  if (auto it = body.find("chat_template_kwargs"); it != body.end() && !it->is_null()) {
    if (!it->is_object()) {
      return BadParam("chat_template_kwargs",
                      "'chat_template_kwargs' must be an object of the template's variables");
    }
    if (it->dump().size() > kMaxKwargsBytes) {
      return BadParam("chat_template_kwargs", absl::StrCat("'chat_template_kwargs' may hold at "
                                                           "most ",
                                                           kMaxKwargsBytes, " bytes of JSON"));
    }
    for (const auto& [key, value] : it->items()) {
      static constexpr const char* kOwnFields[] = {
          "messages",     "tools", "documents", "add_generation_prompt", "continue_final_message",
          "chat_template"};
      static constexpr const char* kTokens[] = {"bos_token", "eos_token", "unk_token", "pad_token"};
      for (const char* own : kOwnFields) {
        if (key == own) {
          return BadParam("chat_template_kwargs",
                          absl::StrCat("'chat_template_kwargs' may not set '", key,
                                       "': it is the request's own field"));
        }
      }
      for (const char* token : kTokens) {
        if (key == token) {
          return BadParam("chat_template_kwargs",
                          absl::StrCat("'chat_template_kwargs' may not set '", key,
                                       "': the model's tokenizer gives it"));
        }
      }
    }
    o.kwargs = *it;
  }
  if (auto it = body.find("documents"); it != body.end() && !it->is_null()) {
    if (!it->is_array() || it->size() > kMaxDocuments ||
        !std::all_of(it->begin(), it->end(), [](const json& d) { return d.is_object(); })) {
      return BadParam("documents", absl::StrCat("'documents' must be a list of at most ",
                                                kMaxDocuments, " objects (title, text)"));
    }
    o.documents = *it;
  }
  if (auto it = body.find("chat_template"); it != body.end() && !it->is_null()) {
    if (!it->is_string() || it->get_ref<const std::string&>().empty() ||
        it->get_ref<const std::string&>().size() > kMaxTemplateBytes) {
      return BadParam("chat_template", absl::StrCat("'chat_template' must be a Jinja template of "
                                                    "at most ",
                                                    kMaxTemplateBytes, " bytes"));
    }
    r.chat_template = it->get<std::string>();
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ApiRequest> ParseApiRequest(const json& body, bool chat) {
  if (!body.is_object()) return BadParam("", "the request body must be a JSON object");
  ApiRequest r;
  r.chat = chat;
  auto model = body.find("model");
  if (model == body.end() || !model->is_string()) {
    return BadParam("model", "'model' must be a string naming the model");
  }
  r.model = model->get<std::string>();
  RETURN_IF_ERROR(chat ? ParseMessages(body, r) : ParsePrompt(body, r));
  if (chat) {
    RETURN_IF_ERROR(ParseChatOptions(body, r));
  } else {
    for (const char* field :
         {"chat_template", "chat_template_kwargs", "documents", "add_generation_prompt",
          "continue_final_message", "include_reasoning"}) {
      if (auto it = body.find(field); it != body.end() && !it->is_null()) {
        return BadParam(field, absl::StrCat("'", field, "' belongs to /v1/chat/completions"));
      }
    }
  }

  SamplingParams& p = r.params;
  ASSIGN_OR_RETURN(auto max_tokens, Integer(body, "max_tokens"));
  if (chat && !max_tokens) {
    ASSIGN_OR_RETURN(max_tokens, Integer(body, "max_completion_tokens"));
  }
  if (max_tokens) {
    if (*max_tokens < 1) return BadParam("max_tokens", "'max_tokens' must be at least 1");
    p.max_tokens = *max_tokens;
    r.max_tokens_set = true;
  }
  ASSIGN_OR_RETURN(auto temperature, Number(body, "temperature"));
  if (temperature) {
    if (*temperature < 0 || *temperature > 2) {
      return BadParam("temperature", "'temperature' must be between 0 and 2");
    }
    p.temperature = static_cast<float>(*temperature);
  } else {
    p.temperature = 1.0f;  // OpenAI's default
  }
  ASSIGN_OR_RETURN(auto top_p, Number(body, "top_p"));
  if (top_p) {
    if (!(*top_p > 0 && *top_p <= 1)) return BadParam("top_p", "'top_p' must be in (0, 1]");
    p.top_p = static_cast<float>(*top_p);
  }
  ASSIGN_OR_RETURN(auto top_k, Integer(body, "top_k"));
  if (top_k) {
    if (*top_k < -1) return BadParam("top_k", "'top_k' must be -1 (off), 0 (off) or positive");
    p.top_k = std::max<int64_t>(0, *top_k);
  }
  ASSIGN_OR_RETURN(auto seed, Integer(body, "seed"));
  if (seed) {
    p.seed = static_cast<uint64_t>(*seed);
    r.seed_set = true;
  }
  ASSIGN_OR_RETURN(auto n, Integer(body, "n"));
  if (n) {
    if (*n < 1 || *n > kMaxChoices) {
      return BadParam("n", absl::StrCat("'n' must be between 1 and ", kMaxChoices));
    }
    r.n = *n;
  }
  ASSIGN_OR_RETURN(auto best_of, Integer(body, "best_of"));
  if (best_of) {
    if (chat && *best_of != 1) {
      return BadParam("best_of", "'best_of' belongs to /v1/completions");
    }
    if (*best_of < r.n || *best_of > kMaxChoices) {
      return BadParam("best_of",
                      absl::StrCat("'best_of' must be between 'n' (", r.n, ") and ", kMaxChoices));
    }
    r.best_of = *best_of;
  }
  if (!best_of) r.best_of = r.n;
  const size_t prompts = chat ? 1 : r.prompt_ids.size();
  if (prompts * static_cast<size_t>(r.best_of) > kMaxSequences) {
    return BadParam(r.best_of > r.n ? "best_of" : "n",
                    absl::StrCat("a request may ask for at most ", kMaxSequences,
                                 " sequences (prompts x ", r.best_of > r.n ? "best_of" : "n",
                                 "); this one asks for ", prompts * r.best_of));
  }
  // OpenAI's penalties in [-2, 2]; vLLM's repetition_penalty (> 0; at most 10 here).
  for (auto [name, field] : {std::pair{"presence_penalty", &p.presence_penalty},
                             {"frequency_penalty", &p.frequency_penalty}}) {
    ASSIGN_OR_RETURN(auto v, Number(body, name));
    if (!v) continue;
    if (*v < -2 || *v > 2) return BadParam(name, absl::StrCat("'", name, "' must be in [-2, 2]"));
    *field = static_cast<float>(*v);
  }
  ASSIGN_OR_RETURN(auto repetition, Number(body, "repetition_penalty"));
  if (repetition) {
    if (!(*repetition > 0 && *repetition <= 10)) {
      return BadParam("repetition_penalty", "'repetition_penalty' must be in (0, 10]");
    }
    p.repetition_penalty = static_cast<float>(*repetition);
  }
  RETURN_IF_ERROR(ParseLogitBias(body, p));
  ASSIGN_OR_RETURN(auto min_tokens, Integer(body, "min_tokens"));
  if (min_tokens) {
    if (*min_tokens < 0) return BadParam("min_tokens", "'min_tokens' must be >= 0");
    p.min_tokens = *min_tokens;
  }
  if (auto it = body.find("suffix"); it != body.end() && !it->is_null()) {
    return BadParam("suffix", "'suffix' is not supported");
  }
  if (chat) {
    RETURN_IF_ERROR(ParseTools(body, r));
  } else {
    for (const char* name :
         {"tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"}) {
      if (auto it = body.find(name); it != body.end() && !it->is_null()) {
        return BadParam(name, absl::StrCat("'", name, "' belongs to /v1/chat/completions"));
      }
    }
  }
  RETURN_IF_ERROR(ParseStructuredOutput(body, r));
  ASSIGN_OR_RETURN(auto echo, Boolean(body, "echo"));
  if (echo && *echo) {
    if (chat) return BadParam("echo", "'echo' belongs to /v1/completions");
    r.echo = true;
  }
  ASSIGN_OR_RETURN(auto ignore_eos, Boolean(body, "ignore_eos"));
  if (ignore_eos) p.ignore_eos = *ignore_eos;
  RETURN_IF_ERROR(ParseStop(body, r));
  if (r.max_tokens_set && p.min_tokens > p.max_tokens) {
    return BadParam("min_tokens", "'min_tokens' must not exceed 'max_tokens'");
  }

  if (chat) {
    ASSIGN_OR_RETURN(auto logprobs, Boolean(body, "logprobs"));
    ASSIGN_OR_RETURN(auto top, Integer(body, "top_logprobs"));
    r.logprobs = logprobs.value_or(false);
    if (top) {
      if (!r.logprobs) return BadParam("top_logprobs", "'top_logprobs' needs 'logprobs': true");
      if (*top < 0 || *top > kMaxTopLogprobs) {
        return BadParam("top_logprobs",
                        absl::StrCat("'top_logprobs' must be between 0 and ", kMaxTopLogprobs));
      }
      p.top_logprobs = *top;
    }
  } else {
    ASSIGN_OR_RETURN(auto logprobs, Integer(body, "logprobs"));
    if (logprobs) {
      if (*logprobs < 0 || *logprobs > kMaxTopLogprobs) {
        return BadParam("logprobs",
                        absl::StrCat("'logprobs' must be between 0 and ", kMaxTopLogprobs));
      }
      r.logprobs = true;
      p.top_logprobs = *logprobs;
    }
  }
  // vLLM's cache_salt: the request shares cached prefixes only with requests of the same salt.
  if (auto it = body.find("cache_salt"); it != body.end() && !it->is_null()) {
    if (!it->is_string() || it->get<std::string>().empty() ||
        it->get<std::string>().size() > kMaxCacheSalt) {
      return BadParam("cache_salt",
                      absl::StrCat("'cache_salt' must be a non-empty string of at most ",
                                   kMaxCacheSalt, " bytes"));
    }
    r.cache_salt = it->get<std::string>();
  }
  if (auto it = body.find("kv_transfer_params"); it != body.end() && !it->is_null()) {
    const auto flag = [&](const char* key) {
      auto f = it->find(key);
      return f != it->end() && f->is_boolean() && f->get<bool>();
    };
    if (!it->is_object() || flag("do_remote_decode") == flag("do_remote_prefill")) {
      return BadParam("kv_transfer_params",
                      "'kv_transfer_params' must be an object with do_remote_decode (a prefill "
                      "replica's leg) or do_remote_prefill (a decode replica's) true");
    }
    r.kv_transfer = nlohmann::json::parse(it->dump());
  }
  ASSIGN_OR_RETURN(auto speculative, Boolean(body, "speculative"));
  if (speculative) r.speculative = *speculative;
  if (auto it = body.find("priority"); it != body.end() && !it->is_null()) {
    if (!it->is_number_integer() || std::llabs(it->get<int64_t>()) > kMaxPriority) {
      return BadParam("priority", absl::StrCat("'priority' must be an integer in [-", kMaxPriority,
                                               ", ", kMaxPriority, "] (lower runs first)"));
    }
    r.priority = it->get<int64_t>();
  }
  if (auto it = body.find("shardserve_resume"); it != body.end() && !it->is_null()) {
    const auto bad = [] {
      return BadParam("shardserve_resume",
                      absl::StrCat("'shardserve_resume' must be an object with 'tokens' (at most ",
                                   kMaxResumedTokens,
                                   " token ids), 'id' (a string of at most 128 bytes), "
                                   "'created' and 'seed' (non-negative integers)"));
    };
    if (!it->is_object()) return bad();
    const auto tokens = it->find("tokens");
    const auto id = it->find("id");
    const auto created = it->find("created");
    const auto seed = it->find("seed");
    const auto id_ok = [](const auto& t) {
      return t.is_number_integer() && t.template get<int64_t>() >= 0 &&
             t.template get<int64_t>() <= std::numeric_limits<int32_t>::max();
    };
    if (tokens == it->end() || !tokens->is_array() || tokens->size() > kMaxResumedTokens ||
        !std::all_of(tokens->begin(), tokens->end(), id_ok) ||
        (id != it->end() && (!id->is_string() || id->get<std::string>().size() > 128)) ||
        (created != it->end() &&
         (!created->is_number_unsigned() || created->get<uint64_t>() >= (uint64_t{1} << 40))) ||
        (seed != it->end() && !seed->is_number_unsigned())) {
      return bad();
    }
    ApiRequest::Resume resume;
    for (const auto& t : *tokens) resume.tokens.push_back(static_cast<int32_t>(t.get<int64_t>()));
    if (id != it->end()) resume.id = id->get<std::string>();
    if (created != it->end()) resume.created = static_cast<int64_t>(created->get<uint64_t>());
    if (seed != it->end()) resume.seed = seed->get<uint64_t>();
    r.resume = std::move(resume);
  }
  ASSIGN_OR_RETURN(auto stream, Boolean(body, "stream"));
  r.stream = stream.value_or(false);
  if (r.stream && r.best_of > r.n) {
    return BadParam("best_of",
                    "'best_of' greater than 'n' cannot stream: the best are known "
                    "only at the end");
  }
  if (body.contains("prompt_logprobs") && !body["prompt_logprobs"].is_null()) {
    return BadParam("prompt_logprobs",
                    "'prompt_logprobs' (vLLM's per-id form) is not supported; /v1/completions "
                    "with 'echo': true and 'logprobs' gives the prompt's log-probabilities");
  }
  if (auto it = body.find("stream_options"); it != body.end() && !it->is_null()) {
    if (!it->is_object()) return BadParam("stream_options", "'stream_options' must be an object");
    if (!r.stream) return BadParam("stream_options", "'stream_options' needs 'stream': true");
    ASSIGN_OR_RETURN(auto usage, Boolean(*it, "include_usage"));
    r.include_usage = usage.value_or(false);
  }
  return r;
}

absl::Status WithHttpStatus(absl::Status status, int http_status) {
  status.SetPayload(kHttpPayload, absl::Cord(std::to_string(http_status)));
  return status;
}

absl::Status WithRetryAfter(absl::Status status, int64_t seconds) {
  status.SetPayload(kRetryAfterPayload, absl::Cord(std::to_string(seconds)));
  return status;
}

int64_t RetryAfterOf(const absl::Status& status) {
  int64_t s = 0;
  if (auto p = status.GetPayload(kRetryAfterPayload)) {
    if (!absl::SimpleAtoi(std::string(*p), &s)) s = 0;
  }
  return s;
}

int HttpStatusFor(const absl::Status& status) {
  if (auto p = status.GetPayload(kHttpPayload)) {
    int code;
    if (absl::SimpleAtoi(std::string(*p), &code)) return code;
  }
  switch (status.code()) {
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
      return 400;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kUnavailable:
      return 503;
    default:
      return 500;
  }
}

nlohmann::json ErrorBody(const absl::Status& status) {
  using json = nlohmann::json;
  const int code = HttpStatusFor(status);
  const char* type = code == 429   ? "rate_limit_error"
                     : code == 404 ? "not_found_error"
                     : code < 500  ? "invalid_request_error"
                                   : "server_error";
  const std::string param = ErrorParam(status);
  return {{"error",
           {{"message", std::string(status.message())},
            {"type", type},
            {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code == 404   ? json("model_not_found")
                     : code == 401 ? json("invalid_api_key")
                                   : json(nullptr)}}}};
}

std::string DumpJson(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace shardserve
