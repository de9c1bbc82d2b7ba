#pragma once
// Chat prompts for the model families whose chat format shardserve knows: Llama 3 (header
// tokens), ChatML (Qwen2), Llama 2 ([INST] with <<SYS>>) and Mistral ([INST]). The family is
// read from the model directory's chat_template.jinja or tokenizer_config.json `chat_template`
// (a GGUF file's tokenizer.chat_template; without any, from the tokenizer's special tokens);
// shardserve renders the family's format itself rather than running the Jinja text. A model whose
// template is of no known family gets no chat template, and the reason says so.
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
  enum class Family { kNone, kLlama3, kChatMl, kLlama2, kMistral };

  // Never fails: an unreadable or unknown template gives kNone with the reason.
  static ChatTemplate ForModel(const std::string& model_dir, const Tokenizer& tokenizer);

  Family family() const { return family_; }
  const char* name() const;
  // Why there is no template (kNone only).
  const std::string& reason() const { return reason_; }

  // The prompt for `messages`, ending where the assistant's reply begins, with the ranges of
  // the messages' text in it. Messages that the family cannot express (e.g. roles out of turn for
  // Llama 2) are InvalidArgument.
  absl::StatusOr<RenderedChat> Render(const std::vector<ChatMessage>& messages) const;
  // Tokens that end the assistant's turn (generation stops there).
  const std::vector<int64_t>& end_of_turn_ids() const { return end_of_turn_; }

 private:
  Family family_ = Family::kNone;
  std::string reason_;
  std::string bos_, eos_;
  std::string default_system_;  // ChatML templates that add one when none is given
  std::vector<int64_t> end_of_turn_;
};

}  // namespace shardserve
