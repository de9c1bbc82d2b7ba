#include "serve/text_stream.h"

#include <algorithm>

namespace shardserve {
namespace {

constexpr char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD: what an incomplete byte run decodes to

bool EndsWithReplacement(const std::string& s) {
  return s.size() >= 3 && s.compare(s.size() - 3, 3, kReplacement) == 0;
}

}  // namespace

TextStream::Delta TextStream::Add(const std::vector<int32_t>& tokens) {
  Delta d;
  if (stopped_) return d;
  for (int32_t id : tokens) {
    ids_.push_back(id);
    // The text the tokens since the last release point add, decoded in the context of the
    // tokens just before them; held while it ends in U+FFFD (a character still incomplete) or
    // in a byte-fallback run (the whole run decodes as one: valid UTF-8, or U+FFFD per byte).
    std::string piece;
    if (tokenizer_->IsByteFallbackToken(id)) {
      d.token_texts.push_back(std::move(piece));
      continue;
    }
    piece = NewText();
    if (!piece.empty() && !EndsWithReplacement(piece)) {
      decoded_ += piece;
      // Released: the window moves on, the tokens just released its context.
      prefix_offset_ = read_offset_;
      read_offset_ = ids_.size();
      prefix_text_ = DecodeRange(prefix_offset_, read_offset_);
    } else {
      piece.clear();
    }
    d.token_texts.push_back(std::move(piece));
  }
  // Release up to the first stop string, or up to what could still become one.
  size_t end = decoded_.size();
  size_t stop_at = std::string::npos;
  size_t longest = 0;
  for (const std::string& s : stops_) longest = std::max(longest, s.size());
  const size_t from = released_.size() > longest ? released_.size() - longest : 0;
  for (const std::string& s : stops_) {
    const size_t at = decoded_.find(s, from);
    if (at != std::string::npos && at < stop_at) stop_at = at;
  }
  if (stop_at != std::string::npos) {
    end = std::max(stop_at, released_.size());
    d.stopped = stopped_ = true;
  } else {
    for (const std::string& s : stops_) {
      for (size_t k = std::min(s.size() - 1, decoded_.size()); k > 0; --k) {
        if (decoded_.compare(decoded_.size() - k, k, s, 0, k) == 0) {
          end = std::min(end, decoded_.size() - k);
          break;
        }
      }
    }
    end = std::max(end, released_.size());
  }
  d.text = decoded_.substr(released_.size(), end - released_.size());
  released_ += d.text;
  return d;
}

std::string TextStream::Flush() {
  if (stopped_) return "";
  // What is held: the tokens' text since the last release point, U+FFFD and all.
  decoded_ += NewText();
  prefix_offset_ = read_offset_ = ids_.size();
  prefix_text_.clear();
  std::string rest = decoded_.substr(released_.size());
  released_ += rest;
  return rest;
}

std::string TextStream::NewText() const {
  const std::string now = DecodeRange(prefix_offset_, ids_.size());
  return now.size() > prefix_text_.size() ? now.substr(prefix_text_.size()) : "";
}

std::string TextStream::DecodeRange(size_t begin, size_t end) const {
  return tokenizer_->Decode(std::vector<int32_t>(ids_.begin() + begin, ids_.begin() + end),
                            /*skip_special_tokens=*/true, keep_);
}

}  // namespace shardserve
