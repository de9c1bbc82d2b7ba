// The model loaders against mutated model files (ctest fuzz.model_files): a deterministic mutator
// (fixed seed) corrupts one file of a small generated model at a time — the GGUF file (its
// header, metadata and tensor table mostly), the safetensors header, config.json and
// tokenizer.json (bytes, and JSON values swapped for hostile ones), and an FP8 checkpoint's
// safetensors file (anywhere) and config.json — and runs what a worker runs on
// a model directory: LoadModelConfig, Tokenizer::Load, Transformer::Load. Each must return a
// status; an exception that escapes, an abort or a crash ends this process and fails the tier, and
// ctest's timeout catches a hang. Prints how many files each loader refused and loaded.
//
// usage: model_files_fuzz [ITERATIONS_PER_FILE (600)] [SEED (1)]
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend/dtype.h"
#include "devtools/gen_model.h"
#include "devtools/gguf_convert.h"
#include "model/config.h"
#include "model/test_models.h"
#include "model/transformer.h"
#include "tokenizer/tokenizer.h"

namespace shardserve {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing::ReadFile;
using testing::WriteFile;

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}

  uint64_t Below(uint64_t n) { return n == 0 ? 0 : rng_() % n; }

  // Byte-level damage; positions fall in [0, focus) four times in five (the part of a file that
  // describes the rest), anywhere otherwise.
  std::string Bytes(std::string s, size_t focus) {
    if (s.empty()) return s;
    const int edits = 1 + static_cast<int>(Below(4));
    for (int e = 0; e < edits && !s.empty(); ++e) {
      const size_t region = Below(5) < 4 ? std::min(focus, s.size()) : s.size();
      const size_t at = Below(region);
      switch (Below(8)) {
        case 0:  // one bit
          s[at] = static_cast<char>(s[at] ^ (1 << Below(8)));
          break;
        case 1:  // a byte, often a boundary value
          s[at] = static_cast<char>(kBytes[Below(sizeof(kBytes))]);
          break;
        case 2: {  // a little-endian integer of 4 or 8 bytes
          const uint64_t v = kInts[Below(std::size(kInts))];
          const size_t width = Below(2) ? 8 : 4;
          for (size_t k = 0; k < width && at + k < s.size(); ++k) {
            s[at + k] = static_cast<char>((v >> (8 * k)) & 0xff);
          }
          break;
        }
        case 3:  // cut short
          s.resize(at);
          break;
        case 4:  // a run of bytes removed
          s.erase(at, 1 + Below(64));
          break;
        case 5:  // a run inserted
          s.insert(at, std::string(1 + Below(64), static_cast<char>(Below(256))));
          break;
        case 6: {  // a run copied over another place
          const size_t from = Below(region), n = 1 + Below(32);
          s.replace(at, std::min(n, s.size() - at), s.substr(from, n));
          break;
        }
        default:  // a random byte
          s[at] = static_cast<char>(Below(256));
          break;
      }
    }
    return s;
  }

  // A JSON document with one of its values (at any depth) replaced, removed or retyped; or, one
  // time in four, byte-level damage to its text.
  std::string Json(const std::string& text) {
    if (Below(4) == 0) return Bytes(text, text.size());
    json doc = json::parse(text);
    std::vector<json*> nodes;
    Collect(doc, nodes);
    json* target = nodes[Below(nodes.size())];
    switch (Below(3)) {
      case 0:
        *target = Hostile();
        break;
      case 1:  // a key removed from an object, or an element from an array
        if (target->is_object() && !target->empty()) {
          auto it = target->begin();
          std::advance(it, Below(target->size()));
          const std::string key = it.key();
          target->erase(key);
        } else if (target->is_array() && !target->empty()) {
          target->erase(target->begin() + static_cast<long>(Below(target->size())));
        } else {
          *target = Hostile();
        }
        break;
      default:  // a number nudged, a string changed
        if (target->is_number()) {
          *target = target->get<double>() * (Below(2) ? -1.0 : 1e6);
        } else if (target->is_string()) {
          *target = Bytes(target->get<std::string>(), 64) + "x";
          if (!IsValid(*target)) *target = "\xc3\xa9";
        } else {
          *target = Hostile();
        }
    }
    return doc.dump();
  }

 private:
  static constexpr unsigned char kBytes[] = {0x00, 0x01, 0x7f, 0x80, 0xb8, 0xc0, 0xfe,
                                             0xff, '"',  '{',  '[',  ',',  ':',  '\\'};
  static constexpr uint64_t kInts[] = {0,
                                       1,
                                       2,
                                       255,
                                       0x7fffffff,
                                       0x80000000,
                                       0xffffffff,
                                       0x100000000,
                                       uint64_t{1} << 40,
                                       0x7fffffffffffffff,
                                       0x8000000000000000,
                                       0xffffffffffffffff};

  static void Collect(json& j, std::vector<json*>& out) {
    out.push_back(&j);
    if (j.is_structured() && out.size() < 20000) {
      for (json& child : j) Collect(child, out);
    }
  }
  static bool IsValid(const json& j) {  // a string the JSON writer takes (UTF-8)
    try {
      (void)j.dump();
      return true;
    } catch (const json::exception&) {
      return false;
    }
  }
  json Hostile() {
    static const json kValues[] = {0,
                                   -1,
                                   1,
                                   2147483647,
                                   4294967295ULL,
                                   int64_t{1} << 53,
                                   100000000,
                                   std::numeric_limits<int64_t>::max(),
                                   -std::numeric_limits<int64_t>::max(),
                                   1e308,
                                   -1e308,
                                   1e-320,
                                   0.0,
                                   -0.0,
                                   0.5,
                                   "",
                                   "x",
                                   nullptr,
                                   true,
                                   json::array(),
                                   json::object(),
                                   json::array({1, 2, 3}),
                                   json::array({json::array({json::array()})})};
    return kValues[Below(std::size(kValues))];
  }

  std::mt19937_64 rng_;
};

struct Tally {
  int files = 0, config_refused = 0, tokenizer_refused = 0, weights_refused = 0, loaded = 0;
};

// What a worker does with a model directory. Statuses only; anything else ends the process.
void LoadAll(const std::string& dir, Tally& t) {
  ++t.files;
  if (!LoadModelConfig(dir).ok()) {
    ++t.config_refused;
    return;
  }
  if (!Tokenizer::Load(dir).ok()) {
    ++t.tokenizer_refused;
    return;
  }
  Transformer::Options o;
  o.num_threads = 1;
  if (!Transformer::Load(dir, o).ok()) {
    ++t.weights_refused;
    return;
  }
  ++t.loaded;
}

// The bytes of a safetensors file that describe it: the length word and the JSON header.
size_t SafetensorsHeader(const std::string& s) {
  if (s.size() < 8) return s.size();
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = (n << 8) | static_cast<unsigned char>(s[k]);
  return static_cast<size_t>(std::min<uint64_t>(s.size(), 8 + n));
}

int Run(int iterations, uint64_t seed) {
  testing::TempDir tmp;
  // A small model as safetensors (+ config.json, tokenizer.json) and the same as one GGUF file.
  GenModelOptions g = testing::SmallModel("llama", tmp.Sub("hf"));
  g.layers = 2;
  g.vocab = 300;
  if (absl::Status s = GenerateModel(g); !s.ok()) {
    std::fprintf(stderr, "gen-model: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  fs::create_directories(tmp.Sub("gguf"));
  if (absl::Status s = ConvertToGguf(tmp.Sub("hf"), tmp.Sub("gguf/model.gguf"), DType::kQ8_0);
      !s.ok()) {
    std::fprintf(stderr, "gguf: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  // And as a fine-grained FP8 checkpoint (E4M3 weights, F32 block scales beside them).
  GenModelOptions g8 = g;
  g8.out_dir = tmp.Sub("fp8");
  g8.fp8_block = 32;
  if (absl::Status s = GenerateModel(g8); !s.ok()) {
    std::fprintf(stderr, "gen-model --fp8-block: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  // And in blocks of 128 with columns in groups of 128: repacked and computed as FP8 (F8_128).
  GenModelOptions g128 = g8;
  g128.out_dir = tmp.Sub("fp8-128");
  g128.fp8_block = 128;
  g128.hidden = 128;
  g128.intermediate = 256;
  if (absl::Status s = GenerateModel(g128); !s.ok()) {
    std::fprintf(stderr, "gen-model --fp8-block 128: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  // And a DeepSeek-V3 (multi-head latent attention, grouped routing, a dense layer, YaRN).
  GenModelOptions ds = testing::SmallModel("deepseek_v3", tmp.Sub("ds"));
  ds.layers = 2;
  ds.vocab = 300;
  ds.q_lora_rank = 32;
  ds.groups = 2;
  ds.topk_groups = 1;
  ds.rope_scaling = "yarn";
  if (absl::Status s = GenerateModel(ds); !s.ok()) {
    std::fprintf(stderr, "gen-model --arch deepseek_v3: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  // And a gpt-oss (sinks, sliding layers, fused biased experts in MXFP4).
  GenModelOptions go = testing::SmallModel("gpt_oss", tmp.Sub("go"));
  go.layers = 2;
  go.vocab = 300;
  go.mxfp4 = true;  // its experts' bytes and E8M0 scales mutated too
  go.dtype = DType::kBF16;
  if (absl::Status s = GenerateModel(go); !s.ok()) {
    std::fprintf(stderr, "gen-model --arch gpt_oss: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  // Both as llama.cpp's GGUF (deepseek2 with k_b and v_b; gpt-oss with ggml's MXFP4 experts).
  for (const auto& [from, to, type] :
       {std::tuple{"ds", "ds-gguf", DType::kF32}, {"go", "go-gguf", DType::kBF16}}) {
    fs::create_directories(tmp.Sub(to));
    if (absl::Status s = ConvertToGguf(tmp.Sub(from), tmp.Sub(to) + "/model.gguf", type); !s.ok()) {
      std::fprintf(stderr, "gguf of %s: %s\n", from, std::string(s.message()).c_str());
      return 1;
    }
  }
  struct Target {
    std::string name, dir, file;
    enum { kBinary, kSafetensors, kWhole, kJson } kind;
  };
  const std::vector<Target> targets = {
      {"GGUF", tmp.Sub("gguf"), "model.gguf", Target::kBinary},
      {"safetensors", tmp.Sub("hf"), "model.safetensors", Target::kSafetensors},
      {"config.json", tmp.Sub("hf"), "config.json", Target::kJson},
      {"tokenizer.json", tmp.Sub("hf"), "tokenizer.json", Target::kJson},
      // Its header and its bytes (NaN codes, scales that are not finite) alike.
      {"FP8 safetensors", tmp.Sub("fp8"), "model.safetensors", Target::kWhole},
      {"FP8 config.json", tmp.Sub("fp8"), "config.json", Target::kJson},
      {"FP8 computed as FP8", tmp.Sub("fp8-128"), "model.safetensors", Target::kWhole},
      {"MLA safetensors", tmp.Sub("ds"), "model.safetensors", Target::kSafetensors},
      {"MLA config.json", tmp.Sub("ds"), "config.json", Target::kJson},
      {"gpt-oss MXFP4", tmp.Sub("go"), "model.safetensors", Target::kWhole},
      {"gpt-oss config", tmp.Sub("go"), "config.json", Target::kJson},
      {"MLA GGUF", tmp.Sub("ds-gguf"), "model.gguf", Target::kBinary},
      {"gpt-oss MXFP4 GGUF", tmp.Sub("go-gguf"), "model.gguf", Target::kWhole},
  };
  Mutator m(seed);
  int total = 0;
  for (const Target& t : targets) {
    const std::string path = t.dir + "/" + t.file;
    const std::string original = ReadFile(path);
    Tally before;
    LoadAll(t.dir, before);
    if (before.loaded != 1) {
      std::fprintf(stderr, "%s: the unmutated model does not load\n", t.name.c_str());
      return 1;
    }
    Tally tally;
    for (int i = 0; i < iterations; ++i) {
      const std::string mutated =
          t.kind == Target::kJson          ? m.Json(original)
          : t.kind == Target::kSafetensors ? m.Bytes(original, SafetensorsHeader(original))
          : t.kind == Target::kWhole       ? m.Bytes(original, original.size())
                                     : m.Bytes(original, std::min<size_t>(original.size(), 32768));
      WriteFile(path, mutated);
      LoadAll(t.dir, tally);
    }
    WriteFile(path, original);
    total += tally.files;
    std::printf(
        "%-15s %5d mutated files: %5d refused by the config, %5d by the tokenizer, %5d by the "
        "weights' loader; %5d loaded\n",
        t.name.c_str(), tally.files, tally.config_refused, tally.tokenizer_refused,
        tally.weights_refused, tally.loaded);
  }
  std::printf("PASS: %d mutated model files (seed %llu), every one refused or loaded, no abort\n",
              total, static_cast<unsigned long long>(seed));
  return 0;
}

}  // namespace
}  // namespace shardserve

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 600;
  const uint64_t seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1;
  return shardserve::Run(iterations, seed);
}
