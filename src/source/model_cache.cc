#include "source/model_cache.h"

#include <fcntl.h>
#include <fnmatch.h>
#include <openssl/evp.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/status.h"
#include "common/text.h"

namespace shardserve::source {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr char kManifest[] = ".manifest.json";
constexpr char kInUse[] = ".inuse";  // a running model's processes hold a shared flock on it
constexpr size_t kMaxFiles = 10000;

std::string Errno(const std::string& what) {
  return absl::StrCat(what, ": ", std::strerror(errno));
}

// A file descriptor closed on scope exit.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

// The digest so far, in hex.
std::string FinalHex(EVP_MD_CTX* ctx) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx, out, &len);
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) absl::StrAppend(&hex, absl::Hex(out[i], absl::kZeroPad2));
  return hex;
}

// A path a source lists must stay inside the model's directory: relative, no '.' or '..'
// component, no empty component, printable, bounded.
absl::Status CheckPath(const std::string& name, const std::string& path) {
  auto bad = [&](const char* why) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": the source lists a file '", path.substr(0, 200), "' ", why));
  };
  if (path.empty() || path.size() > 1024) return bad("whose path is empty or too long");
  if (path[0] == '/') return bad("with an absolute path");
  for (unsigned char ch : path) {
    if (ch < 0x20 || ch == 0x7f || ch == '\\') return bad("whose path holds a control character");
  }
  for (absl::string_view part : absl::StrSplit(path, '/')) {
    if (part.empty() || part == "." || part == "..") return bad("whose path leaves its directory");
    if (absl::StartsWith(part, ".manifest") || absl::EndsWith(part, ".part") ||
        absl::EndsWith(part, ".part.done") || part == ".lock" || part == kInUse) {
      return bad("whose name the cache keeps for itself");
    }
  }
  return absl::OkStatus();
}

// The digest of `head` and then the file's bytes.
absl::StatusOr<std::string> Digest(const std::string& path, const EVP_MD* md,
                                   const std::string& head = "") {
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (f.fd < 0) return absl::NotFoundError(Errno(path));
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  EVP_DigestInit_ex(ctx.get(), md, nullptr);
  EVP_DigestUpdate(ctx.get(), head.data(), head.size());
  std::vector<char> buf(size_t{1} << 20);
  for (;;) {
    const ssize_t n = ::read(f.fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::InternalError(Errno(path));
    if (n == 0) break;
    EVP_DigestUpdate(ctx.get(), buf.data(), static_cast<size_t>(n));
  }
  return FinalHex(ctx.get());
}

// The whole file checked against what the source says of it.
absl::Status Verify(const std::string& name, const RemoteFile& f, const std::string& part,
                    std::vector<std::string>& weak) {
  std::error_code ec;
  const auto size = static_cast<int64_t>(fs::file_size(part, ec));
  if (ec || size != f.size) {
    return absl::DataLossError(absl::StrCat(name, ": ", f.path, " holds ", ec ? 0 : size,
                                            " bytes where the source lists ", f.size));
  }
  if (!f.sha256.empty()) {
    ASSIGN_OR_RETURN(const std::string got, FileSha256(part));
    if (got != f.sha256) {
      return absl::DataLossError(absl::StrCat(name, ": ", f.path, " has SHA-256 ", got,
                                              " where the source says ", f.sha256,
                                              ": the download is corrupt (deleted)"));
    }
  } else if (!f.git_sha1.empty()) {
    ASSIGN_OR_RETURN(const std::string got,
                     Digest(part, EVP_sha1(), absl::StrCat("blob ", f.size, std::string(1, '\0'))));
    if (got != f.git_sha1) {
      return absl::DataLossError(absl::StrCat(name, ": ", f.path, " has git blob id ", got,
                                              " where the source says ", f.git_sha1,
                                              ": the download is corrupt (deleted)"));
    }
  } else if (!f.md5.empty()) {
    ASSIGN_OR_RETURN(const std::string got, FileMd5(part));
    if (got != f.md5) {
      return absl::DataLossError(absl::StrCat(name, ": ", f.path, " has MD5 ", got,
                                              " where the source's ETag says ", f.md5,
                                              ": the download is corrupt (deleted)"));
    }
  } else {
    weak.push_back(f.path);
  }
  return absl::OkStatus();
}

// The ranges of NAME.part already fetched (NAME.part.done: one range index a line).
std::set<int64_t> DoneRanges(const std::string& done_path) {
  std::set<int64_t> done;
  std::ifstream in(done_path);
  int64_t i;
  while (in >> i) done.insert(i);
  return done;
}

class FileFetch {
 public:
  FileFetch(const std::string& name, const RemoteFile& f, const std::string& dest,
            const FetchOptions& o, std::atomic<int64_t>& fetched, const std::function<void()>& tick)
      : name_(name), f_(f), dest_(dest), o_(o), fetched_(fetched), tick_(tick) {}

  absl::Status Run(std::vector<std::string>& weak) {
    std::error_code ec;
    fs::create_directories(fs::path(dest_).parent_path(), ec);
    const std::string part = dest_ + ".part", done_path = dest_ + ".part.done";
    // Ranges recorded as done count only with the .part that holds them.
    if (!fs::exists(part, ec)) fs::remove(done_path, ec);
    Fd fd(::open(part.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644));
    if (fd.fd < 0) return absl::InternalError(Errno(part));
    if (::ftruncate(fd.fd, f_.size) != 0) return absl::InternalError(Errno(part));
    const int64_t R = std::max<int64_t>(1, o_.range_bytes);
    const int64_t ranges = (f_.size + R - 1) / R;
    std::set<int64_t> done = DoneRanges(done_path);
    std::vector<int64_t> todo;
    for (int64_t i = 0; i < ranges; ++i) {
      if (!done.count(i)) todo.push_back(i);
    }
    {
      absl::MutexLock lock(&mu_);
      done_out_.open(done_path, std::ios::app);
    }
    absl::Status failed;
    std::atomic<size_t> next{0};
    auto worker = [&] {
      for (size_t k = next++; k < todo.size(); k = next++) {
        {
          absl::MutexLock lock(&mu_);
          if (!failed_.ok()) return;
        }
        absl::Status s = Range(fd.fd, todo[k], R);
        absl::MutexLock lock(&mu_);
        if (!s.ok()) {
          if (failed_.ok()) failed_ = s;
          return;
        }
        done_out_ << todo[k] << "\n" << std::flush;
        tick_();
      }
    };
    const int threads = static_cast<int>(
        std::min<size_t>(todo.size(), static_cast<size_t>(std::max(1, o_.parallel))));
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
    worker();
    for (std::thread& t : pool) t.join();
    {
      absl::MutexLock lock(&mu_);
      done_out_.close();
      failed = failed_;
    }
    if (!failed.ok()) return failed;  // the ranges done stay: the next fetch resumes
    if (::fsync(fd.fd) != 0) return absl::InternalError(Errno(part));
    absl::Status checked = Verify(name_, f_, part, weak);
    if (!checked.ok()) {
      fs::remove(part, ec);
      fs::remove(done_path, ec);
      return checked;
    }
    if (::rename(part.c_str(), dest_.c_str()) != 0) return absl::InternalError(Errno(dest_));
    fs::remove(done_path, ec);
    return absl::OkStatus();
  }

 private:
  absl::Status Range(int fd, int64_t index, int64_t R) {
    const int64_t begin = index * R, end = std::min(f_.size, begin + R);  // [begin, end)
    absl::Status last;
    for (int attempt = 0; attempt < std::max(1, o_.attempts); ++attempt) {
      if (attempt > 0) std::this_thread::sleep_for(std::chrono::seconds(1 << (attempt - 1)));
      HttpRequest r = f_.get;
      r.range_begin = begin;
      r.range_end = end - 1;
      // Counted as they arrive: the progress of a large range shows while it comes.
      absl::StatusOr<HttpResponse> resp = FetchToFile(r, fd, begin, end - begin, &fetched_);
      if (!resp.ok()) {
        last = absl::Status(resp.status().code(),
                            absl::StrCat(name_, ": ", f_.path, ": ", resp.status().message()));
        continue;
      }
      last = HttpError(*resp, absl::StrCat(name_, ": ", f_.path));
      if (!last.ok()) {
        if (last.code() == absl::StatusCode::kUnavailable) continue;
        return last;  // 401, 403, 404: another try would say the same
      }
      // A server that ignores the range answers 200 with the whole file: only right when the
      // range is the whole file.
      if (resp->status == 200 && !(begin == 0 && end == f_.size)) {
        return absl::FailedPreconditionError(absl::StrCat(
            name_, ": ", f_.path, ": the server ignores byte ranges (HTTP 200 to a range)"));
      }
      if (resp->written != end - begin) {
        last = absl::DataLossError(absl::StrCat(name_, ": ", f_.path, ": bytes ", begin, "-",
                                                end - 1, " came short (", resp->written, " of ",
                                                end - begin, ")"));
        continue;
      }
      return absl::OkStatus();
    }
    return last;
  }

  const std::string& name_;
  const RemoteFile& f_;
  const std::string dest_;
  const FetchOptions& o_;
  std::atomic<int64_t>& fetched_;
  const std::function<void()>& tick_;
  absl::Mutex mu_;
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  std::ofstream done_out_ ABSL_GUARDED_BY(mu_);
};

// What the manifest says of `files`, in path order.
json ManifestFiles(std::vector<RemoteFile> files) {
  std::sort(files.begin(), files.end(),
            [](const RemoteFile& a, const RemoteFile& b) { return a.path < b.path; });
  json out = json::array();
  for (const RemoteFile& f : files) {
    out.push_back({{"path", f.path},
                   {"size", f.size},
                   {"sha256", f.sha256},
                   {"md5", f.md5},
                   {"git_sha1", f.git_sha1}});
  }
  return out;
}

// Whether the manifest of `dir` lists exactly `files` (their paths, sizes and checks) and each is
// there at its size.
bool Present(const std::string& dir, const std::vector<RemoteFile>& files) {
  auto text = ReadFileToString(dir + "/" + kManifest);
  if (!text.ok()) return false;
  const json m = json::parse(*text, nullptr, false);
  if (!m.is_object() || !m.contains("files") || m["files"] != ManifestFiles(files)) return false;
  for (const RemoteFile& f : files) {
    std::error_code ec;
    if (static_cast<int64_t>(fs::file_size(dir + "/" + f.path, ec)) != f.size || ec) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::string> FileSha256(const std::string& path) {
  return Digest(path, EVP_sha256());
}
absl::StatusOr<std::string> FileMd5(const std::string& path) { return Digest(path, EVP_md5()); }

std::string BytesSha256(const std::string& bytes) {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr);
  EVP_DigestUpdate(ctx.get(), bytes.data(), bytes.size());
  return FinalHex(ctx.get());
}

bool IsHex(const std::string& s, size_t n) {
  return s.size() == n && std::all_of(s.begin(), s.end(), [](char ch) {
           return absl::ascii_isxdigit(static_cast<unsigned char>(ch));
         });
}

std::string ListingKey(std::vector<RemoteFile> files) {
  std::sort(files.begin(), files.end(),
            [](const RemoteFile& a, const RemoteFile& b) { return a.path < b.path; });
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr);
  for (const RemoteFile& f : files) {
    const std::string line =
        absl::StrCat(f.path, "\t", f.size, "\t", f.sha256, "\t", f.md5, "\t", f.git_sha1, "\n");
    EVP_DigestUpdate(ctx.get(), line.data(), line.size());
  }
  return FinalHex(ctx.get());
}

absl::StatusOr<std::vector<RemoteFile>> Choose(const std::vector<RemoteFile>& files,
                                               const std::vector<std::string>& patterns) {
  if (patterns.empty()) return files;
  std::vector<RemoteFile> out;
  std::vector<bool> used(patterns.size(), false);
  for (const RemoteFile& f : files) {
    bool keep = false;
    for (size_t i = 0; i < patterns.size(); ++i) {
      if (::fnmatch(patterns[i].c_str(), f.path.c_str(), FNM_PATHNAME) == 0) {
        keep = used[i] = true;
      }
    }
    if (keep) out.push_back(f);
  }
  for (size_t i = 0; i < patterns.size(); ++i) {
    if (!used[i]) {
      return absl::NotFoundError(absl::StrCat("spec.model.files: '", patterns[i],
                                              "' matches none of the model's ", files.size(),
                                              " files"));
    }
  }
  return out;
}

absl::StatusOr<FetchReport> Materialize(const std::string& root, const std::string& name,
                                        const std::string& key,
                                        const std::vector<RemoteFile>& files,
                                        const FetchOptions& options,
                                        const FetchProgress& progress) {
  if (files.empty()) return absl::NotFoundError(absl::StrCat(name, ": the source lists no files"));
  if (files.size() > kMaxFiles) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": the source lists ", files.size(),
                                                   " files (at most ", kMaxFiles,
                                                   "); spec.model.files chooses which to fetch"));
  }
  if (key.empty() || key.find('/') != std::string::npos || key[0] == '.') {
    return absl::InvalidArgumentError(absl::StrCat(name, ": no revision to address it by"));
  }
  FetchReport report;
  std::set<std::string> seen;
  for (const RemoteFile& f : files) {
    RETURN_IF_ERROR(CheckPath(name, f.path));
    if (f.size < 0) return absl::InvalidArgumentError(absl::StrCat(name, ": ", f.path, ": size"));
    if (!seen.insert(f.path).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": the source lists ", f.path, " twice"));
    }
    report.bytes_total += f.size;
  }
  report.dir = (fs::path(root) / key).string();
  std::error_code ec;
  fs::create_directories(report.dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(report.dir, ": ", ec.message()));
  { Fd in_use(::open((report.dir + "/" + kInUse).c_str(), O_RDONLY | O_CREAT | O_CLOEXEC, 0644)); }
  // One process fetches; the others wait here and then find the model present.
  Fd lock(::open((report.dir + "/.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  if (lock.fd < 0) return absl::InternalError(Errno(report.dir + "/.lock"));
  while (::flock(lock.fd, LOCK_EX) != 0) {
    if (errno != EINTR) return absl::InternalError(Errno(report.dir + "/.lock"));
  }
  if (Present(report.dir, files)) {
    report.cache_hit = true;
    // Recently used: the cache's eviction reads the manifest's time.
    fs::last_write_time(report.dir + "/" + kManifest, fs::file_time_type::clock::now(), ec);
    return report;
  }
  fs::remove(report.dir + "/" + kManifest, ec);
  std::atomic<int64_t> fetched{0};  // bytes moved, failed tries included
  std::atomic<int64_t> whole{0};    // bytes of the files already whole
  // The caller is told one call at a time: when a range is done, and twice a second between
  // (a range is 64 MiB; a slow link takes a while for one).
  absl::Mutex telling;
  const std::function<void()> tick = [&] {
    if (!progress) return;
    absl::MutexLock lock(&telling);
    progress(std::min(report.bytes_total, whole.load() + fetched.load()), report.bytes_total);
  };
  absl::Notification over;
  std::thread ticker;
  if (progress) {
    ticker = std::thread([&] {
      while (!over.WaitForNotificationWithTimeout(absl::Milliseconds(500))) tick();
    });
  }
  absl::Cleanup stop_ticker = [&] {
    over.Notify();
    if (ticker.joinable()) ticker.join();
  };
  for (const RemoteFile& f : files) {
    const std::string dest = report.dir + "/" + f.path;
    // A file without its .part was renamed into place only after its check.
    if (static_cast<int64_t>(fs::file_size(dest, ec)) == f.size && !ec &&
        !fs::exists(dest + ".part", ec)) {
      whole += f.size;
      continue;
    }
    FileFetch fetch(name, f, dest, options, fetched, tick);
    absl::Status s = fetch.Run(report.weak_checks);
    report.bytes_fetched = fetched.load();
    if (!s.ok()) return s;
  }
  report.bytes_fetched = fetched.load();
  std::move(stop_ticker).Invoke();
  const json manifest = {{"name", name}, {"key", key}, {"files", ManifestFiles(files)}};
  const std::string tmp = report.dir + "/" + kManifest + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << manifest.dump(1);
    if (!out) return absl::InternalError(absl::StrCat(tmp, ": cannot write"));
  }
  if (::rename(tmp.c_str(), (report.dir + "/" + kManifest).c_str()) != 0) {
    return absl::InternalError(Errno(report.dir + "/" + kManifest));
  }
  if (progress) progress(report.bytes_total, report.bytes_total);
  return report;
}

namespace {

// Bytes of the files under `dir` (as listed: a sparse .part counts whole).
int64_t BytesUnder(const std::string& dir) {
  int64_t bytes = 0;
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->is_regular_file(ec)) bytes += static_cast<int64_t>(it->file_size(ec));
  }
  return bytes;
}

}  // namespace

std::vector<CachedModel> CachedModels(const std::string& root) {
  std::vector<CachedModel> out;
  std::error_code ec;
  for (fs::recursive_directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    if (!it->is_directory(ec) || it->is_symlink(ec)) {
      continue;
    }
    const std::string manifest = it->path().string() + "/" + kManifest;
    if (!fs::exists(manifest, ec)) {
      if (it.depth() > 20) it.disable_recursion_pending();
      continue;
    }
    CachedModel m;
    m.dir = it->path().string();
    m.bytes = BytesUnder(m.dir);
    m.used = fs::last_write_time(manifest, ec);
    out.push_back(std::move(m));
    it.disable_recursion_pending();  // a model's own directories hold files, not models
  }
  std::sort(out.begin(), out.end(),
            [](const CachedModel& a, const CachedModel& b) { return a.used < b.used; });
  return out;
}

int64_t CacheBytes(const std::string& root) { return BytesUnder(root); }

bool InUse(const std::string& dir) {
  Fd f(::open((dir + "/" + kInUse).c_str(), O_RDONLY | O_CLOEXEC));
  if (f.fd < 0) return false;
  return ::flock(f.fd, LOCK_EX | LOCK_NB) != 0;
}

absl::StatusOr<int> HoldInUse(const std::string& dir) {
  const int fd = ::open((dir + "/" + kInUse).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(Errno(dir + "/" + kInUse));
  while (::flock(fd, LOCK_SH) != 0) {
    if (errno != EINTR) {
      const absl::Status s = absl::InternalError(Errno(dir + "/" + kInUse));
      ::close(fd);
      return s;
    }
  }
  return fd;
}

absl::StatusOr<EvictReport> MakeRoom(const std::string& root, int64_t need, int64_t limit,
                                     const std::string& keep, std::chrono::seconds grace) {
  EvictReport report;
  std::error_code ec;
  fs::create_directories(root, ec);
  // One eviction at a time in a cache (each fetch of a node asks before it downloads).
  Fd lock(::open((root + "/.evict.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  if (lock.fd < 0) return absl::InternalError(Errno(root + "/.evict.lock"));
  while (::flock(lock.fd, LOCK_EX) != 0) {
    if (errno != EINTR) return absl::InternalError(Errno(root + "/.evict.lock"));
  }
  report.cache_bytes = CacheBytes(root);
  if (limit <= 0 || report.cache_bytes + need <= limit) return report;
  const auto now = fs::file_time_type::clock::now();
  int64_t busy = 0;
  for (const CachedModel& m : CachedModels(root)) {
    if (report.cache_bytes + need <= limit) break;
    if (fs::path(m.dir) == fs::path(keep)) continue;
    // In use: a running model's processes hold its .inuse; used within `grace`: a pod whose
    // fetch found it may not have started its ranks yet; fetching: its .lock is held.
    Fd fetch_lock(::open((m.dir + "/.lock").c_str(), O_RDONLY | O_CLOEXEC));
    if (InUse(m.dir) || now - m.used < grace ||
        (fetch_lock.fd >= 0 && ::flock(fetch_lock.fd, LOCK_EX | LOCK_NB) != 0)) {
      busy += m.bytes;
      continue;
    }
    // Out of its place first (a reader that looks now finds it absent, never half there).
    const std::string doomed =
        absl::StrCat(root, "/.evicting-", ::getpid(), "-", report.evicted.size());
    if (::rename(m.dir.c_str(), doomed.c_str()) != 0) continue;
    fs::remove_all(doomed, ec);
    report.cache_bytes -= m.bytes;
    report.evicted.push_back(m.dir);
  }
  if (report.cache_bytes + need > limit) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the model cache ", root, " (limit ", HumanBytes(limit), ") holds ",
                     HumanBytes(report.cache_bytes), ", ", HumanBytes(busy),
                     " of it models in use or just used; ", HumanBytes(need), " more do not fit"));
  }
  return report;
}

}  // namespace shardserve::source
