#include "http/server.h"

#include <poll.h>
#include <sys/resource.h>

#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cstdio>
#include <future>
#include <list>
#include <optional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"

namespace shardserve::http {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;
using error_code = boost::system::error_code;

std::string Request::Header(std::string_view name) const {
  std::string out;
  for (const auto& [k, v] : headers) {
    if (k == name) absl::StrAppend(&out, out.empty() ? "" : ", ", v);
  }
  return out;
}

bool Request::HasHeader(std::string_view name) const {
  for (const auto& h : headers) {
    if (h.first == name) return true;
  }
  return false;
}

Routes& Routes::Get(const std::string& path, Handler h) {
  table_[path]["GET"] = {std::move(h), nullptr};
  return *this;
}
Routes& Routes::Post(const std::string& path, Handler h) {
  table_[path]["POST"] = {std::move(h), nullptr};
  return *this;
}
Routes& Routes::GetBlocking(const std::string& path, BlockingHandler h) {
  table_[path]["GET"] = {nullptr, std::move(h)};
  return *this;
}
Routes& Routes::PostBlocking(const std::string& path, BlockingHandler h) {
  table_[path]["POST"] = {nullptr, std::move(h)};
  return *this;
}

namespace {

// A header value as written: no line breaks (they would split the response).
std::string HeaderSafe(absl::string_view v) {
  return absl::StrReplaceAll(v, {{"\r", " "}, {"\n", " "}});
}

// The status line and headers of an answer.
std::string ResponseHead(const Response& r, bool chunked, bool close) {
  std::string reason(bhttp::obsolete_reason(static_cast<bhttp::status>(r.status)));
  std::string s = absl::StrCat("HTTP/1.1 ", r.status, " ", reason, "\r\n");
  if (!r.content_type.empty()) absl::StrAppend(&s, "Content-Type: ", r.content_type, "\r\n");
  for (const auto& [k, v] : r.headers)
    absl::StrAppend(&s, HeaderSafe(k), ": ", HeaderSafe(v), "\r\n");
  if (chunked) {
    s += "Transfer-Encoding: chunked\r\n";
  } else {
    absl::StrAppend(&s, "Content-Length: ", r.body.size(), "\r\n");
  }
  if (close) s += "Connection: close\r\n";
  s += "\r\n";
  return s;
}

std::string Seconds(std::chrono::milliseconds d) {
  return absl::StrCat(static_cast<double>(d.count()) / 1000.0, " s");
}

bool IsHttpError(const error_code& ec) {
  return ec.category() == bhttp::make_error_code(bhttp::error::bad_method).category();
}

// Lets the process hold as many sockets as `max_connections` asks for: the soft limit of open
// files is raised to the hard one (1024 by default, less than a server should hold).
void RaiseFileLimit() {
  static std::once_flag once;
  std::call_once(once, [] {
    rlimit l{};
    if (getrlimit(RLIMIT_NOFILE, &l) == 0 && l.rlim_cur < l.rlim_max) {
      l.rlim_cur = l.rlim_max;
      setrlimit(RLIMIT_NOFILE, &l);
    }
  });
}

class Connection;

constexpr auto kLingerTime = std::chrono::milliseconds(2000);
constexpr size_t kLingerBytes = 16 << 20;

}  // namespace

struct Server::Impl {
  ServerOptions options;
  Routes routes;
  // Declared first so that it is destroyed last, after every socket and timer that uses it.
  asio::io_context io{1};
  tcp::acceptor acceptor{io};
  asio::steady_timer accept_retry{io};
  std::thread thread;
  int port = 0;
  // The I/O thread's own state.
  std::list<std::shared_ptr<Connection>> conns;
  bool stopping = false;
  std::atomic<size_t> open{0};

  absl::Mutex mu;
  absl::CondVar idle;
  int blocking ABSL_GUARDED_BY(mu) = 0;
  bool stopped ABSL_GUARDED_BY(mu) = false;

  Response Error(int status, const std::string& reason) const {
    if (options.on_error) options.on_error(status);
    if (options.error) return options.error(status, reason);
    std::string escaped;
    for (char c : reason) {
      if (c == '"' || c == '\\') escaped += '\\';
      escaped += (static_cast<unsigned char>(c) < 0x20) ? ' ' : c;
    }
    Response r;
    r.status = status;
    r.body = absl::StrCat("{\"error\":{\"message\":\"", escaped, "\"}}");
    return r;
  }
  bool TakeBlocking() {
    absl::MutexLock lock(&mu);
    if (blocking >= options.max_blocking) return false;
    ++blocking;
    return true;
  }
  void ReleaseBlocking() {
    absl::MutexLock lock(&mu);
    --blocking;
    idle.SignalAll();
  }
  void Accept();
  void Admit(tcp::socket socket);
  // Closes the connection that has waited longest for its request head; false when none does.
  bool EvictOldestHead();
};

namespace {

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  enum class State { kHead, kBody, kHandling, kWriting, kClosed };

  Connection(Server::Impl* server, tcp::socket socket)
      : s_(server), socket_(std::move(socket)), timer_(server->io) {}

  void Start(std::list<std::shared_ptr<Connection>>::iterator self) {
    self_ = self;
    error_code ec;
    const tcp::endpoint remote = socket_.remote_endpoint(ec);
    if (!ec) peer_ = absl::StrCat(remote.address().to_string(), ":", remote.port());
    ReadHead();
  }

  State state() const { return state_; }
  std::chrono::steady_clock::time_point idle_since() const { return idle_since_; }
  asio::io_context& io() { return s_->io; }
  const ServerOptions& options() const { return s_->options; }
  Server::Impl* server() { return s_; }
  bool gone() const { return gone_.load(); }
  int fd() { return socket_.native_handle(); }

  // Ends the connection. While a blocking handler holds it, the socket is only shut down (its
  // writes fail, ClientGone turns true) and closed when the handler lets go.
  void Close() {
    auto keep = shared_from_this();
    gone_ = true;
    if (state_ == State::kClosed) return;
    error_code ec;
    if (attached_) {
      socket_.shutdown(tcp::socket::shutdown_both, ec);
      return;
    }
    state_ = State::kClosed;
    Disarm();
    socket_.close(ec);
    s_->conns.erase(self_);
    --s_->open;
  }

  // A blocking handler is done with this connection.
  void Detach() {
    attached_ = false;
    if (gone_ || state_ == State::kClosed) Close();
  }

  // Writes `data`; then `done(ok)`. The write fails if the client does not take it in time.
  void Send(std::string data, std::function<void(bool)> done) {
    out_ = std::move(data);
    Arm(options().write_timeout);
    asio::async_write(socket_, asio::buffer(out_),
                      [self = shared_from_this(), done = std::move(done)](error_code ec, size_t) {
                        self->Disarm();
                        if (ec) self->Close();
                        done(!ec);
                      });
  }

  // A whole answer, then the next request (keep-alive) or the end.
  void WriteResponse(const Response& r) {
    state_ = State::kWriting;
    const bool close = !keep_alive_ || s_->stopping;
    Send(ResponseHead(r, false, close) + r.body, [self = shared_from_this(), close](bool ok) {
      if (!ok) return;
      if (!close) return self->AfterAnswer();
      self->linger_ ? self->Linger() : self->Close();
    });
  }

  void WriteStreamHead(const Response& head, std::function<void(bool)> done) {
    state_ = State::kWriting;
    Send(ResponseHead(head, chunked_, !chunked_ || !keep_alive_), std::move(done));
  }

  void WriteChunk(std::string_view data, std::function<void(bool)> done) {
    std::string wire;
    if (chunked_) {
      char size[24];
      std::snprintf(size, sizeof(size), "%zx\r\n", data.size());
      wire = absl::StrCat(size, absl::string_view(data.data(), data.size()), "\r\n");
    } else {
      wire = std::string(data);
    }
    Send(std::move(wire), std::move(done));
  }

  void EndStream() {
    if (!chunked_) return Close();
    Send("0\r\n\r\n", [self = shared_from_this()](bool ok) {
      if (ok) (self->keep_alive_ && !self->s_->stopping) ? self->AfterAnswer() : self->Close();
    });
  }

  // The server refuses the request itself: the reason, then the connection closes (lingering,
  // so that a client still sending its body reads the answer rather than a reset).
  void Refuse(int status, const std::string& reason) {
    keep_alive_ = false;
    linger_ = true;
    WriteResponse(s_->Error(status, reason));
  }

 private:
  void Arm(std::chrono::milliseconds d) {
    const uint64_t id = ++deadline_id_;
    timed_out_ = false;
    timer_.expires_after(d);
    timer_.async_wait([self = shared_from_this(), id](error_code ec) {
      if (ec || id != self->deadline_id_) return;
      self->timed_out_ = true;
      error_code ignored;
      self->socket_.cancel(ignored);  // the pending read or write ends with operation_aborted
    });
  }
  void Disarm() {
    ++deadline_id_;
    timer_.cancel();
  }

  // Half-closes, then reads and drops what the client still sends (at most kLingerBytes, for at
  // most kLingerTime) before closing: closing with unread bytes would reset the connection, and
  // the client could lose the answer it has not read yet.
  void Linger() {
    error_code ec;
    socket_.shutdown(tcp::socket::shutdown_send, ec);
    state_ = State::kWriting;
    Arm(kLingerTime);
    DrainSome();
  }
  void DrainSome() {
    auto scratch = std::make_shared<std::array<char, 16384>>();
    socket_.async_read_some(asio::buffer(*scratch),
                            [self = shared_from_this(), scratch](error_code ec, size_t n) {
                              self->lingered_ += n;
                              if (ec || self->lingered_ > kLingerBytes) return self->Close();
                              self->DrainSome();
                            });
  }

  void AfterAnswer() {
    if (s_->stopping) return Close();
    ReadHead();
  }

  // The head is read whole (to its empty line, at most max_header_bytes) before Beast parses it,
  // so that its raw lines can be checked: Beast joins obs-fold continuations silently, and RFC
  // 9112 §5.2 says a server must reject them (a Content-Length split over two lines would
  // otherwise read differently here and at a proxy in front).
  void ReadHead() {
    state_ = State::kHead;
    idle_since_ = std::chrono::steady_clock::now();
    parser_.emplace();
    parser_->header_limit(static_cast<std::uint32_t>(options().max_header_bytes));
    parser_->body_limit(options().max_body_bytes);
    head_scanned_ = 0;
    Arm(options().header_timeout);
    ReadHeadBytes();
  }

  // Looks for the head's end (CRLF CRLF) in what has arrived (bytes already searched are not
  // searched again), then reads more; stops past max_header_bytes.
  void ReadHeadBytes() {
    const std::string_view got(static_cast<const char*>(buffer_.data().data()), buffer_.size());
    const size_t from = head_scanned_ > 3 ? head_scanned_ - 3 : 0;
    if (const size_t end = got.find("\r\n\r\n", from); end != std::string_view::npos) {
      return OnHeadBytes(end + 4);
    }
    head_scanned_ = got.size();
    if (got.size() > options().max_header_bytes) return OnHeadBytes(got.size());
    socket_.async_read_some(
        buffer_.prepare(std::min<size_t>(65536, options().max_header_bytes + 1)),
        [self = shared_from_this()](error_code ec, size_t n) {
          if (ec) {
            self->Disarm();
            return self->OnReadError(ec, true);
          }
          self->buffer_.commit(n);
          self->ReadHeadBytes();
        });
  }

  void OnHeadBytes(size_t n) {
    const std::string_view head(static_cast<const char*>(buffer_.data().data()), n);
    if (!head.ends_with("\r\n\r\n")) {
      Disarm();
      return Refuse(
          431, absl::StrCat("the request head exceeds ", options().max_header_bytes, " bytes"));
    }
    if (head.find("\r\n ") != std::string_view::npos ||
        head.find("\r\n\t") != std::string_view::npos) {
      Disarm();
      return Refuse(400,
                    "a header line is continued on the next (obs-fold, RFC 9112 §5.2): send each "
                    "field on one line");
    }
    bhttp::async_read_header(socket_, buffer_, *parser_,
                             [self = shared_from_this()](error_code ec, size_t) {
                               self->Disarm();
                               ec ? self->OnReadError(ec, true) : self->OnHead();
                             });
  }

  void OnHead() {
    const auto& msg = parser_->get();
    // RFC 9112 §3.2: an HTTP/1.1 request without a Host header, or with several, gets 400.
    if (msg.version() >= 11 && msg.count(bhttp::field::host) != 1) {
      return Refuse(400, "an HTTP/1.1 request needs exactly one Host header");
    }
    if (msg.count(bhttp::field::transfer_encoding) > 0 && !parser_->chunked()) {
      return Refuse(400, "a Transfer-Encoding other than chunked is not supported");
    }
    if (auto length = parser_->content_length(); length && *length > options().max_body_bytes) {
      return Refuse(413, absl::StrCat("the request body of ", *length, " bytes exceeds ",
                                      options().max_body_bytes, " bytes"));
    }
    if (parser_->is_done()) return Dispatch();
    if (beast::iequals(msg[bhttp::field::expect], "100-continue")) {
      return Send("HTTP/1.1 100 Continue\r\n\r\n", [self = shared_from_this()](bool ok) {
        if (ok) self->ReadBody();
      });
    }
    ReadBody();
  }

  void ReadBody() {
    state_ = State::kBody;
    Arm(options().body_timeout);
    bhttp::async_read(socket_, buffer_, *parser_,
                      [self = shared_from_this()](error_code ec, size_t) {
                        self->Disarm();
                        ec ? self->OnReadError(ec, false) : self->Dispatch();
                      });
  }

  void OnReadError(const error_code& ec, bool head) {
    if (timed_out_) {
      // A connection that never began a request just goes (keep-alive idle).
      if (head && !parser_->got_some() && buffer_.size() == 0) return Close();
      return Refuse(408, head ? absl::StrCat("the request head did not arrive within ",
                                             Seconds(options().header_timeout))
                              : absl::StrCat("the request body did not arrive within ",
                                             Seconds(options().body_timeout)));
    }
    if (ec == bhttp::error::header_limit) {
      return Refuse(
          431, absl::StrCat("the request head exceeds ", options().max_header_bytes, " bytes"));
    }
    if (ec == bhttp::error::body_limit) {
      return Refuse(413,
                    absl::StrCat("the request body exceeds ", options().max_body_bytes, " bytes"));
    }
    if (ec == bhttp::error::bad_content_length) {
      return Refuse(400,
                    "the request's Content-Length is malformed, given twice with different "
                    "values, or given with Transfer-Encoding");
    }
    if (ec == bhttp::error::bad_transfer_encoding) {
      return Refuse(400, "the request's Transfer-Encoding is given twice or with Content-Length");
    }
    if (IsHttpError(ec) && ec != bhttp::error::end_of_stream &&
        ec != bhttp::error::partial_message) {
      return Refuse(400, absl::StrCat("malformed request: ", ec.message()));
    }
    Close();  // the client went away
  }

  void Dispatch() {
    auto msg = parser_->release();
    keep_alive_ = msg.keep_alive();
    chunked_ = msg.version() >= 11;
    Request req;
    req.method = std::string(msg.method_string());
    req.target = std::string(msg.target());
    req.path = req.target.substr(0, req.target.find('?'));
    for (const auto& f : msg) {
      req.headers.emplace_back(absl::AsciiStrToLower(std::string(f.name_string())),
                               std::string(f.value()));
    }
    req.body = std::move(msg.body());
    req.peer = peer_;

    const auto& table = s_->routes.table();
    auto path = table.find(req.path);
    if (path == table.end()) {
      return WriteResponse(
          s_->Error(404, absl::StrCat("no such endpoint: ", req.method, " ", req.path)));
    }
    auto route = path->second.find(req.method);
    if (route == path->second.end()) {
      std::string allow;
      for (const auto& [method, r] : path->second) {
        absl::StrAppend(&allow, allow.empty() ? "" : ", ", method);
      }
      Response r = s_->Error(
          405, absl::StrCat(req.method, " is not allowed on ", req.path, "; allowed: ", allow));
      r.headers.emplace_back("Allow", allow);
      return WriteResponse(r);
    }
    if (route->second.inline_handler) {
      Response r;
      try {
        r = route->second.inline_handler(req);
      } catch (const std::exception& e) {
        r = s_->Error(500, absl::StrCat("internal error: ", e.what()));
      }
      return WriteResponse(r);
    }
    if (!s_->TakeBlocking()) {  // the client's to retry later: 429, as for a full queue
      Response r = s_->Error(429, "the server is busy: too many requests in progress");
      r.headers.emplace_back("Retry-After", "1");
      return WriteResponse(r);
    }
    state_ = State::kHandling;
    attached_ = true;
    try {
      std::thread(RunBlocking, shared_from_this(), route->second.blocking_handler, std::move(req))
          .detach();
    } catch (const std::system_error& e) {  // no thread to be had
      s_->ReleaseBlocking();
      attached_ = false;
      Response r = s_->Error(503, absl::StrCat("the server is busy: ", e.what()));
      r.headers.emplace_back("Retry-After", "1");
      WriteResponse(r);
    }
  }

  static void RunBlocking(std::shared_ptr<Connection> conn, BlockingHandler handler, Request req);

  Server::Impl* s_;
  tcp::socket socket_;
  asio::steady_timer timer_;
  beast::flat_buffer buffer_;
  size_t head_scanned_ = 0;  // bytes of buffer_ searched for the head's end
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  std::list<std::shared_ptr<Connection>>::iterator self_;
  std::string peer_;
  std::string out_;  // the bytes being written
  State state_ = State::kHead;
  std::chrono::steady_clock::time_point idle_since_;
  uint64_t deadline_id_ = 0;
  bool timed_out_ = false;
  bool keep_alive_ = true;
  bool chunked_ = true;
  bool linger_ = false;  // refused: drain before closing
  size_t lingered_ = 0;
  bool attached_ = false;          // a blocking handler holds the connection
  std::atomic<bool> gone_{false};  // read by the handler's thread
};

// The exchange of one blocking handler: every socket operation is posted to the I/O thread, and
// the handler's thread waits for its outcome (bounded by the write timeout).
class BlockingExchange : public Exchange {
 public:
  explicit BlockingExchange(std::shared_ptr<Connection> c) : c_(std::move(c)) {}

  void Respond(Response r) override {
    if (answered_) return;
    answered_ = true;
    asio::post(c_->io(), [c = c_, r = std::move(r)] {
      if (!c->gone()) c->WriteResponse(r);
    });
  }
  bool StartStream(const Response& head) override {
    if (answered_) return false;
    answered_ = streaming_ = true;
    return OnIo([head](Connection& c, std::function<void(bool)> done) {
      c.WriteStreamHead(head, std::move(done));
    });
  }
  bool Write(std::string_view data) override {
    if (!streaming_ || ended_) return false;
    if (data.empty()) return !c_->gone();  // an empty chunk would end the stream
    return OnIo([d = std::string(data)](Connection& c, std::function<void(bool)> done) {
      c.WriteChunk(d, std::move(done));
    });
  }
  void End() override {
    if (!streaming_ || ended_) return;
    ended_ = true;
    asio::post(c_->io(), [c = c_] {
      if (!c->gone()) c->EndStream();
    });
  }
  bool ClientGone() override {
    if (c_->gone()) return true;
    pollfd p{c_->fd(), POLLRDHUP, 0};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
  }

  // After the handler: an answer it did not give, then the connection goes back to the I/O
  // thread.
  void Finish(const std::string& failure) {
    if (!answered_ && failure.empty() && ClientGone()) {
      // The handler gave up on a client that left (it counts that, as 499): no answer to write
      // and nothing more to count.
      asio::post(c_->io(), [c = c_] { c->Close(); });
    } else if (!answered_) {
      Response r = c_->server()->Error(
          500, failure.empty() ? "internal error: the handler gave no answer" : failure);
      Respond(std::move(r));
    } else if (streaming_ && !ended_) {
      asio::post(c_->io(), [c = c_] { c->Close(); });  // a stream cut short
    }
    asio::io_context& io = c_->io();  // before c_ moves into the handler
    asio::post(io, [c = std::move(c_)] { c->Detach(); });
  }

 private:
  bool OnIo(std::function<void(Connection&, std::function<void(bool)>)> op) {
    if (c_->gone()) return false;
    auto result = std::make_shared<std::promise<bool>>();
    std::future<bool> f = result->get_future();
    asio::post(c_->io(), [c = c_, op = std::move(op), result] {
      if (c->gone()) return result->set_value(false);
      op(*c, [result](bool ok) { result->set_value(ok); });
    });
    if (f.wait_for(c_->options().write_timeout + std::chrono::seconds(5)) !=
        std::future_status::ready) {
      return false;
    }
    return f.get();
  }

  std::shared_ptr<Connection> c_;
  bool answered_ = false, streaming_ = false, ended_ = false;
};

void Connection::RunBlocking(std::shared_ptr<Connection> conn, BlockingHandler handler,
                             Request req) {
  Server::Impl* s = conn->s_;
  {
    BlockingExchange ex(std::move(conn));
    std::string failure;
    try {
      handler(req, ex);
    } catch (const std::exception& e) {
      failure = absl::StrCat("internal error: ", e.what());
    }
    ex.Finish(failure);
  }
  s->ReleaseBlocking();
}

}  // namespace

bool Server::Impl::EvictOldestHead() {
  std::shared_ptr<Connection> oldest;
  for (const auto& c : conns) {
    if (c->state() == Connection::State::kHead &&
        (!oldest || c->idle_since() < oldest->idle_since())) {
      oldest = c;
    }
  }
  if (!oldest) return false;
  oldest->Close();
  return true;
}

void Server::Impl::Admit(tcp::socket socket) {
  if (conns.size() >= options.max_connections && !EvictOldestHead()) {
    error_code ec;
    socket.close(ec);  // every connection is busy with a request: no room
    return;
  }
  error_code ec;
  socket.set_option(tcp::no_delay(true), ec);
  conns.push_front(std::make_shared<Connection>(this, std::move(socket)));
  ++open;
  conns.front()->Start(conns.begin());
}

void Server::Impl::Accept() {
  acceptor.async_accept([this](error_code ec, tcp::socket socket) {
    if (stopping) return;
    if (!ec) {
      Admit(std::move(socket));
      return Accept();
    }
    // Out of descriptors (or another transient failure): make room, then try again shortly
    // rather than spin.
    if (ec == asio::error::no_descriptors || ec.value() == ENFILE) EvictOldestHead();
    accept_retry.expires_after(std::chrono::milliseconds(20));
    accept_retry.async_wait([this](error_code e) {
      if (!e && !stopping) Accept();
    });
  });
}

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Server::~Server() { Stop(); }

absl::StatusOr<std::unique_ptr<Server>> Server::Start(ServerOptions options, Routes routes) {
  RaiseFileLimit();
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  impl->routes = std::move(routes);
  const std::string& host = impl->options.host;
  error_code ec;
  const asio::ip::address address = asio::ip::make_address(host.empty() ? "0.0.0.0" : host, ec);
  auto fail = [&](const error_code& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve HTTP on ", host, ":", impl->options.port, ": ", e.message()));
  };
  if (ec) return fail(ec);
  const tcp::endpoint endpoint(address, static_cast<unsigned short>(impl->options.port));
  impl->acceptor.open(endpoint.protocol(), ec);
  if (!ec) impl->acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(endpoint, ec);
  if (!ec) impl->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return fail(ec);
  impl->port = impl->acceptor.local_endpoint(ec).port();
  impl->Accept();
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->io.run(); });
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

void Server::Stop() {
  if (!impl_) return;
  {
    absl::MutexLock lock(&impl_->mu);
    if (impl_->stopped) return;
    impl_->stopped = true;
  }
  Impl* s = impl_.get();
  asio::post(s->io, [s] {
    s->stopping = true;
    error_code ec;
    s->acceptor.close(ec);
    s->accept_retry.cancel();
    const std::vector<std::shared_ptr<Connection>> all(s->conns.begin(), s->conns.end());
    for (const auto& c : all) c->Close();
  });
  {
    absl::MutexLock lock(&s->mu);
    while (s->blocking != 0) s->idle.Wait(&s->mu);
  }
  s->io.stop();
  if (s->thread.joinable()) s->thread.join();
}

int Server::port() const { return impl_->port; }

size_t Server::connections() const { return impl_->open.load(); }

absl::StatusOr<ClientResponse> Fetch(const std::string& host, int port, const std::string& method,
                                     const std::string& target, const Headers& headers,
                                     const std::string& body, std::chrono::milliseconds timeout) {
  asio::io_context io{1};
  beast::tcp_stream stream(io);
  tcp::resolver resolver(io);
  bhttp::request<bhttp::string_body> req(bhttp::string_to_verb(method), target, 11);
  req.set(bhttp::field::host, host);
  for (const auto& [k, v] : headers) req.set(k, v);
  req.body() = body;
  req.prepare_payload();
  bhttp::response_parser<bhttp::string_body> parser;
  parser.body_limit(64 << 20);
  beast::flat_buffer buffer;
  error_code result = asio::error::timed_out;
  stream.expires_after(timeout);
  resolver.async_resolve(host, std::to_string(port), [&](error_code ec, auto endpoints) {
    if (ec) return void(result = ec);
    stream.async_connect(endpoints, [&](error_code ec, const auto&) {
      if (ec) return void(result = ec);
      bhttp::async_write(stream, req, [&](error_code ec, size_t) {
        if (ec) return void(result = ec);
        bhttp::async_read(stream, buffer, parser, [&](error_code ec, size_t) { result = ec; });
      });
    });
  });
  io.run_for(timeout + std::chrono::milliseconds(100));
  if (result) {
    return absl::UnavailableError(
        absl::StrCat(method, " http://", host, ":", port, target, ": ", result.message()));
  }
  ClientResponse out;
  const auto& msg = parser.get();
  out.status = static_cast<int>(msg.result_int());
  for (const auto& f : msg) {
    out.headers.emplace_back(absl::AsciiStrToLower(std::string(f.name_string())),
                             std::string(f.value()));
  }
  out.body = msg.body();
  return out;
}

}  // namespace shardserve::http
