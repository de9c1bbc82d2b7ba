#include "cli/fetch.h"

#include <sys/stat.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "api/sharded_model.h"
#include "api/worker_env.h"
#include "common/args.h"
#include "common/status.h"
#include "common/text.h"
#include "http/server.h"
#include "source/model_source.h"

namespace shardserve {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// What the fetch is doing, for /startupz: its own download, or the node's one it waits for
// (read from the progress file the downloading process writes beside the model's directory).
class Progress {
 public:
  Progress(std::string uri, std::string file) : uri_(std::move(uri)), file_(std::move(file)) {}

  void Set(const std::string& state) {
    absl::MutexLock lock(&mu_);
    state_ = state;
  }
  // Called by the download (source::FetchProgress).
  void Bytes(int64_t done, int64_t total) {
    const absl::Time now = absl::Now();
    absl::MutexLock lock(&mu_);
    if (start_ == absl::InfinitePast()) start_ = now;
    downloading_ = true;
    done_ = done;
    total_ = total;
    if (now - written_ > absl::Seconds(1) || done == total) {
      written_ = now;
      const json j = Numbers();
      const std::string tmp = file_ + ".tmp";
      std::ofstream(tmp, std::ios::trunc) << j.dump();
      std::rename(tmp.c_str(), file_.c_str());
    }
  }
  json Answer() const {
    absl::MutexLock lock(&mu_);
    json d = downloading_ ? Numbers() : Theirs();
    std::string state = state_;
    if (d.is_object() && d.value("total", int64_t{0}) > 0) {
      const int64_t bytes = d["bytes"], total = d["total"];
      const double rate = d["rate"];
      state = absl::StrCat(
          downloading_ ? "downloading " : "waiting for this node's download of ", uri_, ": ",
          HumanBytes(bytes), " of ", HumanBytes(total),
          rate > 0 ? absl::StrCat(" at ", HumanBytes(static_cast<int64_t>(rate)), "/s, ",
                                  static_cast<int64_t>((total - bytes) / rate), " s left")
                   : std::string());
    }
    json out = {{"state", state}};
    if (d.is_object()) out["download"] = d;
    return out;
  }

 private:
  json Numbers() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const double s = absl::ToDoubleSeconds(absl::Now() - start_);
    const double rate = s > 0.2 ? done_ / s : 0.0;
    return {{"bytes", done_},
            {"total", total_},
            {"rate", rate},
            {"eta", rate > 0 ? (total_ - done_) / rate : -1.0}};
  }
  json Theirs() const {
    absl::StatusOr<std::string> text = ReadFileToString(file_);
    if (!text.ok()) return nullptr;
    const json j = json::parse(*text, nullptr, false);
    const auto number = [&j](const char* key) { return j.contains(key) && j[key].is_number(); };
    return j.is_object() && number("bytes") && number("total") && number("rate") && number("eta")
               ? j
               : json(nullptr);
  }

  const std::string uri_, file_;
  mutable absl::Mutex mu_;
  std::string state_ ABSL_GUARDED_BY(mu_) = "starting";
  bool downloading_ ABSL_GUARDED_BY(mu_) = false;
  int64_t done_ ABSL_GUARDED_BY(mu_) = 0, total_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time start_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time written_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace

absl::Status RunFetch(const std::vector<std::string>& argv) {
  ASSIGN_OR_RETURN(Args a,
                   Args::Parse(argv,
                               {"uri", "files", "revision", "cache", "cache-limit", "credentials",
                                "progress-port", "report", "used-grace-seconds", "link"},
                               {"small"}, "shardserve fetch", kFetchUsage));
  ASSIGN_OR_RETURN(const std::string uri_text, a.Require("uri"));
  ASSIGN_OR_RETURN(const ModelUri uri, ParseModelUri(uri_text));
  if (!uri.remote()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--uri '", uri_text, "' is not a remote model (hf://, s3://, oci://)"));
  }
  ASSIGN_OR_RETURN(const int64_t limit, a.GetInt("cache-limit", 0));
  ASSIGN_OR_RETURN(const int64_t port, a.GetInt("progress-port", -1));
  // A model just found in the cache stays out of eviction this long: its pod's ranks start next.
  ASSIGN_OR_RETURN(const int64_t grace, a.GetInt("used-grace-seconds", 600));
  const source::Env getenv = source::SecretEnv(a.GetOr("credentials", ""), ProcessEnv);
  const std::string cache = a.GetOr("cache", source::DefaultCacheRoot(getenv));
  std::vector<std::string> patterns;
  if (auto f = a.Get("files")) patterns = absl::StrSplit(*f, ',', absl::SkipWhitespace());
  const absl::Time start = absl::Now();
  ::umask(022);  // the files are read by the ranks' user, whoever fetches them

  ASSIGN_OR_RETURN(source::ModelListing listing,
                   source::ListModel(uri, uri_text, patterns, getenv, a.GetOr("revision", "")));
  if (a.Has("small")) {  // what a router reads: not the weights, in a directory of their own
    listing.files = source::SmallFiles(listing.files);
    listing.key += "-small";
  }
  const std::string dir = absl::StrCat(cache, "/", listing.dir());
  std::error_code ec;
  fs::create_directories(fs::path(dir).parent_path(), ec);
  Progress progress(uri_text, absl::StrCat(dir, ".progress.json"));
  std::unique_ptr<http::Server> server;
  if (port >= 0) {
    http::Routes routes;
    routes.Get("/startupz", [&progress](const http::Request&) {
      return http::Response{200, "application/json", progress.Answer().dump(), {}};
    });
    http::ServerOptions o;
    o.port = static_cast<int>(port);
    o.max_body_bytes = 0;
    o.max_blocking = 0;
    ASSIGN_OR_RETURN(server, http::Server::Start(o, std::move(routes)));
  }
  int64_t total = 0;
  for (const source::RemoteFile& f : listing.files) total += f.size;
  progress.Set(absl::StrCat("making room in the node's model cache for ", uri_text));
  ASSIGN_OR_RETURN(const source::EvictReport room,
                   source::MakeRoom(cache, std::max<int64_t>(0, total - source::CacheBytes(dir)),
                                    limit, dir, std::chrono::seconds(grace)));
  for (const std::string& gone : room.evicted) {
    std::fprintf(stderr,
                 "shardserve fetch: evicted %s (least recently used, no process holds it)\n",
                 gone.c_str());
  }
  progress.Set(
      absl::StrCat("fetching ", uri_text, " (", HumanBytes(total), ") into the node's cache"));
  source::FetchOptions options;
  absl::StatusOr<source::FetchReport> r = source::Materialize(
      absl::StrCat(cache, "/", listing.root), uri_text, listing.key, listing.files, options,
      [&progress](int64_t done, int64_t all) { progress.Bytes(done, all); });
  fs::remove(absl::StrCat(dir, ".progress.json"), ec);
  if (!r.ok()) return r.status();
  const json report = {{"uri", uri_text},
                       {"revision", listing.revision},
                       {"dir", listing.dir()},
                       {"bytes_total", r->bytes_total},
                       {"bytes_fetched", r->bytes_fetched},
                       {"cache_hit", r->cache_hit},
                       {"cache_bytes", source::CacheBytes(cache)},
                       {"evicted", room.evicted},
                       {"weak_checks", r->weak_checks},
                       {"seconds", absl::ToDoubleSeconds(absl::Now() - start)}};
  if (auto link = a.Get("link")) {  // a path that does not depend on the revision
    fs::remove(*link, ec);
    fs::create_symlink(r->dir, *link, ec);
    if (ec) return absl::InternalError(absl::StrCat("--link ", *link, ": ", ec.message()));
  }
  if (auto file = a.Get("report")) {
    std::ofstream out(*file, std::ios::trunc);
    out << report.dump() << "\n";
    if (!out) return absl::InternalError(absl::StrCat("--report ", *file, ": cannot write"));
  }
  std::printf("%s\n", report.dump().c_str());
  return absl::OkStatus();
}

}  // namespace shardserve
