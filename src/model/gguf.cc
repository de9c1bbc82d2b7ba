#include "model/gguf.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "common/text.h"

namespace shardserve {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read little-endian
constexpr uint64_t kMaxStringBytes = uint64_t{1} << 24;
constexpr uint64_t kMaxArrayElements = uint64_t{1} << 24;
constexpr uint64_t kMaxTensorElements = uint64_t{1} << 40;
constexpr uint32_t kMaxDims = 4;
constexpr int kMaxArrayDepth = 2;  // an array of arrays, no deeper

const char* const kValueTypeNames[] = {"uint8",  "int8",    "uint16", "int16",  "uint32",
                                       "int32",  "float32", "bool",   "string", "array",
                                       "uint64", "int64",   "float64"};
const char* ValueTypeName(uint32_t t) { return t <= kGgufF64 ? kValueTypeNames[t] : "unknown"; }

struct TypeInfo {
  GgmlType type;
  const char* name;
  GgmlBlock block;
};
constexpr TypeInfo kTypes[] = {
    {GgmlType::kF32, "F32", {1, 4}},       {GgmlType::kF16, "F16", {1, 2}},
    {GgmlType::kQ4_0, "Q4_0", {32, 18}},   {GgmlType::kQ4_1, "Q4_1", {32, 20}},
    {GgmlType::kQ5_0, "Q5_0", {32, 22}},   {GgmlType::kQ5_1, "Q5_1", {32, 24}},
    {GgmlType::kQ8_0, "Q8_0", {32, 34}},   {GgmlType::kQ8_1, "Q8_1", {32, 36}},
    {GgmlType::kQ2_K, "Q2_K", {256, 84}},  {GgmlType::kQ3_K, "Q3_K", {256, 110}},
    {GgmlType::kQ4_K, "Q4_K", {256, 144}}, {GgmlType::kQ5_K, "Q5_K", {256, 176}},
    {GgmlType::kQ6_K, "Q6_K", {256, 210}}, {GgmlType::kQ8_K, "Q8_K", {256, 292}},
    {GgmlType::kBF16, "BF16", {1, 2}},     {GgmlType::kMXFP4, "MXFP4", {32, 17}},
};
const TypeInfo* FindType(uint32_t type) {
  for (const TypeInfo& t : kTypes) {
    if (static_cast<uint32_t>(t.type) == type) return &t;
  }
  return nullptr;
}

// Reads the file front to back; every read first checks that the bytes are there.
class Cursor {
 public:
  Cursor(const uint8_t* data, uint64_t size, const std::string& path)
      : data_(data), size_(size), path_(path) {}
  uint64_t pos() const { return pos_; }
  uint64_t left() const { return size_ - pos_; }

  absl::Status Need(uint64_t bytes, const std::string& what) const {
    if (bytes > left()) {
      return absl::InvalidArgumentError(absl::StrCat(path_, ": ", what, " at byte ", pos_,
                                                     " needs ", bytes, " bytes; the file has ",
                                                     left(), " left"));
    }
    return absl::OkStatus();
  }
  template <typename T>
  absl::StatusOr<T> Read(const std::string& what) {
    RETURN_IF_ERROR(Need(sizeof(T), what));
    T v;
    std::memcpy(&v, data_ + pos_, sizeof(T));  // little-endian, as the format and every host
    pos_ += sizeof(T);
    return v;
  }
  absl::StatusOr<std::string> String(const std::string& what) {
    ASSIGN_OR_RETURN(uint64_t n, Read<uint64_t>(what + " (length)"));
    if (n > kMaxStringBytes) {
      return absl::InvalidArgumentError(absl::StrCat(path_, ": ", what, " at byte ", pos_ - 8,
                                                     " is ", n, " bytes long (at most ",
                                                     kMaxStringBytes, ")"));
    }
    RETURN_IF_ERROR(Need(n, what));
    std::string s(reinterpret_cast<const char*>(data_ + pos_), n);
    if (!IsValidUtf8(s)) {  // GGUF strings are UTF-8; the tokenizer's JSON would refuse it later
      return absl::InvalidArgumentError(
          absl::StrCat(path_, ": ", what, " at byte ", pos_, " is not valid UTF-8"));
    }
    pos_ += n;
    return s;
  }

 private:
  const uint8_t* data_;
  uint64_t size_;
  uint64_t pos_ = 0;
  const std::string& path_;
};

uint64_t FixedSize(uint32_t type) {
  switch (type) {
    case kGgufU8:
    case kGgufI8:
    case kGgufBool:
      return 1;
    case kGgufU16:
    case kGgufI16:
      return 2;
    case kGgufU32:
    case kGgufI32:
    case kGgufF32:
      return 4;
    case kGgufU64:
    case kGgufI64:
    case kGgufF64:
      return 8;
    default:
      return 0;
  }
}

absl::StatusOr<GgufValue> ReadValue(Cursor& c, uint32_t type, int depth, const std::string& path,
                                    const std::string& key) {
  const std::string what = absl::StrCat("metadata '", key, "'");
  GgufValue out;
  out.type = type;
  switch (type) {
    case kGgufU8: {
      ASSIGN_OR_RETURN(uint8_t v, c.Read<uint8_t>(what));
      out.v = uint64_t{v};
      break;
    }
    case kGgufU16: {
      ASSIGN_OR_RETURN(uint16_t v, c.Read<uint16_t>(what));
      out.v = uint64_t{v};
      break;
    }
    case kGgufU32: {
      ASSIGN_OR_RETURN(uint32_t v, c.Read<uint32_t>(what));
      out.v = uint64_t{v};
      break;
    }
    case kGgufU64: {
      ASSIGN_OR_RETURN(uint64_t v, c.Read<uint64_t>(what));
      out.v = v;
      break;
    }
    case kGgufI8: {
      ASSIGN_OR_RETURN(int8_t v, c.Read<int8_t>(what));
      out.v = int64_t{v};
      break;
    }
    case kGgufI16: {
      ASSIGN_OR_RETURN(int16_t v, c.Read<int16_t>(what));
      out.v = int64_t{v};
      break;
    }
    case kGgufI32: {
      ASSIGN_OR_RETURN(int32_t v, c.Read<int32_t>(what));
      out.v = int64_t{v};
      break;
    }
    case kGgufI64: {
      ASSIGN_OR_RETURN(int64_t v, c.Read<int64_t>(what));
      out.v = v;
      break;
    }
    case kGgufF32: {
      ASSIGN_OR_RETURN(float v, c.Read<float>(what));
      out.v = double{v};
      break;
    }
    case kGgufF64: {
      ASSIGN_OR_RETURN(double v, c.Read<double>(what));
      out.v = v;
      break;
    }
    case kGgufBool: {
      ASSIGN_OR_RETURN(uint8_t v, c.Read<uint8_t>(what));
      if (v > 1) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": ", what, " is a bool of value ", int{v}, " (0 or 1)"));
      }
      out.v = v == 1;
      break;
    }
    case kGgufString: {
      ASSIGN_OR_RETURN(std::string s, c.String(what));
      out.v = std::move(s);
      break;
    }
    case kGgufArray: {
      if (depth >= kMaxArrayDepth) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": ", what, " nests arrays deeper than ", kMaxArrayDepth));
      }
      ASSIGN_OR_RETURN(uint32_t elem, c.Read<uint32_t>(what + " (element type)"));
      ASSIGN_OR_RETURN(uint64_t n, c.Read<uint64_t>(what + " (element count)"));
      if (elem > kGgufF64) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": ", what, " has elements of unknown type ", elem));
      }
      if (n > kMaxArrayElements) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": ", what, " has ", n, " elements (at most ", kMaxArrayElements, ")"));
      }
      // The smallest element (a fixed size, or a string's or array's length words) times the
      // count must fit in what is left, before anything is allocated.
      const uint64_t least = elem == kGgufString ? 8 : elem == kGgufArray ? 12 : FixedSize(elem);
      RETURN_IF_ERROR(c.Need(n * least, what + " (elements)"));
      GgufArray a;
      a.reserve(n);
      for (uint64_t i = 0; i < n; ++i) {
        ASSIGN_OR_RETURN(GgufValue v, ReadValue(c, elem, depth + 1, path, key));
        a.push_back(std::move(v));
      }
      out.v = std::move(a);
      break;
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": ", what, " has unknown value type ", type));
  }
  return out;
}

}  // namespace

std::optional<std::string> GgmlTypeName(uint32_t type) {
  const TypeInfo* t = FindType(type);
  if (t == nullptr) return std::nullopt;
  return std::string(t->name);
}

std::optional<GgmlBlock> GgmlBlockOf(uint32_t type) {
  const TypeInfo* t = FindType(type);
  if (t == nullptr) return std::nullopt;
  return t->block;
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::OpenPart(const std::string& path) {
  std::unique_ptr<GgufFile> f(new GgufFile());
  ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> mapped, MappedFile::Open(path));
  f->files_.push_back(std::move(mapped));
  const MappedFile& file = *f->files_[0];
  Cursor c(file.data(), file.size(), path);
  auto bad = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", parts...));
  };

  ASSIGN_OR_RETURN(uint32_t magic, c.Read<uint32_t>("the magic"));
  if (magic != kMagic) return bad("not a GGUF file (magic 0x", absl::Hex(magic), ")");
  ASSIGN_OR_RETURN(f->version_, c.Read<uint32_t>("the version"));
  if (f->version_ != 2 && f->version_ != 3) {
    return bad("GGUF version ", f->version_, " (versions 2 and 3 are read)");
  }
  ASSIGN_OR_RETURN(uint64_t n_tensors, c.Read<uint64_t>("the tensor count"));
  ASSIGN_OR_RETURN(uint64_t n_kv, c.Read<uint64_t>("the metadata count"));
  // Each metadata entry takes at least 13 bytes, each tensor info at least 32.
  if (n_kv > c.left() / 13 || n_tensors > c.left() / 32 || n_kv * 13 + n_tensors * 32 > c.left()) {
    return bad(n_kv, " metadata entries and ", n_tensors, " tensor infos do not fit in the ",
               c.left(), " bytes after the header");
  }

  for (uint64_t i = 0; i < n_kv; ++i) {
    ASSIGN_OR_RETURN(std::string key, c.String(absl::StrCat("metadata key ", i)));
    ASSIGN_OR_RETURN(uint32_t type, c.Read<uint32_t>(absl::StrCat("metadata '", key, "' type")));
    ASSIGN_OR_RETURN(GgufValue v, ReadValue(c, type, 0, path, key));
    if (!f->metadata_.emplace(key, std::move(v)).second) {
      return bad("metadata key '", key, "' appears twice");
    }
  }
  if (auto it = f->metadata_.find("general.alignment"); it != f->metadata_.end()) {
    const uint64_t* a = std::get_if<uint64_t>(&it->second.v);
    if (it->second.type != kGgufU32 || *a == 0 || (*a & (*a - 1)) != 0) {
      return bad("general.alignment must be a uint32 power of two");
    }
    f->alignment_ = *a;
  }

  std::vector<GgufTensor> infos;
  infos.reserve(n_tensors);
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensor t;
    ASSIGN_OR_RETURN(t.name, c.String(absl::StrCat("tensor name ", i)));
    const std::string what = absl::StrCat("tensor '", t.name, "'");
    ASSIGN_OR_RETURN(uint32_t n_dims, c.Read<uint32_t>(what + " (dimensions)"));
    if (n_dims == 0 || n_dims > kMaxDims) {
      return bad(what, " has ", n_dims, " dimensions (1 to ", kMaxDims, ")");
    }
    uint64_t numel = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      ASSIGN_OR_RETURN(uint64_t dim, c.Read<uint64_t>(what + " (dimension)"));
      if (dim == 0 || dim > kMaxTensorElements || numel * dim > kMaxTensorElements) {
        return bad(what, " has dimension ", d, " of ", dim, " (the tensor may hold at most ",
                   kMaxTensorElements, " values)");
      }
      numel *= dim;
      t.dims.push_back(static_cast<int64_t>(dim));
    }
    ASSIGN_OR_RETURN(uint32_t type, c.Read<uint32_t>(what + " (type)"));
    const TypeInfo* info = FindType(type);
    if (info == nullptr) return bad(what, " has unknown ggml type ", type);
    t.type = info->type;
    if (t.dims[0] % info->block.values != 0) {
      return bad(what, " of type ", info->name, " has rows of ", t.dims[0],
                 " values, not a whole number of its ", info->block.values, "-value blocks");
    }
    t.bytes = numel / info->block.values * info->block.bytes;
    ASSIGN_OR_RETURN(t.offset, c.Read<uint64_t>(what + " (offset)"));
    if (t.offset % f->alignment_ != 0) {
      return bad(what, " starts at offset ", t.offset, ", not a multiple of the alignment ",
                 f->alignment_);
    }
    infos.push_back(std::move(t));
  }

  const uint64_t data_start = (c.pos() + f->alignment_ - 1) / f->alignment_ * f->alignment_;
  const uint64_t size = file.size();
  if (data_start > size && n_tensors > 0) {
    return bad("the data section would start at byte ", data_start, ", past the end (", size,
               " bytes)");
  }
  const uint64_t data_size = size > data_start ? size - data_start : 0;
  std::vector<const GgufTensor*> by_offset;
  for (GgufTensor& t : infos) {
    if (t.offset > data_size || t.bytes > data_size - t.offset) {
      return bad("tensor '", t.name, "' (", t.bytes, " bytes at data offset ", t.offset,
                 ") extends past the end of the file (data section ", data_size, " bytes)");
    }
    t.data = file.data() + data_start + t.offset;
  }
  for (GgufTensor& t : infos) {
    const std::string name = t.name;
    if (!f->tensors_.emplace(name, std::move(t)).second) {
      return bad("tensor '", name, "' appears twice");
    }
  }
  for (const auto& [name, t] : f->tensors_) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const GgufTensor* a, const GgufTensor* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const GgufTensor &a = *by_offset[i - 1], &b = *by_offset[i];
    if (a.offset + a.bytes > b.offset) {
      return bad("tensors '", a.name, "' (bytes ", a.offset, " to ", a.offset + a.bytes, ") and '",
                 b.name, "' (from ", b.offset, ") overlap");
    }
  }
  return f;
}

std::optional<GgufSplitName> ParseGgufSplitName(const std::string& path) {
  const std::string shape = "-#####-of-#####.gguf";
  if (path.size() <= shape.size()) return std::nullopt;
  const std::string tail = path.substr(path.size() - shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == '#' ? !absl::ascii_isdigit(tail[i]) : tail[i] != shape[i]) return std::nullopt;
  }
  GgufSplitName n{path.substr(0, path.size() - shape.size()), std::stoi(tail.substr(1, 5)),
                  std::stoi(tail.substr(10, 5))};
  if (n.number < 1 || n.count < 1 || n.number > n.count) return std::nullopt;
  return n;
}

namespace {

std::string SplitPath(const GgufSplitName& n, int number) {
  return absl::StrFormat("%s-%05d-of-%05d.gguf", n.prefix, number, n.count);
}

}  // namespace

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  const std::optional<GgufSplitName> name = ParseGgufSplitName(path);
  ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> first, OpenPart(name ? SplitPath(*name, 1) : path));
  const bool declared = first->metadata_.count("split.count") > 0;
  if (!name && !declared) return first;
  if (!name) {
    return absl::InvalidArgumentError(
        absl::StrCat(path,
                     ": declares split.count but its name is not a split part's "
                     "(PREFIX-00001-of-0000N.gguf)"));
  }
  if (!declared) {
    return absl::InvalidArgumentError(absl::StrCat(first->path(), ": named as part 1 of ",
                                                   name->count, " but has no split.count"));
  }
  ASSIGN_OR_RETURN(const uint64_t tensors_count, first->GetUint("split.tensors.count"));
  for (int i = 1; i <= name->count; ++i) {
    std::unique_ptr<GgufFile> part;
    if (i > 1) {
      ASSIGN_OR_RETURN(part, OpenPart(SplitPath(*name, i)));
    }
    GgufFile& p = i == 1 ? *first : *part;
    ASSIGN_OR_RETURN(const uint64_t no, p.GetUint("split.no"));
    ASSIGN_OR_RETURN(const uint64_t count, p.GetUint("split.count"));
    if (no != static_cast<uint64_t>(i - 1) || count != static_cast<uint64_t>(name->count)) {
      return absl::InvalidArgumentError(
          absl::StrCat(p.path(), ": split.no ", no, " of split.count ", count,
                       ", but its name makes it part ", i - 1, " (from 0) of ", name->count));
    }
    if (i > 1) RETURN_IF_ERROR(first->Merge(p, i - 1));
  }
  if (first->tensors_.size() != tensors_count) {
    return absl::InvalidArgumentError(absl::StrCat(first->path(), ": split.tensors.count is ",
                                                   tensors_count, " but the ", name->count,
                                                   " parts hold ", first->tensors_.size()));
  }
  return first;
}

absl::Status GgufFile::Merge(GgufFile& part, int index) {
  for (auto& [name, t] : part.tensors_) {
    auto [it, added] = tensors_.emplace(name, t);
    if (!added) {
      return absl::InvalidArgumentError(
          absl::StrCat(part.path(), ": tensor '", name, "' is also in ", path(it->second.part)));
    }
    it->second.part = index;
  }
  files_.push_back(std::move(part.files_[0]));
  return absl::OkStatus();
}

absl::StatusOr<const GgufValue*> GgufFile::Find(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) {
    return absl::NotFoundError(absl::StrCat(path(), ": metadata '", key, "' is missing"));
  }
  return &it->second;
}

absl::Status GgufFile::NotA(const std::string& key, const GgufValue& v, const char* want) const {
  return absl::InvalidArgumentError(
      absl::StrCat(path(), ": metadata '", key, "' is a ", ValueTypeName(v.type), ", not ", want));
}

absl::StatusOr<std::string> GgufFile::GetString(const std::string& key) const {
  ASSIGN_OR_RETURN(const GgufValue* v, Find(key));
  if (const std::string* s = std::get_if<std::string>(&v->v)) return *s;
  return NotA(key, *v, "a string");
}

absl::StatusOr<uint64_t> GgufFile::GetUint(const std::string& key) const {
  ASSIGN_OR_RETURN(const GgufValue* v, Find(key));
  if (const uint64_t* u = std::get_if<uint64_t>(&v->v)) return *u;
  if (const int64_t* i = std::get_if<int64_t>(&v->v); i != nullptr && *i >= 0) {
    return static_cast<uint64_t>(*i);
  }
  return NotA(key, *v, "a non-negative integer");
}

absl::StatusOr<double> GgufFile::GetFloat(const std::string& key) const {
  ASSIGN_OR_RETURN(const GgufValue* v, Find(key));
  const double* d = std::get_if<double>(&v->v);
  if (d == nullptr) return NotA(key, *v, "a float");
  if (!std::isfinite(*d)) return NotA(key, *v, "a finite float");
  return *d;
}

absl::StatusOr<const GgufArray*> GgufFile::GetArray(const std::string& key) const {
  ASSIGN_OR_RETURN(const GgufValue* v, Find(key));
  if (const GgufArray* a = std::get_if<GgufArray>(&v->v)) return a;
  return NotA(key, *v, "an array");
}

}  // namespace shardserve
