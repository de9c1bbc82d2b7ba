#include "bench/disk_bench.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/args.h"
#include "common/prefetch.h"
#include "common/process.h"
#include "common/status.h"
#include "model/transformer.h"

namespace shardserve {
namespace {

namespace fs = std::filesystem;

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Empties the page cache (root only): false when it cannot.
bool DropPageCache() {
  ::sync();
  std::ofstream f("/proc/sys/vm/drop_caches");
  f << "3\n";
  f.flush();
  return static_cast<bool>(f);
}

}  // namespace

absl::Status RunDiskBench(const std::vector<std::string>& argv) {
  ASSIGN_OR_RETURN(Args a, Args::Parse(argv, {"model", "threads", "repeat"}, {"load"},
                                       "shardserve bench disk", kDiskBenchUsage));
  ASSIGN_OR_RETURN(const int64_t repeat, a.GetInt("repeat", 3));
  if (repeat < 1 || repeat > 100) return absl::InvalidArgumentError("--repeat is 1 to 100");
  ASSIGN_OR_RETURN(const std::string model, a.Require("model"));
  std::vector<int> threads;
  for (absl::string_view v : absl::StrSplit(a.GetOr("threads", "1,4,8"), ',')) {
    int n;
    if (!absl::SimpleAtoi(v, &n) || n < 1 || n > 256) {
      return absl::InvalidArgumentError("--threads lists thread counts from 1 to 256");
    }
    threads.push_back(n);
  }
  std::vector<std::string> files;
  std::vector<FileRange> whole;
  int64_t bytes = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(model, ec)) {
    const std::string p = e.path().string();
    if (!absl::EndsWith(p, ".safetensors") && !absl::EndsWith(p, ".gguf")) continue;
    files.push_back(p);
    const uint64_t size = e.file_size(ec);
    whole.push_back({p, 0, size});
    bytes += static_cast<int64_t>(size);
  }
  if (ec || files.empty()) {
    return absl::NotFoundError(absl::StrCat(model, ": no .safetensors or .gguf files"));
  }
  std::sort(files.begin(), files.end());
  const bool dropped = DropPageCache();
  std::printf("model %s: %zu weight files, %.2f GB; page cache %s\n", model.c_str(), files.size(),
              bytes / 1e9,
              dropped ? "dropped before each run"
                      : "NOT dropped (not root): the figures below are from memory");
  // Rounds of dd (the disk's sequential read) and the loader's reads at each thread count, each
  // from a dropped page cache; a virtual disk's speed wanders, so each figure is the median.
  const std::vector<FileRange> pieces = Pieces(whole, uint64_t{16} << 20);
  std::vector<double> dd;
  std::vector<std::vector<double>> loader(threads.size());
  for (int64_t r = 0; r < repeat; ++r) {
    DropPageCache();
    const auto t0 = std::chrono::steady_clock::now();
    for (const std::string& f : files) {
      const std::string cmd = absl::StrCat("dd if='", f, "' of=/dev/null bs=16M status=none");
      if (std::system(cmd.c_str()) != 0) {
        return absl::InternalError(absl::StrCat("dd failed on ", f));
      }
    }
    dd.push_back(bytes / 1e9 / Since(t0));
    for (size_t i = 0; i < threads.size(); ++i) {
      DropPageCache();
      const auto t1 = std::chrono::steady_clock::now();
      ASSIGN_OR_RETURN(const int64_t read, ReadIntoPageCache(pieces, threads[i]));
      loader[i].push_back(read / 1e9 / Since(t1));
    }
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double dd_gbs = median(dd);
  std::printf("%-34s %8.2f GB/s  (median of %lld)\n", "dd bs=16M (sequential)", dd_gbs,
              static_cast<long long>(repeat));
  for (size_t i = 0; i < threads.size(); ++i) {
    const double gbs = median(loader[i]);
    std::printf("%-34s %8.2f GB/s  %5.0f %% of dd\n",
                absl::StrCat("loader reads, ", threads[i], " thread(s)").c_str(), gbs,
                100 * gbs / dd_gbs);
  }
  if (a.Has("load")) {
    for (int n : {0, threads.back()}) {
      DropPageCache();
      Transformer::Options o;
      o.num_threads = 2;
      o.read_threads = n;
      const auto t2 = std::chrono::steady_clock::now();
      ASSIGN_OR_RETURN(std::unique_ptr<Transformer> t, Transformer::Load(model, o));
      const double s = Since(t2);
      std::printf("%-34s %8.2f s (%.2f GB/s of files)\n",
                  n == 0 ? "stage load, no reading first"
                         : absl::StrCat("stage load, ", n, " reading threads").c_str(),
                  s, bytes / 1e9 / s);
    }
  }
  return absl::OkStatus();
}

}  // namespace shardserve
