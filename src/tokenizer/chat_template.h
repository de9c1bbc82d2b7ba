#pragma once
// Chat prompts rendered by the model's own Jinja template (tokenizer/jinja.h), as Hugging Face's
// apply_chat_template renders it: the template of the model directory's chat_template.jinja, of
// tokenizer_config.json's `chat_template` (a string, or the "default" of a list of named ones),
// or of a GGUF file's tokenizer.chat_template (or one the deployment or request gives instead);
// the variables apply_chat_template gives it (messages, tools and documents, None when not given,
// add_generation_prompt, the special tokens bos_token, eos_token, unk_token, pad_token, and the
// request's chat_template_kwargs). Messages reach it as vLLM hands them over: a template that
// iterates a message's content (list style) gets its text parts as [{"type": "text", "text"}],
// any other (string style) the parts joined by "\n"; a null content is "" (or []). A model without
// a template gets none, and the reason says so.
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "tokenizer/tokenizer.h"

namespace shardserve {

struct ChatMessage {
  std::string role;           // system | user | assistant | tool
  std::string content;        // the text (parts joined by "\n", for string-style templates)
  bool content_null = false;  // an assistant's turn of tool calls without text
  std::string name;           // optional
  std::string tool_call_id;   // tool: the call it answers
  // assistant: [{id?, type: "function", function: {name, arguments (an object)}}]; null: none.
  nlohmann::ordered_json tool_calls;
  // assistant: its reasoning, given back (reasoning_content, as vLLM passes it to the template;
  // a template that does not read it drops it, as transformers' does); null: none.
  nlohmann::ordered_json reasoning_content;
  // The content's text parts when it came as a list (list-style templates get them apart); empty:
  // the content is one part (none when null).
  std::vector<std::string> parts;
};

// How a chat is rendered, beyond its messages (vLLM's request fields).
struct ChatOptions {
  nlohmann::ordered_json tools;      // the request's functions, or null (None)
  nlohmann::ordered_json documents;  // the request's documents, or null (None)
  nlohmann::ordered_json kwargs;     // chat_template_kwargs: more variables (an object), or null
  bool add_generation_prompt = true;
  // The prompt ends inside the last message, its text to be continued (transformers' way: the
  // template renders it, the prompt is cut where its text ends).
  bool continue_final_message = false;
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
  // `own`: a template that replaces the model's (spec.serving.chatTemplate), "" for the model's.
  static ChatTemplate ForModel(const std::string& model_dir, const Tokenizer& tokenizer,
                               const std::string& own = "");
  // This model's special tokens and end of turn with another template (a request's own).
  ChatTemplate WithTemplate(std::string text, std::string source) const;

  bool has_template() const { return !template_.empty(); }
  // Where the template came from ("tokenizer_config.json", "chat_template.jinja", "GGUF"), or
  // "none".
  const std::string& source() const { return source_; }
  // Why there is no template.
  const std::string& reason() const { return reason_; }

  // The prompt for `messages` (and `tools`, the request's list of functions, or null), ending
  // where the assistant's reply begins, with the ranges of the messages' text in it (found in
  // order where the template wrote each unchanged). The template's own errors (raise_exception:
  // roles out of turn, ...) are InvalidArgument quoting it.
  absl::StatusOr<RenderedChat> Render(const std::vector<ChatMessage>& messages,
                                      const ChatOptions& options = {}) const;
  // Whether the template's text holds `text` (a marker it writes).
  bool writes(std::string_view text) const { return template_.find(text) != std::string::npos; }
  // Whether it names the variable `name` (a whole word: `enable_thinkin` is not
  // `enable_thinking`).
  bool reads(std::string_view name) const;
  // Whether the template reads the `tools` variable at all (one that does not would drop them).
  bool renders_tools() const;
  // Whether it iterates a message's content (vLLM's "openai" content format): it gets the parts.
  bool list_content() const { return list_content_; }
  // The format the template teaches the model for its tool calls, by the markers it writes:
  // "hermes" (<tool_call>{"name": ..., "arguments": ...}</tool_call>: Hermes, Qwen 2.5/3),
  // "qwen3_coder" (<tool_call><function=...>: Qwen3-Coder's XML), "llama3_json" (a bare
  // {"name": ..., "parameters": ...}: Llama 3.1-3.3, <|python_tag|>), "pythonic"
  // ([func_name1(params_name1=...)]: Llama 3.2 / 4 pythonic), "mistral" ([TOOL_CALLS]),
  // "deepseek_v3" / "deepseek_v31" (<｜tool▁calls▁begin｜>, the arguments in a ```json fence or
  // not), "kimi_k2" (<|tool_calls_section_begin|>), "openai" (<|channel|>: gpt-oss's harmony);
  // "" when
  // it shows none, or the markers of more than one (spec.serving.toolCallParser names it then).
  std::string tool_call_format() const;
  // Tokens that end the assistant's turn (generation stops there): the special token the template
  // writes right after an assistant message, and the tokenizer's eos_token.
  const std::vector<int64_t>& end_of_turn_ids() const { return end_of_turn_; }

 private:
  // The text of the messages (a part each in list style, else a message each; markers
  // replace them when `marked`), cut where the final message's text ends when continuing it.
  absl::StatusOr<std::string> RenderText(const std::vector<ChatMessage>& messages,
                                         const ChatOptions& options, bool marked) const;
  void SetTemplate(std::string text);

  std::string template_;
  bool list_content_ = false;
  std::string source_ = "none";
  std::string reason_;
  std::vector<std::pair<std::string, std::string>> special_;  // bos_token, eos_token, ...
  std::vector<int64_t> end_of_turn_;
};

}  // namespace shardserve
