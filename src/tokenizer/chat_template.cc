#include "tokenizer/chat_template.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/text.h"
#include "model/gguf_model.h"
#include "tokenizer/jinja.h"

namespace shardserve {
namespace {

using json = nlohmann::json;

// tokenizer_config.json writes special tokens as a string or as {"content": ...}.
std::string TokenText(const json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return "";
}

// The template text: a string, or a list of named templates of which "default" is used.
std::string TemplateText(const json& config) {
  auto it = config.find("chat_template");
  if (it == config.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    for (const json& t : *it) {
      // (value() would throw on a name that is no string: a model file is input too)
      if (t.is_object() && t.contains("name") && t["name"] == "default" && t.contains("template") &&
          t["template"].is_string()) {
        return t["template"].get<std::string>();
      }
    }
  }
  return "";
}

}  // namespace

ChatTemplate ChatTemplate::ForModel(const std::string& model_dir, const Tokenizer& tokenizer) {
  ChatTemplate t;
  json config = json::object();
  std::string path = (std::filesystem::path(model_dir) / "tokenizer_config.json").string();
  absl::StatusOr<std::string> text;
  const absl::StatusOr<std::optional<std::string>> gguf = FindGgufFile(model_dir);
  const bool from_gguf = gguf.ok() && gguf->has_value();
  if (!from_gguf) {
    text = ReadFileToString(path);
  } else {
    path = absl::StrCat(**gguf, " (GGUF metadata)");
    absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::Open(**gguf);
    absl::StatusOr<GgufTokenizerFiles> files =
        f.ok() ? GgufTokenizer(**f) : absl::StatusOr<GgufTokenizerFiles>(f.status());
    if (!files.ok()) {
      t.reason_ = std::string(files.status().message());
      return t;
    }
    text = files->tokenizer_config_json;
  }
  if (text.ok()) {
    try {
      config = json::parse(*text);
    } catch (const json::exception& e) {
      t.reason_ = absl::StrCat(path, " is not valid JSON: ", e.what());
      return t;
    }
  }
  if (!config.is_object()) config = json::object();
  // Hugging Face directories saved by recent transformers keep the template in its own file,
  // which takes precedence over tokenizer_config.json's (as transformers reads them).
  if (!from_gguf) {
    const auto jinja = std::filesystem::path(model_dir) / "chat_template.jinja";
    if (std::error_code ec; std::filesystem::is_regular_file(jinja, ec)) {
      absl::StatusOr<std::string> own = ReadFileToString(jinja.string());
      if (!own.ok()) {
        t.reason_ = std::string(own.status().message());
        return t;
      }
      config["chat_template"] = *own;
      t.source_ = "chat_template.jinja";
    }
  }
  for (const char* key : {"bos_token", "eos_token", "unk_token", "pad_token"}) {
    t.special_.emplace_back(key, TokenText(config, key));
  }
  t.template_ = TemplateText(config);
  if (t.template_.empty()) {
    t.reason_ = absl::StrCat(path, " gives no chat_template");
    return t;
  }
  if (t.source_ == "none") t.source_ = from_gguf ? "GGUF" : "tokenizer_config.json";
  // The end of an assistant's turn: the special token the template writes after its text.
  const std::string probe = "\x01shardserve-probe\x01";
  std::vector<ChatMessage> probe_turn(2);
  probe_turn[0].role = "user";
  probe_turn[0].content = "hi";
  probe_turn[1].role = "assistant";
  probe_turn[1].content = probe;
  absl::StatusOr<std::string> turn = t.RenderText(probe_turn, nullptr, false);
  if (turn.ok() && turn->find(probe) != std::string::npos) {
    const std::string after = turn->substr(turn->find(probe) + probe.size(), 64);
    absl::StatusOr<std::vector<int32_t>> ids = tokenizer.Encode(after, false);
    if (ids.ok() && !ids->empty() && tokenizer.IsSpecial(ids->front())) {
      t.end_of_turn_.push_back(ids->front());
    }
  }
  const std::string eos = TokenText(config, "eos_token");
  if (auto id = tokenizer.TokenId(eos);
      id && !eos.empty() &&
      std::find(t.end_of_turn_.begin(), t.end_of_turn_.end(), *id) == t.end_of_turn_.end()) {
    t.end_of_turn_.push_back(*id);
  }
  return t;
}

bool ChatTemplate::renders_tools() const { return template_.find("tools") != std::string::npos; }

std::string ChatTemplate::tool_call_format() const {
  if (template_.find("<tool_call>") != std::string::npos) return "hermes";
  if (template_.find("[TOOL_CALLS]") != std::string::npos) return "mistral";
  if (template_.find("<|python_tag|>") != std::string::npos ||
      template_.find("ipython") != std::string::npos) {
    return "llama3_json";
  }
  return "";
}

absl::StatusOr<std::string> ChatTemplate::RenderText(const std::vector<ChatMessage>& messages,
                                                     const nlohmann::ordered_json& tools,
                                                     bool add_generation_prompt) const {
  nlohmann::ordered_json ctx;
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  // Each message as apply_chat_template receives the request's: its role and content (null for
  // an assistant's calls alone), then what else it carries.
  for (const ChatMessage& m : messages) {
    nlohmann::ordered_json msg = {{"role", m.role}};
    msg["content"] =
        m.content_null ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(m.content);
    if (!m.name.empty()) msg["name"] = m.name;
    if (!m.tool_call_id.empty()) msg["tool_call_id"] = m.tool_call_id;
    if (!m.tool_calls.is_null()) msg["tool_calls"] = m.tool_calls;
    list.push_back(std::move(msg));
  }
  ctx["messages"] = std::move(list);
  ctx["tools"] = tools;
  ctx["documents"] = nullptr;
  ctx["add_generation_prompt"] = add_generation_prompt;
  for (const auto& [key, value] : special_) {
    if (!value.empty()) ctx[key] = value;
  }
  return RenderJinja(template_, ctx);
}

absl::StatusOr<RenderedChat> ChatTemplate::Render(const std::vector<ChatMessage>& messages,
                                                  const nlohmann::ordered_json& tools) const {
  if (!has_template()) {
    return absl::FailedPreconditionError(
        absl::StrCat("this model has no chat template: ", reason_, "; use /v1/completions"));
  }
  RenderedChat r;
  ASSIGN_OR_RETURN(r.text, RenderText(messages, tools, true));
  // Where the messages' text lies: the same template rendered with a marker for each message's
  // text, each marker then replaced by the text (as given, or trimmed, as templates often write
  // it), must give the prompt; the replacements' places are the ranges.
  std::vector<ChatMessage> marked = messages;
  for (size_t i = 0; i < marked.size(); ++i) {
    if (!marked[i].content_null) marked[i].content = absl::StrCat("\x02", i, "\x03");
  }
  absl::StatusOr<std::string> layout = RenderText(marked, tools, true);
  if (!layout.ok()) return r;  // the template looks at the text itself: no ranges
  for (const bool trimmed : {false, true}) {
    std::string text;
    std::vector<TextRange> ranges;
    size_t at = 0;
    for (;;) {
      const size_t open = layout->find('\x02', at);
      const size_t close = open == std::string::npos ? open : layout->find('\x03', open);
      size_t i = 0;
      if (close == std::string::npos ||
          !absl::SimpleAtoi(layout->substr(open + 1, close - open - 1), &i) ||
          i >= messages.size()) {
        text += layout->substr(at);
        break;
      }
      text += layout->substr(at, open - at);
      const absl::string_view content =
          trimmed ? absl::StripAsciiWhitespace(messages[i].content) : messages[i].content;
      if (!content.empty()) ranges.push_back({text.size(), text.size() + content.size()});
      absl::StrAppend(&text, content);
      at = close + 1;
    }
    if (text == r.text) {
      r.content = std::move(ranges);
      break;
    }
  }
  return r;
}

}  // namespace shardserve
