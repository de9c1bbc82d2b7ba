#include "tokenizer/chat_template.h"

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/text.h"
#include "model/gguf_model.h"

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
      if (t.is_object() && t.value("name", "") == "default" && t.contains("template") &&
          t["template"].is_string()) {
        return t["template"].get<std::string>();
      }
    }
  }
  return "";
}

std::string Trim(const std::string& s) { return std::string(absl::StripAsciiWhitespace(s)); }

// The system message a ChatML template adds when the conversation has none (Qwen2's "You are a
// helpful assistant.", SmolLM2's own): the literal text of its system turn, if it writes one.
std::string DefaultSystem(const std::string& tmpl) {
  for (const char* open : {"<|im_start|>system\\n", "<|im_start|>system\n"}) {
    const size_t at = tmpl.find(open);
    if (at == std::string::npos) continue;
    const size_t begin = at + std::strlen(open), end = tmpl.find("<|im_end|>", begin);
    if (end == std::string::npos) continue;
    const std::string text = tmpl.substr(begin, end - begin);
    if (text.find_first_of("{}'\"\\") == std::string::npos) return text;  // literal text only
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
    }
  }
  t.bos_ = TokenText(config, "bos_token");
  t.eos_ = TokenText(config, "eos_token");
  const std::string tmpl = TemplateText(config);
  auto has = [&](const char* marker) {
    return tmpl.empty() ? tokenizer.TokenId(marker).has_value()
                        : tmpl.find(marker) != std::string::npos;
  };
  if (has("<|start_header_id|>")) {
    t.family_ = Family::kLlama3;
    if (auto id = tokenizer.TokenId("<|eot_id|>")) t.end_of_turn_.push_back(*id);
  } else if (has("<|im_start|>")) {
    t.family_ = Family::kChatMl;
    if (auto id = tokenizer.TokenId("<|im_end|>")) t.end_of_turn_.push_back(*id);
    t.default_system_ = DefaultSystem(tmpl);
  } else if (!tmpl.empty() && tmpl.find("<<SYS>>") != std::string::npos) {
    t.family_ = Family::kLlama2;
  } else if (!tmpl.empty() && tmpl.find("[INST]") != std::string::npos) {
    t.family_ = Family::kMistral;
  } else {
    t.reason_ = tmpl.empty() ? "the model has no chat_template in tokenizer_config.json"
                             : "the model's chat_template is not of a family shardserve knows "
                               "(Llama 2, Llama 3, Mistral, ChatML)";
    return t;
  }
  if (auto id = tokenizer.TokenId(t.eos_); id && !t.eos_.empty()) t.end_of_turn_.push_back(*id);
  return t;
}

const char* ChatTemplate::name() const {
  switch (family_) {
    case Family::kLlama3:
      return "llama3";
    case Family::kChatMl:
      return "chatml";
    case Family::kLlama2:
      return "llama2";
    case Family::kMistral:
      return "mistral";
    case Family::kNone:
      break;
  }
  return "none";
}

absl::StatusOr<RenderedChat> ChatTemplate::Render(const std::vector<ChatMessage>& messages) const {
  RenderedChat r;
  std::string& out = r.text;
  // A message's text, appended where the format puts it, and its range noted.
  auto content = [&r](std::string_view text) {
    if (!text.empty()) r.content.push_back({r.text.size(), r.text.size() + text.size()});
    r.text.append(text);
  };
  switch (family_) {
    case Family::kNone:
      return absl::FailedPreconditionError(
          absl::StrCat("this model has no chat template: ", reason_, "; use /v1/completions"));
    case Family::kLlama3:
      out = bos_;
      for (const ChatMessage& m : messages) {
        absl::StrAppend(&out, "<|start_header_id|>", m.role, "<|end_header_id|>\n\n");
        content(Trim(m.content));
        absl::StrAppend(&out, "<|eot_id|>");
      }
      absl::StrAppend(&out, "<|start_header_id|>assistant<|end_header_id|>\n\n");
      return r;
    case Family::kChatMl:
      if (!default_system_.empty() && messages.front().role != "system") {
        absl::StrAppend(&out, "<|im_start|>system\n", default_system_, "<|im_end|>\n");
      }
      for (const ChatMessage& m : messages) {
        absl::StrAppend(&out, "<|im_start|>", m.role, "\n");
        content(m.content);
        absl::StrAppend(&out, "<|im_end|>\n");
      }
      absl::StrAppend(&out, "<|im_start|>assistant\n");
      return r;
    case Family::kLlama2:
    case Family::kMistral:
      break;
  }
  // [INST] families: an optional system message, then user and assistant turns alternating,
  // ending with the user.
  size_t first = 0;
  const bool has_system = messages.front().role == "system";
  if (has_system) first = 1;
  for (size_t i = first; i < messages.size(); ++i) {
    const bool user_turn = (i - first) % 2 == 0;
    const ChatMessage& m = messages[i];
    if (m.role != (user_turn ? "user" : "assistant")) {
      return absl::InvalidArgumentError(
          absl::StrCat("this model's ", name(),
                       " chat format needs user and assistant messages alternating "
                       "after an optional system message; messages[",
                       i, "] is '", m.role, "'"));
    }
    if (user_turn) {
      // Llama 2 opens every turn with BOS, Mistral only the conversation.
      const bool bos = family_ == Family::kLlama2 || i == first;
      absl::StrAppend(&out, bos ? bos_ : "", "[INST] ");
      if (i == first && has_system) {
        const std::string& system = messages.front().content;
        if (family_ == Family::kLlama2) {
          absl::StrAppend(&out, "<<SYS>>\n");
          content(system);
          absl::StrAppend(&out, "\n<</SYS>>\n\n");
        } else {
          content(system);
          absl::StrAppend(&out, "\n\n");
        }
      }
      content(Trim(m.content));
      absl::StrAppend(&out, family_ == Family::kLlama2 ? " [/INST]" : "[/INST]");
    } else {
      absl::StrAppend(&out, " ");
      content(Trim(m.content));
      absl::StrAppend(&out, family_ == Family::kLlama2 ? " " : "", eos_);
    }
  }
  if (messages.back().role != "user") {
    return absl::InvalidArgumentError(
        absl::StrCat("this model's ", name(), " chat format needs the last message from the user"));
  }
  return r;
}

}  // namespace shardserve
