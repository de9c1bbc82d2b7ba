#pragma once
// `shardserve bench load`: a load generator for the OpenAI-compatible API. Closed-loop clients at
// each concurrency level stream greedy completions of random token prompts and report output
// tokens/s, time to first token and inter-token latency (p50/p99), and, given the leader rank's
// /metrics, the share of a batch-1 decode step spent outside the rank's forward pass (HTTP,
// scheduling and sampling). With --turns T each client's requests are conversations: every turn
// resends the shared start and the conversation's history so far (its earlier prompts and as
// many tokens as each answer held) with new tokens of its own, and the prefix cache's hit rate
// (usage.prompt_tokens_details.cached_tokens over prompt tokens) is reported, overall and past
// the shared start ("own": the conversations' own tokens, which only the replica that served
// the conversation before can hold). With several
// --url addresses each request goes to one of them at random, as a plain Kubernetes Service
// spreads connections.
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardserve {

absl::Status RunLoadBench(const std::vector<std::string>& argv);
inline constexpr char kLoadBenchUsage[] =
    "[--url HOST:PORT[,HOST:PORT...] --model NAME --concurrency 1,4,16 --requests-per-client N\n"
    "--turns T --max-tokens N --prompt-tokens N --shared-prefix-tokens N --vocab N\n"
    "--rank-metrics HOST:PORT --api-key KEY]\n"
    "(concurrent clients against a served model; every prompt starts with the same shared "
    "tokens)";

}  // namespace shardserve
