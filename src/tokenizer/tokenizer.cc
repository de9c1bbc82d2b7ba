#include "tokenizer/tokenizer.h"

#include "model/gguf_model.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <queue>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/status.h"
#include "common/text.h"

namespace shardserve {
namespace {

using json = nlohmann::json;

// In one pass (replacing in place would move the rest of the text at every match: quadratic).
std::string ReplaceAll(const std::string& s, const std::string& from, const std::string& to) {
  if (from.empty()) return s;
  std::string out;
  out.reserve(s.size());
  size_t last = 0;
  for (size_t pos = s.find(from); pos != std::string::npos; pos = s.find(from, last)) {
    out.append(s, last, pos - last);
    out += to;
    last = pos + from.size();
  }
  out.append(s, last, std::string::npos);
  return out;
}

bool ValidUtf8(std::string_view s) {
  utf8proc_int32_t cp;
  for (size_t i = 0; i < s.size();) {
    const auto n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i),
                                    static_cast<utf8proc_ssize_t>(s.size() - i), &cp);
    if (n <= 0) return false;
    i += static_cast<size_t>(n);
  }
  return true;
}

// Replaces invalid UTF-8 with U+FFFD, one per maximal invalid subpart (the Unicode
// recommendation that Rust's from_utf8_lossy, and so `tokenizers`, follows): a lead byte and the
// continuation bytes that could still have completed its character count as one.
std::string Utf8Lossy(std::string_view s) {
  std::string out;
  const auto byte = [&](size_t i) { return i < s.size() ? static_cast<uint8_t>(s[i]) : 0; };
  const auto cont = [](uint8_t b, uint8_t lo = 0x80, uint8_t hi = 0xBF) {
    return b >= lo && b <= hi;
  };
  for (size_t i = 0; i < s.size();) {
    const uint8_t b0 = byte(i);
    size_t good = 0, bad = 1;  // a whole character's length, or the invalid run's
    if (b0 < 0x80) {
      good = 1;
    } else if (b0 >= 0xC2 && b0 <= 0xDF) {
      if (cont(byte(i + 1))) good = 2;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      const uint8_t lo = b0 == 0xE0 ? 0xA0 : 0x80, hi = b0 == 0xED ? 0x9F : 0xBF;
      if (cont(byte(i + 1), lo, hi)) {
        if (cont(byte(i + 2)))
          good = 3;
        else
          bad = 2;
      }
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      const uint8_t lo = b0 == 0xF0 ? 0x90 : 0x80, hi = b0 == 0xF4 ? 0x8F : 0xBF;
      if (cont(byte(i + 1), lo, hi)) {
        if (!cont(byte(i + 2)))
          bad = 2;
        else if (!cont(byte(i + 3)))
          bad = 3;
        else
          good = 4;
      }
    }
    if (good > 0) {
      out.append(s.substr(i, good));
      i += good;
    } else {
      out += "\xEF\xBF\xBD";
      i += bad;
    }
  }
  return out;
}

// The byte a SentencePiece byte-fallback token ("<0xE4>") stands for.
std::optional<char> ByteFallbackByte(const std::string& t) {
  unsigned int byte;
  if (t.size() == 6 && t.rfind("<0x", 0) == 0 && t[5] == '>' &&
      std::sscanf(t.c_str() + 3, "%2X", &byte) == 1) {
    return static_cast<char>(byte);
  }
  return std::nullopt;
}

// A compiled PCRE2 pattern (UTF + Unicode properties), owned.
class Regex {
 public:
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(const std::string& pattern) {
    int err;
    PCRE2_SIZE off;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                     PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      return absl::InvalidArgumentError(absl::StrCat("regex '", pattern, "' does not compile at ",
                                                     off, ": ", reinterpret_cast<char*>(msg)));
    }
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
    return std::unique_ptr<Regex>(new Regex(code));
  }
  ~Regex() { pcre2_code_free(code_); }

  // Non-overlapping matches as [begin, end) byte ranges.
  std::vector<std::pair<size_t, size_t>> FindAll(std::string_view s) const {
    std::vector<std::pair<size_t, size_t>> out;
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    size_t pos = 0;
    // The subject's UTF-8 is checked by the first match only: checking it at every match would
    // make a long text quadratic.
    uint32_t options = 0;
    while (pos <= s.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos,
                                 options, md, nullptr);
      options = PCRE2_NO_UTF_CHECK;
      if (rc < 0) break;
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      if (ov[1] == ov[0]) {  // empty match: step over one character
        pos = ov[0] + (ov[0] < s.size() ? Utf8CharLen(static_cast<unsigned char>(s[ov[0]])) : 1);
        continue;
      }
      out.push_back({ov[0], ov[1]});
      pos = ov[1];
    }
    pcre2_match_data_free(md);
    return out;
  }

 private:
  explicit Regex(pcre2_code* code) : code_(code) {}
  pcre2_code* code_;
};

constexpr char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr char kMetaspace[] = "\xE2\x96\x81";  // U+2581 "▁"
constexpr int64_t kMaxTokenId = 1 << 24;       // far past any vocabulary

struct Normalizer {
  enum Kind { kPrepend, kReplace, kNfc } kind;
  std::string a, b;
};

struct PreTokenizer {
  enum Kind { kByteLevel, kSplit, kMetaspace, kDigits } kind;
  bool add_prefix_space = false;   // ByteLevel
  bool use_regex = true;           // ByteLevel
  std::unique_ptr<Regex> regex;    // ByteLevel (GPT-2) or Split
  bool remove_matches = false;     // Split behavior Removed (else Isolated)
  std::string replacement;         // Metaspace
  std::string prepend_scheme;      // Metaspace: always | first | never
  bool split = true;               // Metaspace
  bool individual_digits = false;  // Digits
};

struct Decoder {
  enum Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind;
  std::string a, b;  // Replace: pattern, content; Strip: content; Metaspace: replacement
  int start = 0, stop = 0;
  bool prepend = true;  // Metaspace: strip the leading space of the first token
};

struct AddedToken {
  int32_t id;
  std::string content;
  bool special, lstrip, rstrip;
};

}  // namespace

const std::vector<std::string>& ByteToUnicode() {
  static const std::vector<std::string> table = [] {
    std::vector<std::string> t(256);
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      const int cp = printable ? b : next++;
      utf8proc_uint8_t buf[4];
      const auto n = utf8proc_encode_char(cp, buf);
      t[b] = std::string(reinterpret_cast<char*>(buf), n);
    }
    return t;
  }();
  return table;
}

struct Tokenizer::Impl {
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<std::string> id_to_token;  // "" where an id has no token
  // (left id << 32 | right id) -> (rank, merged id)
  absl::flat_hash_map<uint64_t, std::pair<int32_t, int32_t>> merges;
  bool byte_fallback = false;
  bool ignore_merges = false;
  bool byte_level = false;  // a ByteLevel pre-tokenizer maps bytes to stand-in characters
  std::optional<int32_t> unk_id;
  bool fuse_unk = false;
  std::vector<Normalizer> normalizers;
  std::vector<PreTokenizer> pre_tokenizers;
  std::vector<Decoder> decoders;
  std::vector<AddedToken> added;
  // The added tokens by their first byte, longest first (matching prefers them).
  std::array<std::vector<const AddedToken*>, 256> added_by_byte;
  size_t max_token_bytes = 4;      // the longest vocabulary entry (at least a character)
  bool strips_whitespace = false;  // an added token takes the whitespace around it
  bool nfc = false;
  std::vector<bool> special;
  std::vector<int32_t> prefix_ids, suffix_ids;  // post-processor template around the sequence
  std::unordered_map<std::string, int32_t> byte_fallback_ids;  // "<0x41>" lookups, by byte
  std::unordered_map<std::string, unsigned char> unicode_to_byte;

  // Words seen before and their ids: words of at most kMaxCachedWordBytes, kCacheBytes in all
  // (emptied when full), so no stream of distinct words grows it without bound.
  mutable absl::Mutex cache_mu;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache ABSL_GUARDED_BY(cache_mu);
  mutable size_t cache_bytes ABSL_GUARDED_BY(cache_mu) = 0;

  absl::Status ParseModel(const json& m, const std::string& src);
  absl::Status ParseNormalizer(const json& n, const std::string& src);
  absl::Status ParsePreTokenizer(const json& p, const std::string& src);
  absl::Status ParseDecoder(const json& d, const std::string& src);
  absl::Status ParsePostProcessor(const json& p, const std::string& src);

  std::string Normalize(std::string s) const;
  std::vector<std::string> PreTokenize(const std::string& s, bool first_section) const;
  absl::Status Bpe(const std::string& word, std::vector<int32_t>& out) const;
  // The word's initial symbols: a token per character, byte fallback, or unk.
  absl::Status Symbols(const std::string& word, std::vector<int32_t>& syms) const;
  std::optional<std::pair<int32_t, int32_t>> Merge(int32_t left, int32_t right) const {
    auto it = merges.find(static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32 |
                          static_cast<uint32_t>(right));
    if (it == merges.end()) return std::nullopt;
    return it->second;
  }
  // No token covers more than this many bytes of a pre-tokenized word (nullopt: unbounded, an
  // unk token fused over a run of unknown characters).
  std::optional<size_t> WordBytesPerToken() const {
    if (fuse_unk && unk_id && !byte_level && !byte_fallback) return std::nullopt;
    return max_token_bytes;
  }
};

namespace {
constexpr size_t kMaxCachedWordBytes = 256;
constexpr size_t kMaxWordBytes = 1 << 20;
constexpr size_t kCacheBytes = 16 << 20;
}  // namespace

namespace {

absl::Status Refuse(const std::string& src, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(src, ": ", what, " is not supported"));
}

std::string TypeOf(const json& j) {
  return j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>()
                                                                      : std::string("?");
}

absl::StatusOr<std::string> StringPattern(const json& pattern, const std::string& src,
                                          const std::string& where) {
  if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string()) {
    return pattern["String"].get<std::string>();
  }
  return Refuse(src, absl::StrCat(where, " with pattern ", pattern.dump()));
}

}  // namespace

absl::Status Tokenizer::Impl::ParseModel(const json& m, const std::string& src) {
  if (!m.is_object() || TypeOf(m) != "BPE") {
    return Refuse(src, absl::StrCat("model type '", TypeOf(m), "' (only BPE)"));
  }
  if (!m.contains("vocab") || !m["vocab"].is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(src, ": model.vocab is missing"));
  }
  for (auto it = m["vocab"].begin(); it != m["vocab"].end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 ||
        it.value().get<int64_t>() > kMaxTokenId) {
      return absl::InvalidArgumentError(
          absl::StrCat(src, ": vocab entry '", it.key(), "' has an invalid id"));
    }
    vocab[it.key()] = it.value().get<int32_t>();
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (m.contains(key) && !m[key].is_null() && m[key] != "") {
      return Refuse(src, absl::StrCat("model.", key));
    }
  }
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() != 0.0) {
    return Refuse(src, "BPE dropout");
  }
  byte_fallback = m.value("byte_fallback", false);
  ignore_merges = m.value("ignore_merges", false);
  fuse_unk = m.value("fuse_unk", false);
  if (m.contains("unk_token") && m["unk_token"].is_string()) {
    auto it = vocab.find(m["unk_token"].get<std::string>());
    if (it == vocab.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          src, ": unk_token '", m["unk_token"].get<std::string>(), "' is not in the vocabulary"));
    }
    unk_id = it->second;
  }
  const json merges_json = m.value("merges", json::array());
  int32_t rank = 0;
  for (const json& mj : merges_json) {
    std::string a, b;
    if (mj.is_string()) {
      const std::string s = mj.get<std::string>();
      const size_t sp = s.find(' ', 1);
      if (sp == std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat(src, ": merge '", s, "' has no space"));
      }
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (mj.is_array() && mj.size() == 2 && mj[0].is_string() && mj[1].is_string()) {
      a = mj[0].get<std::string>();
      b = mj[1].get<std::string>();
    } else {
      return absl::InvalidArgumentError(absl::StrCat(src, ": merge ", mj.dump(), " is malformed"));
    }
    auto ia = vocab.find(a), ib = vocab.find(b), ic = vocab.find(a + b);
    if (ia == vocab.end() || ib == vocab.end() || ic == vocab.end()) {
      return absl::InvalidArgumentError(absl::StrCat(src, ": merge '", a, " ", b,
                                                     "' uses or makes a token not in the "
                                                     "vocabulary"));
    }
    merges.emplace(static_cast<uint64_t>(static_cast<uint32_t>(ia->second)) << 32 |
                       static_cast<uint32_t>(ib->second),
                   std::make_pair(rank++, ic->second));
  }
  if (byte_fallback) {
    for (int b = 0; b < 256; ++b) {
      const std::string tok = absl::StrFormat("<0x%02X>", b);
      auto it = vocab.find(tok);
      if (it != vocab.end()) byte_fallback_ids[std::string(1, static_cast<char>(b))] = it->second;
    }
  }
  return absl::OkStatus();
}

absl::Status Tokenizer::Impl::ParseNormalizer(const json& n, const std::string& src) {
  if (n.is_null()) return absl::OkStatus();
  const std::string type = TypeOf(n);
  if (type == "Sequence") {
    for (const json& s : n.value("normalizers", json::array())) {
      RETURN_IF_ERROR(ParseNormalizer(s, src));
    }
  } else if (type == "Prepend") {
    normalizers.push_back({Normalizer::kPrepend, n.value("prepend", ""), ""});
  } else if (type == "Replace") {
    ASSIGN_OR_RETURN(std::string pattern, StringPattern(n["pattern"], src, "Replace normalizer"));
    normalizers.push_back({Normalizer::kReplace, pattern, n.value("content", "")});
  } else if (type == "NFC") {
    normalizers.push_back({Normalizer::kNfc, "", ""});
  } else {
    return Refuse(src, absl::StrCat("normalizer '", type, "'"));
  }
  return absl::OkStatus();
}

absl::Status Tokenizer::Impl::ParsePreTokenizer(const json& p, const std::string& src) {
  if (p.is_null()) return absl::OkStatus();
  const std::string type = TypeOf(p);
  PreTokenizer t;
  if (type == "Sequence") {
    for (const json& s : p.value("pretokenizers", json::array())) {
      RETURN_IF_ERROR(ParsePreTokenizer(s, src));
    }
    return absl::OkStatus();
  } else if (type == "ByteLevel") {
    t.kind = PreTokenizer::kByteLevel;
    t.add_prefix_space = p.value("add_prefix_space", false);
    t.use_regex = p.value("use_regex", true);
    if (t.use_regex) {
      ASSIGN_OR_RETURN(t.regex, Regex::Compile(kGpt2Pattern));
    }
    byte_level = true;
  } else if (type == "Split") {
    t.kind = PreTokenizer::kSplit;
    const json& pattern = p["pattern"];
    std::string regex;
    if (pattern.is_object() && pattern.contains("Regex")) {
      regex = pattern["Regex"].get<std::string>();
    } else {
      ASSIGN_OR_RETURN(std::string literal, StringPattern(pattern, src, "Split pre-tokenizer"));
      for (char ch : literal) {
        if (std::string("\\^$.|?*+()[]{}").find(ch) != std::string::npos) regex += '\\';
        regex += ch;
      }
    }
    ASSIGN_OR_RETURN(t.regex, Regex::Compile(regex));
    const std::string behavior = p.value("behavior", "Isolated");
    if (behavior == "Removed") {
      t.remove_matches = true;
    } else if (behavior != "Isolated") {
      return Refuse(src, absl::StrCat("Split behavior '", behavior, "'"));
    }
    if (p.value("invert", false)) return Refuse(src, "Split with invert");
  } else if (type == "Metaspace") {
    t.kind = PreTokenizer::kMetaspace;
    t.replacement = p.value("replacement", std::string(kMetaspace));
    t.prepend_scheme =
        p.value("prepend_scheme", p.value("add_prefix_space", true) ? "always" : "never");
    t.split = p.value("split", true);
  } else if (type == "Digits") {
    t.kind = PreTokenizer::kDigits;
    t.individual_digits = p.value("individual_digits", false);
    ASSIGN_OR_RETURN(t.regex, Regex::Compile(t.individual_digits ? "\\p{N}" : "\\p{N}+"));
  } else {
    return Refuse(src, absl::StrCat("pre-tokenizer '", type, "'"));
  }
  pre_tokenizers.push_back(std::move(t));
  return absl::OkStatus();
}

absl::Status Tokenizer::Impl::ParseDecoder(const json& d, const std::string& src) {
  if (d.is_null()) return absl::OkStatus();
  const std::string type = TypeOf(d);
  Decoder dec{};
  if (type == "Sequence") {
    for (const json& s : d.value("decoders", json::array())) RETURN_IF_ERROR(ParseDecoder(s, src));
    return absl::OkStatus();
  } else if (type == "ByteLevel") {
    dec.kind = Decoder::kByteLevel;
  } else if (type == "Replace") {
    dec.kind = Decoder::kReplace;
    ASSIGN_OR_RETURN(dec.a, StringPattern(d["pattern"], src, "Replace decoder"));
    dec.b = d.value("content", "");
  } else if (type == "ByteFallback") {
    dec.kind = Decoder::kByteFallback;
  } else if (type == "Fuse") {
    dec.kind = Decoder::kFuse;
  } else if (type == "Strip") {
    dec.kind = Decoder::kStrip;
    dec.a = d.value("content", " ");
    dec.start = d.value("start", 0);
    dec.stop = d.value("stop", 0);
  } else if (type == "Metaspace") {
    dec.kind = Decoder::kMetaspace;
    dec.a = d.value("replacement", std::string(kMetaspace));
    dec.prepend = d.value("prepend_scheme", std::string("always")) != "never" &&
                  d.value("add_prefix_space", true);
  } else {
    return Refuse(src, absl::StrCat("decoder '", type, "'"));
  }
  decoders.push_back(dec);
  return absl::OkStatus();
}

absl::Status Tokenizer::Impl::ParsePostProcessor(const json& p, const std::string& src) {
  if (p.is_null()) return absl::OkStatus();
  const std::string type = TypeOf(p);
  if (type == "Sequence") {
    for (const json& s : p.value("processors", json::array())) {
      RETURN_IF_ERROR(ParsePostProcessor(s, src));
    }
    return absl::OkStatus();
  }
  if (type == "ByteLevel") return absl::OkStatus();  // only adjusts offsets
  if (type != "TemplateProcessing") return Refuse(src, absl::StrCat("post-processor '", type, "'"));
  const json specials = p.value("special_tokens", json::object());
  bool seen_sequence = false;
  for (const json& piece : p.value("single", json::array())) {
    if (piece.contains("Sequence")) {
      seen_sequence = true;
      continue;
    }
    if (!piece.contains("SpecialToken")) {
      return Refuse(src, absl::StrCat("template piece ", piece.dump()));
    }
    const std::string name = piece["SpecialToken"].value("id", "");
    if (!specials.contains(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(src, ": template names special token '", name, "' without ids"));
    }
    for (const json& id : specials[name].value("ids", json::array())) {
      (seen_sequence ? suffix_ids : prefix_ids).push_back(id.get<int32_t>());
    }
  }
  return absl::OkStatus();
}

std::string Tokenizer::Impl::Normalize(std::string s) const {
  for (const Normalizer& n : normalizers) {
    switch (n.kind) {
      case Normalizer::kPrepend:
        if (!s.empty()) s = n.a + s;
        break;
      case Normalizer::kReplace:
        s = ReplaceAll(s, n.a, n.b);
        break;
      case Normalizer::kNfc: {
        utf8proc_uint8_t* out = utf8proc_NFC(reinterpret_cast<const utf8proc_uint8_t*>(s.c_str()));
        if (out != nullptr) {
          s = reinterpret_cast<char*>(out);
          free(out);
        }
        break;
      }
    }
  }
  return s;
}

std::vector<std::string> Tokenizer::Impl::PreTokenize(const std::string& text,
                                                      bool first_section) const {
  std::vector<std::string> pieces{text};
  for (const PreTokenizer& p : pre_tokenizers) {
    std::vector<std::string> next;
    for (size_t pi = 0; pi < pieces.size(); ++pi) {
      const std::string& s = pieces[pi];
      switch (p.kind) {
        case PreTokenizer::kByteLevel: {
          std::string src = s;
          if (p.add_prefix_space && !src.empty() && src[0] != ' ') src = " " + src;
          std::vector<std::string> parts;
          if (p.regex) {
            for (auto [b, e] : p.regex->FindAll(src)) parts.push_back(src.substr(b, e - b));
          } else {
            parts.push_back(src);
          }
          for (const std::string& part : parts) {
            std::string mapped;
            for (unsigned char ch : part) mapped += ByteToUnicode()[ch];
            next.push_back(std::move(mapped));
          }
          break;
        }
        case PreTokenizer::kSplit:
        case PreTokenizer::kDigits: {
          size_t last = 0;
          for (auto [b, e] : p.regex->FindAll(s)) {
            if (b > last) next.push_back(s.substr(last, b - last));
            if (!p.remove_matches) next.push_back(s.substr(b, e - b));
            last = e;
          }
          if (last < s.size()) next.push_back(s.substr(last));
          break;
        }
        case PreTokenizer::kMetaspace: {
          std::string r = ReplaceAll(s, " ", p.replacement);
          const bool prepend = p.prepend_scheme == "always" ||
                               (p.prepend_scheme == "first" && first_section && pi == 0);
          if (prepend && r.rfind(p.replacement, 0) != 0) r = p.replacement + r;
          if (!p.split) {
            next.push_back(r);
            break;
          }
          size_t start = 0;  // split before each replacement char (merged with the next)
          for (size_t pos = r.find(p.replacement, 1); pos != std::string::npos;
               pos = r.find(p.replacement, pos + 1)) {
            next.push_back(r.substr(start, pos - start));
            start = pos;
          }
          next.push_back(r.substr(start));
          break;
        }
      }
    }
    pieces.swap(next);
  }
  pieces.erase(std::remove(pieces.begin(), pieces.end(), std::string()), pieces.end());
  return pieces;
}

absl::Status Tokenizer::Impl::Symbols(const std::string& word, std::vector<int32_t>& syms) const {
  for (const std::string& ch : SplitUtf8Chars(word)) {
    auto it = vocab.find(ch);
    if (it != vocab.end()) {
      syms.push_back(it->second);
      continue;
    }
    if (byte_fallback) {
      bool all = true;
      std::vector<int32_t> bytes;
      for (char b : ch) {
        auto bt = byte_fallback_ids.find(std::string(1, b));
        if (bt == byte_fallback_ids.end()) {
          all = false;
          break;
        }
        bytes.push_back(bt->second);
      }
      if (all) {
        syms.insert(syms.end(), bytes.begin(), bytes.end());
        continue;
      }
    }
    if (!unk_id) {
      return absl::InvalidArgumentError(absl::StrCat(
          "character '", ch, "' is not in the vocabulary and the tokenizer has no unk token"));
    }
    if (fuse_unk && !syms.empty() && syms.back() == *unk_id) continue;
    syms.push_back(*unk_id);
  }
  return absl::OkStatus();
}

// Merges as Hugging Face's `tokenizers` does (word.rs, merge_all): the pair of lowest rank
// first, the leftmost among equals, in O(n log n): the symbols form a linked list and the
// candidate pairs a heap; a candidate whose symbols have changed since it was pushed is dropped
// when popped.
absl::Status Tokenizer::Impl::Bpe(const std::string& word, std::vector<int32_t>& out) const {
  if (ignore_merges) {
    auto it = vocab.find(word);
    if (it != vocab.end()) {
      out.push_back(it->second);
      return absl::OkStatus();
    }
  }
  const bool cacheable = word.size() <= kMaxCachedWordBytes;
  if (cacheable) {
    absl::MutexLock lock(&cache_mu);
    auto it = cache.find(word);
    if (it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return absl::OkStatus();
    }
  }
  std::vector<int32_t> ids;
  RETURN_IF_ERROR(Symbols(word, ids));
  const int n = static_cast<int>(ids.size());
  std::vector<int> prev(n), next(n);
  std::vector<bool> alive(n, true);
  for (int i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Candidate {
    int32_t rank;
    int pos;
    int32_t merged;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  auto push = [&](int pos) {
    if (pos < 0 || next[pos] < 0) return;
    if (auto m = Merge(ids[pos], ids[next[pos]])) heap.push({m->first, pos, m->second});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    if (!alive[c.pos] || next[c.pos] < 0) continue;
    const int right = next[c.pos];
    auto m = Merge(ids[c.pos], ids[right]);
    if (!m || m->second != c.merged || m->first != c.rank) continue;  // stale
    ids[c.pos] = c.merged;
    alive[right] = false;
    next[c.pos] = next[right];
    if (next[right] >= 0) prev[next[right]] = c.pos;
    push(prev[c.pos]);
    push(c.pos);
  }
  std::vector<int32_t> syms;
  for (int i = n > 0 ? 0 : -1; i >= 0; i = next[i]) syms.push_back(ids[i]);
  out.insert(out.end(), syms.begin(), syms.end());
  if (!cacheable) return absl::OkStatus();
  const size_t bytes = word.size() + syms.size() * sizeof(int32_t) + 64;
  absl::MutexLock lock(&cache_mu);
  if (cache_bytes + bytes > kCacheBytes) {
    cache.clear();
    cache_bytes = 0;
  }
  if (cache.emplace(word, std::move(syms)).second) cache_bytes += bytes;
  return absl::OkStatus();
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(const std::string& text,
                                                               const std::string& src) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(src, ": not valid JSON: ", e.what()));
  }
  if (!j.is_object() || !j.contains("model")) {
    return absl::InvalidArgumentError(absl::StrCat(src, ": has no 'model' section"));
  }
  auto impl = std::make_unique<Impl>();
  try {
    RETURN_IF_ERROR(impl->ParseModel(j["model"], src));
    RETURN_IF_ERROR(impl->ParseNormalizer(j.value("normalizer", json()), src));
    RETURN_IF_ERROR(impl->ParsePreTokenizer(j.value("pre_tokenizer", json()), src));
    RETURN_IF_ERROR(impl->ParseDecoder(j.value("decoder", json()), src));
    for (const json& a : j.value("added_tokens", json::array())) {
      const json& id = a.at("id");
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > kMaxTokenId) {
        return absl::InvalidArgumentError(
            absl::StrCat(src, ": added token ", id.dump(), " has an invalid id"));
      }
      AddedToken t{id.get<int32_t>(), a.at("content").get<std::string>(), a.value("special", false),
                   a.value("lstrip", false), a.value("rstrip", false)};
      if (t.content.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(src, ": added token ", t.id, " is empty"));
      }
      impl->vocab[t.content] = t.id;
      impl->added.push_back(std::move(t));
    }
    RETURN_IF_ERROR(impl->ParsePostProcessor(j.value("post_processor", json()), src));
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(src, ": malformed: ", e.what()));
  }
  // Longest added tokens first, so that matching prefers them.
  std::sort(impl->added.begin(), impl->added.end(), [](const AddedToken& a, const AddedToken& b) {
    return a.content.size() > b.content.size();
  });
  for (const AddedToken& a : impl->added) {
    impl->added_by_byte[static_cast<unsigned char>(a.content[0])].push_back(&a);
    if (a.lstrip || a.rstrip) impl->strips_whitespace = true;
  }
  for (const auto& [tok, id] : impl->vocab) {
    impl->max_token_bytes = std::max(impl->max_token_bytes, tok.size());
  }
  impl->nfc = std::any_of(impl->normalizers.begin(), impl->normalizers.end(),
                          [](const Normalizer& n) { return n.kind == Normalizer::kNfc; });
  int32_t max_id = -1;
  for (const auto& [tok, id] : impl->vocab) max_id = std::max(max_id, id);
  impl->id_to_token.assign(max_id + 1, "");
  impl->special.assign(max_id + 1, false);
  for (const auto& [tok, id] : impl->vocab) impl->id_to_token[id] = tok;
  for (const AddedToken& a : impl->added) impl->special[a.id] = a.special;
  for (int32_t id : impl->prefix_ids) {
    if (id < 0 || id > max_id) {
      return absl::InvalidArgumentError(absl::StrCat(src, ": template token id ", id, " unknown"));
    }
  }
  for (int b = 0; b < 256; ++b) impl->unicode_to_byte[ByteToUnicode()[b]] = b;
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& model_dir) {
  if (auto gguf = FindGgufFile(model_dir); gguf.ok() && gguf->has_value()) {
    ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> f, GgufFile::Open(**gguf));
    ASSIGN_OR_RETURN(GgufTokenizerFiles files, GgufTokenizer(*f));
    return FromJson(files.tokenizer_json, absl::StrCat(**gguf, " (GGUF tokenizer)"));
  }
  const std::string path = (std::filesystem::path(model_dir) / "tokenizer.json").string();
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  return FromJson(text, path);
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(
    std::string_view text, bool add_special_tokens, size_t max_tokens,
    const std::vector<TextRange>& text_ranges) const {
  const Impl& m = *impl_;
  std::vector<int32_t> ids;
  if (add_special_tokens) ids = m.prefix_ids;
  const std::optional<size_t> per_token = m.WordBytesPerToken();
  auto too_many = [&] {
    return absl::OutOfRangeError(absl::StrCat("the text holds more than ", max_tokens, " tokens"));
  };
  auto is_space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  // Split around added tokens, then normalize, pre-tokenize and BPE each plain section.
  size_t section_start = 0, i = 0;
  bool first_section = true;
  auto flush = [&](size_t end) -> absl::Status {
    if (end > section_start) {
      const std::string normalized =
          m.Normalize(std::string(text.substr(section_start, end - section_start)));
      for (const std::string& piece : m.PreTokenize(normalized, first_section)) {
        // A word needs at least this many tokens: refused before the work if they cannot fit.
        if (max_tokens > 0 && per_token &&
            ids.size() + (piece.size() + *per_token - 1) / *per_token > max_tokens) {
          return too_many();
        }
        if (piece.size() > kMaxWordBytes) {
          return absl::InvalidArgumentError(absl::StrCat(
              "the text holds a word of ", piece.size(),
              " bytes; words (runs without a break) are limited to ", kMaxWordBytes, " bytes"));
        }
        RETURN_IF_ERROR(m.Bpe(piece, ids));
        if (max_tokens > 0 && ids.size() > max_tokens) return too_many();
      }
      first_section = false;
    }
    return absl::OkStatus();
  };
  size_t range = 0;  // the first text range that does not end before i
  // Whether [begin, end) overlaps a text range (ranges are in order; begin only grows).
  auto in_text_range = [&](size_t begin, size_t end) {
    while (range < text_ranges.size() && text_ranges[range].end <= begin) ++range;
    return range < text_ranges.size() && text_ranges[range].begin < end;
  };
  while (i < text.size()) {
    const AddedToken* hit = nullptr;
    for (const AddedToken* a : m.added_by_byte[static_cast<unsigned char>(text[i])]) {
      if (a->special && in_text_range(i, i + a->content.size())) continue;
      if (text.compare(i, a->content.size(), a->content) == 0) {
        hit = a;
        break;
      }
    }
    if (hit == nullptr) {
      ++i;
      continue;
    }
    size_t begin = i, end = i + hit->content.size();
    if (hit->lstrip) {
      while (begin > section_start && is_space(text[begin - 1])) --begin;
    }
    RETURN_IF_ERROR(flush(begin));
    ids.push_back(hit->id);
    if (max_tokens > 0 && ids.size() > max_tokens) return too_many();
    if (hit->rstrip) {
      while (end < text.size() && is_space(text[end])) ++end;
    }
    i = section_start = end;
    first_section = false;
  }
  RETURN_IF_ERROR(flush(text.size()));
  if (add_special_tokens) ids.insert(ids.end(), m.suffix_ids.begin(), m.suffix_ids.end());
  if (max_tokens > 0 && ids.size() > max_tokens) return too_many();
  return ids;
}

std::optional<size_t> Tokenizer::MaxBytesPerToken() const {
  const Impl& m = *impl_;
  std::optional<size_t> per_word = m.WordBytesPerToken();
  const bool drops_text = std::any_of(m.pre_tokenizers.begin(), m.pre_tokenizers.end(),
                                      [](const PreTokenizer& p) { return p.remove_matches; });
  if (!per_word || m.strips_whitespace || drops_text) return std::nullopt;
  // Normalized text is no shorter than the input, but for NFC composition (three jamo of three
  // bytes each into one syllable of three); a byte-level stand-in is at least one byte a byte.
  return *per_word * (m.nfc ? 3 : 1);
}

namespace {

// A byte-level token's bytes (each character of its string one byte's stand-in); a token outside
// the byte alphabet stays as it is.
std::string ByteLevelBytes(const Tokenizer::Impl& m, const std::string& t) {
  std::string bytes;
  for (const std::string& ch : SplitUtf8Chars(t)) {
    auto it = m.unicode_to_byte.find(ch);
    if (it == m.unicode_to_byte.end()) return t;
    bytes += static_cast<char>(it->second);
  }
  return bytes;
}

}  // namespace

std::string Tokenizer::Decode(const std::vector<int32_t>& ids, bool skip_special_tokens,
                              const std::vector<int32_t>& keep) const {
  const Impl& m = *impl_;
  // As Hugging Face does: every token's string (added tokens' content included) goes through the
  // decoder chain in one list.
  std::vector<std::string> toks;
  for (int32_t id : ids) {
    if (id < 0 || id >= static_cast<int32_t>(m.id_to_token.size()) || m.id_to_token[id].empty()) {
      continue;
    }
    if (skip_special_tokens && m.special[id] &&
        std::find(keep.begin(), keep.end(), id) == keep.end()) {
      continue;
    }
    toks.push_back(m.id_to_token[id]);
  }
  for (const Decoder& d : m.decoders) {
    switch (d.kind) {
      case Decoder::kByteLevel: {
        std::string bytes;
        for (const std::string& t : toks) bytes += ByteLevelBytes(m, t);
        toks.assign(1, Utf8Lossy(bytes));
        break;
      }
      case Decoder::kReplace:
        for (std::string& t : toks) t = ReplaceAll(t, d.a, d.b);
        break;
      case Decoder::kByteFallback: {
        std::vector<std::string> next;
        std::string pending;
        auto emit_pending = [&] {
          if (pending.empty()) return;
          if (ValidUtf8(pending)) {
            next.push_back(pending);
          } else {
            for (size_t k = 0; k < pending.size(); ++k) next.push_back("\xEF\xBF\xBD");
          }
          pending.clear();
        };
        for (const std::string& t : toks) {
          if (std::optional<char> byte = ByteFallbackByte(t)) {
            pending += *byte;
          } else {
            emit_pending();
            next.push_back(t);
          }
        }
        emit_pending();
        toks.swap(next);
        break;
      }
      case Decoder::kFuse: {
        std::string all;
        for (const std::string& t : toks) all += t;
        toks.assign(1, all);
        break;
      }
      case Decoder::kStrip:
        for (std::string& t : toks) {
          for (int k = 0; k < d.start && t.rfind(d.a, 0) == 0; ++k) t.erase(0, d.a.size());
          for (int k = 0; k < d.stop && t.size() >= d.a.size() &&
                          t.compare(t.size() - d.a.size(), d.a.size(), d.a) == 0;
               ++k) {
            t.erase(t.size() - d.a.size());
          }
        }
        break;
      case Decoder::kMetaspace:
        for (size_t k = 0; k < toks.size(); ++k) {
          toks[k] = ReplaceAll(toks[k], d.a, " ");
          if (k == 0 && d.prepend && !toks[k].empty() && toks[k][0] == ' ') toks[k].erase(0, 1);
        }
        break;
    }
  }
  std::string out;
  for (const std::string& t : toks) out += t;
  return out;
}

std::string Tokenizer::TokenBytes(int32_t id) const {
  const Impl& m = *impl_;
  if (id < 0 || id >= static_cast<int32_t>(m.id_to_token.size())) return "";
  std::string t = m.id_to_token[id];
  if (m.special[id]) return t;
  // Decode's chain on the one token, without what applies at a text's start (Strip, Metaspace's
  // dropped first space) or to a whole text (Fuse, the lossy UTF-8 of partial characters).
  for (const Decoder& d : m.decoders) {
    switch (d.kind) {
      case Decoder::kByteLevel:
        t = ByteLevelBytes(m, t);
        break;
      case Decoder::kReplace:
        t = ReplaceAll(t, d.a, d.b);
        break;
      case Decoder::kByteFallback:
        if (std::optional<char> byte = ByteFallbackByte(t)) t = std::string(1, *byte);
        break;
      case Decoder::kMetaspace:
        t = ReplaceAll(t, d.a, " ");
        break;
      case Decoder::kFuse:
      case Decoder::kStrip:
        break;
    }
  }
  return t;
}

std::optional<int32_t> Tokenizer::TokenId(const std::string& token) const {
  auto it = impl_->vocab.find(token);
  if (it == impl_->vocab.end()) return std::nullopt;
  return it->second;
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_to_token.size()); }

bool Tokenizer::IsByteFallbackToken(int32_t id) const {
  const Impl& m = *impl_;
  if (id < 0 || id >= static_cast<int32_t>(m.id_to_token.size())) return false;
  return std::any_of(m.decoders.begin(), m.decoders.end(),
                     [](const Decoder& d) { return d.kind == Decoder::kByteFallback; }) &&
         ByteFallbackByte(m.id_to_token[id]).has_value();
}

bool Tokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && id < static_cast<int32_t>(impl_->special.size()) && impl_->special[id];
}

}  // namespace shardserve
