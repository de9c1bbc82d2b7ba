#include "source/hf.h"

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardserve::source {
namespace {

using json = nlohmann::json;

constexpr size_t kMaxFiles = 10000;

HttpRequest WithToken(const HfOptions& o, const std::string& url) {
  HttpRequest r;
  r.url = url;
  if (!o.token.empty()) r.headers.push_back(absl::StrCat("Authorization: Bearer ", o.token));
  return r;
}

}  // namespace

absl::StatusOr<HfOptions> HfOptions::FromEnv(const std::function<const char*(const char*)>& env) {
  HfOptions o;
  if (const char* e = env("HF_ENDPOINT"); e != nullptr && *e) {
    o.endpoint = e;
    if (!absl::StartsWith(o.endpoint, "http://") && !absl::StartsWith(o.endpoint, "https://")) {
      return absl::InvalidArgumentError(
          absl::StrCat("HF_ENDPOINT '", o.endpoint, "' must be an http:// or https:// URL"));
    }
    while (!o.endpoint.empty() && o.endpoint.back() == '/') o.endpoint.pop_back();
  }
  if (const char* t = env("HF_TOKEN"); t != nullptr && *t) {
    o.token = t;
    for (unsigned char ch : o.token) {
      if (ch <= 0x20 || ch >= 0x7f) {
        return absl::InvalidArgumentError("HF_TOKEN holds a character a token cannot");
      }
    }
  }
  return o;
}

absl::StatusOr<HfListing> ParseHfListing(const std::string& body, const HfOptions& o,
                                         const std::string& repo, const std::string& name) {
  const json j = json::parse(body, nullptr, false);
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat(name, ": the Hub's answer ", why));
  };
  if (j.is_discarded() || !j.is_object()) return bad("is not a JSON object");
  HfListing out;
  if (!j.contains("sha") || !j["sha"].is_string() || !IsHex(j["sha"].get<std::string>(), 40)) {
    return bad("names no commit ('sha')");
  }
  out.commit = absl::AsciiStrToLower(j["sha"].get<std::string>());
  if (!j.contains("siblings") || !j["siblings"].is_array()) return bad("lists no files");
  if (j["siblings"].size() > kMaxFiles) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": the repository holds more than ", kMaxFiles, " files"));
  }
  for (const json& s : j["siblings"]) {
    if (!s.is_object() || !s.contains("rfilename") || !s["rfilename"].is_string()) {
      return bad("lists a file without a name");
    }
    RemoteFile f;
    f.path = s["rfilename"].get<std::string>();
    const json* lfs = s.contains("lfs") && s["lfs"].is_object() ? &s["lfs"] : nullptr;
    if (lfs != nullptr) {
      const json& l = *lfs;
      if (!l.contains("sha256") || !l["sha256"].is_string() ||
          !IsHex(l["sha256"].get<std::string>(), 64) || !l.contains("size") ||
          !l["size"].is_number_unsigned()) {
        return bad(absl::StrCat("gives ", f.path, " an LFS entry without a SHA-256 and a size"));
      }
      f.sha256 = absl::AsciiStrToLower(l["sha256"].get<std::string>());
      f.size = l["size"].get<int64_t>();
    } else {
      if (!s.contains("size") || !s["size"].is_number_unsigned() || !s.contains("blobId") ||
          !s["blobId"].is_string() || !IsHex(s["blobId"].get<std::string>(), 40)) {
        return bad(absl::StrCat("gives ", f.path,
                                " no size and blob id (the Hub answers ?blobs=true with them)"));
      }
      f.size = s["size"].get<int64_t>();
      f.git_sha1 = absl::AsciiStrToLower(s["blobId"].get<std::string>());
    }
    f.get = WithToken(o, absl::StrCat(o.endpoint, "/", repo, "/resolve/", out.commit, "/",
                                      UriEscape(f.path, true)));
    out.files.push_back(std::move(f));
  }
  if (out.files.empty())
    return absl::NotFoundError(absl::StrCat(name, ": the repository is empty"));
  return out;
}

absl::StatusOr<HfListing> ListHf(const HfOptions& o, const std::string& repo,
                                 const std::string& revision, const std::string& name) {
  const std::string url = absl::StrCat(o.endpoint, "/api/models/", repo, "/revision/",
                                       UriEscape(revision, false), "?blobs=true");
  absl::StatusOr<HttpResponse> r = Fetch(WithToken(o, url));
  if (!r.ok()) {
    return absl::Status(r.status().code(),
                        absl::StrCat(name, ": asking the Hub: ", r.status().message()));
  }
  if (r->status == 401 || r->status == 403) {
    return absl::PermissionDeniedError(absl::StrCat(name, ": the Hub refuses (HTTP ", r->status,
                                                    "): a gated or private model needs HF_TOKEN",
                                                    o.token.empty() ? "" : " with access to it"));
  }
  if (r->status == 404) {
    return absl::NotFoundError(
        absl::StrCat(name, ": the Hub has no revision '", revision, "' of ", repo, " (HTTP 404)"));
  }
  RETURN_IF_ERROR(HttpError(*r, absl::StrCat(name, ": asking the Hub")));
  return ParseHfListing(r->body, o, repo, name);
}

}  // namespace shardserve::source
