#include "comm/tcp_comm.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>

#include "absl/strings/str_join.h"
#include "comm/communicator_checks.h"
#include "comm/multiprocess.h"
#include "comm/rendezvous.h"

namespace shardserve {
namespace {

using ::testing::HasSubstr;
using testing::RunMembers;

// Listening sockets bound before forking, so every member knows every port.
struct Group {
  std::vector<Socket> listeners;
  std::vector<TcpMember> members;
};

Group BindGroup(int n) {
  Group g;
  for (int m = 0; m < n; ++m) {
    auto s = Listen("127.0.0.1", 0);
    EXPECT_TRUE(s.ok()) << s.status();
    g.members.push_back({"127.0.0.1", s->port(),
                         testing::kMemberNames.size() > size_t(m) ? testing::kMemberNames[m] : ""});
    g.listeners.push_back(std::move(*s));
  }
  return g;
}

absl::StatusOr<std::unique_ptr<Communicator>> Make(Group& g, int rank) {
  TcpOptions o;
  o.members = g.members;
  o.rank = rank;
  o.peer_timeout = std::chrono::milliseconds(600);
  o.connect_timeout = std::chrono::milliseconds(10000);
  auto c = TcpCommunicator::Create(o, std::move(g.listeners[rank]));
  if (!c.ok()) return c.status();
  return std::unique_ptr<Communicator>(std::move(*c));
}

TEST(TcpCommunicatorTest, CollectivesAndPointToPointAreExact) {
  for (int n : {2, 3}) {
    Group g = BindGroup(n);
    auto codes = RunMembers(n, [&](int r) -> std::string {
      auto comm = Make(g, r);
      if (!comm.ok()) return std::string(comm.status().message());
      return testing::ExerciseCommunicator(**comm);
    });
    for (int r = 0; r < n; ++r) EXPECT_EQ(codes[r], 0) << "member " << r << " of " << n;
  }
}

TEST(TcpCommunicatorTest, DeadOrFrozenMemberIsNamed) {
  std::vector<Group> rounds;
  rounds.push_back(BindGroup(3));
  rounds.push_back(BindGroup(3));
  testing::ExpectDeadOrFrozenMemberIsNamed(
      [&](int round, int r) { return Make(rounds[round], r); });
}

// The full path: ranks register at the leader's rendezvous (some before it listens), receive the
// world, and build a TCP communicator from it.
TEST(RendezvousTest, RanksMeetAndBuildTheirCommunicator) {
  const int tp = 2, pp = 2, n = tp * pp;
  Group data = BindGroup(n);
  int leader_port;
  {
    auto probe = Listen("127.0.0.1", 0);  // a free port nobody listens on yet
    leader_port = probe->port();
  }
  auto codes = RunMembers(n, [&](int r) -> std::string {
    auto world = WorldConfig::Create(tp, pp, r);
    const RankAddress self{r, "127.0.0.1", data.members[r].port};
    absl::StatusOr<WorldInfo> info;
    if (r == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // others retry meanwhile
      auto server = RendezvousServer::Listen("127.0.0.1", leader_port);
      if (!server.ok()) return std::string(server.status().message());
      info = server->Run(*world, self, {std::string("nccl-id\0bytes", 13)},
                         std::chrono::milliseconds(10000));
    } else {
      info =
          JoinRendezvous("127.0.0.1", leader_port, *world, self, std::chrono::milliseconds(10000));
    }
    if (!info.ok()) return std::string(info.status().message());
    if (info->blobs.size() != 1 || info->blobs[0] != std::string("nccl-id\0bytes", 13)) {
      return "blob lost";
    }
    TcpOptions o;
    for (const RankAddress& a : info->ranks) {
      if (a.port != data.members[a.rank].port) return "wrong address in the world";
      o.members.push_back({a.host, a.port, world->Describe(a.rank)});
    }
    o.rank = r;
    auto comm = TcpCommunicator::Create(o, std::move(data.listeners[r]));
    if (!comm.ok()) return std::string(comm.status().message());
    float x = static_cast<float>(r);
    CHECK_OK((*comm)->AllReduceSum(&x, 1));
    return x == 6.0f ? "" : "wrong sum";
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

TEST(RendezvousTest, MissingRankIsNamedAndWrongShapeRefused) {
  auto server = RendezvousServer::Listen("127.0.0.1", 0);
  ASSERT_TRUE(server.ok());
  const int port = server->port();
  std::thread wrong([port] {
    auto w = WorldConfig::Create(1, 2, 1);
    auto info =
        JoinRendezvous("127.0.0.1", port, *w, {1, "127.0.0.1", 1}, std::chrono::milliseconds(5000));
    EXPECT_THAT(std::string(info.status().message()),
                HasSubstr("rank 1 runs tp 1 x pp 2 but the leader runs tp 1 x pp 3"));
  });
  std::thread good([port] {
    auto w = WorldConfig::Create(1, 3, 1);
    auto info =
        JoinRendezvous("127.0.0.1", port, *w, {1, "127.0.0.1", 1}, std::chrono::milliseconds(5000));
    EXPECT_FALSE(info.ok());  // the leader gives up on rank 2 and never sends the world
  });
  auto w = WorldConfig::Create(1, 3, 0);
  auto info = server->Run(*w, {0, "127.0.0.1", 1}, {}, std::chrono::milliseconds(1500));
  wrong.join();
  server = absl::InternalError("closed");  // the leader is gone: rank 1 stops waiting
  good.join();
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(info.status().message()),
              HasSubstr("rendezvous: rank 2 (stage 2, tp 0) did not register within 1500 ms"));
}

// Blobs made from the registered addresses (as the CUDA backend makes NCCL ids only for links
// between different GPUs), and a failure to make them reaches every rank instead of a world.
TEST(RendezvousTest, BlobsFromTheAddressesAndTheirFailureReachEveryRank) {
  for (bool fail : {false, true}) {
    auto server = RendezvousServer::Listen("127.0.0.1", 0);
    ASSERT_TRUE(server.ok());
    const int port = server->port();
    std::string joined_result;
    std::thread rank1([&] {
      auto w = WorldConfig::Create(1, 2, 1);
      auto info = JoinRendezvous("127.0.0.1", port, *w, {1, "10.0.0.7", 1},
                                 std::chrono::milliseconds(5000));
      joined_result =
          info.ok() ? absl::StrJoin(info->blobs, ",") : std::string(info.status().message());
    });
    auto w = WorldConfig::Create(1, 2, 0);
    auto info = server->RunMakingBlobs(
        *w, {0, "127.0.0.1", 1},
        [&](const std::vector<RankAddress>& ranks) -> absl::StatusOr<std::vector<std::string>> {
          if (fail) return absl::ResourceExhaustedError("no NCCL id: out of sockets");
          return std::vector<std::string>{ranks[0].host, ranks[1].host};
        },
        std::chrono::milliseconds(5000));
    rank1.join();
    if (fail) {
      EXPECT_EQ(info.status().code(), absl::StatusCode::kResourceExhausted);
      EXPECT_THAT(joined_result, HasSubstr("the leader failed: no NCCL id: out of sockets"));
    } else {
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(joined_result, "127.0.0.1,10.0.0.7");
    }
  }
}

TEST(RendezvousTest, LeaderThatNeverListensTimesOut) {
  int port;
  {
    auto probe = Listen("127.0.0.1", 0);
    port = probe->port();
  }
  auto w = WorldConfig::Create(2, 1, 1);
  auto info =
      JoinRendezvous("127.0.0.1", port, *w, {1, "127.0.0.1", 1}, std::chrono::milliseconds(300));
  EXPECT_EQ(info.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(info.status().message()), HasSubstr("the leader did not listen"));
}

}  // namespace
}  // namespace shardserve
