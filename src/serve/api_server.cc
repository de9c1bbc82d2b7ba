#include "serve/api_server.h"

#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>
#include <sys/socket.h>

#include <cstdlib>
#include <filesystem>
#include <random>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "metrics/rank_metrics.h"
#include "model/tokenizer.h"
#include "serve/chat_template.h"
#include "serve/openai.h"
#include "serve/text_stream.h"

namespace shardserve {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
constexpr auto kPoll = std::chrono::milliseconds(50);
constexpr int kMaxNesting = 64;

absl::StatusOr<int64_t> EnvInt(const char* name, int64_t def, int64_t min) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return def;
  int64_t out;
  if (!absl::SimpleAtoi(v, &out) || out < min) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", name, "='", v, "' must be an integer >= ", min));
  }
  return out;
}

// Deeper JSON than any request needs is refused before parsing.
bool TooDeep(const std::string& body) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxNesting) return true;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return false;
}

// cpp-httplib does not give handlers their socket; the accepted connection is the one whose
// local and remote ports are the request's. Used to notice a client that went away while a
// non-streamed answer is being generated.
int FindConnection(const httplib::Request& req) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    int fd;
    if (!absl::SimpleAtoi(entry.path().filename().string(), &fd)) continue;
    sockaddr_storage local{}, peer{};
    socklen_t ll = sizeof(local), pl = sizeof(peer);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) != 0) continue;
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0) continue;
    auto port_of = [](const sockaddr_storage& a) -> int {
      if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port);
      if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
      return -1;
    };
    if (port_of(local) == req.local_port && port_of(peer) == req.remote_port) return fd;
  }
  return -1;
}

bool PeerGone(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, POLLRDHUP, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

std::string RequestId(const char* prefix) {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(rng()));
  return absl::StrCat(prefix, buf);
}

json Bytes(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

// One prompt's sequence as the API reports it.
struct Choice {
  Choice(std::shared_ptr<RequestStream> s, TextStream t, int64_t prompt)
      : stream(std::move(s)), text(std::move(t)), prompt_tokens(prompt) {}
  std::shared_ptr<RequestStream> stream;
  TextStream text;
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  std::string finish_reason;  // set when done
  absl::Status error;
  bool done = false;
  bool sent_role = false;
  // Log-probabilities: completions form (tokens, token_logprobs, top_logprobs, text_offset) or
  // chat form (content entries), filled as tokens arrive.
  json lp_tokens = json::array(), lp_values = json::array(), lp_top = json::array(),
       lp_offsets = json::array(), lp_content = json::array();
  std::string all_text;
};

// What one poll of a choice's stream adds.
struct ChoiceDelta {
  std::string text;
  json logprobs;  // null unless requested and tokens arrived
  bool finished = false;
};

}  // namespace

struct ApiServer::Impl {
  ServeConfig config;
  std::unique_ptr<Tokenizer> tokenizer;
  ChatTemplate chat;
  httplib::Server http;
  std::thread listener;
  std::shared_ptr<prometheus::Registry> own_registry = std::make_shared<prometheus::Registry>();
  std::unique_ptr<LeaderMetrics> metrics;
  std::mutex registry_mu;
  std::shared_ptr<prometheus::Registry> rank_registry;
  std::shared_mutex engine_mu;
  Engine* engine = nullptr;  // guarded by engine_mu
  std::string not_ready =
      "the model replica is starting: waiting for every rank to connect and "
      "load";  // guarded by engine_mu
  std::atomic<int> active{0};
  int64_t max_context = 0;

  std::string TokenText(int32_t id) const { return tokenizer->Decode({id}, false); }

  void Reply(httplib::Response& res, const absl::Status& s) {
    const int code = HttpStatusFor(s);
    res.status = code;
    if (code == 429 || code == 503) res.set_header("Retry-After", "1");
    res.set_content(DumpJson(ErrorBody(s)), "application/json");
    metrics->CountRequest(code);
  }

  ChoiceDelta Poll(Choice& c, const ApiRequest& req, std::chrono::milliseconds wait) {
    ChoiceDelta d;
    if (c.done) return d;
    RequestStream::Update u = c.stream->Next(wait);
    std::vector<int32_t> ids;
    for (const auto& t : u.tokens) ids.push_back(t.id);
    TextStream::Delta td = c.text.Add(ids);
    c.completion_tokens += static_cast<int64_t>(u.tokens.size());
    if (req.logprobs && !u.tokens.empty()) {
      json content = json::array();
      const size_t first_offset = c.lp_tokens.size();
      for (size_t i = 0; i < u.tokens.size(); ++i) {
        const auto& t = u.tokens[i];
        const std::string& piece = td.token_texts[i];
        if (req.chat) {
          json top = json::array();
          for (const TokenLogprob& a : t.top) {
            const std::string s = TokenText(a.id);
            top.push_back({{"token", s}, {"logprob", a.logprob}, {"bytes", Bytes(s)}});
          }
          content.push_back({{"token", piece},
                             {"logprob", t.logprob},
                             {"bytes", Bytes(piece)},
                             {"top_logprobs", top}});
        } else {
          json top = json::object();
          for (const TokenLogprob& a : t.top) top[TokenText(a.id)] = a.logprob;
          if (t.top.empty()) top[piece] = t.logprob;
          c.lp_tokens.push_back(piece);
          c.lp_values.push_back(t.logprob);
          c.lp_top.push_back(top);
          c.lp_offsets.push_back(c.all_text.size());
        }
        c.all_text += piece;
      }
      if (req.chat) {
        for (json& e : content) c.lp_content.push_back(e);
        d.logprobs = {{"content", content}};
      } else {
        auto slice = [&](const json& a) {
          return json(std::vector<json>(a.begin() + first_offset, a.end()));
        };
        d.logprobs = {{"tokens", slice(c.lp_tokens)},
                      {"token_logprobs", slice(c.lp_values)},
                      {"top_logprobs", slice(c.lp_top)},
                      {"text_offset", slice(c.lp_offsets)}};
      }
    }
    d.text = std::move(td.text);
    if (td.stopped) {
      c.stream->Cancel();  // a stop string ends it; the engine frees its slot
      c.finish_reason = "stop";
      c.done = d.finished = true;
    } else if (u.finished) {
      c.done = d.finished = true;
      if (!u.status.ok()) {
        c.error = u.status;
      } else {
        // Held-back text (an incomplete character at the end) belongs to the last token.
        const std::string rest = c.text.Flush();
        d.text += rest;
        if (!rest.empty() && !c.lp_tokens.empty()) {
          c.lp_tokens.back() = c.lp_tokens.back().get<std::string>() + rest;
        }
        if (!rest.empty() && !c.lp_content.empty()) {
          c.lp_content.back()["token"] = c.lp_content.back()["token"].get<std::string>() + rest;
        }
        c.finish_reason = u.finish_reason;
      }
    }
    return d;
  }

  json Usage(const std::vector<Choice>& choices) const {
    int64_t p = 0, g = 0;
    for (const Choice& c : choices) {
      p += c.prompt_tokens;
      g += c.completion_tokens;
    }
    return {{"prompt_tokens", p}, {"completion_tokens", g}, {"total_tokens", p + g}};
  }

  // Tokenizes and submits every prompt of the request; on failure nothing stays queued.
  absl::Status Submit(ApiRequest& req, std::vector<Choice>& choices) {
    std::vector<std::vector<int32_t>> prompts;
    if (req.chat) {
      ASSIGN_OR_RETURN(std::string text, chat.Render(req.messages));
      ASSIGN_OR_RETURN(auto ids, tokenizer->Encode(text, /*add_special_tokens=*/false));
      prompts.push_back(std::move(ids));
      for (int64_t id : chat.end_of_turn_ids()) req.params.stop_token_ids.push_back(id);
    } else {
      for (size_t i = 0; i < req.prompt_ids.size(); ++i) {
        if (!req.prompt_ids[i].empty()) {
          prompts.push_back(req.prompt_ids[i]);
        } else {
          ASSIGN_OR_RETURN(auto ids, tokenizer->Encode(req.prompt_texts[i]));
          prompts.push_back(std::move(ids));
        }
      }
    }
    std::shared_lock<std::shared_mutex> lock(engine_mu);
    if (engine == nullptr) return absl::UnavailableError(not_ready);
    for (const auto& ids : prompts) {
      GenerationRequest g;
      g.prompt_ids = ids;
      g.params = req.params;
      const int64_t n = static_cast<int64_t>(ids.size());
      if (n >= max_context) {
        return BadParam(req.chat ? "messages" : "prompt",
                        absl::StrCat("this model's maximum context length is ", max_context,
                                     " tokens; the prompt holds ", n));
      }
      if (!req.max_tokens_set && req.chat) g.params.max_tokens = max_context - n;
      auto stream = engine->Submit(g);
      if (!stream.ok()) {
        for (Choice& c : choices) c.stream->Cancel();
        choices.clear();
        const absl::Status& s = stream.status();
        return s.code() == absl::StatusCode::kInvalidArgument && ErrorParam(s).empty()
                   ? BadParam("max_tokens", std::string(s.message()))
                   : s;
      }
      choices.emplace_back(*std::move(stream), TextStream(tokenizer.get(), req.stop), n);
    }
    return absl::OkStatus();
  }

  json ChunkHeader(const ApiRequest& req, const std::string& id, int64_t created) const {
    return {{"id", id},
            {"object", req.chat ? "chat.completion.chunk" : "text_completion"},
            {"created", created},
            {"model", config.model_name}};
  }

  void Generate(const httplib::Request& http_req, httplib::Response& res, bool chat) {
    if (TooDeep(http_req.body)) {
      return Reply(res, BadParam("", absl::StrCat("the request body nests deeper than ",
                                                  kMaxNesting, " levels")));
    }
    json body;
    try {
      body = json::parse(http_req.body);
    } catch (const json::exception& e) {
      return Reply(res,
                   BadParam("", absl::StrCat("the request body is not valid JSON: ", e.what())));
    }
    auto parsed = ParseApiRequest(body, chat);
    if (!parsed.ok()) return Reply(res, parsed.status());
    auto req = std::make_shared<ApiRequest>(*std::move(parsed));
    if (req->model != config.model_name) {
      absl::Status s = absl::NotFoundError(absl::StrCat("the model '", req->model,
                                                        "' does not exist; this server serves '",
                                                        config.model_name, "'"));
      s.SetPayload("type.shardserve.io/param", absl::Cord("model"));
      return Reply(res, s);
    }
    if (!req->seed_set)
      req->params.seed = std::random_device{}() * 4294967296ull + std::random_device{}();
    auto choices = std::make_shared<std::vector<Choice>>();
    if (absl::Status s = Submit(*req, *choices); !s.ok()) return Reply(res, s);
    const std::string id = RequestId(chat ? "chatcmpl-" : "cmpl-");
    const int64_t created = std::chrono::duration_cast<std::chrono::seconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count();
    if (!req->stream) return Answer(http_req, res, *req, *choices, id, created);
    metrics->CountRequest(200);
    ++active;
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, req, choices, id, created](size_t, httplib::DataSink& sink) {
          return Stream(*req, *choices, id, created, sink);
        },
        [this, choices](bool) {
          for (Choice& c : *choices) c.stream->Cancel();
          --active;
        });
  }

  // A non-streamed answer: waits for every choice, cancelling them if the client goes away.
  void Answer(const httplib::Request& http_req, httplib::Response& res, const ApiRequest& req,
              std::vector<Choice>& choices, const std::string& id, int64_t created) {
    ++active;
    const int fd = FindConnection(http_req);
    std::vector<std::string> texts(choices.size());
    std::vector<json> logprobs(choices.size());
    for (;;) {
      bool all_done = true;
      for (size_t i = 0; i < choices.size(); ++i) {
        ChoiceDelta d = Poll(choices[i], req, all_done ? kPoll : std::chrono::milliseconds(0));
        texts[i] += d.text;
        all_done &= choices[i].done;
      }
      if (all_done) break;
      if (PeerGone(fd)) {
        for (Choice& c : choices) c.stream->Cancel();
        --active;
        res.status = 499;  // the client closed the request; nobody reads this
        metrics->CountRequest(499);
        return;
      }
    }
    --active;
    for (const Choice& c : choices) {
      if (!c.error.ok()) return Reply(res, c.error);
    }
    json out_choices = json::array();
    for (size_t i = 0; i < choices.size(); ++i) {
      const Choice& c = choices[i];
      json lp = nullptr;
      if (req.logprobs) {
        lp = req.chat ? json{{"content", c.lp_content}}
                      : json{{"tokens", c.lp_tokens},
                             {"token_logprobs", c.lp_values},
                             {"top_logprobs", c.lp_top},
                             {"text_offset", c.lp_offsets}};
      }
      json choice = {{"index", i}, {"logprobs", lp}, {"finish_reason", c.finish_reason}};
      if (req.chat) {
        choice["message"] = {{"role", "assistant"}, {"content", texts[i]}};
      } else {
        choice["text"] = texts[i];
      }
      out_choices.push_back(std::move(choice));
    }
    json out = {{"id", id},
                {"object", req.chat ? "chat.completion" : "text_completion"},
                {"created", created},
                {"model", config.model_name},
                {"choices", out_choices},
                {"usage", Usage(choices)}};
    res.status = 200;
    res.set_content(DumpJson(out), "application/json");
    metrics->CountRequest(200);
  }

  // Server-sent events until every choice is done, the client leaves (false), or the replica
  // fails (an error event).
  bool Stream(const ApiRequest& req, std::vector<Choice>& choices, const std::string& id,
              int64_t created, httplib::DataSink& sink) {
    auto send = [&](const json& event) {
      const std::string line = absl::StrCat("data: ", DumpJson(event), "\n\n");
      return sink.write(line.data(), line.size());
    };
    bool all_done = false;
    while (!all_done) {
      if (!sink.is_writable()) return false;  // gone: the release callback cancels
      all_done = true;
      bool waited = false;
      for (size_t i = 0; i < choices.size(); ++i) {
        Choice& c = choices[i];
        if (c.done) continue;
        ChoiceDelta d = Poll(c, req, waited ? std::chrono::milliseconds(0) : kPoll);
        waited = true;
        if (!c.error.ok()) {
          send(ErrorBody(c.error));
          sink.done();
          return true;
        }
        all_done &= c.done;
        json choice = {{"index", i},
                       {"logprobs", d.logprobs.is_null() ? json(nullptr) : d.logprobs},
                       {"finish_reason", d.finished ? json(c.finish_reason) : json(nullptr)}};
        if (req.chat) {
          json delta = json::object();
          if (!c.sent_role) delta["role"] = "assistant";
          if (!d.text.empty() || !c.sent_role) delta["content"] = d.text;
          c.sent_role = true;
          if (delta.empty() && !d.finished && d.logprobs.is_null()) continue;
          choice["delta"] = delta;
        } else {
          if (d.text.empty() && !d.finished && d.logprobs.is_null()) continue;
          choice["text"] = d.text;
        }
        json event = ChunkHeader(req, id, created);
        event["choices"] = json::array({choice});
        if (!send(event)) return false;
      }
    }
    if (req.include_usage) {
      json event = ChunkHeader(req, id, created);
      event["choices"] = json::array();
      event["usage"] = Usage(choices);
      if (!send(event)) return false;
    }
    const std::string done = "data: [DONE]\n\n";
    sink.write(done.data(), done.size());
    sink.done();
    return true;
  }
};

absl::StatusOr<ServeConfig> ServeConfigFromEnv(ServeConfig c) {
  if (const char* host = std::getenv("SHARDSERVE_API_HOST"); host && *host) c.host = host;
  ASSIGN_OR_RETURN(int64_t port, EnvInt("SHARDSERVE_API_PORT", c.port, 0));
  ASSIGN_OR_RETURN(int64_t batch, EnvInt("SHARDSERVE_MAX_BATCH_SIZE", c.max_batch, 1));
  ASSIGN_OR_RETURN(int64_t queue, EnvInt("SHARDSERVE_MAX_QUEUE", c.max_queue, 0));
  ASSIGN_OR_RETURN(c.max_step_tokens, EnvInt("SHARDSERVE_MAX_STEP_TOKENS", c.max_step_tokens, 1));
  ASSIGN_OR_RETURN(int64_t body, EnvInt("SHARDSERVE_MAX_BODY_BYTES",
                                        static_cast<int64_t>(c.max_body_bytes), 1024));
  ASSIGN_OR_RETURN(c.drain_seconds, EnvInt("SHARDSERVE_DRAIN_SECONDS", c.drain_seconds, 0));
  c.port = static_cast<int>(port);
  c.max_batch = static_cast<int>(batch);
  c.max_queue = static_cast<int>(queue);
  c.max_body_bytes = static_cast<size_t>(body);
  return c;
}

ApiServer::ApiServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ApiServer::~ApiServer() { Stop(std::chrono::milliseconds(0)); }

absl::StatusOr<std::unique_ptr<ApiServer>> ApiServer::Start(const ServeConfig& config) {
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  ASSIGN_OR_RETURN(impl->tokenizer, Tokenizer::Load(config.model_dir));
  impl->chat = ChatTemplate::ForModel(config.model_dir, *impl->tokenizer);
  impl->metrics = std::make_unique<LeaderMetrics>(
      *impl->own_registry, config.metrics_model.empty() ? config.model_name : config.metrics_model,
      config.replica);
  Impl* s = impl.get();
  httplib::Server& http = s->http;
  const size_t threads = static_cast<size_t>(config.max_batch + config.max_queue + 16);
  http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  http.set_payload_max_length(config.max_body_bytes);
  http.set_keep_alive_timeout(5);
  http.set_error_handler([s](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    const std::string what =
        res.status == 413
            ? absl::StrCat("the request body exceeds ", s->config.max_body_bytes, " bytes")
            : absl::StrCat("no such endpoint: ", req.method, " ", req.path);
    const absl::Status st =
        res.status == 413 ? absl::InvalidArgumentError(what) : absl::NotFoundError(what);
    json body = ErrorBody(st);
    body["error"]["code"] = nullptr;
    res.set_content(DumpJson(body), "application/json");
    s->metrics->CountRequest(res.status);
  });
  http.set_exception_handler(
      [s](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown error";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        s->Reply(res, absl::InternalError(absl::StrCat("internal error: ", what)));
      });
  http.Post("/v1/completions", [s](const httplib::Request& req, httplib::Response& res) {
    s->Generate(req, res, false);
  });
  http.Post("/v1/chat/completions", [s](const httplib::Request& req, httplib::Response& res) {
    s->Generate(req, res, true);
  });
  http.Get("/v1/models", [s](const httplib::Request&, httplib::Response& res) {
    json model = {{"id", s->config.model_name},
                  {"object", "model"},
                  {"created", 0},
                  {"owned_by", "shardserve"},
                  {"chat_template", s->chat.name()}};
    {
      std::shared_lock<std::shared_mutex> lock(s->engine_mu);
      if (s->max_context > 0) model["max_model_len"] = s->max_context;
    }
    res.set_content(DumpJson({{"object", "list"}, {"data", json::array({model})}}),
                    "application/json");
    s->metrics->CountRequest(200);
  });
  http.Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("{\"status\":\"ok\"}", "application/json");
  });
  http.Get("/readyz", [s](const httplib::Request&, httplib::Response& res) {
    std::shared_lock<std::shared_mutex> lock(s->engine_mu);
    if (s->engine != nullptr && s->engine->accepting()) {
      res.set_content("{\"ready\":true}", "application/json");
    } else {
      res.status = 503;
      const std::string reason =
          s->engine != nullptr ? "the server is draining: it finishes the requests it has and stops"
                               : s->not_ready;
      res.set_content(DumpJson({{"ready", false}, {"reason", reason}}), "application/json");
    }
  });
  http.Get("/metrics", [s](const httplib::Request&, httplib::Response& res) {
    std::vector<prometheus::MetricFamily> families = s->own_registry->Collect();
    {
      std::lock_guard<std::mutex> lock(s->registry_mu);
      if (s->rank_registry) {
        auto more = s->rank_registry->Collect();
        families.insert(families.end(), more.begin(), more.end());
      }
    }
    res.set_content(prometheus::TextSerializer().Serialize(families), "text/plain; version=0.0.4");
  });
  const int port = config.port == 0
                       ? http.bind_to_any_port(config.host)
                       : (http.bind_to_port(config.host, config.port) ? config.port : -1);
  if (port < 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve the API on ", config.host, ":",
                                               config.port,
                                               ": the address is in use or not available"));
  }
  s->listener = std::thread([s] { s->http.listen_after_bind(); });
  std::unique_ptr<ApiServer> server(new ApiServer(std::move(impl)));
  server->port_ = port;
  return server;
}

void ApiServer::AttachRankMetrics(
    std::shared_ptr<prometheus::Registry> rank,
    const std::function<void(std::shared_ptr<prometheus::Registry>)>& expose) {
  {
    std::lock_guard<std::mutex> lock(impl_->registry_mu);
    impl_->rank_registry = std::move(rank);
  }
  if (expose) expose(impl_->own_registry);
}

void ApiServer::SetEngine(Engine* engine, const std::string& reason) {
  std::unique_lock<std::shared_mutex> lock(impl_->engine_mu);
  impl_->engine = engine;
  if (engine != nullptr) impl_->max_context = engine->options().max_context;
  if (!reason.empty()) impl_->not_ready = reason;
}

EngineObserver ApiServer::Observer() {
  LeaderMetrics* m = impl_->metrics.get();
  EngineObserver o;
  o.queue_depth = [m](size_t d) { m->SetQueueDepth(static_cast<double>(d)); };
  o.first_token = [m](double s) { m->ObserveFirstToken(s); };
  o.inter_token = [m](double s) { m->ObserveInterToken(s); };
  o.generated = [m](int64_t n) { m->AddGenerated(static_cast<double>(n)); };
  return o;
}

void ApiServer::Stop(std::chrono::milliseconds timeout) {
  if (!impl_ || !impl_->listener.joinable()) return;
  const auto deadline = Clock::now() + timeout;
  while (impl_->active.load() > 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  impl_->http.stop();
  impl_->listener.join();
}

}  // namespace shardserve
