#pragma once
// A Communicator that forwards to another and reports every operation's name, duration and the
// bytes this member contributed (for metrics), without the backends knowing about metrics.
#include <chrono>
#include <functional>

#include "comm/communicator.h"

namespace shardserve {

class ObservedCommunicator : public Communicator {
 public:
  using Observer = std::function<void(const char* op, double seconds, size_t bytes)>;
  ObservedCommunicator(Communicator* inner, Observer observer)
      : inner_(inner), observer_(std::move(observer)) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::Status AllReduceSum(float* data, size_t count) override {
    return Timed("all_reduce", count * sizeof(float),
                 [&] { return inner_->AllReduceSum(data, count); });
  }
  absl::Status AllGather(const float* send, size_t count, float* recv) override {
    return Timed("all_gather", count * sizeof(float),
                 [&] { return inner_->AllGather(send, count, recv); });
  }
  absl::Status ReduceScatterSum(const float* send, size_t count, float* recv) override {
    return Timed("reduce_scatter", count * size() * sizeof(float),
                 [&] { return inner_->ReduceScatterSum(send, count, recv); });
  }
  absl::Status Broadcast(void* data, size_t bytes, int root) override {
    return Timed("broadcast", bytes, [&] { return inner_->Broadcast(data, bytes, root); });
  }
  absl::Status Send(const void* data, size_t bytes, int peer) override {
    return Timed("send", bytes, [&] { return inner_->Send(data, bytes, peer); });
  }
  absl::Status Recv(void* data, size_t bytes, int peer) override {
    return Timed("recv", bytes, [&] { return inner_->Recv(data, bytes, peer); });
  }
  absl::Status Barrier() override {
    return Timed("barrier", 0, [&] { return inner_->Barrier(); });
  }
  absl::Status Abort(const absl::Status& reason) override { return inner_->Abort(reason); }

 private:
  template <typename F>
  absl::Status Timed(const char* op, size_t bytes, F&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s = f();
    observer_(op, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
              bytes);
    return s;
  }

  Communicator* inner_;
  Observer observer_;
};

}  // namespace shardserve
