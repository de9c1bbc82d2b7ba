#pragma once
// How to reach a kube-apiserver: from a kubeconfig file (client certificate or bearer token, a CA
// to verify the server; exec credential plugins are refused) or from inside a pod (the service
// account's token, re-read when the kubelet rotates it, and the cluster CA). TLS is always
// verified; there is no insecure mode.
#include <chrono>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace shardserve::k8s {

struct KubeConfig {
  std::string server;      // https://host:port
  std::string ca_pem;      // PEM of the CA bundle that signs the server's certificate
  std::string cert_pem;    // client certificate (PEM), with
  std::string key_pem;     // its private key
  std::string token;       // bearer token, or
  std::string token_file;  // a file holding it, re-read when it changes (service accounts)
  std::string namespace_ = "default";
};

// The kubeconfig at `path` (its current context, or `context`). Relative file references are
// resolved against the kubeconfig's directory. Errors name the file and the field.
absl::StatusOr<KubeConfig> LoadKubeconfig(const std::string& path, const std::string& context = "");

// Inside a pod: KUBERNETES_SERVICE_HOST/PORT and /var/run/secrets/kubernetes.io/serviceaccount
// (`root` replaces that directory, for tests).
absl::StatusOr<KubeConfig> InClusterConfig(
    const std::string& root = "/var/run/secrets/kubernetes.io/serviceaccount");

// $KUBECONFIG if set, else in-cluster, else ~/.kube/config.
absl::StatusOr<KubeConfig> DefaultConfig();

// The bearer token to send now: `token`, or the current contents of `token_file` (re-read when
// its modification time changes). Thread-safe.
class TokenSource {
 public:
  explicit TokenSource(const KubeConfig& config) : token_(config.token), file_(config.token_file) {}
  absl::StatusOr<std::string> Token();

 private:
  absl::Mutex mu_;
  std::string token_ ABSL_GUARDED_BY(mu_);
  const std::string file_;
  std::chrono::system_clock::time_point mtime_ ABSL_GUARDED_BY(mu_){};
};

}  // namespace shardserve::k8s
