#include "comm/rendezvous.h"

#include <map>
#include <nlohmann/json.hpp>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardserve {
namespace {

using json = nlohmann::json;
constexpr uint32_t kMaxMessage = 16 << 20;

absl::Status WriteMessage(Socket& s, const json& j) {
  const std::string body = j.dump();
  const uint32_t len = static_cast<uint32_t>(body.size());
  RETURN_IF_ERROR(s.WriteAll(&len, sizeof(len)));
  return s.WriteAll(body.data(), body.size());
}

absl::StatusOr<json> ReadMessage(Socket& s, std::chrono::milliseconds idle) {
  uint32_t len;
  RETURN_IF_ERROR(s.ReadAll(&len, sizeof(len), idle));
  if (len > kMaxMessage) return absl::DataLossError(absl::StrCat("message of ", len, " bytes"));
  std::string body(len, '\0');
  RETURN_IF_ERROR(s.ReadAll(body.data(), len, idle));
  try {
    return json::parse(body);
  } catch (const json::exception& e) {
    return absl::DataLossError(absl::StrCat("malformed rendezvous message: ", e.what()));
  }
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

}  // namespace

absl::StatusOr<RendezvousServer> RendezvousServer::Listen(const std::string& host, int port) {
  ASSIGN_OR_RETURN(Socket s, shardserve::Listen(host, port));
  return RendezvousServer(std::move(s));
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
                                                           std::chrono::milliseconds timeout) {
  const int n = world.world_size();
  WorldInfo info;
  info.ranks.resize(n);
  info.ranks[0] = self;
  std::map<int, Socket> joined;
  const Deadline deadline = std::chrono::steady_clock::now() + timeout;
  while (static_cast<int>(joined.size()) < n - 1) {
    auto conn = Accept(listener_, deadline);
    if (!conn.ok()) {
      std::string missing;
      for (int r = 1; r < n; ++r) {
        if (!joined.count(r))
          absl::StrAppend(&missing, missing.empty() ? "" : ", ", world.Describe(r));
      }
      return absl::DeadlineExceededError(absl::StrCat(
          "rendezvous: ", missing, " did not register within ", timeout.count(), " ms"));
    }
    auto msg = ReadMessage(*conn, std::chrono::milliseconds(5000));
    if (!msg.ok()) continue;  // not a rank (a probe, a stray connection)
    const json& m = *msg;
    std::string refusal;
    const int rank = m.value("rank", -1);
    if (m.value("type", "") != "register") {
      refusal = "expected a registration";
    } else if (m.value("tp", 0) != world.tp() || m.value("pp", 0) != world.pp()) {
      refusal =
          absl::StrCat("rank ", rank, " runs tp ", m.value("tp", 0), " x pp ", m.value("pp", 0),
                       " but the leader runs tp ", world.tp(), " x pp ", world.pp());
    } else if (rank < 1 || rank >= n) {
      refusal = absl::StrCat("rank ", rank, " is outside the world of ", n);
    } else if (joined.count(rank)) {
      refusal = absl::StrCat(world.Describe(rank), " registered twice");
    }
    if (!refusal.empty()) {
      (void)WriteMessage(*conn, {{"type", "error"}, {"message", refusal}});
      continue;
    }
    info.ranks[rank] = {rank, m.value("host", ""), m.value("port", 0)};
    joined.emplace(rank, std::move(*conn));
  }
  absl::StatusOr<std::vector<std::string>> blobs = make_blobs(info.ranks);
  if (!blobs.ok()) {  // every rank learns why there is no world
    const std::string why = absl::StrCat("the leader failed: ", blobs.status().message());
    for (auto& [rank, conn] : joined)
      (void)WriteMessage(conn, {{"type", "error"}, {"message", why}});
    return blobs.status();
  }
  info.blobs = *std::move(blobs);
  const json reply = WorldJson(info);
  for (auto& [rank, conn] : joined) {
    if (absl::Status s = WriteMessage(conn, reply); !s.ok()) {
      return absl::UnavailableError(
          absl::StrCat("rendezvous: ", world.Describe(rank), " went away: ", s.message()));
    }
  }
  return info;
}

absl::StatusOr<WorldInfo> JoinRendezvous(const std::string& leader_host, int leader_port,
                                         const WorldConfig& world, const RankAddress& self,
                                         std::chrono::milliseconds timeout) {
  const Deadline deadline = std::chrono::steady_clock::now() + timeout;
  auto conn = ConnectWithRetry(leader_host, leader_port, deadline);
  if (!conn.ok()) {
    return absl::DeadlineExceededError(
        absl::StrCat("rendezvous: the leader did not listen: ", conn.status().message()));
  }
  RETURN_IF_ERROR(WriteMessage(*conn, {{"type", "register"},
                                       {"rank", self.rank},
                                       {"tp", world.tp()},
                                       {"pp", world.pp()},
                                       {"host", self.host},
                                       {"port", self.port}}));
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  auto reply = ReadMessage(*conn, std::max(left, std::chrono::milliseconds(1)));
  if (!reply.ok()) {
    return absl::DeadlineExceededError(absl::StrCat(
        "rendezvous: no world from the leader within ", timeout.count(), " ms (",
        reply.status().message(), "; are all ", world.world_size(), " ranks running?)"));
  }
  const json& m = *reply;
  if (m.value("type", "") == "error") {
    return absl::FailedPreconditionError(
        absl::StrCat("rendezvous refused: ", m.value("message", "")));
  }
  WorldInfo info;
  try {
    for (const json& r : m.at("ranks")) {
      info.ranks.push_back(
          {r.at("rank").get<int>(), r.at("host").get<std::string>(), r.at("port").get<int>()});
    }
    for (const json& b : m.at("blobs")) {
      std::string raw;
      if (!absl::Base64Unescape(b.get<std::string>(), &raw)) {
        return absl::DataLossError("rendezvous: a blob is not base64");
      }
      info.blobs.push_back(std::move(raw));
    }
  } catch (const json::exception& e) {
    return absl::DataLossError(absl::StrCat("rendezvous: malformed world: ", e.what()));
  }
  if (static_cast<int>(info.ranks.size()) != world.world_size()) {
    return absl::DataLossError("rendezvous: the world has the wrong number of ranks");
  }
  return info;
}

}  // namespace shardserve
