#pragma once
// Writes GGUF v3 files (what model/gguf.h reads): typed metadata, then the tensor infos, then each
// tensor's bytes at the file's alignment (general.alignment, 32 unless set). For generated test
// models; a tensor's bytes must already be in its ggml type's layout.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "model/gguf.h"

namespace shardserve {

class GgufWriter {
 public:
  static GgufValue String(std::string s) { return {kGgufString, std::move(s)}; }
  static GgufValue U16(uint16_t v) { return {kGgufU16, uint64_t{v}}; }
  static GgufValue U32(uint32_t v) { return {kGgufU32, uint64_t{v}}; }
  static GgufValue I32(int32_t v) { return {kGgufI32, int64_t{v}}; }
  static GgufValue F32(float v) { return {kGgufF32, double{v}}; }
  static GgufValue Bool(bool v) { return {kGgufBool, v}; }
  // An array of values of one type (the type of its first element; uint8 when empty).
  static GgufValue Array(GgufArray items) { return {kGgufArray, std::move(items)}; }

  void Set(const std::string& key, GgufValue value);
  // dims in GGUF order (dims[0] the row length); bytes: the data in the type's block layout.
  void AddTensor(const std::string& name, GgmlType type, std::vector<int64_t> dims,
                 std::string bytes);
  absl::Status Write(const std::string& path) const;

 private:
  std::vector<std::pair<std::string, GgufValue>> metadata_;
  struct Tensor {
    std::string name;
    GgmlType type;
    std::vector<int64_t> dims;
    std::string bytes;
  };
  std::vector<Tensor> tensors_;
};

}  // namespace shardserve
