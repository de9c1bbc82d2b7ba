#pragma once
// A cache of models fetched from where they live (source/model_source.h): one directory per model
// revision, content-addressed (the source's revision or digest, else a digest of what its listing
// says of every file), shared by every process that wants the same revision. Fetching is once per
// cache: a lock file (flock) lets one process download while the others wait, then find it there;
// a model counts as present only once every file is whole and checked (a manifest written last).
// A file is fetched into NAME.part in ranges (several at once for a large file); the ranges done
// are recorded beside it, so a fetch cut short (a killed pod, a lost connection) resumes where it
// stopped. Every file is checked before the model counts as present: its SHA-256 where the
// source gives one, else its git blob id (the Hub's small files), else its MD5 (S3's ETag of a
// single-part upload), else only its size (named as the weaker check); a file that fails is
// deleted and the error names it.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "source/http.h"

namespace shardserve::source {

// One file of a model as its source lists it.
struct RemoteFile {
  std::string path;  // under the model's directory ("config.json", "shards/00001.safetensors")
  int64_t size = 0;
  std::string sha256;    // hex, "" when the source gives none
  std::string md5;       // hex, "" when the source gives none
  std::string git_sha1;  // hex git blob id (SHA-1 of "blob SIZE\0" + bytes), "" when none
  HttpRequest get;       // how to fetch it (url, headers, signing); ranges are added
};

struct FetchOptions {
  int64_t range_bytes = int64_t{64} << 20;  // a file is fetched in ranges of this size
  int parallel = 4;                         // ranges in flight
  int attempts = 3;                         // tries of a range before the fetch fails
};

// What a fetch did, for logs, status and metrics.
struct FetchReport {
  std::string dir;                       // the model's directory
  int64_t bytes_total = 0;               // of its files
  int64_t bytes_fetched = 0;             // moved over the network by this call
  bool cache_hit = false;                // present already: nothing fetched
  std::vector<std::string> weak_checks;  // files checked by size alone
};

// Bytes so far of the fetch in progress, and its total.
using FetchProgress = std::function<void(int64_t done, int64_t total)>;

// The model `key` (a source's revision or digest; see ListingKey) of `files` under `root`:
// present already, or fetched now. `name` says what the model is in errors ("s3://b/llama").
absl::StatusOr<FetchReport> Materialize(const std::string& root, const std::string& name,
                                        const std::string& key,
                                        const std::vector<RemoteFile>& files,
                                        const FetchOptions& options = {},
                                        const FetchProgress& progress = nullptr);

// A content address for a listing without a revision of its own (S3): SHA-256 of every file's
// path, size and checks, in path order.
std::string ListingKey(std::vector<RemoteFile> files);

// Keeps the files whose path matches one of `patterns` (shell patterns, fnmatch; '*' does not
// cross '/'); every file when `patterns` is empty. A pattern that matches nothing is an error
// naming it.
absl::StatusOr<std::vector<RemoteFile>> Choose(const std::vector<RemoteFile>& files,
                                               const std::vector<std::string>& patterns);

// A model present in a cache, for eviction and metrics.
struct CachedModel {
  std::string dir;
  int64_t bytes = 0;
  std::filesystem::file_time_type used;  // its last use (a fetch that found or made it)
};

// Every model present under `root` (a directory holding a manifest), least recently used first.
std::vector<CachedModel> CachedModels(const std::string& root);
// Bytes of every file under `root` (present models, partial fetches).
int64_t CacheBytes(const std::string& root);

// A model's processes hold a shared lock on its .inuse file while they run (HoldInUse: the
// descriptor, kept open for the process's life); eviction passes over a model so held.
absl::StatusOr<int> HoldInUse(const std::string& dir);
bool InUse(const std::string& dir);

struct EvictReport {
  int64_t cache_bytes = 0;           // after eviction
  std::vector<std::string> evicted;  // directories removed
};

// Room for `need` more bytes in the cache `root` of at most `limit` bytes (0: no limit):
// the least recently used models are evicted until they fit, passing over `keep`, every model in
// use, being fetched, or used within `grace` (a pod that found it may not run yet). Too little
// that can go is an error saying how much is held.
absl::StatusOr<EvictReport> MakeRoom(const std::string& root, int64_t need, int64_t limit,
                                     const std::string& keep, std::chrono::seconds grace);

// Hex SHA-256 / MD5 of a file's bytes.
absl::StatusOr<std::string> FileSha256(const std::string& path);
absl::StatusOr<std::string> FileMd5(const std::string& path);
std::string BytesSha256(const std::string& bytes);
// Whether `s` is `n` hex digits (a digest as a source gives it).
bool IsHex(const std::string& s, size_t n);

}  // namespace shardserve::source
