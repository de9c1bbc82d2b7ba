#pragma once
// Bearer API keys of the leader's API (DESIGN.md §4, trust). Keys come from
//   SHARDSERVE_API_KEY        one key, or
//   SHARDSERVE_API_KEYS_FILE  a file of keys, one a line ('#' starts a comment), or a directory
//                             of such files: a mounted Kubernetes Secret, one key an entry;
// both may be given. A key has at least 16 characters and no whitespace. The file is read again
// when it is older than a few seconds, so a rotated Secret takes effect without a restart (a
// read that fails keeps the keys in force and says why once).
//
// A request proves a key with `Authorization: Bearer KEY`. The presented key is compared with
// every known one through their SHA-256 digests with CRYPTO_memcmp: the time taken does not
// depend on which key, or which byte of it, differs. Thread-safe.
#include <array>
#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace shardserve {

class ApiKeys {
 public:
  // From a key (may be empty) and a keys file or directory (may be empty), as the server's
  // config carries them (ServeConfigFrom); null when both are empty (the API is open).
  // InvalidArgument names the variable, the file and the line.
  static absl::StatusOr<std::unique_ptr<ApiKeys>> Open(const std::string& key,
                                                       const std::string& file);
  // The same, but at least one must be given.
  static absl::StatusOr<std::unique_ptr<ApiKeys>> Create(const std::string& key,
                                                         const std::string& file);

  // OK when `authorization` (the header's value) carries a known key; otherwise Unauthenticated
  // saying what is wrong, never which keys exist.
  absl::Status Check(std::string_view authorization);

  size_t size();

 private:
  using Digest = std::array<unsigned char, 32>;
  ApiKeys(std::string key, std::string file) : key_(std::move(key)), file_(std::move(file)) {}
  // The keys of key_ and file_ now.
  absl::StatusOr<std::vector<Digest>> Read() const;
  void RefreshLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string key_;
  const std::string file_;
  absl::Mutex mu_;
  std::vector<Digest> digests_ ABSL_GUARDED_BY(mu_);
  std::chrono::steady_clock::time_point read_at_ ABSL_GUARDED_BY(mu_);
  std::string last_error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardserve
