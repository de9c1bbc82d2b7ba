#include "serve/grammar.h"

#include <llguidance.h>

#include <nlohmann/json.hpp>
#include <string_view>

#include "absl/strings/str_cat.h"
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

class GrammarMatcher final : public TokenConstraint {
 public:
  explicit GrammarMatcher(LlgMatcher* m) : m_(m) {}
  ~GrammarMatcher() override { llg_free_matcher(m_); }

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

 private:
  absl::Status Error(const std::string& what) {
    const char* e = llg_matcher_get_error(m_);
    return absl::InternalError(absl::StrCat("the output's grammar failed on ", what, ": ",
                                            e != nullptr ? e : "(no message)"));
  }
  LlgMatcher* m_;
};

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
  LlgConstraintInit init = {};
  llg_constraint_init_set_defaults(&init, tokenizer_);
  init.log_stderr_level = 0;  // errors come back as statuses
  init.log_buffer_level = 0;
  // llguidance's limits bound the work of a hostile grammar (its size, the lexer's states, each
  // mask's fuel); their defaults are its own.
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
    if (schema.is_object() && !schema.contains("x-guidance")) {
      schema["x-guidance"] = {{"whitespace_flexible", false}};
    }
    data = schema.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    kind = "json";
  }
  if (data.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError("the grammar holds a NUL character");
  }
  LlgMatcher* m = llg_new_matcher(&init, kind, data.c_str());
  auto matcher = std::make_unique<GrammarMatcher>(m);
  if (llg_matcher_is_error(m)) {
    const char* e = llg_matcher_get_error(m);
    return absl::InvalidArgumentError(e != nullptr ? e : "the grammar does not compile");
  }
  return matcher;
}

}  // namespace shardserve
