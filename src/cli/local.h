#pragma once
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace shardserve {

// `shardserve local -f MANIFEST [--port N --metrics-port-base N --threads N --api-key-file F]`:
// runs the manifest's replicas on this machine until Ctrl-C / SIGTERM or a rank fails. Every
// replica gets a fresh rendezvous secret; the API takes the keys of --api-key-file (or
// SHARDSERVE_API_KEY / SHARDSERVE_API_KEYS_FILE), which a manifest with apiKeySecret needs.
absl::Status RunLocal(std::vector<std::string> argv);
inline constexpr char kLocalUsage[] =
    "-f MANIFEST.yaml [--port N --metrics-port-base N --threads N --api-key-file FILE\n"
    "--router-token-file FILE --admin-key-file FILE --flow-control-file FILE --no-router]\n"
    "(a ShardedModel on this machine: its replicas, stages and ranks as processes, the OpenAI API\n"
    "on http://127.0.0.1:PORT/v1: with several replicas, shardserve-router there in front of\n"
    "them (PORT + 1 + r), unless --no-router (then replica r on PORT + r); the router token\n"
    "(its proof to the leaders, and what reads its /metrics) from FILE, else a new secret;\n"
    "the admins' keys that load LoRA adapters at runtime (from spec.lora.source) from\n"
    "--admin-key-file; the tenants' classes and limits (spec.serving.flowControl's config) from\n"
    "--flow-control-file; a replica that fails after it served is restarted; Ctrl-C stops)";

}  // namespace shardserve
