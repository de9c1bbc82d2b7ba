#include "source/model_source.h"

#include <filesystem>
#include <map>
#include <memory>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/status.h"
#include "common/text.h"
#include "source/hf.h"
#include "source/oci.h"
#include "source/s3.h"

namespace shardserve::source {
namespace {

namespace fs = std::filesystem;

constexpr size_t kMaxCredential = 1 << 20;

// The key of a revision, narrowed to the files chosen from it when not all are.
std::string KeyOf(const std::string& revision, bool chosen, const std::vector<RemoteFile>& files) {
  return chosen ? absl::StrCat(revision, "-", ListingKey(files).substr(0, 12)) : revision;
}

}  // namespace

Env SecretEnv(const std::string& dir, Env base) {
  auto values = std::make_shared<std::map<std::string, std::string>>();
  std::error_code ec;
  if (!dir.empty()) {
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const std::string name = e.path().filename().string();
      // A Secret's volume also holds ..data and the links' targets: names of variables are
      // letters, digits and '_'.
      if (name.empty() || name[0] == '.' || !e.is_regular_file(ec) ||
          e.file_size(ec) > kMaxCredential) {
        continue;
      }
      absl::StatusOr<std::string> v = ReadFileToString(e.path().string());
      if (!v.ok()) continue;
      while (!v->empty() && (v->back() == '\n' || v->back() == '\r')) v->pop_back();
      (*values)[name] = *std::move(v);
    }
    if (fs::exists(dir + "/.dockerconfigjson", ec)) {
      (*values)["REGISTRY_AUTH_FILE"] = dir + "/.dockerconfigjson";
      (*values)["DOCKER_CONFIG"] = "";  // the Secret's, not a config of the image
    }
  }
  return [values, base = std::move(base)](const char* name) -> const char* {
    if (auto it = values->find(name); it != values->end()) return it->second.c_str();
    return base(name);
  };
}

std::string DefaultCacheRoot(const Env& env) {
  if (const char* v = env("SHARDSERVE_MODEL_CACHE"); v != nullptr && *v) return v;
  if (const char* v = env("XDG_CACHE_HOME"); v != nullptr && *v) {
    return absl::StrCat(v, "/shardserve/models");
  }
  const char* home = env("HOME");
  return absl::StrCat(home != nullptr && *home ? home : "/tmp", "/.cache/shardserve/models");
}

absl::StatusOr<ModelListing> ListModel(const ModelUri& uri, const std::string& uri_text,
                                       const std::vector<std::string>& patterns, const Env& env,
                                       const std::string& revision) {
  ModelListing out;
  switch (uri.scheme) {
    case ModelUri::Scheme::kHf: {
      ASSIGN_OR_RETURN(const HfOptions hf, HfOptions::FromEnv(env));
      ASSIGN_OR_RETURN(HfListing listing,
                       ListHf(hf, uri.repo, revision.empty() ? uri.revision : revision, uri_text));
      ASSIGN_OR_RETURN(out.files, Choose(listing.files, patterns));
      out.root = absl::StrCat("hf/", absl::StrReplaceAll(uri.repo, {{"/", "--"}}));
      out.revision = listing.commit;
      // The commit addresses the revision; the files chosen from it, their own directory.
      out.key = KeyOf(listing.commit, !patterns.empty(), out.files);
      return out;
    }
    case ModelUri::Scheme::kOci: {
      ASSIGN_OR_RETURN(const OciOptions oci, OciOptions::FromEnv(env));
      ASSIGN_OR_RETURN(OciListing listing,
                       ListOci(oci, uri.registry, uri.repo,
                               revision.empty() ? uri.revision : revision, uri_text));
      ASSIGN_OR_RETURN(out.files, Choose(listing.files, patterns));
      out.root =
          absl::StrCat("oci/", absl::StrReplaceAll(uri.registry, {{":", "_"}}), "/", uri.repo);
      out.revision = absl::StrCat("sha256:", listing.digest);
      out.key = KeyOf(listing.digest, !patterns.empty(), out.files);
      return out;
    }
    case ModelUri::Scheme::kS3: {
      ASSIGN_OR_RETURN(const S3Options s3, S3Options::FromEnv(env));
      ASSIGN_OR_RETURN(std::vector<RemoteFile> all, ListS3(s3, uri.bucket, uri.path, uri_text));
      ASSIGN_OR_RETURN(out.files, Choose(all, patterns));
      out.root = absl::StrCat("s3/", uri.bucket);
      // S3 has no revision: the listing's digest (every file's path, size and checks) addresses it.
      out.key = out.revision = ListingKey(out.files);
      if (!revision.empty() && revision != out.revision) {
        return absl::FailedPreconditionError(
            absl::StrCat(uri_text, ": the objects changed since the model was resolved (listing ",
                         out.revision.substr(0, 12), ", not ", revision.substr(0, 12),
                         "); the operator resolves it again"));
      }
      return out;
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat(uri_text, " is not a remote model"));
  }
}

std::vector<RemoteFile> SmallFiles(const std::vector<RemoteFile>& files) {
  std::vector<RemoteFile> out;
  for (const RemoteFile& f : files) {
    bool weights = false;
    for (const char* ext : {".safetensors", ".gguf", ".bin", ".pt", ".pth", ".onnx", ".h5"}) {
      weights |= absl::EndsWith(f.path, ext);
    }
    if (!weights && f.size <= (int64_t{64} << 20)) out.push_back(f);
  }
  return out;
}

absl::StatusOr<FetchReport> ResolveModel(const ModelUri& uri, const std::string& uri_text,
                                         const ResolveOptions& options) {
  if (!uri.remote()) {
    FetchReport local;
    local.dir = uri.path;
    local.cache_hit = true;
    return local;
  }
  ASSIGN_OR_RETURN(const ModelListing listing,
                   ListModel(uri, uri_text, options.files, options.env, options.revision));
  return Materialize(absl::StrCat(options.cache_root, "/", listing.root), uri_text, listing.key,
                     listing.files, options.fetch, options.progress);
}

}  // namespace shardserve::source
