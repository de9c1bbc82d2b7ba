#include "k8s/config.h"

#include <yaml-cpp/yaml.h>

#include <cstdlib>
#include <filesystem>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status.h"
#include "common/text.h"

namespace shardserve::k8s {
namespace {

namespace fs = std::filesystem;

// A PEM given inline (base64 "*-data") or as a file ("*" / "*-file"), relative to `base`.
absl::Status ReadPem(const YAML::Node& node, const std::string& data_key,
                     const std::string& file_key, const fs::path& base, const std::string& where,
                     std::string& out) {
  if (node[data_key] && node[data_key].IsScalar()) {
    if (!absl::Base64Unescape(node[data_key].Scalar(), &out)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".", data_key, " is not base64"));
    }
    return absl::OkStatus();
  }
  if (node[file_key] && node[file_key].IsScalar()) {
    fs::path p = node[file_key].Scalar();
    if (p.is_relative()) p = base / p;
    auto text = ReadFileToString(p.string());
    if (!text.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".", file_key, ": ", text.status().message()));
    }
    out = *std::move(text);
  }
  return absl::OkStatus();
}

// The `inner` mapping of the entry named `name` in a kubeconfig list; an invalid node if none.
YAML::Node Named(const YAML::Node& list, const std::string& name, const char* inner) {
  if (list && list.IsSequence()) {
    for (const auto& item : list) {
      if (item["name"] && item["name"].Scalar() == name && item[inner].IsMap()) return item[inner];
    }
  }
  return YAML::Node(YAML::NodeType::Undefined);
}

}  // namespace

absl::StatusOr<KubeConfig> LoadKubeconfig(const std::string& path, const std::string& context) {
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not valid YAML: ", e.what()));
  }
  try {
    const std::string ctx_name =
        !context.empty() ? context
                         : (root["current-context"] ? root["current-context"].Scalar() : "");
    if (ctx_name.empty()) return absl::InvalidArgumentError(path + ": no current-context");
    YAML::Node ctx = Named(root["contexts"], ctx_name, "context");
    if (!ctx.IsDefined()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": context '", ctx_name, "' not found"));
    }
    const std::string cluster_name = ctx["cluster"] ? ctx["cluster"].Scalar() : "";
    const std::string user_name = ctx["user"] ? ctx["user"].Scalar() : "";
    YAML::Node cluster = Named(root["clusters"], cluster_name, "cluster");
    if (!cluster.IsDefined()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": cluster '", cluster_name, "' not found"));
    }
    KubeConfig c;
    if (ctx["namespace"]) c.namespace_ = ctx["namespace"].Scalar();
    c.server = cluster["server"] ? cluster["server"].Scalar() : "";
    if (c.server.rfind("https://", 0) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": cluster '", cluster_name,
                                                     "' server '", c.server, "' is not https://"));
    }
    if (cluster["insecure-skip-tls-verify"] && cluster["insecure-skip-tls-verify"].as<bool>()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": cluster '", cluster_name, "' asks for insecure-skip-tls-verify; refused"));
    }
    const fs::path base = fs::path(path).parent_path();
    const std::string where = absl::StrCat(path, ": clusters[", cluster_name, "]");
    RETURN_IF_ERROR(ReadPem(cluster, "certificate-authority-data", "certificate-authority", base,
                            where, c.ca_pem));
    YAML::Node user = Named(root["users"], user_name, "user");
    if (user.IsDefined()) {
      const std::string uwhere = absl::StrCat(path, ": users[", user_name, "]");
      if (user["exec"] || user["auth-provider"]) {
        return absl::InvalidArgumentError(absl::StrCat(
            uwhere,
            " uses an exec or auth-provider plugin, which shardserve does not run; use a "
            "client certificate or a token"));
      }
      RETURN_IF_ERROR(
          ReadPem(user, "client-certificate-data", "client-certificate", base, uwhere, c.cert_pem));
      RETURN_IF_ERROR(ReadPem(user, "client-key-data", "client-key", base, uwhere, c.key_pem));
      if (user["token"]) c.token = user["token"].Scalar();
      if (user["tokenFile"]) {
        fs::path p = user["tokenFile"].Scalar();
        c.token_file = (p.is_relative() ? base / p : p).string();
      }
      if (c.cert_pem.empty() != c.key_pem.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(uwhere, " has a client certificate without its key, or a key alone"));
      }
    }
    return c;
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", e.what()));
  }
}

absl::StatusOr<KubeConfig> InClusterConfig(const std::string& root) {
  const char* host = std::getenv("KUBERNETES_SERVICE_HOST");
  const char* port = std::getenv("KUBERNETES_SERVICE_PORT");
  if (host == nullptr || port == nullptr) {
    return absl::FailedPreconditionError(
        "not in a pod: KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are not set");
  }
  KubeConfig c;
  const std::string h = host;
  c.server =
      absl::StrCat("https://", h.find(':') != std::string::npos ? "[" + h + "]" : h, ":", port);
  ASSIGN_OR_RETURN(c.ca_pem, ReadFileToString(root + "/ca.crt"));
  c.token_file = root + "/token";
  if (auto ns = ReadFileToString(root + "/namespace"); ns.ok()) {
    c.namespace_ = std::string(absl::StripAsciiWhitespace(*ns));
  }
  return c;
}

absl::StatusOr<KubeConfig> DefaultConfig() {
  if (const char* path = std::getenv("KUBECONFIG"); path != nullptr && *path) {
    return LoadKubeconfig(path);
  }
  if (std::getenv("KUBERNETES_SERVICE_HOST") != nullptr) return InClusterConfig();
  const char* home = std::getenv("HOME");
  return LoadKubeconfig(absl::StrCat(home ? home : "", "/.kube/config"));
}

absl::StatusOr<std::string> TokenSource::Token() {
  absl::MutexLock lock(&mu_);
  if (file_.empty()) return token_;
  std::error_code ec;
  const auto mtime = fs::last_write_time(file_, ec);
  if (ec) return absl::UnauthenticatedError(absl::StrCat("token file ", file_, ": ", ec.message()));
  const auto when = std::chrono::file_clock::to_sys(mtime);
  if (token_.empty() || when != mtime_) {
    ASSIGN_OR_RETURN(std::string text, ReadFileToString(file_));
    token_ = std::string(absl::StripAsciiWhitespace(text));
    mtime_ = std::chrono::time_point_cast<std::chrono::system_clock::duration>(when);
  }
  return token_;
}

}  // namespace shardserve::k8s
