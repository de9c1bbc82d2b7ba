#pragma once
// Reads Hugging Face safetensors files by mmap (weights are never copied into private memory)
// and validates them completely: header length and JSON, dtypes, shape × dtype size == byte
// range, ranges inside the file, no overlaps. Errors name the file, the tensor and the numbers.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "backend/dtype.h"
#include "common/mapped_file.h"
#include "model/gguf.h"

namespace shardserve {

// A tensor inside a mapped file. `data` stays valid while the owning file is open.
struct TensorView {
  std::string name;
  std::string file;  // path of the file it lives in, for messages
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t nbytes = 0;
  uint64_t file_offset = 0;  // where data starts in the file (for reading slices with pread)
  // F8_E4M3 weights: `<name>_scale_inv`, their scale per block (model/fp8.h), which WeightStore
  // pairs them with (a pointer into its map).
  const TensorView* scale = nullptr;

  int64_t numel() const;
  std::string ShapeString() const;  // "[512,256]"
};

class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // MappedFile::DropResidentPages: the touched pages leave this process's resident memory.
  void DropResidentPages() const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  std::unique_ptr<MappedFile> file_;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All weights of a model directory: model.safetensors, or the shards listed by
// model.safetensors.index.json (every listed tensor must be in the file the index names). Each
// F8_E4M3 matrix is paired with its `<name>_scale_inv` (F32 or BF16, two dimensions), or the
// directory is refused naming the one missing; scales beside a weight that is not FP8 are refused.
class WeightStore {
 public:
  // The weights of a model directory's safetensors files, or of the GGUF file the path names.
  static absl::StatusOr<std::unique_ptr<WeightStore>> Open(const std::string& model_dir);

  bool Has(const std::string& name) const { return tensors_.count(name) > 0; }
  // The tensor, or NotFound naming it. With `shape`, a mismatch is an error naming both shapes.
  absl::StatusOr<TensorView> Get(const std::string& name) const;
  absl::StatusOr<TensorView> Get(const std::string& name, const std::vector<int64_t>& shape) const;
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  size_t total_bytes() const;
  // SafetensorsFile::DropResidentPages of every file (after the weights went to a GPU).
  void DropResidentPages() const;

 private:
  absl::Status PairFp8Scales();
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::unique_ptr<GgufFile> gguf_;                 // or a GGUF file (model/gguf_model.h)
  std::vector<std::unique_ptr<uint8_t[]>> owned_;  // its tensors rearranged in memory
  std::map<std::string, TensorView> tensors_;
};

// Writes one safetensors file: the header for `specs`, then each tensor's bytes as `fill`
// produces them (one tensor in memory at a time). Data offsets are contiguous, 8-byte aligned.
struct TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  size_t nbytes() const;
};
absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorSpec>& specs,
                              const std::function<void(size_t, std::vector<uint8_t>&)>& fill,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace shardserve
