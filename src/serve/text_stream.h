#pragma once
// Turns a sequence's generated tokens into text as they arrive: each token's share of the text
// (for logprobs), the text safe to send now, and stop strings. Text is held back while it ends
// in an incomplete UTF-8 character or in what could be the start of a stop string; when a stop
// string appears, the text ends just before it.
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace shardserve {

class TextStream {
 public:
  TextStream(const Tokenizer* tokenizer, std::vector<std::string> stops)
      : tokenizer_(tokenizer), stops_(std::move(stops)) {}

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
  std::vector<int32_t> ids_;
  std::string decoded_;   // complete characters decoded so far
  std::string pending_;   // trailing incomplete character(s), released only by Flush
  std::string released_;  // text handed out
  bool stopped_ = false;
};

}  // namespace shardserve
