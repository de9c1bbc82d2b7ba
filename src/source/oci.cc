#include "source/oci.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status.h"

namespace shardserve::source {
namespace {

using json = nlohmann::json;

constexpr size_t kMaxLayers = 10000;
constexpr size_t kMaxManifest = size_t{4}
                                << 20;  // what the distribution spec lets a registry refuse
constexpr char kTitle[] = "org.opencontainers.image.title";
constexpr char kAccept[] =
    "Accept: application/vnd.oci.image.manifest.v1+json, "
    "application/vnd.docker.distribution.manifest.v2+json";

// "host:port" of a Docker config's key ("https://host:port/v1/" and the like).
std::string RegistryOf(absl::string_view key) {
  absl::ConsumePrefix(&key, "https://") || absl::ConsumePrefix(&key, "http://");
  return std::string(key.substr(0, key.find('/')));
}

// "user:password" for `registry` from a Docker config; "" when it has none.
absl::StatusOr<std::string> CredentialsFor(const std::string& config, const std::string& registry) {
  if (config.empty()) return "";
  const json j = json::parse(config, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("the Docker config (registry credentials) is not JSON");
  }
  const json auths = j.value("auths", json::object());
  if (!auths.is_object()) return "";
  for (const auto& [key, entry] : auths.items()) {
    if (RegistryOf(key) != registry || !entry.is_object()) continue;
    if (entry.contains("auth") && entry["auth"].is_string()) {
      std::string plain;
      if (!absl::Base64Unescape(entry["auth"].get<std::string>(), &plain) ||
          plain.find(':') == std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat("the Docker config's 'auth' for ", registry,
                                                       " is not base64 of USER:PASSWORD"));
      }
      return plain;
    }
    if (entry.contains("username") && entry["username"].is_string() && entry.contains("password") &&
        entry["password"].is_string()) {
      return absl::StrCat(entry["username"].get<std::string>(), ":",
                          entry["password"].get<std::string>());
    }
  }
  return "";
}

// The parameters of a WWW-Authenticate challenge: `Bearer realm="...",service="...",scope="..."`.
std::map<std::string, std::string> ChallengeParams(absl::string_view c) {
  std::map<std::string, std::string> out;
  const size_t space = c.find(' ');
  out["scheme"] = absl::AsciiStrToLower(c.substr(0, space));
  if (space == absl::string_view::npos) return out;
  c.remove_prefix(space + 1);
  while (!c.empty()) {
    c = absl::StripLeadingAsciiWhitespace(c);
    const size_t eq = c.find('=');
    if (eq == absl::string_view::npos) break;
    const std::string key = absl::AsciiStrToLower(absl::StripAsciiWhitespace(c.substr(0, eq)));
    c.remove_prefix(eq + 1);
    std::string value;
    if (absl::ConsumePrefix(&c, "\"")) {
      const size_t end = c.find('"');
      value = std::string(c.substr(0, end));
      c.remove_prefix(end == absl::string_view::npos ? c.size() : end + 1);
    } else {
      const size_t end = c.find(',');
      value = std::string(absl::StripAsciiWhitespace(c.substr(0, end)));
      c.remove_prefix(end == absl::string_view::npos ? c.size() : end);
    }
    absl::ConsumePrefix(&c, ",");
    out[key] = value;
  }
  return out;
}

// The Authorization header answering a registry's 401 `challenge` ("" when none can).
absl::StatusOr<std::string> Answer(const std::string& challenge, const std::string& credentials,
                                   const std::string& repo, const std::string& name) {
  const auto p = ChallengeParams(challenge);
  const std::string basic =
      credentials.empty() ? "" : absl::StrCat("Basic ", absl::Base64Escape(credentials));
  if (p.at("scheme") == "basic") return basic.empty() ? "" : absl::StrCat("Authorization: ", basic);
  if (p.at("scheme") != "bearer" || !p.contains("realm")) {
    return absl::PermissionDeniedError(
        absl::StrCat(name, ": the registry asks for an authentication shardserve does not speak (",
                     challenge.substr(0, 80), ")"));
  }
  const std::string realm = p.at("realm");
  if (!absl::StartsWith(realm, "https://") && !absl::StartsWith(realm, "http://")) {
    return absl::PermissionDeniedError(
        absl::StrCat(name, ": the registry's token realm '", realm, "' is not an HTTP URL"));
  }
  HttpRequest token;
  token.url = absl::StrCat(realm, realm.find('?') == std::string::npos ? "?" : "&",
                           "scope=", UriEscape(absl::StrCat("repository:", repo, ":pull"), false));
  if (p.contains("service"))
    absl::StrAppend(&token.url, "&service=", UriEscape(p.at("service"), false));
  if (!basic.empty()) token.headers.push_back(absl::StrCat("Authorization: ", basic));
  token.max_body = 64 << 10;
  absl::StatusOr<HttpResponse> r = Fetch(token);
  if (!r.ok()) {
    return absl::Status(
        r.status().code(),
        absl::StrCat(name, ": asking the registry for a token: ", r.status().message()));
  }
  if (r->status == 401 || r->status == 403) {
    return absl::PermissionDeniedError(absl::StrCat(
        name, ": the registry's token service refuses (HTTP ", r->status, ")",
        credentials.empty() ? ": a private repository needs credentials (an image pull Secret)"
                            : ": the credentials are wrong or lack pull access"));
  }
  RETURN_IF_ERROR(HttpError(*r, absl::StrCat(name, ": asking the registry for a token")));
  const json j = json::parse(r->body, nullptr, false);
  for (const char* field : {"token", "access_token"}) {
    if (j.is_object() && j.contains(field) && j[field].is_string()) {
      const std::string t = j[field].get<std::string>();
      for (unsigned char ch : t) {
        if (ch <= 0x20 || ch >= 0x7f) {
          return absl::DataLossError(absl::StrCat(name, ": the registry's token is not a token"));
        }
      }
      return absl::StrCat("Authorization: Bearer ", t);
    }
  }
  return absl::DataLossError(
      absl::StrCat(name, ": the registry's token service answered no token"));
}

}  // namespace

absl::StatusOr<OciOptions> OciOptions::FromEnv(const std::function<const char*(const char*)>& env) {
  OciOptions o;
  std::string path;
  if (const char* d = env("DOCKER_CONFIG"); d != nullptr && *d) {
    path = absl::StrCat(d, "/config.json");
  } else if (const char* f = env("REGISTRY_AUTH_FILE"); f != nullptr && *f) {
    path = f;
  } else if (const char* h = env("HOME"); h != nullptr && *h) {
    path = absl::StrCat(h, "/.docker/config.json");
  }
  if (!path.empty()) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      std::ostringstream s;
      s << in.rdbuf();
      if (s.str().size() > (size_t{1} << 20)) {
        return absl::InvalidArgumentError(absl::StrCat(path, " is larger than 1 MiB"));
      }
      o.docker_config = s.str();
    }
  }
  if (const char* p = env("SHARDSERVE_OCI_PLAIN_HTTP"); p != nullptr && *p) {
    for (absl::string_view r : absl::StrSplit(p, ',', absl::SkipWhitespace())) {
      o.plain_http.emplace_back(absl::StripAsciiWhitespace(r));
    }
  }
  return o;
}

absl::StatusOr<std::vector<RemoteFile>> ParseOciManifest(const std::string& body,
                                                         const std::string& blob_url,
                                                         const std::string& auth,
                                                         const std::string& name) {
  const json j = json::parse(body, nullptr, false);
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat(name, ": the registry's manifest ", why));
  };
  if (j.is_discarded() || !j.is_object()) return bad("is not a JSON object");
  // A hostile registry's JSON may put anything anywhere: strings read only where they are ones.
  const auto text = [](const json& o, const char* key) {
    const auto it = o.find(key);
    return it != o.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  const std::string media = text(j, "mediaType");
  if (absl::StrContains(media, "index") || absl::StrContains(media, "manifest.list") ||
      j.contains("manifests")) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": the reference is an index of images (", media,
                     "), not a model artifact; push the model with one layer a file (oras push)"));
  }
  if (!j.contains("layers") || !j["layers"].is_array()) return bad("lists no layers");
  if (j["layers"].size() > kMaxLayers) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": the artifact has more than ", kMaxLayers, " layers"));
  }
  std::vector<RemoteFile> files;
  for (const json& l : j["layers"]) {
    if (!l.is_object()) return bad("lists a layer that is not an object");
    const std::string digest = text(l, "digest");
    if (!absl::StartsWith(digest, "sha256:") || !IsHex(digest.substr(7), 64)) {
      return bad(absl::StrCat("gives a layer the digest '", digest.substr(0, 80),
                              "' (shardserve checks sha256 digests)"));
    }
    if (!l.contains("size") || !l["size"].is_number_unsigned()) return bad("gives a layer no size");
    const json annotations = l.value("annotations", json::object());
    if (!annotations.is_object() || !annotations.contains(kTitle) ||
        !annotations[kTitle].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": layer ", digest.substr(0, 19),
          " has no org.opencontainers.image.title: it is an image layer, not a file of a model "
          "artifact (push the model with one layer a file, as oras push does)"));
    }
    RemoteFile f;
    f.path = annotations[kTitle].get<std::string>();
    f.size = l["size"].get<int64_t>();
    f.sha256 = absl::AsciiStrToLower(digest.substr(7));
    f.get.url = absl::StrCat(blob_url, "sha256:", f.sha256);
    if (!auth.empty()) f.get.headers.push_back(auth);
    files.push_back(std::move(f));
  }
  if (files.empty()) return absl::NotFoundError(absl::StrCat(name, ": the artifact has no layers"));
  return files;
}

absl::StatusOr<OciListing> ListOci(const OciOptions& o, const std::string& registry,
                                   const std::string& repo, const std::string& reference,
                                   const std::string& name) {
  const std::string host = registry.substr(
      0, registry.rfind(':') == std::string::npos || registry.back() == ']' ? registry.size()
                                                                            : registry.rfind(':'));
  const bool plain =
      host == "localhost" || host == "127.0.0.1" || host == "[::1]" ||
      std::find(o.plain_http.begin(), o.plain_http.end(), registry) != o.plain_http.end();
  const std::string base = absl::StrCat(plain ? "http://" : "https://", registry, "/v2/", repo);
  ASSIGN_OR_RETURN(const std::string credentials, CredentialsFor(o.docker_config, registry));
  HttpRequest get;
  get.url = absl::StrCat(base, "/manifests/", reference);
  get.headers = {kAccept};
  get.max_body = kMaxManifest;
  std::string auth;
  absl::StatusOr<HttpResponse> r = Fetch(get);
  if (r.ok() && r->status == 401) {
    auto challenge = r->headers.find("www-authenticate");
    if (challenge == r->headers.end()) {
      return absl::PermissionDeniedError(
          absl::StrCat(name, ": the registry refuses (HTTP 401) and says no way to authenticate"));
    }
    ASSIGN_OR_RETURN(auth, Answer(challenge->second, credentials, repo, name));
    if (!auth.empty()) {
      get.headers.push_back(auth);
      r = Fetch(get);
    }
  }
  if (!r.ok()) {
    return absl::Status(r.status().code(),
                        absl::StrCat(name, ": asking the registry: ", r.status().message()));
  }
  if (r->status == 401 || r->status == 403) {
    return absl::PermissionDeniedError(absl::StrCat(
        name, ": the registry refuses (HTTP ", r->status, ")",
        credentials.empty() ? ": a private repository needs credentials (an image pull Secret)"
                            : ": the credentials lack pull access to it"));
  }
  if (r->status == 404) {
    return absl::NotFoundError(
        absl::StrCat(name, ": the registry has no ", repo, " at '", reference, "' (HTTP 404)"));
  }
  RETURN_IF_ERROR(HttpError(*r, absl::StrCat(name, ": asking the registry")));
  OciListing out;
  out.digest = BytesSha256(r->body);
  if (absl::StartsWith(reference, "sha256:") &&
      absl::AsciiStrToLower(reference.substr(7)) != out.digest) {
    return absl::DataLossError(
        absl::StrCat(name, ": the registry's manifest has the digest sha256:", out.digest,
                     ", not the one asked for"));
  }
  ASSIGN_OR_RETURN(out.files, ParseOciManifest(r->body, absl::StrCat(base, "/blobs/"), auth, name));
  return out;
}

}  // namespace shardserve::source
