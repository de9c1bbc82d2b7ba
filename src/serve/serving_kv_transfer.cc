// Disaggregated serving's two legs on a leader (serve/kv_handoff.h): the prefill leg answers
// with the handoff once every sequence has its first token; the decode leg starts each sequence
// from the handoff's first token and KV.
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "serve/api_server_impl.h"

namespace shardserve {

absl::Status ApiServer::Impl::KvLeg(ApiRequest& req, const http::Request& http_req,
                                    std::optional<KvHandoff>* handoff) {
  if (req.kv_transfer.is_null()) return absl::OkStatus();
  // Only the model's router asks for an offer or hands one over.
  if (router_keys == nullptr) {
    return absl::PermissionDeniedError(
        "'kv_transfer_params' is the model's router's, and this server has no router token "
        "(SHARDSERVE_ROUTER_TOKEN_FILE)");
  }
  if (absl::Status s = router_keys->Check(http_req.Header(kRouterHeader)); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("'kv_transfer_params' needs the router's token in ",
                                               kRouterHeader, ": ", s.message()));
  }
  const bool prefill = req.kv_transfer.contains("do_remote_decode");
  const std::string role = prefill ? "prefill" : "decode";
  if (config.env.kv_role != role) {
    return BadParam("kv_transfer_params",
                    absl::StrCat("this is not a ", role, " replica (SHARDSERVE_KV_ROLE is '",
                                 config.env.kv_role, "')"));
  }
  if (req.echo && req.logprobs) {  // every prompt row is computed on the replica that answers
    return BadParam("kv_transfer_params",
                    "a disaggregated request cannot score its prompt (echo with logprobs)");
  }
  if (prefill && req.stream) {  // the handoff is one answer
    return BadParam("stream",
                    "a prefill leg (kv_transfer_params do_remote_decode) answers the "
                    "handoff whole: 'stream' must be false");
  }
  if (prefill) return absl::OkStatus();
  ASSIGN_OR_RETURN(KvHandoff h, DecodeKvHandoff(req.kv_transfer));
  req.params.seed = h.seed;  // the samplers go on from the prefill replica's streams
  req.seed_set = true;
  *handoff = std::move(h);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<SequenceKvRole>> ApiServer::Impl::KvRoles(
    const ApiRequest& req, const std::optional<KvHandoff>& handoff, size_t n) {
  std::vector<SequenceKvRole> roles(n);
  if (!handoff) {  // the prefill leg
    for (SequenceKvRole& r : roles) r.offer = true;
    return roles;
  }
  if (handoff->sequences.size() != n) {
    return BadParam("kv_transfer_params",
                    absl::StrCat("'kv_transfer_params' hands over ", handoff->sequences.size(),
                                 " sequences; the request has ", n));
  }
  for (size_t i = 0; i < n; ++i) {
    auto source = std::make_shared<SequenceKvRole::Source>();
    const KvHandoff::Sequence& s = handoff->sequences[i];
    source->ticket = s.ticket.value_or(KvTicket{});  // none: the first token ends it
    source->shape = handoff->shape;
    source->addresses = handoff->addresses;
    source->first = s.first;
    if (static_cast<int64_t>(source->first.top.size()) > req.params.top_logprobs) {
      source->first.top.resize(req.params.top_logprobs);
    }
    roles[i].import = std::move(source);
  }
  return roles;
}

void ApiServer::Impl::AnswerKvOffer(const ApiRequest& req,
                                    const std::vector<std::shared_ptr<RequestStream>>& seqs,
                                    http::Exchange& ex) {
  KvHandoff h;
  {
    absl::ReaderMutexLock lock(&engine_mu);
    h.shape = kv_shape;
    h.addresses = kv_addresses;
  }
  h.seed = req.params.seed;
  // Nobody will take the offers made so far (the router left, a sequence failed): freed now.
  auto give_up = [&] {
    absl::ReaderMutexLock lock(&engine_mu);
    for (const KvHandoff::Sequence& s : h.sequences) {
      if (s.ticket && engine != nullptr) engine->ReleaseOffer(*s.ticket);
    }
  };
  for (const auto& s : seqs) {
    RequestStream::Update all;
    while (!all.finished) {
      if (ex.ClientGone()) {
        h.sequences.push_back({s->kv_offer(), {}});  // cancelled by the caller, or offered
        return give_up();
      }
      RequestStream::Update u = s->Next(std::chrono::milliseconds(200));
      for (RequestStream::Token& t : u.tokens) all.tokens.push_back(std::move(t));
      all.finished = u.finished;
      all.status = u.status;
    }
    h.sequences.push_back({s->kv_offer(), {}});
    if (!all.status.ok() || all.tokens.size() != 1) {
      give_up();
      return ex.Respond(Reply(!all.status.ok() ? all.status
                                               : absl::InternalError(absl::StrCat(
                                                     "a prefilled sequence ended with ",
                                                     all.tokens.size(), " tokens, not one"))));
    }
    h.sequences.back().first = std::move(all.tokens[0]);
  }
  metrics->CountRequest(200);
  ex.Respond({200, "application/json", DumpJson({{"kv_transfer_params", EncodeKvHandoff(h)}}), {}});
}

}  // namespace shardserve
