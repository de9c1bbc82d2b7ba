#include "serve/api_server.h"

#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <filesystem>
#include <random>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "api/worker_env.h"
#include "common/log.h"
#include "common/status.h"
#include "common/text.h"
#include "model/lora.h"
#include "serve/api_server_impl.h"

namespace shardserve {

using api_internal::Clock;
using api_internal::json;
using api_internal::ojson;

namespace {

constexpr int kMaxNesting = 64;

// A POST body must say it is JSON: a form or text/plain body (what a web page may send to a
// server on localhost without asking) is refused.
bool IsJson(const std::string& content_type) {
  const std::string media = absl::AsciiStrToLower(
      absl::StripAsciiWhitespace(content_type.substr(0, content_type.find(';'))));
  return media == "application/json";
}

}  // namespace

namespace api_internal {

std::string RequestId(const char* prefix) {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(rng()));
  return absl::StrCat(prefix, buf);
}

}  // namespace api_internal

std::string ApiServer::Impl::TokenText(int32_t id) const { return tokenizer->Decode({id}, false); }

http::Response ApiServer::Impl::Reply(const absl::Status& s) {
  const int code = HttpStatusFor(s);
  http::Response r{code, "application/json", DumpJson(ErrorBody(s)), {}};
  if (code == 429 || code == 503) {
    r.headers.emplace_back("Retry-After", absl::StrCat(std::max<int64_t>(1, RetryAfterOf(s))));
  }
  if (code == 401) r.headers.emplace_back("WWW-Authenticate", "Bearer");
  metrics->CountRequest(code);
  return r;
}

http::Response ApiServer::Impl::Json(const json& body) {
  metrics->CountRequest(200);
  return {200, "application/json", DumpJson(body), {}};
}

// The 401 answer when keys are required and the request has none that is known.
std::optional<http::Response> ApiServer::Impl::Deny(const http::Request& req) {
  if (keys == nullptr) return std::nullopt;
  absl::Status s = keys->Check(req.Header("authorization"));
  if (s.ok()) return std::nullopt;
  return Reply(s);
}

// The template a request renders with: its own (PromptBuilder refuses it where untrusted), else
// the deployment's.
ChatTemplate ApiServer::Impl::TemplateFor(const ApiRequest& req) const {
  return req.chat_template ? chat.WithTemplate(*req.chat_template, "the request's chat_template")
                           : chat;
}

// Whether a chat's output has its <think> blocks taken out as reasoning_content: the manifest's
// choice (spec.serving.reasoningParser), else where the request's chat template writes </think>.
bool ApiServer::Impl::ReasoningRuns(const ApiRequest& req) const {
  const std::string& parser = config.env.reasoning_parser;
  if (!parser.empty()) return parser == "think";
  return TemplateFor(req).writes("</think>");
}

// Whether a chat's output is read as gpt-oss's harmony messages: the manifest's choice (either
// parser naming it, or the tool-call format taken from the template), else where the request's
// chat template writes <|channel|>.
bool ApiServer::Impl::Harmony(const ApiRequest& req) const {
  const std::string& reasoning = config.env.reasoning_parser;
  const std::string& tools = config.env.tool_call_parser;
  if (reasoning == "harmony" || ToolCallFormat(req) == "openai") return true;
  return reasoning.empty() && tools.empty() && TemplateFor(req).writes("<|channel|>");
}

// The format of the model's tool calls: the manifest's (spec.serving.toolCallParser), else the
// one the request's chat template shows.
std::string ApiServer::Impl::ToolCallFormat(const ApiRequest& req) const {
  return config.env.tool_call_parser.empty() ? TemplateFor(req).tool_call_format()
                                             : config.env.tool_call_parser;
}

// A request's tools (tool_choice "auto", "required" or a named function) need a template that
// renders them and shows a call format we parse; tool_choice "none" renders the prompt without
// them and parses nothing (as vLLM does by default).
absl::Status ApiServer::Impl::ToolsRunHere(const ApiRequest& req) const {
  if (req.tool_choice == "none") return absl::OkStatus();
  const ChatTemplate t = TemplateFor(req);
  if (!t.renders_tools()) {
    return BadParam("tools", absl::StrCat("this model's chat template (", t.source(),
                                          ") does not render tools"));
  }
  const std::string format = ToolCallFormat(req);
  if (format.empty()) {
    return BadParam("tools",
                    "this model's chat template shows no tool-call format shardserve parses, or "
                    "more than one (Hermes <tool_call> JSON, Qwen3-Coder's XML, Llama 3 JSON, "
                    "pythonic, Mistral [TOOL_CALLS], DeepSeek-V3 / V3.1, Kimi K2, gpt-oss's "
                    "harmony); "
                    "spec.serving.toolCallParser names one");
  }
  if (format == "mistral" && !MistralMarker()) {
    return BadParam("tools",
                    "the chat template writes Mistral's [TOOL_CALLS], which this model's "
                    "tokenizer has no special token for");
  }
  return absl::OkStatus();
}

// Mistral's [TOOL_CALLS] token: a special token whose text the output keeps for the parser.
std::optional<int32_t> ApiServer::Impl::MistralMarker() const {
  std::optional<int32_t> id = tokenizer->TokenId("[TOOL_CALLS]");
  return id && tokenizer->IsSpecial(*id) ? id : std::nullopt;
}

MarkerIds ApiServer::Impl::SpecialMarkers(const std::string& format) const {
  MarkerIds out;
  for (std::string_view text : ToolCallMarkers(format)) {
    const std::optional<int32_t> id = tokenizer->TokenId(std::string(text));
    if (id && tokenizer->IsSpecial(*id)) out.emplace(std::string(text), *id);
  }
  return out;
}

std::vector<int64_t> ApiServer::Impl::HarmonyStops() const {
  std::vector<int64_t> out;
  for (const char* text : {"<|return|>", "<|call|>"}) {
    const std::optional<int32_t> id = tokenizer->TokenId(text);
    if (id && tokenizer->IsSpecial(*id)) out.push_back(*id);
  }
  return out;
}

// A request's JSON body: its content type, its depth and its syntax checked.
absl::StatusOr<ojson> ApiServer::Impl::Body(const http::Request& http_req) {
  if (!IsJson(http_req.Header("content-type"))) {
    return WithHttpStatus(BadParam("", absl::StrCat("the request body must be JSON "
                                                    "(Content-Type: application/json), not '",
                                                    http_req.Header("content-type"), "'")),
                          415);
  }
  if (JsonNestsDeeperThan(http_req.body, kMaxNesting)) {
    return BadParam("",
                    absl::StrCat("the request body nests deeper than ", kMaxNesting, " levels"));
  }
  try {
    return ojson::parse(http_req.body);
  } catch (const ojson::exception& e) {
    return BadParam("", absl::StrCat("the request body is not valid JSON: ", e.what()));
  }
}

std::vector<std::string> ApiServer::Impl::AdapterNames() {
  {
    absl::ReaderMutexLock lock(&engine_mu);
    if (engine != nullptr) return engine->adapter_names();
  }
  std::vector<std::string> out;
  for (const AdapterRef& a : adapters) out.push_back(a.name);
  return out;
}

absl::StatusOr<std::optional<int64_t>> ApiServer::Impl::Served(const std::string& model) {
  if (model == config.env.model_name) return std::nullopt;
  {
    absl::ReaderMutexLock lock(&engine_mu);
    if (engine != nullptr) {
      if (absl::StatusOr<int64_t> id = engine->AdapterOf(model); id.ok()) return *id;
    }
  }
  std::string names = absl::StrCat("'", config.env.model_name, "'");
  for (const std::string& a : AdapterNames()) absl::StrAppend(&names, ", '", a, "'");
  absl::Status s = absl::NotFoundError(absl::StrCat(
      "the model '", model.substr(0, 200), "' does not exist; this server serves ", names));
  s.SetPayload("type.shardserve.io/param", absl::Cord("model"));
  return s;
}

absl::Status ApiServer::Impl::ServeModelOf(ApiRequest& req) {
  ASSIGN_OR_RETURN(const std::optional<int64_t> adapter, Served(req.model));
  req.adapter = adapter.value_or(-1);
  req.adapter_name = adapter ? req.model : "";
  // Its blocks' salt: a declared adapter's name (the router salts alike); an adapter loaded at
  // runtime also its id, so that a name unloaded and loaded again with other files never meets
  // the blocks of its earlier files.
  req.adapter_salt = req.adapter_name;
  if (adapter && *adapter >= static_cast<int64_t>(adapters.size())) {
    absl::StrAppend(&req.adapter_salt, "#", *adapter);
  }
  return absl::OkStatus();
}

http::Response ApiServer::Impl::LoraAdmin(const http::Request& req, bool load) {
  const std::string endpoint = load ? "/v1/load_lora_adapter" : "/v1/unload_lora_adapter";
  if (admin_keys == nullptr) {
    return Reply(
        WithHttpStatus(absl::NotFoundError(absl::StrCat(
                           endpoint,
                           ": runtime LoRA adapters are off on this server (no admin keys: "
                           "SHARDSERVE_ADMIN_KEYS_FILE, spec.lora.adminKeySecret)")),
                       404));
  }
  if (absl::Status s = admin_keys->Check(req.Header("authorization")); !s.ok()) {
    // A user's key is known but not allowed here; anything else is not authenticated.
    const bool user = keys != nullptr && keys->Check(req.Header("authorization")).ok();
    if (user) {
      return Reply(WithHttpStatus(
          absl::PermissionDeniedError(absl::StrCat(endpoint, " needs an admin key")), 403));
    }
    return Reply(s);
  }
  absl::StatusOr<ojson> body = Body(req);
  if (!body.ok()) return Reply(body.status());
  absl::Status s = [&]() -> absl::Status {
    if (!body->is_object()) return BadParam("", "the request body must be a JSON object");
    for (const auto& [key, value] : body->items()) {
      if (key != "lora_name" && (key != "lora_path" || !load)) {
        return BadParam(key,
                        absl::StrCat("'", key.substr(0, 64), "' is not a field of ", endpoint));
      }
    }
    auto name = body->find("lora_name");
    if (name == body->end() || !name->is_string()) {
      return BadParam("lora_name", "'lora_name' must be the adapter's name (a string)");
    }
    const std::string n = name->get<std::string>();
    RETURN_IF_ERROR(CheckAdapterName(n));
    Engine* e;
    {
      absl::ReaderMutexLock lock(&engine_mu);
      if (engine == nullptr) return absl::UnavailableError(not_ready);
      e = engine;
    }
    if (!load) return e->UnloadAdapter(n);
    if (n == config.env.model_name) {
      return BadParam("lora_name", absl::StrCat("'", n, "' is the base model's name"));
    }
    auto path = body->find("lora_path");
    if (path == body->end() || !path->is_string() || path->get_ref<const std::string&>().empty() ||
        path->get_ref<const std::string&>().size() > 4096) {
      return BadParam("lora_path", "'lora_path' must be the adapter's directory (a string)");
    }
    // Inside the adapters' directory only: relative to it, or an absolute path in it, with no
    // step out of it (symbolic links followed).
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path root = fs::weakly_canonical(config.env.lora_root, ec);
    const fs::path given(path->get<std::string>());
    const fs::path dir = fs::weakly_canonical(given.is_absolute() ? given : root / given, ec);
    const auto [r, d] = std::mismatch(root.begin(), root.end(), dir.begin(), dir.end());
    if (config.env.lora_root.empty() || ec || r != root.end()) {
      return BadParam("lora_path", absl::StrCat("'lora_path' must be inside the adapters' "
                                                "directory (",
                                                config.env.lora_root.empty()
                                                    ? "none is set: SHARDSERVE_LORA_ROOT"
                                                    : config.env.lora_root,
                                                ")"));
    }
    LoraLimits limits;
    limits.max_rank = config.env.max_lora_rank;
    // Read and checked here, on this request's thread: a bad adapter is this request's 400.
    if (auto a = LoraAdapter::Load(dir.string(), *model_config, limits); !a.ok()) {
      return BadParam("lora_path", std::string(a.status().message()));
    }
    return e->LoadAdapter(n, dir.string());
  }();
  if (!s.ok()) {
    if (s.code() == absl::StatusCode::kAlreadyExists)
      s = BadParam("lora_name", std::string(s.message()));
    return Reply(s);
  }
  const std::string name = body->value("lora_name", "");
  return http::Response{200,
                        "text/plain",
                        absl::StrCat("Success: LoRA adapter '", name, "' ",
                                     load ? "added" : "removed", " successfully."),
                        {}};
}

ServeConfig ServeConfigFrom(const WorkerEnv& env, bool local) {
  ServeConfig c;
  c.env = env;
  c.host = !env.api_host.empty() ? env.api_host : local ? "127.0.0.1" : "0.0.0.0";
  return c;
}

ApiServer::ApiServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ApiServer::~ApiServer() { Stop(std::chrono::milliseconds(0)); }

absl::StatusOr<std::unique_ptr<ApiServer>> ApiServer::Start(const ServeConfig& config) {
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  const WorkerEnv& env = config.env;
  ASSIGN_OR_RETURN(impl->keys, ApiKeys::Open(env.api_key, env.api_keys_file));
  ASSIGN_OR_RETURN(impl->router_keys, ApiKeys::Open("", env.router_token_file));
  ASSIGN_OR_RETURN(impl->flow, FlowControl::Open(env.flow_control_file));
  ASSIGN_OR_RETURN(impl->adapters, ParseAdapterList(env.lora_adapters));
  if (!env.admin_keys_file.empty()) {
    if (env.max_loras == 0) {
      return absl::FailedPreconditionError(
          "SHARDSERVE_ADMIN_KEYS_FILE lets admins load LoRA adapters, and SHARDSERVE_MAX_LORAS is "
          "0");
    }
    ASSIGN_OR_RETURN(impl->admin_keys, ApiKeys::Open("", env.admin_keys_file));
    ASSIGN_OR_RETURN(impl->model_config, LoadModelConfig(env.model_path));
  }
  ASSIGN_OR_RETURN(impl->tokenizer, Tokenizer::Load(env.model_path));
  impl->chat = ChatTemplate::ForModel(env.model_path, *impl->tokenizer, env.chat_template);
  impl->prompt_builder =
      std::make_unique<PromptBuilder>(impl->tokenizer.get(), &impl->chat,
                                      env.special_tokens_as_text, env.trust_request_chat_template);
  impl->metrics = std::make_unique<LeaderMetrics>(
      impl->own_registry, env.metrics_model(), std::to_string(env.replica), env.kv_role,
      SloTargets{env.slo_ttft_ms / 1000.0, env.slo_itl_ms / 1000.0,
                 static_cast<double>(env.slo_percentile)});
  Impl* s = impl.get();
  http::ServerOptions options;
  options.host = config.host;
  options.port = env.api_port;
  options.max_body_bytes = static_cast<size_t>(env.max_body_bytes);
  options.header_timeout = std::chrono::milliseconds(env.http_header_timeout_ms);
  options.body_timeout = std::chrono::milliseconds(env.http_body_timeout_ms);
  options.max_connections = static_cast<size_t>(env.http_max_connections);
  // Generation requests beyond the batch and the queue are the engine's to refuse (429).
  options.max_blocking = env.max_batch_size + env.max_queue + 16;
  options.error = [](int status, const std::string& reason) {
    absl::Status st = WithHttpStatus(absl::InvalidArgumentError(reason), status);
    json body = ErrorBody(st);
    if (status == 404) {  // no such endpoint (an unknown model is answered by its handler)
      body["error"]["type"] = "not_found_error";
      body["error"]["code"] = nullptr;
    }
    if (status >= 500) body["error"]["type"] = "server_error";
    http::Response r{status, "application/json", DumpJson(body), {}};
    return r;
  };
  options.on_error = [s](int status) { s->metrics->CountRequest(status); };

  http::Routes routes;
  routes.PostBlocking("/v1/completions", [s](const http::Request& req, http::Exchange& ex) {
    s->Generate(req, ex, false);
  });
  routes.PostBlocking("/v1/chat/completions", [s](const http::Request& req, http::Exchange& ex) {
    s->Generate(req, ex, true);
  });
  routes.PostBlocking("/v1/responses",
                      [s](const http::Request& req, http::Exchange& ex) { s->Responses(req, ex); });
  // Tokenizing a long text takes a while: off the event loop, as generation is.
  routes.PostBlocking("/tokenize", [s](const http::Request& req, http::Exchange& ex) {
    ex.Respond(s->Tokenization(req, false));
  });
  routes.PostBlocking("/detokenize", [s](const http::Request& req, http::Exchange& ex) {
    ex.Respond(s->Tokenization(req, true));
  });
  for (bool load : {true, false}) {
    routes.PostBlocking(load ? "/v1/load_lora_adapter" : "/v1/unload_lora_adapter",
                        [s, load](const http::Request& req, http::Exchange& ex) {
                          ex.Respond(s->LoraAdmin(req, load));
                        });
  }
  routes.GetBlocking("/v1/kv-events",
                     [s](const http::Request& req, http::Exchange& ex) { s->KvEvents(req, ex); });
  routes.Get("/v1/models", [s](const http::Request& req) {
    if (auto denied = s->Deny(req)) return *std::move(denied);
    json model = {{"id", s->config.env.model_name},
                  {"object", "model"},
                  {"created", 0},
                  {"owned_by", "shardserve"},
                  {"chat_template", s->chat.source()}};
    {
      absl::ReaderMutexLock lock(&s->engine_mu);
      if (s->max_context > 0) model["max_model_len"] = s->max_context;
    }
    json data = json::array({model});
    for (const std::string& a : s->AdapterNames()) {  // as vLLM lists its LoRA modules
      json lora = {{"id", a},      {"object", "model"},
                   {"created", 0}, {"owned_by", "shardserve"},
                   {"root", a},    {"parent", s->config.env.model_name}};
      if (model.contains("max_model_len")) lora["max_model_len"] = model["max_model_len"];
      data.push_back(std::move(lora));
    }
    return s->Json({{"object", "list"}, {"data", std::move(data)}});
  });
  routes.Get("/healthz", [](const http::Request&) {
    return http::Response{200, "application/json", "{\"status\":\"ok\"}", {}};
  });
  routes.Get("/readyz", [s](const http::Request&) {
    absl::ReaderMutexLock lock(&s->engine_mu);
    if (s->engine != nullptr && s->engine->accepting()) {
      return http::Response{200, "application/json", "{\"ready\":true}", {}};
    }
    const std::string reason = s->engine != nullptr
                                   ? "the server is draining: it finishes the requests it has and "
                                     "stops"
                                   : s->not_ready;
    return http::Response{
        503, "application/json", DumpJson(json{{"ready", false}, {"reason", reason}}), {}};
  });
  routes.Get("/metrics", [s](const http::Request& req) {
    if (s->config.env.api_metrics_auth) {
      if (auto denied = s->Deny(req)) return *std::move(denied);
    }
    std::vector<prometheus::MetricFamily> families = s->metrics->Page()->Collect();
    {
      absl::MutexLock lock(&s->registry_mu);
      if (s->rank_registry) {
        auto more = s->rank_registry->Collect();
        families.insert(families.end(), more.begin(), more.end());
      }
    }
    return http::Response{
        200, "text/plain; version=0.0.4", prometheus::TextSerializer().Serialize(families), {}};
  });
  if (env.prefix_cache_per_key && s->keys == nullptr) {  // else it would isolate nothing
    return absl::FailedPreconditionError(
        "SHARDSERVE_PREFIX_CACHE_ISOLATION=perKey separates the prefix cache by API key, and the "
        "API has none (SHARDSERVE_API_KEY, SHARDSERVE_API_KEYS_FILE)");
  }
  ASSIGN_OR_RETURN(s->http, http::Server::Start(options, std::move(routes)));
  if (s->keys == nullptr) {
    LogWarning("leader: the API has no keys (", kApiKeyEnv, ", ", kApiKeysFileEnv,
               "): "
               "anyone who reaches ",
               config.host, ":", s->http->port(), " can use it");
  }
  std::unique_ptr<ApiServer> server(new ApiServer(std::move(impl)));
  server->port_ = server->impl_->http->port();
  return server;
}

void ApiServer::AttachRankMetrics(
    std::shared_ptr<prometheus::Registry> rank,
    const std::function<void(std::shared_ptr<prometheus::Collectable>)>& expose) {
  {
    absl::MutexLock lock(&impl_->registry_mu);
    impl_->rank_registry = std::move(rank);
  }
  if (expose) expose(impl_->metrics->Page());
}

void ApiServer::SetEngine(Engine* engine, const std::string& reason) {
  absl::WriterMutexLock lock(&impl_->engine_mu);
  impl_->engine = engine;
  if (engine != nullptr) {
    impl_->max_context = engine->options().max_context;
    impl_->vocab_size = engine->options().vocab_size;
    impl_->eos_ids = engine->options().eos_token_ids;
  }
  if (!reason.empty()) impl_->not_ready = reason;
}

void ApiServer::SetKvSource(const KvRoleShape& shape, std::vector<std::string> addresses) {
  absl::WriterMutexLock lock(&impl_->engine_mu);
  impl_->kv_shape = shape;
  impl_->kv_addresses = std::move(addresses);
}

EngineObserver ApiServer::Observer() {
  LeaderMetrics* m = impl_->metrics.get();
  EngineObserver o;
  o.queue_depth = [m](size_t d) { m->SetQueueDepth(static_cast<double>(d)); };
  o.backlog = [m](int running, int64_t prompt) { m->SetBacklog(running, prompt); };
  if (const int max_loras = impl_->config.env.max_loras; max_loras > 0) {
    o.adapters = [m, max_loras](const std::vector<std::string>& running,
                                const std::vector<std::string>& waiting) {
      m->SetLoraRequests(running, waiting, max_loras);
    };
  }
  o.first_token = [m](double s) { m->ObserveFirstToken(s); };
  o.inter_token = [m](double s) { m->ObserveInterToken(s); };
  o.generated = [m](int64_t n) { m->AddGenerated(static_cast<double>(n)); };
  o.grammar_mask = [m](double s) { m->ObserveGrammarMask(s); };
  o.prefix_lookup = [m](int64_t queried, int64_t hit) { m->CountPrefixLookup(queried, hit); };
  o.speculation = [m](int64_t drafted, int64_t accepted) {
    m->CountSpeculation(drafted, accepted);
  };
  o.cache_blocks = [m](int64_t used, int64_t cached) { m->SetCacheBlocks(used, cached); };
  o.kv_import = [m](double seconds, int64_t bytes, const absl::Status& transfer) {
    m->ObserveKvTransfer(seconds, bytes, transfer.ok());
    if (!transfer.ok())
      LogWarning("a prompt's KV transfer failed; prefilled here: ", transfer.message());
  };
  o.kv_events = [log = &impl_->kv_events](const std::vector<KvEvent>& e) { log->Apply(e); };
  return o;
}

void ApiServer::Stop(std::chrono::milliseconds timeout) {
  if (!impl_ || !impl_->http) return;
  const auto deadline = Clock::now() + timeout;
  while (impl_->active.load() > 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  impl_->http->Stop();
}

}  // namespace shardserve
