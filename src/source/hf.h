#pragma once
// Models on the Hugging Face Hub (or a mirror that serves its API, HF_ENDPOINT): a revision (a
// branch, a tag or a commit) resolved to its commit, which addresses the model in the cache; each
// file's size and check from the Hub's listing (GET /api/models/REPO/revision/REV?blobs=true): the
// SHA-256 of an LFS file, the git blob id (SHA-1 of "blob SIZE\0" and the bytes) of the others;
// files fetched from /REPO/resolve/COMMIT/PATH. A token (HF_TOKEN) goes with every request to the
// Hub, and not to the hosts it redirects to (libcurl drops the header across hosts).
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "source/model_cache.h"

namespace shardserve::source {

struct HfOptions {
  std::string endpoint = "https://huggingface.co";
  std::string token;  // none: anonymous (public models)

  // HF_ENDPOINT and HF_TOKEN, as huggingface_hub reads them.
  static absl::StatusOr<HfOptions> FromEnv(const std::function<const char*(const char*)>& env);
};

struct HfListing {
  std::string commit;  // 40 hex digits
  std::vector<RemoteFile> files;
};

// The files of `repo` ("ORG/NAME") at `revision`. `name` names the model in errors.
absl::StatusOr<HfListing> ListHf(const HfOptions& o, const std::string& repo,
                                 const std::string& revision, const std::string& name);

// The Hub's JSON of a model at a revision, read into a listing (files fetched from `endpoint`).
absl::StatusOr<HfListing> ParseHfListing(const std::string& body, const HfOptions& o,
                                         const std::string& repo, const std::string& name);

}  // namespace shardserve::source
