#include "common/prefetch.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace shardserve {

std::vector<FileRange> Pieces(std::vector<FileRange> ranges, uint64_t piece) {
  std::sort(ranges.begin(), ranges.end(), [](const FileRange& a, const FileRange& b) {
    return std::tie(a.path, a.offset) < std::tie(b.path, b.offset);
  });
  std::vector<FileRange> merged;
  for (FileRange& r : ranges) {
    if (r.length == 0) continue;
    if (!merged.empty() && merged.back().path == r.path &&
        r.offset <= merged.back().offset + merged.back().length) {
      FileRange& m = merged.back();
      m.length = std::max(m.offset + m.length, r.offset + r.length) - m.offset;
    } else {
      merged.push_back(std::move(r));
    }
  }
  std::vector<FileRange> out;
  for (const FileRange& m : merged) {
    for (uint64_t at = 0; at < m.length; at += piece) {
      out.push_back({m.path, m.offset + at, std::min(piece, m.length - at)});
    }
  }
  return out;
}

absl::StatusOr<int64_t> ReadIntoPageCache(const std::vector<FileRange>& pieces, int threads,
                                          int share, int shares) {
  std::vector<const FileRange*> mine;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (static_cast<int>(i % std::max(1, shares)) == share) mine.push_back(&pieces[i]);
  }
  // One descriptor per file, opened before the threads start.
  std::map<std::string, int> fds;
  absl::Status status;
  for (const FileRange* p : mine) {
    if (fds.count(p->path)) continue;
    const int fd = ::open(p->path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      status = absl::NotFoundError(absl::StrCat(p->path, ": ", std::strerror(errno)));
      break;
    }
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    fds[p->path] = fd;
  }
  std::atomic<size_t> next{0};
  std::atomic<int64_t> bytes{0};
  absl::Mutex mu;
  if (status.ok()) {
    std::vector<std::thread> pool;
    for (int t = 0; t < std::max(1, threads); ++t) {
      pool.emplace_back([&] {
        std::vector<char> buf(size_t{16} << 20);
        for (size_t i = next++; i < mine.size(); i = next++) {
          const FileRange& p = *mine[i];
          const int fd = fds.at(p.path);
          for (uint64_t done = 0; done < p.length;) {
            const size_t want =
                static_cast<size_t>(std::min<uint64_t>(buf.size(), p.length - done));
            const ssize_t n = ::pread(fd, buf.data(), want, static_cast<off_t>(p.offset + done));
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) {  // an error, or a file shorter than its header said (a loader names it)
              if (n < 0) {
                absl::MutexLock lock(&mu);
                if (status.ok()) {
                  status = absl::InternalError(absl::StrCat(p.path, ": ", std::strerror(errno)));
                }
              }
              break;
            }
            done += static_cast<uint64_t>(n);
            bytes += n;
          }
        }
      });
    }
    for (std::thread& t : pool) t.join();
  }
  for (const auto& [path, fd] : fds) ::close(fd);
  if (!status.ok()) return status;
  return bytes.load();
}

}  // namespace shardserve
