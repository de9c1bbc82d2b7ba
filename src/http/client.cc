#include "http/client.h"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardserve::http {

namespace asio = boost::asio;
namespace beast = boost::beast;

namespace {

absl::StatusOr<std::string> GetOrThrow(const std::string& host, int port, const std::string& path,
                                       std::chrono::milliseconds timeout, size_t max_body_bytes) {
  const std::string where = absl::StrCat("http://", host, ":", port, path);
  auto failed = [&](const std::string& what, const beast::error_code& ec) {
    return absl::UnavailableError(absl::StrCat(where, ": ", what, ": ", ec.message()));
  };
  asio::io_context io;
  beast::error_code ec;
  const asio::ip::address address = asio::ip::make_address(host, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat(where, ": not an IP address"));
  beast::tcp_stream stream(io);
  stream.expires_after(timeout);
  const asio::ip::tcp::endpoint endpoint(address, static_cast<unsigned short>(port));
  // The stream's deadline bounds every step; the asynchronous calls are what honour it.
  stream.async_connect(endpoint, [&](const beast::error_code& e) { ec = e; });
  io.run();
  if (ec) return failed("cannot connect", ec);
  beast::http::request<beast::http::empty_body> req(beast::http::verb::get, path, 11);
  req.set(beast::http::field::host, host);
  req.set(beast::http::field::connection, "close");
  io.restart();
  beast::http::async_write(stream, req, [&](const beast::error_code& e, size_t) { ec = e; });
  io.run();
  if (ec) return failed("cannot send the request", ec);
  beast::flat_buffer buffer;
  beast::http::response_parser<beast::http::string_body> parser;
  parser.header_limit(8 * 1024);
  parser.body_limit(max_body_bytes);
  auto read = [&](auto&& how) -> absl::Status {
    io.restart();
    how([&](const beast::error_code& e, size_t) { ec = e; });
    io.run();
    if (ec == beast::http::error::body_limit) {
      return absl::UnavailableError(
          absl::StrCat(where, ": an answer of more than ", max_body_bytes, " bytes"));
    }
    return ec ? failed("no answer", ec) : absl::OkStatus();
  };
  // The head first: the parser checks a declared length against its limit there.
  RETURN_IF_ERROR(read(
      [&](auto done) { beast::http::async_read_header(stream, buffer, parser, std::move(done)); }));
  RETURN_IF_ERROR(
      read([&](auto done) { beast::http::async_read(stream, buffer, parser, std::move(done)); }));
  const auto& res = parser.get();
  if (res.body().size() > max_body_bytes) {  // a backstop: the parser bounds it
    return absl::UnavailableError(
        absl::StrCat(where, ": an answer of more than ", max_body_bytes, " bytes"));
  }
  if (res.result_int() != 200) {
    return absl::UnavailableError(absl::StrCat(where, ": answered ", res.result_int()));
  }
  return res.body();
}

}  // namespace

absl::StatusOr<std::string> Get(const std::string& host, int port, const std::string& path,
                                std::chrono::milliseconds timeout, size_t max_body_bytes) {
  try {
    return GetOrThrow(host, port, path, timeout, max_body_bytes);
  } catch (const std::exception& e) {  // resources (sockets, memory) Asio could not get
    return absl::UnavailableError(absl::StrCat("http://", host, ":", port, path, ": ", e.what()));
  }
}

}  // namespace shardserve::http
