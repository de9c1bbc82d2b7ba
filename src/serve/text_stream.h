#pragma once
// Turns a sequence's generated tokens into text as they arrive: each token's share of the text
// (for logprobs), the text safe to send now, and stop strings. Each new token's text is its
// window's decode (the tokens since the last release point, with the context before them) past
// what the window held before, so text once sent never changes and the whole equals the
// tokenizer's decode of all tokens, U+FFFD for bytes that never formed a character included.
// Text is held back while it ends in U+FFFD (a character that later bytes may complete) or in
// what could be the start of a stop string; when a stop string appears, the text ends just
// before it.
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace shardserve {

class TextStream {
 public:
  // `keep_special`: special tokens whose text the stream keeps (others are skipped).
  TextStream(const Tokenizer* tokenizer, std::vector<std::string> stops,
             std::vector<int32_t> keep_special = {})
      : tokenizer_(tokenizer), stops_(std::move(stops)), keep_(std::move(keep_special)) {}

  struct Delta {
    std::vector<std::string> token_texts;  // one per added token (may be empty strings)
    std::string text;                      // newly released text
    bool stopped = false;                  // a stop string matched; nothing more will come
  };
  Delta Add(const std::vector<int32_t>& tokens);
  // The held-back text, once generation ended without a stop string.
  std::string Flush();
  const std::string& released() const { return released_; }

 private:
  const Tokenizer* tokenizer_;
  std::vector<std::string> stops_;
  std::vector<int32_t> keep_;
  std::string DecodeRange(size_t begin, size_t end) const;
  // What the tokens since read_offset_ add to the window's decode (past prefix_text_).
  std::string NewText() const;

  std::vector<int32_t> ids_;
  size_t prefix_offset_ = 0;  // the window's first token (context for the decode)
  size_t read_offset_ = 0;    // tokens before this one have their text in decoded_
  std::string prefix_text_;   // the decode of [prefix_offset_, read_offset_), kept
  std::string decoded_;       // text of the tokens up to read_offset_
  std::string released_;      // text handed out
  bool stopped_ = false;
};

}  // namespace shardserve
