#pragma once
// A model's reasoning apart from its answer, as vLLM's reasoning parsers give it
// (`reasoning_content`): the text of a <think>...</think> block (Qwen3, QwQ, DeepSeek-R1). The
// block may open in the prompt (a template that writes "<think>\n" where the reply begins, as
// DeepSeek-R1's and Qwen3's thinking models' do: the output starts inside it) or in the output
// (Qwen3 writes <think> itself; with enable_thinking false the template writes an empty block, and
// the output is all answer). Text after </think> is the answer; an output that ends inside the
// block is all reasoning (the model never answered). The parser takes the output as it streams:
// it holds back only what may be the start of a tag.
#include <string>
#include <string_view>

namespace shardserve {

class ReasoningParser {
 public:
  // `in_block`: the prompt ends inside a <think> block (PromptEndsThinking).
  explicit ReasoningParser(bool in_block);

  struct Out {
    std::string reasoning;
    std::string content;
  };
  Out Add(std::string_view text);
  Out Finish();  // what was held back

 private:
  enum class State { kStart, kReasoning, kContent };
  State state_;
  bool fresh_;  // at the start of a block the prompt opened
  std::string held_;
};

// Whether a rendered prompt ends inside a <think> block (its last <think> after its last
// </think>).
bool PromptEndsThinking(std::string_view prompt);

}  // namespace shardserve
