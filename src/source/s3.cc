#include "source/s3.h"

#include <pugixml.hpp>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardserve::source {
namespace {

constexpr size_t kMaxObjects = 10000;

// The bucket's URL: path-style on a given endpoint (what S3-compatible stores serve), virtual-host
// style on AWS.
std::string BucketUrl(const S3Options& o, const std::string& bucket) {
  if (!o.endpoint.empty()) {
    std::string e = o.endpoint;
    while (!e.empty() && e.back() == '/') e.pop_back();
    return absl::StrCat(e, "/", bucket);
  }
  return absl::StrCat("https://", bucket, ".s3.", o.region, ".amazonaws.com");
}

HttpRequest Signed(const S3Options& o, const std::string& url) {
  HttpRequest r;
  r.url = url;
  if (!o.access_key.empty()) {
    r.aws_sigv4 = absl::StrCat("aws:amz:", o.region, ":s3");
    r.user = absl::StrCat(o.access_key, ":", o.secret_key);
    r.headers.push_back("x-amz-content-sha256: UNSIGNED-PAYLOAD");
    if (!o.session_token.empty()) {
      r.headers.push_back(absl::StrCat("x-amz-security-token: ", o.session_token));
    }
  }
  return r;
}

}  // namespace

absl::StatusOr<S3Options> S3Options::FromEnv(const std::function<const char*(const char*)>& env) {
  S3Options o;
  auto get = [&](const char* name) -> std::string {
    const char* v = env(name);
    return v == nullptr ? "" : v;
  };
  o.access_key = get("AWS_ACCESS_KEY_ID");
  o.secret_key = get("AWS_SECRET_ACCESS_KEY");
  o.session_token = get("AWS_SESSION_TOKEN");
  if (o.access_key.empty() != o.secret_key.empty()) {
    return absl::InvalidArgumentError(
        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY go together: one is set, the other is not");
  }
  for (const char* name : {"AWS_REGION", "AWS_DEFAULT_REGION"}) {
    if (!get(name).empty()) {
      o.region = get(name);
      break;
    }
  }
  for (const char* name : {"AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"}) {
    const std::string e = get(name);
    if (e.empty()) continue;
    if (!absl::StartsWith(e, "http://") && !absl::StartsWith(e, "https://")) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " '", e, "' must be an http:// or https:// URL"));
    }
    o.endpoint = e;
    break;
  }
  for (char ch : o.region) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(ch)) && ch != '-') {
      return absl::InvalidArgumentError(absl::StrCat("AWS_REGION '", o.region, "' is no region"));
    }
  }
  return o;
}

absl::StatusOr<S3Listing> ParseS3Listing(const std::string& xml, const std::string& name) {
  // pugixml: no DTD, no external entities, nothing fetched; the body is bounded by its fetch.
  pugi::xml_document doc;
  const pugi::xml_parse_result parsed =
      doc.load_buffer(xml.data(), xml.size(), pugi::parse_default & ~pugi::parse_doctype);
  const pugi::xml_node root = doc.child("ListBucketResult");
  if (!parsed || !root) {
    return absl::DataLossError(
        absl::StrCat(name, ": the bucket's listing is not ListObjectsV2's XML"));
  }
  S3Listing out;
  const bool truncated = std::string(root.child_value("IsTruncated")) == "true";
  out.next_token = root.child_value("NextContinuationToken");
  for (const pugi::xml_node c : root.children("Contents")) {
    S3Listing::Object o;
    o.key = c.child_value("Key");
    const bool sized = absl::SimpleAtoi(c.child_value("Size"), &o.size) && o.size >= 0;
    o.etag = c.child_value("ETag");
    if (o.etag.size() >= 2 && o.etag.front() == '"' && o.etag.back() == '"') {
      o.etag = o.etag.substr(1, o.etag.size() - 2);
    }
    if (o.key.empty() || !sized) {
      return absl::DataLossError(
          absl::StrCat(name, ": the listing has an object without a key or a size"));
    }
    out.objects.push_back(std::move(o));
  }
  if (!truncated) out.next_token.clear();
  if (truncated && out.next_token.empty()) {
    return absl::DataLossError(
        absl::StrCat(name, ": the listing is truncated without a continuation token"));
  }
  return out;
}

absl::StatusOr<std::vector<RemoteFile>> ListS3(const S3Options& o, const std::string& bucket,
                                               const std::string& prefix, const std::string& name) {
  const std::string base = BucketUrl(o, bucket);
  const std::string dir = prefix.empty() ? "" : prefix + "/";
  std::vector<RemoteFile> files;
  std::string token;
  do {
    std::string url = absl::StrCat(base, "/?list-type=2&prefix=", UriEscape(dir, false));
    if (!token.empty()) absl::StrAppend(&url, "&continuation-token=", UriEscape(token, false));
    absl::StatusOr<HttpResponse> r = Fetch(Signed(o, url));
    if (!r.ok()) {
      return absl::Status(r.status().code(),
                          absl::StrCat(name, ": listing the bucket: ", r.status().message()));
    }
    RETURN_IF_ERROR(HttpError(*r, absl::StrCat(name, ": listing the bucket")));
    ASSIGN_OR_RETURN(S3Listing page, ParseS3Listing(r->body, name));
    for (const S3Listing::Object& obj : page.objects) {
      if (!absl::StartsWith(obj.key, dir) || obj.key.back() == '/') continue;
      RemoteFile f;
      f.path = obj.key.substr(dir.size());
      f.size = obj.size;
      // A single-part upload's ETag is its MD5; a multipart one's ("...-N") is not.
      if (IsHex(obj.etag, 32)) f.md5 = absl::AsciiStrToLower(obj.etag);
      f.get = Signed(o, absl::StrCat(base, "/", UriEscape(obj.key, true)));
      files.push_back(std::move(f));
      if (files.size() > kMaxObjects) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": more than ", kMaxObjects, " objects under the prefix"));
      }
    }
    token = page.next_token;
  } while (!token.empty());
  if (files.empty()) {
    return absl::NotFoundError(absl::StrCat(name, ": no objects under the prefix"));
  }
  // The SHA-256 each object was stored with, where it was (HeadObject in checksum mode).
  for (RemoteFile& f : files) {
    HttpRequest head = f.get;
    head.head = true;
    head.headers.push_back("x-amz-checksum-mode: ENABLED");
    ASSIGN_OR_RETURN(HttpResponse r, Fetch(head));
    RETURN_IF_ERROR(HttpError(r, absl::StrCat(name, ": ", f.path)));
    // A multipart object's composite checksum ("...-N") is of its parts, not of the file.
    if (auto it = r.headers.find("x-amz-checksum-sha256");
        it != r.headers.end() && it->second.find('-') == std::string::npos) {
      std::string raw;
      if (!absl::Base64Unescape(it->second, &raw) || raw.size() != 32) {
        return absl::DataLossError(
            absl::StrCat(name, ": ", f.path, ": x-amz-checksum-sha256 is not a SHA-256"));
      }
      f.sha256 = absl::BytesToHexString(raw);
    }
  }
  return files;
}

}  // namespace shardserve::source
