#pragma once
// The leader's API server inside (serve/api_server.h): its state, shared by the endpoint families,
// each in a file of its own as vLLM keeps serving_chat and serving_completion: api_server.cc (the
// server, its routes, the small endpoints and what every endpoint uses), serving_completions.cc,
// serving_tokenize.cc and serving_kv_events.cc. Internal to src/serve.
#include <prometheus/registry.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "api/adapters.h"
#include "http/server.h"
#include "metrics/rank_metrics.h"
#include "model/config.h"
#include "serve/api_keys.h"
#include "serve/api_server.h"
#include "serve/flow_control.h"
#include "serve/grammar.h"
#include "serve/grammar_workers.h"
#include "serve/kv_events.h"
#include "serve/kv_handoff.h"
#include "serve/openai.h"
#include "serve/prompts.h"
#include "serve/reasoning.h"
#include "serve/tool_calls.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace shardserve {

namespace api_internal {
using json = nlohmann::json;
using ojson = nlohmann::ordered_json;  // request bodies, in their keys' order
using Clock = std::chrono::steady_clock;
// A request's grammar compiles within this, or the request is refused (400); at most this many
// wait to compile (beyond: 429).
inline constexpr auto kCompileTimeout = std::chrono::seconds(5);
inline constexpr size_t kMaxQueuedCompiles = 64;
// A fresh id: `prefix` and 16 hex digits.
std::string RequestId(const char* prefix);
// One prompt's sequence as the API reports it, and what one poll of it adds
// (serving_completions.cc).
struct Choice;
struct ChoiceDelta;
}  // namespace api_internal

struct ApiServer::Impl {
  using json = api_internal::json;
  using ojson = api_internal::ojson;
  using Choice = api_internal::Choice;
  using ChoiceDelta = api_internal::ChoiceDelta;

  ServeConfig config;
  std::unique_ptr<Tokenizer> tokenizer;
  ChatTemplate chat;
  std::unique_ptr<PromptBuilder> prompt_builder;
  std::unique_ptr<ApiKeys> keys;  // null: the API is open
  // The routers' token for the KV events (null: the API keys stand for it).
  std::unique_ptr<ApiKeys> router_keys;
  std::unique_ptr<FlowControl> flow;  // tenants' classes and limits (serve/flow_control.h)
  KvEventLog kv_events;
  const std::string epoch = api_internal::RequestId("");  // names this run in the KV events' hello
  std::unique_ptr<http::Server> http;
  std::shared_ptr<prometheus::Registry> own_registry = std::make_shared<prometheus::Registry>();
  std::unique_ptr<LeaderMetrics> metrics;
  absl::Mutex registry_mu;
  std::shared_ptr<prometheus::Registry> rank_registry ABSL_GUARDED_BY(registry_mu);
  absl::Mutex engine_mu;
  Engine* engine ABSL_GUARDED_BY(engine_mu) = nullptr;
  std::string not_ready ABSL_GUARDED_BY(engine_mu) =
      "the model replica is starting: waiting for every rank to connect and load";
  std::atomic<int> active{0};
  int64_t max_context ABSL_GUARDED_BY(engine_mu) = 0;
  int64_t vocab_size ABSL_GUARDED_BY(engine_mu) = 0;
  std::vector<int64_t> eos_ids ABSL_GUARDED_BY(engine_mu);
  // Structured output's view of the vocabulary, made at the first request that needs it.
  absl::Mutex grammar_mu;
  std::shared_ptr<const GrammarVocabulary> grammar_vocab ABSL_GUARDED_BY(grammar_mu);
  std::shared_ptr<const ReasoningGate> reasoning_gate ABSL_GUARDED_BY(grammar_mu);
  // The LoRA adapters declared (SHARDSERVE_LORA_ADAPTERS); the engine serves them and those
  // loaded at runtime.
  std::vector<AdapterRef> adapters;
  // Grammars compile here, on threads whose stacks hold llguidance's recursion, within
  // kCompileTimeout; the HTTP thread waits for its own.
  std::unique_ptr<GrammarWorkers> compilers =
      std::make_unique<GrammarWorkers>(2, kGrammarStackBytes, api_internal::kMaxQueuedCompiles);

  // --- Shared by the endpoints (api_server.cc).
  http::Response Reply(const absl::Status& s);
  http::Response Json(const json& body);
  // The 401 answer when keys are required and the request has none that is known.
  std::optional<http::Response> Deny(const http::Request& req);
  // A request's JSON body: its content type, its depth and its syntax checked.
  absl::StatusOr<ojson> Body(const http::Request& http_req);
  // The LoRA adapter a request's `model` names (the engine's id), nullopt for the base model;
  // NotFound naming the model and those served when it is neither.
  absl::StatusOr<std::optional<int64_t>> Served(const std::string& model);
  // Served, for a request: its adapter set.
  absl::Status ServeModelOf(ApiRequest& req);
  // The adapters served: the engine's, or before it runs the declared ones.
  std::vector<std::string> AdapterNames();
  // POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's): an admin key's only.
  http::Response LoraAdmin(const http::Request& req, bool load);
  std::unique_ptr<ApiKeys> admin_keys;      // null: runtime adapters off
  std::optional<ModelConfig> model_config;  // what a loaded adapter is checked against
  std::string TokenText(int32_t id) const;
  // The format of the model's tool calls: the manifest's (spec.serving.toolCallParser), else the
  // one its chat template shows.
  ChatTemplate TemplateFor(const ApiRequest& req) const;
  bool ReasoningRuns(const ApiRequest& req) const;
  std::string ToolCallFormat(const ApiRequest& req) const;
  // A request's tools (tool_choice "auto", "required" or a named function) need a template that
  // renders them and shows a call format we parse; tool_choice "none" renders the prompt without
  // them and parses nothing (as vLLM does by default).
  absl::Status ToolsRunHere(const ApiRequest& req) const;
  // Mistral's [TOOL_CALLS] token: a special token whose text the output keeps for the parser.
  std::optional<int32_t> MistralMarker() const;
  bool Harmony(const ApiRequest& req) const;
  // gpt-oss's ends of an assistant's action (<|return|> after the answer, <|call|> after a call):
  // its special tokens' ids, where the tokenizer has them. A harmony reply stops at either, as
  // vLLM stops it (gpt-oss's generation_config lists only <|return|>).
  std::vector<int64_t> HarmonyStops() const;
  // The special tokens among a tool-call format's markers (kept in the text for its parser, named
  // by id in its grammar).
  MarkerIds SpecialMarkers(const std::string& format) const;

  // --- POST /v1/completions and /v1/chat/completions (serving_completions.cc).
  // POST /v1/completions and /v1/chat/completions, on a thread of their own.
  void Generate(const http::Request& http_req, http::Exchange& ex, bool chat);
  // Tokenizes and submits every prompt of the request; on failure nothing stays queued.
  absl::Status Submit(ApiRequest& req, const http::Request& http_req, std::vector<Choice>& choices);
  // The request's grammar, compiled once (its sequences take clones); a grammar that does not
  // compile, or not in time, is a 400 naming the field that gave it; too many waiting to
  // compile, a 429.
  absl::StatusOr<std::unique_ptr<TokenConstraint>> CompileGrammar(const ApiRequest& req,
                                                                  int64_t vocab,
                                                                  std::vector<int64_t> ends);
  // What c's stream adds within `wait`, as the API reports it.
  ChoiceDelta Poll(Choice& c, const ApiRequest& req, std::chrono::milliseconds wait);
  // An update of c's stream turned into text, log-probabilities, reasoning and calls (a resumed
  // request's output so far goes through it unsent, so that the rest continues it).
  ChoiceDelta Consume(Choice& c, const ApiRequest& req, const RequestStream::Update& u);
  // Request migration: a request from the router (its token) is marked so; a resumed one
  // ("shardserve_resume") is checked: the router's, streamed, one sequence, no echo, no
  // disaggregated leg; its seed becomes the request's.
  absl::Status ResumeLeg(ApiRequest& req, const http::Request& http_req);
  // Flow control: the request's tenant (by its key, when keys are required) and effective
  // priority; its limits checked unless the router already did (a 429 naming the limit, with
  // Retry-After). The tenant's class, for Record.
  absl::StatusOr<TenantClass> AdmitFlow(ApiRequest& req, const http::Request& http_req);
  // The tokens the request's choices used, in its tenant's minute (unless the router counts them).
  void RecordFlow(const ApiRequest& req, const TenantClass& tenant,
                  const std::vector<Choice>& choices);
  // OpenAI's usage, with prompt_tokens_details.cached_tokens: the prompt tokens whose KV came
  // from the prefix cache (each prompt's first sequence's).
  json Usage(const std::vector<Choice>& choices) const;
  json ChunkHeader(const ApiRequest& req, const std::string& id, int64_t created) const;
  // Waits for every choice, its text, reasoning and calls (each call's pieces joined); false
  // when the client went away (counted: nothing to answer).
  bool Collect(const ApiRequest& req, std::vector<Choice>& choices, http::Exchange& ex,
               std::vector<std::string>& texts, std::vector<std::string>& reasonings,
               std::vector<std::vector<ToolCall>>& calls);
  // POST /v1/responses (serve/responses.h), answered whole or as its events.
  void Responses(const http::Request& http_req, http::Exchange& ex);
  // A non-streamed answer: waits for every choice, cancelling them if the client goes away.
  void Answer(const ApiRequest& req, std::vector<Choice>& choices, const std::string& id,
              int64_t created, http::Exchange& ex);
  // Server-sent events until every choice is done, the client leaves, or the replica fails (an
  // error event).
  // Counted once it ends: 200 when it was whole, the error's code when the replica failed,
  // 499 when the client left.
  void Stream(const ApiRequest& req, std::vector<Choice>& choices, const std::string& id,
              int64_t created, http::Exchange& ex);

  // --- POST /tokenize and /detokenize (serving_tokenize.cc).
  // POST /tokenize and /detokenize as vLLM serves them: a prompt (with add_special_tokens,
  // default true) or chat messages and tools (rendered as for /v1/chat/completions,
  // add_generation_prompt true) to {"count", "max_model_len", "tokens"}; token ids to {"prompt"}.
  // `model` may be left out.
  http::Response Tokenization(const http::Request& http_req, bool detokenize);

  // --- GET /v1/kv-events (serving_kv_events.cc).
  // GET /v1/kv-events: the replica's cached block names and load for a router
  // (serve/kv_events.h), until the router leaves or the server stops.
  void KvEvents(const http::Request& http_req, http::Exchange& ex);

  // Disaggregated serving (serving_kv_transfer.cc, serve/kv_handoff.h). A leg of a disaggregated
  // request is checked (the router's token, this replica's role, what it asks); the decode leg's
  // handoff is read (its seed becomes the request's).
  absl::Status KvLeg(ApiRequest& req, const http::Request& http_req,
                     std::optional<KvHandoff>* handoff);
  // Each of `n` sequences' part: offered (the prefill leg), taken from the handoff (decode).
  absl::StatusOr<std::vector<SequenceKvRole>> KvRoles(const ApiRequest& req,
                                                      const std::optional<KvHandoff>& handoff,
                                                      size_t n);
  // The prefill leg's answer: once every sequence has its first token, the handoff.
  void AnswerKvOffer(const ApiRequest& req, const std::vector<std::shared_ptr<RequestStream>>& seqs,
                     http::Exchange& ex);
  KvRoleShape kv_shape ABSL_GUARDED_BY(engine_mu);  // a prefill replica's (ApiServer::SetKvSource)
  std::vector<std::string> kv_addresses ABSL_GUARDED_BY(engine_mu);
};

}  // namespace shardserve
