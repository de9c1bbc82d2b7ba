#include "common/text.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace shardserve {

size_t Utf8CharLen(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead >> 5) == 0x6) return 2;
  if ((lead >> 4) == 0xe) return 3;
  if ((lead >> 3) == 0x1e) return 4;
  return 1;
}

std::vector<std::string> SplitUtf8Chars(std::string_view s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    const size_t n = std::min(Utf8CharLen(static_cast<unsigned char>(s[i])), s.size() - i);
    out.emplace_back(s.substr(i, n));
    i += n;
  }
  return out;
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace shardserve
