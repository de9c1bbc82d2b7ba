#pragma once
// TCP communicator: pipeline links between stages (on different nodes) and the fallback for any
// group. Members form a full mesh (each connects to the lower-numbered members and accepts the
// higher ones, retrying until they listen); every connection proves the group's secret both ways
// (comm/handshake.h), so nothing else on the network can pose as a member or take one's place,
// and a connection that says nothing delays no one. Messages are framed; a thread sends heartbeat
// frames on idle links, so a receiver that hears nothing for `peer_timeout` names the peer as
// stopped, and a closed connection names it as dead. Collectives are rings (reduce-scatter,
// all-gather) whose send and receive run concurrently, so large transfers cannot deadlock.
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "comm/communicator.h"
#include "comm/socket.h"

namespace shardserve {

struct TcpMember {
  std::string host;
  int port = 0;
  std::string name;  // for messages, e.g. "rank 3 (stage 1, tp 1)"
};

struct TcpOptions {
  std::vector<TcpMember> members;
  int rank = 0;
  uint64_t group_id = 0;  // members of other groups that connect by mistake are refused
  std::string secret;     // every member proves it (at least kMinSecretBytes)
  std::chrono::milliseconds peer_timeout{2000};
  std::chrono::milliseconds connect_timeout{30000};
  // Last resort for a sender blocked on a frozen receiver's full buffer. Receivers detect a
  // frozen peer within peer_timeout and exit, which resets their connections, so this only
  // fires when nothing else does; it must exceed the longest time a live receiver may be busy.
  std::chrono::milliseconds send_timeout{60000};
};

class TcpCommunicator : public Communicator {
 public:
  // `listener` listens on members[rank].port (bind it first, so others can connect at once).
  static absl::StatusOr<std::unique_ptr<TcpCommunicator>> Create(const TcpOptions& options,
                                                                 Socket listener);
  ~TcpCommunicator() override;

  int rank() const override { return options_.rank; }
  int size() const override { return static_cast<int>(options_.members.size()); }
  absl::Status AllReduceSum(float* data, size_t count) override;
  absl::Status AllGather(const float* send, size_t count, float* recv) override;
  absl::Status ReduceScatterSum(const float* send, size_t count, float* recv) override;
  absl::Status Broadcast(void* data, size_t bytes, int root) override;
  absl::Status Send(const void* data, size_t bytes, int peer) override;
  absl::Status Recv(void* data, size_t bytes, int peer) override;
  absl::Status Barrier() override;
  absl::Status Abort(const absl::Status& reason) override;

 private:
  struct Peer {
    Socket sock;
    absl::Mutex write_mu;  // whole frames only
    std::atomic<int64_t> last_write_ms{0};
  };
  explicit TcpCommunicator(const TcpOptions& options);
  absl::Status Connect(Socket listener);
  absl::Status WriteFrame(int peer, uint32_t type, const void* data, size_t bytes);
  absl::Status RecvFrame(void* data, size_t bytes, int peer);
  absl::Status Fail(int peer, const absl::Status& s) const;
  // Sends to `to` while receiving from `from`.
  absl::Status SendRecv(const void* send, size_t send_bytes, int to, void* recv, size_t recv_bytes,
                        int from);
  // Ring over blocks [offsets[b], offsets[b+1]) of data: afterwards block rank() holds the sum.
  absl::Status RingReduceScatter(float* data, const std::vector<size_t>& offsets);
  // Ring over blocks: afterwards every member has every block (each starts with its own).
  absl::Status RingAllGather(float* data, const std::vector<size_t>& offsets);

  TcpOptions options_;
  std::vector<std::unique_ptr<Peer>> peers_;  // indexed by member; null for self
  std::atomic<bool> stop_{false};
  bool aborted_ = false;
  std::thread heartbeat_;
};

}  // namespace shardserve
