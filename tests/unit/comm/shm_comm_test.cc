#include "comm/shm_comm.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "comm/multiprocess.h"

namespace shardserve {
namespace {

using testing::RunMembers;

std::string UniqueName() {
  static std::atomic<int> counter{0};
  return absl::StrCat("/shardserve-test-", getpid(), "-", counter++);
}

ShmOptions Options(const std::string& name, int size, int rank, size_t capacity = 4096) {
  ShmOptions o;
  o.name = name;
  o.size = size;
  o.rank = rank;
  o.capacity_bytes = capacity;  // small, so large transfers exercise chunking
  o.peer_timeout = std::chrono::milliseconds(600);
  o.attach_timeout = std::chrono::milliseconds(10000);
  return o;
}

#define CHECK_OK(expr)                                                        \
  do {                                                                        \
    if (absl::Status s_ = (expr); !s_.ok()) return std::string(s_.message()); \
  } while (0)

// Every collective and point-to-point operation, for 2..4 members, with transfers below and above
// the slot capacity; results are checked exactly (small integers sum exactly in F32).
TEST(ShmCommunicatorTest, CollectivesAndPointToPointAreExact) {
  for (int n : {2, 3, 4}) {
    const std::string name = UniqueName();
    auto codes = RunMembers(n, [&](int r) -> std::string {
      auto comm = ShmCommunicator::Create(Options(name, n, r));
      if (!comm.ok()) return std::string(comm.status().message());
      Communicator& c = **comm;
      for (size_t count : {size_t{1}, size_t{7}, size_t{1000}, size_t{5000}}) {
        std::vector<float> v(count);
        for (size_t i = 0; i < count; ++i) v[i] = static_cast<float>(r * 100 + i % 97);
        CHECK_OK(c.AllReduceSum(v.data(), count));
        for (size_t i = 0; i < count; ++i) {
          const float want = 100.0f * n * (n - 1) / 2 + n * static_cast<float>(i % 97);
          if (v[i] != want) return absl::StrCat("all-reduce[", i, "] = ", v[i], " not ", want);
        }
        std::vector<float> gathered(n * count);
        std::vector<float> mine(count, static_cast<float>(r + 1));
        CHECK_OK(c.AllGather(mine.data(), count, gathered.data()));
        for (int m = 0; m < n; ++m) {
          if (gathered[m * count + count - 1] != m + 1) return "all-gather wrong";
        }
        std::vector<float> parts(n * count), reduced(count);
        for (size_t i = 0; i < parts.size(); ++i) parts[i] = static_cast<float>(i % 13);
        CHECK_OK(c.ReduceScatterSum(parts.data(), count, reduced.data()));
        for (size_t i = 0; i < count; ++i) {
          if (reduced[i] != n * static_cast<float>((r * count + i) % 13)) {
            return "reduce-scatter wrong";
          }
        }
        std::vector<uint8_t> bytes(count * 3, static_cast<uint8_t>(r == n - 1 ? 42 : 0));
        CHECK_OK(c.Broadcast(bytes.data(), bytes.size(), n - 1));
        if (bytes.front() != 42 || bytes.back() != 42) return "broadcast wrong";
        // A ring of sends: each member sends to the next and receives from the previous.
        std::vector<float> out(count, static_cast<float>(r)), in(count, -1);
        const int next = (r + 1) % n, prev = (r + n - 1) % n;
        if (r % 2 == 0) {
          CHECK_OK(c.Send(out.data(), count * 4, next));
          CHECK_OK(c.Recv(in.data(), count * 4, prev));
        } else {
          CHECK_OK(c.Recv(in.data(), count * 4, prev));
          CHECK_OK(c.Send(out.data(), count * 4, next));
        }
        if (in.back() != prev) return absl::StrCat("recv got ", in.back(), " not ", prev);
        CHECK_OK(c.Barrier());
      }
      if (r == 0) CHECK_OK(c.Send(nullptr, 0, 1));
      if (r == 1) CHECK_OK(c.Recv(nullptr, 0, 0));
      return "";
    });
    for (int r = 0; r < n; ++r) EXPECT_EQ(codes[r], 0) << "member " << r << " of " << n;
  }
}

// A member that dies, or freezes, makes the others' next operation fail naming it — not hang.
TEST(ShmCommunicatorTest, DeadOrFrozenMemberIsNamed) {
  for (bool freeze : {false, true}) {
    const std::string name = UniqueName();
    auto codes = RunMembers(
        3,
        [&](int r) -> std::string {
          ShmOptions o = Options(name, 3, r);
          o.member_names = {"rank 0 (stage 0, tp 0)", "rank 1 (stage 0, tp 1)",
                            "rank 2 (stage 0, tp 2)"};
          auto comm = ShmCommunicator::Create(o);
          if (!comm.ok()) return std::string(comm.status().message());
          std::vector<float> v(100, 1.0f);
          CHECK_OK((*comm)->AllReduceSum(v.data(), v.size()));
          if (r == 2) {
            if (freeze) raise(SIGSTOP);
            _exit(3);  // dies without leaving cleanly
          }
          const auto t0 = std::chrono::steady_clock::now();
          absl::Status s = (*comm)->AllReduceSum(v.data(), v.size());
          const double secs =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          std::fprintf(stderr, "member %d detected the %s member after %.2f s: %s\n", r,
                       freeze ? "frozen" : "dead", secs, std::string(s.message()).c_str());
          if (s.code() != absl::StatusCode::kUnavailable) return "expected Unavailable";
          if (std::string(s.message()).find("rank 2 (stage 0, tp 2) stopped answering") ==
              std::string::npos) {
            return absl::StrCat("message does not name rank 2: ", s.message());
          }
          return "";
        },
        [&](const std::vector<pid_t>& pids) {
          if (!freeze) return;
          // Member 2 stopped itself; once the others have exited (left waitable, WNOWAIT, so
          // their codes are still checked), kill it.
          int status;
          waitpid(pids[2], &status, WUNTRACED);
          siginfo_t info;
          waitid(P_PID, pids[0], &info, WEXITED | WNOWAIT);
          waitid(P_PID, pids[1], &info, WEXITED | WNOWAIT);
          kill(pids[2], SIGKILL);
        });
    EXPECT_EQ(codes[0], 0);
    EXPECT_EQ(codes[1], 0);
    EXPECT_EQ(codes[2], freeze ? 128 + SIGKILL : 3);
  }
}

TEST(ShmCommunicatorTest, MissingMemberTimesOutNamingIt) {
  ShmOptions o = Options(UniqueName(), 2, 0);
  o.attach_timeout = std::chrono::milliseconds(300);
  o.member_names = {"rank 0 (stage 1, tp 0)", "rank 1 (stage 1, tp 1)"};
  auto comm = ShmCommunicator::Create(o);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(std::string(comm.status().message()).find("rank 1 (stage 1, tp 1) did not attach"),
            std::string::npos)
      << comm.status();
  ShmOptions bad = o;
  bad.name = "no-slash";
  EXPECT_EQ(ShmCommunicator::Create(bad).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardserve
