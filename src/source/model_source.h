#pragma once
// A model from where it lives (spec.model.uri): a local uri is its directory; a remote one
// (s3://, hf://) is listed, the files spec.model.files chooses are fetched into the model cache
// (source/model_cache.h), and the cache's directory is the model's. Credentials and endpoints
// come from the environment every user of the source already sets (source/s3.h, source/hf.h).
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "api/sharded_model.h"
#include "source/model_cache.h"

namespace shardserve::source {

struct ResolveOptions {
  std::string cache_root;          // the model cache (DefaultCacheRoot())
  std::vector<std::string> files;  // spec.model.files; empty: all
  FetchOptions fetch;
  FetchProgress progress;                       // bytes fetched so far, of the total
  std::function<const char*(const char*)> env;  // the environment (std::getenv)
};

// The directory of the model `uri` names, fetched first where it is remote. `uri_text` names it
// in errors.
absl::StatusOr<FetchReport> ResolveModel(const ModelUri& uri, const std::string& uri_text,
                                         const ResolveOptions& options);

// $SHARDSERVE_MODEL_CACHE, else $XDG_CACHE_HOME/shardserve/models, else
// ~/.cache/shardserve/models.
std::string DefaultCacheRoot(const std::function<const char*(const char*)>& env);

}  // namespace shardserve::source
