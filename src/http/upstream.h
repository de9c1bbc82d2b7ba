#pragma once
// A streaming HTTP/1.1 client call, for a proxy (the router, router/router.h) and for long-lived
// streams (a leader's KV events): connect and send the request within one deadline, read the
// answer's head within another, then its body piece by piece as it arrives (each piece within a
// read deadline; chunked answers de-chunked), so an answer is passed on as it comes. Bounded: a
// head of at most 16 KiB; no exception escapes. One thread uses a call at a time.
#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "http/server.h"

namespace shardserve::http {

class UpstreamCall {
 public:
  struct Head {
    int status = 0;
    Headers headers;  // names in lower case
    std::string content_type;
  };

  // Unavailable (naming host:port and what failed) when the connection or the request fails or
  // does not complete within `connect_timeout` (nothing reached the server, or not all of it);
  // DeadlineExceeded when the answer's head does not come within `head_timeout` after that, and
  // Aborted when the connection breaks while waiting for it (the server may have acted).
  static absl::StatusOr<std::unique_ptr<UpstreamCall>> Start(
      const std::string& host, int port, const std::string& method, const std::string& target,
      const Headers& headers, const std::string& body, std::chrono::milliseconds connect_timeout,
      std::chrono::milliseconds head_timeout);
  ~UpstreamCall();

  const Head& head() const { return head_; }
  // The next piece of the body, waiting up to `timeout`; "" with *done set at its end.
  // DeadlineExceeded when nothing came in time (the call stays usable); Unavailable when the
  // connection failed.
  absl::StatusOr<std::string> Read(std::chrono::milliseconds timeout, bool* done);
  // Closes the connection (the upstream sees the client gone).
  void Close();

  struct Impl;

 private:
  explicit UpstreamCall(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  Head head_;
};

}  // namespace shardserve::http
