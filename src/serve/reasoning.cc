#include "serve/reasoning.h"

#include <algorithm>

#include "common/status.h"
#include "common/text.h"

namespace shardserve {
namespace {

constexpr std::string_view kOpen = "<think>";
constexpr std::string_view kClose = "</think>";

// The gate in one sequence's state (see ReasoningGate): free until `ends` have appeared in the
// output, in order.
class GatedConstraint final : public TokenConstraint {
 public:
  enum class State { kFirst, kReasoning, kAnswer };
  GatedConstraint(std::unique_ptr<TokenConstraint> inner, const Tokenizer* tokenizer,
                  std::shared_ptr<const std::vector<uint32_t>> free_mask, int32_t open_id,
                  std::vector<std::string_view> ends, State state)
      : inner_(std::move(inner)),
        tokenizer_(tokenizer),
        free_mask_(std::move(free_mask)),
        open_id_(open_id),
        ends_(std::move(ends)),
        state_(state) {}

  void Cancel() override { inner_->Cancel(); }

  absl::Status Allowed(std::vector<uint32_t>* mask) override {
    if (state_ == State::kReasoning) {
      *mask = *free_mask_;
      return absl::OkStatus();
    }
    RETURN_IF_ERROR(inner_->Allowed(mask));
    if (state_ == State::kFirst && open_id_ >= 0) {  // or the output opens its reasoning
      const size_t word = static_cast<size_t>(open_id_) / 32;
      if (mask->size() <= word) mask->resize(word + 1, 0);
      (*mask)[word] |= 1u << (open_id_ % 32);
    }
    return absl::OkStatus();
  }

  absl::Status Accept(int32_t token) override {
    if (state_ == State::kFirst) {
      state_ = token == open_id_ && open_id_ >= 0 ? State::kReasoning : State::kAnswer;
      if (state_ == State::kReasoning) return absl::OkStatus();
    }
    if (state_ == State::kAnswer) return inner_->Accept(token);
    tail_ += tokenizer_->TokenBytes(token);
    for (;;) {  // what follows the last marker in its token is white space (the mask)
      const size_t at = tail_.find(ends_[found_]);
      if (at == std::string::npos) break;
      tail_.erase(0, at + ends_[found_].size());
      if (++found_ == ends_.size()) {
        state_ = State::kAnswer;
        tail_.clear();
        return absl::OkStatus();
      }
    }
    const size_t longest = ends_[found_].size();
    if (tail_.size() > longest) tail_.erase(0, tail_.size() - longest);
    return absl::OkStatus();
  }

  bool Finished() const override { return state_ == State::kAnswer && inner_->Finished(); }

  std::unique_ptr<TokenConstraint> Clone() const override {
    auto c = std::make_unique<GatedConstraint>(inner_->Clone(), tokenizer_, free_mask_, open_id_,
                                               ends_, state_);
    c->tail_ = tail_;
    c->found_ = found_;
    return c;
  }

 private:
  std::unique_ptr<TokenConstraint> inner_;
  const Tokenizer* tokenizer_;
  std::shared_ptr<const std::vector<uint32_t>> free_mask_;
  int32_t open_id_;
  std::vector<std::string_view> ends_;  // the markers that end the reasoning, in order
  size_t found_ = 0;                    // how many have appeared
  State state_;
  std::string tail_;  // the last bytes of the reasoning, where the next marker is looked for
};

}  // namespace

ReasoningGate::ReasoningGate(const Tokenizer& tokenizer, int64_t vocab_size)
    : tokenizer_(&tokenizer) {
  auto mask = std::make_shared<std::vector<uint32_t>>((vocab_size + 31) / 32, 0u);
  for (int64_t id = 0; id < std::min(vocab_size, tokenizer.vocab_size()); ++id) {
    const std::string bytes = tokenizer.TokenBytes(static_cast<int32_t>(id));
    const size_t gt = bytes.find('>');
    const bool carries =
        gt != std::string::npos && bytes.find_first_not_of(" \t\r\n", gt + 1) != std::string::npos;
    if (!carries) (*mask)[id / 32] |= 1u << (id % 32);
  }
  free_mask_ = std::move(mask);
  auto ids = tokenizer.Encode(kOpen, /*add_special_tokens=*/false);
  if (ids.ok() && ids->size() == 1 && tokenizer.TokenBytes((*ids)[0]) == kOpen)
    open_id_ = (*ids)[0];
}

std::unique_ptr<TokenConstraint> ReasoningGate::Wrap(std::unique_ptr<TokenConstraint> inner,
                                                     bool in_block) const {
  return std::make_unique<GatedConstraint>(
      std::move(inner), tokenizer_, free_mask_, open_id_, std::vector<std::string_view>{kClose},
      in_block ? GatedConstraint::State::kReasoning : GatedConstraint::State::kFirst);
}

std::unique_ptr<TokenConstraint> ReasoningGate::WrapHarmony(
    std::unique_ptr<TokenConstraint> inner) const {
  return std::make_unique<GatedConstraint>(
      std::move(inner), tokenizer_, free_mask_, -1,
      std::vector<std::string_view>{"<|channel|>final", "<|message|>"},
      GatedConstraint::State::kReasoning);
}

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
    const size_t keep = PartialMarker(held_, kClose);
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
