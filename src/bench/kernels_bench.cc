#include "bench/kernels_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

#include "api/worker_env.h"
#include "backend/cpu/cpu_features.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/kernels_avx512.h"
#include "backend/cpu/quant.h"
#include "bench/runtime_bench.h"
#include "common/args.h"
#include "common/huge_pages.h"
#include "common/status.h"
#include "common/thread_pool.h"
#include "devtools/quantize_row.h"

namespace shardserve {
namespace {
absl::Status PrefillTable(ThreadPool& pool, int64_t K);
}  // namespace

absl::Status RunKernelsBench(const std::vector<std::string>& argv) {
  ASSIGN_OR_RETURN(Args a, Args::Parse(argv, {"threads", "cols", "kernels"}, {},
                                       "shardserve bench kernels", kKernelsBenchUsage));
  // --kernels, else the worker contract's SHARDSERVE_CPU_KERNELS, as bench runtime reads it.
  ASSIGN_OR_RETURN(const WorkerEnv env, WorkerEnv::FromEnv());
  RETURN_IF_ERROR(cpu::UseKernelLevel(a.GetOr("kernels", env.cpu_kernels)));
  ASSIGN_OR_RETURN(int64_t threads, a.GetInt("threads", 1));
  ASSIGN_OR_RETURN(int64_t K, a.GetInt("cols", 2048));
  if (threads < 1 || threads > 256) return absl::InvalidArgumentError("--threads must be 1-256");
  if (K < 32 || K > 65536 || K % 32 != 0) {
    return absl::InvalidArgumentError("--cols must be a multiple of 32 from 32 to 65536");
  }
  ThreadPool pool(static_cast<int>(threads));
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1, 1);
  std::vector<float> row(K), x(K);
  for (float& v : x) v = dist(rng);
  std::printf(
      "%-6s %12s %12s %14s   (%lld thread(s), %lld columns, %s kernels; GB/s of weights read, "
      "and G weights a second from memory; the read bandwidth of these threads: %.2f GB/s)\n",
      "type", "in L2", "from memory", "G weights/s", static_cast<long long>(threads),
      static_cast<long long>(K), cpu::KernelLevelName(cpu::ActiveKernelLevel()),
      ReadBandwidth(pool) / 1e9);
  // BF16, Q4_1, Q4_K and Q6_K as a file holds them, and as the CPU backend keeps them (BF16X but
  // where AMX multiplies BF16, Q4_1X, Q4_KX, Q6_KX).
  for (DType dt :
       {DType::kBF16, DType::kBF16X, DType::kF8_128, DType::kQ8_0, DType::kQ4_0, DType::kQ4_1,
        DType::kQ4_1X, DType::kQ4_K, DType::kQ4_KX, DType::kQ5_K, DType::kQ6_K, DType::kQ6_KX}) {
    const DType file = cpu::FileType(dt);
    // The K-quants' rows hold whole super-blocks of 256; the portable kernels keep no repacked
    // layout.
    if (K % DTypeBlock(dt) != 0 || (dt != file && cpu::KeptLayout(file, K) != dt)) {
      std::printf("%-6s %12s %12s %14s\n", DTypeName(dt), "-", "-", "-");
      continue;
    }
    double rate[2];
    for (int memory = 0; memory < 2; ++memory) {
      const int64_t distinct = memory ? 256 : 128;
      std::string bytes;
      for (int64_t n = 0; n < distinct; ++n) {
        for (float& v : row) v = dist(rng);
        if (file == DType::kBF16) {
          for (float v : row) {
            const uint16_t h = F32ToBf16(v);
            bytes.append(reinterpret_cast<const char*>(&h), 2);
          }
        } else {
          bytes += QuantizeRow(file, row.data(), K);
        }
      }
      const std::string plain = bytes;
      const size_t file_row_bytes = DTypeBytes(file, K), row_bytes = DTypeBytes(dt, K);
      bytes.resize(distinct * row_bytes);
      if (dt == DType::kBF16X) {  // `distinct` rows: whole groups of 16, repeated below
        cpu::RepackBf16Pairs({file, plain.data(), distinct, K, K},
                             reinterpret_cast<uint16_t*>(bytes.data()));
      } else {
        for (int64_t n = 0; n < distinct; ++n) {
          const auto* src = reinterpret_cast<const uint8_t*>(plain.data()) + n * file_row_bytes;
          auto* dst = reinterpret_cast<uint8_t*>(bytes.data()) + n * row_bytes;
          cpu::RepackRow(dt, src, K, dst);
        }
      }
      // From memory: about 512 MiB, 16 times this machine's L3, of those rows over and over, where
      // the CPU backend keeps a matrix (its Upload): in huge pages.
      const int64_t N =
          memory ? std::max<int64_t>(1, (int64_t{512} << 20) / row_bytes / distinct) * distinct
                 : distinct;
      const size_t total = static_cast<size_t>(N) * row_bytes;
      const HugePagesArray kept = AllocateHugePages(total);
      if (kept == nullptr) return absl::ResourceExhaustedError("cannot map the matrices");
      for (size_t at = 0; at < total; at += bytes.size()) {
        std::memcpy(kept.get() + at, bytes.data(), std::min(bytes.size(), total - at));
      }
      const WeightMatrix w{dt, kept.get(), N, K, K};
      std::vector<float> y(N);
      // As many products as read about 3 GB (at least 20), after 3 to warm up.
      const int reps = std::max<int>(20, static_cast<int>(3e9 / static_cast<double>(total)));
      for (int i = 0; i < 3; ++i) cpu::MatMul(w, x.data(), 1, K, y.data(), N, pool);
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < reps; ++i) cpu::MatMul(w, x.data(), 1, K, y.data(), N, pool);
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
      rate[memory] = static_cast<double>(total) / s / 1e9;
    }
    const double per_value = static_cast<double>(DTypeBytes(dt, K)) / static_cast<double>(K);
    std::printf("%-6s %12.2f %12.2f %14.2f\n", DTypeName(dt), rate[0], rate[1],
                rate[1] / per_value);
  }
  return PrefillTable(pool, K);
}

namespace {

// The prefill table's columns: each kernel level (avx512int8: the quantized types on int8
// activations), AVX2's without AVX-VNNI, AVX-512's without VNNI and avx512bf16's and avx512int8's
// without AMX's tiles (x86-64).
struct Column {
  const char* name;
  cpu::KernelLevel level;
  bool vnni = true, amx = true;
};
constexpr Column kColumns[] = {{"avx2", cpu::KernelLevel::kAvx2},
                               {"avx2 -VNNI", cpu::KernelLevel::kAvx2, false},
                               {"avx512", cpu::KernelLevel::kAvx512},
                               {"avx512 -AMX", cpu::KernelLevel::kAvx512, true, false},
                               {"avx512 -VNNI", cpu::KernelLevel::kAvx512, false, false},
                               {"avx512bf16", cpu::KernelLevel::kAvx512Bf16},
                               {"avx512bf16 -AMX", cpu::KernelLevel::kAvx512Bf16, true, false},
                               {"avx512int8", cpu::KernelLevel::kAvx512Int8},
                               {"avx512int8 -AMX", cpu::KernelLevel::kAvx512Int8, true, false},
                               {"portable", cpu::KernelLevel::kPortable}};

// Prefill: 128 tokens by 1,024 weight rows of K columns (the weights in L2/L3, the panels in L1:
// compute-bound), GFLOP/s at each kernel level this CPU and this build run (cpu_features.h; "-"
// where they lack one), at avx2 and avx512 with VNNI off ("-" without AVX-VNNI, AVX512-VNNI; at
// avx512 AMX's tiles off too), at avx512, avx512bf16 and avx512int8 with AMX's tiles off ("-"
// without AMX-INT8, AMX-BF16 at avx512bf16).
absl::Status PrefillTable(ThreadPool& pool, int64_t K) {
  constexpr int64_t M = 128, N = 1024;
  const cpu::CpuFeatures have = cpu::CpuFeatures::Detect();
  const cpu::KernelLevel before = cpu::ActiveKernelLevel();
  std::printf("\n%-6s", "type");
  for (const Column& c : kColumns) std::printf(" %15s", c.name);
  std::printf("   (prefill GEMM GFLOP/s, %lld tokens x %lld rows; kernels: %s)\n",
              static_cast<long long>(M), static_cast<long long>(N), cpu::DescribeKernels().c_str());
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> dist(-1, 1);
  std::vector<float> x(M * K), y(M * N), values(N * K);
  for (float& v : x) v = dist(rng);
  for (float& v : values) v = dist(rng);
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16, DType::kBF16X, DType::kQ8_0,
                   cpu::KeptType(DType::kQ4_K), cpu::KeptType(DType::kQ6_K)}) {
    if (K % DTypeBlock(dt) != 0) continue;
    std::vector<uint16_t> halves(N * K);
    std::string quantized(N * DTypeBytes(dt, K), '\0');
    if (dt == DType::kF16 || dt == DType::kBF16 || dt == DType::kBF16X) {
      for (int64_t i = 0; i < N * K; ++i) {
        halves[i] = dt == DType::kF16 ? F32ToF16(values[i]) : F32ToBf16(values[i]);
      }
      if (dt == DType::kBF16X) {
        const std::vector<uint16_t> rows = halves;
        cpu::RepackBf16Pairs({DType::kBF16, rows.data(), N, K, K}, halves.data());
      }
    } else if (dt != DType::kF32) {  // as the backend keeps it: the file's blocks, repacked
      for (int64_t n = 0; n < N; ++n) {
        const std::string row = QuantizeRow(cpu::FileType(dt), values.data() + n * K, K);
        cpu::RepackRow(dt, reinterpret_cast<const uint8_t*>(row.data()), K,
                       reinterpret_cast<uint8_t*>(quantized.data()) + n * DTypeBytes(dt, K));
      }
    }
    const void* data = quantized.data();
    if (dt == DType::kF32) data = values.data();
    if (dt == DType::kF16 || dt == DType::kBF16 || dt == DType::kBF16X) data = halves.data();
    const WeightMatrix w{dt, data, N, K, K};
    std::printf("%-6s", DTypeName(dt));
    for (const Column& c : kColumns) {
      if (!cpu::ChooseKernelLevel(have, cpu::KernelLevelName(c.level)).ok() ||
          (!c.vnni && !(c.level == cpu::KernelLevel::kAvx2 ? have.avx_vnni : have.avx512_vnni)) ||
          (c.vnni && !c.amx &&
           !(c.level == cpu::KernelLevel::kAvx512Bf16 ? have.amx_bf16 : have.amx_int8)) ||
          (dt == DType::kBF16X && c.level == cpu::KernelLevel::kPortable)) {  // x86's layout
        std::printf(" %15s", "-");
        continue;
      }
      cpu::SetKernelLevel(c.level);
#if !SHARDSERVE_PORTABLE_KERNELS
      cpu::UseVnni(c.vnni);
      cpu::avx512::UseAmx(c.amx);
#endif
      cpu::MatMul(w, x.data(), M, K, y.data(), N, pool);  // warm
      int reps = 0;
      const auto t0 = std::chrono::steady_clock::now();
      double s = 0;
      while (s < 1.0 || reps < 3) {
        cpu::MatMul(w, x.data(), M, K, y.data(), N, pool);
        ++reps;
        s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
      std::printf(" %15.1f", 2.0 * M * N * K * reps / s / 1e9);
    }
    std::printf("\n");
  }
  cpu::SetKernelLevel(before);
#if !SHARDSERVE_PORTABLE_KERNELS
  cpu::UseVnni(true);
  cpu::avx512::UseAmx(true);
#endif
  return absl::OkStatus();
}

}  // namespace

}  // namespace shardserve
