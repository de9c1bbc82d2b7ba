#pragma once
// A rank's backend (DESIGN.md §5): the backend its stage of the model runs on and, on GPUs, the
// NCCL communicators between its GPU and its peers'. The one place that knows which backends
// this build has; the rank runtime drives the Transformer it loads.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "comm/rendezvous.h"
#include "comm/world.h"
#include "model/kv_cache.h"
#include "model/transformer.h"
#ifdef SHARDSERVE_WITH_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace shardserve {

struct RankConfig;
struct WorkerEnv;

#ifdef SHARDSERVE_WITH_CUDA
// The CUDA kernels the contract chooses (SHARDSERVE_CUDA_ATTN_KERNEL, SHARDSERVE_CUDA_QUANT_GEMV,
// SHARDSERVE_CUDA_FP8_GEMV); a name the backend does not know is an error naming the variable.
absl::StatusOr<cuda::KernelChoice> CudaKernelsOf(const WorkerEnv& env);
#endif

class StageBackend {
 public:
  using Observer = std::function<void(const char* op, double seconds, size_t bytes)>;

  // SHARDSERVE_BACKEND (config.backend): cpu, cuda, or auto (CUDA when this build has it and a
  // GPU is visible). cuda without a build or a GPU is FailedPrecondition; anything else is
  // InvalidArgument.
  static absl::StatusOr<std::unique_ptr<StageBackend>> Choose(const RankConfig& config,
                                                              const WorldConfig& world);
  virtual ~StageBackend() = default;

  // What the leader hands every rank at the rendezvous, from all their addresses (on GPUs the
  // NCCL ids); none on the CPU.
  virtual absl::StatusOr<std::vector<std::string>> Blobs(
      const std::vector<RankAddress>& ranks) const = 0;
  // Joins what the blobs name, then loads this rank's stage (o: its layers, TP rank and host TP
  // group) and a KV cache for it. `observe` times the backend's communicators.
  virtual absl::StatusOr<std::unique_ptr<Transformer>> Load(const WorldInfo& info,
                                                            Transformer::Options o,
                                                            const Observer& observe,
                                                            std::unique_ptr<KvCache>& cache) = 0;
  // Two-member links (the earlier stage is member 0) to this rank's counterparts (same tp_rank)
  // in the neighbouring stages, on backend memory (device to device); null where hidden states
  // go over the host mesh.
  // Where the leader's draft model runs (speculative method draft): the rank's own kind of
  // backend (on the CPU with `threads` threads; on the rank's GPU beside its stage).
  virtual absl::StatusOr<std::unique_ptr<Backend>> DraftBackend(int threads) = 0;
  // The backend's name (cpu, cuda) and, on the CPU, its kernels' level (the metrics' labels).
  virtual std::string name() const = 0;
  virtual std::string kernels() const { return ""; }
  virtual Communicator* device_prev() const { return nullptr; }
  virtual Communicator* device_next() const { return nullptr; }
  // Tells the peers on the backend's own communicators why this rank stops.
  virtual void Abort(const absl::Status& cause) { (void)cause; }
};

}  // namespace shardserve
