#include "bench/comm_bench.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/shm_comm.h"
#include "common/args.h"
#include "common/status.h"

namespace shardserve {
namespace {

using Clock = std::chrono::steady_clock;

double MemcpyBandwidth() {
  const size_t n = 64 << 20;
  std::unique_ptr<char[]> a(new char[n]), b(new char[n]);
  std::memset(a.get(), 1, n);
  std::memset(b.get(), 2, n);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = Clock::now();
    std::memcpy(b.get(), a.get(), n);
    best = std::max(best, n / std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

// One member's loop; member 0 prints. Sizes in bytes.
absl::Status Member(const std::string& name, int n, int rank, const std::vector<size_t>& sizes,
                    double memcpy_bw) {
  ShmOptions o;
  o.name = name;
  o.size = n;
  o.rank = rank;
  o.capacity_bytes = 16 << 20;
  ASSIGN_OR_RETURN(auto comm, ShmCommunicator::Create(o));
  std::vector<float> buf(sizes.back() / sizeof(float), 1.0f);
  if (rank == 0) {
    std::printf("shared-memory all-reduce, %d processes; memcpy %.2f GB/s (1 thread, same run)\n",
                n, memcpy_bw / 1e9);
    std::printf("%10s %8s %12s %12s %10s %14s\n", "bytes", "iters", "time_us", "algbw_GB/s",
                "busbw_GB/s", "busbw/memcpy");
  }
  for (size_t bytes : sizes) {
    const size_t count = bytes / sizeof(float);
    const int iters = static_cast<int>(std::clamp<size_t>((256u << 20) / bytes, 5, 2000));
    RETURN_IF_ERROR(comm->AllReduceSum(buf.data(), count));  // warm-up
    RETURN_IF_ERROR(comm->Barrier());
    std::vector<double> times;
    for (int i = 0; i < iters; ++i) {
      const auto t0 = Clock::now();
      RETURN_IF_ERROR(comm->AllReduceSum(buf.data(), count));
      times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    std::sort(times.begin(), times.end());
    const double t = times[times.size() / 2];  // median
    const double algbw = bytes / t, busbw = algbw * 2.0 * (n - 1) / n;
    if (rank == 0) {
      std::printf("%10zu %8d %12.1f %12.2f %10.2f %13.0f%%\n", bytes, iters, t * 1e6, algbw / 1e9,
                  busbw / 1e9, 100 * busbw / memcpy_bw);
    }
  }
  return comm->Barrier();
}

}  // namespace

absl::Status RunAllReduceBench(const std::vector<std::string>& argv) {
  ASSIGN_OR_RETURN(Args a, Args::Parse(argv, {"processes"}, {}, "shardserve bench allreduce",
                                       kAllReduceBenchUsage));
  ASSIGN_OR_RETURN(int64_t n, a.GetInt("processes", 2));
  if (n < 2) return absl::InvalidArgumentError("--processes must be at least 2");
  std::vector<size_t> sizes = {4};  // the small-message latency row
  for (size_t s = 4096; s <= (64u << 20); s *= 4) sizes.push_back(s);
  const double memcpy_bw = MemcpyBandwidth();
  const std::string name = absl::StrCat("/shardserve-bench-", getpid());
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      absl::Status s = Member(name, static_cast<int>(n), r, sizes, memcpy_bw);
      if (!s.ok()) std::fprintf(stderr, "member %d: %s\n", r, std::string(s.message()).c_str());
      std::fflush(stdout);
      _exit(s.ok() ? 0 : 1);
    }
    pids.push_back(pid);
  }
  bool ok = true;
  for (pid_t pid : pids) {
    int status;
    waitpid(pid, &status, 0);
    ok &= WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  return ok ? absl::OkStatus() : absl::InternalError("a benchmark member failed");
}

}  // namespace shardserve
