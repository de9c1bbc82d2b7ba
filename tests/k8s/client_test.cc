// The Kubernetes client against a real control plane (tests/k8s/testenv, started once for this
// binary): TLS and authentication, typed writes, informers (create/update/delete, 410 recovery
// after an apiserver restart over a compacted etcd), optimistic-concurrency status updates racing
// spec updates, and the work queue collapsing a burst of events into few reconciles.
#include "k8s/client.h"

#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/process.h"
#include "common/text.h"
#include "k8s/config.h"
#include "k8s/informer.h"
#include "k8s/workqueue.h"
#include "operator/builders.h"

namespace shardserve::k8s {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

bool WaitFor(const std::function<bool()>& cond, std::chrono::milliseconds timeout = 30s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(20ms);
  }
  return cond();
}

// One control plane for the whole binary.
class TestEnv : public ::testing::Environment {
 public:
  static TestEnv* env;
  std::string dir, kubeconfig;
  pid_t pid = -1;

  void SetUp() override {
    const char* bin = std::getenv("SHARDSERVE_TESTENV_BIN");
    ASSERT_NE(bin, nullptr) << "SHARDSERVE_TESTENV_BIN names the testenv binaries";
    dir = (fs::temp_directory_path() / absl::StrCat("shardserve-k8s-", getpid())).string();
    fs::create_directories(dir);
    // The CRDs go in before the controllers start, so the garbage collector knows them at once.
    auto p = Spawn(
        std::string(bin) + "/testenv",
        {"up", "--dir", dir, "--bin", bin, "--crds", std::string(SHARDSERVE_SOURCE_DIR) + "/crds"},
        {});
    ASSERT_TRUE(p.ok()) << p.status();
    pid = *p;
    ASSERT_TRUE(WaitForReady()) << "testenv did not start; logs in " << dir;
    kubeconfig = dir + "/kubeconfig";
  }
  void TearDown() override {
    if (pid > 0) {
      kill(pid, SIGTERM);
      waitpid(pid, nullptr, 0);
    }
    fs::remove_all(dir);
  }
  bool WaitForReady() {
    return WaitFor([&] { return fs::exists(dir + "/ready"); }, 180s);
  }
  int Kubectl(const std::string& args) {
    return std::system(
        absl::StrCat("kubectl --kubeconfig ", dir, "/kubeconfig ", args, " >/dev/null 2>&1")
            .c_str());
  }
  // Restarts kube-apiserver over an etcd compacted past every version handed out so far.
  bool RestartCompacted() {
    kill(pid, SIGUSR1);
    if (!WaitFor([&] { return !fs::exists(dir + "/ready"); }, 30s)) return false;
    return WaitForReady();
  }
};
TestEnv* TestEnv::env = nullptr;

std::unique_ptr<Client> AdminClient(ClientOptions o = {}) {
  auto config = LoadKubeconfig(TestEnv::env->kubeconfig);
  EXPECT_TRUE(config.ok()) << config.status();
  auto c = Client::Create(*config, o);
  EXPECT_TRUE(c.ok()) << c.status();
  return *std::move(c);
}

json Pod(const std::string& name, const json& labels = json::object()) {
  return {{"apiVersion", "v1"},
          {"kind", "Pod"},
          {"metadata", {{"name", name}, {"labels", labels}}},
          {"spec", {{"containers", {{{"name", "w"}, {"image", "worker"}}}}}}};
}

json Model(const std::string& name) {
  return {{"apiVersion", "shardserve.io/v1alpha1"},
          {"kind", "ShardedModel"},
          {"metadata", {{"name", name}}},
          {"spec",
           {{"model", {{"name", name}, {"uri", "pvc://models/" + name}}},
            {"worker", {{"image", "worker:1"}}}}}};
}

TEST(K8sClient, TypedWritesAndTheApiserversErrors) {
  auto c = AdminClient();
  auto created = c->Create(kPods, "default", Pod("typed", {{"app", "a"}}));
  ASSERT_TRUE(created.ok()) << created.status();
  auto again = c->Create(kPods, "default", Pod("typed"));
  EXPECT_TRUE(ApiAlreadyExists(again.status())) << again.status();
  auto missing = c->Get(kPods, "default", "nope");
  EXPECT_TRUE(ApiNotFound(missing.status()));
  EXPECT_NE(missing.status().message().find("pods \"nope\" not found"), std::string::npos);

  auto patched =
      c->MergePatch(kPods, "default", "typed", {{"metadata", {{"labels", {{"b", "2"}}}}}});
  ASSERT_TRUE(patched.ok()) << patched.status();
  EXPECT_EQ((*patched)["metadata"]["labels"]["b"], "2");
  ListOptions lo;
  lo.label_selector = "app=a,b=2";
  auto list = c->List(kPods, "default", lo);
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ((*list)["items"].size(), 1u);

  // Server-side apply creates, then updates, with the field manager recorded.
  json svc = {{"metadata", {{"name", "applied"}}},
              {"spec", {{"ports", {{{"port", 8000}}}}, {"clusterIP", "None"}}}};
  ASSERT_TRUE(c->Apply(kServices, "default", svc).ok());
  svc["metadata"]["labels"] = {{"x", "y"}};
  auto applied = c->Apply(kServices, "default", svc);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ((*applied)["metadata"]["labels"]["x"], "y");
  EXPECT_EQ((*applied)["metadata"]["managedFields"][0]["manager"], "shardserve-operator");

  // Delete with a stale uid precondition is refused; with the right one it goes.
  absl::Status stale = c->Delete(kPods, "default", "typed", "00000000-0000-0000-0000-000000000000");
  EXPECT_TRUE(ApiConflict(stale)) << stale;
  EXPECT_TRUE(c->Delete(kPods, "default", "typed", (*created)["metadata"]["uid"]).ok());
  EXPECT_TRUE(c->Delete(kPods, "default", "typed").ok()) << "NotFound is success";

  // The ShardedModel's scale and status subresources, and an Event about it.
  ASSERT_TRUE(c->Create(kShardedModels, "default", Model("typed-model")).ok());
  auto scaled = c->MergePatch(kShardedModels, "default", "typed-model",
                              {{"spec", {{"replicas", 3}}}}, "scale");
  ASSERT_TRUE(scaled.ok()) << scaled.status();
  EXPECT_EQ((*c->Get(kShardedModels, "default", "typed-model", "scale"))["spec"]["replicas"], 3);
  auto status = c->MergePatch(kShardedModels, "default", "typed-model",
                              {{"status", {{"phase", "Pending"}}}}, "status");
  ASSERT_TRUE(status.ok()) << status.status();
  // A member dropped from the status (a node's download done) is gone on the server, not kept
  // by the merge patch.
  const json downloading = {
      {"phase", "Downloading"},
      {"downloads", {{{"node", "n1"}, {"bytes", 5}}}},
      {"model", {{"source", {{"revision", "abc"}}}, {"footprint", {{"layers", 2}}}}}};
  const json done = {{"phase", "Ready"}, {"model", {{"source", {{"revision", "abc"}}}}}};
  ASSERT_TRUE(c->MergePatch(kShardedModels, "default", "typed-model",
                            {{"status", MergePatchBetween((*status)["status"], downloading)}},
                            "status")
                  .ok());
  ASSERT_TRUE(c->MergePatch(kShardedModels, "default", "typed-model",
                            {{"status", MergePatchBetween(downloading, done)}}, "status")
                  .ok());
  EXPECT_EQ((*c->Get(kShardedModels, "default", "typed-model"))["status"], done);
  json event = {{"metadata", {{"name", "typed-model.1"}}},
                {"involvedObject",
                 {{"apiVersion", "shardserve.io/v1alpha1"},
                  {"kind", "ShardedModel"},
                  {"name", "typed-model"},
                  {"namespace", "default"}}},
                {"reason", "Placed"},
                {"message", "replica 0 placed"},
                {"type", "Normal"}};
  EXPECT_TRUE(c->Create(kEvents, "default", event).ok());

  // Leases and nodes (cluster-scoped) have typed paths too.
  json lease = {{"metadata", {{"name", "l"}}}, {"spec", {{"holderIdentity", "me"}}}};
  EXPECT_TRUE(c->Create(kLeases, "default", lease).ok());
  EXPECT_TRUE(c->List(kNodes, "").ok());
  EXPECT_GT(c->requests(), 10);
}

TEST(K8sClient, TlsIsVerifiedAndBadCredentialsFailClearly) {
  auto config = *LoadKubeconfig(TestEnv::env->kubeconfig);
  KubeConfig wrong_ca = config;
  // Any other CA: the client certificate's issuer is not the server's.
  wrong_ca.ca_pem = *ReadFileToString(TestEnv::env->dir + "/pki/admin.crt");
  auto c = Client::Create(wrong_ca);
  ASSERT_TRUE(c.ok()) << c.status();
  auto r = (*c)->Get(kNodes, "", "");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("does not verify against the configured CA"),
            std::string::npos)
      << r.status();

  KubeConfig bad_token = config;
  bad_token.cert_pem.clear();
  bad_token.key_pem.clear();
  bad_token.token = "expired-or-forged";
  auto t = Client::Create(bad_token);
  ASSERT_TRUE(t.ok());
  auto denied = (*t)->List(kPods, "default");
  EXPECT_EQ(denied.status().code(), absl::StatusCode::kUnauthenticated) << denied.status();
  EXPECT_NE(denied.status().message().find("401"), std::string::npos);

  KubeConfig garbage = config;
  garbage.ca_pem = "not a certificate";
  EXPECT_EQ(Client::Create(garbage).status().code(), absl::StatusCode::kInvalidArgument);
}

// A service-account token signed with the cluster's key, as kube-apiserver issues them, with the
// given expiry (seconds from now).
std::string SignedToken(const std::string& sa_uid, int64_t expires_in) {
  const int64_t now = std::time(nullptr);
  const json header = {{"alg", "RS256"}, {"typ", "JWT"}};
  const json claims = {
      {"iss", "https://kubernetes.default.svc"},
      {"aud", {"https://kubernetes.default.svc"}},
      {"sub", "system:serviceaccount:default:op"},
      {"iat", now - 3600},
      {"nbf", now - 3600},
      {"exp", now + expires_in},
      {"kubernetes.io",
       {{"namespace", "default"}, {"serviceaccount", {{"name", "op"}, {"uid", sa_uid}}}}}};
  auto b64 = [](const std::string& s) {
    std::string out;
    absl::WebSafeBase64Escape(s, &out);
    return out;
  };
  const std::string signing_input = b64(header.dump()) + "." + b64(claims.dump());
  const std::string key = *ReadFileToString(TestEnv::env->dir + "/pki/sa.key");
  BIO* bio = BIO_new_mem_buf(key.data(), static_cast<int>(key.size()));
  EVP_PKEY* pkey = PEM_read_bio_PrivateKey(bio, nullptr, nullptr, nullptr);
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  size_t len = 0;
  EVP_DigestSignInit(ctx, nullptr, EVP_sha256(), nullptr, pkey);
  EVP_DigestSignUpdate(ctx, signing_input.data(), signing_input.size());
  EVP_DigestSignFinal(ctx, nullptr, &len);
  std::string sig(len, '\0');
  EVP_DigestSignFinal(ctx, reinterpret_cast<unsigned char*>(sig.data()), &len);
  sig.resize(len);
  EVP_MD_CTX_free(ctx);
  EVP_PKEY_free(pkey);
  BIO_free(bio);
  return signing_input + "." + b64(sig);
}

TEST(K8sClient, ServiceAccountTokenAuthenticatesAndRotates) {
  const ResourceType service_accounts{"", "v1", "serviceaccounts", "ServiceAccount", true};
  const ResourceType roles{"rbac.authorization.k8s.io", "v1", "roles", "Role", true};
  const ResourceType role_bindings{"rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding",
                                   true};
  auto admin = AdminClient();
  ASSERT_TRUE(admin->Create(service_accounts, "default", {{"metadata", {{"name", "op"}}}}).ok());
  json request = {{"apiVersion", "authentication.k8s.io/v1"},
                  {"kind", "TokenRequest"},
                  {"spec", {{"expirationSeconds", 600}}}};
  auto issued = admin->Request("POST", service_accounts.Path("default", "op", "token"), &request);
  ASSERT_TRUE(issued.ok()) << issued.status();
  const std::string token = (*issued)["status"]["token"];

  // The token file is re-read when it changes (the kubelet rotates it in a pod).
  KubeConfig config = *LoadKubeconfig(TestEnv::env->kubeconfig);
  config.cert_pem.clear();
  config.key_pem.clear();
  config.token_file = TestEnv::env->dir + "/sa-token";
  std::ofstream(config.token_file) << token;
  auto c = Client::Create(config);
  ASSERT_TRUE(c.ok());
  auto forbidden = (*c)->List(kPods, "default");
  EXPECT_EQ(forbidden.status().code(), absl::StatusCode::kPermissionDenied)
      << "authenticated as the service account, which may not list pods yet: "
      << forbidden.status();
  EXPECT_NE(forbidden.status().message().find("system:serviceaccount:default:op"),
            std::string::npos);
  json role = {
      {"metadata", {{"name", "pod-reader"}}},
      {"rules", {{{"apiGroups", {""}}, {"resources", {"pods"}}, {"verbs", {"get", "list"}}}}}};
  ASSERT_TRUE(admin->Create(roles, "default", role).ok());
  json binding = {
      {"metadata", {{"name", "op-reads-pods"}}},
      {"roleRef",
       {{"apiGroup", "rbac.authorization.k8s.io"}, {"kind", "Role"}, {"name", "pod-reader"}}},
      {"subjects", {{{"kind", "ServiceAccount"}, {"name", "op"}, {"namespace", "default"}}}}};
  ASSERT_TRUE(admin->Create(role_bindings, "default", binding).ok());
  EXPECT_TRUE(WaitFor([&] { return (*c)->List(kPods, "default").ok(); }, 10s))
      << (*c)->List(kPods, "default").status();

  // A token of this very account that expired a minute ago is refused, clearly; the same token
  // unexpired is accepted (so the expiry is what was refused).
  const std::string uid = (*admin->Get(service_accounts, "default", "op"))["metadata"]["uid"];
  KubeConfig with_token = config;
  with_token.token_file.clear();
  with_token.token = SignedToken(uid, 3600);
  EXPECT_TRUE((*Client::Create(with_token))->List(kPods, "default").ok());
  with_token.token = SignedToken(uid, -60);
  auto expired = (*Client::Create(with_token))->List(kPods, "default");
  EXPECT_EQ(expired.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_NE(expired.status().message().find("the bearer token was refused: expired"),
            std::string::npos)
      << expired.status();

  std::this_thread::sleep_for(1100ms);  // a different modification time
  std::ofstream(config.token_file, std::ios::trunc) << "rotated-to-garbage";
  EXPECT_EQ((*c)->List(kPods, "default").status().code(), absl::StatusCode::kUnauthenticated);
  std::this_thread::sleep_for(1100ms);
  std::ofstream(config.token_file, std::ios::trunc) << token;
  EXPECT_TRUE((*c)->List(kPods, "default").ok());
}

TEST(K8sInformer, SeesPodsAndShardedModelsComeAndGo) {
  auto c = AdminClient();
  absl::Mutex mu;
  std::vector<std::string> seen;
  auto record = [&](const std::string& what) {
    absl::MutexLock lock(&mu);
    seen.push_back(what);
  };
  auto has = [&](const std::string& what) {
    absl::MutexLock lock(&mu);
    return std::find(seen.begin(), seen.end(), what) != seen.end();
  };
  EventHandlers h;
  h.on_add = [&](const json& o) { record("add " + Store::KeyOf(o)); };
  h.on_update = [&](const json&, const json& o) { record("update " + Store::KeyOf(o)); };
  h.on_delete = [&](const json& o) { record("delete " + Store::KeyOf(o)); };
  InformerOptions po;
  po.label_selector = "informer=yes";
  Informer pods(c.get(), kPods, po, h);
  Informer models(c.get(), kShardedModels, {}, h);
  ASSERT_TRUE(c->Create(kPods, "default", Pod("before", {{"informer", "yes"}})).ok());
  pods.Start();
  models.Start();
  ASSERT_TRUE(pods.WaitForSync(30s) && models.WaitForSync(30s));
  EXPECT_TRUE(has("add default/before")) << "the initial list is reported as adds";

  ASSERT_TRUE(
      c->Create(kPods, "default", Pod("p", {{"informer", "yes"}, {"role", "leader"}})).ok());
  ASSERT_TRUE(c->Create(kPods, "default", Pod("other")).ok());  // not selected
  ASSERT_TRUE(c->Create(kShardedModels, "default", Model("m1")).ok());
  EXPECT_TRUE(WaitFor([&] { return has("add default/p") && has("add default/m1"); }));
  EXPECT_EQ(pods.store().ByLabel("role", "leader").size(), 1u);
  EXPECT_FALSE(pods.store().Get("default/other").has_value());
  EXPECT_FALSE(pods.store().Get("default/p")->at("metadata").contains("managedFields"));

  ASSERT_TRUE(c->MergePatch(kShardedModels, "default", "m1", {{"spec", {{"replicas", 3}}}}).ok());
  EXPECT_TRUE(WaitFor([&] {
    auto m = models.store().Get("default/m1");
    return has("update default/m1") && m && (*m)["spec"]["replicas"] == 3;
  }));
  ASSERT_TRUE(c->Delete(kPods, "default", "p").ok());
  ASSERT_TRUE(c->Delete(kShardedModels, "default", "m1").ok());
  EXPECT_TRUE(WaitFor([&] { return has("delete default/p") && has("delete default/m1"); }));
  EXPECT_EQ(pods.store().ByLabel("role", "leader").size(), 0u);
  EXPECT_EQ(pods.lists(), 1);
}

TEST(K8sInformer, RecoversFromGoneAfterTheApiserverRestartsOverACompactedEtcd) {
  auto c = AdminClient();
  std::atomic<int> deletes{0};
  EventHandlers h;
  h.on_delete = [&](const json&) { ++deletes; };
  InformerOptions o;
  o.label_selector = "gone=test";
  o.min_backoff = 50ms;
  Informer pods(c.get(), kPods, o, h);
  ASSERT_TRUE(c->Create(kPods, "default", Pod("g1", {{"gone", "test"}})).ok());
  pods.Start();
  ASSERT_TRUE(pods.WaitForSync(30s));
  ASSERT_EQ(pods.lists(), 1);
  ASSERT_TRUE(TestEnv::env->RestartCompacted());
  // The informer's resourceVersion is older than the compaction: its watch gets 410 Gone and it
  // lists again; afterwards events flow as before.
  EXPECT_TRUE(WaitFor([&] { return pods.lists() >= 2; }, 60s)) << pods.last_error();
  ASSERT_TRUE(c->Create(kPods, "default", Pod("g2", {{"gone", "test"}})).ok());
  EXPECT_TRUE(WaitFor([&] { return pods.store().Get("default/g2").has_value(); }));
  ASSERT_TRUE(c->Delete(kPods, "default", "g1").ok());
  EXPECT_TRUE(WaitFor([&] { return deletes.load() == 1; }));
  EXPECT_EQ(pods.store().size(), 1u);
}

// Every status write loses a race with a spec write once: the spec changes between the client's
// read and its PUT (written from inside the mutation, so the interleaving is the same on a loaded
// machine), the PUT conflicts, and the client reads again and lands the update on the new object.
TEST(K8sClient, StatusUpdatesRacingSpecUpdatesAllLand) {
  auto c = AdminClient();
  ASSERT_TRUE(c->Create(kShardedModels, "default", Model("race")).ok());
  constexpr int kUpdates = 20;
  int written = 0;
  int reads = 0;
  for (int i = 0; i < kUpdates; ++i) {
    bool raced = false;
    auto r = c->UpdateStatus(kShardedModels, "default", "race", [&](json& o) {
      ++reads;
      if (!raced) {
        raced = true;
        EXPECT_TRUE(
            c->MergePatch(kShardedModels, "default", "race", {{"spec", {{"replicas", 2 + i % 2}}}})
                .ok());
      }
      const int n = o.contains("status") ? o["status"].value("readyReplicas", 0) : 0;
      o["status"]["readyReplicas"] = n + 1;
      o["status"]["observedGeneration"] = o["metadata"]["generation"];
      return true;
    });
    written += r.ok();
    EXPECT_TRUE(r.ok()) << r.status();
  }
  EXPECT_EQ(written, kUpdates);
  EXPECT_EQ(reads, 2 * kUpdates) << "each update conflicted once and was read again once";
  EXPECT_EQ((*c->Get(kShardedModels, "default", "race"))["status"]["readyReplicas"], kUpdates)
      << "no status update was lost to a conflict";
}

// The operator's builders produce objects the real apiserver accepts, owned by the model (and
// collected with it).
TEST(K8sBuilders, StagePodsAndServicesAreAcceptedAndOwned) {
  auto c = AdminClient();
  json model = Model("built");
  model["spec"]["parallelism"] = {{"tensor", 4}, {"pipeline", 2}};
  model["spec"]["worker"]["tolerations"] = {{{"key", "gpu"}, {"operator", "Exists"}}};
  auto created = c->Create(kShardedModels, "default", model);
  ASSERT_TRUE(created.ok()) << created.status();
  auto view = op::ReadModel(*created);
  ASSERT_TRUE(view.ok()) << view.status();
  for (int64_t stage = 0; stage < 2; ++stage) {
    auto pod = c->Create(kPods, "default", op::BuildStagePod(*view, 0, stage, {"gpu-a", "gpu-a"}));
    EXPECT_TRUE(pod.ok()) << pod.status();
  }
  EXPECT_TRUE(c->Create(kServices, "default", op::BuildWorkersService(*view)).ok());
  EXPECT_TRUE(c->Create(kServices, "default", op::BuildLeaderService(*view)).ok());
  ASSERT_TRUE(c->Delete(kShardedModels, "default", "built").ok());
  EXPECT_TRUE(WaitFor(
      [&] {
        return ApiNotFound(c->Get(kPods, "default", "built-0-1").status()) &&
               ApiNotFound(c->Get(kServices, "default", "built-workers").status());
      },
      120s))
      << "the garbage collector removes the children with their owner (it learns a new "
         "CRD within its 30 s discovery resync)";
}

TEST(K8sWorkQueue, ABurstOfEventsForOneKeyIsReconciledOnceOrTwice) {
  auto c = AdminClient();
  WorkQueue queue;
  EventHandlers h;
  auto enqueue = [&](const json& o) { queue.Add(Store::KeyOf(o)); };
  h.on_add = enqueue;
  h.on_update = [&](const json&, const json& o) { enqueue(o); };
  Informer models(c.get(), kShardedModels, {}, h);
  models.Start();
  ASSERT_TRUE(models.WaitForSync(30s));
  ASSERT_TRUE(c->Create(kShardedModels, "default", Model("burst")).ok());
  std::atomic<int> reconciles{0};
  std::thread worker([&] {
    while (auto key = queue.Get()) {
      if (*key == "default/burst") {
        ++reconciles;
        std::this_thread::sleep_for(300ms);  // a slow reconcile while events pile up
      }
      queue.Done(*key);
    }
  });
  const int64_t before = models.events();
  for (int i = 0; i < 30; ++i) {
    ASSERT_TRUE(
        c->MergePatch(kShardedModels, "default", "burst", {{"spec", {{"replicas", i}}}}).ok());
  }
  EXPECT_TRUE(WaitFor([&] { return models.events() - before >= 30; }));
  EXPECT_TRUE(WaitFor([&] { return queue.Len() == 0; }));
  std::this_thread::sleep_for(400ms);
  queue.ShutDown();
  worker.join();
  EXPECT_GE(reconciles.load(), 1);
  EXPECT_LE(reconciles.load(), 4) << "31 events for one key";
  EXPECT_EQ((*models.store().Get("default/burst"))["spec"]["replicas"], 29);
}

}  // namespace
}  // namespace shardserve::k8s

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  shardserve::k8s::TestEnv::env = new shardserve::k8s::TestEnv();
  ::testing::AddGlobalTestEnvironment(shardserve::k8s::TestEnv::env);
  return RUN_ALL_TESTS();
}
