#pragma once
// Test helpers: a temporary directory and small generated models inside it.
#include <cstdint>
#include <string>
#include <vector>

#include "devtools/gen_model.h"

namespace shardserve::testing {

class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string Sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Small model options (2 layers, hidden 64) for `arch`, to be adjusted by the test.
GenModelOptions SmallModel(const std::string& arch, const std::string& out_dir);
// Writes a small model and fails the test on error.
std::string WriteModel(const GenModelOptions& options);

// Rewrites the safetensors file at `path` without the tensor `name`, or with it as given (fails
// the test on error).
void RemoveTensor(const std::string& path, const std::string& name);
void AddTensor(const std::string& path, const std::string& name, DType dtype,
               const std::vector<int64_t>& shape, const std::vector<uint8_t>& bytes);

std::string ReadFile(const std::string& path);
void WriteFile(const std::string& path, const std::string& data);

}  // namespace shardserve::testing
