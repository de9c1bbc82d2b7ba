// Kubeconfig and in-cluster configuration (pure file parsing), and the work queue's semantics.
#include "k8s/config.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "k8s/workqueue.h"
#include "model/test_models.h"

namespace shardserve::k8s {
namespace {

using namespace std::chrono_literals;
using testing::TempDir;

void Write(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

TEST(KubeConfig, ReadsCertificatesTokensAndRefusesWhatItCannotHonour) {
  TempDir dir;
  Write(dir.Sub("ca.crt"), "CA PEM");
  Write(dir.Sub("c.crt"), "CERT PEM");
  Write(dir.Sub("c.key"), "KEY PEM");
  const std::string base = R"(apiVersion: v1
kind: Config
current-context: a
contexts:
- {name: a, context: {cluster: c, user: u, namespace: team}}
- {name: b, context: {cluster: c, user: t}}
clusters:
- {name: c, cluster: {server: "https://10.0.0.1:6443", certificate-authority: ca.crt}}
users:
- {name: u, user: {client-certificate: c.crt, client-key: c.key}}
- {name: t, user: {token: abc}}
- {name: e, user: {exec: {command: aws}}}
)";
  Write(dir.Sub("kubeconfig"), base);
  auto c = LoadKubeconfig(dir.Sub("kubeconfig"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->server, "https://10.0.0.1:6443");
  EXPECT_EQ(c->ca_pem, "CA PEM");  // relative to the kubeconfig's directory
  EXPECT_EQ(c->cert_pem, "CERT PEM");
  EXPECT_EQ(c->key_pem, "KEY PEM");
  EXPECT_EQ(c->namespace_, "team");
  auto t = LoadKubeconfig(dir.Sub("kubeconfig"), "b");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->token, "abc");
  EXPECT_NE(LoadKubeconfig(dir.Sub("kubeconfig"), "zz").status().message().find("'zz' not found"),
            std::string::npos);

  auto with = [&](const std::string& from, const std::string& to) {
    std::string s = base;
    s.replace(s.find(from), from.size(), to);
    Write(dir.Sub("k2"), s);
    return LoadKubeconfig(dir.Sub("k2")).status();
  };
  EXPECT_NE(with("user: u,", "user: e,").message().find("exec or auth-provider"),
            std::string::npos);
  EXPECT_NE(with("https://10.0.0.1:6443", "http://10.0.0.1:8080").message().find("not https"),
            std::string::npos);
  EXPECT_NE(with("certificate-authority: ca.crt", "insecure-skip-tls-verify: true")
                .message()
                .find("insecure-skip-tls-verify"),
            std::string::npos);
  EXPECT_NE(with("ca.crt}", "missing.crt}").message().find("missing.crt"), std::string::npos);
}

TEST(KubeConfig, InClusterTokenIsReReadWhenRotated) {
  TempDir dir;
  Write(dir.Sub("ca.crt"), "CA");
  Write(dir.Sub("token"), "first\n");
  Write(dir.Sub("namespace"), "serving");
  setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1", 1);
  setenv("KUBERNETES_SERVICE_PORT", "443", 1);
  auto c = InClusterConfig(dir.path());
  unsetenv("KUBERNETES_SERVICE_HOST");
  unsetenv("KUBERNETES_SERVICE_PORT");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->server, "https://10.96.0.1:443");
  EXPECT_EQ(c->namespace_, "serving");
  TokenSource tokens(*c);
  EXPECT_EQ(*tokens.Token(), "first");
  std::this_thread::sleep_for(1100ms);  // a new modification time
  Write(dir.Sub("token"), "second");
  EXPECT_EQ(*tokens.Token(), "second");
  EXPECT_EQ(InClusterConfig(dir.path()).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(WorkQueue, DeduplicatesAndNeverHandsOutAKeyTwiceAtOnce) {
  WorkQueue q;
  for (int i = 0; i < 100; ++i) q.Add("a");
  q.Add("b");
  EXPECT_EQ(q.Len(), 2u);
  EXPECT_EQ(q.adds(), 101);
  auto a = q.Get();
  EXPECT_EQ(*a, "a");
  q.Add("a");  // while processing: comes back after Done, not now
  EXPECT_EQ(*q.Get(), "b");
  EXPECT_EQ(q.Len(), 0u);
  q.Done("b");
  q.Done("a");
  EXPECT_EQ(*q.Get(), "a");
  q.Done("a");
  q.ShutDown();
  EXPECT_FALSE(q.Get().has_value());
}

TEST(WorkQueue, FailuresBackOffPerKeyAndForgetResets) {
  RateLimit limit;
  limit.base = 20ms;
  WorkQueue q(limit);
  const auto t0 = std::chrono::steady_clock::now();
  q.AddRateLimited("k");  // 20 ms
  EXPECT_EQ(*q.Get(), "k");
  q.Done("k");
  q.AddRateLimited("k");  // 40 ms
  EXPECT_EQ(*q.Get(), "k");
  q.Done("k");
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 60ms);
  EXPECT_EQ(q.Requeues("k"), 2);
  q.Forget("k");
  EXPECT_EQ(q.Requeues("k"), 0);
  q.AddAfter("later", 30ms);
  q.Add("now");
  EXPECT_EQ(*q.Get(), "now");
  EXPECT_EQ(*q.Get(), "later");
}

}  // namespace
}  // namespace shardserve::k8s
