#include "comm/rendezvous.h"

#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/base/thread_annotations.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "comm/handshake.h"
#include "comm/json_frame.h"
#include "common/status.h"

namespace shardserve {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
constexpr char kContext[] = "rendezvous";
constexpr uint32_t kMaxRegistration = 4096;  // a rank's registration is small
constexpr uint32_t kMaxWorld = 16 << 20;     // the world: every address and blob
constexpr auto kHandshake = std::chrono::milliseconds(5000);
constexpr size_t kMaxHost = 253;

absl::Status WriteMessage(Socket& s, const json& j) {
  return WriteJsonFrame([&](const void* data, size_t n) { return s.WriteAll(data, n); },
                        EncodeJsonFrame(j));
}

// A JSON object of at most max_bytes, before the deadline.
absl::StatusOr<json> ReadMessage(Socket& s, uint32_t max_bytes, Deadline deadline) {
  return ReadJsonFrame([&](void* data, size_t n) { return ReadBefore(s, data, n, deadline); },
                       max_bytes, "a rendezvous message");
}

struct Registration {
  int rank, tp, pp;
  RankAddress address;
};

absl::StatusOr<Registration> ReadRegistration(const json& m) {
  ASSIGN_OR_RETURN(std::string type, JsonString(m, "type", 32));
  if (type != "register") return absl::DataLossError("expected a registration");
  Registration r;
  ASSIGN_OR_RETURN(int64_t rank, JsonInt(m, "rank", 0, 1 << 20));
  ASSIGN_OR_RETURN(int64_t tp, JsonInt(m, "tp", 1, 1 << 20));
  ASSIGN_OR_RETURN(int64_t pp, JsonInt(m, "pp", 1, 1 << 20));
  ASSIGN_OR_RETURN(int64_t port, JsonInt(m, "port", 1, 65535));
  ASSIGN_OR_RETURN(r.address.host, JsonString(m, "host", kMaxHost));
  r.rank = static_cast<int>(rank);
  r.tp = static_cast<int>(tp);
  r.pp = static_cast<int>(pp);
  r.address.rank = r.rank;
  r.address.port = static_cast<int>(port);
  return r;
}

json WorldJson(const WorldInfo& w) {
  json ranks = json::array();
  for (const RankAddress& r : w.ranks) {
    ranks.push_back({{"rank", r.rank}, {"host", r.host}, {"port", r.port}});
  }
  json blobs = json::array();
  for (const std::string& b : w.blobs) blobs.push_back(absl::Base64Escape(b));
  return {{"type", "world"}, {"ranks", ranks}, {"blobs", blobs}};
}

absl::StatusOr<WorldInfo> WorldFromJson(const json& m, int world_size) {
  auto ranks = m.find("ranks");
  auto blobs = m.find("blobs");
  if (ranks == m.end() || !ranks->is_array() || blobs == m.end() || !blobs->is_array() ||
      static_cast<int>(ranks->size()) != world_size) {
    return absl::DataLossError(
        absl::StrCat("rendezvous: the world is malformed or does not hold ", world_size, " ranks"));
  }
  WorldInfo info;
  for (const json& r : *ranks) {
    if (!r.is_object()) return absl::DataLossError("rendezvous: a rank entry is not an object");
    RankAddress a;
    ASSIGN_OR_RETURN(int64_t rank, JsonInt(r, "rank", 0, world_size - 1));
    ASSIGN_OR_RETURN(int64_t port, JsonInt(r, "port", 0, 65535));
    ASSIGN_OR_RETURN(a.host, JsonString(r, "host", kMaxHost));
    if (rank != static_cast<int64_t>(info.ranks.size())) {
      return absl::DataLossError("rendezvous: the world's ranks are out of order");
    }
    a.rank = static_cast<int>(rank);
    a.port = static_cast<int>(port);
    info.ranks.push_back(std::move(a));
  }
  for (const json& b : *blobs) {
    std::string raw;
    if (!b.is_string() || !absl::Base64Unescape(b.get<std::string>(), &raw)) {
      return absl::DataLossError("rendezvous: a blob is not base64");
    }
    info.blobs.push_back(std::move(raw));
  }
  return info;
}

}  // namespace

absl::StatusOr<RendezvousServer> RendezvousServer::Listen(const std::string& host, int port,
                                                          std::string secret) {
  if (secret.size() < kMinSecretBytes) {
    return absl::FailedPreconditionError("the rendezvous needs the replica's secret");
  }
  ASSIGN_OR_RETURN(Socket s, shardserve::Listen(host, port));
  return RendezvousServer(std::move(s), std::move(secret));
}

absl::StatusOr<WorldInfo> RendezvousServer::Run(const WorldConfig& world, const RankAddress& self,
                                                const std::vector<std::string>& blobs,
                                                std::chrono::milliseconds timeout) {
  return RunMakingBlobs(
      world, self,
      [&blobs](const std::vector<RankAddress>&) -> absl::StatusOr<std::vector<std::string>> {
        return blobs;
      },
      timeout);
}

absl::StatusOr<WorldInfo> RendezvousServer::RunMakingBlobs(const WorldConfig& world,
                                                           const RankAddress& self,
                                                           const BlobMaker& make_blobs,
                                                           std::chrono::milliseconds timeout,
                                                           const Waiting& waiting) {
  const int n = world.world_size();
  WorldInfo info;
  info.ranks.resize(n);
  info.ranks[0] = self;
  struct Joined {
    absl::Mutex mu;
    std::map<int, Socket> sockets ABSL_GUARDED_BY(mu);
  } joining;
  const Deadline deadline = Clock::now() + timeout;
  auto missing_of = [&](const std::map<int, Socket>& joined) {
    std::string missing;
    for (int r = 1; r < n; ++r) {
      if (!joined.count(r))
        absl::StrAppend(&missing, missing.empty() ? "" : ", ", world.Describe(r));
    }
    return missing;
  };
  if (waiting) waiting(missing_of({}));
  // Each proven connection registers; a refusal tells the rank why.
  auto admit = [&](uint32_t claim, Socket& conn) {
    auto msg = ReadMessage(conn, kMaxRegistration, std::min(deadline, Clock::now() + kHandshake));
    std::string refusal;
    absl::StatusOr<Registration> r =
        msg.ok() ? ReadRegistration(*msg) : absl::StatusOr<Registration>(msg.status());
    absl::MutexLock lock(&joining.mu);
    if (!r.ok()) {
      refusal = absl::StrCat("a malformed registration: ", r.status().message());
    } else if (r->tp != world.tp() || r->pp != world.pp()) {
      refusal = absl::StrCat("rank ", r->rank, " runs tp ", r->tp, " x pp ", r->pp,
                             " but the leader runs tp ", world.tp(), " x pp ", world.pp());
    } else if (r->rank < 1 || r->rank >= n) {
      refusal = absl::StrCat("rank ", r->rank, " is outside the world of ", n);
    } else if (static_cast<uint32_t>(r->rank) != claim) {
      refusal = absl::StrCat("the connection proved rank ", claim, " but registers rank ", r->rank);
    } else if (joining.sockets.count(r->rank)) {
      refusal = absl::StrCat(world.Describe(r->rank), " registered twice");
    }
    if (!refusal.empty()) {
      (void)WriteMessage(conn, {{"type", "error"}, {"message", refusal}});
      return false;
    }
    info.ranks[r->rank] = r->address;
    joining.sockets.emplace(r->rank, std::move(conn));
    if (waiting) waiting(missing_of(joining.sockets));
    return true;
  };
  absl::Status s = AcceptVerified(listener_, secret_, kContext, n - 1, deadline, kHandshake, admit);
  std::map<int, Socket> joined;  // AcceptVerified has joined its threads
  {
    absl::MutexLock lock(&joining.mu);
    joined = std::move(joining.sockets);
  }
  if (!s.ok()) {
    const absl::Status late = absl::DeadlineExceededError(absl::StrCat(
        "rendezvous: ", missing_of(joined), " did not register within ", timeout.count(), " ms"));
    // The ranks that came learn who did not, rather than only that the leader went away.
    const std::string why = absl::StrCat("the leader gave up: ", late.message());
    for (auto& [rank, conn] : joined) {
      (void)WriteMessage(conn, {{"type", "error"}, {"message", why}});
    }
    return late;
  }
  absl::StatusOr<std::vector<std::string>> blobs = make_blobs(info.ranks);
  if (!blobs.ok()) {  // every rank learns why there is no world
    const std::string why = absl::StrCat("the leader failed: ", blobs.status().message());
    for (auto& [rank, conn] : joined) {
      (void)WriteMessage(conn, {{"type", "error"}, {"message", why}});
    }
    return blobs.status();
  }
  info.blobs = *std::move(blobs);
  const json reply = WorldJson(info);
  for (auto& [rank, conn] : joined) {
    if (absl::Status w = WriteMessage(conn, reply); !w.ok()) {
      return absl::UnavailableError(
          absl::StrCat("rendezvous: ", world.Describe(rank), " went away: ", w.message()));
    }
  }
  return info;
}

void RendezvousServer::RefuseAll(const WorldConfig& world, const std::string& why,
                                 std::chrono::milliseconds timeout) {
  const std::string message = absl::StrCat("the leader failed: ", why);
  struct Told {
    absl::Mutex mu;
    std::set<int> ranks ABSL_GUARDED_BY(mu);
  } told;
  const Deadline deadline = Clock::now() + timeout;
  (void)AcceptVerified(listener_, secret_, kContext, world.world_size() - 1, deadline, kHandshake,
                       [&](uint32_t claim, Socket& conn) {
                         (void)ReadMessage(conn, kMaxRegistration,
                                           std::min(deadline, Clock::now() + kHandshake));
                         (void)WriteMessage(conn, {{"type", "error"}, {"message", message}});
                         absl::MutexLock lock(&told.mu);
                         return told.ranks.insert(static_cast<int>(claim)).second;
                       });
}

absl::StatusOr<WorldInfo> JoinRendezvous(const std::string& leader_host, int leader_port,
                                         const WorldConfig& world, const RankAddress& self,
                                         const std::string& secret,
                                         std::chrono::milliseconds timeout) {
  const Deadline deadline = Clock::now() + timeout;
  auto conn = ConnectProven(leader_host, leader_port, secret, kContext,
                            static_cast<uint32_t>(self.rank), deadline, kHandshake);
  if (absl::IsPermissionDenied(conn.status())) {
    return absl::PermissionDeniedError(absl::StrCat("rendezvous with ", leader_host, ":",
                                                    leader_port, ": ", conn.status().message()));
  }
  if (!conn.ok()) {
    return absl::DeadlineExceededError(absl::StrCat(
        "rendezvous: the leader did not listen or prove itself: ", conn.status().message()));
  }
  RETURN_IF_ERROR(WriteMessage(*conn, {{"type", "register"},
                                       {"rank", self.rank},
                                       {"tp", world.tp()},
                                       {"pp", world.pp()},
                                       {"host", self.host},
                                       {"port", self.port}}));
  auto reply = ReadMessage(*conn, kMaxWorld, deadline);
  if (!reply.ok()) {
    return absl::DeadlineExceededError(absl::StrCat(
        "rendezvous: no world from the leader within ", timeout.count(), " ms (",
        reply.status().message(), "; are all ", world.world_size(), " ranks running?)"));
  }
  const json& m = *reply;
  auto type = JsonString(m, "type", 32);
  if (type.ok() && *type == "error") {
    auto message = JsonString(m, "message", 64 << 10);
    return absl::FailedPreconditionError(
        absl::StrCat("rendezvous refused: ", message.ok() ? *message : "(no reason given)"));
  }
  if (!type.ok() || *type != "world") {
    return absl::DataLossError("rendezvous: the leader's answer is neither a world nor a refusal");
  }
  return WorldFromJson(m, world.world_size());
}

}  // namespace shardserve
