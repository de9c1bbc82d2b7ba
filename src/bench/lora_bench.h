#pragma once
// `shardserve bench lora`: what LoRA adapters cost a CPU rank (issue 54): decode throughput of a
// batch whose sequences run 1, 8 or 32 distinct adapters against the same batch on the base
// alone, and the time to read an adapter (PEFT's files), to put it in a slot and to swap it.
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardserve {

absl::Status RunLoraBench(const std::vector<std::string>& argv);
inline constexpr char kLoraBenchUsage[] =
    "--model DIR [--threads N --batch N --rank N --steps N --adapters 1,8,32]\n(decode with many "
    "LoRA adapters in one batch against the base; adapter load and swap time)";

}  // namespace shardserve
