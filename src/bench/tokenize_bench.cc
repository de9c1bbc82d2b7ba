#include "bench/tokenize_bench.h"

#include <chrono>
#include <cstdio>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/args.h"
#include "common/status.h"
#include "devtools/corpus.h"
#include "tokenizer/tokenizer.h"

namespace shardserve {

absl::Status RunTokenizeBench(const std::vector<std::string>& argv) {
  ASSIGN_OR_RETURN(Args a, Args::Parse(argv, {"model", "bytes"}, {}, "shardserve bench tokenize",
                                       kTokenizeBenchUsage));
  ASSIGN_OR_RETURN(std::string model, a.Require("model"));
  std::vector<size_t> sizes;
  for (absl::string_view v : absl::StrSplit(a.GetOr("bytes", "8192,65536,1048000"), ',')) {
    size_t n;
    if (!absl::SimpleAtoi(v, &n) || n < 2) {
      return absl::InvalidArgumentError("--bytes must list sizes of at least 2 bytes");
    }
    sizes.push_back(n);
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tok, Tokenizer::Load(model));
  const std::string english(DefaultCorpus());
  std::printf("%-12s %10s %12s %12s\n", "input", "bytes", "tokens", "seconds");
  for (size_t n : sizes) {
    std::string word, text;
    while (word.size() + 2 <= n) word += "he";
    while (text.size() < n) text += english;
    text.resize(n);
    for (const auto& [name, input] :
         {std::pair<const char*, const std::string&>{"one word", word}, {"text", text}}) {
      const auto t0 = std::chrono::steady_clock::now();
      auto ids = tok->Encode(input, false);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!ids.ok()) {
        std::printf("%-12s %10zu %12s %12.4f  (%s)\n", name, input.size(), "-", s,
                    std::string(ids.status().message()).c_str());
      } else {
        std::printf("%-12s %10zu %12zu %12.4f\n", name, input.size(), ids->size(), s);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace shardserve
