#pragma once
// Reads GGUF files (llama.cpp's model format, versions 2 and 3) by mmap and validates them
// completely before anything uses them: magic and version, every metadata key and value (types,
// string and array lengths against the bytes left), tensor infos (dimensions, element type,
// whole blocks along the first dimension), the alignment, and every tensor's bytes inside the
// data section without overlaps. Errors name the file, the key or tensor, and the numbers.
//
// A model split by llama.cpp's gguf-split is one GgufFile over its parts
// PREFIX-0000i-of-0000N.gguf (any part's path names the set): the first part holds the metadata,
// every part declares split.no (from 0) and split.count, the first split.tensors.count; each
// part is validated as above, and a part missing, numbered wrongly or repeating another's tensor
// is refused by name.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "common/mapped_file.h"

namespace shardserve {

// ggml's element types, by their numbers in the file.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kBF16 = 30,
  kMXFP4 = 39,
};
// The name llama.cpp gives a type ("Q4_K"), or nullopt for a number it does not know.
std::optional<std::string> GgmlTypeName(uint32_t type);
// Values per block and bytes per block (1 value per "block" for F32/F16/BF16).
struct GgmlBlock {
  int64_t values = 0;
  int64_t bytes = 0;
};
std::optional<GgmlBlock> GgmlBlockOf(uint32_t type);

// GGUF metadata value types, by their numbers in the file.
enum GgufValueType : uint32_t {
  kGgufU8 = 0,
  kGgufI8,
  kGgufU16,
  kGgufI16,
  kGgufU32,
  kGgufI32,
  kGgufF32,
  kGgufBool,
  kGgufString,
  kGgufArray,
  kGgufU64,
  kGgufI64,
  kGgufF64,
};

// A metadata value: a scalar, a string, or an array of one of those.
struct GgufValue;
using GgufArray = std::vector<GgufValue>;
struct GgufValue {
  uint32_t type = kGgufU8;  // a GgufValueType
  std::variant<uint64_t, int64_t, double, bool, std::string, GgufArray> v;
};

struct GgufTensor {
  std::string name;
  GgmlType type = GgmlType::kF32;
  std::vector<int64_t> dims;  // GGUF order: dims[0] varies fastest (a row's length)
  const uint8_t* data = nullptr;
  int part = 0;         // the file of a split model holding it (0: the first, or the only one)
  uint64_t offset = 0;  // from the start of its part's data section
  uint64_t bytes = 0;
};

// A split part's name, PREFIX-%05d-of-%05d.gguf (gguf-split's, numbered from 1), or nullopt.
struct GgufSplitName {
  std::string prefix;
  int number = 0, count = 0;
};
std::optional<GgufSplitName> ParseGgufSplitName(const std::string& path);

class GgufFile {
 public:
  static absl::StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);

  const std::string& path(int part = 0) const { return files_[part]->path(); }
  int parts() const { return static_cast<int>(files_.size()); }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  const std::map<std::string, GgufTensor>& tensors() const { return tensors_; }
  // The first byte of a part's mapping.
  const uint8_t* file_data(int part = 0) const { return files_[part]->data(); }
  // MappedFile::DropResidentPages (after the weights went to a GPU).
  void DropResidentPages() const {
    for (const auto& f : files_) f->DropResidentPages();
  }

  // Typed metadata: NotFound naming a missing key, InvalidArgument naming a key of another type.
  absl::StatusOr<std::string> GetString(const std::string& key) const;
  absl::StatusOr<uint64_t> GetUint(const std::string& key) const;  // any unsigned type
  absl::StatusOr<double> GetFloat(const std::string& key) const;   // float32 or float64
  absl::StatusOr<const GgufArray*> GetArray(const std::string& key) const;

 private:
  GgufFile() = default;
  static absl::StatusOr<std::unique_ptr<GgufFile>> OpenPart(const std::string& path);
  // Adds `part`'s tensors (part number `index`), refusing a name already present.
  absl::Status Merge(GgufFile& part, int index);
  absl::StatusOr<const GgufValue*> Find(const std::string& key) const;
  absl::Status NotA(const std::string& key, const GgufValue& v, const char* want) const;
  std::vector<std::unique_ptr<MappedFile>> files_;  // the parts, in order
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::map<std::string, GgufValue> metadata_;
  std::map<std::string, GgufTensor> tensors_;
};

}  // namespace shardserve
