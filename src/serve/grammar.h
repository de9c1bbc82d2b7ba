#pragma once
// Structured output: response_format's JSON object and JSON schema, and the regex and Lark
// grammar extensions, enforced while sampling by llguidance (its own C interface, built from
// crates.io by serve/guidance). The leader keeps a matcher per constrained sequence (the
// engine's TokenConstraint): before each sampled token it computes the mask of allowed ids, which
// the step carries to the last stage's sampler; the sampled token then advances the matcher.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/generation.h"
#include "tokenizer/tokenizer.h"

struct LlgTokenizer;

namespace shardserve {

// The bounds a grammar is held to before llguidance sees it (CheckGrammarBounds): its text, its
// `$ref`s (each one a level of the compiler's recursion), a Lark grammar's rules and any
// grammar's bracket nesting. With them, the deepest compilation fits a grammar thread's stack
// (serve/grammar_workers.h).
inline constexpr size_t kMaxGrammarBytes = 1 << 20;
inline constexpr size_t kMaxGrammarRefs = 20000;
inline constexpr size_t kMaxLarkRules = 20000;
inline constexpr int kMaxGrammarNesting = 100;
inline constexpr size_t kMaxGrammarSymbols = 200'000;  // llguidance's max_grammar_size

struct Grammar {
  // llguidance's kinds: "json_schema" (data: the schema, JSON text), "json_object" (any JSON
  // object), "regex" (Rust regex syntax, matched whole), "lark" (llguidance's Lark dialect).
  std::string kind;
  std::string data;
};

// llguidance's view of a model's vocabulary: every token's bytes as they stand in a text
// (Tokenizer::TokenBytes), special tokens and ids the tokenizer lacks marked so that no text
// matches them, and the ids that end a generation (allowed once the grammar is complete).
// Thread-safe: one per model, shared by every request's matchers.
class GrammarVocabulary {
 public:
  // `tokenizer` must outlive the vocabulary (llguidance tokenizes forced text with it);
  // vocab_size is the model's (at least the tokenizer's).
  static absl::StatusOr<std::shared_ptr<const GrammarVocabulary>> Create(
      const Tokenizer& tokenizer, int64_t vocab_size, const std::vector<int64_t>& end_ids);
  ~GrammarVocabulary();
  GrammarVocabulary(const GrammarVocabulary&) = delete;
  GrammarVocabulary& operator=(const GrammarVocabulary&) = delete;

  // A matcher of `grammar` at its start; InvalidArgument in our words, with llguidance's reason,
  // when the grammar does not compile (a bad schema, regex or Lark text, or one past the bounds
  // above or llguidance's limits). Recursion as deep as the bounds allow: call it on a grammar
  // thread (serve/grammar_workers.h).
  absl::StatusOr<std::unique_ptr<TokenConstraint>> Compile(const Grammar& grammar) const;

 private:
  GrammarVocabulary() = default;
  LlgTokenizer* tokenizer_ = nullptr;
};

// A JSON schema or JSON object grammar as llguidance takes it: keywords it lacks given their
// sound stand-ins, our x-guidance defaults (no whitespace, oneOf as anyOf) where the schema sets
// none; the schema's JSON text (for llguidance's "json" kind or a Lark grammar's %json).
absl::StatusOr<std::string> PreparedSchema(const Grammar& grammar);

// InvalidArgument naming the bound `grammar` exceeds, if any.
absl::Status CheckGrammarBounds(const Grammar& grammar);

}  // namespace shardserve
