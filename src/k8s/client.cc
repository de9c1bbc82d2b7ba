#include "k8s/client.h"

#include <cpprest/containerstream.h>
#include <cpprest/http_client.h>

#include <boost/asio/ssl.hpp>
#include <thread>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "api/sharded_model.h"
#include "common/status.h"

namespace shardserve::k8s {
namespace {

constexpr char kCodePayload[] = "type.shardserve.io/k8s-code";
constexpr char kReasonPayload[] = "type.shardserve.io/k8s-reason";

std::string Encode(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      out += absl::StrFormat("%%%02X", c);
    }
  }
  return out;
}

int PayloadCode(const absl::Status& s) {
  auto p = s.GetPayload(kCodePayload);
  return p ? std::atoi(std::string(*p).c_str()) : 0;
}
std::string PayloadReason(const absl::Status& s) {
  auto p = s.GetPayload(kReasonPayload);
  return p ? std::string(*p) : std::string();
}

// The apiserver's error (a Status object in the body) as a Status naming the request.
absl::Status ApiError(int code, const std::string& body, const std::string& what) {
  std::string message = body, reason;
  try {
    const json j = json::parse(body);
    message = j.value("message", body);
    reason = j.value("reason", "");
  } catch (const json::exception&) {
  }
  absl::StatusCode sc = absl::StatusCode::kUnknown;
  switch (code) {
    case 400:
    case 422:
      sc = absl::StatusCode::kInvalidArgument;
      break;
    case 401:
      sc = absl::StatusCode::kUnauthenticated;
      break;
    case 403:
      sc = absl::StatusCode::kPermissionDenied;
      break;
    case 404:
      sc = absl::StatusCode::kNotFound;
      break;
    case 409:
      sc =
          reason == "AlreadyExists" ? absl::StatusCode::kAlreadyExists : absl::StatusCode::kAborted;
      break;
    case 410:
      sc = absl::StatusCode::kOutOfRange;
      break;
    case 429:
      sc = absl::StatusCode::kResourceExhausted;
      break;
    default:
      sc = code >= 500 ? absl::StatusCode::kUnavailable : absl::StatusCode::kUnknown;
  }
  if (code == 401 && message.empty()) message = "Unauthorized";
  absl::Status s(sc, absl::StrCat(what, ": ", code, " ", message));
  s.SetPayload(kCodePayload, absl::Cord(std::to_string(code)));
  s.SetPayload(kReasonPayload, absl::Cord(reason));
  return s;
}

web::http::http_request NewRequest(const std::string& method, const std::string& path,
                                   const std::string& token, const std::string& user_agent) {
  web::http::http_request req(method);
  req.set_request_uri(path);
  req.headers().add("Accept", "application/json");
  req.headers().add("User-Agent", user_agent);
  if (!token.empty()) req.headers().add("Authorization", "Bearer " + token);
  return req;
}

// The apiserver says only "Unauthorized"; say what was refused.
absl::Status Unauthenticated(const std::string& body, const std::string& what, bool certificate) {
  const absl::Status s = ApiError(401, body, what);
  absl::Status out(
      s.code(),
      absl::StrCat(s.message(), certificate
                                    ? " (the client certificate was not accepted by this cluster)"
                                    : " (the bearer token was refused: expired, revoked or "
                                      "not issued for this cluster)"));
  s.ForEachPayload(
      [&](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

}  // namespace

const ResourceType kPods{"", "v1", "pods", "Pod", true};
const ResourceType kNodes{"", "v1", "nodes", "Node", false};
const ResourceType kServices{"", "v1", "services", "Service", true};
const ResourceType kEvents{"", "v1", "events", "Event", true};
const ResourceType kNetworkPolicies{"networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy",
                                    true};
const ResourceType kLeases{"coordination.k8s.io", "v1", "leases", "Lease", true};
const ResourceType kSecrets{"", "v1", "secrets", "Secret", true};
const ResourceType kDeployments{"apps", "v1", "deployments", "Deployment", true};
const ResourceType kPodDisruptionBudgets{"policy", "v1", "poddisruptionbudgets",
                                         "PodDisruptionBudget", true};
const ResourceType kTokenReviews{"authentication.k8s.io", "v1", "tokenreviews", "TokenReview",
                                 false};
const ResourceType kSubjectAccessReviews{"authorization.k8s.io", "v1", "subjectaccessreviews",
                                         "SubjectAccessReview", false};
const ResourceType kShardedModels{kApiGroup, kApiGroupVersion, "shardedmodels", kShardedModelKind,
                                  true};

std::string ResourceType::Path(const std::string& ns, const std::string& name,
                               const std::string& subresource) const {
  std::string p = group.empty() ? "/api/" + version : "/apis/" + group + "/" + version;
  if (namespaced && !ns.empty()) absl::StrAppend(&p, "/namespaces/", ns);
  absl::StrAppend(&p, "/", plural);
  if (!name.empty()) absl::StrAppend(&p, "/", name);
  if (!subresource.empty()) absl::StrAppend(&p, "/", subresource);
  return p;
}

bool ApiNotFound(const absl::Status& s) { return PayloadCode(s) == 404; }
bool ApiAlreadyExists(const absl::Status& s) {
  return PayloadCode(s) == 409 && PayloadReason(s) == "AlreadyExists";
}
bool ApiConflict(const absl::Status& s) {
  return PayloadCode(s) == 409 && PayloadReason(s) != "AlreadyExists";
}
json MergePatchBetween(const json& from, const json& to) {
  if (!from.is_object() || !to.is_object()) return to;
  json patch = json::object();
  for (const auto& [key, old] : from.items()) {
    if (!to.contains(key)) patch[key] = nullptr;
  }
  for (const auto& [key, now] : to.items()) {
    const auto it = from.find(key);
    if (it == from.end()) {
      patch[key] = now;
    } else if (*it != now) {
      patch[key] = MergePatchBetween(*it, now);
    }
  }
  return patch;
}

bool ApiGone(const absl::Status& s) {
  return PayloadCode(s) == 410 || PayloadReason(s) == "Expired" || PayloadReason(s) == "Gone";
}

struct WatchCancel::Impl {
  pplx::cancellation_token_source source;
};
WatchCancel::WatchCancel() : impl_(std::make_unique<Impl>()) {}
WatchCancel::~WatchCancel() = default;
void WatchCancel::Cancel() { impl_->source.cancel(); }
bool WatchCancel::cancelled() const { return impl_->source.get_token().is_canceled(); }

struct Client::Impl {
  std::unique_ptr<web::http::client::http_client> http;   // requests
  std::unique_ptr<web::http::client::http_client> watch;  // long-lived streams
};

Client::Client(const KubeConfig& config, ClientOptions options)
    : config_(config),
      options_(std::move(options)),
      tokens_(config),
      impl_(std::make_unique<Impl>()),
      bucket_tokens_(options_.burst),
      bucket_time_(std::chrono::steady_clock::now()) {}

Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Create(const KubeConfig& config,
                                                       ClientOptions options) {
  if (config.server.rfind("https://", 0) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the API server '", config.server, "' must be https://"));
  }
  // Check the PEMs once here, so a bad certificate is a clear error and not a failed handshake.
  auto configure = [config](boost::asio::ssl::context& ctx) {
    ctx.set_verify_mode(boost::asio::ssl::verify_peer);
    if (config.ca_pem.empty()) {
      ctx.set_default_verify_paths();
    } else {
      ctx.add_certificate_authority(boost::asio::buffer(config.ca_pem));
    }
    if (!config.cert_pem.empty()) {
      ctx.use_certificate_chain(boost::asio::buffer(config.cert_pem));
      ctx.use_private_key(boost::asio::buffer(config.key_pem), boost::asio::ssl::context::pem);
    }
  };
  try {
    boost::asio::ssl::context probe(boost::asio::ssl::context::tls_client);
    configure(probe);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("the CA, client certificate or key of ",
                                                   config.server, " is not usable: ", e.what()));
  }
  std::unique_ptr<Client> c(new Client(config, std::move(options)));
  try {
    web::http::client::http_client_config hc;
    hc.set_validate_certificates(true);
    hc.set_ssl_context_callback(configure);
    hc.set_timeout(c->options_.timeout);
    c->impl_->http = std::make_unique<web::http::client::http_client>(config.server, hc);
    hc.set_timeout(std::chrono::seconds(600));
    c->impl_->watch = std::make_unique<web::http::client::http_client>(config.server, hc);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("API server ", config.server, ": ", e.what()));
  }
  return c;
}

absl::Status Client::Unreachable(const std::string& what, const std::string& error) const {
  const bool tls =
      error.find("SSL") != std::string::npos || error.find("certificate") != std::string::npos;
  return absl::UnavailableError(absl::StrCat(
      what, " to ", config_.server, " failed: ", error,
      tls ? " (TLS: the server's certificate does not verify against the configured CA, or the "
            "client certificate was refused)"
          : ""));
}

void Client::Throttle() {
  for (;;) {
    double wait;
    {
      absl::MutexLock lock(&bucket_mu_);
      const auto now = std::chrono::steady_clock::now();
      bucket_tokens_ = std::min<double>(
          options_.burst,
          bucket_tokens_ +
              options_.qps * std::chrono::duration<double>(now - bucket_time_).count());
      bucket_time_ = now;
      if (bucket_tokens_ >= 1) {
        bucket_tokens_ -= 1;
        return;
      }
      wait = (1 - bucket_tokens_) / options_.qps;
      throttled_ += wait;
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(wait));
  }
}

double Client::throttled_seconds() const {
  absl::MutexLock lock(&bucket_mu_);
  return throttled_;
}

absl::StatusOr<json> Client::Request(const std::string& method, const std::string& path,
                                     const json* body, const std::string& content_type) {
  const std::string what = absl::StrCat(method, " ", path);
  ASSIGN_OR_RETURN(std::string token, tokens_.Token());
  Throttle();
  ++requests_;
  try {
    web::http::http_request req = NewRequest(method, path, token, options_.user_agent);
    if (body != nullptr) req.set_body(body->dump(), content_type);
    const auto start = std::chrono::steady_clock::now();
    web::http::http_response resp = impl_->http->request(req).get();
    const std::string text = resp.extract_utf8string(true).get();
    if (trace_) {
      std::fprintf(
          stderr, "k8s: %s %d %.1f ms\n", what.c_str(), resp.status_code(),
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count());
    }
    if (resp.status_code() == 401) return Unauthenticated(text, what, token.empty());
    if (resp.status_code() >= 300) return ApiError(resp.status_code(), text, what);
    if (text.empty()) return json::object();
    return json::parse(text);
  } catch (const json::exception& e) {
    return absl::DataLossError(absl::StrCat(what, ": the answer is not JSON: ", e.what()));
  } catch (const std::exception& e) {
    return Unreachable(what, e.what());
  }
}

absl::StatusOr<json> Client::Get(const ResourceType& rt, const std::string& ns,
                                 const std::string& name, const std::string& subresource) {
  return Request("GET", rt.Path(ns, name, subresource));
}

absl::StatusOr<std::string> Client::ListPages(
    const ResourceType& rt, const std::string& ns, const ListOptions& o,
    const std::function<absl::Status(json& page)>& on_page) {
  std::string cont, rv;
  do {
    std::string q = absl::StrCat("?limit=", o.limit);
    if (!o.label_selector.empty()) absl::StrAppend(&q, "&labelSelector=", Encode(o.label_selector));
    if (!o.field_selector.empty()) absl::StrAppend(&q, "&fieldSelector=", Encode(o.field_selector));
    if (!cont.empty()) {
      absl::StrAppend(&q, "&continue=", Encode(cont));
    } else if (!o.resource_version.empty()) {
      absl::StrAppend(&q, "&resourceVersion=", Encode(o.resource_version));
    }
    ASSIGN_OR_RETURN(json page, Request("GET", rt.Path(ns) + q));
    cont = page["metadata"].value("continue", "");
    rv = page["metadata"].value("resourceVersion", "");
    RETURN_IF_ERROR(on_page(page));
  } while (!cont.empty());
  return rv;
}

absl::StatusOr<json> Client::List(const ResourceType& rt, const std::string& ns,
                                  const ListOptions& o) {
  json items = json::array();
  ASSIGN_OR_RETURN(std::string rv, ListPages(rt, ns, o, [&](json& page) {
                     for (json& item : page["items"]) items.push_back(std::move(item));
                     return absl::OkStatus();
                   }));
  return json{{"items", std::move(items)}, {"metadata", {{"resourceVersion", rv}}}};
}

absl::StatusOr<json> Client::Create(const ResourceType& rt, const std::string& ns,
                                    const json& object) {
  return Request("POST", rt.Path(ns), &object);
}

absl::StatusOr<json> Client::Apply(const ResourceType& rt, const std::string& ns,
                                   const json& object, bool force) {
  json obj = object;
  obj["apiVersion"] = rt.api_version();
  obj["kind"] = rt.kind;
  const std::string name = obj["metadata"].value("name", "");
  if (name.empty()) return absl::InvalidArgumentError("Apply: the object has no metadata.name");
  return Request("PATCH",
                 absl::StrCat(rt.Path(ns, name), "?fieldManager=", Encode(options_.field_manager),
                              force ? "&force=true" : ""),
                 &obj, "application/apply-patch+yaml");
}

absl::StatusOr<json> Client::MergePatch(const ResourceType& rt, const std::string& ns,
                                        const std::string& name, const json& patch,
                                        const std::string& subresource) {
  return Request("PATCH",
                 absl::StrCat(rt.Path(ns, name, subresource),
                              "?fieldManager=", Encode(options_.field_manager)),
                 &patch, "application/merge-patch+json");
}

absl::StatusOr<json> Client::UpdateStatus(const ResourceType& rt, const std::string& ns,
                                          const std::string& name,
                                          const std::function<bool(json& object)>& mutate,
                                          int attempts) {
  for (int i = 0; i < attempts; ++i) {
    ASSIGN_OR_RETURN(json obj, Get(rt, ns, name));
    if (!mutate(obj)) return obj;
    auto put = Request(
        "PUT",
        absl::StrCat(rt.Path(ns, name, "status"), "?fieldManager=", Encode(options_.field_manager)),
        &obj);
    if (put.ok() || !ApiConflict(put.status())) return put;
    // Someone wrote in between: read again, after a short jittered pause.
    std::this_thread::sleep_for(std::chrono::milliseconds(1 + (i * 7 + requests_.load()) % 10));
  }
  return absl::AbortedError(absl::StrCat("status of ", rt.plural, " ", ns, "/", name,
                                         " kept changing under ", attempts, " attempts"));
}

absl::Status Client::Delete(const ResourceType& rt, const std::string& ns, const std::string& name,
                            const std::string& uid, const std::string& resource_version,
                            const std::string& propagation) {
  json opts = {{"apiVersion", "v1"}, {"kind", "DeleteOptions"}};
  if (!uid.empty()) opts["preconditions"]["uid"] = uid;
  if (!resource_version.empty()) opts["preconditions"]["resourceVersion"] = resource_version;
  if (!propagation.empty()) opts["propagationPolicy"] = propagation;
  auto r = Request("DELETE", rt.Path(ns, name), &opts);
  if (!r.ok() && !ApiNotFound(r.status())) return r.status();
  return absl::OkStatus();
}

absl::Status Client::Watch(const ResourceType& rt, const std::string& ns, const WatchOptions& o,
                           const WatchHandler& handler, const WatchCancel* cancel) {
  std::string path = absl::StrCat(rt.Path(ns), "?watch=1&timeoutSeconds=", o.timeout_seconds);
  if (o.bookmarks) absl::StrAppend(&path, "&allowWatchBookmarks=true");
  if (!o.resource_version.empty()) {
    absl::StrAppend(&path, "&resourceVersion=", Encode(o.resource_version));
  }
  if (!o.label_selector.empty())
    absl::StrAppend(&path, "&labelSelector=", Encode(o.label_selector));
  if (!o.field_selector.empty())
    absl::StrAppend(&path, "&fieldSelector=", Encode(o.field_selector));
  const std::string what = "WATCH " + path;
  ASSIGN_OR_RETURN(std::string token, tokens_.Token());
  Throttle();
  ++requests_;
  try {
    web::http::http_request req = NewRequest("GET", path, token, options_.user_agent);
    const pplx::cancellation_token cancel_token =
        cancel != nullptr ? cancel->impl()->source.get_token() : pplx::cancellation_token::none();
    web::http::http_response resp = impl_->watch->request(req, cancel_token).get();
    if (resp.status_code() == 401) {
      return Unauthenticated(resp.extract_utf8string(true).get(), what, token.empty());
    }
    if (resp.status_code() >= 300) {
      return ApiError(resp.status_code(), resp.extract_utf8string(true).get(), what);
    }
    concurrency::streams::istream body = resp.body();
    for (;;) {
      concurrency::streams::container_buffer<std::string> line;
      const size_t n = body.read_line(line).get();
      if (n == 0 && body.is_eof()) return absl::OkStatus();  // the server ended the stream
      if (line.collection().empty()) continue;
      const json event = json::parse(line.collection());
      const std::string type = event.value("type", "");
      const json& object = event["object"];
      if (type == "ERROR") {
        return ApiError(object.value("code", 500), object.dump(), what);
      }
      if (!handler(type, object)) return absl::OkStatus();
    }
  } catch (const json::exception& e) {
    return absl::DataLossError(absl::StrCat(what, ": a malformed event: ", e.what()));
  } catch (const pplx::task_canceled&) {
    return absl::CancelledError(what + ": cancelled");
  } catch (const std::exception& e) {
    if (cancel != nullptr && cancel->cancelled()) return absl::CancelledError(what + ": cancelled");
    return Unreachable(what, e.what());
  }
}

}  // namespace shardserve::k8s
