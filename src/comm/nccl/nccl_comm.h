#pragma once
// NCCL communicator (built with SHARDSERVE_CUDA). nccl.h stays out of this header: the unique id
// travels as opaque bytes (the leader creates it and hands it out over the rendezvous), the
// communicator handle is hidden behind a pointer. RAII, non-copyable.
#include <array>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace shardserve::nccl {

struct UniqueId {
  std::array<char, 128> bytes{};  // NCCL_UNIQUE_ID_BYTES
};

std::string Version();  // e.g. "2.28.9"
absl::StatusOr<UniqueId> NewUniqueId();

class Communicator {
 public:
  // Joins the communicator of `nranks` ranks identified by `id` as `rank`, on CUDA `device`.
  static absl::StatusOr<std::unique_ptr<Communicator>> Create(const UniqueId& id, int nranks,
                                                              int rank, int device);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // In-place sum over all ranks of `count` floats at device pointer `data`; waits for it.
  absl::Status AllReduceSum(float* data, size_t count);
  int rank() const { return rank_; }
  int size() const { return nranks_; }

 private:
  struct Handle;
  Communicator(std::unique_ptr<Handle> h, int rank, int nranks);
  std::unique_ptr<Handle> handle_;
  int rank_, nranks_;
};

}  // namespace shardserve::nccl
