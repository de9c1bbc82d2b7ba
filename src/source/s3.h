#pragma once
// Models in S3 or any S3-compatible store (MinIO, Ceph, moto, ...): ListObjectsV2 under a prefix,
// each object's SHA-256 where it was stored with one (HeadObject with checksum mode), else the
// MD5 its ETag carries (a single-part upload), and requests signed with AWS Signature Version 4
// (libcurl's signer); listings read with pugixml.
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "source/model_cache.h"

namespace shardserve::source {

struct S3Options {
  std::string endpoint;  // scheme://host[:port]; empty: AWS's https://s3.REGION.amazonaws.com
  std::string region = "us-east-1";
  std::string access_key, secret_key, session_token;  // none: unsigned requests (a public bucket)

  // What every AWS tool reads: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN,
  // AWS_REGION (else AWS_DEFAULT_REGION), AWS_ENDPOINT_URL_S3 (else AWS_ENDPOINT_URL).
  static absl::StatusOr<S3Options> FromEnv(const std::function<const char*(const char*)>& env);
};

// The objects under s3://BUCKET/PREFIX, as files relative to the prefix (an object named like a
// folder, ending in '/', is none). `name` names the model in errors.
absl::StatusOr<std::vector<RemoteFile>> ListS3(const S3Options& o, const std::string& bucket,
                                               const std::string& prefix, const std::string& name);

// ListObjectsV2's XML: each object's key, size and ETag, and the token of the next page ("" at
// the last). A body that is not its XML is an error naming `name`.
struct S3Listing {
  struct Object {
    std::string key;
    int64_t size = 0;
    std::string etag;  // without its quotes
  };
  std::vector<Object> objects;
  std::string next_token;
};
absl::StatusOr<S3Listing> ParseS3Listing(const std::string& xml, const std::string& name);

}  // namespace shardserve::source
