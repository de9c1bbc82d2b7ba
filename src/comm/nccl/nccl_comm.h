#pragma once
// NCCL communicator behind the common Communicator interface (built with SHARDSERVE_CUDA).
// Every data pointer is device memory of this rank's GPU. The communicator is nonblocking: its
// creation and each operation are polled with ncclCommGetAsyncError, which reports a failed peer,
// and the wait is bounded (a watchdog): a creation that does not complete within `init_timeout`
// (a member never joined) or an operation that does not complete within `timeout` aborts the
// communicator (ncclCommAbort), so a dead peer is named in seconds instead of hanging in a
// collective until NCCL's own timeout.
// nccl.h stays out of this header: the unique id travels as opaque bytes (the leader creates it
// and hands it out over the rendezvous as a blob).
#include <array>
#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "comm/communicator.h"

namespace shardserve::nccl {

struct UniqueId {
  std::array<char, 128> bytes{};  // NCCL_UNIQUE_ID_BYTES

  std::string ToBlob() const { return std::string(bytes.data(), bytes.size()); }
  static absl::StatusOr<UniqueId> FromBlob(const std::string& blob);
};

std::string Version();  // e.g. "2.28.9"
absl::StatusOr<UniqueId> NewUniqueId();

class NcclCommunicator : public Communicator {
 public:
  // Joins the communicator of `nranks` ranks identified by `id` as `rank`, on CUDA `device`.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(
      const UniqueId& id, int nranks, int rank, int device,
      std::chrono::milliseconds timeout = std::chrono::milliseconds(5000),
      std::chrono::milliseconds init_timeout = std::chrono::milliseconds(60000));
  ~NcclCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return nranks_; }
  absl::Status AllReduceSum(float* data, size_t count) override;
  absl::Status AllGather(const float* send, size_t count, float* recv) override;
  absl::Status ReduceScatterSum(const float* send, size_t count, float* recv) override;
  absl::Status Broadcast(void* data, size_t bytes, int root) override;
  absl::Status Send(const void* data, size_t bytes, int peer) override;
  absl::Status Recv(void* data, size_t bytes, int peer) override;
  absl::Status Barrier() override;
  absl::Status Abort(const absl::Status& reason) override;

 private:
  struct Handle;
  NcclCommunicator(std::unique_ptr<Handle> h, int rank, int nranks,
                   std::chrono::milliseconds timeout);
  // Checks the enqueue result, then waits for the stream with the watchdog.
  absl::Status Finish(int enqueue_result, const char* what);

  std::unique_ptr<Handle> handle_;
  int rank_, nranks_;
  std::chrono::milliseconds timeout_;
  bool aborted_ = false;
};

}  // namespace shardserve::nccl
