#pragma once
// A Hugging Face `tokenizer.json` BPE tokenizer: byte-level BPE (GPT-2 / Llama 3 / Qwen, with the
// pre-tokenizer regex) and SentencePiece-style BPE with byte fallback (Llama 2 / TinyLlama),
// added and special tokens, the template post-processor and the decoder chain. Components it does
// not implement are refused at load, by name. Encode/Decode are thread-safe.
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve {

// A byte range [begin, end) of a text.
struct TextRange {
  size_t begin = 0, end = 0;
  bool operator==(const TextRange&) const = default;
};

class Tokenizer {
 public:
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(const std::string& json_text,
                                                             const std::string& source);
  // tokenizer.json of a model directory, or the tokenizer in the metadata of the GGUF file the
  // path names (model/gguf_model.h).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& model_dir);
  ~Tokenizer();

  // add_special_tokens applies the post-processor template (e.g. a leading BOS). With
  // max_tokens > 0, a text of more tokens is refused (OutOfRange) as soon as that is certain:
  // the work done is bounded by the limit, not by the text. Merges take O(n log n) in a word's
  // length; a word (a pre-tokenizer's piece) of more than 1 MiB is refused (InvalidArgument).
  //
  // In `text_ranges` (byte ranges of `text`, in order and apart) special tokens are not
  // recognised: a special token's string there is text like any other (a chat message's content
  // with serving.specialTokensInContent: text). Added tokens that are not special still match.
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text, bool add_special_tokens = true,
                                              size_t max_tokens = 0,
                                              const std::vector<TextRange>& text_ranges = {}) const;
  // No token covers more than this many bytes of input text, so a text of B bytes holds at least
  // B / MaxBytesPerToken() tokens: a prompt too long for a context can be refused by its size
  // before any work. nullopt when the tokenizer has no such bound (added tokens that take the
  // whitespace around them, a pre-tokenizer that drops what it matches, an unk token fused over
  // runs of unknown characters).
  std::optional<size_t> MaxBytesPerToken() const;
  // Ids that the tokenizer does not know are skipped, as Hugging Face does. Special tokens in
  // `keep` are decoded even when skipping the others (a tool-call marker a parser reads).
  std::string Decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false,
                     const std::vector<int32_t>& keep = {}) const;

  // The bytes token `id` adds inside a text (no UTF-8 repair; not the text's start, so no strip
  // of a leading space); "" for an id the tokenizer lacks. Special tokens give their content.
  std::string TokenBytes(int32_t id) const;
  std::optional<int32_t> TokenId(const std::string& token) const;
  int64_t vocab_size() const;  // largest id + 1
  bool IsSpecial(int32_t id) const;
  // A byte token ("<0xE4>") that a ByteFallback decoder joins with its neighbours: how a run of
  // them decodes is known only once the run ends.
  bool IsByteFallbackToken(int32_t id) const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The GPT-2 byte-to-unicode table used by byte-level BPE (UTF-8 of the printable stand-in).
const std::vector<std::string>& ByteToUnicode();

}  // namespace shardserve
