#include "serve/api_keys.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "api/worker_env.h"
#include "common/log.h"
#include "common/status.h"
#include "common/text.h"

namespace shardserve {
namespace {

constexpr size_t kMinKeyLength = 16;
constexpr size_t kMaxKeyLength = 4096;
constexpr size_t kMaxKeys = 1024;
constexpr auto kRereadAfter = std::chrono::seconds(5);

absl::Status CheckKey(absl::string_view key, const std::string& where) {
  if (key.size() < kMinKeyLength || key.size() > kMaxKeyLength) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": an API key must have ", kMinKeyLength,
                                                   " to ", kMaxKeyLength, " characters, not ",
                                                   key.size()));
  }
  for (char c : key) {
    if (static_cast<unsigned char>(c) <= ' ' || c == 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": an API key may not hold whitespace or control characters"));
    }
  }
  return absl::OkStatus();
}

std::array<unsigned char, 32> Sha256(absl::string_view s) {
  std::array<unsigned char, 32> d;
  SHA256(reinterpret_cast<const unsigned char*>(s.data()), s.size(), d.data());
  return d;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ApiKeys>> ApiKeys::Open(const std::string& key,
                                                       const std::string& file) {
  if (key.empty() && file.empty()) return std::unique_ptr<ApiKeys>();
  return Create(key, file);
}

absl::StatusOr<std::unique_ptr<ApiKeys>> ApiKeys::Create(const std::string& key,
                                                         const std::string& file) {
  std::unique_ptr<ApiKeys> keys(new ApiKeys(key, file));
  ASSIGN_OR_RETURN(std::vector<Digest> digests, keys->Read());
  if (digests.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(kApiKeysFileEnv, " ", file, " holds no API key"));
  }
  absl::MutexLock lock(&keys->mu_);
  keys->digests_ = std::move(digests);
  keys->read_at_ = std::chrono::steady_clock::now();
  return keys;
}

absl::StatusOr<std::vector<ApiKeys::Digest>> ApiKeys::Read() const {
  std::vector<Digest> out;
  if (!key_.empty()) {
    RETURN_IF_ERROR(CheckKey(key_, kApiKeyEnv));
    out.push_back(Sha256(key_));
  }
  if (file_.empty()) return out;
  std::vector<std::string> files;
  std::error_code ec;
  if (std::filesystem::is_directory(file_, ec)) {
    // A mounted Secret: one file an entry, beside the kubelet's hidden ..data links.
    for (const auto& e : std::filesystem::directory_iterator(file_, ec)) {
      const std::string name = e.path().filename().string();
      if (!name.empty() && name[0] != '.' && e.is_regular_file(ec)) files.push_back(e.path());
    }
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat(kApiKeysFileEnv, " ", file_, ": ", ec.message()));
    }
  } else {
    files.push_back(file_);
  }
  for (const std::string& f : files) {
    ASSIGN_OR_RETURN(std::string text, ReadFileToString(f));
    int line_no = 0;
    for (absl::string_view line : absl::StrSplit(text, '\n')) {
      ++line_no;
      line = absl::StripAsciiWhitespace(line);
      if (line.empty() || line[0] == '#') continue;
      RETURN_IF_ERROR(CheckKey(line, absl::StrCat(kApiKeysFileEnv, " ", f, ":", line_no)));
      if (out.size() == kMaxKeys) {
        return absl::InvalidArgumentError(
            absl::StrCat(kApiKeysFileEnv, " ", file_, ": more than ", kMaxKeys, " keys"));
      }
      out.push_back(Sha256(line));
    }
  }
  return out;
}

void ApiKeys::RefreshLocked() {
  const auto now = std::chrono::steady_clock::now();
  if (file_.empty() || now - read_at_ < kRereadAfter) return;
  read_at_ = now;
  absl::StatusOr<std::vector<Digest>> fresh = Read();
  if (fresh.ok() && fresh->empty()) fresh = absl::InvalidArgumentError("no key left");
  if (!fresh.ok()) {
    const std::string why(fresh.status().message());
    if (why != last_error_) {
      LogWarning("api keys: keeping the keys in force: ", why);
      last_error_ = why;
    }
    return;
  }
  last_error_.clear();
  digests_ = *std::move(fresh);
}

absl::Status ApiKeys::Check(std::string_view header) {
  const absl::string_view authorization(header.data(), header.size());
  if (authorization.empty()) {
    return absl::UnauthenticatedError("no API key: send one as 'Authorization: Bearer KEY'");
  }
  constexpr absl::string_view kBearer = "bearer ";
  if (authorization.size() <= kBearer.size() ||
      !absl::EqualsIgnoreCase(authorization.substr(0, kBearer.size()), kBearer)) {
    return absl::UnauthenticatedError("the Authorization header must be 'Bearer KEY'");
  }
  const Digest presented = Sha256(absl::StripAsciiWhitespace(authorization.substr(kBearer.size())));
  absl::MutexLock lock(&mu_);
  RefreshLocked();
  int match = 0;
  for (const Digest& d : digests_) {  // every key, whichever matches
    match |= CRYPTO_memcmp(d.data(), presented.data(), d.size()) == 0;
  }
  if (match) return absl::OkStatus();
  return absl::UnauthenticatedError("incorrect API key provided");
}

size_t ApiKeys::size() {
  absl::MutexLock lock(&mu_);
  return digests_.size();
}

}  // namespace shardserve
