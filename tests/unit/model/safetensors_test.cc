#include "model/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "model/test_models.h"
#include "model/transformer.h"

namespace shardserve {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;
using testing::ReadFile;
using testing::TempDir;
using testing::WriteFile;

// A safetensors file from a header and a data section, as bytes.
std::string File(const json& header, size_t data_bytes) {
  const std::string h = header.dump();
  std::string out(8, '\0');
  const uint64_t len = h.size();
  std::memcpy(out.data(), &len, 8);
  return out + h + std::string(data_bytes, '\x01');
}

std::string OpenError(const TempDir& dir, const std::string& bytes) {
  const std::string path = dir.Sub("t.safetensors");
  WriteFile(path, bytes);
  auto f = SafetensorsFile::Open(path);
  EXPECT_FALSE(f.ok());
  return std::string(f.status().message());
}

TEST(SafetensorsTest, ReadsWhatItWritesByMmap) {
  TempDir dir;
  const std::string path = dir.Sub("w.safetensors");
  std::vector<TensorSpec> specs = {{"a", DType::kF32, {2, 3}}, {"b", DType::kBF16, {4}}};
  ASSERT_TRUE(WriteSafetensors(path, specs, [](size_t i, std::vector<uint8_t>& bytes) {
                for (size_t k = 0; k < bytes.size(); ++k) bytes[k] = uint8_t(i * 100 + k);
              }).ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  const TensorView& a = (*f)->tensors().at("a");
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.nbytes, 24u);
  EXPECT_EQ(static_cast<const uint8_t*>(a.data)[5], 5);
  EXPECT_EQ(static_cast<const uint8_t*>((*f)->tensors().at("b").data)[1], 101);
  // The data pointer lies in a mapping of the file itself: no copy into private memory.
  const auto addr = reinterpret_cast<uintptr_t>(a.data);
  std::ifstream maps("/proc/self/maps");
  std::string line;
  bool mapped = false;
  while (std::getline(maps, line)) {
    uintptr_t lo, hi;
    if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) == 2 && addr >= lo && addr < hi) {
      mapped = line.find("w.safetensors") != std::string::npos;
    }
  }
  EXPECT_TRUE(mapped) << "tensor data is not inside a mapping of the file";
}

// Resident kilobytes of this process's mapping of `file` (/proc/self/smaps), -1 if none.
long MappedRssKb(const std::string& file) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool in = false;
  long kb = -1;
  while (std::getline(smaps, line)) {
    uintptr_t lo, hi;
    if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) == 2) {
      in = line.find(file) != std::string::npos;
    } else if (in && line.rfind("Rss:", 0) == 0) {
      kb = std::max(kb, 0L) + std::stol(line.substr(4));
    }
  }
  return kb;
}

// After the weights went to a GPU: the touched pages leave the process, the data stays readable.
TEST(SafetensorsTest, DroppedPagesLeaveResidentMemoryButStayReadable) {
  TempDir dir;
  const std::string path = dir.Sub("big.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"w", DType::kF32, {1024, 1024}}},
                               [](size_t, std::vector<uint8_t>& bytes) {
                                 for (size_t k = 0; k < bytes.size(); ++k)
                                   bytes[k] = uint8_t(k % 251);
                               })
                  .ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  const TensorView& w = (*f)->tensors().at("w");
  const uint8_t* p = static_cast<const uint8_t*>(w.data);
  uint64_t sum = 0;
  for (size_t k = 0; k < w.nbytes; ++k) sum += p[k];
  EXPECT_GT(MappedRssKb("big.safetensors"), 3000);  // 4 MiB read
  (*f)->DropResidentPages();
  EXPECT_EQ(MappedRssKb("big.safetensors"), 0);
  uint64_t again = 0;
  for (size_t k = 0; k < w.nbytes; ++k) again += p[k];
  EXPECT_EQ(again, sum);
}

TEST(SafetensorsTest, EachCorruptionGetsItsOwnError) {
  TempDir dir;
  const json good = {{"w", {{"dtype", "F32"}, {"shape", {2, 2}}, {"data_offsets", {0, 16}}}}};
  EXPECT_THAT(OpenError(dir, "abc"), HasSubstr("too short for a safetensors header"));
  std::string huge(8, '\xff');
  EXPECT_THAT(OpenError(dir, huge + "{}"), HasSubstr("exceeds the file"));
  std::string bad_json = File(good, 16);
  bad_json[9] = '#';
  EXPECT_THAT(OpenError(dir, bad_json), HasSubstr("header is not valid JSON"));
  EXPECT_THAT(OpenError(dir, File(json::array(), 0)), HasSubstr("not a JSON object"));
  const std::string truncated = File(good, 16);
  EXPECT_THAT(OpenError(dir, truncated.substr(0, truncated.size() - 4)),
              HasSubstr("tensor 'w': data_offsets [0,16] run past the end of the data (12 bytes"));
  json dtype = good;
  dtype["w"]["dtype"] = "I64";
  EXPECT_THAT(
      OpenError(dir, File(dtype, 16)),
      HasSubstr("tensor 'w': unsupported dtype 'I64' (supported: F32, F16, BF16, F8_E4M3, U8)"));
  json shape = good;
  shape["w"]["shape"] = {3, 2};
  EXPECT_THAT(OpenError(dir, File(shape, 16)),
              HasSubstr("shape [3,2] x F32 needs 24 bytes but data_offsets [0,16] hold 16"));
  json overlap = good;
  overlap["v"] = {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {8, 16}}};
  EXPECT_THAT(OpenError(dir, File(overlap, 16)), HasSubstr("overlap"));
  json backwards = good;
  backwards["w"]["data_offsets"] = {16, 0};
  EXPECT_THAT(OpenError(dir, File(backwards, 16)), HasSubstr("end before they begin"));
  json fields = good;
  fields["w"].erase("shape");
  EXPECT_THAT(OpenError(dir, File(fields, 16)), HasSubstr("needs dtype, shape and data_offsets"));
}

class ModelDirTest : public ::testing::Test {
 protected:
  std::string LoadError(const std::string& model_dir) {
    auto m = Transformer::Load(model_dir, {});
    EXPECT_FALSE(m.ok());
    return std::string(m.status().message());
  }
  TempDir dir_;
};

TEST_F(ModelDirTest, MissingTensorIsNamed) {
  auto o = testing::SmallModel("llama", dir_.Sub("m"));
  testing::WriteModel(o);
  testing::RemoveTensor(dir_.Sub("m/model.safetensors"), "model.layers.1.mlp.up_proj.weight");
  EXPECT_THAT(LoadError(dir_.Sub("m")),
              HasSubstr("missing tensor 'model.layers.1.mlp.up_proj.weight'"));
}

TEST_F(ModelDirTest, WrongShapeIsNamedWithBothShapes) {
  auto o = testing::SmallModel("llama", dir_.Sub("m"));
  testing::WriteModel(o);
  std::string cfg = ReadFile(dir_.Sub("m/config.json"));
  json j = json::parse(cfg);
  j["intermediate_size"] = 128;  // the weights were written with 96
  WriteFile(dir_.Sub("m/config.json"), j.dump());
  EXPECT_THAT(LoadError(dir_.Sub("m")),
              HasSubstr("tensor 'model.layers.0.mlp.gate_proj.weight' in " +
                        dir_.Sub("m/model.safetensors") + " has shape [96,64], expected [128,64]"));
}

TEST_F(ModelDirTest, TruncatedFileBadConfigAndUnsupportedOption) {
  auto o = testing::SmallModel("llama", dir_.Sub("m"));
  testing::WriteModel(o);
  const std::string weights = ReadFile(dir_.Sub("m/model.safetensors"));
  WriteFile(dir_.Sub("m/model.safetensors"), weights.substr(0, weights.size() - 100));
  EXPECT_THAT(LoadError(dir_.Sub("m")), HasSubstr("the file may be truncated"));
  WriteFile(dir_.Sub("m/model.safetensors"), weights);
  const std::string cfg = ReadFile(dir_.Sub("m/config.json"));
  WriteFile(dir_.Sub("m/config.json"), cfg.substr(0, cfg.size() / 2));
  EXPECT_THAT(LoadError(dir_.Sub("m")), HasSubstr("config.json: not valid JSON"));
  json j = json::parse(cfg);
  j["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 2.0}};
  WriteFile(dir_.Sub("m/config.json"), j.dump());
  EXPECT_THAT(LoadError(dir_.Sub("m")), HasSubstr("'dynamic' is not supported"));
  EXPECT_THAT(LoadError(dir_.Sub("nothing-here")), HasSubstr("cannot open"));
}

TEST_F(ModelDirTest, ShardedIndexIsValidated) {
  auto o = testing::SmallModel("llama", dir_.Sub("m"));
  o.shard_bytes = 60000;
  testing::WriteModel(o);
  ASSERT_TRUE(std::filesystem::exists(dir_.Sub("m/model.safetensors.index.json")));
  auto store = WeightStore::Open(dir_.Sub("m"));
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE((*store)->Has("lm_head.weight"));
  json index = json::parse(ReadFile(dir_.Sub("m/model.safetensors.index.json")));
  const std::string file = index["weight_map"]["lm_head.weight"];
  index["weight_map"]["lm_head.weight"] = index["weight_map"]["model.embed_tokens.weight"];
  WriteFile(dir_.Sub("m/model.safetensors.index.json"), index.dump());
  ASSERT_NE(index["weight_map"]["lm_head.weight"], file) << "test needs them in different files";
  EXPECT_THAT(LoadError(dir_.Sub("m")), HasSubstr("tensor 'lm_head.weight' is listed in file"));
  index["weight_map"]["lm_head.weight"] = "model-00009-of-00009.safetensors";
  WriteFile(dir_.Sub("m/model.safetensors.index.json"), index.dump());
  EXPECT_THAT(LoadError(dir_.Sub("m")), HasSubstr("model-00009-of-00009.safetensors: cannot open"));
  index["weight_map"]["lm_head.weight"] = "../elsewhere.safetensors";
  WriteFile(dir_.Sub("m/model.safetensors.index.json"), index.dump());
  EXPECT_THAT(LoadError(dir_.Sub("m")), HasSubstr("outside the directory"));
}

}  // namespace
}  // namespace shardserve
