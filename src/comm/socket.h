#pragma once
// Blocking TCP sockets with deadlines, RAII. Errors name the address and the system error.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve {

using Deadline = std::chrono::steady_clock::time_point;

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket();

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // The local port (for a listener bound to port 0).
  int port() const;

  // A send blocked longer than this fails (0: never).
  void SetSendTimeout(std::chrono::milliseconds timeout);
  absl::Status WriteAll(const void* data, size_t bytes);
  // Reads exactly `bytes`; fails with Unavailable on end of stream, DeadlineExceeded when no
  // byte arrives for `idle` (progress resets the clock).
  absl::Status ReadAll(void* data, size_t bytes, std::chrono::milliseconds idle);

 private:
  int fd_ = -1;
};

// A listening socket on host:port (port 0: any free port).
absl::StatusOr<Socket> Listen(const std::string& host, int port);
// A port on host that is free now, for a child process to listen on later. It is chosen below
// the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range), which the kernel never
// hands out to a bind to port 0 or to an outgoing connection: between this check and the child's
// bind, only another chooser of this kind could take it (a port from Listen(host, 0) could be
// given to any process's port-0 listener in that time). `taken`: ports the caller's own children
// will listen on later (free now, as nothing listens there yet), never chosen.
// Where the range starts within 1,000 ports of 10,000, any free port a port-0 listener gets,
// but not one of `taken`. An error names the reason when every port it could choose is taken.
absl::StatusOr<int> ChooseFreePort(const std::string& host, const std::vector<int>& taken = {});
// ChooseFreePort with the ephemeral range starting at ephemeral_low (tests).
absl::StatusOr<int> ChooseFreePortBelow(const std::string& host, int ephemeral_low,
                                        const std::vector<int>& taken);
// Accepts one connection, or DeadlineExceeded at `deadline`.
absl::StatusOr<Socket> Accept(const Socket& listener, Deadline deadline);
// Connects to host:port, retrying (the name may not resolve yet, nothing may listen yet) until
// `deadline`; then DeadlineExceeded naming the address and the last error.
absl::StatusOr<Socket> ConnectWithRetry(const std::string& host, int port, Deadline deadline);

}  // namespace shardserve
