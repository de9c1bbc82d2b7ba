#include "comm/nccl/nccl_comm.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"

namespace shardserve::nccl {
namespace {

static_assert(sizeof(ncclUniqueId) == sizeof(UniqueId::bytes), "NCCL unique id size changed");

absl::Status NcclError(ncclResult_t r, const char* what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", ncclGetErrorString(r)));
}

// Polls a nonblocking communicator until the call in progress on it is done: OK once its state is
// ncclSuccess, the error if it failed, Unavailable at the deadline. The caller aborts on error.
absl::Status Settle(ncclComm_t comm, const char* what,
                    std::chrono::steady_clock::time_point deadline,
                    std::chrono::milliseconds limit) {
  for (;;) {
    ncclResult_t state = ncclSuccess;
    if (ncclResult_t r = ncclCommGetAsyncError(comm, &state); r != ncclSuccess) {
      return NcclError(r, what);
    }
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress)
      return NcclError(state, absl::StrCat(what, " (a peer failed)").c_str());
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::UnavailableError(absl::StrCat(what, " did not complete within ", limit.count(),
                                                 " ms: a peer never joined or stopped answering"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace

struct NcclCommunicator::Handle {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  float* scratch = nullptr;  // one float for Barrier
};

absl::StatusOr<UniqueId> UniqueId::FromBlob(const std::string& blob) {
  UniqueId id;
  if (blob.size() != id.bytes.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("an NCCL unique id has ", id.bytes.size(), " bytes, not ", blob.size()));
  }
  std::memcpy(id.bytes.data(), blob.data(), blob.size());
  return id;
}

std::string Version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  return absl::StrCat(v / 10000, ".", (v / 100) % 100, ".", v % 100);
}

absl::StatusOr<UniqueId> NewUniqueId() {
  ncclUniqueId id;
  if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
    return NcclError(r, "ncclGetUniqueId");
  }
  UniqueId out;
  std::memcpy(out.bytes.data(), &id, sizeof(id));
  return out;
}

NcclCommunicator::NcclCommunicator(std::unique_ptr<Handle> h, int rank, int nranks,
                                   std::chrono::milliseconds timeout)
    : handle_(std::move(h)), rank_(rank), nranks_(nranks), timeout_(timeout) {}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    const UniqueId& id, int nranks, int rank, int device, std::chrono::milliseconds timeout,
    std::chrono::milliseconds init_timeout) {
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("cudaSetDevice(", device, "): ", cudaGetErrorString(e)));
  }
  auto h = std::make_unique<Handle>();
  if (cudaError_t e = cudaStreamCreate(&h->stream); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaStreamCreate: ", cudaGetErrorString(e)));
  }
  if (cudaError_t e = cudaMalloc(&h->scratch, sizeof(float)); e != cudaSuccess) {
    cudaStreamDestroy(h->stream);
    return absl::ResourceExhaustedError(absl::StrCat("cudaMalloc: ", cudaGetErrorString(e)));
  }
  ncclUniqueId nid;
  std::memcpy(&nid, id.bytes.data(), sizeof(nid));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once; Settle and Finish bound the waits
  const ncclResult_t r = ncclCommInitRankConfig(&h->comm, nranks, nid, rank, &config);
  absl::Status s = absl::OkStatus();
  if (r != ncclSuccess && r != ncclInProgress) {
    s = NcclError(r, "ncclCommInitRankConfig");
  } else {
    s = Settle(h->comm, "joining the NCCL communicator",
               std::chrono::steady_clock::now() + init_timeout, init_timeout);
  }
  // The communicator owns the handle from here: its destructor aborts a failed one.
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator(std::move(h), rank, nranks, timeout));
  if (!s.ok()) {
    return c->Abort(absl::Status(s.code(), absl::StrCat(s.message(), " (rank ", rank, " of ",
                                                        nranks, ", GPU ", device, ")")));
  }
  return c;
}

NcclCommunicator::~NcclCommunicator() {
  if (handle_->comm != nullptr) {
    // A clean end: finalize (nonblocking, so polled with a bound), then destroy; a finalize that
    // does not complete means a peer is gone, and the communicator is aborted instead.
    const ncclResult_t r = ncclCommFinalize(handle_->comm);
    const bool done = (r == ncclSuccess || r == ncclInProgress) &&
                      Settle(handle_->comm, "ncclCommFinalize",
                             std::chrono::steady_clock::now() + timeout_, timeout_)
                          .ok();
    if (done) {
      ncclCommDestroy(handle_->comm);
    } else {
      ncclCommAbort(handle_->comm);
    }
  }
  if (handle_->scratch != nullptr) cudaFree(handle_->scratch);
  if (handle_->stream != nullptr) cudaStreamDestroy(handle_->stream);
}

absl::Status NcclCommunicator::Abort(const absl::Status& reason) {
  if (!aborted_ && handle_->comm != nullptr) {
    ncclCommAbort(handle_->comm);  // wakes peers' pending operations with an error
    handle_->comm = nullptr;
  }
  aborted_ = true;
  return reason;
}

absl::Status NcclCommunicator::Finish(int enqueue_result, const char* what) {
  if (aborted_) return absl::UnavailableError("the NCCL communicator was aborted");
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  if (enqueue_result == ncclInProgress) {  // nonblocking: the operation is still being enqueued
    if (absl::Status s = Settle(handle_->comm, what, deadline, timeout_); !s.ok()) {
      return Abort(s);
    }
  } else if (enqueue_result != ncclSuccess) {
    return Abort(NcclError(static_cast<ncclResult_t>(enqueue_result), what));
  }
  for (;;) {
    const cudaError_t e = cudaStreamQuery(handle_->stream);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) {
      return Abort(absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e))));
    }
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(handle_->comm, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      return Abort(NcclError(async, absl::StrCat(what, " (a peer failed)").c_str()));
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return Abort(absl::UnavailableError(absl::StrCat(
          what, " did not complete within ", timeout_.count(), " ms: a peer stopped answering")));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

absl::Status NcclCommunicator::AllReduceSum(float* data, size_t count) {
  return Finish(
      ncclAllReduce(data, data, count, ncclFloat32, ncclSum, handle_->comm, handle_->stream),
      "ncclAllReduce");
}

absl::Status NcclCommunicator::AllGather(const float* send, size_t count, float* recv) {
  return Finish(ncclAllGather(send, recv, count, ncclFloat32, handle_->comm, handle_->stream),
                "ncclAllGather");
}

absl::Status NcclCommunicator::ReduceScatterSum(const float* send, size_t count, float* recv) {
  return Finish(
      ncclReduceScatter(send, recv, count, ncclFloat32, ncclSum, handle_->comm, handle_->stream),
      "ncclReduceScatter");
}

absl::Status NcclCommunicator::Broadcast(void* data, size_t bytes, int root) {
  return Finish(ncclBroadcast(data, data, bytes, ncclInt8, root, handle_->comm, handle_->stream),
                "ncclBroadcast");
}

absl::Status NcclCommunicator::Send(const void* data, size_t bytes, int peer) {
  return Finish(ncclSend(data, bytes, ncclInt8, peer, handle_->comm, handle_->stream), "ncclSend");
}

absl::Status NcclCommunicator::Recv(void* data, size_t bytes, int peer) {
  return Finish(ncclRecv(data, bytes, ncclInt8, peer, handle_->comm, handle_->stream), "ncclRecv");
}

absl::Status NcclCommunicator::Barrier() {
  return Finish(ncclAllReduce(handle_->scratch, handle_->scratch, 1, ncclFloat32, ncclSum,
                              handle_->comm, handle_->stream),
                "barrier");
}

}  // namespace shardserve::nccl
