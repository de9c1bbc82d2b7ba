#include "serve/grammar.h"

#include <llguidance.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string_view>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "common/text.h"

namespace shardserve {
namespace {

constexpr uint8_t kSpecialMarker = 0xFF;  // llguidance's prefix of a token no text matches

// llguidance's tokenize callback (thread-safe: Encode is const): text bytes to ids, no special
// tokens added; a text the tokenizer refuses gives no tokens.
size_t Tokenize(const void* user_data, const uint8_t* bytes, size_t len, uint32_t* out,
                size_t out_len) {
  const auto* tokenizer = static_cast<const Tokenizer*>(user_data);
  auto ids = tokenizer->Encode(std::string_view(reinterpret_cast<const char*>(bytes), len),
                               /*add_special_tokens=*/false);
  if (!ids.ok()) return 0;
  for (size_t i = 0; i < ids->size() && i < out_len; ++i) out[i] = static_cast<uint32_t>((*ids)[i]);
  return ids->size();
}

// llguidance's message in our words: its first line, bounded, without the parser's state or a
// backtrace, and the reasons a client meets most said plainly.
std::string Reason(const char* message) {
  if (message == nullptr || *message == '\0') return "no reason given";
  absl::string_view m(message);
  m = m.substr(0, m.find('\n'));
  const std::string first(m.substr(0, 300));
  if (absl::StrContains(first, "panicked")) {
    return "the grammar compiler could not handle it (it may be too large or refer to itself)";
  }
  if (absl::StrContains(first, "NoExtensionBias")) {
    return "it refers to itself without end: no text can complete it";
  }
  if (absl::StrContains(first, "fuel") || absl::StrContains(first, "too many") ||
      absl::StrContains(first, "too large") || absl::StrContains(first, "grammar size") ||
      absl::StrContains(first, "max is")) {
    return absl::StrCat("it is too large or complex for the server's limits (", first, ")");
  }
  return first;
}

// The deepest nesting of brackets in `text` (grammar and regex syntax), stopping past `limit`.
int BracketDepth(std::string_view text, int limit) {
  int depth = 0, deepest = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\\') {
      ++i;  // an escaped character
    } else if (c == '(' || c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
      if (deepest > limit) break;
    } else if ((c == ')' || c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

// Lines that start a Lark rule or terminal ("name:", "?name:", "NAME.2:"): one a line.
size_t LarkRules(absl::string_view text) {
  size_t rules = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    size_t i = line.find_first_not_of(" \t");
    if (i == absl::string_view::npos) continue;
    if (line[i] == '?' || line[i] == '!') ++i;
    const size_t name = i;
    while (i < line.size() && (absl::ascii_isalnum(line[i]) || line[i] == '_' || line[i] == '.'))
      ++i;
    if (i == name) continue;
    i = line.find_first_not_of(" \t", i);
    if (i != absl::string_view::npos && line[i] == ':') ++rules;
  }
  return rules;
}

size_t Count(std::string_view text, std::string_view what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string_view::npos; at = text.find(what, at + 1)) {
    ++n;
  }
  return n;
}

class GrammarMatcher final : public TokenConstraint {
 public:
  explicit GrammarMatcher(LlgMatcher* m) : m_(m), cancel_(llg_matcher_get_cancellation_handle(m)) {}
  ~GrammarMatcher() override {
    llg_free_matcher(m_);
    llg_free_cancellation_handle(cancel_);
  }

  void Cancel() override {
    if (cancel_ != nullptr) llg_cancel(cancel_);
  }

  absl::Status Allowed(std::vector<uint32_t>* mask) override {
    const size_t bytes = llg_matcher_get_mask_byte_size(m_);
    mask->assign(bytes / sizeof(uint32_t), 0);
    if (llg_matcher_compute_mask_into(m_, mask->data(), bytes) != 0) return Error("its mask");
    return absl::OkStatus();
  }

  absl::Status Accept(int32_t token) override {
    if (token < 0 || llg_matcher_consume_token(m_, static_cast<uint32_t>(token)) != 0) {
      return Error(absl::StrCat("token ", token));
    }
    return absl::OkStatus();
  }

  bool Finished() const override { return llg_matcher_is_stopped(m_); }

  std::unique_ptr<TokenConstraint> Clone() const override {
    return std::make_unique<GrammarMatcher>(llg_clone_matcher(m_));
  }

 private:
  // The grammar the client gave cannot go on (a limit of its work, or a cancellation): the
  // client's to change, so InvalidArgument.
  absl::Status Error(const std::string& what) {
    if (llg_matcher_is_cancelled(m_)) {
      return absl::InvalidArgumentError(
          absl::StrCat("the output's grammar was stopped while computing ", what));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("the output's grammar failed on ", what, ": ", reason()));
  }

 public:
  std::string reason() { return Reason(llg_matcher_get_error(m_)); }

 private:
  LlgMatcher* m_;
  LlgCancellationHandle* cancel_;
};

// What the client gave, as an error message names it.
std::string KindName(const std::string& kind) {
  if (kind == "json_schema") return "the JSON schema";
  if (kind == "json_object") return "the JSON object grammar";
  if (kind == "regex") return "the regular expression";
  return "the grammar";
}

}  // namespace

absl::StatusOr<std::shared_ptr<const GrammarVocabulary>> GrammarVocabulary::Create(
    const Tokenizer& tokenizer, int64_t vocab_size, const std::vector<int64_t>& end_ids) {
  vocab_size = std::max(vocab_size, tokenizer.vocab_size());
  if (vocab_size <= 0 || vocab_size > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("a vocabulary of ", vocab_size, " tokens"));
  }
  std::vector<uint32_t> lens;
  std::string bytes;
  lens.reserve(vocab_size);
  for (int32_t id = 0; id < vocab_size; ++id) {
    std::string b = tokenizer.TokenBytes(id);
    const bool special = tokenizer.IsSpecial(id) || b.empty();
    if (special) {
      // Marked: grammars never match it as text (a Lark grammar may name it, <|...|>).
      if (b.empty()) b = absl::StrCat("<[", id, "]>");
      b.insert(b.begin(), static_cast<char>(kSpecialMarker));
    }
    lens.push_back(static_cast<uint32_t>(b.size()));
    bytes += b;
  }
  std::vector<uint32_t> ends;
  for (int64_t id : end_ids) {
    if (id >= 0 && id < vocab_size) ends.push_back(static_cast<uint32_t>(id));
  }
  if (ends.empty()) {
    return absl::FailedPreconditionError(
        "structured output needs the model's end-of-sequence token, and it names none");
  }
  // llguidance tokenizes forced text (a grammar's literal) with our tokenizer when that gives
  // the text's own bytes; a SentencePiece tokenizer puts a space before a text's first word, so
  // there llguidance tokenizes greedily over the vocabulary itself.
  bool exact = true;
  for (const char* probe : {"x", "{\"", "-1"}) {
    auto ids = tokenizer.Encode(probe, /*add_special_tokens=*/false);
    std::string joined;
    for (int32_t id : ids.ok() ? *ids : std::vector<int32_t>{}) joined += tokenizer.TokenBytes(id);
    exact &= ids.ok() && joined == probe;
  }
  LlgTokenizerInitV2 init = {};
  init.struct_size = sizeof(init);
  init.vocab_size = static_cast<uint32_t>(vocab_size);
  init.tok_eos = ends[0];
  init.token_lens = lens.data();
  init.token_bytes = reinterpret_cast<const uint8_t*>(bytes.data());
  if (exact) {
    init.tokenize_assumes_string = true;  // Encode takes text; llguidance handles partial UTF-8
    init.tokenize_fn = Tokenize;
    init.tokenize_user_data = &tokenizer;
  } else {
    init.use_approximate_greedy_tokenize_fn = true;
  }
  init.tok_eos_extra = ends.size() > 1 ? ends.data() + 1 : nullptr;
  init.tok_eos_extra_count = static_cast<uint32_t>(ends.size() - 1);
  char error[1024] = {};
  LlgTokenizer* t = llg_new_tokenizer_v2(&init, error, sizeof(error));
  if (t == nullptr) {
    return absl::InternalError(absl::StrCat("llguidance refused the vocabulary: ", error));
  }
  std::shared_ptr<GrammarVocabulary> v(new GrammarVocabulary());
  v->tokenizer_ = t;
  return v;
}

GrammarVocabulary::~GrammarVocabulary() { llg_free_tokenizer(tokenizer_); }

absl::StatusOr<std::unique_ptr<TokenConstraint>> GrammarVocabulary::Compile(
    const Grammar& grammar) const {
  if (grammar.kind != "json_schema" && grammar.kind != "json_object" && grammar.kind != "regex" &&
      grammar.kind != "lark") {
    return absl::InvalidArgumentError(absl::StrCat("no grammar of kind '", grammar.kind, "'"));
  }
  RETURN_IF_ERROR(CheckGrammarBounds(grammar));
  LlgConstraintInit init = {};
  llg_constraint_init_set_defaults(&init, tokenizer_);
  init.log_stderr_level = 0;  // errors come back as statuses
  init.log_buffer_level = 0;
  // llguidance's limits bound the work of a hostile grammar: its size in symbols, the lexer's
  // states and the fuel of its construction (about 20 ms), each mask's lexer fuel and Earley
  // items (about 15 and 3 ms); its errors leave out the parser's state.
  init.limits.max_grammar_size = kMaxGrammarSymbols;
  init.limits.initial_lexer_fuel = 1'000'000;
  init.limits.max_lexer_states = 100'000;
  init.limits.step_lexer_fuel = 200'000;
  init.limits.step_max_items = 50'000;
  init.limits.verbose_errors = false;
  std::string data = grammar.data;
  const char* kind = grammar.kind.c_str();
  if (grammar.kind == "json_object" || grammar.kind == "json_schema") {
    // JSON without whitespace between its tokens (", " and ": " as separators) unless the schema
    // asks otherwise (llguidance's "x-guidance" options): a model free to add whitespace can add
    // it without end, and the output would stop at max_tokens, unparsed.
    nlohmann::json schema = nlohmann::json::object({{"type", "object"}});
    if (grammar.kind == "json_schema") {
      if (JsonNestsDeeperThan(grammar.data, 64)) {
        return absl::InvalidArgumentError("the schema nests deeper than 64 levels");
      }
      schema = nlohmann::json::parse(grammar.data, nullptr, /*allow_exceptions=*/false);
      if (schema.is_discarded()) return absl::InvalidArgumentError("the schema is not JSON");
    }
    // Our defaults, kept for what a schema's own x-guidance does not set: no whitespace, and
    // oneOf taken as anyOf (sound where its branches exclude each other, as real schemas' mostly
    // do; an answer matching two of them is possible, and documented).
    if (schema.is_object()) {
      nlohmann::json& options = schema["x-guidance"];
      if (options.is_null()) options = nlohmann::json::object();
      if (!options.is_object()) return absl::InvalidArgumentError("x-guidance must be an object");
      if (!options.contains("whitespace_flexible")) options["whitespace_flexible"] = false;
      if (!options.contains("coerce_one_of")) options["coerce_one_of"] = true;
    }
    data = schema.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    kind = "json";
  }
  if (data.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError("the grammar holds a NUL character");
  }
  LlgMatcher* m = llg_new_matcher(&init, kind, data.c_str());
  if (llg_matcher_is_error(m)) {
    const std::string reason = Reason(llg_matcher_get_error(m));
    llg_free_matcher(m);
    return absl::InvalidArgumentError(
        absl::StrCat(KindName(grammar.kind), " cannot be used: ", reason));
  }
  auto matcher = std::make_unique<GrammarMatcher>(m);
  // The first mask, once: a grammar that cannot start (it refers to itself without end, or
  // matches nothing) is the client's error now rather than in the middle of a generation.
  std::vector<uint32_t> mask;
  if (!matcher->Allowed(&mask).ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(KindName(grammar.kind), " cannot be used: ", matcher->reason()));
  }
  if (std::none_of(mask.begin(), mask.end(), [](uint32_t w) { return w != 0; })) {
    return absl::InvalidArgumentError(
        absl::StrCat(KindName(grammar.kind), " cannot be used: it matches no text"));
  }
  return matcher;
}

absl::Status CheckGrammarBounds(const Grammar& grammar) {
  const std::string what = KindName(grammar.kind);
  if (grammar.data.size() > kMaxGrammarBytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is ", grammar.data.size(),
                                                   " bytes long; at most ", kMaxGrammarBytes,
                                                   " are accepted"));
  }
  // llguidance's compiler recurses once per `$ref` it follows, per rule a rule names and per
  // nested bracket: these bounds keep its depth within a grammar thread's stack.
  if (const size_t refs = Count(grammar.data, "\"$ref\""); refs > kMaxGrammarRefs) {
    return absl::InvalidArgumentError(absl::StrCat(what, " holds ", refs, " \"$ref\"s; at most ",
                                                   kMaxGrammarRefs, " are accepted"));
  }
  if (grammar.kind == "lark") {
    if (const size_t rules = LarkRules(grammar.data); rules > kMaxLarkRules) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " defines up to ", rules, " rules; at most ", kMaxLarkRules, " are accepted"));
    }
  }
  if (grammar.kind == "lark" || grammar.kind == "regex") {
    if (BracketDepth(grammar.data, kMaxGrammarNesting) > kMaxGrammarNesting) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " nests brackets deeper than ", kMaxGrammarNesting, " levels"));
    }
  }
  return absl::OkStatus();
}

}  // namespace shardserve
