// The GGUF reader: a file built byte by byte reads back whole; every malformed variant, and every
// truncation of a valid file, is refused with a message that names the problem.
#include "model/gguf.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "devtools/gguf_writer.h"

namespace shardserve {
namespace {

// GGUF bytes, little-endian.
struct Builder {
  std::string b;
  template <typename T>
  Builder& Put(T v) {
    b.append(reinterpret_cast<const char*>(&v), sizeof(T));
    return *this;
  }
  Builder& Str(const std::string& s) {
    Put<uint64_t>(s.size());
    b += s;
    return *this;
  }
  Builder& Header(uint64_t tensors, uint64_t kvs, uint32_t version = 3) {
    return Put<uint32_t>(0x46554747)
        .Put<uint32_t>(version)
        .Put<uint64_t>(tensors)
        .Put<uint64_t>(kvs);
  }
  Builder& Tensor(const std::string& name, std::vector<uint64_t> dims, uint32_t type,
                  uint64_t offset) {
    Str(name).Put<uint32_t>(dims.size());
    for (uint64_t d : dims) Put<uint64_t>(d);
    return Put<uint32_t>(type).Put<uint64_t>(offset);
  }
  Builder& AlignTo(size_t a) {
    b.resize((b.size() + a - 1) / a * a, '\0');
    return *this;
  }
};

// One scratch file per test process (the reader's and the writer's), rewritten for each case and
// removed when the process ends.
std::string ScratchPath(const char* name) {
  return testing::TempDir() + "/" + name + "_" + std::to_string(getpid()) + ".gguf";
}
struct RemoveScratchFiles {
  ~RemoveScratchFiles() {
    std::remove(ScratchPath("gguf_test").c_str());
    std::remove(ScratchPath("gguf_writer").c_str());
  }
} remove_scratch_files;

std::string Write(const std::string& bytes) {
  const std::string path = ScratchPath("gguf_test");
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  return path;
}

// A valid file: metadata of several types (an array of strings among them), an F32 tensor of
// 4 x 2 and a Q8_0 tensor of 64 x 1 (two 34-byte blocks) after it at the default alignment.
Builder Valid() {
  Builder f;
  f.Header(2, 4);
  f.Str("general.architecture").Put<uint32_t>(8).Str("llama");
  f.Str("llama.block_count").Put<uint32_t>(4).Put<uint32_t>(22);
  f.Str("llama.rope.freq_base").Put<uint32_t>(6).Put<float>(10000.f);
  f.Str("tokenizer.ggml.tokens").Put<uint32_t>(9).Put<uint32_t>(8).Put<uint64_t>(2);
  f.Str("<s>").Str("hello");
  f.Tensor("a", {4, 2}, 0, 0);
  f.Tensor("q", {64}, 8, 32);
  f.AlignTo(32);
  for (int i = 0; i < 8; ++i) f.Put<float>(static_cast<float>(i));
  f.AlignTo(32);  // Q8_0 at data offset 32
  f.b.append(68, '\x01');
  return f;
}

TEST(Gguf, AValidFileReadsBack) {
  auto f = GgufFile::Open(Write(Valid().b));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->version(), 3u);
  EXPECT_EQ(*(*f)->GetString("general.architecture"), "llama");
  EXPECT_EQ(*(*f)->GetUint("llama.block_count"), 22u);
  EXPECT_EQ(*(*f)->GetFloat("llama.rope.freq_base"), 10000.0);
  const GgufArray* tokens = *(*f)->GetArray("tokenizer.ggml.tokens");
  ASSERT_EQ(tokens->size(), 2u);
  EXPECT_EQ(std::get<std::string>((*tokens)[1].v), "hello");
  const GgufTensor& a = (*f)->tensors().at("a");
  EXPECT_EQ(a.dims, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(a.bytes, 32u);
  float v[8];
  std::memcpy(v, a.data, sizeof v);
  EXPECT_EQ(v[7], 7.f);
  const GgufTensor& q = (*f)->tensors().at("q");
  EXPECT_EQ(q.type, GgmlType::kQ8_0);
  EXPECT_EQ(q.bytes, 68u);
  EXPECT_EQ(q.data[67], 1);
  EXPECT_EQ(*GgmlTypeName(14), "Q6_K");
  EXPECT_FALSE(GgmlTypeName(99).has_value());

  // Typed getters name the key and what it is.
  EXPECT_NE((*f)->GetString("llama.block_count")
                .status()
                .message()
                .find("'llama.block_count' is a uint32, not a string"),
            std::string::npos);
  EXPECT_EQ((*f)->GetUint("nope").status().code(), absl::StatusCode::kNotFound);
}

// A string that is not UTF-8 (one byte of a token set to 0xb8 once aborted the tokenizer's JSON
// writer) and a float that is not a number are refused by name.
TEST(Gguf, StringsMustBeUtf8AndFloatsFinite) {
  Builder f = Valid();
  const size_t at = f.b.find("hello");
  ASSERT_NE(at, std::string::npos);
  f.b[at + 1] = static_cast<char>(0xb8);
  auto bad = GgufFile::Open(Write(f.b));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("metadata 'tokenizer.ggml.tokens'"), std::string::npos)
      << bad.status();
  EXPECT_NE(bad.status().message().find("is not valid UTF-8"), std::string::npos);

  Builder n = Valid();
  const float ten_thousand = 10000.f;
  const size_t f_at = n.b.find(std::string(reinterpret_cast<const char*>(&ten_thousand), 4));
  ASSERT_NE(f_at, std::string::npos);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(&n.b[f_at], &nan, 4);
  auto file = GgufFile::Open(Write(n.b));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_NE((*file)
                ->GetFloat("llama.rope.freq_base")
                .status()
                .message()
                .find("'llama.rope.freq_base' is a float32, not a finite float"),
            std::string::npos);
}

TEST(Gguf, EveryTruncationIsRefusedNotRead) {
  const std::string whole = Valid().b;
  for (size_t n = 0; n < whole.size(); ++n) {
    auto f = GgufFile::Open(Write(whole.substr(0, n)));
    EXPECT_FALSE(f.ok()) << "a file cut to " << n << " of " << whole.size() << " bytes";
  }
}

// What GgufWriter writes, the reader reads back: every value type, nested arrays, an alignment
// of its own, and tensors of several types at aligned offsets.
TEST(Gguf, TheWritersFilesReadBack) {
  GgufWriter w;
  w.Set("general.alignment", GgufWriter::U32(64));
  w.Set("s", GgufWriter::String("hello"));
  w.Set("u8", {kGgufU8, uint64_t{200}});
  w.Set("i16", {kGgufI16, int64_t{-300}});
  w.Set("u64", {kGgufU64, uint64_t{1} << 40});
  w.Set("f32", GgufWriter::F32(0.5f));
  w.Set("f64", {kGgufF64, 2.25});
  w.Set("b", GgufWriter::Bool(true));
  w.Set("tokens", GgufWriter::Array({GgufWriter::String("<s>"), GgufWriter::String("a b")}));
  w.Set("nested", GgufWriter::Array({GgufWriter::Array({GgufWriter::I32(-1)})}));
  w.Set("empty", GgufWriter::Array({}));
  std::string f32(4 * 3 * 4, '\0'), q4k(144 * 2, '\x5a');
  for (int i = 0; i < 12; ++i) {
    const float v = static_cast<float>(i);
    std::memcpy(&f32[4 * i], &v, 4);
  }
  w.AddTensor("w", GgmlType::kF32, {4, 3}, f32);
  w.AddTensor("q", GgmlType::kQ4_K, {256, 2}, q4k);
  const std::string path = ScratchPath("gguf_writer");
  ASSERT_TRUE(w.Write(path).ok());
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->alignment(), 64u);
  EXPECT_EQ(*(*f)->GetString("s"), "hello");
  EXPECT_EQ(*(*f)->GetUint("u8"), 200u);
  EXPECT_EQ(std::get<int64_t>((*f)->metadata().at("i16").v), -300);
  EXPECT_EQ(*(*f)->GetUint("u64"), uint64_t{1} << 40);
  EXPECT_EQ(*(*f)->GetFloat("f32"), 0.5);
  EXPECT_EQ(*(*f)->GetFloat("f64"), 2.25);
  EXPECT_TRUE(std::get<bool>((*f)->metadata().at("b").v));
  EXPECT_EQ(std::get<std::string>((**(*f)->GetArray("tokens"))[1].v), "a b");
  const GgufArray& inner = std::get<GgufArray>((**(*f)->GetArray("nested"))[0].v);
  EXPECT_EQ(std::get<int64_t>(inner[0].v), -1);
  EXPECT_TRUE((*(*f)->GetArray("empty"))->empty());
  const GgufTensor& t = (*f)->tensors().at("w");
  EXPECT_EQ(t.dims, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(t.data), t.bytes), f32);
  const GgufTensor& q = (*f)->tensors().at("q");
  EXPECT_EQ(q.offset % 64, 0u);
  EXPECT_EQ(q.bytes, q4k.size());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(q.data), q.bytes), q4k);
}

// Bytes changed at random: the reader answers (a file or an error) and never reads outside it.
TEST(Gguf, RandomlyDamagedFilesNeverCrashTheReader) {
  const std::string whole = Valid().b;
  std::mt19937 rng(7);
  int refused = 0;
  for (int i = 0; i < 2000; ++i) {
    std::string bytes = whole;
    for (int k = 0; k < 1 + i % 4; ++k) bytes[rng() % bytes.size()] = static_cast<char>(rng());
    auto f = GgufFile::Open(Write(bytes));
    if (!f.ok()) {
      ++refused;
      EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << f.status();
    }
  }
  EXPECT_GT(refused, 0);
}

TEST(Gguf, MalformedFilesAreRefusedNamingTheProblem) {
  struct Case {
    std::string what;
    std::string bytes;
    std::string message;
  };
  std::vector<Case> cases;
  {
    Builder f = Valid();
    f.b[0] = 'X';
    cases.push_back({"magic", f.b, "not a GGUF file"});
  }
  cases.push_back({"version", Builder().Header(0, 0, 1).b, "GGUF version 1"});
  cases.push_back({"counts", Builder().Header(uint64_t{1} << 60, 0).b, "tensor infos do not fit"});
  cases.push_back({"string length",
                   Builder().Header(0, 1).Put<uint64_t>(uint64_t{1} << 40).Put<uint64_t>(0).b,
                   "(at most 16777216)"});
  cases.push_back({"value type",
                   Builder().Header(0, 1).Str("k").Put<uint32_t>(13).Put<uint64_t>(0).b,
                   "'k' has unknown value type 13"});
  cases.push_back({"array count",
                   Builder()
                       .Header(0, 1)
                       .Str("k")
                       .Put<uint32_t>(9)
                       .Put<uint32_t>(4)
                       .Put<uint64_t>(uint64_t{1} << 20)
                       .b,
                   "metadata 'k' (elements)"});
  cases.push_back(
      {"bool", Builder().Header(0, 1).Str("k").Put<uint32_t>(7).Put<uint8_t>(2).Put<uint64_t>(0).b,
       "bool of value 2"});
  cases.push_back({"duplicate key",
                   Builder()
                       .Header(0, 2)
                       .Str("k")
                       .Put<uint32_t>(0)
                       .Put<uint8_t>(1)
                       .Str("k")
                       .Put<uint32_t>(0)
                       .Put<uint8_t>(1)
                       .Put<uint64_t>(0)
                       .b,
                   "'k' appears twice"});
  cases.push_back({"alignment",
                   Builder()
                       .Header(0, 1)
                       .Str("general.alignment")
                       .Put<uint32_t>(4)
                       .Put<uint32_t>(24)
                       .Put<uint64_t>(0)
                       .b,
                   "power of two"});
  auto one_tensor = [](std::vector<uint64_t> dims, uint32_t type, uint64_t offset,
                       size_t data_bytes) {
    Builder f;
    f.Header(1, 0).Tensor("t", dims, type, offset).AlignTo(32);
    f.b.append(data_bytes, '\0');
    return f.b;
  };
  cases.push_back({"dims", one_tensor({}, 0, 0, 64), "'t' has 0 dimensions"});
  cases.push_back({"zero dim", one_tensor({4, 0}, 0, 0, 64), "dimension 1 of 0"});
  cases.push_back({"ggml type", one_tensor({4}, 4, 0, 64), "'t' has unknown ggml type 4"});
  cases.push_back({"partial block", one_tensor({48}, 2, 0, 64), "not a whole number of its 32"});
  cases.push_back(
      {"offset alignment", one_tensor({4}, 0, 4, 64), "not a multiple of the alignment"});
  cases.push_back({"past the end", one_tensor({64}, 0, 0, 64), "extends past the end"});
  {
    Builder f;
    f.Header(2, 0).Tensor("a", {8}, 0, 0).Tensor("b", {8}, 0, 0).AlignTo(32);
    f.b.append(64, '\0');
    cases.push_back({"overlap", f.b, "overlap"});
  }
  {
    Builder f;
    f.Header(2, 0).Tensor("a", {8}, 0, 0).Tensor("a", {8}, 0, 32).AlignTo(32);
    f.b.append(64, '\0');
    cases.push_back({"duplicate tensor", f.b, "'a' appears twice"});
  }
  for (const Case& c : cases) {
    auto f = GgufFile::Open(Write(c.bytes));
    ASSERT_FALSE(f.ok()) << c.what;
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(f.status().message().find(c.message), std::string::npos)
        << c.what << ": " << f.status();
  }
  EXPECT_EQ(GgufFile::Open("/nonexistent.gguf").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace shardserve
