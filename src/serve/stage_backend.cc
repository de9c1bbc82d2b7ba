#include "serve/stage_backend.h"

#include <algorithm>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_features.h"
#include "comm/observed_comm.h"
#include "common/log.h"
#include "common/status.h"
#include "serve/rank_runtime.h"
#ifdef SHARDSERVE_WITH_CUDA
#include "backend/cuda/cuda_backend.h"
#include "comm/nccl/nccl_comm.h"
#endif

namespace shardserve {
namespace {

// Host memory and the host mesh; nothing to join.
class CpuBackend : public StageBackend {
 public:
  explicit CpuBackend(const RankConfig& config) : cfg_(config) {}
  absl::StatusOr<std::vector<std::string>> Blobs(const std::vector<RankAddress>&) const override {
    return std::vector<std::string>();
  }
  absl::StatusOr<std::unique_ptr<Transformer>> Load(const WorldInfo&, Transformer::Options o,
                                                    const Observer&,
                                                    std::unique_ptr<KvCache>& cache) override {
    RETURN_IF_ERROR(cpu::UseKernelLevel(cfg_.env.cpu_kernels));
    ASSIGN_OR_RETURN(auto m, Transformer::Load(cfg_.env.model_path, o));
    ASSIGN_OR_RETURN(cache, m->NewKvCache(cfg_.env.kv_cache_tokens));
    LogInfo("CPU backend, ", cpu::DescribeKernels(), " kernels, ", o.num_threads, " threads");
    return m;
  }
  absl::StatusOr<std::unique_ptr<Backend>> DraftBackend(int threads) override {
    return cpu::NewBackend(std::max(1, threads));
  }
  std::string name() const override { return "cpu"; }
  std::string kernels() const override { return cpu::KernelLevelName(cpu::ActiveKernelLevel()); }

 private:
  const RankConfig& cfg_;
};

#ifdef SHARDSERVE_WITH_CUDA
// The GPUs: ranks on one host take its GPUs in rank order (a pod's T ranks its T GPUs, rank t of
// the stage the t-th; `shardserve local` the machine's, wrapping around when there are fewer).
// NCCL communicators: the stage's TP group (tp > 1), and links to the same tp_rank of the
// previous and next stage where the two ranks have different GPUs.
class CudaBackend : public StageBackend {
 public:
  CudaBackend(const RankConfig& config, const WorldConfig& world, cuda::KernelChoice kernels)
      : cfg_(config), world_(world), kernels_(kernels) {}

  // An NCCL id per stage's TP group (tp > 1), then one per link (stage s, tp_rank t) ->
  // (s + 1, t) at pp + s * tp + t; empty where unused.
  absl::StatusOr<std::vector<std::string>> Blobs(
      const std::vector<RankAddress>& ranks) const override {
    std::vector<std::string> blobs;
    const int tp = cfg_.env.tp, pp = cfg_.env.pp;
    blobs.resize(pp + (pp - 1) * tp);
    for (int s = 0; tp > 1 && s < pp; ++s) {
      ASSIGN_OR_RETURN(nccl::UniqueId id, nccl::NewUniqueId());
      blobs[s] = id.ToBlob();
    }
    for (int s = 0; s + 1 < pp; ++s) {
      for (int t = 0; t < tp; ++t) {
        // Two ranks on one GPU cannot share an NCCL communicator: their link stays on the host.
        const int a = world_.RankOf(s, t), b = world_.RankOf(s + 1, t);
        if (ranks[a].host == ranks[b].host && DeviceOf(a) == DeviceOf(b)) continue;
        ASSIGN_OR_RETURN(nccl::UniqueId id, nccl::NewUniqueId());
        blobs[pp + s * tp + t] = id.ToBlob();
      }
    }
    return blobs;
  }

  absl::StatusOr<std::unique_ptr<Transformer>> Load(const WorldInfo& info, Transformer::Options o,
                                                    const Observer& observe,
                                                    std::unique_ptr<KvCache>& cache) override {
    // The host TP group stays for the small exchanges of token choice; NCCL carries the
    // activations within the stage and, over links, to the neighbouring stages.
    const int device = DeviceOf(world_.rank());
    RETURN_IF_ERROR(Join(info, device, observe));
    if (tp_timed_) o.tp_comm = tp_timed_.get();
    ASSIGN_OR_RETURN(std::unique_ptr<Backend> gpu, cuda::NewBackend(device, kernels_));
    ASSIGN_OR_RETURN(auto m, Transformer::Load(cfg_.env.model_path, o, std::move(gpu)));
    ASSIGN_OR_RETURN(cache, m->NewKvCache(cfg_.env.kv_cache_tokens));
    LogInfo("CUDA backend on GPU ", device);
    return m;
  }

  absl::StatusOr<std::unique_ptr<Backend>> DraftBackend(int /*threads*/) override {
    const int device = DeviceOf(world_.rank());
    LogInfo("the draft model on GPU ", device);
    return cuda::NewBackend(device, kernels_);
  }
  std::string name() const override { return "cuda"; }
  Communicator* device_prev() const override { return prev_timed_.get(); }
  Communicator* device_next() const override { return next_timed_.get(); }
  void Abort(const absl::Status& cause) override {
    for (Communicator* c : {tp_.get(), prev_.get(), next_.get()}) {
      if (c != nullptr) (void)c->Abort(cause);
    }
  }

 private:
  int DeviceOf(int rank) const {
    const int n = cuda::DeviceCount();
    return n > 0 ? rank % n : 0;
  }

  absl::Status Join(const WorldInfo& info, int device, const Observer& observe) {
    const int tp = cfg_.env.tp, pp = cfg_.env.pp, s = cfg_.env.stage, t = cfg_.env.tp_rank;
    if (static_cast<int>(info.blobs.size()) != pp + (pp - 1) * tp) {
      return absl::InternalError(absl::StrCat("the leader handed out ", info.blobs.size(),
                                              " NCCL ids for ", pp, " stages of ", tp, " ranks"));
    }
    // Joined in one order on every rank: the stage's group, the link from the previous stage,
    // the link to the next; stage 0 has no previous link, so no rank waits on one still joining.
    auto join = [&](const std::string& blob, int size, int member,
                    std::unique_ptr<Communicator>& raw,
                    std::unique_ptr<Communicator>& timed) -> absl::Status {
      if (blob.empty()) return absl::OkStatus();
      ASSIGN_OR_RETURN(nccl::UniqueId id, nccl::UniqueId::FromBlob(blob));
      ASSIGN_OR_RETURN(raw,
                       nccl::NcclCommunicator::Create(id, size, member, device, cfg_.peer_timeout(),
                                                      cfg_.startup_timeout()));
      timed = std::make_unique<ObservedCommunicator>(raw.get(), observe);
      return absl::OkStatus();
    };
    if (tp > 1) {
      if (cuda::DeviceCount() < tp) {
        return absl::FailedPreconditionError(absl::StrCat(
            "tensor parallelism of ", tp, " on the CUDA backend needs ", tp,
            " GPUs on the stage's node (one per rank); ", cuda::DeviceCount(), " visible"));
      }
      RETURN_IF_ERROR(join(info.blobs[s], tp, t, tp_, tp_timed_));
    }
    if (s > 0) RETURN_IF_ERROR(join(info.blobs[pp + (s - 1) * tp + t], 2, 1, prev_, prev_timed_));
    if (s + 1 < pp) {
      RETURN_IF_ERROR(join(info.blobs[pp + s * tp + t], 2, 0, next_, next_timed_));
    }
    return absl::OkStatus();
  }

  const RankConfig& cfg_;
  const WorldConfig& world_;
  const cuda::KernelChoice kernels_;
  // The NCCL communicators, and the same timed into the metrics (as the runtime uses them).
  std::unique_ptr<Communicator> tp_, prev_, next_;
  std::unique_ptr<Communicator> tp_timed_, prev_timed_, next_timed_;
};
#endif

}  // namespace

#ifdef SHARDSERVE_WITH_CUDA
absl::StatusOr<cuda::KernelChoice> CudaKernelsOf(const WorkerEnv& env) {
  cuda::KernelChoice k;
  absl::StatusOr<cuda::AttentionKernel> attention =
      cuda::AttentionKernelNamed(env.cuda_attention_kernel);
  if (!attention.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("environment variable ", kCudaAttnKernelEnv, "=",
                                                   attention.status().message()));
  }
  absl::StatusOr<cuda::QuantGemvMode> gemv = cuda::QuantGemvNamed(env.cuda_quant_gemv);
  if (!gemv.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", kCudaQuantGemvEnv, "=", gemv.status().message()));
  }
  absl::StatusOr<cuda::Fp8GemvMode> fp8 = cuda::Fp8GemvNamed(env.cuda_fp8_gemv);
  if (!fp8.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", kCudaFp8GemvEnv, "=", fp8.status().message()));
  }
  k.attention = *attention;
  k.quant_gemv = *gemv;
  k.fp8_gemv = *fp8;
  return k;
}
#endif

absl::StatusOr<std::unique_ptr<StageBackend>> StageBackend::Choose(const RankConfig& config,
                                                                   const WorldConfig& world) {
  const std::string& name = config.env.backend;
#ifdef SHARDSERVE_WITH_CUDA
  const bool gpu = cuda::DeviceCount() > 0;
  ASSIGN_OR_RETURN(const cuda::KernelChoice kernels, CudaKernelsOf(config.env));
  auto cuda = [&]() -> std::unique_ptr<StageBackend> {
    return std::make_unique<CudaBackend>(config, world, kernels);
  };
#else
  const bool gpu = false;
  auto cuda = []() -> std::unique_ptr<StageBackend> { return nullptr; };
  (void)world;
#endif
  auto cpu = [&]() -> std::unique_ptr<StageBackend> {
    return std::make_unique<CpuBackend>(config);
  };
  // LoRA's CUDA kernels can be switched off: a replica with adapters is then refused on a GPU,
  // never moved to the CPU unsaid.
  const absl::Status lora =
      config.env.max_loras > 0 && !config.env.cuda_lora
          ? absl::FailedPreconditionError(
                absl::StrCat("LoRA adapters on the CUDA backend are switched off (", kCudaLoraEnv,
                             "=off): run this replica without adapters "
                             "or on the CPU backend"))
          : absl::OkStatus();
  if (name == "cpu") return cpu();
  if (name == "auto") {
    if (!gpu) return cpu();
    RETURN_IF_ERROR(lora);
    return cuda();
  }
  if (name == "cuda") {
#ifndef SHARDSERVE_WITH_CUDA
    return absl::FailedPreconditionError(absl::StrCat(
        kBackendEnv, "=cuda, but this build has no CUDA backend (build with SHARDSERVE_CUDA)"));
#endif
    if (!gpu)
      return absl::FailedPreconditionError(
          absl::StrCat(kBackendEnv, "=cuda, but no GPU is visible"));
    RETURN_IF_ERROR(lora);
    return cuda();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(kBackendEnv, " '", name, "' must be cpu, cuda or auto"));
}

}  // namespace shardserve
