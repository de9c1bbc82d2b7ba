#pragma once
// gpt-oss's output in OpenAI's harmony format, as vLLM's gpt-oss parsers read it: a reply is a
// run of messages, each a header (its channel, perhaps a recipient and a content type) and a
// body:
//   <|channel|>analysis<|message|>THOUGHT<|end|>
//   <|start|>assistant<|channel|>commentary to=functions.NAME
//   <|constrain|>json<|message|>ARGS<|call|>
//   <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
// (the prompt ends in "<|start|>assistant"; a recipient may stand before the channel too). The
// analysis channel is reasoning_content; a commentary message to functions.NAME is a tool call;
// the final channel, and commentary to nobody (a preamble the user may see), is content. The
// markers are special tokens, which the text stream keeps for this parser (HarmonyMarkers); the
// stop tokens (<|call|>, <|return|>) end the output without appearing in it. The parser takes the
// output as it streams: bodies pass on as they come, holding back only what may begin a marker; a
// call of a function given is announced with its header, its arguments streaming as they are
// written (one to a function not given stays text). An output that never opens a message is
// content.
#include <string>
#include <string_view>
#include <vector>

#include "serve/tool_calls.h"

namespace shardserve {

class HarmonyParser {
 public:
  // `tools`: the request's (the names a call may use); `parallel` false keeps the first call.
  HarmonyParser(const nlohmann::ordered_json& tools, bool parallel);

  struct Out {
    std::string reasoning;
    std::string content;
    std::vector<ToolCall> calls;
  };
  Out Add(std::string_view text);
  Out Finish();  // what was held back, and a message the output ended in
  int calls() const { return next_index_; }

 private:
  // The message whose body is being read ends (its terminator, or the output's end).
  void EndMessage(Out& out);
  // Passes a body's text to its destination.
  void Emit(std::string_view text, Out& out);

  std::vector<std::string> names_;
  bool parallel_;
  enum class State { kHeader, kBody } state_ = State::kHeader;
  enum class Kind { kReasoning, kContent, kCall } kind_ = Kind::kContent;
  std::string recipient_;    // a call's function name
  std::string call_args_;    // the body of a call not announced (a function not given) so far
  int streamed_index_ = -1;  // the announced call's index (its arguments stream)
  bool dropped_ = false;     // a call past the one parallel_tool_calls false allows
  std::string buffer_;
  bool any_message_ = false;
  int next_index_ = 0;
};

// The harmony format's markers (special tokens the text stream keeps for the parser).
std::vector<std::string_view> HarmonyMarkers();

}  // namespace shardserve
