#include "model/safetensors.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "model/gguf_model.h"

namespace shardserve {
namespace {

using json = nlohmann::json;
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

std::string ShapeStr(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

}  // namespace

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorView::ShapeString() const { return ShapeStr(shape); }

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> file, MappedFile::Open(path));
  const uint64_t size = file->size();
  if (size < 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": file is ", size, " bytes, too short for a safetensors header"));
  }
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  const uint8_t* bytes = file->data();
  f->file_ = std::move(file);

  uint64_t header_len;
  std::memcpy(&header_len, bytes, 8);  // little-endian on every supported host
  if (header_len > kMaxHeaderBytes || header_len > size - 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": header length ", header_len, " exceeds the file (", size, " bytes)"));
  }
  json header;
  try {
    header = json::parse(bytes + 8, bytes + 8 + header_len);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header is not valid JSON: ", e.what()));
  }
  if (!header.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header is not a JSON object"));
  }
  const uint64_t data_size = size - 8 - header_len;
  const uint8_t* data = bytes + 8 + header_len;

  struct Range {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Range> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": __metadata__ is not an object"));
      }
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return absl::InvalidArgumentError(
              absl::StrCat(path, ": __metadata__ value '", m.key(), "' is not a string"));
        }
        f->metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = absl::StrCat(path, ": tensor '", name, "'");
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets")) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": entry needs dtype, shape and data_offsets"));
    }
    TensorView t;
    t.name = name;
    t.file = path;
    if (!v["dtype"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": dtype is not a string"));
    }
    auto dtype = ParseDType(v["dtype"].get<std::string>());
    if (!dtype.ok())
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", dtype.status().message()));
    t.dtype = *dtype;
    if (!v["shape"].is_array()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": shape is not an array"));
    }
    uint64_t numel = 1;
    for (const json& d : v["shape"]) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > (1ull << 40)) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": shape ", v["shape"].dump(), " has an invalid dimension"));
      }
      t.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
      numel *= d.get<uint64_t>();
    }
    const json& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": data_offsets must be two non-negative integers"));
    }
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": data_offsets [", begin, ",", end, "] end before they begin"));
    }
    if (end > data_size) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": data_offsets [", begin, ",", end,
                                                     "] run past the end of the data (", data_size,
                                                     " bytes; the file may be truncated)"));
    }
    const uint64_t expected = numel * DTypeSize(t.dtype);
    if (end - begin != expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": shape ", t.ShapeString(), " x ", DTypeName(t.dtype), " needs ", expected,
          " bytes but data_offsets [", begin, ",", end, "] hold ", end - begin));
    }
    t.data = data + begin;
    t.nbytes = end - begin;
    t.file_offset = 8 + header_len + begin;
    auto [pos, inserted] = f->tensors_.emplace(name, std::move(t));
    ranges.push_back({begin, end, &pos->first});
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].begin < ranges[i - 1].end) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensors '", *ranges[i - 1].name, "' [", ranges[i - 1].begin, ",",
                       ranges[i - 1].end, ") and '", *ranges[i].name, "' [", ranges[i].begin, ",",
                       ranges[i].end, ") overlap"));
    }
  }
  return f;
}

void SafetensorsFile::DropResidentPages() const { file_->DropResidentPages(); }

void WeightStore::DropResidentPages() const {
  for (const auto& f : files_) f->DropResidentPages();
  if (gguf_) gguf_->DropResidentPages();
}

SafetensorsFile::~SafetensorsFile() = default;

absl::Status WeightStore::PairFp8Scales() {
  constexpr std::string_view kScale = "_scale_inv";
  for (const auto& [name, s] : tensors_) {
    if (!name.ends_with(kScale)) continue;
    const auto w = tensors_.find(name.substr(0, name.size() - kScale.size()));
    if (w != tensors_.end() && w->second.dtype != DType::kF8E4M3) {
      return absl::InvalidArgumentError(
          absl::StrCat(s.file, ": tensor '", name, "' scales '", w->first, "', which is ",
                       DTypeName(w->second.dtype), ", not F8_E4M3: only FP8 weights have scales"));
    }
  }
  for (auto& [name, t] : tensors_) {
    if (t.dtype != DType::kF8E4M3) continue;
    const std::string scale_name = name + "_scale_inv";
    const auto s = tensors_.find(scale_name);
    if (t.shape.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(t.file, ": tensor '", name, "' is F8_E4M3 with shape ", t.ShapeString(),
                       "; FP8 weights are matrices (two dimensions)"));
    }
    if (s == tensors_.end()) {
      return absl::InvalidArgumentError(absl::StrCat(t.file, ": tensor '", name,
                                                     "' is F8_E4M3 but its scales, '", scale_name,
                                                     "', are not in the model"));
    }
    if ((s->second.dtype != DType::kF32 && s->second.dtype != DType::kBF16) ||
        (s->second.shape.size() != 2 && s->second.numel() != 1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          s->second.file, ": tensor '", scale_name, "' is ", DTypeName(s->second.dtype), " ",
          s->second.ShapeString(),
          "; FP8 scales are an F32 or BF16 matrix of blocks, or one scale for the tensor"));
    }
    t.scale = &s->second;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<WeightStore>> WeightStore::Open(const std::string& model_dir) {
  namespace fs = std::filesystem;
  auto store = std::make_unique<WeightStore>();
  ASSIGN_OR_RETURN(const std::optional<std::string> gguf, FindGgufFile(model_dir));
  if (gguf) {
    ASSIGN_OR_RETURN(store->gguf_, GgufFile::Open(*gguf));
    ASSIGN_OR_RETURN(const ModelConfig config, GgufModelConfig(*store->gguf_));
    ASSIGN_OR_RETURN(store->tensors_, GgufTensors(*store->gguf_, config, store->owned_));
    return store;
  }
  const fs::path dir(model_dir);
  const fs::path index_path = dir / "model.safetensors.index.json";
  const fs::path single = dir / "model.safetensors";
  if (fs::exists(index_path)) {
    json index;
    try {
      std::ifstream in(index_path);
      index = json::parse(in);
    } catch (const json::exception& e) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path.string(), ": not valid JSON: ", e.what()));
    }
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path.string(), ": missing the 'weight_map' object"));
    }
    std::map<std::string, SafetensorsFile*> by_file;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      if (!it.value().is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(index_path.string(), ": weight_map entry '",
                                                       it.key(), "' is not a file name"));
      }
      const std::string file = it.value().get<std::string>();
      if (file.find('/') != std::string::npos || file.find("..") != std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat(
            index_path.string(), ": weight_map names file '", file, "' outside the directory"));
      }
      if (!by_file.count(file)) {
        ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open((dir / file).string()));
        by_file[file] = f.get();
        store->files_.push_back(std::move(f));
      }
      const auto& tensors = by_file[file]->tensors();
      auto t = tensors.find(it.key());
      if (t == tensors.end()) {
        return absl::InvalidArgumentError(absl::StrCat(index_path.string(), ": tensor '", it.key(),
                                                       "' is listed in file '", file,
                                                       "' but that file does not contain it"));
      }
      store->tensors_[it.key()] = t->second;
    }
  } else if (fs::exists(single)) {
    ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(single.string()));
    store->tensors_ = f->tensors();
    store->files_.push_back(std::move(f));
  } else {
    return absl::NotFoundError(absl::StrCat(model_dir,
                                            ": no model.safetensors or "
                                            "model.safetensors.index.json"));
  }
  RETURN_IF_ERROR(store->PairFp8Scales());
  return store;
}

absl::StatusOr<TensorView> WeightStore::Get(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("missing tensor '", name, "'"));
  }
  return it->second;
}

absl::StatusOr<TensorView> WeightStore::Get(const std::string& name,
                                            const std::vector<int64_t>& shape) const {
  ASSIGN_OR_RETURN(TensorView t, Get(name));
  if (t.shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' in ", t.file, " has shape ",
                                                   t.ShapeString(), ", expected ",
                                                   ShapeStr(shape)));
  }
  return t;
}

size_t WeightStore::total_bytes() const {
  size_t n = 0;
  for (const auto& [name, t] : tensors_) n += t.nbytes;
  return n;
}

size_t TensorSpec::nbytes() const {
  size_t n = DTypeSize(dtype);
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorSpec>& specs,
                              const std::function<void(size_t, std::vector<uint8_t>&)>& fill,
                              const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const TensorSpec& t : specs) {
    header[t.name] = {{"dtype", std::string(DTypeName(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // align the data section to 8 bytes
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::InternalError(absl::StrCat(path, ": cannot write"));
  const uint64_t len = h.size();
  out.write(reinterpret_cast<const char*>(&len), 8);
  out.write(h.data(), static_cast<std::streamsize>(h.size()));
  std::vector<uint8_t> bytes;
  for (size_t i = 0; i < specs.size(); ++i) {
    bytes.assign(specs[i].nbytes(), 0);
    fill(i, bytes);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
  }
  out.close();
  if (!out) return absl::InternalError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace shardserve
