#pragma once
// Small text and file helpers shared by the model code.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve {

// Bytes of the UTF-8 sequence that starts with `lead` (1 for an invalid lead byte).
size_t Utf8CharLen(unsigned char lead);
// Whether s is well-formed UTF-8 (RFC 3629: no overlong forms, no surrogates, nothing past
// U+10FFFF), as a JSON writer requires.
bool IsValidUtf8(std::string_view s);
// The UTF-8 characters of s (a truncated last sequence stays one piece).
std::vector<std::string> SplitUtf8Chars(std::string_view s);
// The whole file, or NotFound "PATH: cannot open".
absl::StatusOr<std::string> ReadFileToString(const std::string& path);
// A size for people: "557 B", "1.47 MB", "2.30 GB" (decimal units, as disks and downloads say).
std::string HumanBytes(int64_t bytes);
// Whether JSON text nests arrays and objects deeper than `limit` (a scan, before any parser
// recurses into it; strings are skipped).
bool JsonNestsDeeperThan(std::string_view text, int limit);

// The length of the longest suffix of `text` that is a proper prefix of `marker`: what a stream
// parser holds back, as it may be the marker's beginning.
size_t PartialMarker(std::string_view text, std::string_view marker);

}  // namespace shardserve
