#include "bench/runtime_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>

#include "api/worker_env.h"
#include "backend/cpu/cpu_features.h"
#include "common/args.h"
#include "common/huge_pages.h"
#include "common/process.h"
#include "common/status.h"
#include "common/thread_pool.h"
#include "model/transformer.h"

namespace shardserve {
namespace {

using Clock = std::chrono::steady_clock;
// Eight floats in GCC's vector type: the CPU's SIMD (x86: one AVX register; ARM: two NEON).
using F8 = float __attribute__((vector_size(32)));
inline F8 Load8(const float* p) {
  F8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Writes positions [kv.length, context) of one sequence straight into every layer of the cache
// (arbitrary values: a decode step's time does not depend on them), as a prefill would have.
absl::Status FillKv(Transformer& model, KvCache& cache, SequenceKv& kv, int64_t context) {
  RETURN_IF_ERROR(cache.Reserve(kv, context));
  Backend& be = model.backend();
  const ModelConfig& c = model.config();
  const bool latent = c.mla;
  const int64_t width = latent ? c.kv_lora_rank : c.num_kv_heads * c.head_dim;
  const int64_t width2 = latent ? c.head_dim : width;  // the rotated key dims, or V
  constexpr int64_t kRows = 256;
  std::vector<float> a(kRows * width), b(kRows * width2);
  for (size_t i = 0; i < a.size(); ++i) a[i] = std::sin(0.37f * static_cast<float>(i));
  for (size_t i = 0; i < b.size(); ++i) b[i] = std::cos(0.11f * static_cast<float>(i));
  std::unique_ptr<Buffer> da = be.NewBuffer(), db = be.NewBuffer(), dp = be.NewBuffer(),
                          dt = be.NewBuffer(), doff = be.NewBuffer();
  RETURN_IF_ERROR(da->Reserve(a.size() * sizeof(float)));
  RETURN_IF_ERROR(db->Reserve(b.size() * sizeof(float)));
  RETURN_IF_ERROR(dp->Reserve(kRows * sizeof(int32_t)));
  RETURN_IF_ERROR(doff->Reserve(kRows * sizeof(int32_t)));
  RETURN_IF_ERROR(dt->Reserve(kv.blocks.size() * sizeof(int32_t)));
  RETURN_IF_ERROR(be.CopyFromHost(da->data(), a.data(), a.size() * sizeof(float)));
  RETURN_IF_ERROR(be.CopyFromHost(db->data(), b.data(), b.size() * sizeof(float)));
  RETURN_IF_ERROR(
      be.CopyFromHost(dt->data(), kv.blocks.data(), kv.blocks.size() * sizeof(int32_t)));
  const std::vector<int32_t> zeros(kRows, 0);
  RETURN_IF_ERROR(be.CopyFromHost(doff->data(), zeros.data(), kRows * sizeof(int32_t)));
  for (int64_t p0 = kv.length; p0 < context; p0 += kRows) {
    const int64_t rows = std::min(kRows, context - p0);
    std::vector<int32_t> pos(rows);
    for (int64_t r = 0; r < rows; ++r) pos[r] = static_cast<int32_t>(p0 + r);
    RETURN_IF_ERROR(be.CopyFromHost(dp->data(), pos.data(), rows * sizeof(int32_t)));
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const int32_t *p = dp->as<int32_t>(), *t = dt->as<int32_t>(), *o = doff->as<int32_t>();
      RETURN_IF_ERROR(latent ? be.WriteLatentKv(*cache.storage(), l, da->as<float>(),
                                                db->as<float>(), rows, p, t, o)
                             : be.WriteKv(*cache.storage(), l, da->as<float>(), db->as<float>(),
                                          rows, p, t, o));
    }
  }
  kv.length = context;
  return be.Synchronize();
}

}  // namespace

double ReadBandwidth(ThreadPool& pool) {
  // In huge pages, as the CPU backend keeps the weights (common/huge_pages.h): the rate such
  // memory gives.
  const size_t n = (size_t{3} << 30) / sizeof(float);
  const HugePagesArray bytes = AllocateHugePages(n * sizeof(float));
  if (bytes == nullptr) return 0;
  float* buf = reinterpret_cast<float*>(bytes.get());
  pool.ParallelFor(static_cast<int64_t>(n), 1 << 16, [&](int, int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) buf[i] = static_cast<float>(i & 7);
  });
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    std::vector<float> sums(pool.num_threads());
    const auto t0 = Clock::now();
    pool.ParallelFor(static_cast<int64_t>(n), 1 << 16, [&](int t, int64_t b, int64_t e) {
      F8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int64_t i = b; i + 32 <= e; i += 32) {
        a0 += Load8(&buf[i]);
        a1 += Load8(&buf[i + 8]);
        a2 += Load8(&buf[i + 16]);
        a3 += Load8(&buf[i + 24]);
      }
      sums[t] = ((a0 + a1) + (a2 + a3))[0];
    });
    const double s = Seconds(t0, Clock::now());
    best = std::max(best, n * sizeof(float) / s);
    if (sums[0] < 0) std::printf("#");  // keep the reads alive
  }
  return best;
}

namespace {

// Peak F32 FLOP/s with the CPU's FMA (x86: AVX2's; contracted from a * m + c): independent FMA
// chains on every thread.
double FmaPeak(ThreadPool& pool) {
  constexpr int64_t kIters = 200'000'000 / 8;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<float> out(pool.num_threads());
    const auto t0 = Clock::now();
    pool.ParallelFor(pool.num_threads(), 1, [&](int t, int64_t, int64_t) {
      F8 acc[10];
      for (int i = 0; i < 10; ++i) acc[i] = F8{} + 0.1f * i;
      const F8 m = F8{} + 0.999999f, c = F8{} + 1e-7f;
      for (int64_t it = 0; it < kIters; ++it) {
        for (int i = 0; i < 10; ++i) acc[i] = acc[i] * m + c;
      }
      F8 s = acc[0];
      for (int i = 1; i < 10; ++i) s += acc[i];
      out[t] = s[0];
    });
    const double s = Seconds(t0, Clock::now());
    best = std::max(best, pool.num_threads() * kIters * 10.0 * 8 * 2 / s);
    if (out[0] < 0) std::printf("#");
  }
  return best;
}

}  // namespace

DecodeCost DecodeCostOf(const ModelConfig& c, size_t weight_bytes) {
  const double H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size;
  const double per_layer_params =
      H * c.q_dim() * 2 + H * c.kv_dim() * 2 +
      (c.moe ? c.num_experts * 3 * H * I + c.num_experts * H : 3 * H * I);
  DecodeCost d;
  d.active_layer_params = H * c.q_dim() * 2 + H * c.kv_dim() * 2 +
                          (c.moe ? c.experts_per_token * 3 * H * I : 3 * H * I);
  d.bytes_per_param =
      static_cast<double>(weight_bytes) /
      (c.num_layers * per_layer_params + V * H * (c.tie_word_embeddings ? 1 : 2) + H);
  d.weight_bytes_per_step = (c.num_layers * d.active_layer_params + V * H) * d.bytes_per_param;
  return d;
}

absl::Status RunRuntimeBench(const std::vector<std::string>& argv) {
  ASSIGN_OR_RETURN(Args a, Args::Parse(argv,
                                       {"model", "threads", "decode-tokens", "prefill-tokens",
                                        "context", "kv-cache-dtype"},
                                       {}, "shardserve bench runtime", kRuntimeBenchUsage));
  ASSIGN_OR_RETURN(std::string dir, a.Require("model"));
  ASSIGN_OR_RETURN(int64_t threads, a.GetInt("threads", 2));
  ASSIGN_OR_RETURN(int64_t decode_tokens, a.GetInt("decode-tokens", 32));
  ASSIGN_OR_RETURN(int64_t prefill_tokens, a.GetInt("prefill-tokens", 512));
  ASSIGN_OR_RETURN(int64_t context, a.GetInt("context", 0));
  if (context < 0 || decode_tokens < 1 || prefill_tokens < 0) {
    return absl::InvalidArgumentError(
        "--context and --prefill-tokens must be at least 0, --decode-tokens at least 1");
  }

  // How the weights compute, the KV cache keeps its values and which CPU kernels run, as a rank
  // reads them from the worker contract (SHARDSERVE_FP8, SHARDSERVE_KV_CACHE_DTYPE, the flag
  // first; SHARDSERVE_CPU_KERNELS).
  ASSIGN_OR_RETURN(const WorkerEnv env, WorkerEnv::FromEnv());
  RETURN_IF_ERROR(cpu::UseKernelLevel(env.cpu_kernels));
  ASSIGN_OR_RETURN(const KvCacheDtype kv_dtype, KvCacheDtypeOf(a.Get("kv-cache-dtype"), env));
  Transformer::Options o;
  o.num_threads = static_cast<int>(threads);
  o.fp8_blocks = env.fp8_blocks;
  o.kv_cache_dtype = kv_dtype;
  ASSIGN_OR_RETURN(auto model, Transformer::Load(dir, o));
  const ModelConfig& c = model->config();
  const double H = c.hidden_size, V = c.vocab_size;
  // The bytes the rank holds (an FP8 checkpoint's as F8_128, or expanded into the model's dtype
  // with SHARDSERVE_FP8=expand), which a decode step reads.
  const double held = static_cast<double>(model->shard_weight_bytes());
  const DecodeCost cost = DecodeCostOf(c, static_cast<size_t>(held));
  const double bytes_per_param = cost.bytes_per_param;
  const double active_layer_params = cost.active_layer_params;
  const double decode_bytes = cost.weight_bytes_per_step;

  std::printf(
      "model: %s  layers %lld hidden %lld intermediate %lld heads %lld/%lld vocab %lld  "
      "weights %.2f GB (%.2f bytes/param)  threads %lld  CPU kernels %s\n",
      c.architecture.c_str(), (long long)c.num_layers, (long long)c.hidden_size,
      (long long)c.intermediate_size, (long long)c.num_heads, (long long)c.num_kv_heads,
      (long long)c.vocab_size, held / 1e9, bytes_per_param, (long long)threads,
      cpu::DescribeKernels().c_str());
  // The machine's capacity is measured before and after the model work and the higher figure
  // kept: on a VM with steal time a single measurement can land in a slow moment.
  ThreadPool pool(static_cast<int>(threads));
  const double bw_before = ReadBandwidth(pool);
  const double peak_before = FmaPeak(pool);

  // Decode at batch 1 after a short prompt (or --context cached positions); one warm-up step
  // pages the weights in.
  ASSIGN_OR_RETURN(auto cache,
                   model->NewKvCache(std::max(prefill_tokens, context) + decode_tokens + 64));
  SequenceKv kv;
  std::vector<SequenceChunk> chunks(1);
  chunks[0].kv = &kv;
  chunks[0].tokens = {1, 5, 9, 13, 17, 21, 25, 29};
  std::vector<float> logits;
  RETURN_IF_ERROR(model->Forward(chunks, *cache, logits));
  if (context > kv.length) RETURN_IF_ERROR(FillKv(*model, *cache, kv, context));
  chunks[0].tokens = {3};
  RETURN_IF_ERROR(model->Forward(chunks, *cache, logits));
  // Per-step times, reported as the median and the best step.
  std::vector<double> steps;
  for (int64_t i = 0; i < decode_tokens; ++i) {
    chunks[0].tokens = {static_cast<int32_t>((i * 7919) % c.vocab_size)};
    const auto t0 = Clock::now();
    RETURN_IF_ERROR(model->Forward(chunks, *cache, logits));
    steps.push_back(Seconds(t0, Clock::now()));
  }
  std::sort(steps.begin(), steps.end());
  const size_t rss = ResidentBytes();

  const double context_kv = static_cast<double>(cache->BlocksFor(kv.length)) *
                            static_cast<double>(model->kv_block_bytes());
  const int64_t decoded_at = kv.length;
  // Prefill of one prompt of prefill_tokens (best of 2).
  chunks[0].tokens.resize(prefill_tokens);
  for (int64_t i = 0; i < prefill_tokens; ++i) {
    chunks[0].tokens[i] = static_cast<int32_t>((i * 104729 + 7) % c.vocab_size);
  }
  double prefill_s = 1e30;
  for (int rep = 0; rep < (prefill_tokens > 0 ? 2 : 0); ++rep) {
    cache->Release(kv);
    const auto t0 = Clock::now();
    RETURN_IF_ERROR(model->Forward(chunks, *cache, logits));
    prefill_s = std::min(prefill_s, Seconds(t0, Clock::now()));
  }

  const double bw_after = ReadBandwidth(pool);
  const double peak_after = FmaPeak(pool);
  const double bw = std::max(bw_before, bw_after), peak = std::max(peak_before, peak_after);
  std::printf(
      "machine: read bandwidth %.2f GB/s, AVX2 FMA peak %.1f GFLOP/s (%lld threads; best of "
      "before %.2f / %.1f and after %.2f / %.1f)\n",
      bw / 1e9, peak / 1e9, (long long)threads, bw_before / 1e9, peak_before / 1e9, bw_after / 1e9,
      peak_after / 1e9);
  for (auto [label, s] : {std::pair{"median", steps[steps.size() / 2]}, {"best", steps[0]}}) {
    std::printf(
        "decode  batch 1 (%s step): %.2f tokens/s, %.1f ms/token, weights read %.2f GB/token, "
        "effective %.2f GB/s = %.0f%% of read bandwidth\n",
        label, 1 / s, 1e3 * s, decode_bytes / 1e9, decode_bytes / s / 1e9,
        100.0 * decode_bytes / s / bw);
  }
  // The KV cache: its dtype, bytes a position, and what decode read at its context.
  const KvFormat& kvf = model->kv_format();
  const double per_position = static_cast<double>(model->kv_block_bytes()) / cache->block_size();
  const double median = steps[steps.size() / 2];
  std::printf(
      "kv cache: %s, %.0f bytes a position (all layers); decode from %lld positions: %.3f GB of "
      "KV, median %.2f tokens/s (%.1f ms/token; weights + KV read at %.2f GB/s)\n",
      DTypeName(kvf.dtype), per_position, static_cast<long long>(decoded_at), context_kv / 1e9,
      1 / median, 1e3 * median, (decode_bytes + context_kv) / median / 1e9);
  if (prefill_tokens == 0) return absl::OkStatus();
  const double n = static_cast<double>(prefill_tokens);
  const double flops = 2.0 * n * c.num_layers * active_layer_params +
                       4.0 * c.num_layers * c.q_dim() * n * (n + 1) / 2 + 2.0 * V * H;
  std::printf("prefill %lld tokens: %.1f tokens/s, %.1f GFLOP/s = %.0f%% of FMA peak\n",
              (long long)prefill_tokens, n / prefill_s, flops / prefill_s / 1e9,
              100.0 * flops / prefill_s / peak);
  const double kv_bytes = static_cast<double>(cache->BlocksFor(prefill_tokens + decode_tokens)) *
                          model->kv_block_bytes();
  std::printf(
      "memory: RSS %.2f GB after decode; weights %.2f GB + KV cache in use %.3f GB "
      "=> RSS is %.1f%% over weights + KV\n",
      rss / 1e9, held / 1e9, kv_bytes / 1e9, 100.0 * (rss / (held + kv_bytes) - 1));
  return absl::OkStatus();
}

}  // namespace shardserve
