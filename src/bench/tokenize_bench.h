#pragma once
// `shardserve bench tokenize --model DIR [--bytes 8192,65536,1048576]`: the model's tokenizer on
// one long word ("he" repeated to each size, the case that made merges quadratic) and on English
// text of the same size: seconds and tokens per size, with no token limit.
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardserve {

absl::Status RunTokenizeBench(const std::vector<std::string>& argv);
inline constexpr char kTokenizeBenchUsage[] =
    "--model DIR [--bytes 8192,65536,1048000]\n(tokenizer throughput)";

}  // namespace shardserve
