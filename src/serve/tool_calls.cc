#include "serve/tool_calls.h"

#include <algorithm>
#include <optional>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "common/text.h"
#include "serve/harmony.h"

namespace shardserve {
namespace {

using json = nlohmann::ordered_json;
constexpr std::string_view kOpen = "<tool_call>", kClose = "</tool_call>";
// Mistral's: a special token (the text stream keeps it for the parser), then a JSON list.
constexpr std::string_view kMistralCalls = "[TOOL_CALLS]";

// The formats whose calls stand in a section: its opening, each call's opening and closing,
// its closing (tokens of the model's vocabulary, special or not: the text stream keeps them).
struct Section {
  std::string_view begin, call_begin, call_end, end;
  std::string_view separator;  // between a call's name and its arguments
};
constexpr Section kDeepSeek = {"<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
                               "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "<｜tool▁sep｜>"};
constexpr Section kKimi = {"<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                           "<|tool_call_end|>", "<|tool_calls_section_end|>",
                           "<|tool_call_argument_begin|>"};

const Section* SectionOf(std::string_view format) {
  if (format == "deepseek_v3" || format == "deepseek_v31") return &kDeepSeek;
  if (format == "kimi_k2") return &kKimi;
  return nullptr;
}

}  // namespace

std::string RandomId(std::string_view prefix) {
  static constexpr char kAlphabet[] =
      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  thread_local std::mt19937_64 rng(std::random_device{}());
  std::string id(prefix);
  for (int i = 0; i < 24; ++i) id += kAlphabet[rng() % (sizeof(kAlphabet) - 1)];
  return id;
}

namespace {

// The JSON values of `text` one after another, separated by ';' or white space; empty when any
// part is not JSON.
std::vector<json> JsonSequence(std::string_view text) {
  std::vector<json> out;
  size_t at = 0;
  while (at < text.size()) {
    while (at < text.size() && (absl::ascii_isspace(text[at]) || text[at] == ';')) ++at;
    if (at == text.size()) break;
    // The end of the value at `at`: its brackets balanced, strings skipped.
    JsonScan scan;
    size_t end = at;
    bool closed = false;
    while (end < text.size() && !closed) closed = scan.Step(text[end++]);
    if (!closed || text[at] != '{') return {};
    json j = json::parse(text.substr(at, end - at), nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return {};
    out.push_back(std::move(j));
    at = end;
  }
  return out;
}

// Python literals as a pythonic call writes its arguments (Llama 3.2 / 4, xLAM): strings in
// either quotes, numbers, True / False / None, lists, tuples and dicts, nested at most 64 deep.
class PythonLiterals {
 public:
  explicit PythonLiterals(std::string_view s) : s_(s) {}

  // [name(key=value, ...), ...]: the calls, or nullopt when the text is not that whole.
  std::optional<std::vector<std::pair<std::string, json>>> Calls() {
    std::vector<std::pair<std::string, json>> calls;
    if (!Eat('[')) return std::nullopt;
    if (!Eat(']')) {
      do {
        std::string name = Name();
        if (name.empty() || !Eat('(')) return std::nullopt;
        json args = json::object();
        if (!Eat(')')) {
          do {
            if (Space(), at_ < s_.size() && s_[at_] == ')') break;  // a trailing comma
            std::string key = Name();
            if (key.empty() || key.find('.') != std::string::npos || !Eat('=')) {
              return std::nullopt;
            }
            std::optional<json> v = Value(0);
            if (!v) return std::nullopt;
            args[key] = std::move(*v);
          } while (Eat(','));
          if (!Eat(')')) return std::nullopt;
        }
        calls.emplace_back(std::move(name), std::move(args));
      } while (Eat(','));
      if (!Eat(']')) return std::nullopt;
    }
    Space();
    if (at_ != s_.size()) return std::nullopt;
    return calls;
  }

 private:
  void Space() {
    while (at_ < s_.size() && absl::ascii_isspace(s_[at_])) ++at_;
  }
  bool Eat(char c) {
    Space();
    if (at_ < s_.size() && s_[at_] == c) {
      ++at_;
      return true;
    }
    return false;
  }
  // An identifier, dotted names allowed (a module's function).
  std::string Name() {
    Space();
    const size_t from = at_;
    if (at_ >= s_.size() || absl::ascii_isdigit(s_[at_])) return "";  // a number, not a name
    while (at_ < s_.size() &&
           (absl::ascii_isalnum(s_[at_]) || s_[at_] == '_' || (s_[at_] == '.' && at_ > from))) {
      ++at_;
    }
    if (at_ == from) return "";
    return std::string(s_.substr(from, at_ - from));
  }
  std::optional<json> Value(int depth) {
    if (depth > 64) return std::nullopt;
    Space();
    if (at_ >= s_.size()) return std::nullopt;
    const char c = s_[at_];
    if (c == '"' || c == '\'') return String();
    if (c == '[' || c == '(') {
      const char close = c == '[' ? ']' : ')';
      ++at_;
      json list = json::array();
      if (Eat(close)) return list;
      do {
        if (Space(), at_ < s_.size() && s_[at_] == close) break;  // a trailing comma
        std::optional<json> v = Value(depth + 1);
        if (!v) return std::nullopt;
        list.push_back(std::move(*v));
      } while (Eat(','));
      if (!Eat(close)) return std::nullopt;
      return list;
    }
    if (c == '{') {
      ++at_;
      json object = json::object();
      if (Eat('}')) return object;
      do {
        if (Space(), at_ < s_.size() && s_[at_] == '}') break;
        Space();
        if (at_ >= s_.size() || (s_[at_] != '"' && s_[at_] != '\'')) return std::nullopt;
        std::optional<json> key = String();
        if (!key || !Eat(':')) return std::nullopt;
        std::optional<json> v = Value(depth + 1);
        if (!v) return std::nullopt;
        object[key->get<std::string>()] = std::move(*v);
      } while (Eat(','));
      if (!Eat('}')) return std::nullopt;
      return object;
    }
    const std::string word = Name();
    if (word == "True") return json(true);
    if (word == "False") return json(false);
    if (word == "None") return json(nullptr);
    // JSON's words too, where a constrained call's nested JSON value wrote them.
    if (word == "true" || word == "false") return json(word == "true");
    if (word == "null") return json(nullptr);
    if (!word.empty()) return std::nullopt;
    // A number, as JSON reads it (Python's forms JSON lacks are not a call's).
    const size_t from = at_;
    while (at_ < s_.size() &&
           std::string_view("+-0123456789.eE").find(s_[at_]) != std::string_view::npos) {
      ++at_;
    }
    json n = json::parse(s_.substr(from, at_ - from), nullptr, /*allow_exceptions=*/false);
    if (n.is_discarded() || !n.is_number()) return std::nullopt;
    return n;
  }
  // A quoted string with Python's common escapes.
  std::optional<json> String() {
    const char quote = s_[at_++];
    std::string out;
    while (at_ < s_.size() && s_[at_] != quote) {
      char c = s_[at_++];
      if (c == '\\') {
        if (at_ >= s_.size()) return std::nullopt;
        const char e = s_[at_++];
        switch (e) {
          case 'n':
            c = '\n';
            break;
          case 't':
            c = '\t';
            break;
          case 'r':
            c = '\r';
            break;
          case '0':
            c = '\0';
            break;
          default:
            c = e;  // \\ \' \" and the rest as written
        }
      }
      out += c;
    }
    if (at_ >= s_.size()) return std::nullopt;
    ++at_;
    return json(std::move(out));
  }

  std::string_view s_;
  size_t at_ = 0;
};

std::string Trimmed(std::string_view s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return "";
  return std::string(s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1));
}

// Qwen3-Coder's XML call: <function=NAME> then <parameter=KEY>\nVALUE\n</parameter> each, then
// </function>. A value is text for a string parameter (of the function's schema), else JSON
// (a number, a boolean, an object, a list), else text.
std::optional<std::pair<std::string, json>> XmlCall(std::string_view body, const json& tools) {
  constexpr std::string_view kFunction = "<function=", kParameter = "<parameter=",
                             kParameterEnd = "</parameter>", kFunctionEnd = "</function>";
  const size_t f = body.find(kFunction);
  if (f == std::string_view::npos) return std::nullopt;
  const size_t name_end = body.find('>', f);
  if (name_end == std::string_view::npos) return std::nullopt;
  std::string name = Trimmed(body.substr(f + kFunction.size(), name_end - f - kFunction.size()));
  json properties = json::object();
  for (const json& t : tools) {
    if (t.is_object() && t.contains("function") && t["function"].is_object() &&
        t["function"].value("name", json()) == name && t["function"].contains("parameters") &&
        t["function"]["parameters"].is_object() &&
        t["function"]["parameters"].contains("properties") &&
        t["function"]["parameters"]["properties"].is_object()) {
      properties = t["function"]["parameters"]["properties"];
    }
  }
  json args = json::object();
  size_t at = name_end + 1;
  for (;;) {
    const size_t p = body.find(kParameter, at);
    const size_t end_fn = body.find(kFunctionEnd, at);
    if (p == std::string_view::npos || (end_fn != std::string_view::npos && end_fn < p)) break;
    const size_t key_end = body.find('>', p);
    if (key_end == std::string_view::npos) return std::nullopt;
    const std::string key =
        Trimmed(body.substr(p + kParameter.size(), key_end - p - kParameter.size()));
    const size_t value_end = body.find(kParameterEnd, key_end);
    if (value_end == std::string_view::npos) return std::nullopt;
    std::string_view value = body.substr(key_end + 1, value_end - key_end - 1);
    if (!value.empty() && value.front() == '\n') value.remove_prefix(1);
    if (!value.empty() && value.back() == '\n') value.remove_suffix(1);
    const json schema = properties.contains(key) ? properties[key] : json();
    const bool text = schema.is_object() && schema.value("type", json()) == "string";
    json v = json::parse(value, nullptr, /*allow_exceptions=*/false);
    // A string parameter's value is its text, unless written whole as a JSON string (as a
    // constrained call writes one with a pattern or a format).
    if (text && !v.is_string()) v = json(std::string(value));
    args[key] = v.is_discarded() ? json(std::string(value)) : std::move(v);
    at = value_end + kParameterEnd.size();
  }
  return std::make_pair(std::move(name), std::move(args));
}

// A call in a section, NAME SEPARATOR ARGUMENTS: DeepSeek-V3.1's as it stands; DeepSeek-V3's
// "function" SEPARATOR NAME ```json ARGUMENTS ```; Kimi K2's name written functions.NAME:INDEX.
std::optional<std::pair<std::string, json>> SectionCall(const Section& section,
                                                        std::string_view body) {
  const size_t sep = body.find(section.separator);
  if (sep == std::string_view::npos) return std::nullopt;
  std::string name = Trimmed(body.substr(0, sep));
  std::string_view args = body.substr(sep + section.separator.size());
  if (&section == &kDeepSeek && name == "function") {  // V3: the type first, then the name
    const size_t fence = args.find("```json");
    const size_t last = args.rfind("```");
    if (fence == std::string_view::npos || last == std::string_view::npos || last <= fence) {
      return std::nullopt;
    }
    name = Trimmed(args.substr(0, fence));
    args = args.substr(fence + 7, last - fence - 7);
  }
  if (&section == &kKimi) {
    if (absl::StartsWith(name, "functions.")) name.erase(0, 10);
    if (const size_t colon = name.rfind(':'); colon != std::string::npos) name.resize(colon);
  }
  json j = json::parse(args, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || name.empty()) return std::nullopt;
  return std::make_pair(std::move(name), std::move(j));
}

}  // namespace

std::vector<std::string_view> ToolCallMarkers(std::string_view format) {
  if (format == "mistral") return {kMistralCalls};
  if (format == "openai") return HarmonyMarkers();
  if (const Section* s = SectionOf(format)) {
    return {s->begin, s->call_begin, s->call_end, s->end, s->separator};
  }
  return {};
}

ToolCallParser::ToolCallParser(std::string format, const json& tools, bool parallel)
    : format_(std::move(format)), tools_(tools), parallel_(parallel), state_(State::kStart) {
  if (tools.is_array()) {
    for (const json& t : tools) {
      if (t.is_object() && t.contains("function") && t["function"].is_object() &&
          t["function"].contains("name") && t["function"]["name"].is_string()) {
        names_.push_back(t["function"]["name"].get<std::string>());
      }
    }
  }
}

int ToolCallParser::NextIndex() {
  if (!parallel_ && next_index_ > 0) return -1;
  return next_index_++;
}

namespace {
// Reads `"key"` (after white space) at `at` of `s`: 1 when it is there (at moves past it), 0
// when `s` ends first (undecided), -1 when something else is.
int Expect(std::string_view s, size_t& at, std::string_view token) {
  while (at < s.size() && absl::ascii_isspace(s[at])) ++at;
  const size_t n = std::min(token.size(), s.size() - at);
  if (s.substr(at, n) != token.substr(0, n)) return -1;
  if (n < token.size()) return 0;
  at += n;
  return 1;
}
}  // namespace

int ToolCallParser::HermesHeader(std::string* name, size_t* args) const {
  // {"name": "NAME", "arguments": {
  size_t at = 0;
  int r = 1;
  for (std::string_view t : {"{", "\"name\"", ":", "\""}) {
    if ((r = Expect(buffer_, at, t)) != 1) return r;
  }
  const size_t end = buffer_.find('"', at);
  if (end == std::string::npos) {
    return buffer_.find_first_of("\\\n", at) == std::string::npos ? 0 : -1;
  }
  *name = buffer_.substr(at, end - at);
  at = end + 1;
  for (std::string_view t : {",", "\"arguments\"", ":", "{"}) {
    if ((r = Expect(buffer_, at, t)) != 1) return r;
  }
  *args = at - 1;  // the arguments' opening brace
  return 1;
}

int ToolCallParser::SectionHeader(std::string* name, size_t* args) const {
  // NAME SEPARATOR {   (DeepSeek-V3: function SEPARATOR NAME ```json {; Kimi: functions.NAME:N)
  constexpr size_t kLongestName = 256;
  const Section& section = *SectionOf(format_);
  const size_t sep = buffer_.find(section.separator);
  if (sep == std::string::npos) return buffer_.size() > kLongestName ? -1 : 0;
  std::string n = Trimmed(std::string_view(buffer_).substr(0, sep));
  size_t at = sep + section.separator.size();
  if (&section == &kDeepSeek && n == "function") {
    const size_t fence = buffer_.find("```json", at);
    if (fence == std::string::npos) return buffer_.size() - at > kLongestName ? -1 : 0;
    n = Trimmed(std::string_view(buffer_).substr(at, fence - at));
    at = fence + 7;
  }
  if (&section == &kKimi) {
    if (absl::StartsWith(n, "functions.")) n.erase(0, 10);
    if (const size_t colon = n.rfind(':'); colon != std::string::npos) n.resize(colon);
  }
  const size_t first = buffer_.find_first_not_of(" \t\r\n", at);
  if (first == std::string::npos) return 0;
  if (buffer_[first] != '{') return -1;
  *name = std::move(n);
  *args = first;
  return 1;
}

void ToolCallParser::StreamArguments(size_t limit, Out& out) {
  if (mode_ == CallMode::kHeader) {
    // The call announced once its name is read, then its arguments passed on as they come;
    // anything else is read whole at the closing tag.
    std::string name;
    size_t at = 0;
    const int r = SectionOf(format_) ? SectionHeader(&name, &at) : HermesHeader(&name, &at);
    if (r == 0) return;  // not enough yet
    if (r < 0 || std::find(names_.begin(), names_.end(), name) == names_.end()) {
      mode_ = CallMode::kWhole;
      return;
    }
    mode_ = CallMode::kStreamed;
    streamed_index_ = NextIndex();
    if (streamed_index_ >= 0) out.calls.push_back({streamed_index_, RandomId("call_"), name, ""});
    args_at_ = at;
    args_scan_ = JsonScan();
    args_done_ = false;
  }
  if (mode_ != CallMode::kStreamed || args_done_) return;
  const size_t from = args_at_;
  while (args_at_ < limit && !args_done_) args_done_ = args_scan_.Step(buffer_[args_at_++]);
  if (streamed_index_ >= 0 && args_at_ > from) {
    out.calls.push_back({streamed_index_, "", "", buffer_.substr(from, args_at_ - from)});
  }
}

bool ToolCallParser::CallFromJson(const json& j, Out& out) {
  if (!j.is_object() || !j.contains("name") || !j["name"].is_string()) return false;
  const std::string name = j["name"].get<std::string>();
  if (std::find(names_.begin(), names_.end(), name) == names_.end()) return false;
  const char* key = j.contains("arguments") ? "arguments" : "parameters";
  json args = j.contains(key) ? j[key] : json::object();
  if (args.is_string()) {  // some models write the arguments as a JSON string
    args = json::parse(args.get<std::string>(), nullptr, /*allow_exceptions=*/false);
  }
  if (!args.is_object()) return false;
  const int index = NextIndex();
  if (index >= 0)
    out.calls.push_back({index, RandomId("call_"), name, args.dump()});  // else dropped
  return true;
}

void ToolCallParser::Call(std::string_view body, std::string_view raw, Out& out) {
  if (const Section* section = SectionOf(format_)) {
    const std::optional<std::pair<std::string, json>> call = SectionCall(*section, body);
    if (!call || !CallFromJson({{"name", call->first}, {"arguments", call->second}}, out)) {
      out.content += raw;  // stays text
    }
    return;
  }
  if (format_ == "qwen3_coder") {
    const std::optional<std::pair<std::string, json>> call = XmlCall(body, tools_);
    if (!call || !CallFromJson({{"name", call->first}, {"arguments", call->second}}, out)) {
      out.content += raw;  // stays text
    }
    return;
  }
  const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !CallFromJson(j, out)) out.content += raw;  // stays text
}

ToolCallParser::Out ToolCallParser::Add(std::string_view text) {
  Out out;
  buffer_ += text;
  for (;;) {
    if (state_ == State::kStart) {
      // llama3_json: the output is calls when it begins with an object.
      const size_t first = buffer_.find_first_not_of(" \t\r\n");
      if (first == std::string::npos) return out;  // white space so far: undecided
      // llama3_json: an object first; pythonic: a list first (the calls, read whole at the end).
      state_ = (format_ == "llama3_json" && buffer_[first] == '{') ||
                       (format_ == "pythonic" && buffer_[first] == '[')
                   ? State::kJson
                   : State::kContent;
      continue;
    }
    if (state_ == State::kJson) return out;  // whole at the end
    const Section* section = SectionOf(format_);
    if (state_ == State::kSection) {
      // Between a section's calls: the next call, or the section's end.
      const size_t first = buffer_.find_first_not_of(" \t\r\n");
      if (first == std::string::npos) return out;
      const std::string_view rest = std::string_view(buffer_).substr(first);
      if (rest.starts_with(section->call_begin)) {
        buffer_.erase(0, first + section->call_begin.size());
        state_ = State::kInCall;
        mode_ = CallMode::kHeader;
        continue;
      }
      if (rest.starts_with(section->end)) {
        buffer_.erase(0, first + section->end.size());
        state_ = State::kContent;
        continue;
      }
      if (section->call_begin.starts_with(rest) || section->end.starts_with(rest)) {
        return out;  // may be either
      }
      state_ = State::kContent;  // not a call: text
      continue;
    }
    if (state_ == State::kContent) {
      const bool tagged = format_ == "hermes" || format_ == "qwen3_coder";
      if (!tagged && format_ != "mistral" && section == nullptr) {
        out.content += buffer_;
        buffer_.clear();
        return out;
      }
      // Text, then a call's opening tag (Hermes) or [TOOL_CALLS] and the list of calls
      // (Mistral's, read whole at the end).
      const std::string_view marker = tagged ? kOpen : section ? section->begin : kMistralCalls;
      const size_t open = buffer_.find(marker);
      if (open == std::string::npos) {
        const size_t keep = PartialMarker(buffer_, marker);
        out.content += buffer_.substr(0, buffer_.size() - keep);
        buffer_.erase(0, buffer_.size() - keep);
        return out;
      }
      out.content += buffer_.substr(0, open);
      buffer_.erase(0, open + marker.size());
      if (format_ == "mistral") {
        state_ = State::kJson;
        return out;
      }
      if (section != nullptr) {
        state_ = State::kSection;
        continue;
      }
      state_ = State::kInCall;
      // A Hermes call's arguments stream; Qwen3-Coder's XML call is read whole.
      mode_ = format_ == "hermes" ? CallMode::kHeader : CallMode::kWhole;
      continue;
    }
    // kInCall: the arguments as they come, or the whole call at the closing tag.
    const std::string_view open_tag = section ? section->call_begin : kOpen;
    const std::string_view close_tag = section ? section->call_end : kClose;
    const size_t close = buffer_.find(close_tag);
    StreamArguments(
        close != std::string::npos ? close : buffer_.size() - PartialMarker(buffer_, close_tag),
        out);
    if (close == std::string::npos) return out;
    if (mode_ != CallMode::kStreamed) {
      const std::string body = buffer_.substr(0, close);
      Call(body, std::string(open_tag) + body + std::string(close_tag), out);
    }
    buffer_.erase(0, close + close_tag.size());
    state_ = section ? State::kSection : State::kContent;
  }
}

ToolCallParser::Out ToolCallParser::Finish() {
  Out out = Add("");
  if (state_ == State::kInCall) {  // unclosed: a call if what follows the tag is one
    const Section* section = SectionOf(format_);
    if (mode_ != CallMode::kStreamed) {
      Call(buffer_, std::string(section ? section->call_begin : kOpen) + buffer_, out);
    }
  } else if (state_ == State::kSection) {  // a section left open: what is left is no call
    if (!absl::StripAsciiWhitespace(buffer_).empty()) out.content += buffer_;
  } else if (state_ == State::kJson) {
    std::vector<json> values;
    if (format_ == "mistral") {  // a list of calls (or one call)
      json j = json::parse(buffer_, nullptr, /*allow_exceptions=*/false);
      if (j.is_object()) values.push_back(std::move(j));
      if (j.is_array()) values.assign(j.begin(), j.end());
    } else if (format_ == "pythonic") {  // [f(a=1), g(b="x")]
      if (auto calls = PythonLiterals(buffer_).Calls()) {
        for (auto& [name, args] : *calls) values.push_back({{"name", name}, {"arguments", args}});
      }
    } else {
      values = JsonSequence(buffer_);
    }
    const int before = next_index_;
    Out calls;
    bool all = !values.empty();
    for (const json& v : values) all = all && CallFromJson(v, calls);
    if (all) {
      out.calls = std::move(calls.calls);
    } else {  // one part is not a call: the whole output is text
      next_index_ = before;
      out.content += format_ == "mistral" ? std::string(kMistralCalls) + buffer_ : buffer_;
    }
  } else {
    out.content += buffer_;
  }
  buffer_.clear();
  state_ = State::kContent;
  return out;
}

namespace {

// A function's parameters schema, moved under `base` (a JSON pointer of the call's schema): its
// local references ("#", "#/$defs/City": pydantic's nested models) point where they now are.
// Data keywords (const, enum, default, examples) are left as they are.
void RebaseRefs(nlohmann::ordered_json& node, const std::string& base, int depth) {
  if (depth > 128) return;  // request bodies nest at most 64 levels
  if (node.is_array()) {
    for (auto& v : node) RebaseRefs(v, base, depth + 1);
    return;
  }
  if (!node.is_object()) return;
  for (auto it = node.begin(); it != node.end(); ++it) {
    const std::string& key = it.key();
    if (key == "$ref" && it->is_string()) {
      const std::string ref = it->get<std::string>();
      if (!ref.empty() && ref[0] == '#') *it = base + ref.substr(1);
    } else if (key != "const" && key != "enum" && key != "default" && key != "examples") {
      RebaseRefs(*it, base, depth + 1);
    }
  }
}

}  // namespace

Grammar ToolCallGrammar(const std::string& format, const nlohmann::ordered_json& tools,
                        const std::string& choice, const std::string& name, bool parallel,
                        const MarkerIds& markers) {
  using ojson = nlohmann::ordered_json;
  const bool hermes = format == "hermes", llama3 = format == "llama3_json";
  // A marker in Lark: its token where it is a special one, else its text.
  auto marker = [&](std::string_view text) {
    const auto it = markers.find(text);
    return it != markers.end() ? absl::StrCat("<[", it->second, "]>") : ojson(text).dump();
  };
  const ojson style = {
      {"whitespace_flexible", false}, {"item_separator", ", "}, {"key_separator", ": "}};
  // A function's parameters (any object without them) as an embedded %json takes them.
  auto styled_parameters = [&](const ojson& fn) {
    ojson params = fn.contains("parameters") && fn["parameters"].is_object()
                       ? fn["parameters"]
                       : ojson({{"type", "object"}});
    params["x-guidance"] = style;
    return params;
  };
  if (format == "pythonic" || format == "qwen3_coder") {
    // Each function's parameters one by one (in their schema's order, the required ones always,
    // the others perhaps): pythonic as NAME(key=value, ...) in a list, True / False / None for a
    // boolean or null parameter and JSON for the rest (JSON's own words read back too);
    // Qwen3-Coder as <parameter=KEY> blocks, a string parameter's text free of '<', any other
    // value JSON. Each value's schema carries the function's $defs.
    const bool py = format == "pythonic";
    std::string rules, alternatives;
    int rule = 0;
    for (const ojson& t : tools) {
      const ojson& fn = t["function"];
      if (choice == "function" && fn["name"] != name) continue;
      const ojson params = fn.contains("parameters") && fn["parameters"].is_object()
                               ? fn["parameters"]
                               : ojson::object();
      const ojson props = params.contains("properties") && params["properties"].is_object()
                              ? params["properties"]
                              : ojson::object();
      const ojson required = params.value("required", ojson::array());
      std::vector<std::pair<std::string, bool>> items;  // the Lark of each, and whether required
      for (const auto& [key, schema] : props.items()) {
        ojson sub = schema.is_object() ? schema : ojson::object();
        for (const char* defs : {"$defs", "definitions"}) {
          if (params.contains(defs)) sub[defs] = params[defs];
        }
        sub["x-guidance"] = style;
        const std::string type =
            sub.value("type", ojson()).is_string() ? sub["type"].get<std::string>() : "";
        std::string value;
        if (py && type == "boolean") {
          value = R"(("True" | "False"))";
        } else if (py && type == "null") {
          value = R"("None")";
        } else if (!py && type == "string" && !sub.contains("enum") && !sub.contains("const") &&
                   !sub.contains("pattern") && !sub.contains("format")) {
          // Text, its length bounded as the schema bounds it.
          const auto bound = [&](const char* k) {
            return sub.contains(k) && sub[k].is_number_unsigned() ? sub[k].get<uint64_t>() : 0;
          };
          const uint64_t min = bound("minLength"), max = bound("maxLength");
          value = sub.contains("maxLength") ? absl::StrCat("/[^<]{", min, ",", max, "}/")
                                            : absl::StrCat("/[^<]{", min, ",}/");
        } else {
          value = absl::StrCat("%json ", sub.dump());
        }
        const std::string item = py ? absl::StrCat(ojson(key + "=").dump(), " ", value)
                                    : absl::StrCat(ojson("<parameter=" + key + ">\n").dump(), " ",
                                                   value, " ", ojson("\n</parameter>\n").dump());
        const bool must = std::find(required.begin(), required.end(), key) != required.end();
        items.emplace_back(item, must);
      }
      std::string args;
      if (!py) {  // no separators: each block in turn
        for (const auto& [item, must] : items) {
          absl::StrAppend(&args, " ", must ? item : absl::StrCat("(", item, ")?"));
        }
      } else {
        // rest_i: what may follow item i-1 (", " before each item present); first_i: the first
        // present item from i on (none when no item from i on is required).
        const std::string base = absl::StrCat("f", rule++, "_");
        for (size_t i = items.size() + 1; i-- > 0;) {
          std::string rest = "\"\"", first = "\"\"";
          if (i < items.size()) {
            const auto& [item, must] = items[i];
            const std::string next_rest = absl::StrCat(base, "rest", i + 1);
            const std::string next_first = absl::StrCat(base, "first", i + 1);
            rest = must ? absl::StrCat("\", \" ", item, " ", next_rest)
                        : absl::StrCat("\", \" ", item, " ", next_rest, " | ", next_rest);
            first = must ? absl::StrCat(item, " ", next_rest)
                         : absl::StrCat(item, " ", next_rest, " | ", next_first);
          }
          absl::StrAppend(&rules, base, "rest", i, ": ", rest, "\n", base, "first", i, ": ", first,
                          "\n");
        }
        args = absl::StrCat(" ", base, "first0");
      }
      const std::string fname = fn["name"].get<std::string>();
      absl::StrAppend(&alternatives, alternatives.empty() ? "" : " | ",
                      py ? absl::StrCat(ojson(fname + "(").dump(), args, " ", ojson(")").dump())
                         : absl::StrCat(ojson("<tool_call>\n<function=" + fname + ">\n").dump(),
                                        args, " ", ojson("</function>\n</tool_call>").dump()));
    }
    const bool many = parallel && choice == "required";
    const std::string start =
        py ? absl::StrCat("start: \"[\" call", many ? " (\", \" call)*" : "", " \"]\"\n")
           : absl::StrCat("start: call", many ? " (\"\\n\" call)*" : "", "\n");
    return Grammar{"lark", absl::StrCat(start, "call: ", alternatives, "\n", rules)};
  }
  if (format == "openai") {
    // gpt-oss's harmony: a commentary message to the function, its body JSON; the call's stop
    // token (<|call|>, an end id) follows.
    std::string alternatives;
    for (const ojson& t : tools) {
      const ojson& fn = t["function"];
      if (choice == "function" && fn["name"] != name) continue;
      const ojson params = styled_parameters(fn);
      absl::StrAppend(
          &alternatives, alternatives.empty() ? "" : " | ", marker("<|channel|>"), " ",
          ojson(absl::StrCat("commentary to=functions.", fn["name"].get<std::string>(), " "))
              .dump(),
          " ", marker("<|constrain|>"), " ", ojson("json").dump(), " ", marker("<|message|>"),
          " %json ", params.dump());
    }
    return Grammar{"lark", absl::StrCat("start: ", alternatives, "\n")};
  }
  if (const Section* section = SectionOf(format)) {
    // A section of calls, each its function's name and arguments in the format's words.
    std::string alternatives;
    for (const ojson& t : tools) {
      const ojson& fn = t["function"];
      if (choice == "function" && fn["name"] != name) continue;
      const ojson params = styled_parameters(fn);
      const std::string fname = fn["name"].get<std::string>();
      const std::string sep = marker(section->separator);
      std::string head, tail;
      if (format == "deepseek_v3") {
        head = absl::StrCat(ojson("function").dump(), " ", sep, " ",
                            ojson(absl::StrCat(fname, "\n```json\n")).dump());
        tail = absl::StrCat(" ", ojson("\n```").dump());
      } else if (format == "kimi_k2") {
        head = absl::StrCat(ojson(absl::StrCat("functions.", fname, ":")).dump(), " /[0-9]{1,3}/ ",
                            sep);
      } else {
        head = absl::StrCat(ojson(fname).dump(), " ", sep);
      }
      absl::StrAppend(&alternatives, alternatives.empty() ? "" : " | ", marker(section->call_begin),
                      " ", head, " %json ", params.dump(), tail, " ", marker(section->call_end));
    }
    return Grammar{"lark", absl::StrCat("start: ", marker(section->begin), " call",
                                        parallel && choice == "required" ? " call*" : "", " ",
                                        marker(section->end), "\ncall: ", alternatives, "\n")};
  }
  ojson calls = ojson::array();  // one schema per function the call may name
  size_t count = 0;
  for (const ojson& t : tools) {
    const ojson& fn = t["function"];
    count += !(choice == "function" && fn["name"] != name);
  }
  for (const ojson& t : tools) {
    const ojson& fn = t["function"];
    if (choice == "function" && fn["name"] != name) continue;
    ojson params = fn.contains("parameters") && fn["parameters"].is_object()
                       ? fn["parameters"]
                       : ojson({{"type", "object"}});
    const char* args = llama3 ? "parameters" : "arguments";
    // Where the parameters land in the schema of the call (below: one call, or anyOf's entry;
    // Mistral's calls are a list's items).
    RebaseRefs(
        params,
        absl::StrCat("#", format == "mistral" ? "/items" : "",
                     count == 1 ? "" : absl::StrCat("/anyOf/", calls.size()), "/properties/", args),
        0);
    calls.push_back({{"type", "object"},
                     {"properties", {{"name", {{"const", fn["name"]}}}, {args, std::move(params)}}},
                     {"required", {"name", args}},
                     {"additionalProperties", false}});
  }
  ojson schema = calls.size() == 1 ? calls[0] : ojson({{"anyOf", calls}});
  if (format == "mistral") {  // [TOOL_CALLS] (its token), then a list of calls
    ojson list = {{"type", "array"}, {"items", std::move(schema)}, {"minItems", 1}};
    if (!(parallel && choice == "required")) list["maxItems"] = 1;
    list["x-guidance"] = style;
    return Grammar{"lark",
                   absl::StrCat("start: ", marker(kMistralCalls), " %json ", list.dump(), "\n")};
  }
  schema["x-guidance"] = style;
  const std::string call = hermes ? absl::StrCat(ojson("<tool_call>\n").dump(), " %json ",
                                                 schema.dump(), " ", ojson("\n</tool_call>").dump())
                                  : absl::StrCat("%json ", schema.dump());
  const std::string between = ojson(hermes ? "\n" : "; ").dump();
  std::string lark = absl::StrCat(
      "start: call", parallel && choice == "required" ? absl::StrCat(" (", between, " call)*") : "",
      "\ncall: ", call, "\n");
  return Grammar{"lark", std::move(lark)};
}

Grammar ToolCallOrAnswerGrammar(const std::string& format, const nlohmann::ordered_json& tools,
                                bool parallel, const MarkerIds& markers,
                                const std::string& answer_schema) {
  Grammar calls = ToolCallGrammar(format, tools, "required", "", parallel, markers);
  // Its start rule renamed (every call grammar begins with it).
  calls.data = absl::StrCat("start: calls | answer\nanswer: %json ", answer_schema,
                            "\ncalls:", calls.data.substr(6));
  return calls;
}

namespace {

// `text` as a regex matches it literally.
std::string RegexLiteral(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (std::string_view("\\.^$|?*+()[]{}/").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

absl::StatusOr<Grammar> ToolCallOrTextGrammar(const std::string& format,
                                              const nlohmann::ordered_json& tools, bool parallel,
                                              const MarkerIds& markers) {
  using ojson = nlohmann::ordered_json;
  const Grammar calls = ToolCallGrammar(format, tools, "required", "", parallel, markers);
  // The calls grammar's rules: its start rule's body, then the rest.
  const size_t eol = calls.data.find('\n');
  const std::string start = calls.data.substr(6, eol - 6);  // after "start:"
  const std::string rules = calls.data.substr(eol + 1);
  if (format == "llama3_json" || format == "pythonic") {
    // The output is calls, or text that does not begin as they do.
    const char* first = format == "pythonic" ? "\\[" : "{";
    return Grammar{"lark", absl::StrCat("start: TEXT |", start, "\nTEXT: /(?s:(\\s*[^\\s", first,
                                        "].*)?)/\n", rules)};
  }
  std::string opener;  // the text calls begin with, when it is text (a special token ends TEXT)
  std::string rest;    // the calls after it
  if (format == "hermes" || format == "qwen3_coder") {
    opener = "<tool_call>";
    // The first call without its opener: each alternative of `call` begins with it.
    const std::string quoted = ojson(opener).dump();                       // "<tool_call>"
    const std::string open_literal = quoted.substr(0, quoted.size() - 1);  // "<tool_call>
    const size_t call_at = rules.find("call: ");
    if (call_at == std::string::npos) return absl::InternalError("no call rule");
    std::string first = rules.substr(call_at + 6, rules.find('\n', call_at) - call_at - 6);
    first = absl::StrReplaceAll(first, {{open_literal, "\""}});
    rest = absl::StrCat("first", start.substr(start.find("call") + 4), "\nfirst: ", first);
  } else if (const Section* section = SectionOf(format)) {
    const std::string begin(section->begin);
    if (markers.find(section->begin) == markers.end()) {
      opener = begin;
      const std::string literal = ojson(begin).dump();
      const size_t at = start.find(literal);
      if (at == std::string::npos) return absl::InternalError("no section opener");
      rest = start.substr(at + literal.size());
    }
  } else if (format != "mistral") {
    return absl::InvalidArgumentError(
        absl::StrCat("a strict function with tool_choice \"auto\" is not supported in the ", format,
                     " format (\"required\" or a named function constrains its call)"));
  }
  if (opener.empty()) {  // a special token opens the calls: text, then perhaps calls
    return Grammar{"lark", absl::StrCat("start: TEXT | TEXT", start, "\nTEXT: /(?s:.*)/\n", rules)};
  }
  // Text that never writes the opener, or text up to it (a lazy lexeme that ends there), then
  // the calls.
  return Grammar{"lark", absl::StrCat("start: TEXT | before ", rest, "\nTEXT: /(?s:.*)/ & ~/(?s:.*",
                                      RegexLiteral(opener), ".*)/\nbefore[suffix=",
                                      ojson(opener).dump(), "]: /(?s:.*)/\n", rules)};
}

}  // namespace shardserve
