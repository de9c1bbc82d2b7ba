#include "common/args.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace shardserve {
namespace {

using ::testing::HasSubstr;

TEST(ArgsTest, ParsesValuesInlineValuesAndBooleans) {
  auto a = Args::Parse({"--model", "m", "--n=3", "--flag"}, {"model", "n"}, {"flag"});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->GetOr("model", ""), "m");
  EXPECT_EQ(*a->GetInt("n", 0), 3);
  EXPECT_TRUE(a->Has("flag"));
  EXPECT_EQ(*a->GetInt("absent", 7), 7);
}

std::string Error(const absl::StatusOr<Args>& a) { return std::string(a.status().message()); }

TEST(ArgsTest, ErrorsNameTheFlag) {
  EXPECT_EQ(Error(Args::Parse({"--bogus"}, {"model"}, {})),
            "The following argument was not expected: --bogus");
  EXPECT_EQ(Error(Args::Parse({"--model"}, {"model"}, {})), "--model: 1 required VALUE missing");
  EXPECT_EQ(Error(Args::Parse({"stray"}, {"model"}, {})),
            "The following argument was not expected: stray");
  EXPECT_THAT(Error(Args::Parse({"--flag=x"}, {}, {"flag"})), HasSubstr("--flag"));
  auto a = Args::Parse({"--n", "x3"}, {"n"}, {});
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->GetInt("n", 0).status().message(), "--n: 'x3' is not an integer");
  EXPECT_EQ(a->Require("model").status().message(), "--model is required");
}

TEST(ArgsTest, HelpIsTheCommandsOwnUsage) {
  auto a = Args::Parse({"--help"}, {"file", "port"}, {"verbose"}, "shardserve local",
                       "Runs a ShardedModel on this machine.");
  ASSERT_FALSE(a.ok());
  EXPECT_TRUE(IsHelp(a.status()));
  const std::string help = Error(a);
  EXPECT_THAT(help, HasSubstr("Runs a ShardedModel on this machine."));
  EXPECT_THAT(help, HasSubstr("Usage: shardserve local [OPTIONS]"));
  EXPECT_THAT(help, HasSubstr("-f,--file"));
  EXPECT_THAT(help, HasSubstr("--verbose"));
  EXPECT_TRUE(IsHelp(Args::Parse({"-h"}, {}, {}).status()));
  EXPECT_FALSE(IsHelp(Args::Parse({"--bogus"}, {}, {}).status()));
  auto f = Args::Parse({"-f", "m.yaml"}, {"file"}, {});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->GetOr("file", ""), "m.yaml");
}

}  // namespace
}  // namespace shardserve
