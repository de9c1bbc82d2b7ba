#pragma once
// One interface for the collectives and point-to-point transfers between ranks; backends:
// shared memory (the TP group of one stage on one host), TCP (pipeline links across nodes, and a
// fallback) and NCCL (GPUs). A communicator covers a group of `size()` members numbered
// 0..size()-1; it is passed to the code that uses it (never global) and is not thread-safe: one
// operation at a time, issued in the same order by every member.
//
// A member that dies or stops answering makes every operation fail (never hang) with
// Unavailable naming it, within the backend's peer timeout.
#include <cstddef>

#include "absl/status/status.h"

namespace shardserve {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // In place: data[i] = sum over members of their data[i].
  virtual absl::Status AllReduceSum(float* data, size_t count) = 0;
  // recv = the `count` floats of member 0, then of member 1, ... (size() * count floats).
  virtual absl::Status AllGather(const float* send, size_t count, float* recv) = 0;
  // send holds size() * count floats; recv gets the sum over members of send's part rank().
  virtual absl::Status ReduceScatterSum(const float* send, size_t count, float* recv) = 0;
  // Every member ends with root's `bytes` bytes.
  virtual absl::Status Broadcast(void* data, size_t bytes, int root) = 0;
  // Blocking point-to-point; the receiver names the sender and the exact size.
  virtual absl::Status Send(const void* data, size_t bytes, int peer) = 0;
  virtual absl::Status Recv(void* data, size_t bytes, int peer) = 0;
  virtual absl::Status Barrier() = 0;
  // Gives up: tells every member why (best effort), so that they report this cause rather than
  // only "a member left". Returns `reason`.
  virtual absl::Status Abort(const absl::Status& reason) = 0;
};

}  // namespace shardserve
