#pragma once
// HTTP(S) for the model sources (source/model_source.h) on libcurl: TLS verified with the system's
// CAs (OpenSSL), AWS Signature Version 4 (libcurl's own signer), byte ranges, bounded bodies, and a
// transfer that stalls (below 1 KiB/s for a minute) or never connects given up on.
#include <atomic>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve::source {

struct HttpRequest {
  std::string url;
  std::vector<std::string> headers;  // "Name: value"
  // AWS Signature Version 4: "aws:amz:REGION:SERVICE" (CURLOPT_AWS_SIGV4) with `user`
  // "ACCESS_KEY:SECRET_KEY"; empty: unsigned.
  std::string aws_sigv4;
  std::string user;
  bool head = false;
  // Bytes [range_begin, range_end] (inclusive) of the resource; -1: all of it.
  int64_t range_begin = -1, range_end = -1;
  size_t max_body = size_t{16} << 20;  // an in-memory body past this is an error
  int connect_timeout_s = 15;
  int stall_timeout_s = 60;  // below 1 KiB/s for this long: given up
};

struct HttpResponse {
  long status = 0;
  std::map<std::string, std::string> headers;  // names lower-cased; the last of each kept
  std::string body;                            // in memory (Fetch), empty for FetchToFile
  int64_t written = 0;                         // the body's bytes written to the file (FetchToFile)
};

// The response in memory; a transport failure (no connection, TLS, a stall, a body past
// max_body) is an error naming the URL. An HTTP error status is a response, for the caller to
// name.
absl::StatusOr<HttpResponse> Fetch(const HttpRequest& req);

// The body written into `fd` from `offset` on (pwrite), at most `max_bytes` of it (a longer body
// is an error, nothing past the limit written), `received` adding its bytes as they come (a
// counter other transfers may share); only a 200 or 206 body is written (another status's body is
// kept in memory, bounded).
absl::StatusOr<HttpResponse> FetchToFile(const HttpRequest& req, int fd, int64_t offset,
                                         int64_t max_bytes, std::atomic<int64_t>* received);

// An HTTP status as a Status naming what was asked: 401/403 PermissionDenied, 404 NotFound,
// 416 OutOfRange, 429/5xx Unavailable, others Unknown; OK for 2xx.
absl::Status HttpError(const HttpResponse& r, const std::string& what);

// "%XX"-escapes every byte outside RFC 3986's unreserved set, '/' kept where `keep_slash`.
std::string UriEscape(const std::string& s, bool keep_slash);

}  // namespace shardserve::source
