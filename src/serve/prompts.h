#pragma once
// A request's prompt as the leader feeds it to the model: a chat's messages (and tools) rendered
// by the model's own template, or a completion's text, tokenized within the context. Shared by
// the leader's API (serve/api_server.h) and the router (router/router.h), which names the KV
// blocks a prompt would take exactly as the leader does.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "serve/openai.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace shardserve {

class PromptBuilder {
 public:
  // `special_tokens_as_text`: a chat message's special-token strings are text
  // (spec.serving.specialTokensInContent); `trust_request_templates`: a request may bring its own
  // chat_template (spec.serving.trustRequestChatTemplate, vLLM's
  // --trust-request-chat-template). The tokenizer and template outlive the builder.
  PromptBuilder(const Tokenizer* tokenizer, const ChatTemplate* chat, bool special_tokens_as_text,
                bool trust_request_templates = false)
      : tokenizer_(tokenizer),
        chat_(chat),
        special_tokens_as_text_(special_tokens_as_text),
        trust_request_templates_(trust_request_templates) {}

  // A text's tokens, its cost bounded by the context before any work: a text that cannot fit is
  // refused by its size, and tokenizing stops as soon as the context is exceeded; errors are
  // BadParam(param). `text_ranges`: where special tokens are text (Tokenizer::Encode).
  absl::StatusOr<std::vector<int32_t>> Tokenize(
      const std::string& text, bool add_special, int64_t context, const std::string& param,
      const std::vector<TextRange>& text_ranges = {}) const;
  // A chat request's prompt: its messages (and tools, unless tool_choice is none) rendered with
  // its chat options (by its own template where trusted, else refused naming chat_template),
  // then tokenized; a template error is BadParam("messages") quoting it. Where special tokens in
  // content are text, a chat_template_kwargs or documents string holding one is refused (the
  // template would write it where no message's text is).
  // `text`, when given, receives the rendered prompt.
  absl::StatusOr<std::vector<int32_t>> Chat(const ApiRequest& req, int64_t context,
                                            bool add_special = false,
                                            std::string* text = nullptr) const;

 private:
  const Tokenizer* tokenizer_;
  const ChatTemplate* chat_;
  bool special_tokens_as_text_;
  bool trust_request_templates_;
};

}  // namespace shardserve
