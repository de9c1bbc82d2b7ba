#include "comm/tcp_comm.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "comm/communicator_checks.h"
#include "comm/handshake.h"
#include "comm/multiprocess.h"
#include "comm/rendezvous.h"

namespace shardserve {
namespace {

using ::testing::HasSubstr;
using testing::RunMembers;

const std::string kSecret = "replica-secret-0123456789";

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
  o.secret = kSecret;
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
      auto server = RendezvousServer::Listen("127.0.0.1", leader_port, kSecret);
      if (!server.ok()) return std::string(server.status().message());
      info = server->Run(*world, self, {std::string("nccl-id\0bytes", 13)},
                         std::chrono::milliseconds(10000));
    } else {
      info = JoinRendezvous("127.0.0.1", leader_port, *world, self, kSecret,
                            std::chrono::milliseconds(10000));
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
    o.secret = kSecret;
    auto comm = TcpCommunicator::Create(o, std::move(data.listeners[r]));
    if (!comm.ok()) return std::string(comm.status().message());
    float x = static_cast<float>(r);
    CHECK_OK((*comm)->AllReduceSum(&x, 1));
    return x == 6.0f ? "" : "wrong sum";
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

TEST(RendezvousTest, MissingRankIsNamedAndWrongShapeRefused) {
  auto server = RendezvousServer::Listen("127.0.0.1", 0, kSecret);
  ASSERT_TRUE(server.ok());
  const int port = server->port();
  std::thread wrong([port] {
    auto w = WorldConfig::Create(1, 2, 1);
    auto info = JoinRendezvous("127.0.0.1", port, *w, {1, "127.0.0.1", 1}, kSecret,
                               std::chrono::milliseconds(5000));
    EXPECT_THAT(std::string(info.status().message()),
                HasSubstr("rank 1 runs tp 1 x pp 2 but the leader runs tp 1 x pp 3"));
  });
  std::thread good([port] {
    auto w = WorldConfig::Create(1, 3, 1);
    auto info = JoinRendezvous("127.0.0.1", port, *w, {1, "127.0.0.1", 1}, kSecret,
                               std::chrono::milliseconds(5000));
    // The leader gives up on rank 2 and tells the rank that came who did not.
    EXPECT_FALSE(info.ok());
    EXPECT_THAT(std::string(info.status().message()),
                HasSubstr("the leader gave up: rendezvous: rank 2 (stage 2, tp 0) did not "
                          "register within 1500 ms"));
  });
  auto w = WorldConfig::Create(1, 3, 0);
  // The leader tells who it still waits for (a rank's start-up state): both, then rank 2.
  absl::Mutex mu;
  std::vector<std::string> waits;
  auto info = server->RunMakingBlobs(
      *w, {0, "127.0.0.1", 1},
      [](const std::vector<RankAddress>&) { return std::vector<std::string>(); },
      std::chrono::milliseconds(1500),
      [&](const std::string& missing) {
        absl::MutexLock lock(&mu);
        waits.push_back(missing);
      });
  EXPECT_THAT(waits, ::testing::ElementsAre("rank 1 (stage 1, tp 0), rank 2 (stage 2, tp 0)",
                                            "rank 2 (stage 2, tp 0)"));
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
    auto server = RendezvousServer::Listen("127.0.0.1", 0, kSecret);
    ASSERT_TRUE(server.ok());
    const int port = server->port();
    std::string joined_result;
    std::thread rank1([&] {
      auto w = WorldConfig::Create(1, 2, 1);
      auto info = JoinRendezvous("127.0.0.1", port, *w, {1, "10.0.0.7", 1}, kSecret,
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

// What the outside tester did to the leader, and more: five bytes that once aborted it (a length
// prefix and "5", from a peer that knows the secret), an impostor with another secret that tries
// to register as rank 1, garbage, and 40 connections that say nothing. The leader stays up, the
// impostor learns nothing, and the real rank 1 still gets the world.
TEST(RendezvousTest, HostileConnectionsAreRefusedAndDelayNoOne) {
  auto server = RendezvousServer::Listen("127.0.0.1", 0, kSecret);
  ASSERT_TRUE(server.ok());
  const int port = server->port();
  absl::StatusOr<WorldInfo> info;
  std::thread leader([&] {
    auto w = WorldConfig::Create(1, 2, 0);
    info = server->Run(*w, {0, "127.0.0.1", 1}, {"id"}, std::chrono::milliseconds(20000));
  });
  const Deadline soon = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  std::vector<Socket> silent;
  for (int i = 0; i < 40; ++i) silent.push_back(*ConnectWithRetry("127.0.0.1", port, soon));
  {
    auto c = ConnectWithRetry("127.0.0.1", port, soon);
    const std::string junk(300, '\x05');
    (void)c->WriteAll(junk.data(), junk.size());
  }
  std::string five_bytes_answer;
  {
    auto c = ConnectWithRetry("127.0.0.1", port, soon);
    ASSERT_TRUE(ProveToAcceptor(*c, kSecret, "rendezvous", 1, soon).ok());
    const uint32_t len = 1;
    ASSERT_TRUE(c->WriteAll(&len, 4).ok() && c->WriteAll("5", 1).ok());
    uint32_t n = 0;
    if (c->ReadAll(&n, 4, std::chrono::milliseconds(5000)).ok() && n < 4096) {
      five_bytes_answer.resize(n);
      (void)c->ReadAll(five_bytes_answer.data(), n, std::chrono::milliseconds(5000));
    }
  }
  auto w = WorldConfig::Create(1, 2, 1);
  const absl::Status impostor =
      JoinRendezvous("127.0.0.1", port, *w, {1, "10.6.6.6", 6666}, "another-secret-0123456789",
                     std::chrono::milliseconds(5000))
          .status();
  auto joined = JoinRendezvous("127.0.0.1", port, *w, {1, "127.0.0.1", 1234}, kSecret,
                               std::chrono::milliseconds(5000));
  leader.join();
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_EQ(info->ranks[1].port, 1234);  // the real rank, not the impostor
  EXPECT_EQ(joined->blobs, std::vector<std::string>{"id"});
  EXPECT_EQ(impostor.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(impostor.message()), HasSubstr("secrets differ"));
  EXPECT_THAT(five_bytes_answer, HasSubstr("a malformed registration"));
}

// A rank never takes a world from a leader that cannot prove the secret.
TEST(RendezvousTest, ARankRefusesAnImpostorLeader) {
  auto fake = RendezvousServer::Listen("127.0.0.1", 0, "not-the-replica-secret-0");
  ASSERT_TRUE(fake.ok());
  const int port = fake->port();
  std::thread leader([&] {
    auto w = WorldConfig::Create(1, 2, 0);
    (void)fake->Run(*w, {0, "127.0.0.1", 1}, {"stolen?"}, std::chrono::milliseconds(2000));
  });
  auto w = WorldConfig::Create(1, 2, 1);
  auto info = JoinRendezvous("127.0.0.1", port, *w, {1, "127.0.0.1", 1}, kSecret,
                             std::chrono::milliseconds(2000));
  leader.join();
  EXPECT_EQ(info.status().code(), absl::StatusCode::kPermissionDenied);
}

// A leader that cannot start tells the ranks at once.
TEST(RendezvousTest, ALeaderThatFailedTellsEveryRank) {
  auto server = RendezvousServer::Listen("127.0.0.1", 0, kSecret);
  ASSERT_TRUE(server.ok());
  const int port = server->port();
  std::vector<std::string> told(2);
  std::vector<std::thread> ranks;
  for (int r = 1; r <= 2; ++r) {
    ranks.emplace_back([&, r] {
      auto w = WorldConfig::Create(1, 3, r);
      auto info = JoinRendezvous("127.0.0.1", port, *w, {r, "127.0.0.1", 1}, kSecret,
                                 std::chrono::milliseconds(20000));
      told[r - 1] = std::string(info.status().message());
    });
  }
  auto w = WorldConfig::Create(1, 3, 0);
  server->RefuseAll(*w, "tokenizer.json is missing", std::chrono::milliseconds(20000));
  for (std::thread& t : ranks) t.join();
  for (const std::string& m : told) {
    EXPECT_THAT(m, HasSubstr("the leader failed: tokenizer.json is missing"));
  }
}

// On a member's data port, an impostor that claims a member's place (with another secret) is
// refused, and the real member takes it.
TEST(TcpCommunicatorTest, ImpostorsCannotTakeAMembersPlace) {
  Group g = BindGroup(2);
  const int port0 = g.members[0].port;
  auto codes = RunMembers(2, [&](int r) -> std::string {
    if (r == 1) {
      // First an impostor, from this process, then the real member 1.
      const Deadline soon = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      auto c = ConnectWithRetry("127.0.0.1", port0, soon);
      if (!c.ok()) return "no connection";
      absl::Status s = ProveToAcceptor(*c, "impostor-secret-0123456", "tcp-group 0", 1, soon);
      if (s.code() != absl::StatusCode::kPermissionDenied) return "the impostor was not refused";
    }
    auto comm = Make(g, r);
    if (!comm.ok()) return std::string(comm.status().message());
    float x = static_cast<float>(r + 1);
    if (!(*comm)->AllReduceSum(&x, 1).ok()) return "no sum";
    return x == 3.0f ? "" : "wrong sum";
  });
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 0);
}

TEST(RendezvousTest, LeaderThatNeverListensTimesOut) {
  int port;
  {
    auto probe = Listen("127.0.0.1", 0);
    port = probe->port();
  }
  auto w = WorldConfig::Create(2, 1, 1);
  auto info = JoinRendezvous("127.0.0.1", port, *w, {1, "127.0.0.1", 1}, kSecret,
                             std::chrono::milliseconds(300));
  EXPECT_EQ(info.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(info.status().message()), HasSubstr("the leader did not listen"));
}

// A secret's directory outlives a run killed with SIGKILL (no destructor runs) only until the next
// run makes its own secret; a live run's directory stays.
TEST(SecretFileTest, ASecretOfAKilledRunIsRemovedByTheNext) {
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto f = SecretFile::Create();
    const std::string path = f.ok() ? f->path() : "";
    (void)!write(pipefd[1], path.data(), path.size());
    close(pipefd[1]);
    pause();  // until killed: the destructor never runs
    _exit(0);
  }
  close(pipefd[1]);
  char buf[4096];
  const ssize_t n = read(pipefd[0], buf, sizeof buf);
  close(pipefd[0]);
  ASSERT_GT(n, 0);
  const std::filesystem::path orphan = std::filesystem::path(std::string(buf, n)).parent_path();
  auto live = SecretFile::Create();  // the child still runs: its secret stays
  ASSERT_TRUE(live.ok()) << live.status();
  EXPECT_TRUE(std::filesystem::exists(orphan));
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  EXPECT_TRUE(std::filesystem::exists(orphan)) << "kill -9: nothing removed it";
  auto next = SecretFile::Create();
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_FALSE(std::filesystem::exists(orphan)) << orphan << " outlived its run";
  EXPECT_TRUE(std::filesystem::exists(live->path())) << "a live run's secret is left alone";
  EXPECT_NE(std::filesystem::path(next->path())
                .parent_path()
                .filename()
                .string()
                .find(absl::StrCat("shardserve-secret-", getpid(), "-")),
            std::string::npos);
}

TEST(SocketTest, AChosenPortIsFreeAndOutsideTheEphemeralRange) {
  int ephemeral_low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> ephemeral_low;
  for (int i = 0; i < 20; ++i) {
    auto port = ChooseFreePort("127.0.0.1");
    ASSERT_TRUE(port.ok()) << port.status();
    EXPECT_GE(*port, 10000);
    EXPECT_LT(*port, ephemeral_low);
    auto s = Listen("127.0.0.1", *port);  // still free for the one it was chosen for
    EXPECT_TRUE(s.ok()) << s.status();
  }
}

// A port the caller has taken (its children will listen there later; `shardserve local`'s API and
// metrics ports) is never chosen: with all but 100 of the range taken, every choice is one of the
// 100.
TEST(SocketTest, AChosenPortIsNeverOneTheCallerHasTaken) {
  int ephemeral_low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> ephemeral_low;
  if (ephemeral_low - 10000 < 1000)
    GTEST_SKIP() << "no range below the ephemeral ports to choose from";
  const int first = ephemeral_low - 900;  // [first, first + 100) left to choose from
  std::vector<int> taken;
  for (int p = 10000; p < ephemeral_low; ++p) {
    if (p < first || p >= first + 100) taken.push_back(p);
  }
  for (int i = 0; i < 20; ++i) {
    auto port = ChooseFreePort("127.0.0.1", taken);
    ASSERT_TRUE(port.ok()) << port.status();
    EXPECT_GE(*port, first);
    EXPECT_LT(*port, first + 100);
  }
  taken.push_back(first);
  for (int p = first + 1; p < first + 100; ++p) taken.push_back(p);
  const auto none = ChooseFreePort("127.0.0.1", taken);  // every port taken
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted) << none.status();
  EXPECT_THAT(std::string(none.status().message()),
              HasSubstr(absl::StrCat("every port from 10000 to ", ephemeral_low - 1)));
}

// With the ephemeral range moved down (here: said to start at 10,500), a port-0 listener's port,
// never one the caller has taken; an error naming why when the kernel gives only taken ones.
TEST(SocketTest, AChosenPortBelowALowRangeIsNeverOneTheCallerHasTakenEither) {
  int low = 32768, high = 60999;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low >> high;
  std::vector<int> taken;  // half of the kernel's range
  for (int p = low; p <= high; p += 2) taken.push_back(p);
  const std::unordered_set<int> avoid(taken.begin(), taken.end());
  for (int i = 0; i < 20; ++i) {
    auto port = ChooseFreePortBelow("127.0.0.1", 10500, taken);
    ASSERT_TRUE(port.ok()) << port.status();
    EXPECT_FALSE(avoid.contains(*port)) << *port;
  }
  for (int p = low + 1; p <= high; p += 2) taken.push_back(p);  // all of it
  const auto none = ChooseFreePortBelow("127.0.0.1", 10500, taken);
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(std::string(none.status().message()),
              HasSubstr("the kernel gave only ports the caller has taken"));
}

}  // namespace
}  // namespace shardserve
