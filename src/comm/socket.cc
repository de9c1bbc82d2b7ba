#include "comm/socket.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardserve {
namespace {

int MillisUntil(Deadline d) {
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(d - std::chrono::steady_clock::now())
          .count();
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(ms, 1 << 30)));
}

void NoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

}  // namespace

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

Socket::~Socket() {
  if (fd_ >= 0) ::close(fd_);
}

int Socket::port() const {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return -1;
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
}

void Socket::SetSendTimeout(std::chrono::milliseconds timeout) {
  timeval tv{static_cast<time_t>(timeout.count() / 1000),
             static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
  setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

absl::Status Socket::WriteAll(const void* data, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (bytes > 0) {
    const ssize_t n = ::send(fd_, p, bytes, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        return absl::DeadlineExceededError("send blocked past its timeout");
      }
      return absl::UnavailableError(absl::StrCat("send failed: ", std::strerror(errno)));
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status Socket::ReadAll(void* data, size_t bytes, std::chrono::milliseconds idle) {
  auto* p = static_cast<uint8_t*>(data);
  while (bytes > 0) {
    pollfd pfd{fd_, POLLIN, 0};
    const int r = ::poll(&pfd, 1, static_cast<int>(idle.count()));
    if (r < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat("poll failed: ", std::strerror(errno)));
    }
    if (r == 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("nothing received for ", idle.count(), " ms"));
    }
    const ssize_t n = ::recv(fd_, p, bytes, 0);
    if (n == 0) return absl::UnavailableError("connection closed");
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return absl::UnavailableError(absl::StrCat("recv failed: ", std::strerror(errno)));
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<Socket> Listen(const std::string& host, int port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  const std::string port_str = std::to_string(port);
  if (int e = getaddrinfo(host.empty() ? nullptr : host.c_str(), port_str.c_str(), &hints, &res);
      e != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen address ", host, ":", port, ": ", gai_strerror(e)));
  }
  Socket s(::socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC, res->ai_protocol));
  int one = 1;
  setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool ok =
      s.valid() && ::bind(s.fd(), res->ai_addr, res->ai_addrlen) == 0 && ::listen(s.fd(), 128) == 0;
  const int err = errno;
  freeaddrinfo(res);
  if (!ok) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", host, ":", port, ": ", std::strerror(err)));
  }
  return s;
}

absl::StatusOr<int> ChooseFreePort(const std::string& host, const std::vector<int>& taken) {
  int ephemeral_low = 32768;  // Linux's default range is 32768-60999
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  if (int lo = 0; range >> lo && lo > 0 && lo <= 65535) ephemeral_low = lo;
  return ChooseFreePortBelow(host, ephemeral_low, taken);
}

absl::StatusOr<int> ChooseFreePortBelow(const std::string& host, int ephemeral_low,
                                        const std::vector<int>& taken) {
  constexpr int kLowest = 10000;  // above the ports services are usually configured on
  const std::unordered_set<int> avoid(taken.begin(), taken.end());
  absl::Status last;
  if (ephemeral_low - kLowest < 1000) {
    // A range moved down: any free port the kernel gives, but not one the caller has taken (a
    // port-0 listener's port is free now, taken or not).
    for (int attempt = 0; attempt < 64; ++attempt) {
      ASSIGN_OR_RETURN(Socket s, Listen(host, 0));
      if (!avoid.contains(s.port())) return s.port();
    }
    return absl::UnavailableError(absl::StrCat(
        "no free port on ", host, " in 64 tries: the kernel gave only ports the caller has taken"));
  }
  const int span = ephemeral_low - kLowest;
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> pick(kLowest, ephemeral_low - 1);
  for (int attempt = 0; attempt < 64; ++attempt) {
    // A random port, or the first one after it (wrapping) that the caller has not taken.
    int port = pick(rng);
    for (int i = 0; i < span && avoid.contains(port); ++i) {
      port = port + 1 < ephemeral_low ? port + 1 : kLowest;
    }
    if (avoid.contains(port)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("no free port on ", host, ": every port from ", kLowest, " to ",
                       ephemeral_low - 1, " is one the caller has taken"));
    }
    auto s = Listen(host, port);
    if (s.ok()) return port;
    last = s.status();
  }
  return absl::UnavailableError(absl::StrCat("no free port on ", host, " below ", ephemeral_low,
                                             " in 64 tries: ", last.message()));
}

absl::StatusOr<Socket> Accept(const Socket& listener, Deadline deadline) {
  for (;;) {
    pollfd pfd{listener.fd(), POLLIN, 0};
    const int r = ::poll(&pfd, 1, MillisUntil(deadline));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return absl::DeadlineExceededError("no connection arrived in time");
    const int fd = ::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      return absl::UnavailableError(absl::StrCat("accept failed: ", std::strerror(errno)));
    }
    NoDelay(fd);
    return Socket(fd);
  }
}

absl::StatusOr<Socket> ConnectWithRetry(const std::string& host, int port, Deadline deadline) {
  std::string last_error = "no attempt";
  auto backoff = std::chrono::milliseconds(10);
  do {
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    const std::string port_str = std::to_string(port);
    if (int e = getaddrinfo(host.c_str(), port_str.c_str(), &hints, &res); e != 0) {
      last_error = absl::StrCat("cannot resolve: ", gai_strerror(e));
    } else {
      for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
        Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
        if (s.valid() && ::connect(s.fd(), a->ai_addr, a->ai_addrlen) == 0) {
          freeaddrinfo(res);
          NoDelay(s.fd());
          return s;
        }
        last_error = std::strerror(errno);  // typically: nothing listens yet
      }
      freeaddrinfo(res);
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  } while (std::chrono::steady_clock::now() < deadline);
  return absl::DeadlineExceededError(
      absl::StrCat("could not connect to ", host, ":", port, " in time: ", last_error));
}

}  // namespace shardserve
