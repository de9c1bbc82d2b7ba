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

// The formats llguidance enforces (its json/formats.rs); any other is an annotation, as JSON
// Schema makes an unknown format for validators.
constexpr std::string_view kKnownFormats[] = {"date-time", "time",     "date", "duration",
                                              "email",     "hostname", "uuid", "uri"};

void Rewrite(nlohmann::json& schema, int depth);

// Whether a `type` value (a name or a list of names) names `type`.
bool NamesType(const nlohmann::json& value, std::string_view type) {
  if (value.is_string()) return value.get_ref<const std::string&>() == type;
  if (!value.is_array()) return false;
  return std::any_of(value.begin(), value.end(), [&](const nlohmann::json& v) {
    return v.is_string() && v.get_ref<const std::string&>() == type;
  });
}

// Each schema in a keyword's value: a schema, a list of them or a map of them.
void RewriteEach(nlohmann::json& value, int depth, bool map, bool list) {
  if (map && value.is_object()) {
    for (auto& [_, sub] : value.items()) Rewrite(sub, depth + 1);
  } else if (list && value.is_array()) {
    for (auto& sub : value) Rewrite(sub, depth + 1);
  } else if (!map) {
    Rewrite(value, depth + 1);
  }
}

// A schema as llguidance takes it, where a keyword it lacks has a sound stand-in (every value the
// result allows, the schema allows): an unknown `format` is an annotation and dropped;
// `uniqueItems` caps the array at one item (one item is unique) unless minItems asks for more;
// `dependencies`, `dependentRequired` and `dependentSchemas` apply always (the named properties
// required, the schema in allOf), whether or not their property is there; `not` of everything
// ({} or true) is `false`, and `not` of types alone keeps the other types. The rest is left for
// llguidance to refuse by name. Only schema positions are walked (a property called "format" is
// a name, `enum` and `default` are data); depth is bounded by the caller's nesting check.
void Rewrite(nlohmann::json& schema, int depth) {
  if (!schema.is_object() || depth > 128) return;
  static constexpr std::pair<const char*, std::pair<bool, bool>> kSchemaKeywords[] = {
      // keyword, {a map of schemas, a list of schemas} (neither: one schema; both: either)
      {"properties", {true, false}},
      {"patternProperties", {true, false}},
      {"definitions", {true, false}},
      {"$defs", {true, false}},
      {"dependentSchemas", {true, false}},
      {"items", {false, true}},
      {"prefixItems", {false, true}},
      {"allOf", {false, true}},
      {"anyOf", {false, true}},
      {"oneOf", {false, true}},
      {"additionalProperties", {false, false}},
      {"additionalItems", {false, false}},
      {"not", {false, false}},
      {"if", {false, false}},
      {"then", {false, false}},
      {"else", {false, false}},
      {"contains", {false, false}},
      {"propertyNames", {false, false}},
      {"unevaluatedProperties", {false, false}},
      {"unevaluatedItems", {false, false}}};
  for (const auto& [keyword, shape] : kSchemaKeywords) {
    if (auto it = schema.find(keyword); it != schema.end()) {
      const bool items_list = std::string_view(keyword) == "items" && it->is_array();
      RewriteEach(*it, depth, shape.first, items_list || shape.second);
    }
  }
  if (auto it = schema.find("dependencies"); it != schema.end() && it->is_object()) {
    for (auto& [_, sub] : it->items()) {
      if (!sub.is_array()) Rewrite(sub, depth + 1);
    }
  }

  if (auto it = schema.find("format");
      it != schema.end() && it->is_string() &&
      std::find(std::begin(kKnownFormats), std::end(kKnownFormats), it->get<std::string>()) ==
          std::end(kKnownFormats)) {
    schema.erase(it);
  }
  if (auto it = schema.find("uniqueItems"); it != schema.end() && it->is_boolean()) {
    const auto min = schema.find("minItems");
    const bool many = min != schema.end() && min->is_number() && min->get<double>() > 1;
    if (!it->get<bool>()) {
      schema.erase(it);
    } else if (!many) {
      schema.erase(it);
      const auto max = schema.find("maxItems");
      if (max == schema.end() || !max->is_number() || max->get<double>() > 1)
        schema["maxItems"] = 1;
    }
  }
  // Dependencies applied always.
  for (const char* keyword : {"dependencies", "dependentRequired", "dependentSchemas"}) {
    auto it = schema.find(keyword);
    if (it == schema.end() || !it->is_object()) continue;
    nlohmann::json required = schema.value("required", nlohmann::json::array());
    nlohmann::json all_of = schema.value("allOf", nlohmann::json::array());
    if (!required.is_array() || !all_of.is_array()) continue;
    bool whole = true;
    for (const auto& [_, dep] : it->items()) {
      if (dep.is_array()) {
        for (const auto& name : dep) {
          if (!name.is_string()) whole = false;
          if (name.is_string() &&
              std::find(required.begin(), required.end(), name) == required.end()) {
            required.push_back(name);
          }
        }
      } else if (dep.is_object() || dep.is_boolean()) {
        all_of.push_back(dep);
      } else {
        whole = false;
      }
    }
    if (!whole) continue;  // llguidance names what it cannot take
    schema.erase(keyword);
    if (!required.empty()) schema["required"] = required;
    if (!all_of.empty()) schema["allOf"] = all_of;
  }
  if (auto it = schema.find("not"); it != schema.end()) {
    static constexpr std::string_view kTypes[] = {"null",   "boolean", "number", "integer",
                                                  "string", "array",   "object"};
    if (it->is_boolean() ? it->get<bool>() : it->is_object() && it->empty()) {
      schema = false;  // nothing is allowed
      return;
    }
    if (it->is_object() && it->size() == 1 && it->contains("type")) {
      const nlohmann::json& excluded = (*it)["type"];
      auto out = [&](std::string_view t) { return NamesType(excluded, t); };
      // Excluding number excludes its integers; excluding integer alone leaves fractional
      // numbers, which no type names: that is left for llguidance to refuse.
      const bool fractions = out("integer") && !out("number");
      const nlohmann::json own = schema.value("type", nlohmann::json());
      nlohmann::json allowed = nlohmann::json::array();
      for (std::string_view t : kTypes) {
        const bool listed = own.is_null() || NamesType(own, t);
        if (listed && !out(t) && !(t == "integer" && out("number"))) allowed.push_back(t);
      }
      if (fractions && NamesType(allowed, "number")) return;
      schema.erase("not");
      if (allowed.empty()) {
        schema = false;
      } else {
        schema["type"] = allowed;
      }
    }
  }
}

// What the client gave, as an error message names it.
std::string KindName(const std::string& kind) {
  if (kind == "json_schema") return "the JSON schema";
  if (kind == "json_object") return "the JSON object grammar";
  if (kind == "regex") return "the regular expression";
  return "the grammar";
}

}  // namespace

absl::StatusOr<std::string> PreparedSchema(const Grammar& grammar) {
  // JSON without whitespace between its tokens (", " and ": " as separators) unless the schema
  // asks otherwise (llguidance's "x-guidance" options): a model free to add whitespace can add it
  // without end, and the output would stop at max_tokens, unparsed.
  nlohmann::json schema = nlohmann::json::object({{"type", "object"}});
  if (grammar.kind == "json_schema") {
    if (JsonNestsDeeperThan(grammar.data, 64)) {
      return absl::InvalidArgumentError("the schema nests deeper than 64 levels");
    }
    schema = nlohmann::json::parse(grammar.data, nullptr, /*allow_exceptions=*/false);
    if (schema.is_discarded()) return absl::InvalidArgumentError("the schema is not JSON");
  } else if (grammar.kind != "json_object") {
    return absl::InvalidArgumentError(absl::StrCat("a ", grammar.kind, " grammar is no schema"));
  }
  Rewrite(schema, 0);
  // A dialect llguidance does not know ($schema a URI of its own, as Snowplow's self-describing
  // schemas name theirs) would be fetched: read as the latest draft instead, as the jsonschema
  // package reads one.
  if (schema.is_object()) {
    auto it = schema.find("$schema");
    if (it != schema.end() &&
        (!it->is_string() ||
         !(absl::StartsWith(it->get<std::string>(), "http://json-schema.org/") ||
           absl::StartsWith(it->get<std::string>(), "https://json-schema.org/")))) {
      schema.erase(it);
    }
  }
  // Our defaults, kept for what a schema's own x-guidance does not set: no whitespace, and oneOf
  // taken as anyOf (sound where its branches exclude each other, as real schemas' mostly do; an
  // answer matching two of them is possible, and documented).
  if (schema.is_object()) {
    nlohmann::json& options = schema["x-guidance"];
    if (options.is_null()) options = nlohmann::json::object();
    if (!options.is_object()) return absl::InvalidArgumentError("x-guidance must be an object");
    if (!options.contains("whitespace_flexible")) options["whitespace_flexible"] = false;
    if (!options.contains("coerce_one_of")) options["coerce_one_of"] = true;
  }
  return schema.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

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
    ASSIGN_OR_RETURN(data, PreparedSchema(grammar));
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
