#include "http/server.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace shardserve::http {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using namespace std::chrono_literals;

// A raw client socket on loopback: what a hostile or broken client sends, byte for byte.
class Raw {
 public:
  explicit Raw(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  }
  ~Raw() { close(fd_); }
  bool connected() const { return connected_; }
  bool Send(const std::string& s) {
    return ::send(fd_, s.data(), s.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(s.size());
  }
  void ShutdownWrite() { shutdown(fd_, SHUT_WR); }  // done sending, still reading
  // What arrives until the server closes or `wait` passes without a byte.
  std::string Read(std::chrono::milliseconds wait = 5000ms) {
    std::string out;
    char buf[4096];
    for (;;) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(wait.count())) <= 0) break;
      const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) break;
      out.append(buf, static_cast<size_t>(n));
    }
    return out;
  }
  // True when the server has closed the connection (end of stream or reset) within `wait`.
  bool Closed(std::chrono::milliseconds wait = 5000ms) {
    char buf[4096];
    const auto deadline = std::chrono::steady_clock::now() + wait;
    while (std::chrono::steady_clock::now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) return true;
    }
    return false;
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

std::string Get(const std::string& path, const std::string& extra = "") {
  return absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: t\r\n", extra, "\r\n");
}

class ServerTest : public ::testing::Test {
 protected:
  void Start(ServerOptions o = {}) {
    o.host = "127.0.0.1";
    if (!o.on_error) {
      o.on_error = [this](int status) {
        absl::MutexLock l(&errors_mu_);
        errors_.push_back(status);
      };
    }
    Routes r;
    r.Get("/ping", [](const Request&) { return Response{200, "text/plain", "pong", {}}; });
    r.Post("/echo", [](const Request& req) {
      return Response{200, "text/plain", absl::StrCat(req.Header("x-tag"), ":", req.body), {}};
    });
    r.GetBlocking("/slow", [this](const Request&, Exchange& ex) {
      ++entered_;
      while (!release_.load()) std::this_thread::sleep_for(5ms);
      ex.Respond({200, "text/plain", "late", {}});
    });
    r.GetBlocking("/stream", [](const Request&, Exchange& ex) {
      if (!ex.StartStream({200, "text/event-stream", "", {}})) return;
      for (int i = 0; i < 3; ++i) {
        if (!ex.Write(absl::StrCat("data: ", i, "\n\n"))) return;
      }
      ex.End();
    });
    r.GetBlocking("/watch", [this](const Request&, Exchange& ex) {
      ++entered_;
      while (!ex.ClientGone()) std::this_thread::sleep_for(5ms);
      gone_seen_ = true;
    });
    r.GetBlocking("/silent", [](const Request&, Exchange&) {});
    r.GetBlocking("/throws", [](const Request&, Exchange&) { throw std::runtime_error("boom"); });
    auto s = Server::Start(o, std::move(r));
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
  }
  void TearDown() override {
    release_ = true;
    server_.reset();
  }
  int port() const { return server_->port(); }

  std::unique_ptr<Server> server_;
  std::atomic<bool> release_{false};
  std::atomic<bool> gone_seen_{false};
  std::atomic<int> entered_{0};  // blocking handlers that have started
  absl::Mutex errors_mu_;
  std::vector<int> errors_ ABSL_GUARDED_BY(errors_mu_);  // statuses the server answered itself
};

// Polls `done` until it holds (at most 5 s).
template <typename Pred>
bool WaitFor(Pred done) {
  for (int i = 0; i < 500 && !done(); ++i) std::this_thread::sleep_for(10ms);
  return done();
}

TEST_F(ServerTest, AnswersAndKeepsTheConnection) {
  Start();
  Raw c(port());
  ASSERT_TRUE(c.Send(Get("/ping") + Get("/ping")));  // pipelined
  std::string got;
  for (int i = 0; i < 50 && got.find("pong", got.find("pong") + 1) == std::string::npos; ++i) {
    got += c.Read(100ms);
  }
  EXPECT_THAT(got, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(got, HasSubstr("Content-Length: 4\r\n"));
  EXPECT_NE(got.find("pong", got.find("pong") + 1), std::string::npos) << got;
  auto r = Fetch("127.0.0.1", port(), "POST", "/echo", {{"X-Tag", "t1"}}, "body", 5s);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, "t1:body");
}

TEST_F(ServerTest, UnknownPathsAndMethods) {
  Start();
  auto r = Fetch("127.0.0.1", port(), "GET", "/nope", {}, "", 5s);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 404);
  EXPECT_THAT(r->body, HasSubstr("no such endpoint: GET /nope"));
  r = Fetch("127.0.0.1", port(), "POST", "/ping", {}, "", 5s);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 405);
  EXPECT_THAT(r->body, HasSubstr("allowed: GET"));
}

TEST_F(ServerTest, RefusesOversizedHeadsAndBodies) {
  ServerOptions o;
  o.max_header_bytes = 1024;
  o.max_body_bytes = 100;
  Start(o);
  {
    Raw c(port());
    c.Send("GET /ping HTTP/1.1\r\nX-Long: " + std::string(4000, 'a'));  // no newline, ever
    const std::string got = c.Read();
    EXPECT_THAT(got, StartsWith("HTTP/1.1 431 "));
    EXPECT_THAT(got, HasSubstr("exceeds 1024 bytes"));
    EXPECT_TRUE(c.Closed());
  }
  {
    Raw c(port());
    c.Send("POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 101\r\n\r\n");
    const std::string got = c.Read();
    EXPECT_THAT(got, StartsWith("HTTP/1.1 413 "));
    EXPECT_THAT(got, HasSubstr("exceeds 100 bytes"));
  }
  {  // chunked, growing past the limit
    Raw c(port());
    c.Send("POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n");
    for (int i = 0; i < 4; ++i) c.Send("40\r\n" + std::string(64, 'x') + "\r\n");
    EXPECT_THAT(c.Read(), StartsWith("HTTP/1.1 413 "));
  }
}

TEST_F(ServerTest, RefusesAmbiguousBodyLengths) {
  Start();
  for (const std::string& head :
       {std::string("Content-Length: 4\r\nContent-Length: 5\r\n"),
        std::string("Content-Length: 4\r\nTransfer-Encoding: chunked\r\n"),
        std::string("Transfer-Encoding: chunked\r\nContent-Length: 4\r\n"),
        std::string("Transfer-Encoding: gzip\r\n")}) {
    Raw c(port());
    c.Send("POST /echo HTTP/1.1\r\nHost: t\r\n" + head + "\r\nabcde");
    const std::string got = c.Read();
    EXPECT_THAT(got, StartsWith("HTTP/1.1 400 ")) << head;
    EXPECT_TRUE(c.Closed()) << head;
  }
  // The same value twice is one length (RFC 9110 §8.6).
  Raw c(port());
  c.Send("POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\nContent-Length: 4\r\n\r\nabcd");
  EXPECT_THAT(c.Read(500ms), HasSubstr(":abcd"));
}

// Sends `request` on a connection of its own: the answer is 400 naming `why`, and the connection
// is closed.
void ExpectBadRequest(int port, const std::string& request, const std::string& why) {
  Raw c(port);
  c.Send(request);
  const std::string got = c.Read();
  EXPECT_THAT(got, StartsWith("HTTP/1.1 400 ")) << request;
  EXPECT_THAT(got, HasSubstr(why)) << request;
  EXPECT_TRUE(c.Closed()) << request;
}

// RFC 9112 §3.2: exactly one Host in an HTTP/1.1 request; HTTP/1.0 may have none.
TEST_F(ServerTest, AnHttp11RequestNeedsOneHost) {
  Start();
  ExpectBadRequest(port(), "GET /ping HTTP/1.1\r\n\r\n", "exactly one Host header");
  ExpectBadRequest(port(), "GET /ping HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
                   "exactly one Host header");
  Raw c(port());
  c.Send("GET /ping HTTP/1.0\r\n\r\n");
  EXPECT_THAT(c.Read(500ms), HasSubstr(" 200 "));
}

// RFC 9112 §5.2: a header line continued on the next (obs-fold) is refused, Content-Length
// included, before anything reads it; a head that arrives a byte at a time still parses.
TEST_F(ServerTest, RefusesObsFoldedHeaderLines) {
  Start();
  ExpectBadRequest(port(), "GET /ping HTTP/1.1\r\nHost: t\r\nX-A: 1\r\n 2\r\n\r\n", "obs-fold");
  ExpectBadRequest(port(), "POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length:\r\n\t4\r\n\r\nabcd",
                   "obs-fold");
  ExpectBadRequest(port(), "GET /ping HTTP/1.1\r\n Host: t\r\n\r\n", "obs-fold");
  Raw c(port());
  for (char ch : std::string("GET /ping HTTP/1.1\r\nHost: t\r\nX-B: a b\r\n\r\n")) {
    ASSERT_TRUE(c.Send(std::string(1, ch)));
  }
  EXPECT_THAT(c.Read(500ms), HasSubstr(" 200 "));
}

TEST_F(ServerTest, SlowHeadsAndBodiesTimeOut) {
  ServerOptions o;
  o.header_timeout = 300ms;
  o.body_timeout = 300ms;
  Start(o);
  {  // a header line every 100 ms, never the end: cut at the head's deadline, not per line
    Raw c(port());
    c.Send("GET /ping HTTP/1.1\r\n");
    std::string got;
    for (int i = 0; i < 40 && got.empty(); ++i) {
      c.Send(absl::StrCat("X-", i, ": a\r\n"));
      got = c.Read(100ms);
    }
    EXPECT_THAT(got, StartsWith("HTTP/1.1 408 "));
    EXPECT_THAT(got, HasSubstr("the request head did not arrive within 0.3 s"));
  }
  {
    Raw c(port());
    c.Send("POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc");
    const std::string got = c.Read();
    EXPECT_THAT(got, StartsWith("HTTP/1.1 408 "));
    EXPECT_THAT(got, HasSubstr("body"));
  }
  {  // an idle connection simply closes
    Raw c(port());
    EXPECT_TRUE(c.Closed());
  }
}

TEST_F(ServerTest, ExpectContinue) {
  Start();
  Raw c(port());
  c.Send("POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n");
  EXPECT_THAT(c.Read(500ms), StartsWith("HTTP/1.1 100 Continue\r\n\r\n"));
  c.Send("hi");
  EXPECT_THAT(c.Read(500ms), HasSubstr(":hi"));
}

TEST_F(ServerTest, StreamsChunks) {
  Start();
  Raw c(port());
  c.Send(Get("/stream"));
  std::string got;
  for (int i = 0; i < 50 && got.find("0\r\n\r\n") == std::string::npos; ++i) got += c.Read(100ms);
  EXPECT_THAT(got, HasSubstr("Transfer-Encoding: chunked\r\n"));
  EXPECT_THAT(got, HasSubstr("9\r\ndata: 2\n\n\r\n0\r\n\r\n"));
  c.Send(Get("/ping"));  // the connection goes on after the stream
  EXPECT_THAT(c.Read(500ms), HasSubstr("pong"));
}

TEST_F(ServerTest, HandlersThatFailOrSayNothingAre500) {
  Start();
  for (const char* path : {"/silent", "/throws"}) {
    auto r = Fetch("127.0.0.1", port(), "GET", path, {}, "", 5s);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->status, 500) << path;
  }
  auto r = Fetch("127.0.0.1", port(), "GET", "/throws", {}, "", 5s);
  EXPECT_THAT(r->body, HasSubstr("boom"));
}

TEST_F(ServerTest, ABlockingHandlerSeesItsClientGo) {
  Start();
  {
    Raw c(port());
    c.Send(Get("/watch"));
    ASSERT_TRUE(WaitFor([&] { return entered_ == 1; }));
  }  // closed while the handler runs
  EXPECT_TRUE(WaitFor([&] { return gone_seen_.load(); }));
}

// A handler that gives up on a client that left is not answered 500 for it, nor counted: it
// counted the 499 itself (a half-closed client counts as gone, as nginx and uvicorn take it).
TEST_F(ServerTest, AHandlerThatGivesUpOnAGoneClientIsNotAnswered500) {
  Start();
  Raw c(port());
  c.Send(Get("/watch"));
  ASSERT_TRUE(WaitFor([&] { return entered_ == 1; }));
  c.ShutdownWrite();
  EXPECT_TRUE(WaitFor([&] { return gone_seen_.load(); }));
  const std::string got = c.Read(2000ms);
  EXPECT_EQ(got.find(" 500 "), std::string::npos) << got;
  absl::MutexLock l(&errors_mu_);
  EXPECT_TRUE(errors_.empty()) << errors_[0];
}

TEST_F(ServerTest, BusyBeyondTheBlockingHandlers) {
  ServerOptions o;
  o.max_blocking = 2;
  Start(o);
  Raw a(port()), b(port());
  a.Send(Get("/slow"));
  b.Send(Get("/slow"));
  ASSERT_TRUE(WaitFor([&] { return entered_ == 2; }));  // both handlers hold their threads
  auto r = Fetch("127.0.0.1", port(), "GET", "/slow", {}, "", 5s);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 429);  // the client's to retry, as the README promises
  EXPECT_THAT(r->body, HasSubstr("busy"));
  // Inline routes are answered all the while.
  EXPECT_EQ(Fetch("127.0.0.1", port(), "GET", "/ping", {}, "", 5s)->status, 200);
  release_ = true;
  EXPECT_THAT(a.Read(500ms), HasSubstr("late"));
}

// 1,000 clients that send a header line now and then and never finish: each costs a socket, not
// a thread, so probes go on being answered; at the connection cap the oldest unfinished one
// makes room for a newcomer.
TEST_F(ServerTest, SlowClientsDoNotStarveProbes) {
  ServerOptions o;
  o.max_connections = 600;
  o.header_timeout = 60s;
  Start(o);
  std::vector<std::unique_ptr<Raw>> slow;
  for (int i = 0; i < 1000; ++i) {
    slow.push_back(std::make_unique<Raw>(port()));
    slow.back()->Send("POST /echo HTTP/1.1\r\nHost: t\r\n");
  }
  int answered = 0;
  for (int round = 0; round < 3; ++round) {
    for (auto& s : slow) s->Send(absl::StrCat("X-", round, ": a\r\n"));
    for (int p = 0; p < 4; ++p) {
      auto r = Fetch("127.0.0.1", port(), "GET", "/ping", {}, "", 5s);
      answered += r.ok() && r->status == 200;
    }
  }
  EXPECT_EQ(answered, 12);
  EXPECT_LE(server_->connections(), 600u);
  // The oldest were evicted to make room: the first clients are gone, the last still wait.
  EXPECT_TRUE(slow.front()->Closed(1000ms));
  EXPECT_FALSE(slow.back()->Closed(200ms));
}

TEST(FetchTest, NamesTheAddressItCannotReach) {
  auto r = Fetch("127.0.0.1", 1, "GET", "/", {}, "", 1s);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("127.0.0.1:1"));
}

}  // namespace
}  // namespace shardserve::http
