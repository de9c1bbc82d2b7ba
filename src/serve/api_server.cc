#include "serve/api_server.h"

#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <cstdlib>
#include <limits>
#include <random>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "api/worker_env.h"
#include "common/log.h"
#include "common/status.h"
#include "common/text.h"
#include "http/server.h"
#include "metrics/rank_metrics.h"
#include "serve/api_keys.h"
#include "serve/grammar_workers.h"
#include "serve/kv_events.h"
#include "serve/openai.h"
#include "serve/prefix_cache.h"
#include "serve/prompts.h"
#include "serve/text_stream.h"
#include "serve/tool_calls.h"
#include "tokenizer/tokenizer.h"

namespace shardserve {
namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;  // request bodies, in their keys' order
using Clock = std::chrono::steady_clock;
constexpr auto kPoll = std::chrono::milliseconds(50);
constexpr int kMaxNesting = 64;
// A request's grammar compiles within this, or the request is refused (400).
constexpr auto kCompileTimeout = std::chrono::seconds(5);
constexpr size_t kMaxQueuedCompiles = 64;

// A POST body must say it is JSON: a form or text/plain body (what a web page may send to a
// server on localhost without asking) is refused.
bool IsJson(const std::string& content_type) {
  const std::string media = absl::AsciiStrToLower(
      absl::StripAsciiWhitespace(content_type.substr(0, content_type.find(';'))));
  return media == "application/json";
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
  // The request's tools in use: the output's tool calls parsed out of its text.
  std::unique_ptr<ToolCallParser> tool_parser;
};

// What one poll of a choice's stream adds.
struct ChoiceDelta {
  std::string text;  // content (the tool calls' text taken out)
  std::vector<ToolCall> calls;
  json logprobs;  // null unless requested and tokens arrived
  bool finished = false;
};

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

struct ApiServer::Impl {
  ServeConfig config;
  std::unique_ptr<Tokenizer> tokenizer;
  ChatTemplate chat;
  std::unique_ptr<PromptBuilder> prompt_builder;
  std::unique_ptr<ApiKeys> keys;  // null: the API is open
  // The routers' token for the KV events (null: the API keys stand for it).
  std::unique_ptr<ApiKeys> router_keys;
  KvEventLog kv_events;
  const std::string epoch = RequestId("");  // names this run in the KV events' hello
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
  // Grammars compile here, on threads whose stacks hold llguidance's recursion, within
  // kCompileTimeout; the HTTP thread waits for its own.
  std::unique_ptr<GrammarWorkers> compilers =
      std::make_unique<GrammarWorkers>(2, kGrammarStackBytes, kMaxQueuedCompiles);

  // The request's grammar, compiled once (its sequences take clones); a grammar that does not
  // compile, or not in time, is a 400 naming the field that gave it; too many waiting to
  // compile, a 429.
  absl::StatusOr<std::unique_ptr<TokenConstraint>> CompileGrammar(const ApiRequest& req,
                                                                  int64_t vocab,
                                                                  std::vector<int64_t> ends) {
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

  std::string TokenText(int32_t id) const { return tokenizer->Decode({id}, false); }

  http::Response Reply(const absl::Status& s) {
    const int code = HttpStatusFor(s);
    http::Response r{code, "application/json", DumpJson(ErrorBody(s)), {}};
    if (code == 429 || code == 503) r.headers.emplace_back("Retry-After", "1");
    if (code == 401) r.headers.emplace_back("WWW-Authenticate", "Bearer");
    metrics->CountRequest(code);
    return r;
  }
  http::Response Json(const json& body) {
    metrics->CountRequest(200);
    return {200, "application/json", DumpJson(body), {}};
  }
  // The 401 answer when keys are required and the request has none that is known.
  std::optional<http::Response> Deny(const http::Request& req) {
    if (keys == nullptr) return std::nullopt;
    absl::Status s = keys->Check(req.Header("authorization"));
    if (s.ok()) return std::nullopt;
    return Reply(s);
  }

  ChoiceDelta Poll(Choice& c, const ApiRequest& req, std::chrono::milliseconds wait) {
    ChoiceDelta d;
    if (c.done) return d;
    RequestStream::Update u = c.stream->Next(wait);
    std::vector<int32_t> ids;
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
  json Usage(const std::vector<Choice>& choices) const {
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

  // Tokenizes and submits every prompt of the request; on failure nothing stays queued.
  absl::Status Submit(ApiRequest& req, const http::Request& http_req,
                      std::vector<Choice>& choices) {
    const std::string salt = PrefixCacheSalt(config.env.prefix_cache_per_key && keys != nullptr,
                                             http_req.Header("authorization"), req.cache_salt);
    int64_t context, vocab;
    std::vector<int64_t> ends;
    {
      absl::ReaderMutexLock lock(&engine_mu);
      if (engine == nullptr) return absl::UnavailableError(not_ready);
      context = max_context;
      vocab = vocab_size;
      ends = eos_ids;
    }
    std::vector<std::vector<int32_t>> prompts;
    const std::string param = req.chat ? "messages" : "prompt";
    if (req.chat) {
      RETURN_IF_ERROR(ToolsRunHere(req));
      if (req.tool_choice == "required" || req.tool_choice == "function") {  // a call must come
        req.grammar =
            ToolCallGrammar(ToolCallFormat(), req.tools, req.tool_choice, req.tool_choice_name,
                            req.parallel_tool_calls, MistralMarker().value_or(-1));
        req.grammar_param = "tool_choice";
      }
      ASSIGN_OR_RETURN(auto ids, prompt_builder->Chat(req, context));
      prompts.push_back(std::move(ids));
      for (int64_t id : chat.end_of_turn_ids()) req.params.stop_token_ids.push_back(id);
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
        if (req.echo && req.logprobs) g.prompt_logprobs = req.params.top_logprobs;
        if (compiled) g.constraint = compiled->Clone();
        if (!req.max_tokens_set && req.chat) {
          g.params.max_tokens = max_context - static_cast<int64_t>(ids.size());
        }
        seqs.push_back(std::move(g));
      }
    }
    auto streams = engine->SubmitGroup(seqs);
    if (!streams.ok()) {
      const absl::Status& s = streams.status();
      return s.code() == absl::StatusCode::kInvalidArgument && ErrorParam(s).empty()
                 ? BadParam("max_tokens", std::string(s.message()))
                 : s;
    }
    for (size_t k = 0; k < streams->size(); ++k) {
      const size_t p = k / req.best_of, j = k % req.best_of;
      const std::vector<int32_t>& ids = prompts[p];
      std::vector<int32_t> keep;  // the tool-call marker Mistral's parser reads
      if (req.tool_choice != "none" && ToolCallFormat() == "mistral") keep = {*MistralMarker()};
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
      if (req.tool_choice != "none") {
        c.tool_parser =
            std::make_unique<ToolCallParser>(ToolCallFormat(), req.tools, req.parallel_tool_calls);
      }
    }
    return absl::OkStatus();
  }

  // The format of the model's tool calls: the manifest's (spec.serving.toolCallParser), else the
  // one its chat template shows.
  std::string ToolCallFormat() const {
    return config.env.tool_call_parser.empty() ? chat.tool_call_format()
                                               : config.env.tool_call_parser;
  }

  // A request's tools (tool_choice "auto", "required" or a named function) need a template that
  // renders them and shows a call format we parse; tool_choice "none" renders the prompt without
  // them and parses nothing (as vLLM does by default).
  absl::Status ToolsRunHere(const ApiRequest& req) const {
    if (req.tool_choice == "none") return absl::OkStatus();
    if (!chat.renders_tools()) {
      return BadParam("tools", absl::StrCat("this model's chat template (", chat.source(),
                                            ") does not render tools"));
    }
    const std::string format = ToolCallFormat();
    if (format.empty()) {
      return BadParam("tools",
                      "this model's chat template shows no tool-call format shardserve parses "
                      "(Hermes <tool_call> JSON, Llama 3 JSON, Mistral [TOOL_CALLS]); "
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
  std::optional<int32_t> MistralMarker() const {
    std::optional<int32_t> id = tokenizer->TokenId("[TOOL_CALLS]");
    return id && tokenizer->IsSpecial(*id) ? id : std::nullopt;
  }

  json ChunkHeader(const ApiRequest& req, const std::string& id, int64_t created) const {
    return {{"id", id},
            {"object", req.chat ? "chat.completion.chunk" : "text_completion"},
            {"created", created},
            {"model", config.env.model_name}};
  }

  // A request's JSON body: its content type, its depth and its syntax checked.
  absl::StatusOr<ojson> Body(const http::Request& http_req) {
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

  // NotFound naming the model when it is not the one served.
  absl::Status Served(const std::string& model) const {
    if (model == config.env.model_name) return absl::OkStatus();
    absl::Status s = absl::NotFoundError(absl::StrCat("the model '", model,
                                                      "' does not exist; this server serves '",
                                                      config.env.model_name, "'"));
    s.SetPayload("type.shardserve.io/param", absl::Cord("model"));
    return s;
  }

  // POST /tokenize and /detokenize as vLLM serves them: a prompt (with add_special_tokens,
  // default true) or chat messages and tools (rendered as for /v1/chat/completions,
  // add_generation_prompt true) to {"count", "max_model_len", "tokens"}; token ids to {"prompt"}.
  // `model` may be left out.
  http::Response Tokenization(const http::Request& http_req, bool detokenize) {
    if (auto denied = Deny(http_req)) return *std::move(denied);
    absl::StatusOr<ojson> body = Body(http_req);
    if (!body.ok()) return Reply(body.status());
    absl::StatusOr<json> out = [&]() -> absl::StatusOr<json> {
      if (!body->is_object()) return BadParam("", "the request body must be a JSON object");
      if (auto m = body->find("model"); m != body->end() && !m->is_null()) {
        if (!m->is_string()) return BadParam("model", "'model' must be a string");
        RETURN_IF_ERROR(Served(m->get<std::string>()));
      }
      int64_t context, vocab;
      {
        absl::ReaderMutexLock lock(&engine_mu);
        if (engine == nullptr) return absl::UnavailableError(not_ready);
        context = max_context;
        vocab = vocab_size;
      }
      if (detokenize) {
        auto t = body->find("tokens");
        if (t == body->end() || !t->is_array() || t->size() > static_cast<size_t>(context)) {
          return BadParam(
              "tokens", absl::StrCat("'tokens' must be a list of at most ", context, " token ids"));
        }
        std::vector<int32_t> ids;
        for (const ojson& id : *t) {
          if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= vocab) {
            return BadParam("tokens",
                            absl::StrCat("'tokens' entries must be token ids in [0, ", vocab, ")"));
          }
          ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
        }
        return json{{"prompt", tokenizer->Decode(ids)}};
      }
      std::vector<int32_t> ids;
      bool add_special = !body->contains("messages");  // vLLM's defaults: prompt true, chat false
      if (auto a = body->find("add_special_tokens"); a != body->end() && !a->is_null()) {
        if (!a->is_boolean()) {
          return BadParam("add_special_tokens", "'add_special_tokens' must be a boolean");
        }
        add_special = a->get<bool>();
      }
      if (body->contains("messages")) {
        if (auto g = body->find("add_generation_prompt");
            g != body->end() && !(g->is_boolean() && g->get<bool>())) {
          return BadParam("add_generation_prompt",
                          "'add_generation_prompt' other than true is not supported: the chat "
                          "prompt ends where the assistant's reply begins");
        }
        ojson chat_body = *body;
        chat_body["model"] = config.env.model_name;
        ASSIGN_OR_RETURN(ApiRequest req, ParseApiRequest(chat_body, true));
        RETURN_IF_ERROR(ToolsRunHere(req));
        ASSIGN_OR_RETURN(ids, prompt_builder->Chat(req, context, add_special));
      } else {
        auto p = body->find("prompt");
        if (p == body->end() || !p->is_string()) {
          return BadParam("prompt", "'prompt' must be a string (or give 'messages')");
        }
        ASSIGN_OR_RETURN(
            ids, prompt_builder->Tokenize(p->get<std::string>(), add_special, context, "prompt"));
      }
      return json{{"count", ids.size()}, {"max_model_len", context}, {"tokens", ids}};
    }();
    if (!out.ok()) return Reply(out.status());
    return Json(*out);
  }

  // GET /v1/kv-events: the replica's cached block names and load for a router
  // (serve/kv_events.h), until the router leaves or the server stops.
  void KvEvents(const http::Request& http_req, http::Exchange& ex) {
    // Only a router reads them, with its token: an API key never does (the block names and
    // the load are the deployment's, not a tenant's), and without a token nobody does.
    if (router_keys == nullptr) {
      return ex.Respond(Reply(absl::PermissionDeniedError(
          "the KV events are read by the model's router only, and this server has no router "
          "token (SHARDSERVE_ROUTER_TOKEN_FILE)")));
    }
    if (absl::Status st = router_keys->Check(http_req.Header("authorization")); !st.ok()) {
      return ex.Respond(Reply(st));
    }
    int64_t block_size;
    {
      absl::ReaderMutexLock lock(&engine_mu);
      if (engine == nullptr) return ex.Respond(Reply(absl::UnavailableError(not_ready)));
      block_size = engine->options().kv_block_size;
    }
    metrics->CountRequest(200);
    if (!ex.StartStream({200, "application/x-ndjson", "", {{"Cache-Control", "no-cache"}}})) {
      return;
    }
    auto send = [&](const std::vector<std::string>& lines) {
      std::string out;
      for (const std::string& l : lines) absl::StrAppend(&out, l, "\n");
      return ex.Write(out);
    };
    uint64_t position = 0;
    auto snapshot = [&] { return send(EncodeKvSnapshot(kv_events.Snapshot(&position))); };
    if (!send({EncodeKvHello(config.env.model_name, block_size, epoch)}) || !snapshot()) return;
    constexpr auto kLoadEvery = std::chrono::milliseconds(200);
    auto next_load = Clock::now();
    for (;;) {
      std::vector<std::string> lines;
      if (Clock::now() >= next_load) {
        absl::ReaderMutexLock lock(&engine_mu);
        if (engine == nullptr || !engine->healthy()) break;  // the replica is gone
        ReplicaLoad l;
        l.waiting = static_cast<int64_t>(engine->queue_depth());
        l.running = engine->running();
        l.max_batch = engine->options().max_batch;
        l.kv_used = engine->kv_used_blocks();
        l.kv_blocks = engine->options().kv_blocks;
        l.accepting = engine->accepting();
        lines.push_back(EncodeKvLoad(l));
        next_load = Clock::now() + kLoadEvery;
      }
      std::vector<KvEvent> events;
      if (!kv_events.Since(&position, kLoadEvery, &events)) {  // fell behind: start again
        if (!send({EncodeKvReset()}) || !snapshot()) return;
        continue;
      }
      for (std::string& l : EncodeKvEvents(events)) lines.push_back(std::move(l));
      if (!lines.empty() && !send(lines)) return;
      if (ex.ClientGone()) return;
    }
    ex.End();
  }

  // POST /v1/completions and /v1/chat/completions, on a thread of their own.
  void Generate(const http::Request& http_req, http::Exchange& ex, bool chat) {
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
    if (absl::Status s = Served(req.model); !s.ok()) return ex.Respond(Reply(s));
    if (!req.seed_set)
      req.params.seed = std::random_device{}() * 4294967296ull + std::random_device{}();
    std::vector<Choice> choices;
    if (absl::Status s = Submit(req, http_req, choices); !s.ok()) return ex.Respond(Reply(s));
    const std::string id = RequestId(chat ? "chatcmpl-" : "cmpl-");
    const int64_t created = std::chrono::duration_cast<std::chrono::seconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count();
    if (req.stream) {
      Stream(req, choices, id, created, ex);
    } else {
      Answer(req, choices, id, created, ex);
    }
    for (Choice& c : choices) c.stream->Cancel();  // ended, or the client is gone
  }

  // A non-streamed answer: waits for every choice, cancelling them if the client goes away.
  void Answer(const ApiRequest& req, std::vector<Choice>& choices, const std::string& id,
              int64_t created, http::Exchange& ex) {
    std::vector<std::string> texts(choices.size());
    std::vector<std::vector<ToolCall>> calls(choices.size());
    for (;;) {
      bool all_done = true;
      for (size_t i = 0; i < choices.size(); ++i) {
        ChoiceDelta d = Poll(choices[i], req, all_done ? kPoll : std::chrono::milliseconds(0));
        texts[i] += d.text;
        for (ToolCall& piece : d.calls) {  // a call's pieces joined
          if (piece.index == static_cast<int>(calls[i].size())) {
            calls[i].push_back(std::move(piece));
          } else if (!calls[i].empty()) {
            calls[i].back().arguments += piece.arguments;
          }
        }
        all_done &= choices[i].done;
      }
      if (all_done) break;
      if (ex.ClientGone()) {
        metrics->CountRequest(499);  // the client closed the request; nobody reads an answer
        return;
      }
    }
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
  void Stream(const ApiRequest& req, std::vector<Choice>& choices, const std::string& id,
              int64_t created, http::Exchange& ex) {
    int code = 499;
    struct Count {
      LeaderMetrics& m;
      int& code;
      ~Count() { m.CountRequest(code); }
    } count{*metrics, code};
    if (!ex.StartStream({200, "text/event-stream", "", {{"Cache-Control", "no-cache"}}})) return;
    auto send = [&](const json& event) {
      return ex.Write(absl::StrCat("data: ", DumpJson(event), "\n\n"));
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
        if (!c.error.ok()) {
          code = HttpStatusFor(c.error);
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
          if (!d.text.empty() || !c.sent_role) delta["content"] = d.text;
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
};

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
  ASSIGN_OR_RETURN(impl->tokenizer, Tokenizer::Load(env.model_path));
  impl->chat = ChatTemplate::ForModel(env.model_path, *impl->tokenizer);
  impl->prompt_builder = std::make_unique<PromptBuilder>(impl->tokenizer.get(), &impl->chat,
                                                         env.special_tokens_as_text);
  impl->metrics = std::make_unique<LeaderMetrics>(*impl->own_registry, env.metrics_model(),
                                                  std::to_string(env.replica));
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
  // Tokenizing a long text takes a while: off the event loop, as generation is.
  routes.PostBlocking("/tokenize", [s](const http::Request& req, http::Exchange& ex) {
    ex.Respond(s->Tokenization(req, false));
  });
  routes.PostBlocking("/detokenize", [s](const http::Request& req, http::Exchange& ex) {
    ex.Respond(s->Tokenization(req, true));
  });
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
    return s->Json({{"object", "list"}, {"data", json::array({model})}});
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
    std::vector<prometheus::MetricFamily> families = s->own_registry->Collect();
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
    const std::function<void(std::shared_ptr<prometheus::Registry>)>& expose) {
  {
    absl::MutexLock lock(&impl_->registry_mu);
    impl_->rank_registry = std::move(rank);
  }
  if (expose) expose(impl_->own_registry);
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

EngineObserver ApiServer::Observer() {
  LeaderMetrics* m = impl_->metrics.get();
  EngineObserver o;
  o.queue_depth = [m](size_t d) { m->SetQueueDepth(static_cast<double>(d)); };
  o.first_token = [m](double s) { m->ObserveFirstToken(s); };
  o.inter_token = [m](double s) { m->ObserveInterToken(s); };
  o.generated = [m](int64_t n) { m->AddGenerated(static_cast<double>(n)); };
  o.grammar_mask = [m](double s) { m->ObserveGrammarMask(s); };
  o.prefix_lookup = [m](int64_t queried, int64_t hit) { m->CountPrefixLookup(queried, hit); };
  o.cache_blocks = [m](int64_t used, int64_t cached) { m->SetCacheBlocks(used, cached); };
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
