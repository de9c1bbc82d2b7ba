#include "http/client.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "comm/socket.h"
#include "http/server.h"

namespace shardserve::http {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

class ClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Routes r;
    r.Get("/startupz", [](const Request&) {
      return Response{200, "application/json", R"({"state":"loading 41 %"})", {}};
    });
    r.Get("/big", [](const Request&) {
      return Response{200, "text/plain", std::string(9000, 'x'), {}};
    });
    ServerOptions o;
    o.host = "127.0.0.1";
    auto s = Server::Start(o, std::move(r));
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
  }
  std::unique_ptr<Server> server_;
};

TEST_F(ClientTest, GetsTheBodyOfA200) {
  auto body = Get("127.0.0.1", server_->port(), "/startupz", 2000ms, 4096);
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_EQ(*body, R"({"state":"loading 41 %"})");
}

// Every failure is an error that names the address and the path: another status, a body over
// the bound, a port nobody listens on, a peer that accepts and never answers, a host that is
// not an address.
TEST_F(ClientTest, FailuresAreNamedAndBounded) {
  auto missing = Get("127.0.0.1", server_->port(), "/nothing", 2000ms, 4096);
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("/nothing: answered 404"));

  auto big = Get("127.0.0.1", server_->port(), "/big", 2000ms, 4096);
  ASSERT_FALSE(big.ok());
  EXPECT_THAT(std::string(big.status().message()),
              HasSubstr("/big: an answer of more than 4096 bytes"));

  int closed_port;
  {
    auto probe = Listen("127.0.0.1", 0);
    ASSERT_TRUE(probe.ok());
    closed_port = probe->port();
  }
  auto refused = Get("127.0.0.1", closed_port, "/startupz", 2000ms, 4096);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("cannot connect"));

  auto silent = Listen("127.0.0.1", 0);  // the kernel accepts; nobody reads or answers
  ASSERT_TRUE(silent.ok());
  auto hung = Get("127.0.0.1", silent->port(), "/startupz", 300ms, 4096);
  ASSERT_FALSE(hung.ok());
  EXPECT_THAT(std::string(hung.status().message()),
              HasSubstr(absl::StrCat("http://127.0.0.1:", silent->port(), "/startupz: no answer")));

  auto name = Get("rank-0.example", 80, "/startupz", 300ms, 4096);
  ASSERT_FALSE(name.ok());
  EXPECT_THAT(std::string(name.status().message()), HasSubstr("not an IP address"));
}

}  // namespace
}  // namespace shardserve::http
