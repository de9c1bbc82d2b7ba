#pragma once
// Shared-memory communicator for the ranks of one stage on one host (the TP group).
//
// Member 0 creates a POSIX shared-memory segment, the others attach to it by name; it is unlinked
// as soon as everyone is attached, so nothing outlives the processes. Every member owns two
// slots of `capacity_bytes` (double-buffered by operation, so each collective needs one or two
// barriers, not three) and a point-to-point mailbox. AllReduceSum is a reduce-scatter (member r
// sums partition r of every slot, in member order, so all members get bit-identical results)
// followed by an all-gather. Barriers spin on per-member atomic counters, then yield.
//
// Liveness: a thread in every member stamps a heartbeat in the segment; a member waiting on a
// peer whose heartbeat is older than `peer_timeout` (or that left) fails with Unavailable naming
// it. Not thread-safe (one operation at a time), as Communicator says.
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/communicator.h"

namespace shardserve {

inline constexpr size_t kShmSlotBytes = 8 << 20;
inline constexpr size_t kShmHeaderBytes = 128 << 10;
// The bytes of the segment a group of `members` maps, with slots of `capacity_bytes`: the
// header, then two slots and a mailbox per member (what a pod's /dev/shm must hold).
constexpr size_t ShmSegmentBytes(int members, size_t capacity_bytes = kShmSlotBytes) {
  return kShmHeaderBytes + static_cast<size_t>(members) * ((capacity_bytes + 63) / 64 * 64) * 3;
}

struct ShmOptions {
  std::string name;  // segment name, unique per group (e.g. "/shardserve-<job>-stage1")
  int size = 1;
  int rank = 0;
  size_t capacity_bytes = kShmSlotBytes;  // per slot; larger transfers go in chunks
  std::chrono::milliseconds peer_timeout{2000};
  std::chrono::milliseconds attach_timeout{30000};
  // Names members in messages, e.g. "rank 5 (stage 1, tp 1)"; default "member N".
  std::vector<std::string> member_names;
};

class ShmCommunicator : public Communicator {
 public:
  static absl::StatusOr<std::unique_ptr<ShmCommunicator>> Create(const ShmOptions& options);
  ~ShmCommunicator() override;

  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }
  absl::Status AllReduceSum(float* data, size_t count) override;
  absl::Status AllGather(const float* send, size_t count, float* recv) override;
  absl::Status ReduceScatterSum(const float* send, size_t count, float* recv) override;
  absl::Status Broadcast(void* data, size_t bytes, int root) override;
  absl::Status Send(const void* data, size_t bytes, int peer) override;
  absl::Status Recv(void* data, size_t bytes, int peer) override;
  absl::Status Barrier() override;
  absl::Status Abort(const absl::Status& reason) override;

  struct Header;

 private:
  explicit ShmCommunicator(const ShmOptions& options);
  absl::Status Attach();
  // Waits until every member's arrive counter reaches `target`.
  absl::Status WaitAll(uint64_t target);
  // Waits until `done()` holds, checking `peer`'s liveness (or everyone's when peer < 0).
  template <typename Pred>
  absl::Status WaitUntil(Pred done, int peer);
  absl::Status CheckPeer(int peer) const;
  bool MailboxFree() const;
  std::string Name(int member) const;
  float* Slot(int set, int member) const;
  uint8_t* Mailbox(int member) const;
  // Next slot set; every collective uses one (double buffering).
  int NextSet() { return static_cast<int>(ops_++ % 2); }

  ShmOptions options_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  Header* header_ = nullptr;
  uint8_t* data_ = nullptr;
  uint64_t barriers_ = 0;  // barriers this member has entered
  uint64_t ops_ = 0;
  std::atomic<bool> stop_{false};
  std::thread heartbeat_;
};

}  // namespace shardserve
