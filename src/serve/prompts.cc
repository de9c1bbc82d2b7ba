#include "serve/prompts.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardserve {

absl::StatusOr<std::vector<int32_t>> PromptBuilder::Tokenize(
    const std::string& text, bool add_special, int64_t context, const std::string& param,
    const std::vector<TextRange>& text_ranges) const {
  auto too_long = [&](const std::string& what) {
    return BadParam(param, absl::StrCat("this model's maximum context length is ", context,
                                        " tokens; the prompt ", what));
  };
  if (auto per_token = tokenizer_->MaxBytesPerToken();
      per_token && text.size() > static_cast<size_t>(context) * *per_token) {
    return too_long(
        absl::StrCat("has ", text.size(), " bytes, and no token covers more than ", *per_token));
  }
  absl::StatusOr<std::vector<int32_t>> ids =
      tokenizer_->Encode(text, add_special, static_cast<size_t>(context), text_ranges);
  if (ids.status().code() == absl::StatusCode::kOutOfRange) {
    return too_long(absl::StrCat("holds more than ", context, " tokens"));
  }
  if (!ids.ok()) return BadParam(param, std::string(ids.status().message()));
  return ids;
}

namespace {

// The strings of a JSON value (nested), for the special-token check.
void Strings(const nlohmann::ordered_json& j, std::vector<const std::string*>& out) {
  if (j.is_string()) out.push_back(&j.get_ref<const std::string&>());
  if (j.is_structured()) {
    for (const auto& v : j) Strings(v, out);
  }
}

}  // namespace

absl::StatusOr<std::vector<int32_t>> PromptBuilder::Chat(const ApiRequest& req, int64_t context,
                                                         bool add_special,
                                                         std::string* text) const {
  ChatOptions options = req.chat_options;
  options.tools = req.tool_choice != "none" ? req.tools : nlohmann::ordered_json(nullptr);
  std::optional<ChatTemplate> own;
  if (req.chat_template) {
    if (!trust_request_templates_) {
      return BadParam("chat_template",
                      "a request's own 'chat_template' is refused: this deployment renders the "
                      "model's (spec.serving.trustRequestChatTemplate allows them)");
    }
    own = chat_->WithTemplate(*req.chat_template, "the request's chat_template");
  }
  // The template writes these strings where no message's text is: with special tokens in
  // content as text, one holding a special token's text would slip one into the prompt.
  if (special_tokens_as_text_) {
    std::vector<std::pair<std::string, const nlohmann::ordered_json*>> fields = {
        {"chat_template_kwargs", &options.kwargs}, {"documents", &options.documents}};
    for (size_t i = 0; i < req.messages.size(); ++i) {
      fields.emplace_back(absl::StrCat("messages[", i, "].reasoning_content"),
                          &req.messages[i].reasoning_content);
    }
    for (const auto& [field, value] : fields) {
      std::vector<const std::string*> strings;
      Strings(*value, strings);
      for (const std::string* s : strings) {
        if (s->empty()) continue;
        // (bounded: the request body's size; no context limit, or a long text would read as
        // one holding a special token)
        absl::StatusOr<std::vector<int32_t>> plain =
            tokenizer_->Encode(*s, false, 0, {{0, s->size()}});
        absl::StatusOr<std::vector<int32_t>> parsed = tokenizer_->Encode(*s, false, 0);
        if (!plain.ok() || !parsed.ok()) {
          return BadParam(field, std::string((plain.ok() ? parsed : plain).status().message()));
        }
        if (*plain != *parsed) {
          return BadParam(field, absl::StrCat("a '", field,
                                              "' string holds a special token's text, which "
                                              "this deployment keeps out of prompts "
                                              "(spec.serving.specialTokensInContent: text)"));
        }
      }
    }
  }
  // What the template does not read would be dropped without a word: refused by name.
  const ChatTemplate& t = own ? *own : *chat_;
  if (options.kwargs.is_object()) {
    for (const auto& [key, value] : options.kwargs.items()) {
      if (!t.reads(key)) {
        return BadParam("chat_template_kwargs",
                        absl::StrCat("the chat template (", t.source(), ") does not read '", key,
                                     "' (chat_template_kwargs)"));
      }
    }
  }
  if (!options.documents.is_null() && !t.reads("documents")) {
    return BadParam("documents",
                    absl::StrCat("the chat template (", t.source(), ") does not render documents"));
  }
  absl::StatusOr<RenderedChat> rendered = t.Render(req.messages, options);
  if (!rendered.ok()) {
    const absl::string_view m = rendered.status().message();
    return BadParam(absl::StartsWith(m, "continue_final_message") ? "continue_final_message"
                    : own                                         ? "chat_template"
                                                                  : "messages",
                    std::string(m));
  }
  if (text != nullptr) *text = rendered->text;
  return Tokenize(rendered->text, add_special, context, "messages",
                  special_tokens_as_text_ ? rendered->content : std::vector<TextRange>{});
}

}  // namespace shardserve
