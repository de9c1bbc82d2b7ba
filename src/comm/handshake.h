#pragma once
// Mutual proof of a replica's shared secret on a fresh TCP connection (DESIGN.md §4, trust): the
// rendezvous and the ranks' TCP mesh admit only peers that know the per-replica secret, so
// nothing else on the network can join a replica, pose as a rank or learn its NCCL ids.
//
// HMAC-SHA256 challenge and response, both ways, bound to a context (what the connection is for)
// and to what the connector claims to be (its rank or member index):
//   acceptor  -> connector   "SSHS", version, nonce_a (32 random bytes)
//   connector -> acceptor    nonce_c, claim (u32), HMAC(secret, "connector" ctx nonce_a nonce_c
//   claim) acceptor  -> connector   verdict (0 proven, 1 refused), HMAC(secret, "acceptor" ctx ...
//   claim)
// Fresh nonces on both sides defeat a replay; the two labels defeat reflection; digests are
// compared in constant time; every read ends at the deadline, however slowly bytes trickle.
// Nothing is encrypted: what follows is readable on the wire (as NCCL's own traffic is), but only
// the two proven ends take part in it.
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "comm/socket.h"

namespace shardserve {

// A secret has at least this many bytes.
inline constexpr size_t kMinSecretBytes = 16;

// Reads the secret of a file (SHARDSERVE_RENDEZVOUS_SECRET_FILE; surrounding whitespace
// trimmed). Errors name the file and what is wrong.
absl::StatusOr<std::string> ReadSecretFile(const std::string& path);
// `bytes` random bytes, hex-encoded (a secret for `shardserve local` and the operator).
absl::StatusOr<std::string> NewSecret(size_t bytes = 32);

// A fresh secret in a file only this user can read (a private temporary directory,
// shardserve-secret-<pid>-XXXXXX), for the ranks that `shardserve local` and `shardserve
// generate` start; removed with the object, and, when its process was killed first, by the next
// Create.
class SecretFile {
 public:
  static absl::StatusOr<SecretFile> Create();
  SecretFile(SecretFile&& o) noexcept : dir_(std::move(o.dir_)) { o.dir_.clear(); }
  SecretFile& operator=(SecretFile&&) = delete;
  ~SecretFile();
  std::string path() const { return dir_ + "/secret"; }

 private:
  explicit SecretFile(std::string dir) : dir_(std::move(dir)) {}
  std::string dir_;
};

// Connector side: proves `claim` and checks that the acceptor knows the secret too.
// PermissionDenied when the acceptor refused the proof or could not prove the secret itself
// (secrets differ, or an impostor); Unavailable / DeadlineExceeded when the connection failed.
absl::Status ProveToAcceptor(Socket& s, const std::string& secret, std::string_view context,
                             uint32_t claim, Deadline deadline);
// Connects to host:port (retrying until it listens) and proves `claim`, again with backoff while
// the acceptor is busy with others, until `deadline`; each handshake within `handshake_timeout`.
// The proven connection, PermissionDenied when the secrets differ (or the peer is an impostor),
// DeadlineExceeded saying what failed last.
absl::StatusOr<Socket> ConnectProven(const std::string& host, int port, const std::string& secret,
                                     std::string_view context, uint32_t claim, Deadline deadline,
                                     std::chrono::milliseconds handshake_timeout);
// Acceptor side: the connector's claim once it proved the secret (it is told either way).
absl::StatusOr<uint32_t> VerifyConnector(Socket& s, const std::string& secret,
                                         std::string_view context, Deadline deadline);

// Reads exactly `bytes` before `deadline`.
absl::Status ReadBefore(Socket& s, void* data, size_t bytes, Deadline deadline);

// Accepts connections on `listener` and verifies each (VerifyConnector within
// `handshake_timeout`) on a thread of its own, so a connection that says nothing, or trickles,
// delays no one: at most kMaxPending are verified at once, and a newcomer closes the oldest.
// `admit` gets each proven connection with its claim, on that thread (it synchronizes what it
// shares), and returns whether it counts. Returns once `want` connections counted, or
// DeadlineExceeded at `deadline`, or when `stop()` turns true (Cancelled). Every thread has ended
// when it returns.
inline constexpr int kMaxPending = 32;
using AdmitFn = std::function<bool(uint32_t claim, Socket& conn)>;
absl::Status AcceptVerified(const Socket& listener, const std::string& secret,
                            std::string_view context, int want, Deadline deadline,
                            std::chrono::milliseconds handshake_timeout, const AdmitFn& admit,
                            const std::function<bool()>& stop = nullptr);

}  // namespace shardserve
