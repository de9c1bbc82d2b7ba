#pragma once
// Checks every Communicator operation inside one member process; returns "" or what went wrong.
// Used by each backend's multi-process test, so all backends are held to the same results.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "comm/communicator.h"
#include "comm/multiprocess.h"

namespace shardserve::testing {

#define CHECK_OK(expr)                                                        \
  do {                                                                        \
    if (absl::Status s_ = (expr); !s_.ok()) return std::string(s_.message()); \
  } while (0)

// Collectives and point-to-point with counts below and above a shared-memory slot of 4 KiB;
// results are checked exactly (small integers sum exactly in F32).
inline std::string ExerciseCommunicator(Communicator& c) {
  const int r = c.rank(), n = c.size();
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
}

inline const std::vector<std::string> kMemberNames = {
    "rank 0 (stage 0, tp 0)", "rank 1 (stage 0, tp 1)", "rank 2 (stage 0, tp 2)"};

// Makes member `rank` of a 3-member group; each round (0: a member dies, 1: a member freezes)
// needs a fresh group. Members are named kMemberNames.
using CommFactory =
    std::function<absl::StatusOr<std::unique_ptr<Communicator>>(int round, int rank)>;

// Member 2 dies (round 0) or freezes with SIGSTOP (round 1) after one all-reduce; the others'
// next all-reduce must fail with Unavailable naming it — never hang.
inline void ExpectDeadOrFrozenMemberIsNamed(const CommFactory& make) {
  for (int round = 0; round < 2; ++round) {
    const bool freeze = round == 1;
    auto codes = RunMembers(
        3,
        [&](int r) -> std::string {
          auto comm = make(round, r);
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
          if (std::string(s.message()).find(kMemberNames[2]) == std::string::npos) {
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
    EXPECT_EQ(codes[0], 0) << (freeze ? "frozen" : "dead") << " round";
    EXPECT_EQ(codes[1], 0) << (freeze ? "frozen" : "dead") << " round";
    EXPECT_EQ(codes[2], freeze ? 128 + SIGKILL : 3);
  }
}

}  // namespace shardserve::testing
