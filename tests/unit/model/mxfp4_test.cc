// MXFP4 experts (gpt-oss): the E2M1 values, a row's expansion with its E8M0 scales, the bytes that
// are refused, and a gpt-oss checkpoint that loads from MXFP4 as it does from its expanded values.
#include "model/mxfp4.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "model/generator.h"
#include "model/safetensors.h"
#include "model/test_models.h"
#include "model/transformer.h"

namespace shardserve {
namespace {

using ::testing::HasSubstr;

// Value i of an expansion into `to` (F32, F16 or BF16).
float ValueAt(const std::vector<uint8_t>& out, DType to, int64_t i) {
  float v;
  if (to == DType::kF32) {
    std::memcpy(&v, &out[4 * i], 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, &out[2 * i], 2);
  return to == DType::kF16 ? F16ToF32(h) : Bf16ToF32(h);
}

TEST(Mxfp4Test, TheSixteenCodes) {
  const float want[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0f, -0.5, -1, -1.5, -2, -3, -4, -6};
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(Mxfp4Value(static_cast<uint8_t>(c)), want[c]) << c;
    EXPECT_EQ(Mxfp4Value(static_cast<uint8_t>(c | 0xF0)), want[c]) << c;  // the low nibble
  }
}

// Two rows of 64 values (two blocks each): the low nibble is the even value, the scale 2^(s-127).
TEST(Mxfp4Test, ARowExpandsExactlyIntoEveryDtype) {
  std::vector<uint8_t> blocks(2 * 2 * 16), scales = {127, 130, 120, 127};
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = static_cast<uint8_t>(i * 37 + 11);
  const TensorView b{"x.blocks", "f", DType::kU8, {2, 2, 16}, blocks.data(), blocks.size()};
  const TensorView s{"x.scales", "f", DType::kU8, {2, 2}, scales.data(), scales.size()};
  for (DType to : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int64_t row = 0; row < 2; ++row) {
      std::vector<uint8_t> out(64 * DTypeSize(to));
      ASSERT_TRUE(ExpandMxfp4Row(b, s, row, 64, to, out.data()).ok());
      for (int64_t c = 0; c < 64; ++c) {
        const uint8_t byte = blocks[row * 32 + c / 2];
        const float want = Mxfp4Value(c % 2 == 0 ? byte : byte >> 4) *
                           std::ldexp(1.0f, scales[row * 2 + c / 32] - 127);
        ASSERT_EQ(ValueAt(out, to, c), want) << DTypeName(to) << " row " << row << " column " << c;
      }
    }
  }
}

TEST(Mxfp4Test, ANanScaleOrAValuePastTheDtypeIsRefusedNamingTheTensor) {
  std::vector<uint8_t> blocks(16, 0x77), scales = {255};  // 6.0s
  const TensorView b{"e.blocks", "f", DType::kU8, {1, 1, 16}, blocks.data(), blocks.size()};
  const TensorView s{"e.scales", "f", DType::kU8, {1, 1}, scales.data(), scales.size()};
  std::vector<uint8_t> out(32 * 4);
  absl::Status st = ExpandMxfp4Row(b, s, 0, 32, DType::kBF16, out.data());
  EXPECT_THAT(std::string(st.message()),
              HasSubstr("'e.scales': the scale of row 0, block 0 is 255"));
  scales[0] = 254;  // 6 x 2^127 is past F32 and BF16
  st = ExpandMxfp4Row(b, s, 0, 32, DType::kBF16, out.data());
  EXPECT_THAT(std::string(st.message()), HasSubstr("'e.blocks': row 0, column 0 is past BF16"));
  scales[0] = 127 + 14;  // 6 x 2^14 = 98304 is past F16 only
  st = ExpandMxfp4Row(b, s, 0, 32, DType::kF16, out.data());
  EXPECT_THAT(std::string(st.message()), HasSubstr("past F16"));
  EXPECT_TRUE(ExpandMxfp4Row(b, s, 0, 32, DType::kBF16, out.data()).ok());
}

// ggml's blocks (GGUF's MXFP4): the scale byte first, value k in the low nibble of byte k, value
// k + 16 in its high nibble; a slice of rows and whole blocks of columns, in every dtype.
TEST(Mxfp4Test, GgmlBlocksExpandExactlyWithTheirScaleFirst) {
  std::vector<uint8_t> data(3 * 2 * 17);  // 3 rows of 64 values
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 29 + 5);
  for (size_t b = 0; b < 6; ++b) data[b * 17] = static_cast<uint8_t>(120 + b);  // scales
  const TensorView t{
      "blk.0.ffn_up_exps.weight", "f", DType::kMXFP4, {3, 64}, data.data(), data.size()};
  for (DType to : {DType::kF32, DType::kF16, DType::kBF16}) {
    std::vector<uint8_t> out(2 * 32 * DTypeSize(to));  // rows 1-2, the second block
    ASSERT_TRUE(ExpandGgmlMxfp4(t, 1, 3, 32, 64, to, out.data()).ok());
    for (int64_t r = 1; r < 3; ++r) {
      const uint8_t* block = data.data() + (r * 2 + 1) * 17;
      for (int64_t k = 0; k < 32; ++k) {
        const float want = Mxfp4Value(k < 16 ? block[1 + k] : block[1 + k - 16] >> 4) *
                           std::ldexp(1.0f, block[0] - 127);
        const int64_t i = (r - 1) * 32 + k;
        ASSERT_EQ(ValueAt(out, to, i), want) << DTypeName(to) << " row " << r << " value " << k;
      }
    }
  }
  data[17] = 255;  // row 0, block 1: E8M0's NaN
  const absl::Status s =
      ExpandGgmlMxfp4(t, 0, 1, 0, 64, DType::kBF16, std::vector<uint8_t>(128).data());
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("'blk.0.ffn_up_exps.weight': the scale of row 0, block 1 is 255"));
}

// gen-model --mxfp4 writes the experts as MXFP4; the model loads and generates (sharded: the
// ShardedTest's "gpt_oss mxfp4").
TEST(Mxfp4Test, AGptOssCheckpointInMxfp4LoadsAndShards) {
  testing::TempDir dir;
  auto o = testing::SmallModel("gpt_oss", dir.Sub("m"));
  o.mxfp4 = true;
  o.dtype = DType::kBF16;
  testing::WriteModel(o);
  auto one = Transformer::Load(o.out_dir, {});
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_TRUE((*one)->config().mxfp4());
  GenerationRequest req;
  req.prompt_ids = {1, 17, 42, 300, 7};
  req.params.max_tokens = 5;
  req.params.ignore_eos = true;
  auto got = Generate(**one, {req});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*got)[0].tokens.size(), 5u);
  // Experts whose rows do not fill MXFP4's blocks are refused by name.
  o.out_dir = dir.Sub("odd");
  o.intermediate = 48;
  EXPECT_THAT(std::string(GenerateModel(o).message()),
              HasSubstr("--mxfp4 is gpt_oss's, with --hidden (64) and --intermediate (48)"));
}

// Raw bytes where a weight belongs are refused naming the tensor, not handed to a kernel.
TEST(Mxfp4Test, BytesWhereAWeightBelongsAreRefusedByName) {
  testing::TempDir dir;
  auto o = testing::SmallModel("llama", dir.Sub("m"));
  o.dtype = DType::kBF16;
  testing::WriteModel(o);
  const std::string file = dir.Sub("m/model.safetensors");
  const std::string name = "model.layers.0.self_attn.q_proj.weight";
  std::vector<TensorSpec> specs;
  std::vector<std::vector<uint8_t>> data;
  {
    auto f = SafetensorsFile::Open(file);
    ASSERT_TRUE(f.ok()) << f.status();
    for (const auto& [n, t] : (*f)->tensors()) {
      std::vector<int64_t> shape = t.shape;
      if (n == name) shape.back() *= 2;  // the same bytes, as U8
      specs.push_back({n, n == name ? DType::kU8 : t.dtype, shape});
      data.emplace_back(static_cast<const uint8_t*>(t.data),
                        static_cast<const uint8_t*>(t.data) + t.nbytes);
    }
  }
  ASSERT_TRUE(WriteSafetensors(file, specs, [&](size_t i, std::vector<uint8_t>& bytes) {
                bytes = data[i];
              }).ok());
  auto m = Transformer::Load(o.out_dir, {});
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()), HasSubstr(name));
}

}  // namespace
}  // namespace shardserve
