#pragma once
// `shardserve bench kernels [--threads N] [--cols K]`: the CPU matrix-vector product (decode,
// batch 1) for each weight type, on a matrix that stays in the L2 cache (128 rows: the kernel's
// own speed) and on one of 512 MiB, far larger than the caches (its 256 distinct rows repeated:
// with the memory), in GB/s of weights read, beside the read bandwidth of the same threads. K is
// a multiple of 32; types whose block does not divide it (the K-quants' 256) are skipped.
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardserve {

absl::Status RunKernelsBench(const std::vector<std::string>& argv);
inline constexpr char kKernelsBenchUsage[] =
    "[--threads 1] [--cols 2048] [--kernels "
    "auto|avx2|avx512|avx512bf16|avx512int8|portable]\n(matrix-vector "
    "GB/s per weight type, in L2 and from memory, at --kernels or else SHARDSERVE_CPU_KERNELS's "
    "level; prefill GFLOP/s per type at each CPU kernel level)";

}  // namespace shardserve
