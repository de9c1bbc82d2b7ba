#include "serve/text_stream.h"

#include <algorithm>

namespace shardserve {
namespace {

constexpr char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD: what an incomplete byte run decodes to

}  // namespace

TextStream::Delta TextStream::Add(const std::vector<int32_t>& tokens) {
  Delta d;
  if (stopped_) return d;
  for (int32_t id : tokens) {
    ids_.push_back(id);
    std::string full = tokenizer_->Decode(ids_, /*skip_special_tokens=*/true);
    std::string tail;
    while (full.size() >= 3 && full.compare(full.size() - 3, 3, kReplacement) == 0) {
      tail.insert(0, kReplacement);
      full.resize(full.size() - 3);
    }
    std::string piece;
    if (full.size() >= decoded_.size() && full.compare(0, decoded_.size(), decoded_) == 0) {
      piece = full.substr(decoded_.size());
      decoded_ = std::move(full);
    }
    pending_ = std::move(tail);
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
  std::string rest = decoded_.substr(released_.size()) + pending_;
  released_ += rest;
  pending_.clear();
  decoded_ = released_;
  return rest;
}

}  // namespace shardserve
