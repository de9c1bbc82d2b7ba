#include "devtools/bpe_trainer.h"

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/text.h"
#include "tokenizer/tokenizer.h"

namespace shardserve {
namespace {

using json = nlohmann::json;
constexpr char kMeta[] = "\xE2\x96\x81";  // "▁"
constexpr char kGpt2Regex[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Words of the corpus as sequences of symbols (strings), with counts.
std::map<std::vector<std::string>, int64_t> CountWords(std::string_view corpus,
                                                       TokenizerStyle style) {
  std::map<std::vector<std::string>, int64_t> words;
  std::string current;
  auto emit = [&](const std::string& w) {
    if (w.empty()) return;
    std::vector<std::string> syms;
    if (style == TokenizerStyle::kByteLevel) {
      for (unsigned char ch : w) syms.push_back(ByteToUnicode()[ch]);
    } else {
      syms = SplitUtf8Chars(w);
    }
    ++words[syms];
  };
  // Words: a leading space (or "▁") belongs to the word that follows it, as the pre-tokenizers
  // split; runs of punctuation and digits are words of their own.
  auto kind = [](unsigned char c) {
    if (c == ' ' || c == '\n' || c == '\t') return 0;
    if (std::isdigit(c)) return 1;
    if (std::isalpha(c) || c >= 0x80) return 2;
    return 3;
  };
  int prev = -1;
  for (unsigned char c : corpus) {
    const int k = kind(c);
    const bool continues = !current.empty() && (k == prev || (prev == 0 && current == " "));
    if (!continues || k == 0) {
      emit(current);
      current.clear();
    }
    if (k == 0) {
      current = (c == ' ') ? " " : std::string(1, static_cast<char>(c));
      if (c != ' ') {
        emit(current);
        current.clear();
      }
    } else {
      current += static_cast<char>(c);
    }
    prev = k;
  }
  emit(current);
  if (style == TokenizerStyle::kSentencePiece) {
    std::map<std::vector<std::string>, int64_t> out;
    for (auto& [syms, count] : words) {
      std::vector<std::string> s = syms;
      for (auto& x : s) {
        if (x == " ") x = kMeta;
      }
      out[s] += count;
    }
    return out;
  }
  return words;
}

}  // namespace

absl::StatusOr<TrainedTokenizer> TrainBpeTokenizer(std::string_view corpus, TokenizerStyle style,
                                                   int64_t max_vocab,
                                                   const std::vector<std::string>& extra_special) {
  const bool sp = style == TokenizerStyle::kSentencePiece;
  std::vector<std::string> tokens = {sp ? "<unk>" : "<pad>", "<s>", "</s>"};
  tokens.insert(tokens.end(), extra_special.begin(), extra_special.end());
  const size_t num_special = tokens.size();
  if (sp) {
    for (int b = 0; b < 256; ++b) tokens.push_back(absl::StrFormat("<0x%02X>", b));
  } else {
    for (int b = 0; b < 256; ++b) tokens.push_back(ByteToUnicode()[b]);
  }
  if (max_vocab < static_cast<int64_t>(tokens.size())) {
    return absl::InvalidArgumentError(absl::StrCat("vocabulary of ", max_vocab,
                                                   " is too small for the tokenizer's ",
                                                   tokens.size(), " base tokens"));
  }
  auto word_counts = CountWords(corpus, style);
  std::vector<std::pair<std::vector<std::string>, int64_t>> words(word_counts.begin(),
                                                                  word_counts.end());
  std::unordered_map<std::string, int32_t> index;
  for (size_t i = 0; i < tokens.size(); ++i) index[tokens[i]] = static_cast<int32_t>(i);
  if (sp) {  // every character of the corpus is a base token; other characters use bytes
    std::vector<std::string> chars;
    for (const auto& [syms, n] : words) {
      for (const auto& s : syms) chars.push_back(s);
    }
    std::sort(chars.begin(), chars.end());
    chars.erase(std::unique(chars.begin(), chars.end()), chars.end());
    for (const auto& ch : chars) {
      if (!index.count(ch) && static_cast<int64_t>(tokens.size()) < max_vocab) {
        index[ch] = static_cast<int32_t>(tokens.size());
        tokens.push_back(ch);
      }
    }
  }
  std::vector<std::pair<std::string, std::string>> merges;
  while (static_cast<int64_t>(tokens.size()) < max_vocab) {
    std::map<std::pair<std::string, std::string>, int64_t> pairs;
    for (const auto& [syms, n] : words) {
      for (size_t i = 0; i + 1 < syms.size(); ++i) pairs[{syms[i], syms[i + 1]}] += n;
    }
    auto best = pairs.end();
    for (auto it = pairs.begin(); it != pairs.end(); ++it) {
      if (!index.count(it->first.first) || !index.count(it->first.second)) continue;
      if (index.count(it->first.first + it->first.second)) continue;
      if (best == pairs.end() || it->second > best->second) best = it;
    }
    if (best == pairs.end() || best->second < 2) break;
    const auto [a, b] = best->first;
    merges.push_back({a, b});
    index[a + b] = static_cast<int32_t>(tokens.size());
    tokens.push_back(a + b);
    for (auto& [syms, n] : words) {
      std::vector<std::string> merged;
      for (size_t i = 0; i < syms.size(); ++i) {
        if (i + 1 < syms.size() && syms[i] == a && syms[i + 1] == b) {
          merged.push_back(a + b);
          ++i;
        } else {
          merged.push_back(syms[i]);
        }
      }
      syms.swap(merged);
    }
  }

  json vocab = json::object();
  for (size_t i = 0; i < tokens.size(); ++i) vocab[tokens[i]] = i;
  json merges_json = json::array();
  for (const auto& [a, b] : merges) merges_json.push_back(json::array({a, b}));
  auto added = [](int id, const std::string& content) {
    return json{{"id", id},        {"content", content},  {"single_word", false}, {"lstrip", false},
                {"rstrip", false}, {"normalized", false}, {"special", true}};
  };
  json j;
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  j["added_tokens"] = json::array();
  for (size_t i = 0; i < num_special; ++i) j["added_tokens"].push_back(added(i, tokens[i]));
  j["normalizer"] = nullptr;
  json model = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", sp ? json("<unk>") : json(nullptr)},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", sp},
                {"byte_fallback", sp},
                {"ignore_merges", false},
                {"vocab", vocab},
                {"merges", merges_json}};
  j["model"] = model;
  const json bos_template = {
      {"single", json::array({json{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                              json{{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
      {"pair", json::array({json{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                            json{{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                            json{{"SpecialToken", {{"id", "<s>"}, {"type_id", 1}}}},
                            json{{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
      {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}};
  j["post_processor"] = json{{"type", "TemplateProcessing"}};
  j["post_processor"].update(bos_template);
  if (sp) {
    // The form Hugging Face writes for Llama 2 / TinyLlama: "▁" prepended and spaces replaced by
    // the normalizer, no pre-tokenizer.
    j["normalizer"] = {
        {"type", "Sequence"},
        {"normalizers",
         json::array({{{"type", "Prepend"}, {"prepend", kMeta}},
                      {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kMeta}}})}};
    j["pre_tokenizer"] = nullptr;
    j["decoder"] = {
        {"type", "Sequence"},
        {"decoders", json::array({
                         {{"type", "Replace"}, {"pattern", {{"String", kMeta}}}, {"content", " "}},
                         {{"type", "ByteFallback"}},
                         {{"type", "Fuse"}},
                         {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}},
                     })}};
  } else {
    j["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers", json::array({{{"type", "Split"},
                                                          {"pattern", {{"Regex", kGpt2Regex}}},
                                                          {"behavior", "Isolated"},
                                                          {"invert", false}},
                                                         {{"type", "ByteLevel"},
                                                          {"add_prefix_space", false},
                                                          {"trim_offsets", true},
                                                          {"use_regex", false}}})}};
    j["decoder"] = {{"type", "ByteLevel"},
                    {"add_prefix_space", true},
                    {"trim_offsets", true},
                    {"use_regex", true}};
  }
  TrainedTokenizer out;
  out.json = j.dump(1);
  out.vocab_size = static_cast<int64_t>(tokens.size());
  return out;
}

}  // namespace shardserve
