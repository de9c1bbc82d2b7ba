#pragma once
// One plain HTTP/1.1 GET, bounded: connect, request and answer all within `timeout`, a head of at
// most 8 KiB and a body of at most `max_body_bytes`; no exception escapes. Used where the
// operator asks a rank what it is doing while it starts (its metrics port's /startupz).
#include <chrono>
#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace shardserve::http {

// The body of a 200 answer; any other status, an address that does not answer in time, or an
// answer over the bounds is an error naming host:port and path.
absl::StatusOr<std::string> Get(const std::string& host, int port, const std::string& path,
                                std::chrono::milliseconds timeout, size_t max_body_bytes);

}  // namespace shardserve::http
