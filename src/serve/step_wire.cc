#include "serve/step_wire.h"

#include <algorithm>
#include <cctype>
#include <limits>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "comm/json_frame.h"
#include "common/status.h"

namespace shardserve {
namespace {

using json = nlohmann::json;
constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxInt64 = std::numeric_limits<int64_t>::max();

absl::Status In(const std::string& where, const absl::Status& s) {
  return absl::DataLossError(absl::StrCat(where, ": ", s.message()));
}

}  // namespace

json EncodeSamplingParams(const SamplingParams& p) {
  json j = {{"temperature", p.temperature},
            {"top_p", p.top_p},
            {"top_k", p.top_k},
            {"seed", p.seed},
            {"top_logprobs", p.top_logprobs}};
  json bias_ids = json::array(), biases = json::array();
  for (const auto& [id, bias] : p.logit_bias) {
    bias_ids.push_back(id);
    biases.push_back(bias);
  }
  j["bias_ids"] = std::move(bias_ids);
  j["biases"] = std::move(biases);
  j["min_tokens"] = p.min_tokens;
  j["end_ids"] = p.end_ids;
  j["repetition_penalty"] = p.repetition_penalty;
  j["frequency_penalty"] = p.frequency_penalty;
  j["presence_penalty"] = p.presence_penalty;
  return j;
}

absl::StatusOr<SamplingParams> DecodeSamplingParams(const json& j) {
  if (!j.is_object()) return absl::DataLossError("'params' is not an object");
  SamplingParams p;
  ASSIGN_OR_RETURN(double temperature, JsonNumber(j, "temperature"));
  ASSIGN_OR_RETURN(double top_p, JsonNumber(j, "top_p"));
  ASSIGN_OR_RETURN(p.top_k, JsonInt(j, "top_k", 0, kMaxInt64));
  ASSIGN_OR_RETURN(p.top_logprobs, JsonInt(j, "top_logprobs", 0, kMaxInt32));
  auto seed = j.find("seed");
  if (seed == j.end() || !seed->is_number_unsigned()) {
    return absl::DataLossError("'seed' is missing or not an unsigned integer");
  }
  p.seed = seed->get<uint64_t>();
  p.temperature = static_cast<float>(temperature);
  p.top_p = static_cast<float>(top_p);
  {  // the logits' processing
    ASSIGN_OR_RETURN(const std::vector<int64_t> ids, JsonInts(j, "bias_ids", 0, kMaxInt32));
    ASSIGN_OR_RETURN(const json* biases, JsonArray(j, "biases"));
    if (biases->size() != ids.size()) {
      return absl::DataLossError("'bias_ids' and 'biases' differ in length");
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      if (!(*biases)[i].is_number()) return absl::DataLossError("a bias is not a number");
      p.logit_bias.emplace_back(static_cast<int32_t>(ids[i]), (*biases)[i].get<float>());
    }
    ASSIGN_OR_RETURN(p.min_tokens, JsonInt(j, "min_tokens", 0, kMaxInt64));
    ASSIGN_OR_RETURN(p.end_ids, JsonInts(j, "end_ids", 0, kMaxInt32));
    ASSIGN_OR_RETURN(const double repetition, JsonNumber(j, "repetition_penalty"));
    ASSIGN_OR_RETURN(const double frequency, JsonNumber(j, "frequency_penalty"));
    ASSIGN_OR_RETURN(const double presence, JsonNumber(j, "presence_penalty"));
    p.repetition_penalty = static_cast<float>(repetition);
    p.frequency_penalty = static_cast<float>(frequency);
    p.presence_penalty = static_cast<float>(presence);
  }
  RETURN_IF_ERROR(p.Validate());
  return p;
}

namespace {

absl::StatusOr<std::vector<int64_t>> Int64s(const json& m, const char* key) {
  return JsonInts(m, key, std::numeric_limits<int64_t>::min(), kMaxInt64);
}

}  // namespace

json EncodeStep(const StepDesc& d) {
  json chunks = json::array();
  for (const StepChunk& c : d.chunks) {
    json ch = {{"seq", c.seq}, {"tokens", c.tokens}, {"sample", c.sample}, {"blocks", c.blocks}};
    if (!c.allowed.empty()) {  // the mask's words, little-endian, in base64
      std::string bytes(c.allowed.size() * 4, '\0');
      for (size_t i = 0; i < c.allowed.size(); ++i) {
        for (int b = 0; b < 4; ++b) bytes[4 * i + b] = static_cast<char>(c.allowed[i] >> (8 * b));
      }
      ch["allowed"] = absl::Base64Escape(bytes);
    }
    if (!c.score.empty()) {
      ch["score_from"] = c.score_from;
      ch["score"] = c.score;
      ch["score_top"] = c.score_top;
    }
    if (c.params) {
      ch["params"] = EncodeSamplingParams(*c.params);
      ch["draws"] = c.draws;
      ch["prompt_tokens"] = c.prompt_tokens;
      ch["start"] = c.start;
      ch["cached"] = c.cached;
      if (!c.history.empty()) ch["history"] = c.history;
    }
    if (c.offer) ch["offer"] = KvTicketHex(*c.offer);
    if (c.lora_slot >= 0) ch["lora"] = c.lora_slot;
    if (c.drafts > 0) ch["drafts"] = c.drafts;
    if (c.rewind > 0) ch["rewind"] = c.rewind;
    if (c.next >= 0) ch["next"] = c.next;
    chunks.push_back(std::move(ch));
  }
  return {{"type", "step"}, {"mb", d.microbatch}, {"chunks", chunks}, {"release", d.release}};
}

json EncodePing() { return {{"type", "ping"}}; }
json EncodeStop() { return {{"type", "stop"}}; }

absl::StatusOr<StepMessageType> DecodeStepMessageType(const json& m) {
  auto type = JsonString(m, "type", 16);
  if (!type.ok()) return In("a step message", type.status());
  if (*type == "step") return StepMessageType::kStep;
  if (*type == "ping") return StepMessageType::kPing;
  if (*type == "stop") return StepMessageType::kStop;
  if (*type == "kv_import") return StepMessageType::kKvImport;
  if (*type == "lora") return StepMessageType::kLora;
  return absl::DataLossError(absl::StrCat("a step message of unknown type '", *type, "'"));
}

absl::StatusOr<StepDesc> DecodeStep(const json& m) {
  StepDesc d;
  absl::Status s = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(int64_t mb, JsonInt(m, "mb", 0, kMaxInt32));
    d.microbatch = static_cast<int>(mb);
    ASSIGN_OR_RETURN(d.release, Int64s(m, "release"));
    ASSIGN_OR_RETURN(const json* chunks, JsonArray(m, "chunks"));
    for (const json& ch : *chunks) {
      if (!ch.is_object()) return absl::DataLossError("a chunk is not an object");
      StepChunk c;
      ASSIGN_OR_RETURN(c.seq, JsonInt(ch, "seq", 0, kMaxInt64));
      ASSIGN_OR_RETURN(c.sample, JsonBool(ch, "sample"));
      ASSIGN_OR_RETURN(std::vector<int64_t> tokens, Int64s(ch, "tokens"));
      for (int64_t t : tokens) {
        if (t < 0 || t > kMaxInt32) {
          return absl::DataLossError(
              absl::StrCat("chunk of sequence ", c.seq, ": token ", t, " is out of range"));
        }
        c.tokens.push_back(static_cast<int32_t>(t));
      }
      ASSIGN_OR_RETURN(std::vector<int64_t> blocks, JsonInts(ch, "blocks", 0, kMaxInt32));
      c.blocks.assign(blocks.begin(), blocks.end());
      if (ch.contains("lora")) {  // the model checks the slot holds an adapter
        ASSIGN_OR_RETURN(const int64_t slot, JsonInt(ch, "lora", 0, kMaxInt32));
        c.lora_slot = static_cast<int32_t>(slot);
      }
      if (ch.contains("drafts")) {
        ASSIGN_OR_RETURN(c.drafts, JsonInt(ch, "drafts", 1, kMaxInt32));
        if (!c.sample || c.drafts >= static_cast<int64_t>(c.tokens.size())) {
          return absl::DataLossError(absl::StrCat("chunk of sequence ", c.seq, ": ", c.drafts,
                                                  " drafts in a chunk of ", c.tokens.size(),
                                                  c.sample ? " tokens" : " tokens not sampled"));
        }
      }
      if (ch.contains("rewind")) {
        ASSIGN_OR_RETURN(c.rewind, JsonInt(ch, "rewind", 1, kMaxInt32));
      }
      if (ch.contains("next")) {  // the model checks it is in the vocabulary
        ASSIGN_OR_RETURN(const int64_t next, JsonInt(ch, "next", 0, kMaxInt32));
        if (c.sample) {
          return absl::DataLossError(absl::StrCat(
              "chunk of sequence ", c.seq, ": a sampled chunk's next token is its sampling's"));
        }
        c.next = static_cast<int32_t>(next);
      }
      if (auto allowed = ch.find("allowed"); allowed != ch.end()) {
        std::string bytes;
        if (!allowed->is_string() || !absl::Base64Unescape(allowed->get<std::string>(), &bytes) ||
            bytes.empty() || bytes.size() % (4 * (1 + c.drafts)) != 0 || !c.sample) {
          return absl::DataLossError(absl::StrCat("chunk of sequence ", c.seq,
                                                  ": 'allowed' is not the base64 masks of its ",
                                                  1 + c.drafts, " sampled rows"));
        }
        c.allowed.resize(bytes.size() / 4);
        for (size_t i = 0; i < c.allowed.size(); ++i) {
          for (int b = 0; b < 4; ++b) {
            c.allowed[i] |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[4 * i + b]))
                            << (8 * b);
          }
        }
      }
      if (ch.contains("score")) {
        ASSIGN_OR_RETURN(std::vector<int64_t> score, JsonInts(ch, "score", 0, kMaxInt32));
        ASSIGN_OR_RETURN(c.score_from, JsonInt(ch, "score_from", 0, kMaxInt64));
        ASSIGN_OR_RETURN(c.score_top, JsonInt(ch, "score_top", 0, kMaxInt32));
        if (score.empty() || c.score_from > static_cast<int64_t>(c.tokens.size()) ||
            static_cast<int64_t>(score.size()) >
                static_cast<int64_t>(c.tokens.size()) - c.score_from) {
          return absl::DataLossError(absl::StrCat("chunk of sequence ", c.seq, ": ", score.size(),
                                                  " scored rows from row ", c.score_from,
                                                  " of a chunk of ", c.tokens.size()));
        }
        c.score.assign(score.begin(), score.end());
      }
      if (auto params = ch.find("params"); params != ch.end()) {
        auto p = DecodeSamplingParams(*params);
        if (!p.ok()) return In(absl::StrCat("chunk of sequence ", c.seq), p.status());
        c.params = *p;
        ASSIGN_OR_RETURN(c.draws, JsonInt(ch, "draws", 0, kMaxInt64));
        ASSIGN_OR_RETURN(c.prompt_tokens, JsonInt(ch, "prompt_tokens", 0, kMaxInt64));
        ASSIGN_OR_RETURN(c.start, JsonInt(ch, "start", 0, kMaxInt64));
        ASSIGN_OR_RETURN(std::vector<int64_t> cached, JsonInts(ch, "cached", 0, kMaxInt32));
        c.cached.assign(cached.begin(), cached.end());
        if (ch.contains("history")) {
          ASSIGN_OR_RETURN(std::vector<int64_t> history, JsonInts(ch, "history", 0, kMaxInt32));
          if (static_cast<int64_t>(history.size()) != c.start) {
            return absl::DataLossError(absl::StrCat("chunk of sequence ", c.seq, ": a history of ",
                                                    history.size(), " tokens for a start of ",
                                                    c.start));
          }
          c.history.assign(history.begin(), history.end());
        }
      }
      if (ch.contains("offer")) {
        ASSIGN_OR_RETURN(const std::string hex, JsonString(ch, "offer", 64));
        auto ticket = KvTicketFromHex(hex);
        if (!ticket.ok()) return In(absl::StrCat("chunk of sequence ", c.seq), ticket.status());
        c.offer = *ticket;
      }
      d.chunks.push_back(std::move(c));
    }
    return absl::OkStatus();
  }();
  if (!s.ok()) return In("a malformed step", s);
  return d;
}

std::string KvTicketHex(const KvTicket& t) {
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(t.data()), t.size()));
}

absl::StatusOr<KvTicket> KvTicketFromHex(const std::string& hex) {
  KvTicket t{};
  if (hex.size() != 2 * t.size() ||
      !std::all_of(hex.begin(), hex.end(), [](char c) { return std::isxdigit(c) != 0; })) {
    return absl::InvalidArgumentError(
        absl::StrCat("a KV ticket is ", 2 * t.size(), " hex digits, not '",
                     hex.substr(0, 2 * t.size() + 1), hex.size() > 2 * t.size() ? "...'" : "'"));
  }
  const std::string bytes = absl::HexStringToBytes(hex);
  std::copy(bytes.begin(), bytes.end(), t.begin());
  return t;
}

json EncodeKvRoleShape(const KvRoleShape& shape) {
  json stages = json::array();
  for (const auto& [b, e] : shape.stages) stages.push_back({b, e});
  return {{"tp", shape.tp},         {"stages", std::move(stages)},    {"kv_heads", shape.kv_heads},
          {"latent", shape.latent}, {"block_size", shape.block_size}, {"dtype", shape.dtype}};
}

absl::StatusOr<KvRoleShape> DecodeKvRoleShape(const json& j) {
  if (!j.is_object()) return absl::InvalidArgumentError("a KV shape is not an object");
  KvRoleShape shape;
  ASSIGN_OR_RETURN(const int64_t tp, JsonInt(j, "tp", 1, 1 << 16));
  shape.tp = static_cast<int>(tp);
  ASSIGN_OR_RETURN(shape.kv_heads, JsonInt(j, "kv_heads", 1, 1 << 20));
  ASSIGN_OR_RETURN(shape.latent, JsonBool(j, "latent"));
  ASSIGN_OR_RETURN(shape.block_size, JsonInt(j, "block_size", 1, 1 << 20));
  const auto dtype = j.find("dtype");
  if (dtype == j.end() || !dtype->is_string() || dtype->get<std::string>().size() > 16) {
    return absl::InvalidArgumentError("a KV shape without its dtype");
  }
  shape.dtype = dtype->get<std::string>();
  ASSIGN_OR_RETURN(const json* stages, JsonArray(j, "stages"));
  if (stages->empty() || stages->size() > (1 << 16)) {
    return absl::InvalidArgumentError(absl::StrCat("a KV shape of ", stages->size(), " stages"));
  }
  for (const json& st : *stages) {
    if (!st.is_array() || st.size() != 2 || !st[0].is_number_integer() ||
        !st[1].is_number_integer() || st[0].get<int64_t>() < 0 ||
        st[1].get<int64_t>() <= st[0].get<int64_t>() || st[1].get<int64_t>() > (1 << 20)) {
      return absl::InvalidArgumentError("a KV shape's stage is not [begin, end) of layers");
    }
    shape.stages.emplace_back(st[0].get<int64_t>(), st[1].get<int64_t>());
  }
  return shape;
}

json EncodeKvImport(const KvImport& im) {
  json addresses = json::array();
  for (const std::string& a : im.addresses) addresses.push_back(absl::Base64Escape(a));
  return {{"type", "kv_import"},
          {"seq", im.seq},
          {"ticket", KvTicketHex(im.ticket)},
          {"source", EncodeKvRoleShape(im.source)},
          {"addresses", std::move(addresses)},
          {"positions", im.positions},
          {"blocks", im.blocks},
          {"skip_blocks", im.skip_blocks}};
}

absl::StatusOr<KvImport> DecodeKvImport(const json& m) {
  KvImport im;
  absl::Status s = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(im.seq, JsonInt(m, "seq", 0, kMaxInt64));
    ASSIGN_OR_RETURN(const std::string hex, JsonString(m, "ticket", 64));
    ASSIGN_OR_RETURN(im.ticket, KvTicketFromHex(hex));
    auto source = m.find("source");
    if (source == m.end()) return absl::DataLossError("'source' is missing");
    ASSIGN_OR_RETURN(im.source, DecodeKvRoleShape(*source));
    ASSIGN_OR_RETURN(const json* addresses, JsonArray(m, "addresses"));
    const size_t ranks = static_cast<size_t>(im.source.tp) * im.source.stages.size();
    if (addresses->size() != ranks) {
      return absl::DataLossError(
          absl::StrCat(addresses->size(), " exporter addresses for ", ranks, " prefill ranks"));
    }
    for (const json& a : *addresses) {
      std::string bytes;
      if (!a.is_string() || a.get_ref<const std::string&>().size() > (1 << 16) ||
          !absl::Base64Unescape(a.get<std::string>(), &bytes) || bytes.empty()) {
        return absl::DataLossError("an exporter address is not base64 of at most 48 KiB");
      }
      im.addresses.push_back(std::move(bytes));
    }
    ASSIGN_OR_RETURN(im.positions, JsonInt(m, "positions", 1, kMaxInt32));
    ASSIGN_OR_RETURN(const std::vector<int64_t> blocks, JsonInts(m, "blocks", 0, kMaxInt32));
    im.blocks.assign(blocks.begin(), blocks.end());
    ASSIGN_OR_RETURN(im.skip_blocks,
                     JsonInt(m, "skip_blocks", 0, static_cast<int64_t>(im.blocks.size())));
    return absl::OkStatus();
  }();
  if (!s.ok()) return In("a malformed KV import", s);
  return im;
}

namespace {
constexpr const char* kLoraOps[] = {"prepare", "install", "evict", "forget"};
}  // namespace

json EncodeLoraOrder(const LoraOrder& o) {
  json m = {{"type", "lora"}, {"op", kLoraOps[static_cast<int>(o.op)]}, {"id", o.id}};
  if (o.op == LoraOrder::Op::kPrepare) m["path"] = o.path;
  if (o.op == LoraOrder::Op::kInstall || o.op == LoraOrder::Op::kEvict) m["slot"] = o.slot;
  return m;
}

absl::StatusOr<LoraOrder> DecodeLoraOrder(const json& m) {
  LoraOrder o;
  absl::Status s = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(const std::string op, JsonString(m, "op", 16));
    const auto* at = std::find(std::begin(kLoraOps), std::end(kLoraOps), op);
    if (at == std::end(kLoraOps)) {
      return absl::DataLossError(absl::StrCat("unknown op '", op, "'"));
    }
    o.op = static_cast<LoraOrder::Op>(at - std::begin(kLoraOps));
    ASSIGN_OR_RETURN(o.id, JsonInt(m, "id", 0, kMaxInt64));
    if (o.op == LoraOrder::Op::kPrepare) {
      ASSIGN_OR_RETURN(o.path, JsonString(m, "path", 4096));
    }
    if (o.op == LoraOrder::Op::kInstall || o.op == LoraOrder::Op::kEvict) {
      ASSIGN_OR_RETURN(const int64_t slot, JsonInt(m, "slot", 0, kMaxInt32));
      o.slot = static_cast<int32_t>(slot);
    }
    return absl::OkStatus();
  }();
  if (!s.ok()) return In("a malformed LoRA order", s);
  return o;
}

json EncodeLoraInstalled(int32_t slot, const absl::Status& result) {
  return {{"type", "lora_installed"},
          {"slot", slot},
          {"code", static_cast<int>(result.code())},
          {"error", std::string(result.message())}};
}

bool IsLoraInstalled(const json& m) {
  auto type = m.find("type");
  return type != m.end() && *type == "lora_installed";
}

absl::Status DecodeLoraInstalled(const json& m, int32_t slot, absl::Status* result) {
  absl::Status s = [&]() -> absl::Status {
    if (!IsLoraInstalled(m)) return absl::DataLossError("not a LoRA install's answer");
    ASSIGN_OR_RETURN(const int64_t got, JsonInt(m, "slot", 0, kMaxInt32));
    if (got != slot) {
      return absl::DataLossError(absl::StrCat("the answer of slot ", got, ", not ", slot));
    }
    ASSIGN_OR_RETURN(const int64_t code, JsonInt(m, "code", 0, 16));
    ASSIGN_OR_RETURN(const std::string error, JsonString(m, "error", 1 << 16));
    *result =
        code == 0 ? absl::OkStatus() : absl::Status(static_cast<absl::StatusCode>(code), error);
    return absl::OkStatus();
  }();
  return s.ok() ? s : In("a LoRA install's answer", s);
}

json EncodeKvImported(int64_t seq, const absl::Status& transfer, int64_t bytes) {
  return {{"type", "kv_imported"},
          {"seq", seq},
          {"bytes", bytes},
          {"code", static_cast<int>(transfer.code())},
          {"error", std::string(transfer.message())}};
}

bool IsKvImported(const json& m) {
  auto type = m.find("type");
  return type != m.end() && type->is_string() && *type == "kv_imported";
}

absl::Status DecodeKvImported(const json& m, int64_t seq, absl::Status* transfer, int64_t* bytes) {
  auto got = JsonInt(m, "seq", 0, kMaxInt64);
  auto pulled = JsonInt(m, "bytes", 0, kMaxInt64);
  auto code = JsonInt(m, "code", 0, 16);
  auto error = JsonString(m, "error", 4096);
  if (!got.ok() || !code.ok() || !error.ok() || !pulled.ok()) {
    return absl::DataLossError("a malformed KV import answer");
  }
  if (*got != seq) {
    return absl::DataLossError(
        absl::StrCat("a KV import answer for sequence ", *got, ", expected ", seq));
  }
  *transfer = absl::Status(static_cast<absl::StatusCode>(*code), *error);
  *bytes = *pulled;
  return absl::OkStatus();
}

namespace {

json EncodeTokens(const std::vector<StepToken>& tokens) {
  json results = json::array();
  for (const StepToken& t : tokens) {
    json top = json::array();
    for (const TokenLogprob& a : t.top) top.push_back({a.id, a.logprob});
    results.push_back({{"seq", t.seq}, {"token", t.token}, {"logprob", t.logprob}, {"top", top}});
  }
  return results;
}

absl::Status DecodeTokens(const json& m, const char* key, std::vector<StepToken>& out) {
  ASSIGN_OR_RETURN(const json* results, JsonArray(m, key));
  for (const json& t : *results) {
    if (!t.is_object()) return absl::DataLossError("a result is not an object");
    StepToken tok;
    ASSIGN_OR_RETURN(tok.seq, JsonInt(t, "seq", 0, kMaxInt64));
    ASSIGN_OR_RETURN(int64_t token, JsonInt(t, "token", 0, kMaxInt32));
    ASSIGN_OR_RETURN(double logprob, JsonNumber(t, "logprob"));
    tok.token = static_cast<int32_t>(token);
    tok.logprob = static_cast<float>(logprob);
    ASSIGN_OR_RETURN(const json* top, JsonArray(t, "top"));
    for (const json& a : *top) {
      if (!a.is_array() || a.size() != 2 || !a[0].is_number_integer() || !a[1].is_number()) {
        return absl::DataLossError(
            absl::StrCat("sequence ", tok.seq, ": an alternative is not [token, logprob]"));
      }
      tok.top.push_back({a[0].get<int32_t>(), a[1].get<float>()});
    }
    out.push_back(std::move(tok));
  }
  return absl::OkStatus();
}

}  // namespace

json EncodeStepResult(const StepResult& r) {
  json m = {{"mb", r.microbatch}, {"results", EncodeTokens(r.tokens)}};
  if (!r.prompt.empty()) m["prompt"] = EncodeTokens(r.prompt);
  if (!r.drafts.empty()) m["drafts"] = EncodeTokens(r.drafts);
  return m;
}

absl::StatusOr<StepResult> DecodeStepResult(const json& m) {
  StepResult r;
  absl::Status s = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(int64_t mb, JsonInt(m, "mb", 0, kMaxInt32));
    r.microbatch = static_cast<int>(mb);
    RETURN_IF_ERROR(DecodeTokens(m, "results", r.tokens));
    if (m.contains("prompt")) RETURN_IF_ERROR(DecodeTokens(m, "prompt", r.prompt));
    if (m.contains("drafts")) RETURN_IF_ERROR(DecodeTokens(m, "drafts", r.drafts));
    return absl::OkStatus();
  }();
  if (!s.ok()) return In("malformed step results", s);
  return r;
}

}  // namespace shardserve
