#pragma once
// KV transfer between replicas (disaggregated prefill and decode): a rank that holds a prompt's KV
// blocks offers them under a ticket, and a rank of another replica pulls the byte ranges it owns
// straight from it, over UCX (the libucx wheel: TCP and shared memory between hosts' processes,
// RDMA and GPU memory where the machine has them).
//
// The offering side (KvExporter) runs a UCX worker on a thread of its own and answers pulls with
// UCX active messages: a pull names a ticket (32 random bytes the offer was made under, handed to
// the puller through the model's authenticated control path) and byte ranges inside the offer's
// segments; the exporter checks the ticket (in constant time) and the ranges, and sends exactly
// those bytes, gathered from the segments without a copy. Nothing else of the process's memory is
// reachable: no memory is registered for remote access, so a peer that knows the worker's
// address and no ticket reads nothing (UCX's own transports authenticate nobody). Past its
// deadline an offer refuses pulls; it is held until its owner withdraws it, and Withdraw waits
// for the sends in flight, so the memory can be reused.
//
// The pulling side (KvPuller) sends a pull and waits for the bytes, scattered into its
// destinations, within a deadline; a refusal, a peer that dies or a deadline passed comes back as
// an error naming it (the caller then prefills by itself: no request waits on a lost transfer).
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace shardserve {

using KvTicket = std::array<uint8_t, 32>;

// A fresh, unguessable ticket (OpenSSL's RAND_bytes).
absl::StatusOr<KvTicket> NewKvTicket();

// Bytes of this process the exporter may send: a contiguous range it does not own.
struct KvSegment {
  const void* data = nullptr;
  size_t size = 0;
};

// What a puller asks for: `size` bytes at `offset` of segment `segment` of the offer, written to
// `dest` (the puller's memory).
struct KvRange {
  uint32_t segment = 0;
  uint64_t offset = 0;
  uint64_t size = 0;
  void* dest = nullptr;
};

struct KvTransferLimits {
  size_t max_offers = 4096;              // offers held at once
  size_t max_ranges = 1 << 16;           // ranges in one pull
  uint64_t max_pull_bytes = 8ull << 30;  // bytes in one pull
};

class KvExporter {
 public:
  // A UCX context and worker, progressed by a thread of its own.
  static absl::StatusOr<std::unique_ptr<KvExporter>> Create(KvTransferLimits limits = {});
  ~KvExporter();
  KvExporter(const KvExporter&) = delete;
  KvExporter& operator=(const KvExporter&) = delete;

  // The worker's UCX address: what a puller connects to (not a secret; the tickets are).
  const std::string& address() const;

  // Offers `segments` under `ticket`; pulls after `deadline` are refused (Withdraw ends it).
  absl::Status Offer(const KvTicket& ticket, std::vector<KvSegment> segments, absl::Time deadline);
  // Ends an offer; returns once no send of it is in flight (its memory may then be reused).
  // False when there was no such offer (withdrawn already, or expired).
  bool Withdraw(const KvTicket& ticket);
  // Called (on the exporter's thread) when a puller releases an offer it holds: the puller is
  // done with it, and its owner may withdraw it.
  void OnRelease(std::function<void(const KvTicket&)> released);
  // Offers held now (expired ones included, until withdrawn).
  size_t offers() const;
  // Stops answering until Resume (a stalled peer, for tests).
  void PauseForTest();
  void ResumeForTest();

  struct Impl;

 private:
  explicit KvExporter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class KvPuller {
 public:
  static absl::StatusOr<std::unique_ptr<KvPuller>> Create(KvTransferLimits limits = {});
  ~KvPuller();
  KvPuller(const KvPuller&) = delete;
  KvPuller& operator=(const KvPuller&) = delete;

  // Pulls `ranges` of the offer made under `ticket` at the exporter whose address is
  // `exporter_address`, all or nothing (on an error the destinations hold unspecified bytes).
  // PermissionDenied: no offer under that ticket (never made, withdrawn, expired);
  // InvalidArgument: a range outside the offer; DeadlineExceeded; Unavailable: the exporter is
  // unreachable or went away. One pull at a time per puller (calls are serialized).
  absl::Status Pull(const std::string& exporter_address, const KvTicket& ticket,
                    const std::vector<KvRange>& ranges, absl::Duration timeout);
  // Tells the exporter that this side is done with the offer (KvExporter::OnRelease);
  // PermissionDenied when it holds no such offer.
  absl::Status Release(const std::string& exporter_address, const KvTicket& ticket,
                       absl::Duration timeout);

  struct Impl;

 private:
  explicit KvPuller(std::unique_ptr<Impl> impl);
  absl::Status Ask(unsigned am_id, const std::string& exporter_address, const KvTicket& ticket,
                   const std::vector<KvRange>& ranges, absl::Duration timeout);
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardserve
