#pragma once
// What a leader tells a router of its replica's prefix cache (DESIGN.md §1): the names of the KV
// blocks it caches as they are stored and evicted, and its load, so that a router sends a request
// to the replica that already holds its prompt's blocks from the leaders' own reports, not from
// guesses.
//
// The leader's engine applies each step's events to a KvEventLog; every subscriber (a router's
// stream, GET /v1/kv-events) starts from a snapshot of every cached name and then reads the
// events after it. A subscriber that falls behind the log's backlog is told to start again from
// a new snapshot, so it never misses an eviction.
//
// The stream is newline-delimited JSON, one message a line (at most kMaxKvEventLine bytes):
//   {"type":"hello","model":M,"block_size":B,"epoch":E}   first; E names this leader's run
//   {"type":"snapshot","hashes":[...],"last":bool}         the cached names, in pieces
//   {"type":"stored","hashes":[...]} {"type":"removed","hashes":[...]}
//   {"type":"reset"}                                        a new snapshot follows
//   {"type":"load","waiting":W,"running":R,"max_batch":N,"kv_used":U,"kv_blocks":K}
// A name is the block's BlockHash (serve/prefix_cache.h) in 32 hex digits.
#include <chrono>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "serve/prefix_cache.h"

namespace shardserve {

inline constexpr size_t kMaxKvEventLine = 1 << 20;
inline constexpr size_t kKvHashesPerMessage = 4096;

using BlockHashSet = absl::flat_hash_set<BlockHash, BlockHashHasher>;

// Thread-safe: the engine's thread applies, any number of subscribers read.
class KvEventLog {
 public:
  explicit KvEventLog(size_t max_backlog = 1 << 16) : max_backlog_(max_backlog) {}

  void Apply(const std::vector<KvEvent>& events);

  // Every cached name, and the position in the log it is valid at.
  std::vector<BlockHash> Snapshot(uint64_t* position) const;
  // The events after `position` (waiting up to `timeout` for one), advancing it; false when
  // `position` fell out of the backlog (start again from a snapshot).
  bool Since(uint64_t* position, std::chrono::milliseconds timeout,
             std::vector<KvEvent>* events) const;

 private:
  const size_t max_backlog_;
  mutable absl::Mutex mu_;
  BlockHashSet cached_ ABSL_GUARDED_BY(mu_);
  std::deque<KvEvent> backlog_ ABSL_GUARDED_BY(mu_);
  uint64_t first_ ABSL_GUARDED_BY(mu_) = 0;  // the position of backlog_.front()
};

// The replica's load as a leader reports it.
struct ReplicaLoad {
  int64_t waiting = 0, running = 0, max_batch = 0, kv_used = 0, kv_blocks = 0;
  bool accepting = true;  // false while the replica drains: nothing new is sent to it
  // LoRA (issue 54): its adapter slots (0: it serves the base alone) and the adapters in them,
  // which a request of theirs runs at once (any other waits for a slot to be filled).
  int64_t max_loras = 0;
  std::vector<std::string> adapters = {};
};
inline constexpr size_t kMaxKvLoadAdapters = 1024;

// One message of the stream, decoded.
struct KvMessage {
  enum class Type { kHello, kSnapshot, kStored, kRemoved, kReset, kLoad } type = Type::kHello;
  std::string model, epoch;
  int64_t block_size = 0;
  std::vector<BlockHash> hashes;
  bool last = false;  // snapshot: its last piece
  ReplicaLoad load;
};

std::string HashHex(const BlockHash& h);
std::string EncodeKvHello(const std::string& model, int64_t block_size, const std::string& epoch);
// Snapshot pieces of at most kKvHashesPerMessage names (one, empty, when there are none).
std::vector<std::string> EncodeKvSnapshot(const std::vector<BlockHash>& hashes);
// The events as stored / removed messages, in order (runs of one kind in one message).
std::vector<std::string> EncodeKvEvents(const std::vector<KvEvent>& events);
std::string EncodeKvReset();
std::string EncodeKvLoad(const ReplicaLoad& load);
// One line (without its newline); a malformed one is DataLoss naming what is wrong.
absl::StatusOr<KvMessage> DecodeKvMessage(const std::string& line);

}  // namespace shardserve
