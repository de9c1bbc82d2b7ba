// KV transfer over UCX between an exporter and pullers in this process (each its own UCX context
// and worker, so the bytes cross a real UCX transport: shared memory or TCP).
#include "comm/kv_transfer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/synchronization/mutex.h"
#include "common/process.h"

namespace shardserve {
namespace {

using ::testing::HasSubstr;

std::vector<uint8_t> Pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 31 + seed + (i >> 12));
  return v;
}

struct Pair {
  std::unique_ptr<KvExporter> exporter;
  std::unique_ptr<KvPuller> puller;
};

Pair MakePair(KvTransferLimits limits = {}) {
  auto e = KvExporter::Create(limits);
  EXPECT_TRUE(e.ok()) << e.status();
  auto p = KvPuller::Create(limits);
  EXPECT_TRUE(p.ok()) << p.status();
  return {std::move(*e), std::move(*p)};
}

// A puller done with an offer releases it: the exporter's owner hears the ticket (and withdraws
// it); a ticket it does not hold is refused.
TEST(KvTransferTest, AReleaseReachesTheOffersOwner) {
  Pair t = MakePair();
  const std::vector<uint8_t> a = Pattern(4096, 3);
  auto ticket = NewKvTicket(), other = NewKvTicket();
  ASSERT_TRUE(ticket.ok() && other.ok());
  ASSERT_TRUE(
      t.exporter->Offer(*ticket, {{a.data(), a.size()}}, absl::Now() + absl::Seconds(60)).ok());
  absl::Mutex mu;
  std::vector<KvTicket> heard;
  t.exporter->OnRelease([&](const KvTicket& k) {
    absl::MutexLock lock(&mu);
    heard.push_back(k);
  });
  EXPECT_EQ(t.puller->Release(t.exporter->address(), *other, absl::Seconds(10)).code(),
            absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(t.puller->Release(t.exporter->address(), *ticket, absl::Seconds(10)).ok());
  {
    absl::MutexLock lock(&mu);
    EXPECT_EQ(heard, std::vector<KvTicket>{*ticket});
  }
  EXPECT_TRUE(t.exporter->Withdraw(*ticket));
  EXPECT_EQ(t.puller->Release(t.exporter->address(), *ticket, absl::Seconds(10)).code(),
            absl::StatusCode::kPermissionDenied);  // withdrawn: nothing to release
  t.exporter->OnRelease(nullptr);
}

// Small ranges (eager messages) and a large pull of many ranges (rendezvous both ways): exactly
// the bytes asked for land where asked, nothing else is touched.
TEST(KvTransferTest, PullsTheRangesAskedIntoTheirDestinations) {
  Pair t = MakePair();
  const std::vector<uint8_t> a = Pattern(1 << 16, 1), b = Pattern(48 << 20, 2);
  auto ticket = NewKvTicket();
  ASSERT_TRUE(ticket.ok());
  ASSERT_TRUE(t.exporter
                  ->Offer(*ticket, {{a.data(), a.size()}, {b.data(), b.size()}},
                          absl::Now() + absl::Seconds(60))
                  .ok());
  std::vector<uint8_t> small(300, 0xee);
  std::vector<KvRange> ranges = {{0, 100, 200, small.data()}, {1, 7, 100, small.data() + 200}};
  ASSERT_TRUE(t.puller->Pull(t.exporter->address(), *ticket, ranges, absl::Seconds(10)).ok());
  EXPECT_TRUE(std::equal(small.begin(), small.begin() + 200, a.begin() + 100));
  EXPECT_TRUE(std::equal(small.begin() + 200, small.end(), b.begin() + 7));

  // 20,000 ranges of 2 KiB spread over the big segment (the list itself goes by rendezvous).
  const size_t n = 20000, len = 2048;
  std::vector<uint8_t> big(n * len + 16, 0xee);
  ranges.clear();
  for (size_t i = 0; i < n; ++i) {
    ranges.push_back({1, (i * 2311) % (b.size() - len), len, big.data() + i * len});
  }
  ASSERT_TRUE(t.puller->Pull(t.exporter->address(), *ticket, ranges, absl::Seconds(30)).ok());
  for (size_t i = 0; i < n; ++i) {
    ASSERT_TRUE(std::equal(big.begin() + i * len, big.begin() + (i + 1) * len,
                           b.begin() + ranges[i].offset))
        << i;
  }
  EXPECT_EQ(big[n * len], 0xee);  // past the last range: untouched
  // One range of 40 MB.
  std::vector<uint8_t> whole(40 << 20);
  ASSERT_TRUE(t.puller
                  ->Pull(t.exporter->address(), *ticket, {{1, 1000, whole.size(), whole.data()}},
                         absl::Seconds(30))
                  .ok());
  EXPECT_TRUE(std::equal(whole.begin(), whole.end(), b.begin() + 1000));
  EXPECT_TRUE(t.exporter->Withdraw(*ticket));
  EXPECT_EQ(t.exporter->offers(), 0u);
}

// Without the offer's ticket nothing is read; a range outside the offer is refused by name; an
// expired or withdrawn offer is gone; a second offer under the same ticket is refused.
TEST(KvTransferTest, RefusesWhatWasNotOffered) {
  Pair t = MakePair();
  const std::vector<uint8_t> a = Pattern(4096, 3);
  auto ticket = NewKvTicket(), other = NewKvTicket(), old = NewKvTicket();
  ASSERT_TRUE(ticket.ok() && other.ok() && old.ok());
  EXPECT_NE(*ticket, *other);
  ASSERT_TRUE(
      t.exporter->Offer(*ticket, {{a.data(), a.size()}}, absl::Now() + absl::Seconds(60)).ok());
  EXPECT_TRUE(absl::IsAlreadyExists(
      t.exporter->Offer(*ticket, {{a.data(), a.size()}}, absl::Now() + absl::Seconds(60))));
  ASSERT_TRUE(t.exporter->Offer(*old, {{a.data(), a.size()}}, absl::Now() - absl::Seconds(1)).ok());
  std::vector<uint8_t> out(64, 0xee);
  const std::vector<KvRange> one = {{0, 0, 64, out.data()}};
  const std::string& at = t.exporter->address();
  absl::Status s = t.puller->Pull(at, *other, one, absl::Seconds(10));
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("no KV offer under this ticket"));
  EXPECT_EQ(out, std::vector<uint8_t>(64, 0xee));
  s = t.puller->Pull(at, *old, one, absl::Seconds(10));
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  for (const KvRange& bad : {KvRange{0, 4000, 100, out.data()}, KvRange{1, 0, 8, out.data()},
                             KvRange{0, ~0ull - 4, 8, out.data()}}) {
    s = t.puller->Pull(at, *ticket, {bad}, absl::Seconds(10));
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("outside the offer"));
  }
  ASSERT_TRUE(t.puller->Pull(at, *ticket, one, absl::Seconds(10)).ok());  // still served
  EXPECT_TRUE(std::equal(out.begin(), out.end(), a.begin()));
  EXPECT_TRUE(t.exporter->Withdraw(*ticket));
  EXPECT_FALSE(t.exporter->Withdraw(*ticket));
  EXPECT_TRUE(absl::IsPermissionDenied(t.puller->Pull(at, *ticket, one, absl::Seconds(10))));
}

// The puller's own bounds: too many ranges or bytes are refused before anything is sent.
TEST(KvTransferTest, PullerBoundsItsPulls) {
  KvTransferLimits limits;
  limits.max_ranges = 4;
  limits.max_pull_bytes = 1000;
  Pair t = MakePair(limits);
  auto ticket = NewKvTicket();
  std::vector<uint8_t> out(2000);
  std::vector<KvRange> many(5, KvRange{0, 0, 1, out.data()});
  EXPECT_TRUE(absl::IsInvalidArgument(
      t.puller->Pull(t.exporter->address(), *ticket, many, absl::Seconds(1))));
  EXPECT_TRUE(absl::IsInvalidArgument(t.puller->Pull(
      t.exporter->address(), *ticket, {{0, 0, 2000, out.data()}}, absl::Seconds(1))));
}

// An exporter that stops answering: the pull ends at its deadline, and once the exporter answers
// again the next pull is served (a fresh endpoint).
TEST(KvTransferTest, AStalledExporterEndsThePullAtItsDeadline) {
  Pair t = MakePair();
  const std::vector<uint8_t> a = Pattern(1 << 20, 4);
  auto ticket = NewKvTicket();
  ASSERT_TRUE(
      t.exporter->Offer(*ticket, {{a.data(), a.size()}}, absl::Now() + absl::Seconds(60)).ok());
  std::vector<uint8_t> out(a.size());
  const std::vector<KvRange> all = {{0, 0, a.size(), out.data()}};
  ASSERT_TRUE(t.puller->Pull(t.exporter->address(), *ticket, all, absl::Seconds(10)).ok());
  t.exporter->PauseForTest();
  const absl::Time start = absl::Now();
  absl::Status s = t.puller->Pull(t.exporter->address(), *ticket, all, absl::Milliseconds(500));
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(8));  // bounded: the deadline and a close
  t.exporter->ResumeForTest();
  std::fill(out.begin(), out.end(), 0);
  s = t.puller->Pull(t.exporter->address(), *ticket, all, absl::Seconds(10));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(out, a);
}

// An exporter that goes away: the pull fails (Unavailable, or its deadline), it does not hang.
TEST(KvTransferTest, AnExporterGoneFailsThePull) {
  Pair t = MakePair();
  const std::vector<uint8_t> a = Pattern(4096, 5);
  auto ticket = NewKvTicket();
  ASSERT_TRUE(
      t.exporter->Offer(*ticket, {{a.data(), a.size()}}, absl::Now() + absl::Seconds(60)).ok());
  std::vector<uint8_t> out(a.size());
  const std::string address = t.exporter->address();
  ASSERT_TRUE(
      t.puller->Pull(address, *ticket, {{0, 0, a.size(), out.data()}}, absl::Seconds(10)).ok());
  t.exporter.reset();
  absl::Status s =
      t.puller->Pull(address, *ticket, {{0, 0, a.size(), out.data()}}, absl::Seconds(3));
  EXPECT_TRUE(absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s)) << s;
}

// A pull that gives up while its bytes are still arriving (a large rendezvous past a short
// deadline) leaves nothing writing into its destination: the receive is cancelled before the
// pull returns, so the caller may reuse the memory at once.
TEST(KvTransferTest, APullGivenUpWritesNothingAfterItReturns) {
  Pair t = MakePair();
  const std::vector<uint8_t> a = Pattern(64 << 20, 8);
  auto ticket = NewKvTicket();
  ASSERT_TRUE(
      t.exporter->Offer(*ticket, {{a.data(), a.size()}}, absl::Now() + absl::Seconds(60)).ok());
  std::vector<uint8_t> out(a.size()), other(4096);
  int gave_up = 0;
  for (int ms : {1, 2, 3, 5, 8, 12, 20, 30, 50}) {
    absl::Status s = t.puller->Pull(t.exporter->address(), *ticket, {{0, 0, a.size(), out.data()}},
                                    absl::Milliseconds(ms));
    if (s.ok()) continue;
    ++gave_up;
    std::fill(out.begin(), out.end(), 0);  // reused by its owner at once
    ASSERT_TRUE(t.puller
                    ->Pull(t.exporter->address(), *ticket, {{0, 0, other.size(), other.data()}},
                           absl::Seconds(10))
                    .ok());
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](uint8_t b) { return b == 0; }))
        << "written after a pull of " << ms << " ms gave up";
  }
  EXPECT_GT(gave_up, 0);
  ASSERT_TRUE(
      t.puller
          ->Pull(t.exporter->address(), *ticket, {{0, 0, a.size(), out.data()}}, absl::Seconds(30))
          .ok());
  EXPECT_EQ(out, a);
}

// An exporter that went away (a prefill replica restarted) fails only the pulls sent to it: its
// endpoint's error, arriving later, says nothing of a pull from another exporter.
TEST(KvTransferTest, AGoneExportersEndpointFailsNoOtherPull) {
  Pair t = MakePair();
  auto other = KvExporter::Create();
  ASSERT_TRUE(other.ok()) << other.status();
  const std::vector<uint8_t> a = Pattern(4096, 6);
  auto ticket = NewKvTicket();
  ASSERT_TRUE(
      t.exporter->Offer(*ticket, {{a.data(), a.size()}}, absl::Now() + absl::Seconds(60)).ok());
  ASSERT_TRUE(
      (*other)->Offer(*ticket, {{a.data(), a.size()}}, absl::Now() + absl::Seconds(60)).ok());
  std::vector<uint8_t> out(a.size());
  ASSERT_TRUE(
      t.puller
          ->Pull(t.exporter->address(), *ticket, {{0, 0, a.size(), out.data()}}, absl::Seconds(10))
          .ok());
  t.exporter.reset();
  for (int i = 0; i < 20; ++i) {
    absl::Status s = t.puller->Pull((*other)->address(), *ticket, {{0, 0, a.size(), out.data()}},
                                    absl::Seconds(10));
    ASSERT_TRUE(s.ok()) << "pull " << i << ": " << s;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// Pullers on their own threads pull from one exporter at once.
TEST(KvTransferTest, ManyPullersAtOnce) {
  auto exporter = KvExporter::Create();
  ASSERT_TRUE(exporter.ok());
  const std::vector<uint8_t> a = Pattern(8 << 20, 6);
  auto ticket = NewKvTicket();
  ASSERT_TRUE(
      (*exporter)->Offer(*ticket, {{a.data(), a.size()}}, absl::Now() + absl::Seconds(60)).ok());
  std::vector<std::thread> threads;
  std::atomic<int> good{0};
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      auto p = KvPuller::Create();
      if (!p.ok()) return;
      std::vector<uint8_t> out(a.size() / 4);
      for (int round = 0; round < 5; ++round) {
        if (!(*p)->Pull((*exporter)->address(), *ticket,
                        {{0, i * out.size(), out.size(), out.data()}}, absl::Seconds(20))
                 .ok() ||
            !std::equal(out.begin(), out.end(), a.begin() + i * out.size())) {
          return;
        }
      }
      ++good;
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(good.load(), 4);
  EXPECT_TRUE((*exporter)->Withdraw(*ticket));
}

// A puller process (kv_transfer_peer) pulling `bytes` of the offer over and over, once its first
// pull is done; its output goes to *out_path.
absl::StatusOr<pid_t> StartPeer(const KvExporter& exporter, const KvTicket& ticket, size_t bytes,
                                std::string* out_path) {
  char path[] = "/tmp/kv_transfer_peer_XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return absl::InternalError("mkstemp");
  close(fd);
  *out_path = path;
  const std::string peer = SelfDirectory() + "/kv_transfer_peer";
  auto pid = Spawn("/bin/sh",
                   {"-c", "exec \"$0\" \"$1\" \"$2\" \"$3\" > \"$4\"", peer,
                    absl::BytesToHexString(exporter.address()),
                    absl::BytesToHexString(std::string(ticket.begin(), ticket.end())),
                    std::to_string(bytes), path},
                   {}, true);
  if (!pid.ok()) return pid.status();
  std::string seen;
  for (int i = 0; i < 300 && seen.find("pulled") == std::string::npos; ++i) {
    usleep(50000);
    if (FILE* f = fopen(path, "r")) {
      char buf[256];
      size_t n = fread(buf, 1, sizeof(buf), f);
      seen.assign(buf, n);
      fclose(f);
    }
  }
  if (seen.find("pulled") == std::string::npos) {
    kill(*pid, SIGKILL);
    return absl::DeadlineExceededError("the peer pulled nothing: " + seen);
  }
  return *pid;
}

// A puller process killed with SIGKILL in the middle of its pulls (large ones, by rendezvous):
// the exporter lives on, serves another puller, and the offer can be withdrawn (its sends to the
// dead peer end).
TEST(KvTransferTest, APullerKilledMidTransferLeavesTheExporterServing) {
  auto exporter = KvExporter::Create();
  ASSERT_TRUE(exporter.ok());
  const std::vector<uint8_t> a = Pattern(64 << 20, 7);
  auto ticket = NewKvTicket();
  ASSERT_TRUE(
      (*exporter)->Offer(*ticket, {{a.data(), a.size()}}, absl::Now() + absl::Seconds(120)).ok());
  std::string out_path;
  auto pid = StartPeer(**exporter, *ticket, a.size(), &out_path);
  ASSERT_TRUE(pid.ok()) << pid.status();
  usleep(20000);
  kill(*pid, SIGKILL);
  int status = 0;
  waitpid(*pid, &status, 0);
  unlink(out_path.c_str());
  auto puller = KvPuller::Create();
  ASSERT_TRUE(puller.ok());
  std::vector<uint8_t> out(1 << 20);
  absl::Status s = (*puller)->Pull((*exporter)->address(), *ticket,
                                   {{0, 5, out.size(), out.data()}}, absl::Seconds(20));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(std::equal(out.begin(), out.end(), a.begin() + 5));
  const absl::Time start = absl::Now();
  EXPECT_TRUE((*exporter)->Withdraw(*ticket));
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
}

// A puller that stops taking its bytes (a process stopped mid-pull): withdrawing the offer does
// not wait for it for ever — after a grace its endpoint is closed and the send ends.
TEST(KvTransferTest, WithdrawEndsSendsToAPullerThatStoppedTakingThem) {
  auto exporter = KvExporter::Create();
  ASSERT_TRUE(exporter.ok());
  const std::vector<uint8_t> a = Pattern(256 << 20, 8);
  auto ticket = NewKvTicket();
  ASSERT_TRUE(
      (*exporter)->Offer(*ticket, {{a.data(), a.size()}}, absl::Now() + absl::Seconds(120)).ok());
  std::string out_path;
  auto pid = StartPeer(**exporter, *ticket, a.size(), &out_path);
  ASSERT_TRUE(pid.ok()) << pid.status();
  usleep(30000);
  kill(*pid, SIGSTOP);
  const absl::Time start = absl::Now();
  EXPECT_TRUE((*exporter)->Withdraw(*ticket));
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  EXPECT_EQ((*exporter)->offers(), 0u);
  kill(*pid, SIGKILL);
  int status = 0;
  waitpid(*pid, &status, 0);
  unlink(out_path.c_str());
}

}  // namespace
}  // namespace shardserve
