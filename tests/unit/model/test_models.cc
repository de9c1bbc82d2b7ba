#include "model/test_models.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "model/safetensors.h"

namespace shardserve::testing {

TempDir::TempDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "shardserve-test-XXXXXX").string();
  path_ = mkdtemp(tmpl.data());
}

TempDir::~TempDir() { std::filesystem::remove_all(path_); }

GenModelOptions SmallModel(const std::string& arch, const std::string& out_dir) {
  GenModelOptions o;
  o.arch = arch;
  o.out_dir = out_dir;
  o.layers = 2;
  o.hidden = 64;
  o.intermediate = 96;
  o.heads = 4;
  o.kv_heads = 2;
  o.vocab = 400;
  o.dtype = DType::kF32;
  o.seed = 3;
  o.max_position = 256;
  return o;
}

std::string WriteModel(const GenModelOptions& options) {
  absl::Status s = GenerateModel(options);
  EXPECT_TRUE(s.ok()) << s;
  return options.out_dir;
}

namespace {

// Rewrites the safetensors file at `path` without the tensor `name`, with `added` (and its bytes).
void Rewrite(const std::string& path, const std::string& name, const TensorSpec* added = nullptr,
             const std::vector<uint8_t>* bytes = nullptr) {
  std::vector<TensorSpec> specs;
  std::vector<std::vector<uint8_t>> data;
  {
    auto f = SafetensorsFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status();
    for (const auto& [n, t] : (*f)->tensors()) {
      if (n == name) continue;
      specs.push_back({n, t.dtype, t.shape});
      const auto* p = static_cast<const uint8_t*>(t.data);
      data.emplace_back(p, p + t.nbytes);
    }
  }
  if (added != nullptr) {
    specs.push_back(*added);
    data.push_back(*bytes);
  }
  const std::string rewritten = absl::StrCat(path, ".new");
  ASSERT_TRUE(WriteSafetensors(rewritten, specs, [&](size_t i, std::vector<uint8_t>& b) {
                b = data[i];
              }).ok());
  std::filesystem::rename(rewritten, path);
}

}  // namespace

void RemoveTensor(const std::string& path, const std::string& name) { Rewrite(path, name); }

void AddTensor(const std::string& path, const std::string& name, DType dtype,
               const std::vector<int64_t>& shape, const std::vector<uint8_t>& bytes) {
  const TensorSpec spec{name, dtype, shape};
  Rewrite(path, name, &spec, &bytes);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteFile(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << data;
}

}  // namespace shardserve::testing
