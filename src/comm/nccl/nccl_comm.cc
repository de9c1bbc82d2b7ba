#include "comm/nccl/nccl_comm.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace shardserve::nccl {
namespace {

static_assert(sizeof(ncclUniqueId) == sizeof(UniqueId::bytes), "NCCL unique id size changed");

absl::Status Check(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", ncclGetErrorString(r)));
}

}  // namespace

struct Communicator::Handle {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
};

std::string Version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  return absl::StrCat(v / 10000, ".", (v / 100) % 100, ".", v % 100);
}

absl::StatusOr<UniqueId> NewUniqueId() {
  ncclUniqueId id;
  if (absl::Status s = Check(ncclGetUniqueId(&id), "ncclGetUniqueId"); !s.ok()) return s;
  UniqueId out;
  std::memcpy(out.bytes.data(), &id, sizeof(id));
  return out;
}

Communicator::Communicator(std::unique_ptr<Handle> h, int rank, int nranks)
    : handle_(std::move(h)), rank_(rank), nranks_(nranks) {}

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::Create(const UniqueId& id, int nranks,
                                                                   int rank, int device) {
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("cudaSetDevice(", device, "): ", cudaGetErrorString(e)));
  }
  auto h = std::make_unique<Handle>();
  if (cudaError_t e = cudaStreamCreate(&h->stream); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaStreamCreate: ", cudaGetErrorString(e)));
  }
  ncclUniqueId nid;
  std::memcpy(&nid, id.bytes.data(), sizeof(nid));
  if (absl::Status s = Check(ncclCommInitRank(&h->comm, nranks, nid, rank), "ncclCommInitRank");
      !s.ok()) {
    cudaStreamDestroy(h->stream);
    return s;
  }
  return std::unique_ptr<Communicator>(new Communicator(std::move(h), rank, nranks));
}

Communicator::~Communicator() {
  if (handle_->comm != nullptr) ncclCommDestroy(handle_->comm);
  if (handle_->stream != nullptr) cudaStreamDestroy(handle_->stream);
}

absl::Status Communicator::AllReduceSum(float* data, size_t count) {
  if (absl::Status s = Check(
          ncclAllReduce(data, data, count, ncclFloat32, ncclSum, handle_->comm, handle_->stream),
          "ncclAllReduce");
      !s.ok()) {
    return s;
  }
  if (cudaError_t e = cudaStreamSynchronize(handle_->stream); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("all-reduce stream: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

}  // namespace shardserve::nccl
