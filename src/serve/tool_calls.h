#pragma once
// The model's tool calls in its output, as OpenAI's message.tool_calls, in the format its chat
// template teaches (ChatTemplate::tool_call_format):
//   hermes       text, then <tool_call>{"name": ..., "arguments": {...}}</tool_call> per call
//                (Hermes, Qwen 2.5 / 3); a call left unclosed at the end of the output counts;
//   llama3_json  an output that is one JSON object {"name": ..., "parameters" (or "arguments"):
//                {...}}, or several separated by ';' (Llama 3.1-3.3; <|python_tag|> is a
//                special token, gone from the text);
//   mistral      text, then [TOOL_CALLS] (a special token the text stream keeps for this
//                format) and a JSON list of {"name": ..., "arguments": {...}} (Mistral v0.3+);
//   pythonic     an output that is a Python list of calls, [f(a=1, b="x"), g()] (Llama 3.2 / 4's
//                pythonic templates, xLAM), its arguments Python literals;
//   qwen3_coder  text, then <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...
//                </function></tool_call> per call (Qwen3-Coder), each value text for a string
//                parameter of the function's schema, else JSON;
//   deepseek_v3  text, then <｜tool▁calls▁begin｜>, per call <｜tool▁call▁begin｜>function
//                <｜tool▁sep｜>NAME ```json ARGS ```<｜tool▁call▁end｜>, <｜tool▁calls▁end｜>
//                (DeepSeek-V3, R1); deepseek_v31: the same section, each call
//                NAME<｜tool▁sep｜>ARGS (DeepSeek-V3.1; either body is read in either format);
//   kimi_k2      text, then <|tool_calls_section_begin|>, per call <|tool_call_begin|>
//                functions.NAME:INDEX<|tool_call_argument_begin|>ARGS<|tool_call_end|>,
//                <|tool_calls_section_end|> (Kimi K2).
// The markers of a format are its tokens; special ones are kept in the text for the parser
// (ToolCallMarkers).
// A call that does not parse, or names a function the request did not give, stays text, as
// vLLM's parsers leave it. The parser takes the output as it streams: Add returns the text that
// can be shown now (it holds back what may be the start of a call) and the calls as they come,
// as OpenAI streams them: a Hermes call written {"name": ..., "arguments": {...}}, and a DeepSeek
// or Kimi call, is announced (id and name) once its arguments begin, then its arguments follow
// piece by piece as the model writes them; a call written otherwise, and Llama 3's, Mistral's,
// pythonic and Qwen3-Coder calls, come whole once they have parsed.
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "serve/grammar.h"

namespace shardserve {

// A call, or a piece of one: the entries of one index together are the call (the first holds
// its id and name; the arguments, a JSON object as the model wrote it, are their pieces joined).
struct ToolCall {
  int index = 0;          // its place among the output's calls
  std::string id;         // "call_" + 24 random letters and digits; first piece only
  std::string name;       // first piece only
  std::string arguments;  // this piece of the arguments
};

// A new id as OpenAI writes them: `prefix` ("call_" for a tool call) and 24 random letters and
// digits.
std::string RandomId(std::string_view prefix);

// The bracket depth of JSON text read a character at a time, strings (and their escapes)
// skipped.
class JsonScan {
 public:
  // Reads c: true when it closes the outermost bracket.
  bool Step(char c) {
    if (in_string_) {
      if (escaped_) {
        escaped_ = false;
      } else if (c == '\\') {
        escaped_ = true;
      } else if (c == '"') {
        in_string_ = false;
      }
      return false;
    }
    if (c == '"') {
      in_string_ = true;
    } else if (c == '{' || c == '[') {
      ++depth_;
    } else if (c == '}' || c == ']') {
      return --depth_ == 0;
    }
    return false;
  }

 private:
  int depth_ = 0;
  bool in_string_ = false, escaped_ = false;
};

class ToolCallParser {
 public:
  // `format`: "hermes", "llama3_json", "mistral", "pythonic" or "qwen3_coder"; `tools`: the
  // request's list (the names a call may use, their parameters' types); `parallel` false keeps
  // only the first call.
  ToolCallParser(std::string format, const nlohmann::ordered_json& tools, bool parallel);

  struct Out {
    std::string content;
    std::vector<ToolCall> calls;
  };
  Out Add(std::string_view text);
  // The end of the output: what was held back.
  Out Finish();
  // Calls returned so far.
  int calls() const { return next_index_; }

 private:
  void Call(std::string_view body, std::string_view raw, Out& out);
  bool CallFromJson(const nlohmann::ordered_json& j, Out& out);
  // In a Hermes or section call: announces it once its header is read, then passes on its
  // arguments (up to buffer_[limit], the closing tag when it has come).
  void StreamArguments(size_t limit, Out& out);
  // A call's header in buffer_: 1 with its name and where its arguments' brace is, 0 when it is
  // not whole yet, -1 when it is not that shape (the call is read whole).
  int HermesHeader(std::string* name, size_t* args) const;
  int SectionHeader(std::string* name, size_t* args) const;
  // A new call's index, or -1 when parallel_tool_calls false has already had one.
  int NextIndex();

  std::string format_;
  nlohmann::ordered_json tools_;
  std::vector<std::string> names_;
  bool parallel_;
  enum class State { kStart, kContent, kSection, kInCall, kJson } state_;
  std::string buffer_;
  int next_index_ = 0;
  // The Hermes call being read: undecided (its header not whole yet), streamed (announced, its
  // arguments passed on), or whole (written otherwise: parsed at its closing tag).
  enum class CallMode { kHeader, kStreamed, kWhole } mode_ = CallMode::kHeader;
  int streamed_index_ = -1;  // the announced call's index (-1: dropped, one call only)
  size_t args_at_ = 0;       // how much of buffer_ the arguments scan has read
  JsonScan args_scan_;
  bool args_done_ = false;
};

// The markers of `format` that the text stream must keep when the tokenizer makes them special
// tokens (decoding drops those otherwise).
std::vector<std::string_view> ToolCallMarkers(std::string_view format);

// The special tokens among a format's markers, by their text.
using MarkerIds = std::map<std::string, int32_t, std::less<>>;

// The grammar (llguidance's Lark, each call an embedded JSON schema) that a constrained tool
// call follows in `format` ("hermes": <tool_call> blocks; "llama3_json": JSON objects joined by
// "; "; "mistral": the [TOOL_CALLS] token, then a JSON list; "deepseek_v3", "deepseek_v31",
// "kimi_k2": their section of calls): for tool_choice "required" one call of any of `tools`
// (several when `parallel`), for "function" one call of `name`. A call's arguments follow its
// function's parameters (any object without them), written as json.dumps writes them (", " and
// ": "). A marker named in `markers` is that special token; any other is its text.
Grammar ToolCallGrammar(const std::string& format, const nlohmann::ordered_json& tools,
                        const std::string& choice, const std::string& name, bool parallel,
                        const MarkerIds& markers = {});

// tool_choice auto with a JSON answer asked for (response_format): the output is calls of any of
// `tools` in `format` (as ToolCallGrammar's required) or the answer, `answer_schema` (a prepared
// schema's JSON: PreparedSchema).
Grammar ToolCallOrAnswerGrammar(const std::string& format, const nlohmann::ordered_json& tools,
                                bool parallel, const MarkerIds& markers,
                                const std::string& answer_schema);

// tool_choice auto with a strict function: the output is text or calls in `format`, the calls
// constrained as ToolCallGrammar's required ones (text first where the format lets it: Hermes,
// Qwen3-Coder, Mistral, the DeepSeek / Kimi sections; all text or all calls: Llama 3 JSON,
// pythonic). InvalidArgument for a format it cannot do (gpt-oss's harmony).
absl::StatusOr<Grammar> ToolCallOrTextGrammar(const std::string& format,
                                              const nlohmann::ordered_json& tools, bool parallel,
                                              const MarkerIds& markers);

}  // namespace shardserve
