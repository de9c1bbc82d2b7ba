#include "comm/shm_comm.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "comm/communicator_checks.h"
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

TEST(ShmCommunicatorTest, CollectivesAndPointToPointAreExact) {
  for (int n : {2, 3, 4}) {
    const std::string name = UniqueName();
    auto codes = RunMembers(n, [&](int r) -> std::string {
      auto comm = ShmCommunicator::Create(Options(name, n, r));
      if (!comm.ok()) return std::string(comm.status().message());
      return testing::ExerciseCommunicator(**comm);
    });
    for (int r = 0; r < n; ++r) EXPECT_EQ(codes[r], 0) << "member " << r << " of " << n;
  }
}

TEST(ShmCommunicatorTest, DeadOrFrozenMemberIsNamed) {
  const std::vector<std::string> names = {UniqueName(), UniqueName()};  // one group per round
  testing::ExpectDeadOrFrozenMemberIsNamed(
      [&](int round, int r) -> absl::StatusOr<std::unique_ptr<Communicator>> {
        ShmOptions o = Options(names[round], 3, r);
        o.member_names = testing::kMemberNames;
        return ShmCommunicator::Create(o);
      });
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
