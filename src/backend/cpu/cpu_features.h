#pragma once
// The instruction sets the CPU backend's kernels need, checked at run time. Only the kernels
// (backend/cpu: cpu_backend, kernels, quant, sampling) are compiled for x86-64-v3 (AVX2, FMA,
// F16C); everything else is built for the baseline, so a CPU without them gets this error from
// the model loader instead of an illegal instruction. A wider CPU's kernels (AVX-512, AVX-VNNI)
// would be built alongside in their own sources and chosen here by what the CPU reports.
#include "absl/status/status.h"

namespace shardserve::cpu {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  static CpuFeatures Detect();  // this machine's, from CPUID
};

// FailedPrecondition naming each missing feature when `have` cannot run the kernels.
absl::Status CheckCpu(const CpuFeatures& have = CpuFeatures::Detect());

}  // namespace shardserve::cpu
