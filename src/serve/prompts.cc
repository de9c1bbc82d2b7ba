#include "serve/prompts.h"

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

absl::StatusOr<std::vector<int32_t>> PromptBuilder::Chat(const ApiRequest& req, int64_t context,
                                                         bool add_special) const {
  absl::StatusOr<RenderedChat> rendered = chat_->Render(
      req.messages, req.tool_choice != "none" ? req.tools : nlohmann::ordered_json(nullptr));
  if (!rendered.ok()) return BadParam("messages", std::string(rendered.status().message()));
  return Tokenize(rendered->text, add_special, context, "messages",
                  special_tokens_as_text_ ? rendered->content : std::vector<TextRange>{});
}

}  // namespace shardserve
