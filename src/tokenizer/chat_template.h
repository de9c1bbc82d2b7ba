#pragma once
// Chat prompts rendered by the model's own Jinja template (tokenizer/jinja.h), as Hugging Face's
// apply_chat_template renders it: the template of the model directory's chat_template.jinja, of
// tokenizer_config.json's `chat_template` (a string, or the "default" of a list of named ones),
// or of a GGUF file's tokenizer.chat_template; the variables apply_chat_template gives it
// (messages, tools and documents as null, add_generation_prompt, the special tokens bos_token,
// eos_token, unk_token, pad_token). A model without a template gets none, and the reason says so.
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tokenizer/tokenizer.h"

namespace shardserve {

struct ChatMessage {
  std::string role;  // system | user | assistant
  std::string content;
};

// A rendered chat prompt and where the messages' own text lies in it (in order, apart).
struct RenderedChat {
  std::string text;
  std::vector<TextRange> content;
};

class ChatTemplate {
 public:
  // Never fails: an unreadable template, or none, gives a ChatTemplate without one and the
  // reason.
  static ChatTemplate ForModel(const std::string& model_dir, const Tokenizer& tokenizer);

  bool has_template() const { return !template_.empty(); }
  // Where the template came from ("tokenizer_config.json", "chat_template.jinja", "GGUF"), or
  // "none".
  const std::string& source() const { return source_; }
  // Why there is no template.
  const std::string& reason() const { return reason_; }

  // The prompt for `messages`, ending where the assistant's reply begins, with the ranges of
  // the messages' text in it (found in order where the template wrote each unchanged). The
  // template's own errors (raise_exception: roles out of turn, ...) are InvalidArgument quoting
  // it.
  absl::StatusOr<RenderedChat> Render(const std::vector<ChatMessage>& messages) const;
  // Tokens that end the assistant's turn (generation stops there): the special token the template
  // writes right after an assistant message, and the tokenizer's eos_token.
  const std::vector<int64_t>& end_of_turn_ids() const { return end_of_turn_; }

 private:
  absl::StatusOr<std::string> RenderText(const std::vector<ChatMessage>& messages,
                                         bool add_generation_prompt) const;

  std::string template_;
  std::string source_ = "none";
  std::string reason_;
  std::vector<std::pair<std::string, std::string>> special_;  // bos_token, eos_token, ...
  std::vector<int64_t> end_of_turn_;
};

}  // namespace shardserve
