#pragma once
// The OpenAI-compatible request shapes the leader accepts (DESIGN.md §5), parsed and validated
// without I/O. Every rejection is a Status whose message names the parameter; ErrorParam gives
// the parameter for the error body's "param" field.
//
// /v1/completions: prompt (string, token ids, or a list of either), max_tokens (default 16).
// /v1/chat/completions: messages (role + string or text parts), max_tokens or
//   max_completion_tokens (default: the rest of the context).
// Both: temperature, top_p, top_k, seed, stop (string or list), stop_token_ids, ignore_eos,
//   stream, stream_options.include_usage, n (up to 16); completions: best_of (n to 16, not
//   streamed), echo (without logprobs); logprobs (completions: an integer;
//   chat: a boolean with top_logprobs); presence_penalty and frequency_penalty ([-2, 2]),
//   repetition_penalty ((0, 10], vLLM's), logit_bias ({"id": [-100, 100]}), min_tokens (vLLM's;
//   SamplingParams says how each applies). Chat: tools (functions), tool_choice "auto",
//   "none", "required" or a named function (the last two constrained), parallel_tool_calls;
//   messages of role tool (tool_call_id) and assistant messages with tool_calls; how the
//   template renders them: add_generation_prompt, continue_final_message, chat_template_kwargs
//   (its variables; not the request's own fields or the tokenizer's tokens), documents, and a
//   request's own chat_template (served where the deployment trusts them). Structured
//   output (serve/grammar.h): response_format json_object or json_schema, or vLLM's guided_json,
//   guided_regex, guided_grammar (Lark), guided_choice (or structured_outputs' json, regex,
//   grammar, choice, json_object); one at a time, not with tools or min_tokens. cache_salt
//   (vLLM's): cached prefixes are shared only with requests of the same salt. Unsupported
//   options that would change the answer (echo with logprobs, suffix, a function's strict: true
//   with tool_choice "auto", other structured_outputs keys, guided_whitespace_pattern, a
//   guided_decoding_backend other than llguidance, the deprecated functions / function_call) are
//   refused by name; unknown fields are
//   ignored, as OpenAI does. Bodies are ordered JSON: tool schemas reach the chat template with
//   their keys in the client's order, as Hugging Face's apply_chat_template gets them.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/sampler.h"
#include "serve/grammar.h"
#include "tokenizer/chat_template.h"

namespace shardserve {

struct ApiRequest {
  bool chat = false;
  std::string model;
  // Completions: one entry per prompt, as text or as token ids.
  std::vector<std::string> prompt_texts;
  std::vector<std::vector<int32_t>> prompt_ids;
  std::vector<ChatMessage> messages;
  // How the template renders them: add_generation_prompt, continue_final_message,
  // chat_template_kwargs, documents (its tools are set from `tools` when it is rendered).
  ChatOptions chat_options;
  std::optional<std::string> chat_template;  // the request's own (taken only where trusted)
  bool include_reasoning = true;             // vLLM's: false drops reasoning_content
  nlohmann::ordered_json tools;              // the request's tools as given; null: none
  // "auto" (tools given, calls parsed), "none", "required" (one call or more, constrained) or
  // "function" (a call of tool_choice_name, constrained).
  std::string tool_choice = "none";
  std::string tool_choice_name;
  bool parallel_tool_calls = true;  // false: at most one call is returned
  // The first function with strict: true ("tools[i].function.strict"), or empty: with tool_choice
  // auto, such calls are constrained too (the output is text or calls).
  std::string strict_param;
  SamplingParams params;
  bool max_tokens_set = false;
  bool seed_set = false;  // without a seed, every request samples differently
  std::vector<std::string> stop;
  int64_t n = 1;        // choices per prompt
  int64_t best_of = 1;  // sequences generated per prompt, the n of highest log-probability kept
  bool echo = false;    // completions: the prompt's text before each choice's
  bool stream = false;
  bool include_usage = false;
  bool logprobs = false;           // report log-probabilities (top_logprobs alternatives in params)
  std::optional<Grammar> grammar;  // structured output: the rule the output follows
  std::string grammar_param;       // the field that gave it
  std::string cache_salt;          // vLLM's: salts the prompt's KV block names (may be empty)
  bool speculative = true;         // false: no speculative decoding (the replica's) for it
  // The LoRA adapter `model` names (the server sets it: its id and name); -1: the base.
  int64_t adapter = -1;
  std::string adapter_name, adapter_salt;
  // vLLM's kv_transfer_params: a leg of a disaggregated request (serve/kv_handoff.h), as given
  // (an object with do_remote_decode or do_remote_prefill true); null: none.
  nlohmann::json kv_transfer;
  // Request migration (serve/api_server.h): the router's "shardserve_resume" {"tokens", "id",
  // "created", "seed"}, a streamed request resumed after the replica answering it failed: its
  // output so far, the stream's id and time, the seed it sampled with. None: a new request.
  struct Resume {
    std::vector<int32_t> tokens;
    std::string id;
    int64_t created = 0;
    std::optional<uint64_t> seed;
  };
  std::optional<Resume> resume;
  // vLLM's priority (lower runs first); the server makes it the effective one: never more urgent
  // than the tenant's class allows (serve/flow_control.h).
  int64_t priority = 0;
  // Set by the server: the request's tenant (its API key's) and the tenant's weight.
  std::string tenant;
  double tenant_weight = 1.0;
  // Set by the server: the request came from the model's router (its token in kRouterHeader); a
  // stream it can resume elsewhere then reports its progress (serve/api_server.h).
  bool from_router = false;
};

// Parses a request body. `chat` selects /v1/chat/completions.
absl::StatusOr<ApiRequest> ParseApiRequest(const nlohmann::ordered_json& body, bool chat);

// The parameter an error names ("" when none).
std::string ErrorParam(const absl::Status& status);
// InvalidArgument naming `param`.
absl::Status BadParam(const std::string& param, const std::string& message);

// The HTTP status for a Status (InvalidArgument 400, Unauthenticated 401, PermissionDenied 403,
// NotFound 404, ResourceExhausted 429, Unavailable 503, FailedPrecondition 400, others 500; or
// the one WithHttpStatus set) and the OpenAI error body.
int HttpStatusFor(const absl::Status& status);
// The seconds a 429 or 503 asks the client to wait (its Retry-After); 0: unsaid (1 is sent).
absl::Status WithRetryAfter(absl::Status status, int64_t seconds);
int64_t RetryAfterOf(const absl::Status& status);
absl::Status WithHttpStatus(absl::Status status, int http_status);
nlohmann::json ErrorBody(const absl::Status& status);

// JSON text that never throws on invalid UTF-8 (model output may hold partial characters).
std::string DumpJson(const nlohmann::json& j);

}  // namespace shardserve
