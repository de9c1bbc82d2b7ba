#pragma once
#include <string_view>

namespace shardserve {

// The text gen-model trains its tokenizer on when no --corpus file is given.
std::string_view DefaultCorpus();

}  // namespace shardserve
