// Flow control (serve/flow_control.h): the config's classes and errors, each key's tenant,
// requests-per-second and tokens-per-minute limits with their Retry-After, the share between
// routers, and a config changed without a restart.
#include "serve/flow_control.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <thread>

#include "model/test_models.h"

namespace shardserve {
namespace {

using ::testing::HasSubstr;
using Clock = FlowControl::Clock;
using testing::TempDir;

const char kConfig[] = R"(
tenants:
  - name: batch
    key: sk-batch-0123456789abcdef
    priority: 10
    weight: 1
    requestsPerSecond: 2
  - keySha256: 9F86D081884C7D659A2FEAA0C55AD015A3BF4F1B2B0B822CD15D6C15B0F00A08
    weight: 3
    tokensPerMinute: 100
default: {priority: 0, weight: 2}
)";

TEST(FlowControl, ReadsEachKeysClassAndTheDefault) {
  auto config = ParseFlowConfig(kConfig);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->by_digest.size(), 2u);
  TempDir dir;
  const std::string path = dir.Sub("flow.yaml");
  std::ofstream(path) << kConfig;
  auto fc = FlowControl::Open(path);
  ASSERT_TRUE(fc.ok()) << fc.status();
  const TenantClass batch = (*fc)->Tenant("Bearer sk-batch-0123456789abcdef");
  EXPECT_EQ(batch.name, "batch");
  EXPECT_EQ(batch.priority, 10);
  EXPECT_EQ(batch.requests_per_second, 2);
  const TenantClass test = (*fc)->Tenant("Bearer test");  // sha256("test"): by its digest
  EXPECT_EQ(test.name, "key-9f86d081884c");
  EXPECT_EQ(test.weight, 3);
  EXPECT_EQ(test.tokens_per_minute, 100);
  const TenantClass other = (*fc)->Tenant("Bearer sk-someone-else-0123456789");
  EXPECT_EQ(other.weight, 2);
  EXPECT_EQ(other.requests_per_second, 0);
  EXPECT_THAT(other.name, HasSubstr("key-"));
  EXPECT_EQ((*fc)->Tenant("").name, "anonymous");
}

TEST(FlowControl, ABadConfigNamesTheEntryAndField) {
  for (const auto& [text, want] : std::vector<std::pair<std::string, std::string>>{
           {"tenants: [{key: k, weight: 0}]", "tenants[0].weight must be in (0, 1000000]"},
           {"tenants: [{key: k, priority: 1.5}]", "tenants[0].priority must be an integer"},
           {"tenants: [{weight: 1}]", "tenants[0] needs key or keySha256"},
           {"tenants: [{keySha256: abc}]", "keySha256 must be 64 hexadecimal digits"},
           {"tenants: [{key: k, burst: 3}]", "tenants[0]: unknown field 'burst'"},
           {"tenants: [{key: k}, {key: k}]", "tenants[1]: the same key twice"},
           {"default: {requestsPerSecond: fast}", "default.requestsPerSecond must be a number"},
           {"limits: {}", "unknown field 'limits'"},
           {"tenants: [", "not valid YAML"},
       }) {
    auto c = ParseFlowConfig(text);
    ASSERT_FALSE(c.ok()) << text;
    EXPECT_THAT(std::string(c.status().message()), HasSubstr(want)) << text;
  }
}

TEST(FlowControl, RequestsPerSecondIsATokenBucketWithRetryAfter) {
  auto fc = *FlowControl::Open("");
  TenantClass t{"t", 0, 1.0, 2.0, 0};
  const Clock::time_point t0 = Clock::now();
  int64_t retry = 0;
  EXPECT_TRUE(fc->Admit(t, &retry, t0).ok());
  EXPECT_TRUE(fc->Admit(t, &retry, t0).ok());
  const absl::Status third = fc->Admit(t, &retry, t0);
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(third.message()), HasSubstr("'t' is past its requestsPerSecond 2"));
  EXPECT_EQ(retry, 1);
  EXPECT_TRUE(fc->Admit(t, &retry, t0 + std::chrono::milliseconds(500)).ok());
  // Another tenant has a bucket of its own.
  TenantClass u = t;
  u.name = "u";
  EXPECT_TRUE(fc->Admit(u, &retry, t0).ok());
}

TEST(FlowControl, TokensPerMinuteSlideAndAreSharedBetweenRouters) {
  auto fc = *FlowControl::Open("");
  TenantClass t{"t", 0, 1.0, 0, 100};
  const Clock::time_point t0 = Clock::now();
  int64_t retry = 0;
  EXPECT_TRUE(fc->Admit(t, &retry, t0).ok());
  fc->Record(t, 70, t0);
  EXPECT_TRUE(fc->Admit(t, &retry, t0 + std::chrono::seconds(10)).ok());
  fc->Record(t, 40, t0 + std::chrono::seconds(10));
  const absl::Status past = fc->Admit(t, &retry, t0 + std::chrono::seconds(20));
  EXPECT_THAT(std::string(past.message()), HasSubstr("tokensPerMinute 100"));
  EXPECT_GE(retry, 39);  // the first 70 leave the minute at about t0 + 60 s
  EXPECT_LE(retry, 41);
  EXPECT_TRUE(fc->Admit(t, &retry, t0 + std::chrono::seconds(61)).ok());
  // Two routers: each takes half of the limit.
  auto shared = *FlowControl::Open("", 2);
  shared->Record(t, 50, t0);
  const absl::Status half = shared->Admit(t, &retry, t0);
  EXPECT_THAT(std::string(half.message()), HasSubstr("(2 routers: each takes 1/2)"));
}

TEST(FlowControl, AChangedFileTakesEffectAndABrokenOneKeepsTheLast) {
  TempDir dir;
  const std::string path = dir.Sub("flow.yaml");
  std::ofstream(path) << "default: {weight: 1}\n";
  auto fc = *FlowControl::Open(path);
  EXPECT_EQ(fc->Tenant("Bearer x-0123456789abcdef").weight, 1);
  std::ofstream(path) << "default: {weight: 5}\n";
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  EXPECT_EQ(fc->Tenant("Bearer x-0123456789abcdef").weight, 5);
  std::ofstream(path) << "default: {weight: -1}\n";
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  EXPECT_EQ(fc->Tenant("Bearer x-0123456789abcdef").weight, 5);
  EXPECT_THAT(std::string(FlowControl::Open(path).status().message()),
              HasSubstr("flow.yaml: default.weight must be in (0, 1000000]"));
}

}  // namespace
}  // namespace shardserve
