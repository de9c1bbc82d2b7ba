#pragma once
// `shardserve bench disk --model DIR [--threads 1,4,8 --repeat 3 --load]`: how fast a model's
// weights reach memory from its disk, beside dd: the page cache dropped before each run (as root;
// otherwise the figures say they came from memory), `dd bs=16M` over the weight files (the disk's
// sequential read), then the loader's reading (common/prefetch.h: 16 MiB pieces, N threads) over
// the same bytes, in GB/s and as a share of dd's (medians of --repeat rounds); with --load, a whole
// stage's load (Transformer::Load, TP=1) with and without the reading first.
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardserve {

absl::Status RunDiskBench(const std::vector<std::string>& argv);
inline constexpr char kDiskBenchUsage[] =
    "--model DIR [--threads 1,4,8 --repeat 3 --load]\n"
    "(weights from disk to memory, page cache dropped, beside dd)";

}  // namespace shardserve
