#include "source/model_source.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/status.h"
#include "source/hf.h"
#include "source/s3.h"

namespace shardserve::source {

std::string DefaultCacheRoot(const std::function<const char*(const char*)>& env) {
  if (const char* v = env("SHARDSERVE_MODEL_CACHE"); v != nullptr && *v) return v;
  if (const char* v = env("XDG_CACHE_HOME"); v != nullptr && *v) {
    return absl::StrCat(v, "/shardserve/models");
  }
  const char* home = env("HOME");
  return absl::StrCat(home != nullptr && *home ? home : "/tmp", "/.cache/shardserve/models");
}

absl::StatusOr<FetchReport> ResolveModel(const ModelUri& uri, const std::string& uri_text,
                                         const ResolveOptions& options) {
  if (!uri.remote()) {
    FetchReport local;
    local.dir = uri.path;
    local.cache_hit = true;
    return local;
  }
  if (uri.scheme == ModelUri::Scheme::kHf) {
    ASSIGN_OR_RETURN(const HfOptions hf, HfOptions::FromEnv(options.env));
    ASSIGN_OR_RETURN(HfListing listing, ListHf(hf, uri.repo, uri.revision, uri_text));
    ASSIGN_OR_RETURN(std::vector<RemoteFile> chosen, Choose(listing.files, options.files));
    // The commit addresses the revision; the files chosen from it, their own directory.
    const std::string key =
        options.files.empty() ? listing.commit
                              : absl::StrCat(listing.commit, "-", ListingKey(chosen).substr(0, 12));
    const std::string root =
        absl::StrCat(options.cache_root, "/hf/", absl::StrReplaceAll(uri.repo, {{"/", "--"}}));
    return Materialize(root, uri_text, key, chosen, options.fetch, options.progress);
  }
  ASSIGN_OR_RETURN(const S3Options s3, S3Options::FromEnv(options.env));
  ASSIGN_OR_RETURN(std::vector<RemoteFile> all, ListS3(s3, uri.bucket, uri.path, uri_text));
  ASSIGN_OR_RETURN(std::vector<RemoteFile> chosen, Choose(all, options.files));
  // S3 has no revision: the listing's digest (every file's path, size and checks) addresses it.
  const std::string root = absl::StrCat(options.cache_root, "/s3/", uri.bucket);
  return Materialize(root, uri_text, ListingKey(chosen), chosen, options.fetch, options.progress);
}

}  // namespace shardserve::source
