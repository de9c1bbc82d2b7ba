// POST /v1/completions and /v1/chat/completions (OpenAI's API as vLLM serves it): a request's
// prompts tokenized and submitted together, its grammar compiled once, each choice's tokens turned
// into text, log-probabilities and tool calls, answered whole or streamed as server-sent events.
#include <algorithm>
#include <random>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "common/status.h"
#include "common/text.h"
#include "serve/api_server_impl.h"
#include "serve/harmony.h"
#include "serve/prefix_cache.h"
#include "serve/reasoning.h"
#include "serve/responses.h"
#include "serve/text_stream.h"
#include "serve/tool_calls.h"

namespace shardserve {

using api_internal::json;
using api_internal::kCompileTimeout;
using api_internal::kMaxQueuedCompiles;
using api_internal::ojson;
using api_internal::RequestId;

namespace api_internal {

// One prompt's sequence as the API reports it.
struct Choice {
  Choice(std::shared_ptr<RequestStream> s, TextStream t, int64_t prompt)
      : stream(std::move(s)), text(std::move(t)), prompt_tokens(prompt) {}
  std::shared_ptr<RequestStream> stream;
  TextStream text;
  int64_t prompt_tokens = 0;  // counted once per prompt: 0 on its other sequences (n, best_of)
  int64_t completion_tokens = 0;
  double cumulative_logprob = 0;  // best_of's measure
  std::string echo;               // echo: the prompt's text, sent before the first piece
  // echo with logprobs: the prompt, whose tokens lead the log-probabilities (the first with
  // none), and how many of them are reported so far.
  std::vector<int32_t> prompt_ids;
  size_t prompt_reported = 0;
  // The prompt's pieces as they are reported, spelling the echoed text (special tokens kept).
  std::unique_ptr<TextStream> prompt_text;
  std::string finish_reason;  // set when done
  absl::Status error;
  bool done = false;
  bool sent_role = false;
  // Log-probabilities: completions form (tokens, token_logprobs, top_logprobs, text_offset) or
  // chat form (content entries), filled as tokens arrive.
  json lp_tokens = json::array(), lp_values = json::array(), lp_top = json::array(),
       lp_offsets = json::array(), lp_content = json::array();
  std::string all_text;
  // Reasoning apart (spec.serving.reasoningParser): the <think> block taken out of the text.
  std::unique_ptr<ReasoningParser> reasoning;
  // The request's tools in use: the output's tool calls parsed out of its text.
  std::unique_ptr<ToolCallParser> tool_parser;
  // gpt-oss's harmony messages: reasoning, content and calls at once (instead of the two above).
  std::unique_ptr<HarmonyParser> harmony;
};

// What one poll of a choice's stream adds.
struct ChoiceDelta {
  std::string reasoning;  // reasoning_content
  std::string text;       // content (the reasoning and the tool calls' text taken out)
  std::vector<ToolCall> calls;
  json logprobs;  // null unless requested and tokens arrived
  bool finished = false;
  std::vector<int32_t> ids;  // the tokens that arrived
};

}  // namespace api_internal

using api_internal::Choice;
using api_internal::ChoiceDelta;

namespace {

constexpr auto kPoll = std::chrono::milliseconds(50);

json Bytes(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

// OpenAI's tool_calls entries: whole calls in an answer; in a stream's deltas, a call's first
// piece with its index, id, type and name, the next pieces with the index and arguments only.
json ToolCallsJson(const std::vector<ToolCall>& calls, bool streamed) {
  json out = json::array();
  for (const ToolCall& c : calls) {
    json e = json::object();
    if (streamed) e["index"] = c.index;
    if (!c.id.empty()) {
      e["id"] = c.id;
      e["type"] = "function";
      e["function"] = {{"name", c.name}, {"arguments", c.arguments}};
    } else {
      e["function"] = {{"arguments", c.arguments}};
    }
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace

// The request's grammar, compiled once (its sequences take clones); a grammar that does not
// compile, or not in time, is a 400 naming the field that gave it; too many waiting to
// compile, a 429.
absl::StatusOr<std::unique_ptr<TokenConstraint>> ApiServer::Impl::CompileGrammar(
    const ApiRequest& req, int64_t vocab, std::vector<int64_t> ends) {
  std::shared_ptr<const GrammarVocabulary> v;
  {
    absl::MutexLock lock(&grammar_mu);
    if (grammar_vocab == nullptr) {
      // The ids that end a generation: the model's, and the chat template's end of turn.
      for (int64_t id : chat.end_of_turn_ids()) ends.push_back(id);
      ASSIGN_OR_RETURN(grammar_vocab, GrammarVocabulary::Create(*tokenizer, vocab, ends));
    }
    v = grammar_vocab;
  }
  auto bad = [&](absl::string_view message) {
    return BadParam(req.grammar_param, absl::StrCat("'", req.grammar_param, "': ", message));
  };
  // Cheap bounds first, on this thread: a grammar past them never takes a compiler's time.
  if (absl::Status s = CheckGrammarBounds(*req.grammar); !s.ok()) return bad(s.message());
  struct Job {
    absl::Mutex mu;
    bool done ABSL_GUARDED_BY(mu) = false;
    bool abandoned ABSL_GUARDED_BY(mu) = false;
    absl::StatusOr<std::unique_ptr<TokenConstraint>> result ABSL_GUARDED_BY(mu);
  };
  auto job = std::make_shared<Job>();
  const bool posted = compilers->Post([job, v, grammar = *req.grammar] {
    {
      absl::MutexLock lock(&job->mu);
      if (job->abandoned) return;  // its request was already answered: nobody waits
    }
    auto m = v->Compile(grammar);
    absl::MutexLock lock(&job->mu);
    job->result = std::move(m);
    job->done = true;
  });
  if (!posted && !compilers->error().empty()) return absl::UnavailableError(compilers->error());
  if (!posted) {
    return absl::ResourceExhaustedError(absl::StrCat("too many grammars are waiting to compile (",
                                                     kMaxQueuedCompiles, "); retry later"));
  }
  absl::MutexLock lock(&job->mu);
  job->mu.AwaitWithTimeout(absl::Condition(&job->done), absl::FromChrono(kCompileTimeout));
  if (!job->done) {
    job->abandoned = true;
    return bad(
        absl::StrCat("the grammar did not compile within ",
                     std::chrono::duration_cast<std::chrono::seconds>(kCompileTimeout).count(),
                     " s; simplify it"));
  }
  if (!job->result.ok()) return bad(job->result.status().message());
  return std::move(job->result);
}

ChoiceDelta ApiServer::Impl::Poll(Choice& c, const ApiRequest& req,
                                  std::chrono::milliseconds wait) {
  if (c.done) return {};
  return Consume(c, req, c.stream->Next(wait));
}

ChoiceDelta ApiServer::Impl::Consume(Choice& c, const ApiRequest& req,
                                     const RequestStream::Update& u) {
  ChoiceDelta d;
  std::vector<int32_t>& ids = d.ids;
  for (const auto& t : u.tokens) {
    ids.push_back(t.id);
    c.cumulative_logprob += t.logprob;
  }
  TextStream::Delta td = c.text.Add(ids);
  c.completion_tokens += static_cast<int64_t>(u.tokens.size());
  const size_t first_offset = c.lp_tokens.size();
  // A completions entry: the token's text, its log-probability and the alternatives (the
  // token itself among them, as vLLM reports it); null ones for the prompt's first token.
  auto completion_entry = [&](const std::string& piece, const RequestStream::Token* t) {
    c.lp_tokens.push_back(piece);
    c.lp_offsets.push_back(c.all_text.size());
    c.all_text += piece;
    if (t == nullptr) {
      c.lp_values.push_back(nullptr);
      c.lp_top.push_back(nullptr);
      return;
    }
    json top = json::object();
    for (const TokenLogprob& a : t->top) top[TokenText(a.id)] = a.logprob;
    if (!top.contains(piece)) top[piece] = t->logprob;
    c.lp_values.push_back(t->logprob);
    c.lp_top.push_back(std::move(top));
  };
  // echo with logprobs: the prompt's tokens lead, each with its text.
  const bool prompt_due = !c.prompt_ids.empty() && c.prompt_reported < c.prompt_ids.size() &&
                          (!u.prompt.empty() || !u.tokens.empty() || u.finished);
  if (prompt_due) {
    // u.prompt[i] scores position base + i (the first position has no score).
    const size_t base = std::max<size_t>(1, c.prompt_reported);
    const size_t end = std::min(c.prompt_ids.size(), base + u.prompt.size());
    // The new positions' pieces; at the prompt's end, its held-back text too.
    std::vector<std::string> pieces =
        c.prompt_text
            ->Add(std::vector<int32_t>(c.prompt_ids.begin() + c.prompt_reported,
                                       c.prompt_ids.begin() + end))
            .token_texts;
    if (end == c.prompt_ids.size()) pieces.back() += c.prompt_text->Flush();
    for (size_t q = c.prompt_reported; q < end; ++q) {
      completion_entry(pieces[q - c.prompt_reported], q == 0 ? nullptr : &u.prompt[q - base]);
    }
    c.prompt_reported = end;
  }
  if (req.logprobs && (!u.tokens.empty() || prompt_due)) {
    json content = json::array();
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
        c.all_text += piece;
      } else {
        completion_entry(piece, &t);
      }
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
  if (c.harmony != nullptr) {
    HarmonyParser::Out h = c.harmony->Add(d.text);
    if (d.finished) {
      HarmonyParser::Out rest = c.harmony->Finish();
      h.reasoning += rest.reasoning;
      h.content += rest.content;
      h.calls.insert(h.calls.end(), rest.calls.begin(), rest.calls.end());
      if (c.harmony->calls() > 0 && c.finish_reason == "stop") c.finish_reason = "tool_calls";
    }
    if (req.include_reasoning) d.reasoning = std::move(h.reasoning);
    d.text = std::move(h.content);
    d.calls = std::move(h.calls);
    return d;
  }
  if (c.reasoning != nullptr) {
    ReasoningParser::Out r = c.reasoning->Add(d.text);
    if (d.finished) {
      ReasoningParser::Out rest = c.reasoning->Finish();
      r.reasoning += rest.reasoning;
      r.content += rest.content;
    }
    if (req.include_reasoning) d.reasoning = std::move(r.reasoning);
    d.text = std::move(r.content);
  }
  if (c.tool_parser != nullptr) {
    ToolCallParser::Out out = c.tool_parser->Add(d.text);
    if (d.finished) {
      ToolCallParser::Out rest = c.tool_parser->Finish();
      out.content += rest.content;
      out.calls.insert(out.calls.end(), rest.calls.begin(), rest.calls.end());
      // The model ended its turn with calls: OpenAI's reason for that.
      if (c.tool_parser->calls() > 0 && c.finish_reason == "stop") c.finish_reason = "tool_calls";
    }
    // Once calls come, white space between and after them is no content.
    if (c.tool_parser->calls() > 0 && absl::StripAsciiWhitespace(out.content).empty()) {
      out.content.clear();
    }
    d.text = std::move(out.content);
    d.calls = std::move(out.calls);
  }
  return d;
}

// OpenAI's usage, with prompt_tokens_details.cached_tokens: the prompt tokens whose KV came
// from the prefix cache (each prompt's first sequence's).
json ApiServer::Impl::Usage(const std::vector<Choice>& choices) const {
  int64_t p = 0, g = 0, cached = 0;
  for (const Choice& c : choices) {
    p += c.prompt_tokens;
    g += c.completion_tokens;
    if (c.prompt_tokens > 0) cached += c.stream->cached_tokens();
  }
  return {{"prompt_tokens", p},
          {"completion_tokens", g},
          {"total_tokens", p + g},
          {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

absl::Status ApiServer::Impl::ResumeLeg(ApiRequest& req, const http::Request& http_req) {
  req.from_router = router_keys != nullptr && http_req.HasHeader(kRouterHeader) &&
                    router_keys->Check(http_req.Header(kRouterHeader)).ok();
  if (!req.resume) return absl::OkStatus();
  if (!req.from_router) {
    return absl::PermissionDeniedError(
        absl::StrCat("'shardserve_resume' is the model's router's: it needs the router's token in ",
                     kRouterHeader, router_keys == nullptr ? " (this server has none)" : ""));
  }
  const size_t prompts = req.chat ? 1 : req.prompt_ids.size();
  if (!req.stream || prompts != 1 || req.best_of != 1 || req.echo || !req.kv_transfer.is_null()) {
    return BadParam("shardserve_resume",
                    "only a streamed request of one prompt and one choice, without echo or "
                    "kv_transfer_params, is resumed");
  }
  if (req.resume->seed && !req.seed_set) {
    req.params.seed = *req.resume->seed;
    req.seed_set = true;
  }
  return absl::OkStatus();
}

absl::StatusOr<TenantClass> ApiServer::Impl::AdmitFlow(ApiRequest& req,
                                                       const http::Request& http_req) {
  // Without keys anyone may say anything in the header: every request is the anonymous tenant.
  const TenantClass tenant = flow->Tenant(keys != nullptr ? http_req.Header("authorization") : "");
  req.priority = std::max(req.priority, tenant.priority);
  req.tenant = tenant.name;
  req.tenant_weight = tenant.weight;
  if (!req.from_router) {  // the router checked the limits of what it sends
    int64_t retry_after = 0;
    if (absl::Status s = flow->Admit(tenant, &retry_after); !s.ok()) {
      return WithRetryAfter(s, retry_after);
    }
  }
  return tenant;
}

void ApiServer::Impl::RecordFlow(const ApiRequest& req, const TenantClass& tenant,
                                 const std::vector<Choice>& choices) {
  if (req.from_router) return;  // the router counts what it relays
  int64_t tokens = 0;
  for (const Choice& c : choices) tokens += c.prompt_tokens + c.completion_tokens;
  flow->Record(tenant, tokens);
}

// Tokenizes and submits every prompt of the request; on failure nothing stays queued.
absl::Status ApiServer::Impl::Submit(ApiRequest& req, const http::Request& http_req,
                                     std::vector<Choice>& choices) {
  const std::string salt =
      PrefixCacheSalt(config.env.prefix_cache_per_key && keys != nullptr,
                      http_req.Header("authorization"), req.cache_salt, req.adapter_salt);
  int64_t context, vocab;
  std::vector<int64_t> ends;
  {
    absl::ReaderMutexLock lock(&engine_mu);
    if (engine == nullptr) return absl::UnavailableError(not_ready);
    context = max_context;
    vocab = vocab_size;
    ends = eos_ids;
  }
  std::optional<KvHandoff> handoff;
  RETURN_IF_ERROR(KvLeg(req, http_req, &handoff));
  std::vector<std::vector<int32_t>> prompts;
  const std::string param = req.chat ? "messages" : "prompt";
  // <think> blocks parsed; the prompt opens one; gpt-oss's harmony messages parsed
  bool reasoning = false, thinking = false, harmony = false;
  if (req.chat) {
    RETURN_IF_ERROR(ToolsRunHere(req));
    if (req.tool_choice == "required" || req.tool_choice == "function") {  // a call must come
      const std::string format = ToolCallFormat(req);
      req.grammar = ToolCallGrammar(format, req.tools, req.tool_choice, req.tool_choice_name,
                                    req.parallel_tool_calls, SpecialMarkers(format));
      req.grammar_param = "tool_choice";
    } else if (req.grammar && req.tool_choice == "auto") {  // a call, or the JSON answer
      if (Harmony(req)) {  // calls are commentary messages; the answer, the final channel's
        return BadParam(req.grammar_param,
                        absl::StrCat("'", req.grammar_param,
                                     "' with tools (tool_choice \"auto\") is not supported in "
                                     "gpt-oss's harmony format; \"required\" or \"none\" is"));
      }
      absl::StatusOr<std::string> answer = PreparedSchema(*req.grammar);
      if (!answer.ok()) {
        return BadParam(req.grammar_param,
                        absl::StrCat("'", req.grammar_param, "': ", answer.status().message()));
      }
      const std::string format = ToolCallFormat(req);
      req.grammar = ToolCallOrAnswerGrammar(format, req.tools, req.parallel_tool_calls,
                                            SpecialMarkers(format), *answer);
    } else if (req.tool_choice == "auto" && !req.strict_param.empty()) {  // text, or strict calls
      const std::string format = ToolCallFormat(req);
      absl::StatusOr<Grammar> g =
          ToolCallOrTextGrammar(format, req.tools, req.parallel_tool_calls, SpecialMarkers(format));
      if (!g.ok()) return BadParam(req.strict_param, std::string(g.status().message()));
      req.grammar = *std::move(g);
      req.grammar_param = req.strict_param;
    }
    std::string rendered;
    ASSIGN_OR_RETURN(auto ids, prompt_builder->Chat(req, context, false, &rendered));
    prompts.push_back(std::move(ids));
    harmony = Harmony(req);
    reasoning = !harmony && ReasoningRuns(req);
    thinking = reasoning && PromptEndsThinking(rendered);
    for (int64_t id : chat.end_of_turn_ids()) req.params.stop_token_ids.push_back(id);
    if (harmony) {  // a constrained call may end at <|call|> too
      for (int64_t id : HarmonyStops()) {
        req.params.stop_token_ids.push_back(id);
        if (absl::c_find(ends, id) == ends.end()) ends.push_back(id);
      }
    }
  } else {
    for (size_t i = 0; i < req.prompt_ids.size(); ++i) {
      if (!req.prompt_ids[i].empty()) {
        for (int32_t id : req.prompt_ids[i]) {
          if (id >= vocab) {
            return BadParam(param, absl::StrCat("prompt token id ", id,
                                                " is outside the vocabulary [0, ", vocab, ")"));
          }
        }
        prompts.push_back(req.prompt_ids[i]);
      } else {
        ASSIGN_OR_RETURN(auto ids,
                         prompt_builder->Tokenize(req.prompt_texts[i], true, context, param));
        prompts.push_back(std::move(ids));
      }
    }
  }
  for (const auto& ids : prompts) {  // every prompt checked before any is queued
    if (static_cast<int64_t>(ids.size()) >= context) {
      return BadParam(param, absl::StrCat("this model's maximum context length is ", context,
                                          " tokens; the prompt holds ", ids.size()));
    }
  }
  // The grammar compiled before any sequence is queued; each sequence takes a clone.
  std::unique_ptr<TokenConstraint> compiled;
  if (req.grammar) {
    ASSIGN_OR_RETURN(compiled, CompileGrammar(req, vocab, ends));
    // The constraint applies to the answer, after the reasoning (a constrained call in harmony
    // opens its own message: its grammar starts at once).
    if (reasoning || (harmony && req.grammar_param != "tool_choice")) {
      absl::MutexLock lock(&grammar_mu);
      if (reasoning_gate == nullptr) {
        reasoning_gate = std::make_shared<const ReasoningGate>(*tokenizer, vocab);
      }
      compiled = harmony ? reasoning_gate->WrapHarmony(std::move(compiled))
                         : reasoning_gate->Wrap(std::move(compiled), thinking);
    }
  }
  absl::ReaderMutexLock lock(&engine_mu);
  if (engine == nullptr) return absl::UnavailableError(not_ready);
  // best_of sequences of each prompt (n when best_of is not asked), each with a generator of
  // its own (seed + j), so that sampled choices differ; queued together or not at all.
  std::vector<GenerationRequest> seqs;
  for (const std::vector<int32_t>& ids : prompts) {
    for (int64_t j = 0; j < req.best_of; ++j) {
      GenerationRequest g;
      g.prompt_ids = ids;
      g.params = req.params;
      g.params.seed = req.params.seed + static_cast<uint64_t>(j);
      g.cache_salt = salt;
      g.adapter = req.adapter;
      g.priority = req.priority;
      g.speculative = req.speculative;
      g.tenant = req.tenant;
      g.weight = req.tenant_weight;
      if (req.echo && req.logprobs) g.prompt_logprobs = req.params.top_logprobs;
      if (compiled) g.constraint = compiled->Clone();
      if (!req.max_tokens_set && req.chat) {
        g.params.max_tokens = max_context - static_cast<int64_t>(ids.size());
      }
      if (req.resume) g.resumed = req.resume->tokens;
      seqs.push_back(std::move(g));
    }
  }
  std::vector<SequenceKvRole> roles;
  if (!req.kv_transfer.is_null()) {
    ASSIGN_OR_RETURN(roles, KvRoles(req, handoff, seqs.size()));
  }
  auto streams = engine->SubmitGroup(seqs, roles);
  if (!streams.ok()) {
    const absl::Status& s = streams.status();
    return s.code() == absl::StatusCode::kInvalidArgument && ErrorParam(s).empty()
               ? BadParam("max_tokens", std::string(s.message()))
               : s;
  }
  for (size_t k = 0; k < streams->size(); ++k) {
    const size_t p = k / req.best_of, j = k % req.best_of;
    const std::vector<int32_t>& ids = prompts[p];
    std::vector<int32_t> keep;  // the special tokens among the markers the parsers read
    if (req.chat && (harmony || (req.tool_choice != "none" && !req.tools.empty()))) {
      for (const auto& [_, id] : SpecialMarkers(harmony ? "openai" : ToolCallFormat(req))) {
        keep.push_back(id);
      }
    }
    choices.emplace_back((*streams)[k], TextStream(tokenizer.get(), req.stop, keep),
                         j == 0 ? static_cast<int64_t>(ids.size()) : 0);
    Choice& c = choices.back();
    if (req.echo) {
      c.echo = req.prompt_texts[p].empty() ? tokenizer->Decode(ids) : req.prompt_texts[p];
      if (req.logprobs) {
        c.prompt_ids = ids;
        std::vector<int32_t> specials;  // kept, so that the pieces spell the echoed text
        for (int32_t id : ids) {
          if (tokenizer->IsSpecial(id)) specials.push_back(id);
        }
        c.prompt_text =
            std::make_unique<TextStream>(tokenizer.get(), std::vector<std::string>{}, specials);
      }
    }
    if (harmony) {
      c.harmony = std::make_unique<HarmonyParser>(
          req.tool_choice != "none" ? req.tools : nlohmann::ordered_json::array(),
          req.parallel_tool_calls);
      continue;
    }
    if (reasoning) c.reasoning = std::make_unique<ReasoningParser>(thinking);
    if (req.tool_choice != "none") {
      c.tool_parser =
          std::make_unique<ToolCallParser>(ToolCallFormat(req), req.tools, req.parallel_tool_calls);
    }
  }
  if (req.resume) {  // the client has this output: it only sets the parsers' state
    RequestStream::Update sent;
    for (int32_t id : req.resume->tokens) sent.tokens.push_back({id, 0.0f, {}});
    for (Choice& c : choices) {
      Consume(c, req, sent);
      c.sent_role = true;
    }
  }
  return absl::OkStatus();
}

json ApiServer::Impl::ChunkHeader(const ApiRequest& req, const std::string& id,
                                  int64_t created) const {
  return {{"id", id},
          {"object", req.chat ? "chat.completion.chunk" : "text_completion"},
          {"created", created},
          {"model", config.env.model_name}};
}

// POST /v1/completions and /v1/chat/completions, on a thread of their own.
void ApiServer::Impl::Generate(const http::Request& http_req, http::Exchange& ex, bool chat) {
  ++active;
  struct Done {
    std::atomic<int>& n;
    ~Done() { --n; }
  } done{active};
  if (auto denied = Deny(http_req)) return ex.Respond(*std::move(denied));
  absl::StatusOr<ojson> parsed_body = Body(http_req);
  if (!parsed_body.ok()) return ex.Respond(Reply(parsed_body.status()));
  const ojson& body = *parsed_body;
  auto parsed = ParseApiRequest(body, chat);
  if (!parsed.ok()) return ex.Respond(Reply(parsed.status()));
  ApiRequest& req = *parsed;
  if (absl::Status s = ServeModelOf(req); !s.ok()) return ex.Respond(Reply(s));
  if (absl::Status s = ResumeLeg(req, http_req); !s.ok()) return ex.Respond(Reply(s));
  absl::StatusOr<TenantClass> tenant = AdmitFlow(req, http_req);
  if (!tenant.ok()) return ex.Respond(Reply(tenant.status()));
  if (!req.seed_set)
    req.params.seed = std::random_device{}() * 4294967296ull + std::random_device{}();
  std::vector<Choice> choices;
  if (absl::Status s = Submit(req, http_req, choices); !s.ok()) return ex.Respond(Reply(s));
  if (req.kv_transfer.contains("do_remote_decode")) {  // the prefill leg
    std::vector<std::shared_ptr<RequestStream>> seqs;
    for (const Choice& c : choices) seqs.push_back(c.stream);
    AnswerKvOffer(req, seqs, ex);
    for (Choice& c : choices) c.stream->Cancel();
    return;
  }
  // A resumed stream goes on under its id and time.
  const std::string id = req.resume && !req.resume->id.empty()
                             ? req.resume->id
                             : RequestId(chat ? "chatcmpl-" : "cmpl-");
  const int64_t created = req.resume && req.resume->created > 0
                              ? req.resume->created
                              : std::chrono::duration_cast<std::chrono::seconds>(
                                    std::chrono::system_clock::now().time_since_epoch())
                                    .count();
  if (req.stream) {
    Stream(req, choices, id, created, ex);
  } else {
    Answer(req, choices, id, created, ex);
  }
  for (Choice& c : choices) c.stream->Cancel();  // ended, or the client is gone
  RecordFlow(req, *tenant, choices);
}

// Waits for every choice, its text, reasoning and calls (each call's pieces joined); false when
// the client went away (counted, nothing to answer).
bool ApiServer::Impl::Collect(const ApiRequest& req, std::vector<Choice>& choices,
                              http::Exchange& ex, std::vector<std::string>& texts,
                              std::vector<std::string>& reasonings,
                              std::vector<std::vector<ToolCall>>& calls) {
  texts.assign(choices.size(), "");
  reasonings.assign(choices.size(), "");
  calls.assign(choices.size(), {});
  for (;;) {
    bool all_done = true;
    for (size_t i = 0; i < choices.size(); ++i) {
      ChoiceDelta d = Poll(choices[i], req, all_done ? kPoll : std::chrono::milliseconds(0));
      texts[i] += d.text;
      reasonings[i] += d.reasoning;
      for (ToolCall& piece : d.calls) {  // a call's pieces joined
        if (piece.index == static_cast<int>(calls[i].size())) {
          calls[i].push_back(std::move(piece));
        } else if (!calls[i].empty()) {
          calls[i].back().arguments += piece.arguments;
        }
      }
      all_done &= choices[i].done;
    }
    if (all_done) return true;
    if (ex.ClientGone()) {
      metrics->CountRequest(499);  // the client closed the request; nobody reads an answer
      return false;
    }
  }
}

// A non-streamed answer: waits for every choice, cancelling them if the client goes away.
void ApiServer::Impl::Answer(const ApiRequest& req, std::vector<Choice>& choices,
                             const std::string& id, int64_t created, http::Exchange& ex) {
  std::vector<std::string> texts, reasonings;
  std::vector<std::vector<ToolCall>> calls;
  if (!Collect(req, choices, ex, texts, reasonings, calls)) return;
  for (const Choice& c : choices) {
    if (!c.error.ok()) return ex.Respond(Reply(c.error));
  }
  // Each prompt's n choices: with best_of, its n sequences of the highest cumulative
  // log-probability, best first (vLLM's order).
  std::vector<size_t> kept;
  for (size_t first = 0; first < choices.size(); first += req.best_of) {
    std::vector<size_t> group(req.best_of);
    for (int64_t j = 0; j < req.best_of; ++j) group[j] = first + j;
    if (req.best_of > req.n) {
      std::stable_sort(group.begin(), group.end(), [&](size_t a, size_t b) {
        return choices[a].cumulative_logprob > choices[b].cumulative_logprob;
      });
    }
    kept.insert(kept.end(), group.begin(), group.begin() + req.n);
  }
  json out_choices = json::array();
  for (size_t k = 0; k < kept.size(); ++k) {
    const size_t i = kept[k];
    const Choice& c = choices[i];
    json lp = nullptr;
    if (req.logprobs) {
      lp = req.chat ? json{{"content", c.lp_content}}
                    : json{{"tokens", c.lp_tokens},
                           {"token_logprobs", c.lp_values},
                           {"top_logprobs", c.lp_top},
                           {"text_offset", c.lp_offsets}};
    }
    json choice = {{"index", k}, {"logprobs", lp}, {"finish_reason", c.finish_reason}};
    if (req.chat) {
      choice["message"] = {{"role", "assistant"}, {"content", texts[i]}};
      if (!reasonings[i].empty()) choice["message"]["reasoning_content"] = reasonings[i];
      if (!calls[i].empty()) {
        if (texts[i].empty()) choice["message"]["content"] = nullptr;
        choice["message"]["tool_calls"] = ToolCallsJson(calls[i], false);
      }
    } else {
      choice["text"] = c.echo + texts[i];
    }
    out_choices.push_back(std::move(choice));
  }
  ex.Respond(Json({{"id", id},
                   {"object", req.chat ? "chat.completion" : "text_completion"},
                   {"created", created},
                   {"model", config.env.model_name},
                   {"choices", out_choices},
                   {"usage", Usage(choices)}}));
}

// Server-sent events until every choice is done, the client leaves, or the replica fails (an
// error event).
// Counted once it ends: 200 when it was whole, the error's code when the replica failed,
// 499 when the client left.
void ApiServer::Impl::Stream(const ApiRequest& req, std::vector<Choice>& choices,
                             const std::string& id, int64_t created, http::Exchange& ex) {
  int code = 499;
  struct Count {
    LeaderMetrics& m;
    int& code;
    ~Count() { m.CountRequest(code); }
  } count{*metrics, code};
  if (!ex.StartStream({200, "text/event-stream", "", {{"Cache-Control", "no-cache"}}})) return;
  // For the router (request migration): each event's block leads with the tokens it consumed
  // (": tokens ID,ID"), the first with the seed (": seed N"), and a failure of the replica's
  // with ": failed", as SSE comments, which the router takes out.
  const bool progress = req.from_router && choices.size() == 1 && !req.echo;
  std::string pending = progress ? absl::StrCat(": seed ", req.params.seed, "\n") : "";
  auto send = [&](const json& event) {
    const bool ok = ex.Write(absl::StrCat(pending, "data: ", DumpJson(event), "\n\n"));
    pending.clear();
    return ok;
  };
  bool all_done = false;
  while (!all_done) {
    if (ex.ClientGone()) return;
    all_done = true;
    bool waited = false;
    for (size_t i = 0; i < choices.size(); ++i) {
      Choice& c = choices[i];
      if (c.done) continue;
      ChoiceDelta d = Poll(c, req, waited ? std::chrono::milliseconds(0) : kPoll);
      waited = true;
      if (progress && !d.ids.empty()) {
        absl::StrAppend(&pending, ": tokens ", absl::StrJoin(d.ids, ","), "\n");
      }
      if (!c.error.ok()) {
        code = HttpStatusFor(c.error);
        if (progress && code >= 500) pending += ": failed\n";
        send(ErrorBody(c.error));
        return ex.End();
      }
      all_done &= c.done;
      json choice = {{"index", i},
                     {"logprobs", d.logprobs.is_null() ? json(nullptr) : d.logprobs},
                     {"finish_reason", d.finished ? json(c.finish_reason) : json(nullptr)}};
      if (req.chat) {
        json delta = json::object();
        if (!c.sent_role) delta["role"] = "assistant";
        // A poll that took the thought's end and the answer's start at once (a slow reader, a
        // loaded host) sends them as two chunks: a delta is reasoning or answer, never both.
        if (!d.reasoning.empty() && (!d.text.empty() || !d.calls.empty())) {
          delta["reasoning_content"] = std::move(d.reasoning);
          d.reasoning.clear();
          json first = ChunkHeader(req, id, created);
          first["choices"] = json::array({{{"index", i},
                                           {"logprobs", nullptr},
                                           {"finish_reason", nullptr},
                                           {"delta", delta}}});
          if (!send(first)) return;
          delta = json::object();
          c.sent_role = true;
        }
        if (!d.reasoning.empty()) delta["reasoning_content"] = d.reasoning;
        if (!d.text.empty() || (!c.sent_role && d.reasoning.empty())) delta["content"] = d.text;
        if (!d.calls.empty()) delta["tool_calls"] = ToolCallsJson(d.calls, true);
        c.sent_role = true;
        if (delta.empty() && !d.finished && d.logprobs.is_null()) continue;
        choice["delta"] = delta;
      } else {
        if (!c.echo.empty()) {  // the prompt's text first (echo)
          d.text = std::move(c.echo) + d.text;
          c.echo.clear();
        }
        if (d.text.empty() && !d.finished && d.logprobs.is_null()) continue;
        choice["text"] = d.text;
      }
      json event = ChunkHeader(req, id, created);
      event["choices"] = json::array({choice});
      if (!send(event)) return;  // gone: the caller cancels
    }
  }
  if (req.include_usage) {
    json event = ChunkHeader(req, id, created);
    event["choices"] = json::array();
    event["usage"] = Usage(choices);
    if (!send(event)) return;
  }
  if (ex.Write("data: [DONE]\n\n")) {
    code = 200;
    ex.End();
  }
}

namespace {

// A chat parser's error in the Responses request's words: the field it names mapped back.
absl::Status ResponsesParam(const absl::Status& s) {
  const std::string param = ErrorParam(s);
  if (param.empty() || s.code() != absl::StatusCode::kInvalidArgument) return s;
  std::string mapped = param;
  for (const auto& [chat, responses] :
       {std::pair{"max_tokens", "max_output_tokens"}, std::pair{"response_format", "text.format"},
        std::pair{"chat_template_kwargs", "reasoning.effort"}, std::pair{"messages", "input"}}) {
    if (absl::StartsWith(param, chat)) mapped = responses;
  }
  if (absl::StartsWith(param, "tools[")) {
    mapped = absl::StrReplaceAll(param, {{".function.", "."}, {".function", ""}});
  }
  return BadParam(mapped, std::string(s.message()));
}

}  // namespace

// POST /v1/responses: the request read as the chat it stands for (serve/responses.h), answered
// as a response object or its stream of typed events; on a thread of its own.
void ApiServer::Impl::Responses(const http::Request& http_req, http::Exchange& ex) {
  ++active;
  struct Done {
    std::atomic<int>& n;
    ~Done() { --n; }
  } done{active};
  if (auto denied = Deny(http_req)) return ex.Respond(*std::move(denied));
  absl::StatusOr<ojson> body = Body(http_req);
  if (!body.ok()) return ex.Respond(Reply(body.status()));
  absl::StatusOr<ojson> chat_body = ResponsesToChat(*body);
  if (!chat_body.ok()) return ex.Respond(Reply(chat_body.status()));
  auto parsed = ParseApiRequest(*chat_body, /*chat=*/true);
  if (!parsed.ok()) return ex.Respond(Reply(ResponsesParam(parsed.status())));
  ApiRequest& req = *parsed;
  if (absl::Status s = ServeModelOf(req); !s.ok()) return ex.Respond(Reply(s));
  if (absl::Status s = ResumeLeg(req, http_req); !s.ok()) return ex.Respond(Reply(s));
  absl::StatusOr<TenantClass> tenant = AdmitFlow(req, http_req);
  if (!tenant.ok()) return ex.Respond(Reply(tenant.status()));
  req.params.seed = std::random_device{}() * 4294967296ull + std::random_device{}();
  std::vector<Choice> choices;
  if (absl::Status s = Submit(req, http_req, choices); !s.ok()) {
    return ex.Respond(Reply(ResponsesParam(s)));
  }
  const int64_t created = std::chrono::duration_cast<std::chrono::seconds>(
                              std::chrono::system_clock::now().time_since_epoch())
                              .count();
  ResponseBuilder builder(*body, RandomId("resp_"), created, config.env.model_name);
  struct Cancel {
    Impl& server;
    const ApiRequest& req;
    const TenantClass& tenant;
    std::vector<Choice>& choices;
    ~Cancel() {
      for (Choice& c : choices) c.stream->Cancel();  // ended, or the client is gone
      server.RecordFlow(req, tenant, choices);
    }
  } cancel{*this, req, *tenant, choices};
  if (!req.stream) {
    std::vector<std::string> texts, reasonings;
    std::vector<std::vector<ToolCall>> calls;
    if (!Collect(req, choices, ex, texts, reasonings, calls)) return;
    if (!choices[0].error.ok()) return ex.Respond(Reply(choices[0].error));
    builder.Add(reasonings[0], texts[0], calls[0]);
    builder.Finish(choices[0].finish_reason, Usage(choices));
    return ex.Respond(Json(builder.Response()));
  }
  int code = 499;
  struct Count {
    LeaderMetrics& m;
    int& code;
    ~Count() { m.CountRequest(code); }
  } count{*metrics, code};
  if (!ex.StartStream({200, "text/event-stream", "", {{"Cache-Control", "no-cache"}}})) return;
  auto send = [&](const std::vector<json>& events) {
    for (const json& e : events) {
      if (!ex.Write(absl::StrCat("event: ", e["type"].get<std::string>(), "\ndata: ", DumpJson(e),
                                 "\n\n"))) {
        return false;
      }
    }
    return true;
  };
  if (!send(builder.Start())) return;
  Choice& c = choices[0];
  while (!c.done) {
    if (ex.ClientGone()) return;
    ChoiceDelta d = Poll(c, req, kPoll);
    if (!c.error.ok()) {
      code = HttpStatusFor(c.error);
      json error = ErrorBody(c.error)["error"];
      error["type"] = "error";
      send({error});
      return ex.End();
    }
    if (!send(builder.Add(d.reasoning, d.text, d.calls))) return;
  }
  if (send(builder.Finish(c.finish_reason, Usage(choices)))) {
    code = 200;
    ex.End();
  }
}

}  // namespace shardserve
