#include "http/upstream.h"

#include <array>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <limits>
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace shardserve::http {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;
using error_code = boost::system::error_code;

struct UpstreamCall::Impl {
  asio::io_context io{1};
  tcp::socket socket{io};
  beast::flat_buffer buffer;
  bhttp::response_parser<bhttp::buffer_body> parser;
  std::array<char, 64 << 10> piece;
  bool pending = false;  // a body read is outstanding (it outlives a Read that timed out)
  bool finished = false;
  error_code ec;
  std::string where;  // "METHOD http://host:port/target"

  // Runs the io until `finished` or `timeout`.
  bool RunFor(std::chrono::milliseconds timeout) {
    io.restart();
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!finished && std::chrono::steady_clock::now() < deadline) {
      io.run_one_until(deadline);
      if (io.stopped()) io.restart();
    }
    return finished;
  }
};

UpstreamCall::UpstreamCall(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

UpstreamCall::~UpstreamCall() { Close(); }

void UpstreamCall::Close() {
  if (!impl_) return;
  error_code ignored;
  impl_->socket.shutdown(tcp::socket::shutdown_both, ignored);
  impl_->socket.close(ignored);
}

absl::StatusOr<std::unique_ptr<UpstreamCall>> UpstreamCall::Start(
    const std::string& host, int port, const std::string& method, const std::string& target,
    const Headers& headers, const std::string& body, std::chrono::milliseconds connect_timeout,
    std::chrono::milliseconds head_timeout) {
  auto impl = std::make_unique<Impl>();
  Impl& c = *impl;
  c.where = absl::StrCat(method, " http://", host, ":", port, target);
  c.parser.header_limit(16 << 10);
  c.parser.body_limit(std::numeric_limits<std::uint64_t>::max());
  bhttp::request<bhttp::string_body> req(bhttp::string_to_verb(method), target, 11);
  req.set(bhttp::field::host, absl::StrCat(host, ":", port));
  for (const auto& [k, v] : headers) req.set(k, v);
  req.body() = body;
  req.prepare_payload();
  tcp::resolver resolver(c.io);
  c.ec = asio::error::timed_out;
  auto fail = [&](absl::StatusCode code, const std::string& why) {
    error_code ignored;
    resolver.cancel();
    c.socket.close(ignored);
    c.io.restart();
    c.io.run_for(std::chrono::milliseconds(50));  // let the handlers unwind
    return absl::Status(code, absl::StrCat(c.where, ": ", why));
  };
  resolver.async_resolve(host, std::to_string(port), [&](error_code ec, auto endpoints) {
    if (ec) return void((c.ec = ec, c.finished = true));
    asio::async_connect(c.socket, endpoints, [&](error_code ec, const auto&) {
      if (ec) return void((c.ec = ec, c.finished = true));
      bhttp::async_write(c.socket, req, [&](error_code ec, size_t) {
        c.ec = ec;
        c.finished = true;
      });
    });
  });
  if (!c.RunFor(connect_timeout) || c.ec) {
    return fail(absl::StatusCode::kUnavailable,
                c.finished ? c.ec.message() : "no connection in time");
  }
  c.finished = false;
  bhttp::async_read_header(c.socket, c.buffer, c.parser, [&](error_code ec, size_t) {
    c.ec = ec;
    c.finished = true;
  });
  if (!c.RunFor(head_timeout))
    return fail(absl::StatusCode::kDeadlineExceeded, "no answer in time");
  if (c.ec) return fail(absl::StatusCode::kAborted, c.ec.message());
  std::unique_ptr<UpstreamCall> call(new UpstreamCall(std::move(impl)));
  const auto& msg = call->impl_->parser.get();
  call->head_.status = static_cast<int>(msg.result_int());
  for (const auto& f : msg) {
    std::string name = absl::AsciiStrToLower(std::string(f.name_string()));
    if (name == "content-type") call->head_.content_type = std::string(f.value());
    call->head_.headers.emplace_back(std::move(name), std::string(f.value()));
  }
  return call;
}

absl::StatusOr<std::string> UpstreamCall::Read(std::chrono::milliseconds timeout, bool* done) {
  Impl& c = *impl_;
  *done = false;
  if (c.parser.is_done()) {
    *done = true;
    return std::string();
  }
  if (!c.pending) {
    c.parser.get().body().data = c.piece.data();
    c.parser.get().body().size = c.piece.size();
    c.pending = true;
    c.finished = false;
    bhttp::async_read_some(c.socket, c.buffer, c.parser, [&c](error_code ec, size_t) {
      c.ec = ec;
      c.finished = true;
    });
  }
  if (!c.RunFor(timeout)) {
    return absl::DeadlineExceededError(
        absl::StrCat(c.where, ": nothing within ", timeout.count(), " ms"));
  }
  c.pending = false;
  if (c.ec && c.ec != bhttp::error::need_buffer) {
    return absl::UnavailableError(absl::StrCat(c.where, ": ", c.ec.message()));
  }
  const size_t n = c.piece.size() - c.parser.get().body().size;
  *done = c.parser.is_done();
  return std::string(c.piece.data(), n);
}

}  // namespace shardserve::http
