#pragma once
// What a generation asks for and what it gives back: shared by the engine (serve/engine.h), the
// single-process generator (model/generator.h) and the CLI, without the transformer behind them.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "model/sampler.h"

namespace shardserve {

// A rule the generated tokens must follow (structured output: serve/grammar.h), kept by the
// leader's engine: before each sampled token it gives the ids allowed next, after it takes the
// token. One sequence's, used by one thread at a time (Cancel excepted).
class TokenConstraint {
 public:
  virtual ~TokenConstraint() = default;
  // From any thread: a running or later Allowed / Accept gives up at once with an error (the
  // sequence is over: its mask took too long, or it was cancelled).
  virtual void Cancel() {}
  // The allowed ids as a bit mask: bit i % 32 of word i / 32 for token i (ids past the mask are
  // not allowed).
  virtual absl::Status Allowed(std::vector<uint32_t>* mask) = 0;
  virtual absl::Status Accept(int32_t token) = 0;
  // The rule is complete and allows nothing more: the generation ends here.
  virtual bool Finished() const = 0;
  // An independent copy in the same state (one compiled grammar for a request's sequences).
  virtual std::unique_ptr<TokenConstraint> Clone() const = 0;
};

struct GenerationRequest {
  std::vector<int32_t> prompt_ids;
  SamplingParams params;
  std::shared_ptr<TokenConstraint> constraint;  // null: any token
  // The prompt's log-probabilities (echo with logprobs): each prompt token after the first with
  // this many alternatives; -1: none. The prompt is then computed whole (no cached prefix).
  int64_t prompt_logprobs = -1;
  // Salts the names of its KV blocks (serve/prefix_cache.h: PrefixCacheSalt): it shares cached
  // blocks only with sequences of the same salt.
  std::string cache_salt;
  // The LoRA adapter it runs (Engine::AdapterOf: its id in the replica's AdapterRegistry); -1:
  // the base model. Its cache_salt names the adapter, so that no KV block computed under one
  // adapter is shared with another.
  int64_t adapter = -1;
  // Flow control (serve/flow_control.h): vLLM's priority (lower runs first, and is preempted
  // last under memory pressure); the tenant (its API key's) and its weight: within a priority,
  // the batch is shared between tenants in proportion to their weights. An empty tenant: the
  // request is a tenant of its own.
  int64_t priority = 0;
  std::string tenant;
  double weight = 1.0;
  // Request migration: the output another replica produced before it failed (the client has
  // it). The sequence goes on after it, its prompt and these tokens computed here, its sampler
  // past their draws, its constraint past them; they count toward max_tokens and the penalties
  // and are not produced again. Empty: a new sequence.
  std::vector<int32_t> resumed;
  // Speculative decoding (EngineOptions::speculative): false opts the request out.
  bool speculative = true;
};

struct GenerationResult {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<std::vector<TokenLogprob>> top_logprobs;
  std::string finish_reason;  // "stop" or "length"
  // With prompt_logprobs: the prompt's tokens after the first, each with its log-probability and
  // alternatives.
  std::vector<SampledToken> prompt_logprobs;
};

}  // namespace shardserve
