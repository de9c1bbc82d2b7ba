#include "bench/cuda_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "api/worker_env.h"
#include "backend/cuda/cuda_backend.h"
#include "bench/runtime_bench.h"
#include "common/args.h"
#include "common/status.h"
#include "model/transformer.h"
#include "serve/stage_backend.h"

namespace shardserve {

absl::Status RunCudaBench(const std::vector<std::string>& argv) {
  ASSIGN_OR_RETURN(
      Args a, Args::Parse(argv, {"model", "batch", "steps", "prompt-tokens", "profile-steps"}, {},
                          "shardserve bench cuda", kCudaBenchUsage));
  ASSIGN_OR_RETURN(std::string dir, a.Require("model"));
  ASSIGN_OR_RETURN(int64_t steps, a.GetInt("steps", 64));
  ASSIGN_OR_RETURN(int64_t prompt, a.GetInt("prompt-tokens", 128));
  // Under `ncu --profile-from-start off`, only the first N timed steps of each batch are profiled
  // (scripts/gpu-check.sh --profile): their times are then the profiler's, not the model's.
  ASSIGN_OR_RETURN(int64_t profile_steps, a.GetInt("profile-steps", 0));
  std::vector<int64_t> batches;
  for (absl::string_view b : absl::StrSplit(a.GetOr("batch", "1,32"), ',')) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(b, &n) || n < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--batch: '", b, "' is not a batch size"));
    }
    batches.push_back(n);
  }
  if (cuda::DeviceCount() == 0) {
    return absl::FailedPreconditionError("no GPU visible: the CUDA decode benchmark needs one");
  }
  ASSIGN_OR_RETURN(double copy_bw, cuda::CopyBandwidth(size_t{1} << 30));
  // The kernels and the FP8 computation as a rank reads them from the worker contract
  // (SHARDSERVE_CUDA_ATTN_KERNEL, SHARDSERVE_CUDA_QUANT_GEMV, SHARDSERVE_FP8).
  ASSIGN_OR_RETURN(const WorkerEnv env, WorkerEnv::FromEnv());
  ASSIGN_OR_RETURN(const cuda::KernelChoice kernels, CudaKernelsOf(env));
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> gpu, cuda::NewBackend(0, kernels));
  Transformer::Options o;
  o.fp8_blocks = env.fp8_blocks;
  o.kv_cache_dtype = ParseKvCacheDtype(env.kv_cache_dtype).value_or(KvCacheDtype::kAuto);
  ASSIGN_OR_RETURN(auto model, Transformer::Load(dir, o, std::move(gpu)));
  const ModelConfig& c = model->config();
  const DecodeCost cost = DecodeCostOf(c, model->shard_weight_bytes());
  std::printf(
      "model: %s layers %lld hidden %lld vocab %lld, weights %.2f GB, KV cache %s; device copy "
      "bandwidth %.0f GB/s (read + write of 1 GiB)\n",
      c.architecture.c_str(), static_cast<long long>(c.num_layers),
      static_cast<long long>(c.hidden_size), static_cast<long long>(c.vocab_size),
      model->shard_weight_bytes() / 1e9, DTypeName(model->kv_format().dtype), copy_bw / 1e9);
  using Clock = std::chrono::steady_clock;
  for (int64_t B : batches) {
    ASSIGN_OR_RETURN(auto cache, model->NewKvCache(B * (prompt + steps + 32)));
    std::vector<SequenceKv> kv(B);
    std::vector<SequenceChunk> chunks(B);
    for (int64_t s = 0; s < B; ++s) {
      chunks[s].kv = &kv[s];
      for (int64_t i = 0; i < prompt; ++i) {
        chunks[s].tokens.push_back(static_cast<int32_t>((s * 7919 + i * 104729) % c.vocab_size));
      }
    }
    // A step as the serving path runs it: the layers, then the greedy choice on the device (only
    // the summaries of the tokens come back).
    auto step = [&](std::vector<SequenceChunk>& batch) -> absl::Status {
      RETURN_IF_ERROR(model->Run(batch, *cache));
      ASSIGN_OR_RETURN(std::vector<SampledToken> next, model->Greedy(0, nullptr));
      for (size_t s = 0; s < batch.size(); ++s) batch[s].tokens = {next[s].id};
      return absl::OkStatus();
    };
    // Each prompt prefilled alone, as the server's chunked prefill does (a batch of B long
    // prompts at once would hold B x prompt rows of activations); the median is reported, after
    // one untimed prefill of the first prompt into a sequence that is then released (the first
    // run of a shape pays for cuBLAS's start and the buffers' growth).
    {
      SequenceKv scratch;
      std::vector<SequenceChunk> one = {SequenceChunk{chunks[0].tokens, &scratch}};
      RETURN_IF_ERROR(step(one));
      cache->Release(scratch);
    }
    std::vector<double> prefill;
    for (int64_t s = 0; s < B; ++s) {
      std::vector<SequenceChunk> one = {std::move(chunks[s])};
      const auto t0 = Clock::now();
      RETURN_IF_ERROR(step(one));
      prefill.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      chunks[s] = std::move(one[0]);
    }
    std::sort(prefill.begin(), prefill.end());
    std::printf(
        "prefill batch %3lld: %8.1f tokens/s, %lld-token prompt in %.2f ms (median of %lld)\n",
        static_cast<long long>(B), prompt / prefill[prefill.size() / 2],
        static_cast<long long>(prompt), prefill[prefill.size() / 2] * 1e3,
        static_cast<long long>(B));
    RETURN_IF_ERROR(step(chunks));  // a warm-up of the batch's shape
    std::vector<double> times;
    for (int64_t i = 0; i < steps; ++i) {
      if (i == 0 && profile_steps > 0) RETURN_IF_ERROR(cuda::ProfilerRange(true));
      const auto t0 = Clock::now();
      RETURN_IF_ERROR(step(chunks));
      times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      if (i + 1 == profile_steps) RETURN_IF_ERROR(cuda::ProfilerRange(false));
    }
    std::sort(times.begin(), times.end());
    const double median = times[times.size() / 2];
    // Bytes per step: the weights once, and each sequence's K and V of every layer in the
    // cache's dtype.
    const double context = static_cast<double>(prompt + steps / 2);
    const double kv_bytes = static_cast<double>(B) * context * c.num_layers * 2.0 * c.num_kv_heads *
                            c.head_dim * DTypeSize(model->kv_format().dtype);
    const double bytes = cost.weight_bytes_per_step + kv_bytes;
    std::printf(
        "decode batch %3lld: %8.1f tokens/s, inter-token latency %.2f ms (median of %lld "
        "steps), %.2f GB/step (weights %.2f + KV %.2f) = %.0f GB/s = %.0f%% of copy "
        "bandwidth\n",
        static_cast<long long>(B), B / median, median * 1e3, static_cast<long long>(steps),
        bytes / 1e9, cost.weight_bytes_per_step / 1e9, kv_bytes / 1e9, bytes / median / 1e9,
        100.0 * bytes / median / copy_bw);
    for (SequenceKv& s : kv) cache->Release(s);
  }
  return absl::OkStatus();
}

}  // namespace shardserve
