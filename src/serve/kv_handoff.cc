#include "serve/kv_handoff.h"

#include <cmath>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "comm/json_frame.h"
#include "common/status.h"
#include "serve/step_wire.h"

namespace shardserve {
namespace {

using json = nlohmann::json;
constexpr size_t kMaxRanks = 4096, kMaxSequences = 4096, kMaxTop = 20;

absl::StatusOr<RequestStream::Token> DecodeToken(const json& t) {
  if (!t.is_object()) return absl::InvalidArgumentError("a first token is not an object");
  RequestStream::Token out{};
  ASSIGN_OR_RETURN(const int64_t id, JsonInt(t, "id", 0, INT32_MAX));
  out.id = static_cast<int32_t>(id);
  ASSIGN_OR_RETURN(const double logprob, JsonNumber(t, "logprob"));
  out.logprob = static_cast<float>(logprob);
  ASSIGN_OR_RETURN(const json* top, JsonArray(t, "top"));
  if (top->size() > kMaxTop) {
    return absl::InvalidArgumentError(
        absl::StrCat("a first token with ", top->size(), " alternatives (at most ", kMaxTop, ")"));
  }
  for (const json& a : *top) {
    if (!a.is_array() || a.size() != 2 || !a[0].is_number_integer() || !a[1].is_number() ||
        a[0].get<int64_t>() < 0 || a[0].get<int64_t>() > INT32_MAX) {
      return absl::InvalidArgumentError("a first token's alternative is not [id, logprob]");
    }
    out.top.push_back({static_cast<int32_t>(a[0].get<int64_t>()), a[1].get<float>()});
  }
  return out;
}

}  // namespace

json EncodeKvHandoff(const KvHandoff& h) {
  json addresses = json::array();
  for (const std::string& a : h.addresses) addresses.push_back(absl::Base64Escape(a));
  json sequences = json::array();
  for (const KvHandoff::Sequence& s : h.sequences) {
    json top = json::array();
    for (const TokenLogprob& t : s.first.top) top.push_back({t.id, t.logprob});
    // -inf (a token the mask forbade, as logged) is not JSON: the lowest float stands for it.
    const float logprob = std::isfinite(s.first.logprob) ? s.first.logprob : -3.0e38f;
    json seq = {{"first", {{"id", s.first.id}, {"logprob", logprob}, {"top", std::move(top)}}}};
    if (s.ticket) seq["ticket"] = KvTicketHex(*s.ticket);
    sequences.push_back(std::move(seq));
  }
  return {{"do_remote_prefill", true},
          {"shape", EncodeKvRoleShape(h.shape)},
          {"addresses", std::move(addresses)},
          {"seed", h.seed},
          {"sequences", std::move(sequences)}};
}

absl::StatusOr<KvHandoff> DecodeKvHandoff(const json& j) {
  KvHandoff h;
  absl::Status s = [&]() -> absl::Status {
    if (!j.is_object()) return absl::InvalidArgumentError("it is not an object");
    auto shape = j.find("shape");
    if (shape == j.end()) return absl::InvalidArgumentError("'shape' is missing");
    ASSIGN_OR_RETURN(h.shape, DecodeKvRoleShape(*shape));
    ASSIGN_OR_RETURN(const json* addresses, JsonArray(j, "addresses"));
    const size_t ranks = static_cast<size_t>(h.shape.tp) * h.shape.stages.size();
    if (ranks > kMaxRanks || addresses->size() != ranks) {
      return absl::InvalidArgumentError(absl::StrCat(addresses->size(), " addresses for ", ranks,
                                                     " prefill ranks (at most ", kMaxRanks, ")"));
    }
    for (const json& a : *addresses) {
      std::string bytes;
      if (!a.is_string() || a.get_ref<const std::string&>().size() > (1 << 16) ||
          !absl::Base64Unescape(a.get<std::string>(), &bytes) || bytes.empty()) {
        return absl::InvalidArgumentError("an address is not base64 of at most 48 KiB");
      }
      h.addresses.push_back(std::move(bytes));
    }
    auto seed = j.find("seed");
    if (seed == j.end() || !seed->is_number_unsigned()) {
      return absl::InvalidArgumentError("'seed' is missing or not an unsigned integer");
    }
    h.seed = seed->get<uint64_t>();
    ASSIGN_OR_RETURN(const json* sequences, JsonArray(j, "sequences"));
    if (sequences->empty() || sequences->size() > kMaxSequences) {
      return absl::InvalidArgumentError(
          absl::StrCat(sequences->size(), " sequences (1 to ", kMaxSequences, ")"));
    }
    for (const json& seq : *sequences) {
      if (!seq.is_object()) return absl::InvalidArgumentError("a sequence is not an object");
      KvHandoff::Sequence out;
      auto first = seq.find("first");
      if (first == seq.end()) return absl::InvalidArgumentError("a sequence has no 'first'");
      ASSIGN_OR_RETURN(out.first, DecodeToken(*first));
      if (seq.contains("ticket")) {
        ASSIGN_OR_RETURN(const std::string hex, JsonString(seq, "ticket", 64));
        ASSIGN_OR_RETURN(out.ticket, KvTicketFromHex(hex));
      }
      h.sequences.push_back(std::move(out));
    }
    return absl::OkStatus();
  }();
  if (!s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("'kv_transfer_params': ", s.message()));
  }
  return h;
}

}  // namespace shardserve
