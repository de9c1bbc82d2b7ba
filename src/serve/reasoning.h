#pragma once
// A model's reasoning apart from its answer, as vLLM's reasoning parsers give it
// (`reasoning_content`): the text of a <think>...</think> block (Qwen3, QwQ, DeepSeek-R1). The
// block may open in the prompt (a template that writes "<think>\n" where the reply begins, as
// DeepSeek-R1's and Qwen3's thinking models' do: the output starts inside it) or in the output
// (Qwen3 writes <think> itself; with enable_thinking false the template writes an empty block, and
// the output is all answer). Text after </think> is the answer; an output that ends inside the
// block is all reasoning (the model never answered). The parser takes the output as it streams:
// it holds back only what may be the start of a tag.
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "model/generation.h"
#include "tokenizer/tokenizer.h"

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

// Structured output applied to the answer, after the reasoning (as vLLM's reasoning parsers do):
// a constraint held off while the model reasons. Any token is allowed in a <think> block the
// prompt opened, or in one the output opens with the tokenizer's own <think> token as its first;
// from the token after </think> on, the inner constraint rules (its grammar starts there). While
// reasoning, a token that would end the block and carry text after it (`>` followed by more than
// white space) is not allowed: the grammar sees all of the answer.
class ReasoningGate {
 public:
  // Built once per model: the vocabulary's free mask and its <think> token (-1: none).
  ReasoningGate(const Tokenizer& tokenizer, int64_t vocab_size);

  // `inner` behind the gate; `in_block`: the prompt ends inside a <think> block. The tokenizer
  // given above must outlive the result.
  std::unique_ptr<TokenConstraint> Wrap(std::unique_ptr<TokenConstraint> inner,
                                        bool in_block) const;
  // gpt-oss's harmony: free until the final channel's message begins
  // (<|channel|>final ... <|message|>), then `inner`.
  std::unique_ptr<TokenConstraint> WrapHarmony(std::unique_ptr<TokenConstraint> inner) const;

 private:
  const Tokenizer* tokenizer_;
  std::shared_ptr<const std::vector<uint32_t>> free_mask_;
  int32_t open_id_ = -1;
};

// Whether a rendered prompt ends inside a <think> block (its last <think> after its last
// </think>).
bool PromptEndsThinking(std::string_view prompt);

}  // namespace shardserve
