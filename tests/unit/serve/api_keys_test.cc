#include "serve/api_keys.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "api/worker_env.h"
#include "serve/api_server.h"

namespace shardserve {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

class ApiKeysTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("api-keys-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Write(const std::string& name, const std::string& text) {
    const fs::path p = dir_ / name;
    std::ofstream(p) << text;
    return p.string();
  }
  fs::path dir_;
};

TEST_F(ApiKeysTest, ChecksBearerKeysFromAFile) {
  const std::string file =
      Write("keys", "# comment\n\n  sk-first-key-0123456789  \nsk-second-key-0123456789\n");
  auto keys = ApiKeys::Create("", file);
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_EQ((*keys)->size(), 2u);
  EXPECT_TRUE((*keys)->Check("Bearer sk-first-key-0123456789").ok());
  EXPECT_TRUE((*keys)->Check("bearer sk-second-key-0123456789").ok());
  for (const char* bad : {"", "Bearer", "Bearer ", "Basic sk-first-key-0123456789",
                          "Bearer sk-first-key-012345678", "Bearer sk-first-key-0123456789x"}) {
    absl::Status s = (*keys)->Check(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << bad;
    EXPECT_THAT(std::string(s.message()), ::testing::Not(HasSubstr("sk-")));  // never echoed
  }
}

// A mounted Secret: one file per entry beside the kubelet's hidden ..data links.
TEST_F(ApiKeysTest, ReadsAMountedSecretAndFollowsItsRotation) {
  Write("team-a", "sk-team-a-key-0123456789");
  Write("..data", "not a key");
  auto keys = ApiKeys::Create("sk-env-key-0123456789abc", dir_.string());
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_TRUE((*keys)->Check("Bearer sk-team-a-key-0123456789").ok());
  EXPECT_TRUE((*keys)->Check("Bearer sk-env-key-0123456789abc").ok());
  Write("team-a", "sk-team-a-rotated-0123456789");
  bool rotated = false;
  for (int i = 0; i < 100 && !rotated; ++i) {  // re-read within a few seconds
    rotated = (*keys)->Check("Bearer sk-team-a-rotated-0123456789").ok();
    if (!rotated) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(rotated);
  EXPECT_FALSE((*keys)->Check("Bearer sk-team-a-key-0123456789").ok());
}

TEST_F(ApiKeysTest, RefusesWeakOrMissingKeysByName) {
  auto short_key = ApiKeys::Create("", Write("keys", "sk-ok-key-0123456789\nshort\n"));
  EXPECT_THAT(std::string(short_key.status().message()),
              HasSubstr("keys:2: an API key must have 16"));
  auto spaced = ApiKeys::Create("with space 0123456789", "");
  EXPECT_THAT(std::string(spaced.status().message()), HasSubstr("SHARDSERVE_API_KEY"));
  auto empty = ApiKeys::Create("", Write("empty", "# nothing\n"));
  EXPECT_THAT(std::string(empty.status().message()), HasSubstr("holds no API key"));
  auto missing = ApiKeys::Create("", (dir_ / "nope").string());
  EXPECT_FALSE(missing.ok());
}

// The server's keys come through the worker contract: its keys file and SHARDSERVE_API_KEY,
// read with the rest of the contract; neither leaves the API open.
TEST_F(ApiKeysTest, TheServerConfigCarriesTheKeys) {
  const std::string file = Write("keys", "sk-from-the-file-0123\n");
  const std::map<std::string, std::string> vars = {{"SHARDSERVE_API_KEYS_FILE", file},
                                                   {"SHARDSERVE_API_KEY", "sk-from-the-env-01234"}};
  auto w = WorkerEnv::FromEnv([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
  ASSERT_TRUE(w.ok()) << w.status();
  const ServeConfig c = ServeConfigFrom(*w, /*local=*/true);
  EXPECT_EQ(c.env.api_keys_file, file);
  EXPECT_EQ(c.env.api_key, "sk-from-the-env-01234");
  EXPECT_EQ(c.host, "127.0.0.1");
  auto keys = ApiKeys::Open(c.env.api_key, c.env.api_keys_file);
  ASSERT_TRUE(keys.ok() && *keys != nullptr) << keys.status();
  EXPECT_TRUE((*keys)->Check("Bearer sk-from-the-file-0123").ok());
  EXPECT_TRUE((*keys)->Check("Bearer sk-from-the-env-01234").ok());
  auto open = ApiKeys::Open("", "");
  ASSERT_TRUE(open.ok());
  EXPECT_EQ(*open, nullptr);
}

}  // namespace
}  // namespace shardserve
