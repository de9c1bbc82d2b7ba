#include "source/http.h"

#include <curl/curl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace shardserve::source {
namespace {

void GlobalInit() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

struct Transfer {
  HttpResponse* response;
  const HttpRequest* request;
  int fd = -1;
  int64_t offset = 0;
  int64_t max_bytes = 0;  // to the file
  std::atomic<int64_t>* received = nullptr;
  bool too_big = false;
  int write_errno = 0;
};

size_t OnHeader(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const std::string line(data, size * n);
  if (line.rfind("HTTP/", 0) == 0) {  // a status line: a redirect's or a 100's are not the answer
    const size_t sp = line.find(' ');
    t->response->status = sp == std::string::npos ? 0 : std::atol(line.c_str() + sp + 1);
    t->response->headers.clear();
    return size * n;
  }
  const size_t colon = line.find(':');
  if (colon != std::string::npos && t->response->headers.size() < 256) {
    std::string name = absl::AsciiStrToLower(line.substr(0, colon));
    std::string value(absl::StripAsciiWhitespace(line.substr(colon + 1)));
    if (name.size() <= 256 && value.size() <= 8192) t->response->headers[name] = value;
  }
  return size * n;
}

size_t OnBody(char* data, size_t size, size_t n, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t bytes = size * n;
  const bool to_file = t->fd >= 0 && (t->response->status == 200 || t->response->status == 206);
  if (!to_file) {
    if (t->response->body.size() + bytes > t->request->max_body) {
      t->too_big = true;
      return 0;  // aborts the transfer
    }
    t->response->body.append(data, bytes);
    return bytes;
  }
  if (static_cast<int64_t>(bytes) > t->max_bytes) {
    t->too_big = true;
    return 0;
  }
  t->max_bytes -= static_cast<int64_t>(bytes);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t w = ::pwrite(t->fd, data + done, bytes - done, t->offset);
    if (w < 0) {
      if (errno == EINTR) continue;
      t->write_errno = errno;
      return 0;
    }
    done += static_cast<size_t>(w);
    t->offset += w;
  }
  t->response->written += static_cast<int64_t>(bytes);
  if (t->received != nullptr) *t->received += static_cast<int64_t>(bytes);
  return bytes;
}

absl::StatusOr<HttpResponse> Run(const HttpRequest& req, int fd, int64_t offset, int64_t max_bytes,
                                 std::atomic<int64_t>* received) {
  GlobalInit();
  std::unique_ptr<CURL, decltype(&curl_easy_cleanup)> curl(curl_easy_init(), curl_easy_cleanup);
  if (!curl) return absl::InternalError("libcurl: cannot make a handle");
  HttpResponse response;
  Transfer t{&response, &req, fd, offset, max_bytes, received};
  CURL* c = curl.get();
  curl_easy_setopt(c, CURLOPT_URL, req.url.c_str());
  curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(c, CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 1L);
  curl_easy_setopt(c, CURLOPT_MAXREDIRS, 5L);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, static_cast<long>(req.connect_timeout_s));
  curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1024L);
  curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, static_cast<long>(req.stall_timeout_s));
  curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, OnHeader);
  curl_easy_setopt(c, CURLOPT_HEADERDATA, &t);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, OnBody);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &t);
  if (req.head) curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
  std::string range;
  if (req.range_begin >= 0) {
    range =
        absl::StrCat(req.range_begin, "-", req.range_end >= 0 ? absl::StrCat(req.range_end) : "");
    curl_easy_setopt(c, CURLOPT_RANGE, range.c_str());
  }
  if (!req.aws_sigv4.empty()) {
    curl_easy_setopt(c, CURLOPT_AWS_SIGV4, req.aws_sigv4.c_str());
    curl_easy_setopt(c, CURLOPT_USERPWD, req.user.c_str());
  }
  curl_slist* headers = nullptr;
  for (const std::string& h : req.headers) headers = curl_slist_append(headers, h.c_str());
  std::unique_ptr<curl_slist, decltype(&curl_slist_free_all)> keep(headers, curl_slist_free_all);
  if (headers != nullptr) curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
  const CURLcode rc = curl_easy_perform(c);
  if (t.too_big) {
    return absl::ResourceExhaustedError(absl::StrCat(
        req.url, ": the answer is longer than ",
        fd >= 0 ? static_cast<int64_t>(max_bytes) : static_cast<int64_t>(req.max_body), " bytes"));
  }
  if (t.write_errno != 0) {
    return absl::InternalError(
        absl::StrCat(req.url, ": writing what came: ", std::strerror(t.write_errno)));
  }
  if (rc != CURLE_OK) {
    return absl::UnavailableError(absl::StrCat(req.url, ": ", curl_easy_strerror(rc)));
  }
  long status = 0;
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
  response.status = status;
  return response;
}

}  // namespace

absl::StatusOr<HttpResponse> Fetch(const HttpRequest& req) { return Run(req, -1, 0, 0, nullptr); }

absl::StatusOr<HttpResponse> FetchToFile(const HttpRequest& req, int fd, int64_t offset,
                                         int64_t max_bytes, std::atomic<int64_t>* received) {
  return Run(req, fd, offset, max_bytes, received);
}

absl::Status HttpError(const HttpResponse& r, const std::string& what) {
  if (r.status >= 200 && r.status < 300) return absl::OkStatus();
  // The server's own words, bounded: S3's <Code> and <Message> out of its XML, else the body.
  auto tag = [&](const char* name) -> std::string {
    const std::string open = absl::StrCat("<", name, ">"), close = absl::StrCat("</", name, ">");
    const size_t a = r.body.find(open);
    const size_t b = a == std::string::npos ? a : r.body.find(close, a);
    return b == std::string::npos ? "" : r.body.substr(a + open.size(), b - a - open.size());
  };
  std::string said = tag("Code").empty() ? r.body : absl::StrCat(tag("Code"), ": ", tag("Message"));
  said = said.substr(0, 300);
  for (char& ch : said) {
    if (ch == '\n' || ch == '\r') ch = ' ';
  }
  const std::string message =
      absl::StrCat(what, ": HTTP ", r.status, said.empty() ? "" : absl::StrCat(" (", said, ")"));
  if (r.status == 401 || r.status == 403) return absl::PermissionDeniedError(message);
  if (r.status == 404) return absl::NotFoundError(message);
  if (r.status == 416) return absl::OutOfRangeError(message);
  if (r.status == 429 || r.status >= 500) return absl::UnavailableError(message);
  return absl::UnknownError(message);
}

std::string UriEscape(const std::string& s, bool keep_slash) {
  std::string out;
  for (unsigned char ch : s) {
    if (absl::ascii_isalnum(ch) || ch == '-' || ch == '_' || ch == '.' || ch == '~' ||
        (keep_slash && ch == '/')) {
      out.push_back(static_cast<char>(ch));
    } else {
      absl::StrAppendFormat(&out, "%%%02X", ch);
    }
  }
  return out;
}

}  // namespace shardserve::source
