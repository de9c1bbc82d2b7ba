#pragma once
// Rendezvous of one replica's ranks at the leader (stage 0, tp 0), DESIGN.md §4.
//
// The leader listens on the rendezvous port (the pod's own address; loopback locally); every
// other rank connects (retrying until the leader *listens*, not only resolves), proves the
// replica's secret (comm/handshake.h: the leader proves it back, so a rank never takes a world
// from an impostor), registers its data address, and receives the world: every rank's address and
// the opaque blobs the leader hands out (NCCL unique ids). The leader replies only when all ranks
// have registered, so all start together. Timeouts name the missing ranks; a rank from another
// world shape, out of range, registered twice, or whose registration is not the one it proved is
// refused with the reason. Connections that cannot prove the secret are dropped and never delay
// the others. Every message is a length-prefixed JSON object, parsed without exceptions, its
// size bounded, each field's type checked.
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/socket.h"
#include "comm/world.h"

namespace shardserve {

struct RankAddress {
  int rank = 0;
  std::string host;
  int port = 0;  // the rank's data (TCP communicator) port
};

struct WorldInfo {
  std::vector<RankAddress> ranks;  // indexed by rank
  std::vector<std::string> blobs;  // handed out by the leader, e.g. NCCL unique ids
};

class RendezvousServer {
 public:
  // Listens on host:port ("" every address) for ranks that know `secret`.
  static absl::StatusOr<RendezvousServer> Listen(const std::string& host, int port,
                                                 std::string secret);
  int port() const { return listener_.port(); }
  // Collects every other rank's registration, then sends the world to all.
  absl::StatusOr<WorldInfo> Run(const WorldConfig& world, const RankAddress& self,
                                const std::vector<std::string>& blobs,
                                std::chrono::milliseconds timeout);
  // The same, with blobs made once every rank's address is known (e.g. NCCL ids only for the
  // links that will use NCCL); an error from `make_blobs` is returned, and every rank gets it
  // instead of the world. `waiting`, when set, is told the ranks still missing ("stage 1 tp 0,
  // stage 1 tp 1") at the start and after each registration, from any thread.
  using BlobMaker =
      std::function<absl::StatusOr<std::vector<std::string>>(const std::vector<RankAddress>&)>;
  using Waiting = std::function<void(const std::string& missing)>;
  absl::StatusOr<WorldInfo> RunMakingBlobs(const WorldConfig& world, const RankAddress& self,
                                           const BlobMaker& make_blobs,
                                           std::chrono::milliseconds timeout,
                                           const Waiting& waiting = {});
  // The leader failed before it could run the replica: every rank that registers within
  // `timeout` is told `why` at once, rather than waiting for a world that will not come.
  // Returns when every other rank has been told, or at the timeout.
  void RefuseAll(const WorldConfig& world, const std::string& why,
                 std::chrono::milliseconds timeout);

 private:
  RendezvousServer(Socket listener, std::string secret)
      : listener_(std::move(listener)), secret_(std::move(secret)) {}
  Socket listener_;
  std::string secret_;
};

// Joins the leader's rendezvous as `self`; the world, or the leader's refusal (FailedPrecondition
// with its reason), PermissionDenied when the secrets differ, DeadlineExceeded at `timeout`.
absl::StatusOr<WorldInfo> JoinRendezvous(const std::string& leader_host, int leader_port,
                                         const WorldConfig& world, const RankAddress& self,
                                         const std::string& secret,
                                         std::chrono::milliseconds timeout);

}  // namespace shardserve
