#pragma once
// Trains a BPE tokenizer on a text and writes it as a Hugging Face tokenizer.json.
//   kByteLevel:     GPT-2 style byte-level BPE (ByteLevel pre-tokenizer and decoder).
//   kSentencePiece: Llama 2 style BPE over characters with "▁" for spaces and byte fallback.
// Special tokens come first: 0 <unk> (SentencePiece only) / <pad>, 1 <s>, 2 </s>, then
// `extra_special` (e.g. chat-template markers) from id 3.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve {

enum class TokenizerStyle { kByteLevel, kSentencePiece };

struct TrainedTokenizer {
  std::string json;  // tokenizer.json contents
  int64_t vocab_size = 0;
  int32_t bos_id = 1;
  int32_t eos_id = 2;
};

// Learns merges until the vocabulary has `max_vocab` entries or no pair occurs twice.
absl::StatusOr<TrainedTokenizer> TrainBpeTokenizer(
    std::string_view corpus, TokenizerStyle style, int64_t max_vocab,
    const std::vector<std::string>& extra_special = {});

}  // namespace shardserve
