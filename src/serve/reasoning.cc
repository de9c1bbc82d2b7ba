#include "serve/reasoning.h"

#include <algorithm>

namespace shardserve {
namespace {

constexpr std::string_view kOpen = "<think>";
constexpr std::string_view kClose = "</think>";

// The length of the longest suffix of `text` that is a proper prefix of `tag`.
size_t PartialTagAtEnd(std::string_view text, std::string_view tag) {
  for (size_t n = std::min(text.size(), tag.size() - 1); n > 0; --n) {
    if (text.substr(text.size() - n) == tag.substr(0, n)) return n;
  }
  return 0;
}

}  // namespace

ReasoningParser::ReasoningParser(bool in_block)
    : state_(in_block ? State::kReasoning : State::kStart), fresh_(in_block) {}

ReasoningParser::Out ReasoningParser::Add(std::string_view text) {
  Out out;
  held_.append(text);
  for (;;) {
    if (state_ == State::kStart) {
      // The output opens a block only with <think> first (white space before it aside).
      const size_t first = held_.find_first_not_of(" \t\r\n");
      const std::string_view rest =
          std::string_view(held_).substr(first == std::string::npos ? held_.size() : first);
      if (rest.size() >= kOpen.size() && rest.substr(0, kOpen.size()) == kOpen) {
        held_.erase(0, held_.size() - rest.size() + kOpen.size());
        state_ = State::kReasoning;
        continue;
      }
      if (kOpen.substr(0, rest.size()) == rest) return out;  // may be its beginning
      state_ = State::kContent;
    }
    if (state_ == State::kContent) {
      out.content += held_;
      held_.clear();
      return out;
    }
    // A <think> repeated at the start of a block the prompt opened is no text.
    if (fresh_) {
      if (held_.size() < kOpen.size() && kOpen.substr(0, held_.size()) == held_) return out;
      if (held_.rfind(kOpen, 0) == 0) held_.erase(0, kOpen.size());
      fresh_ = false;
    }
    // In the block: up to </think>, and not what may be its beginning.
    const size_t close = held_.find(kClose);
    if (close != std::string::npos) {
      out.reasoning += held_.substr(0, close);
      held_.erase(0, close + kClose.size());
      state_ = State::kContent;
      continue;
    }
    const size_t keep = PartialTagAtEnd(held_, kClose);
    out.reasoning += held_.substr(0, held_.size() - keep);
    held_.erase(0, held_.size() - keep);
    return out;
  }
}

ReasoningParser::Out ReasoningParser::Finish() {
  Out out;
  (state_ == State::kReasoning ? out.reasoning : out.content) += held_;
  held_.clear();
  return out;
}

bool PromptEndsThinking(std::string_view prompt) {
  const size_t open = prompt.rfind(kOpen);
  if (open == std::string_view::npos) return false;
  const size_t close = prompt.rfind(kClose);
  return close == std::string_view::npos || close < open;
}

}  // namespace shardserve
