// GET /v1/kv-events: what the replica caches and its load, streamed to the model's router.
#include "absl/strings/str_cat.h"
#include "serve/api_server_impl.h"

namespace shardserve {

using api_internal::Clock;

// GET /v1/kv-events: the replica's cached block names and load for a router
// (serve/kv_events.h), until the router leaves or the server stops.
void ApiServer::Impl::KvEvents(const http::Request& http_req, http::Exchange& ex) {
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
      l.max_loras = engine->options().lora_slots;
      if (l.max_loras > 0) l.adapters = engine->resident_adapters();
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

}  // namespace shardserve
