#pragma once
// Disaggregated serving over HTTP: how a request crosses from a prefill replica to a decode
// replica, in vLLM's field `kv_transfer_params` (its meaning ours). The router sends the client's
// request to a prefill replica with {"do_remote_decode": true}; the prefill replica computes each
// sequence's prompt and first token, offers the KV under a ticket per sequence and answers with
// the handoff: the prompt KV's shape, its ranks' exporter addresses, the seed its samplers
// started from and, per sequence, the ticket and the first token. The router sends the client's
// request again to a decode replica, with the handoff and "do_remote_prefill": true; every rank
// there pulls its heads and layers (serve/kv_layout.h) and the sequence decodes from the first
// token. Both legs need the router's token (header kRouterHeader): a ticket holds a prefill
// replica's KV cache, and a handoff makes a decode replica connect where it says.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "serve/engine.h"

namespace shardserve {

// The router's proof on a leg of a disaggregated request: "Bearer <router token>".
inline constexpr char kRouterHeader[] = "x-shardserve-router";

struct KvHandoff {
  KvRoleShape shape;
  std::vector<std::string> addresses;  // by prefill rank (stage * tp + tp_rank)
  uint64_t seed = 0;                   // the request's (given or drawn on the prefill replica)
  struct Sequence {
    std::optional<KvTicket> ticket;  // none: the first token ended the sequence
    RequestStream::Token first{};
  };
  std::vector<Sequence> sequences;  // the request's, in order (prompts x best_of)
};

nlohmann::json EncodeKvHandoff(const KvHandoff& handoff);
// A handoff from a request body: every field checked and bounded (at most 4096 prefill ranks and
// sequences, 20 alternatives per first token); InvalidArgument naming what is wrong.
absl::StatusOr<KvHandoff> DecodeKvHandoff(const nlohmann::json& params);

}  // namespace shardserve
