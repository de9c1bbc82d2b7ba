#include "serve/reasoning.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>

namespace shardserve {
namespace {

// The output fed in pieces of `step` bytes (1: a character at a time, as a stream may cut it).
std::pair<std::string, std::string> Split(bool in_block, const std::string& output, size_t step) {
  ReasoningParser p(in_block);
  std::string reasoning, content;
  for (size_t i = 0; i < output.size(); i += step) {
    ReasoningParser::Out o = p.Add(output.substr(i, step));
    reasoning += o.reasoning;
    content += o.content;
  }
  ReasoningParser::Out o = p.Finish();
  return {reasoning + o.reasoning, content + o.content};
}

TEST(ReasoningParser, TakesTheThinkBlockOutOfTheAnswer) {
  using R = std::pair<std::string, std::string>;
  for (size_t step : {1, 2, 3, 5, 100}) {
    // Opened by the prompt (DeepSeek-R1, Qwen3 thinking models): the output starts inside.
    EXPECT_EQ(Split(true, "a < b </thi</think>\n\nYes.", step), R("a < b </thi", "\n\nYes."));
    EXPECT_EQ(Split(true, "<think>\nhm</think>ok", step), R("\nhm", "ok")) << "repeated <think>";
    EXPECT_EQ(Split(true, "still thinking <", step), R("still thinking <", ""))
        << "an output that ends in the block is all reasoning";
    // Opened by the output (Qwen3 writes <think> itself).
    EXPECT_EQ(Split(false, "\n<think>why</think>because", step), R("why", "because"));
    EXPECT_EQ(Split(false, "<thin", step), R("", "<thin")) << "a tag never finished is text";
    // No block: all answer (a template that closed it, enable_thinking false).
    EXPECT_EQ(Split(false, "plain <think> later", step), R("", "plain <think> later"));
    EXPECT_EQ(Split(false, "", step), R("", ""));
  }
}

TEST(ReasoningParser, KnowsWhereThePromptEnds) {
  EXPECT_TRUE(PromptEndsThinking("<|im_start|>assistant\n<think>\n"));
  EXPECT_FALSE(PromptEndsThinking("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
  EXPECT_TRUE(PromptEndsThinking("<think>a</think> then <think>"));
  EXPECT_FALSE(PromptEndsThinking("<|im_start|>assistant\n"));
}

}  // namespace
}  // namespace shardserve
