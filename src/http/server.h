#pragma once
// The HTTP/1.1 server behind every endpoint of shardserve's processes: the leader's API, a rank's
// /metrics, the operator's /metrics and probes. On Boost.Beast over Asio: one I/O thread
// multiplexes every connection, so a client that sends slowly, or never finishes, holds a socket
// and a few KB, never a thread. (cpp-httplib, used before, gives every connection a pool thread
// and has no deadline for a request as a whole: 180 clients sending a header line every 2 s
// starved the API of threads, and a line without a newline grew without bound.)
//
// Bounds, each answered with a status and the reason, then the connection closes:
//   a request head (request line and headers) must be complete within `header_timeout` of the
//   connection becoming idle (accepted, or its previous answer written): 408; at most
//   `max_header_bytes`: 431; a body within `body_timeout` of its head: 408; at most
//   `max_body_bytes`: 413; Content-Length twice with different values, or with
//   Transfer-Encoding, or a transfer coding other than chunked: 400. An answer the client does
//   not take within `write_timeout` (per write) closes the connection.
// At `max_connections`, a new connection evicts the oldest one still sending its head (a slow
// client never locks others out); with none to evict it is closed at once.
//
// Routes are fixed at start. A `Handler` runs on the I/O thread and must not block (probes,
// /metrics: they are answered however many clients are slow). A `BlockingHandler` gets a thread
// of its own, at most `max_blocking` at once (beyond that, `busy` answers 503 with Retry-After),
// and answers through an `Exchange`, whole or as a chunked stream.
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve::http {

using Headers = std::vector<std::pair<std::string, std::string>>;

struct Request {
  std::string method;  // as sent, e.g. "POST"
  std::string target;  // as sent, e.g. "/v1/models?x=1"
  std::string path;    // the target without its query
  Headers headers;     // names in lower case, in the order sent
  std::string body;
  std::string peer;  // "address:port"

  // Every value of header `name` (lower case) joined by ", " (RFC 9110 §5.3); "" when absent.
  std::string Header(std::string_view name) const;
  bool HasHeader(std::string_view name) const;
};

struct Response {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  Headers headers;  // beyond Content-Type, Content-Length / Transfer-Encoding and Connection
};

// How a blocking handler answers, from its own thread: Respond once, or StartStream, Write
// pieces and End. Write and StartStream wait until the client has taken the bytes (at most the
// write timeout) and return false once it is gone. A handler that returns without answering is
// answered 500 for it.
class Exchange {
 public:
  virtual ~Exchange() = default;
  virtual void Respond(Response response) = 0;
  // A chunked answer with the status, content type and headers of `head` (its body is ignored).
  virtual bool StartStream(const Response& head) = 0;
  virtual bool Write(std::string_view data) = 0;
  virtual void End() = 0;
  // The client closed its side of the connection: nobody will read an answer.
  virtual bool ClientGone() = 0;
};

using Handler = std::function<Response(const Request&)>;
using BlockingHandler = std::function<void(const Request&, Exchange&)>;

struct ServerOptions {
  std::string host = "0.0.0.0";
  int port = 0;  // 0: any free port
  size_t max_header_bytes = 16 << 10;
  size_t max_body_bytes = 1 << 20;
  std::chrono::milliseconds header_timeout{10000};
  std::chrono::milliseconds body_timeout{60000};
  std::chrono::milliseconds write_timeout{30000};
  size_t max_connections = 4096;
  int max_blocking = 64;
  // The answer to a request the server refuses itself (status, reason). Default: JSON
  // {"error": {"message": reason}}.
  std::function<Response(int status, const std::string& reason)> error;
  // Called for every answer the server gives itself (4xx/5xx above), e.g. to count it.
  std::function<void(int status)> on_error;
};

class Routes {
 public:
  Routes& Get(const std::string& path, Handler h);
  Routes& Post(const std::string& path, Handler h);
  Routes& GetBlocking(const std::string& path, BlockingHandler h);
  Routes& PostBlocking(const std::string& path, BlockingHandler h);

  struct Route {
    Handler inline_handler;
    BlockingHandler blocking_handler;
  };
  // path -> method -> route
  const std::map<std::string, std::map<std::string, Route>>& table() const { return table_; }

 private:
  std::map<std::string, std::map<std::string, Route>> table_;
};

class Server {
 public:
  // Binds host:port (an error names the address) and starts serving on a thread of its own.
  static absl::StatusOr<std::unique_ptr<Server>> Start(ServerOptions options, Routes routes);
  // Stops: no new connections; idle ones close, those of running blocking handlers are shut so
  // their writes fail at once; waits for the handlers to return.
  ~Server();
  void Stop();

  int port() const;
  // Connections open now (for tests and figures).
  size_t connections() const;

  struct Impl;

 private:
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A blocking HTTP/1.1 client call with one deadline for the whole exchange; for probes of our
// own servers (`shardserve local` waiting for readiness, tests). Unavailable names the address.
struct ClientResponse {
  int status = 0;
  Headers headers;
  std::string body;
};
absl::StatusOr<ClientResponse> Fetch(const std::string& host, int port, const std::string& method,
                                     const std::string& target, const Headers& headers,
                                     const std::string& body, std::chrono::milliseconds timeout);

}  // namespace shardserve::http
