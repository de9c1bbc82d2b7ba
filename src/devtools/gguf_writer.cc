#include "devtools/gguf_writer.h"

#include <fstream>
#include <variant>

#include "absl/strings/str_cat.h"

namespace shardserve {
namespace {

template <typename T>
void Put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

void PutString(std::string& out, const std::string& s) {
  Put<uint64_t>(out, s.size());
  out += s;
}

// The value's payload (its type word is written by the caller: the key's, or the array's).
void PutValue(std::string& out, const GgufValue& v) {
  switch (v.type) {
    case kGgufU8:
      Put<uint8_t>(out, static_cast<uint8_t>(std::get<uint64_t>(v.v)));
      break;
    case kGgufU16:
      Put<uint16_t>(out, static_cast<uint16_t>(std::get<uint64_t>(v.v)));
      break;
    case kGgufU32:
      Put<uint32_t>(out, static_cast<uint32_t>(std::get<uint64_t>(v.v)));
      break;
    case kGgufU64:
      Put<uint64_t>(out, std::get<uint64_t>(v.v));
      break;
    case kGgufI8:
      Put<int8_t>(out, static_cast<int8_t>(std::get<int64_t>(v.v)));
      break;
    case kGgufI16:
      Put<int16_t>(out, static_cast<int16_t>(std::get<int64_t>(v.v)));
      break;
    case kGgufI32:
      Put<int32_t>(out, static_cast<int32_t>(std::get<int64_t>(v.v)));
      break;
    case kGgufI64:
      Put<int64_t>(out, std::get<int64_t>(v.v));
      break;
    case kGgufF32:
      Put<float>(out, static_cast<float>(std::get<double>(v.v)));
      break;
    case kGgufF64:
      Put<double>(out, std::get<double>(v.v));
      break;
    case kGgufBool:
      Put<uint8_t>(out, std::get<bool>(v.v) ? 1 : 0);
      break;
    case kGgufString:
      PutString(out, std::get<std::string>(v.v));
      break;
    case kGgufArray: {
      const GgufArray& a = std::get<GgufArray>(v.v);
      Put<uint32_t>(out, a.empty() ? uint32_t{kGgufU8} : a.front().type);
      Put<uint64_t>(out, a.size());
      for (const GgufValue& e : a) PutValue(out, e);
      break;
    }
  }
}

}  // namespace

void GgufWriter::Set(const std::string& key, GgufValue value) {
  for (auto& [k, v] : metadata_) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  metadata_.emplace_back(key, std::move(value));
}

void GgufWriter::AddTensor(const std::string& name, GgmlType type, std::vector<int64_t> dims,
                           std::string bytes) {
  tensors_.push_back({name, type, std::move(dims), std::move(bytes)});
}

absl::Status GgufWriter::Write(const std::string& path) const {
  uint64_t alignment = 32;
  for (const auto& [k, v] : metadata_) {
    if (k == "general.alignment") alignment = std::get<uint64_t>(v.v);
  }
  std::string out;
  Put<uint32_t>(out, 0x46554747);  // "GGUF"
  Put<uint32_t>(out, 3);
  Put<uint64_t>(out, tensors_.size());
  Put<uint64_t>(out, metadata_.size());
  for (const auto& [k, v] : metadata_) {
    PutString(out, k);
    Put<uint32_t>(out, v.type);
    PutValue(out, v);
  }
  auto align = [&](uint64_t n) { return (n + alignment - 1) / alignment * alignment; };
  uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    PutString(out, t.name);
    Put<uint32_t>(out, static_cast<uint32_t>(t.dims.size()));
    for (int64_t d : t.dims) Put<uint64_t>(out, static_cast<uint64_t>(d));
    Put<uint32_t>(out, static_cast<uint32_t>(t.type));
    Put<uint64_t>(out, offset);
    offset = align(offset + t.bytes.size());
  }
  out.resize(align(out.size()), '\0');
  for (const Tensor& t : tensors_) {
    out += t.bytes;
    out.resize(align(out.size()), '\0');
  }
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(out.data(), static_cast<std::streamsize>(out.size()));
  if (!f) return absl::InternalError(absl::StrCat(path, ": cannot write the GGUF file"));
  return absl::OkStatus();
}

}  // namespace shardserve
