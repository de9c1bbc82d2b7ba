#pragma once
// Models pushed to an OCI registry as an artifact, one layer a file (as ORAS pushes them and
// KServe's modelcars read them): the manifest of REPO:TAG (or @sha256:DIGEST) read through the
// distribution API (GET /v2/REPO/manifests/REF), its digest (SHA-256 of the manifest's bytes)
// addressing the model in the cache; each layer a file named by its
// `org.opencontainers.image.title` annotation, checked by its digest, fetched from
// /v2/REPO/blobs/DIGEST (redirects followed; the registry's credentials never sent to another
// host). Credentials are a Docker config (an image pull Secret's .dockerconfigjson): a registry
// answering 401 is asked again with them, as its WWW-Authenticate says (a bearer token from its
// realm for `repository:REPO:pull`, or basic).
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "source/model_cache.h"

namespace shardserve::source {

struct OciOptions {
  std::string docker_config;  // the Docker config's JSON ("" : anonymous)
  // Registries spoken to over plain HTTP (host[:port]); every other one over HTTPS. Loopback
  // registries (localhost, 127.0.0.1, [::1]) are always plain, as Docker and ORAS treat them.
  std::vector<std::string> plain_http;

  // $DOCKER_CONFIG/config.json, else $REGISTRY_AUTH_FILE, else ~/.docker/config.json (when
  // present); SHARDSERVE_OCI_PLAIN_HTTP, comma-separated registries.
  static absl::StatusOr<OciOptions> FromEnv(const std::function<const char*(const char*)>& env);
};

struct OciListing {
  std::string digest;  // the manifest's, 64 hex digits
  std::vector<RemoteFile> files;
};

// The files of `registry`/`repo` at `reference` (a tag, or "sha256:HEX"). `name` names the
// model in errors.
absl::StatusOr<OciListing> ListOci(const OciOptions& o, const std::string& registry,
                                   const std::string& repo, const std::string& reference,
                                   const std::string& name);

// An image manifest's JSON read into a listing: every layer a file (a layer without a title is
// an image's, not a model artifact's, and refused by name). `blob_url` is the URL before a
// digest; `auth` the header every blob request carries ("" none).
absl::StatusOr<std::vector<RemoteFile>> ParseOciManifest(const std::string& body,
                                                         const std::string& blob_url,
                                                         const std::string& auth,
                                                         const std::string& name);

}  // namespace shardserve::source
