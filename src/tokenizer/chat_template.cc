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

namespace {

// Whether the template loops over a message's content ({% for part in message['content'] %} or
// message.content): vLLM's content-format detection. A linear scan (a template may be a
// request's, and std::regex recurses per character).
bool LoopsOverContent(std::string_view t) {
  auto space = [&](size_t& i) {
    while (i < t.size() && absl::ascii_isspace(t[i])) ++i;
  };
  auto word = [&](size_t& i) {
    const size_t from = i;
    while (i < t.size() && (absl::ascii_isalnum(t[i]) || t[i] == '_')) ++i;
    return t.substr(from, i - from);
  };
  for (size_t at = t.find("{%"); at != std::string_view::npos; at = t.find("{%", at + 2)) {
    size_t i = at + 2;
    if (i < t.size() && t[i] == '-') ++i;
    space(i);
    if (word(i) != "for") continue;
    space(i);
    if (word(i).empty()) continue;
    space(i);
    if (word(i) != "in") continue;
    space(i);
    if (word(i).empty()) continue;
    space(i);
    if (t.substr(i, 8) == ".content") {
      i += 8;
    } else if (i < t.size() && t[i] == '[') {
      ++i;
      space(i);
      if (i >= t.size() || (t[i] != '\'' && t[i] != '"')) continue;
      const char quote = t[i++];
      if (t.substr(i, 7) != "content" || i + 7 >= t.size() || t[i + 7] != quote) continue;
      i += 8;
      space(i);
      if (i >= t.size() || t[i] != ']') continue;
      ++i;
    } else {
      continue;
    }
    space(i);
    if (i < t.size() && (t[i] == '-' || t[i] == '|' || t[i] == '%')) return true;
  }
  return false;
}

}  // namespace

bool ChatTemplate::reads(std::string_view name) const {
  if (name.empty()) return false;
  auto word = [](char c) { return absl::ascii_isalnum(c) || c == '_'; };
  for (size_t at = template_.find(name); at != std::string::npos;
       at = template_.find(name, at + 1)) {
    const size_t end = at + name.size();
    if ((at == 0 || !word(template_[at - 1])) && (end == template_.size() || !word(template_[end])))
      return true;
  }
  return false;
}

void ChatTemplate::SetTemplate(std::string text) {
  template_ = std::move(text);
  list_content_ = LoopsOverContent(template_);
}

ChatTemplate ChatTemplate::WithTemplate(std::string text, std::string source) const {
  ChatTemplate t = *this;
  t.SetTemplate(std::move(text));
  t.source_ = std::move(source);
  return t;
}

ChatTemplate ChatTemplate::ForModel(const std::string& model_dir, const Tokenizer& tokenizer,
                                    const std::string& own) {
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
  if (!own.empty()) {
    t.SetTemplate(own);
    t.source_ = "spec.serving.chatTemplate";
  } else {
    t.SetTemplate(TemplateText(config));
  }
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
  ChatOptions probe_options;
  probe_options.add_generation_prompt = false;
  absl::StatusOr<std::string> turn = t.RenderText(probe_turn, probe_options, false);
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
  std::vector<const char*> shown;
  if (writes("<tool_call>")) shown.push_back(writes("<function=") ? "qwen3_coder" : "hermes");
  if (writes("[TOOL_CALLS]")) shown.push_back("mistral");
  // DeepSeek-V3 writes each call's arguments in a ```json fence after its name; V3.1 bare.
  if (writes("<｜tool▁calls▁begin｜>")) {
    shown.push_back(writes("```json") ? "deepseek_v3" : "deepseek_v31");
  }
  if (writes("<|tool_calls_section_begin|>")) shown.push_back("kimi_k2");
  if (writes("<|channel|>")) shown.push_back("openai");  // gpt-oss's harmony
  // Llama 3.2 / 4's pythonic templates teach "[func_name1(params_name1=params_value1, ...)]"
  // (and name the ipython role, as Llama 3.1's JSON ones do).
  if (writes("[func_name1(")) {
    shown.push_back("pythonic");
  } else if (writes("<|python_tag|>") || writes("ipython")) {
    shown.push_back("llama3_json");
  }
  return shown.size() == 1 ? shown[0] : "";  // none, or more than one: not guessed
}

namespace {

// transformers' marker for the end of a message to be continued.
constexpr absl::string_view kContinueTag = "CONTINUE_FINAL_MESSAGE_TAG ";

std::string Marker(size_t k) { return absl::StrCat("\x02", k, "\x03"); }

// A message's text parts: as given in a list, else its content (none when null).
std::vector<absl::string_view> PartsOf(const ChatMessage& m) {
  if (!m.parts.empty()) return {m.parts.begin(), m.parts.end()};
  if (m.content_null) return {};
  return {m.content};
}

}  // namespace

absl::StatusOr<std::string> ChatTemplate::RenderText(const std::vector<ChatMessage>& messages,
                                                     const ChatOptions& options,
                                                     bool marked) const {
  using ojson = nlohmann::ordered_json;
  const bool continuing = options.continue_final_message;
  if (continuing) {
    if (messages.empty()) {
      return absl::InvalidArgumentError("continue_final_message: there is no message to continue");
    }
    if (PartsOf(messages.back()).empty()) {
      return absl::InvalidArgumentError(
          "continue_final_message: the final message has no text to continue");
    }
    if (template_.find("content") == std::string::npos) {
      return absl::InvalidArgumentError(
          "continue_final_message: this chat template writes no message's content");
    }
  }
  ojson ctx;
  ojson list = ojson::array();
  size_t unit = 0;  // the text's place among the messages' texts (a marker's number)
  // Each message as vLLM hands it to apply_chat_template: its role and content, then what else
  // it carries.
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    const bool last = continuing && i + 1 == messages.size();
    ojson msg = {{"role", m.role}};
    if (list_content_) {
      const std::vector<absl::string_view> texts = PartsOf(m);
      ojson parts = ojson::array();
      for (size_t p = 0; p < texts.size(); ++p) {
        std::string text = marked ? Marker(unit++) : std::string(texts[p]);
        if (last && p + 1 == texts.size()) absl::StrAppend(&text, kContinueTag);
        parts.push_back({{"type", "text"}, {"text", std::move(text)}});
      }
      msg["content"] = std::move(parts);
    } else {
      std::string text = marked && !m.content_null ? Marker(unit++) : m.content;
      if (last) absl::StrAppend(&text, kContinueTag);
      msg["content"] = std::move(text);
    }
    if (!m.name.empty()) msg["name"] = m.name;
    if (!m.tool_call_id.empty()) msg["tool_call_id"] = m.tool_call_id;
    if (!m.tool_calls.is_null()) msg["tool_calls"] = m.tool_calls;
    if (!m.reasoning_content.is_null()) msg["reasoning_content"] = m.reasoning_content;
    list.push_back(std::move(msg));
  }
  for (const auto& [key, value] : special_) {
    if (!value.empty()) ctx[key] = value;
  }
  if (options.kwargs.is_object()) {
    for (const auto& [key, value] : options.kwargs.items()) ctx[key] = value;
  }
  ctx["messages"] = std::move(list);
  ctx["tools"] = options.tools;
  ctx["documents"] = options.documents;
  ctx["add_generation_prompt"] = options.add_generation_prompt && !continuing;
  ASSIGN_OR_RETURN(std::string text, RenderJinja(template_, ctx));
  if (!continuing) return text;
  // Cut where the final message's text ends (transformers' check and cut).
  const absl::string_view tag = absl::StripTrailingAsciiWhitespace(kContinueTag);
  const size_t at = text.rfind(tag.data(), std::string::npos, tag.size());
  const std::string final_text =
      marked ? Marker(unit - 1)
             : std::string(absl::StripAsciiWhitespace(PartsOf(messages.back()).back()));
  if (at == std::string::npos || text.find(final_text) == std::string::npos) {
    return absl::InvalidArgumentError(
        "continue_final_message: the final message's text does not appear in the prompt (the "
        "chat template drops part of it)");
  }
  if (absl::string_view(text).substr(at, kContinueTag.size()) == kContinueTag) {
    text.resize(at);
  } else {
    text = std::string(absl::StripTrailingAsciiWhitespace(absl::string_view(text).substr(0, at)));
  }
  return text;
}

absl::StatusOr<RenderedChat> ChatTemplate::Render(const std::vector<ChatMessage>& messages,
                                                  const ChatOptions& options) const {
  if (!has_template()) {
    return absl::FailedPreconditionError(
        absl::StrCat("this model has no chat template: ", reason_, "; use /v1/completions"));
  }
  RenderedChat r;
  ASSIGN_OR_RETURN(r.text, RenderText(messages, options, false));
  // Where the messages' text lies: the same template rendered with a marker for each text (a
  // part in list style, a message's content else), each marker then replaced by the text (as
  // given, or trimmed, as templates often write it), must give the prompt; the replacements'
  // places are the ranges.
  std::vector<absl::string_view> texts;
  for (const ChatMessage& m : messages) {
    if (list_content_) {
      for (absl::string_view p : PartsOf(m)) texts.push_back(p);
    } else if (!m.content_null) {
      texts.push_back(m.content);
    }
  }
  absl::StatusOr<std::string> layout = RenderText(messages, options, true);
  if (!layout.ok()) return r;  // the template looks at the text itself: no ranges
  for (const bool trimmed : {false, true}) {
    std::string text;
    std::vector<TextRange> ranges;
    size_t at = 0;
    for (;;) {
      const size_t open = layout->find('\x02', at);
      const size_t close = open == std::string::npos ? open : layout->find('\x03', open);
      size_t k = 0;
      if (close == std::string::npos ||
          !absl::SimpleAtoi(layout->substr(open + 1, close - open - 1), &k) || k >= texts.size()) {
        text += layout->substr(at);
        break;
      }
      text += layout->substr(at, open - at);
      const absl::string_view content = trimmed ? absl::StripAsciiWhitespace(texts[k]) : texts[k];
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
