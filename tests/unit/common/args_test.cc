#include "common/args.h"

#include <gtest/gtest.h>

namespace shardserve {
namespace {

TEST(ArgsTest, ParsesValuesInlineValuesAndBooleans) {
  auto a = Args::Parse({"--model", "m", "--n=3", "--flag"}, {"model", "n"}, {"flag"});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->GetOr("model", ""), "m");
  EXPECT_EQ(*a->GetInt("n", 0), 3);
  EXPECT_TRUE(a->Has("flag"));
  EXPECT_EQ(*a->GetInt("absent", 7), 7);
}

TEST(ArgsTest, ErrorsNameTheFlag) {
  EXPECT_EQ(Args::Parse({"--bogus"}, {"model"}, {}).status().message(), "unknown flag --bogus");
  EXPECT_EQ(Args::Parse({"--model"}, {"model"}, {}).status().message(), "--model needs a value");
  EXPECT_EQ(Args::Parse({"stray"}, {"model"}, {}).status().message(),
            "unexpected argument 'stray'");
  auto a = Args::Parse({"--n", "x3"}, {"n"}, {});
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->GetInt("n", 0).status().message(), "--n: 'x3' is not an integer");
  EXPECT_EQ(a->Require("model").status().message(), "--model is required");
}

}  // namespace
}  // namespace shardserve
