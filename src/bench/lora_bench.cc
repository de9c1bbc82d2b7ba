#include "bench/lora_bench.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <numeric>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/args.h"
#include "common/status.h"
#include "devtools/gen_adapter.h"
#include "model/lora.h"
#include "model/transformer.h"

namespace shardserve {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

absl::Status RunLoraBench(const std::vector<std::string>& argv) {
  ASSIGN_OR_RETURN(Args a,
                   Args::Parse(argv, {"model", "threads", "batch", "rank", "steps", "adapters"}, {},
                               "shardserve bench lora", kLoraBenchUsage));
  ASSIGN_OR_RETURN(const std::string dir, a.Require("model"));
  ASSIGN_OR_RETURN(const int64_t threads, a.GetInt("threads", 2));
  ASSIGN_OR_RETURN(const int64_t batch, a.GetInt("batch", 32));
  ASSIGN_OR_RETURN(const int64_t rank, a.GetInt("rank", 16));
  ASSIGN_OR_RETURN(const int64_t steps, a.GetInt("steps", 16));
  std::vector<int64_t> counts;
  for (absl::string_view n : absl::StrSplit(a.GetOr("adapters", "1,8,32"), ',')) {
    int64_t k = 0;
    if (!absl::SimpleAtoi(n, &k) || k < 1 || k > 1024) {
      return absl::InvalidArgumentError(absl::StrCat("--adapters: '", n, "' is not in [1, 1024]"));
    }
    counts.push_back(k);
  }
  if (batch < 1 || batch > 4096 || rank < 1 || rank > 4096 || steps < 1 || threads < 1) {
    return absl::InvalidArgumentError("--batch, --rank, --steps and --threads must be positive");
  }
  const int64_t slots = *std::max_element(counts.begin(), counts.end());
  Transformer::Options o;
  o.num_threads = static_cast<int>(threads);
  o.lora_slots = static_cast<int>(slots);
  o.lora_max_rank = rank;
  ASSIGN_OR_RETURN(auto model, Transformer::Load(dir, o));
  const ModelConfig& c = model->config();

  // The adapters as PEFT would write them, read back (parse and check), then put in their slots.
  const std::string scratch =
      (std::filesystem::temp_directory_path() / absl::StrCat("shardserve-lora-bench-", getpid()))
          .string();
  std::vector<double> write_s, read_s, prepare_s, install_s;
  std::vector<PreparedLora> prepared;
  LoraLimits limits;
  limits.max_rank = rank;
  size_t file_bytes = 0;
  for (int64_t k = 0; k < slots; ++k) {
    const std::string at = absl::StrCat(scratch, "/", k);
    auto t0 = Clock::now();
    AdapterOptions ao;
    ao.rank = rank;
    ao.seed = static_cast<uint64_t>(k + 1);
    RETURN_IF_ERROR(WriteRandomAdapter(at, c, ao));
    write_s.push_back(Since(t0));
    file_bytes = std::filesystem::file_size(at + "/adapter_model.safetensors");
    t0 = Clock::now();
    ASSIGN_OR_RETURN(LoraAdapter adapter, LoraAdapter::Load(at, c, limits));
    read_s.push_back(Since(t0));
    // A rank lays out its share off the step thread (prepare), then puts it in a slot between
    // steps (install: what running sequences wait for).
    t0 = Clock::now();
    ASSIGN_OR_RETURN(PreparedLora p, model->PrepareLora(adapter));
    prepare_s.push_back(Since(t0));
    t0 = Clock::now();
    RETURN_IF_ERROR(model->InstallLora(static_cast<int>(k), p));
    install_s.push_back(Since(t0));
    prepared.push_back(std::move(p));
  }
  // A swap between steps: a slot emptied and given another adapter already prepared.
  std::vector<double> swap_s;
  for (int64_t k = 0; k < std::min<int64_t>(slots, 8); ++k) {
    const auto t0 = Clock::now();
    RETURN_IF_ERROR(model->UnloadLora(static_cast<int>(k)));
    RETURN_IF_ERROR(model->InstallLora(static_cast<int>(k), prepared[(k + 1) % slots]));
    swap_s.push_back(Since(t0));
  }
  std::filesystem::remove_all(scratch);
  std::printf(
      "model: %s  layers %lld hidden %lld intermediate %lld  threads %lld  batch %lld  "
      "adapters of rank %lld on every projection (%.1f MB each as F32 files, %.1f MB in a slot)\n",
      c.architecture.c_str(), (long long)c.num_layers, (long long)c.hidden_size,
      (long long)c.intermediate_size, (long long)threads, (long long)batch, (long long)rank,
      file_bytes / 1e6, model->lora_bytes(0) / 1e6);
  std::printf(
      "adapter (median of %lld): written %.1f ms, read and checked %.1f ms, laid out off the step "
      "thread %.1f ms, put in a slot between steps %.3f ms; swapped between steps (slot emptied, "
      "another put in) %.3f ms\n",
      (long long)slots, 1e3 * Median(write_s), 1e3 * Median(read_s), 1e3 * Median(prepare_s),
      1e3 * Median(install_s), 1e3 * Median(swap_s));

  // Decode: `batch` sequences after a prompt of 8 tokens each, then `steps` steps of one token
  // each, the sequences' adapters k distinct ones in turn (0: the base alone).
  auto decode = [&](int64_t distinct) -> absl::StatusOr<double> {
    ASSIGN_OR_RETURN(auto cache, model->NewKvCache(batch * ((8 + steps) / 16 + 2) * 16));
    std::vector<SequenceKv> kv(batch);
    std::vector<SequenceChunk> chunks(batch);
    for (int64_t i = 0; i < batch; ++i) {
      chunks[i].kv = &kv[i];
      chunks[i].lora_slot = distinct == 0 ? -1 : static_cast<int32_t>(i % distinct);
      for (int t = 0; t < 8; ++t) {
        chunks[i].tokens.push_back(static_cast<int32_t>((i * 131 + t * 17 + 1) % c.vocab_size));
      }
    }
    RETURN_IF_ERROR(model->Run(chunks, *cache));
    RETURN_IF_ERROR(model->Greedy(0, nullptr).status());
    std::vector<double> times;
    for (int64_t s = 0; s < steps; ++s) {
      for (int64_t i = 0; i < batch; ++i) {
        chunks[i].tokens = {static_cast<int32_t>((i * 7919 + s * 31) % c.vocab_size)};
      }
      const auto t0 = Clock::now();
      RETURN_IF_ERROR(model->Run(chunks, *cache));
      RETURN_IF_ERROR(model->Greedy(0, nullptr).status());
      times.push_back(Since(t0));
    }
    return static_cast<double>(batch) / Median(times);
  };
  // The base before and after the adapters' runs, the faster kept (a conservative ratio on a
  // machine whose speed drifts).
  ASSIGN_OR_RETURN(const double base_before, decode(0));
  std::vector<std::pair<int64_t, double>> with;
  for (int64_t k : counts) {
    ASSIGN_OR_RETURN(const double tokens, decode(k));
    with.emplace_back(k, tokens);
  }
  ASSIGN_OR_RETURN(const double base_after, decode(0));
  const double base = std::max(base_before, base_after);
  std::printf(
      "decode batch %lld, base alone: %.1f tokens/s (median step; %.1f before, %.1f after "
      "the adapters' runs)\n",
      (long long)batch, base, base_before, base_after);
  for (const auto& [k, tokens] : with) {
    std::printf("decode batch %lld, %lld distinct adapter(s): %.1f tokens/s = %.2fx the base\n",
                (long long)batch, (long long)k, tokens, tokens / base);
  }
  return absl::OkStatus();
}

}  // namespace shardserve
