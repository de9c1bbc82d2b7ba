#include "backend/cpu/cpu_features.h"

#if defined(__aarch64__)
#include <sys/auxv.h>
#endif

#include <atomic>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace shardserve::cpu {
namespace {

std::atomic<int> g_level{-1};                           // KernelLevel once chosen
std::atomic<bool> g_vnni{true};                         // UseVnni's
std::atomic<int> g_prefetch{-1};                        // UseDecodePrefetch's, -1: the CPU's
constexpr char kVariable[] = "SHARDSERVE_CPU_KERNELS";  // api/worker_env.h's, named in errors
#if SHARDSERVE_PORTABLE_KERNELS
constexpr bool kPortable = true;
#else
constexpr bool kPortable = false;
#endif

}  // namespace

CpuFeatures CpuFeatures::Detect() {
  CpuFeatures f;
#if defined(__aarch64__)
  const unsigned long hwcap = getauxval(AT_HWCAP);
  f.neon = (hwcap & (1UL << 1)) != 0;      // HWCAP_ASIMD
  f.dotprod = (hwcap & (1UL << 20)) != 0;  // HWCAP_ASIMDDP
#elif defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.f16c = __builtin_cpu_supports("f16c");
  f.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  f.avx512_bf16 = f.avx512 && __builtin_cpu_supports("avx512bf16");
  f.avx512_vnni = f.avx512 && __builtin_cpu_supports("avx512vnni");
  f.avx_vnni = f.avx2 && __builtin_cpu_supports("avxvnni");
  f.amx_bf16 =
      f.avx512_bf16 && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16");
  f.amx_int8 =
      f.avx512_vnni && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8");
  f.amd = __builtin_cpu_is("amd");
#endif
  return f;
}

absl::Status CheckCpu(const CpuFeatures& have) {
  if (kPortable) return absl::OkStatus();
  std::vector<std::string> missing;
  if (!have.avx2) missing.push_back("AVX2");
  if (!have.fma) missing.push_back("FMA");
  if (!have.f16c) missing.push_back("F16C");
  if (missing.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "the CPU backend's kernels need AVX2, FMA and F16C (x86-64-v3); this CPU lacks ",
      absl::StrJoin(missing, ", "), " (a GPU backend, or a CPU that has them, can serve it)"));
}

const char* KernelLevelName(KernelLevel level) {
  switch (level) {
    case KernelLevel::kAvx2:
      return "avx2";
    case KernelLevel::kAvx512:
      return "avx512";
    case KernelLevel::kAvx512Bf16:
      return "avx512bf16";
    case KernelLevel::kAvx512Int8:
      return "avx512int8";
    case KernelLevel::kPortable:
      return "portable";
  }
  return "avx2";
}

absl::StatusOr<KernelLevel> ChooseKernelLevel(const CpuFeatures& have, std::string_view asked) {
  if (kPortable) {
    if (asked.empty() || asked == "auto" || asked == "portable") return KernelLevel::kPortable;
    if (asked == "avx2" || asked == "avx512" || asked == "avx512bf16" || asked == "avx512int8") {
      return absl::FailedPreconditionError(absl::StrCat(
          kVariable, "=", std::string(asked),
          ": this build carries the portable kernels only (its CPU is not x86-64, or it "
          "was built with SHARDSERVE_PORTABLE_KERNELS)"));
    }
  } else if (asked == "portable") {
    return absl::FailedPreconditionError(absl::StrCat(
        kVariable,
        "=portable: this x86-64 build carries the AVX2 and AVX-512 kernels; the portable ones are "
        "built for other CPUs (or with the CMake option SHARDSERVE_PORTABLE_KERNELS)"));
  }
  if (asked.empty() || asked == "auto") {
    // kAvx512Bf16 rounds BF16 weights' activations (llama.cpp's arithmetic): auto's where its dot
    // products are twice the FMAs' width (AMD) and BF16 stays BF16X (no AMX: AMX's prefill tiles
    // sum in another order than the decode loop). Intel's cores run vdpbf16ps on one port
    // against the FMAs' two: its prefill is slower than F32's there (README).
    if (have.avx512_bf16 && have.amd && !have.amx_bf16) return KernelLevel::kAvx512Bf16;
    return have.avx512 ? KernelLevel::kAvx512 : KernelLevel::kAvx2;
  }
  if (asked == "avx2") return KernelLevel::kAvx2;
  if (asked == "avx512") {
    if (have.avx512) return KernelLevel::kAvx512;
    return absl::FailedPreconditionError(
        absl::StrCat(kVariable, "=avx512: this CPU lacks AVX-512 (F, BW, VL, DQ)"));
  }
  if (asked == "avx512bf16") {
    if (have.avx512_bf16) return KernelLevel::kAvx512Bf16;
    return absl::FailedPreconditionError(
        absl::StrCat(kVariable, "=avx512bf16: this CPU lacks AVX512-BF16"));
  }
  if (asked == "avx512int8") {
    if (have.avx512_vnni) return KernelLevel::kAvx512Int8;
    return absl::FailedPreconditionError(
        absl::StrCat(kVariable, "=avx512int8: this CPU lacks AVX512-VNNI"));
  }
  return absl::InvalidArgumentError(absl::StrCat(kVariable, "='", std::string(asked),
                                                 "' must be auto, avx2, avx512, avx512bf16, "
                                                 "avx512int8 or portable"));
}

KernelLevel ActiveKernelLevel() {
  int level = g_level.load(std::memory_order_relaxed);
  if (level < 0) {
    level = static_cast<int>(*ChooseKernelLevel(CpuFeatures::Detect(), "auto"));
    g_level.store(level, std::memory_order_relaxed);
  }
  return static_cast<KernelLevel>(level);
}

void SetKernelLevel(KernelLevel level) {
  g_level.store(static_cast<int>(level), std::memory_order_relaxed);
}

bool UsesVnni() {
  if (kPortable || !g_vnni.load(std::memory_order_relaxed)) return false;
  static const CpuFeatures have = CpuFeatures::Detect();
  return ActiveKernelLevel() == KernelLevel::kAvx2 ? have.avx_vnni : have.avx512_vnni;
}

void UseVnni(bool on) { g_vnni.store(on, std::memory_order_relaxed); }

bool DecodePrefetches() {
  if (const int set = g_prefetch.load(std::memory_order_relaxed); set >= 0) return set == 1;
  static const bool by_cpu = [] {
    const CpuFeatures have = CpuFeatures::Detect();
    return !(have.amd && have.avx512);
  }();
  return by_cpu;
}

void UseDecodePrefetch(bool on) { g_prefetch.store(on ? 1 : 0, std::memory_order_relaxed); }

absl::Status UseKernelLevel(std::string_view asked) {
  ASSIGN_OR_RETURN(const KernelLevel level, ChooseKernelLevel(CpuFeatures::Detect(), asked));
  SetKernelLevel(level);
  return absl::OkStatus();
}

std::string DescribeKernels() {
  const CpuFeatures have = CpuFeatures::Detect();
  std::vector<std::string> also;
  if (kPortable) {
    if (have.neon) also.push_back("NEON");
    if (have.dotprod) also.push_back("dot product");
    return absl::StrCat(
        KernelLevelName(ActiveKernelLevel()),
        also.empty() ? "" : absl::StrCat(" (", absl::StrJoin(also, ", "), " present)"));
  }
  if (have.avx512_bf16) also.push_back("BF16");
  if (have.avx512_vnni) also.push_back("VNNI");
  if (have.amx_bf16) also.push_back("AMX-BF16");
  if (have.amx_int8) also.push_back("AMX-INT8");
  std::vector<std::string> sets;  // "AVX-512 BF16, VNNI", "AVX-VNNI"
  if (!also.empty()) sets.push_back(absl::StrCat("AVX-512 ", absl::StrJoin(also, ", ")));
  if (have.avx_vnni) sets.push_back("AVX-VNNI");
  return absl::StrCat(
      KernelLevelName(ActiveKernelLevel()),
      sets.empty() ? "" : absl::StrCat(" (", absl::StrJoin(sets, "; "), " present)"));
}

}  // namespace shardserve::cpu
