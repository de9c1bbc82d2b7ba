#pragma once
// A model from where it lives (spec.model.uri): a local uri is its directory; a remote one
// (s3://, hf://, oci://) is listed, the files spec.model.files chooses are fetched into the model
// cache (source/model_cache.h), and the cache's directory is the model's. Credentials and
// endpoints come from the environment every user of the source already sets (source/s3.h,
// source/hf.h, source/oci.h); on a cluster, from the ShardedModel's Secret (the operator and the
// fetch step read it as the same names).
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "api/sharded_model.h"
#include "source/model_cache.h"

namespace shardserve::source {

using Env = std::function<const char*(const char*)>;

// What a remote model is at one moment: where in a cache it lives, what pins it, its files.
struct ModelListing {
  std::string root;  // under the cache root: "hf/ORG--NAME", "s3/BUCKET", "oci/REGISTRY/REPO"
  std::string key;   // the revision's directory under `root`
  // What the uri resolved to: the commit (hf), the manifest's digest "sha256:HEX" (oci), the
  // listing's digest (s3, which has no revision of its own).
  std::string revision;
  std::vector<RemoteFile> files;  // the ones spec.model.files chose
  std::string dir() const { return root + "/" + key; }
};

// The listing of remote `uri` (`uri_text` names it in errors), of the files `patterns` choose
// (all when empty). A `revision` pins it to what an earlier listing resolved (ModelListing::
// revision): the same commit or digest is listed, and an S3 prefix whose objects changed since
// is an error saying so.
absl::StatusOr<ModelListing> ListModel(const ModelUri& uri, const std::string& uri_text,
                                       const std::vector<std::string>& patterns, const Env& env,
                                       const std::string& revision = "");

// The files of a model that are not its weights (config, tokenizer, chat template: what the
// inspect step and a router read), at most 64 MiB each.
std::vector<RemoteFile> SmallFiles(const std::vector<RemoteFile>& files);

struct ResolveOptions {
  std::string cache_root;          // the model cache (DefaultCacheRoot())
  std::vector<std::string> files;  // spec.model.files; empty: all
  std::string revision;            // pins the listing (ListModel)
  FetchOptions fetch;
  FetchProgress progress;  // bytes fetched so far, of the total
  Env env;                 // the environment (std::getenv)
};

// The directory of the model `uri` names, fetched first where it is remote. `uri_text` names it
// in errors.
absl::StatusOr<FetchReport> ResolveModel(const ModelUri& uri, const std::string& uri_text,
                                         const ResolveOptions& options);

// The environment `base`, with the files of a mounted Secret in `dir` first ("" : none): a file
// named as a variable (HF_TOKEN, AWS_ACCESS_KEY_ID, ...) stands for it; a registry's
// .dockerconfigjson (an image pull Secret's key) becomes REGISTRY_AUTH_FILE.
Env SecretEnv(const std::string& dir, Env base);

// $SHARDSERVE_MODEL_CACHE, else $XDG_CACHE_HOME/shardserve/models, else
// ~/.cache/shardserve/models.
std::string DefaultCacheRoot(const Env& env);

}  // namespace shardserve::source
