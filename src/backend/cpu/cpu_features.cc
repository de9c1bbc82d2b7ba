#include "backend/cpu/cpu_features.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardserve::cpu {

CpuFeatures CpuFeatures::Detect() {
  __builtin_cpu_init();
  CpuFeatures f;
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.f16c = __builtin_cpu_supports("f16c");
  return f;
}

absl::Status CheckCpu(const CpuFeatures& have) {
  std::vector<std::string> missing;
  if (!have.avx2) missing.push_back("AVX2");
  if (!have.fma) missing.push_back("FMA");
  if (!have.f16c) missing.push_back("F16C");
  if (missing.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "the CPU backend's kernels need AVX2, FMA and F16C (x86-64-v3); this CPU lacks ",
      absl::StrJoin(missing, ", "), " (a GPU backend, or a CPU that has them, can serve it)"));
}

}  // namespace shardserve::cpu
