#include "serve/harmony.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "common/text.h"

namespace shardserve {
namespace {

using json = nlohmann::ordered_json;
constexpr std::string_view kStart = "<|start|>", kChannel = "<|channel|>", kMessage = "<|message|>",
                           kEnd = "<|end|>", kCall = "<|call|>", kReturn = "<|return|>",
                           kConstrain = "<|constrain|>";
// What ends a message's body: its own terminators, or a new message's start.
constexpr std::string_view kTerminators[] = {kEnd, kCall, kReturn, kStart};

// The word after `key` in a header (up to white space or a marker).
std::string WordAfter(std::string_view header, std::string_view key) {
  const size_t at = header.find(key);
  if (at == std::string_view::npos) return "";
  std::string_view rest = header.substr(at + key.size());
  size_t end = 0;
  while (end < rest.size() && !absl::ascii_isspace(rest[end]) && rest[end] != '<') ++end;
  return std::string(rest.substr(0, end));
}

}  // namespace

std::vector<std::string_view> HarmonyMarkers() {
  return {kStart, kChannel, kMessage, kEnd, kCall, kReturn, kConstrain};
}

HarmonyParser::HarmonyParser(const json& tools, bool parallel) : parallel_(parallel) {
  for (const json& t : tools.is_array() ? tools : json::array()) {
    if (t.is_object() && t.contains("function") && t["function"].is_object() &&
        t["function"].contains("name") && t["function"]["name"].is_string()) {
      names_.push_back(t["function"]["name"].get<std::string>());
    }
  }
}

void HarmonyParser::Emit(std::string_view text, Out& out) {
  switch (kind_) {
    case Kind::kReasoning:
      out.reasoning += text;
      break;
    case Kind::kContent:
      out.content += text;
      break;
    case Kind::kCall:
      if (streamed_index_ >= 0) {  // announced: its arguments as they come
        if (!text.empty()) out.calls.push_back({streamed_index_, "", "", std::string(text)});
      } else {
        call_args_ += text;
      }
      break;
  }
}

void HarmonyParser::EndMessage(Out& out) {
  if (kind_ != Kind::kCall) return;
  if (streamed_index_ >= 0 || dropped_) {  // streamed already, or past the one call allowed
    streamed_index_ = -1;
    dropped_ = false;
    call_args_.clear();
    return;
  }
  out.content += call_args_;  // not a call of a function given: text, as vLLM leaves it
  call_args_.clear();
}

HarmonyParser::Out HarmonyParser::Add(std::string_view text) {
  Out out;
  buffer_ += text;
  for (;;) {
    if (state_ == State::kHeader) {
      const size_t first = buffer_.find_first_not_of(" \t\r\n");
      if (first == std::string::npos) return out;
      const std::string_view rest = std::string_view(buffer_).substr(first);
      if (!any_message_ && !rest.starts_with("<|") && !std::string_view("<|").starts_with(rest)) {
        state_ = State::kBody;  // not harmony: the output is its answer
        kind_ = Kind::kContent;
        any_message_ = true;
        continue;
      }
      const size_t message = buffer_.find(kMessage);
      if (message == std::string::npos) return out;  // the header is not whole yet
      const std::string_view header = std::string_view(buffer_).substr(0, message);
      const std::string channel = WordAfter(header, kChannel);
      const std::string recipient =
          WordAfter(header, " to=").empty() ? WordAfter(header, "to=") : WordAfter(header, " to=");
      recipient_.clear();
      if (recipient.starts_with("functions.")) recipient_ = recipient.substr(10);
      kind_ = channel == "analysis" ? Kind::kReasoning
              : !recipient_.empty() ? Kind::kCall
                                    : Kind::kContent;
      // A call of a function given is announced now; its arguments stream.
      if (kind_ == Kind::kCall &&
          std::find(names_.begin(), names_.end(), recipient_) != names_.end()) {
        if (parallel_ || next_index_ == 0) {
          streamed_index_ = next_index_++;
          out.calls.push_back({streamed_index_, RandomId("call_"), recipient_, ""});
        } else {
          dropped_ = true;
        }
      }
      buffer_.erase(0, message + kMessage.size());
      state_ = State::kBody;
      any_message_ = true;
      continue;
    }
    // In a body: up to its terminator; not what may be the start of one.
    size_t end = std::string::npos, marker = 0;
    for (std::string_view t : kTerminators) {
      const size_t at = buffer_.find(t);
      if (at < end) end = at, marker = t.size();
    }
    if (end == std::string::npos) {
      size_t keep = 0;
      for (std::string_view t : kTerminators) keep = std::max(keep, PartialMarker(buffer_, t));
      Emit(std::string_view(buffer_).substr(0, buffer_.size() - keep), out);
      buffer_.erase(0, buffer_.size() - keep);
      return out;
    }
    Emit(std::string_view(buffer_).substr(0, end), out);
    EndMessage(out);
    // A new message's start is its header's; a terminator is dropped.
    buffer_.erase(0, buffer_.compare(end, kStart.size(), kStart) == 0 ? end : end + marker);
    state_ = State::kHeader;
  }
}

HarmonyParser::Out HarmonyParser::Finish() {
  Out out = Add("");
  if (state_ == State::kBody) {
    Emit(buffer_, out);
    EndMessage(out);
  }
  // A header left unfinished is no text.
  buffer_.clear();
  state_ = State::kHeader;
  return out;
}

}  // namespace shardserve
