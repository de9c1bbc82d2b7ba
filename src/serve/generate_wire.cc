#include "serve/generate_wire.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "comm/json_frame.h"
#include "common/status.h"
#include "serve/step_wire.h"

namespace shardserve {
namespace {

using json = nlohmann::json;
constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxInt64 = std::numeric_limits<int64_t>::max();
constexpr int64_t kMaxBatch = 1 << 16;

absl::Status In(const char* what, const absl::Status& s) {
  return absl::InvalidArgumentError(absl::StrCat(what, ": ", s.message()));
}

std::vector<int32_t> Narrow(const std::vector<int64_t>& v) {
  return std::vector<int32_t>(v.begin(), v.end());
}

}  // namespace

json EncodeGenerateRun(const GenerateRun& run) {
  const SamplingParams& p = run.request.params;
  return {{"prompt_ids", run.request.prompt_ids}, {"params", EncodeSamplingParams(p)},
          {"max_tokens", p.max_tokens},           {"stop_token_ids", p.stop_token_ids},
          {"ignore_eos", p.ignore_eos},           {"batch", run.batch}};
}

absl::StatusOr<GenerateRun> DecodeGenerateRun(const json& m) {
  GenerateRun run;
  absl::Status s = [&]() -> absl::Status {
    if (!m.is_object()) return absl::DataLossError("not a JSON object");
    ASSIGN_OR_RETURN(std::vector<int64_t> prompt, JsonInts(m, "prompt_ids", 0, kMaxInt32));
    run.request.prompt_ids = Narrow(prompt);
    auto params = m.find("params");
    if (params == m.end()) return absl::DataLossError("'params' is missing");
    ASSIGN_OR_RETURN(SamplingParams p, DecodeSamplingParams(*params));
    ASSIGN_OR_RETURN(p.max_tokens, JsonInt(m, "max_tokens", 1, kMaxInt32));
    ASSIGN_OR_RETURN(p.stop_token_ids, JsonInts(m, "stop_token_ids", 0, kMaxInt32));
    ASSIGN_OR_RETURN(p.ignore_eos, JsonBool(m, "ignore_eos"));
    RETURN_IF_ERROR(p.Validate());
    run.request.params = std::move(p);
    ASSIGN_OR_RETURN(run.batch, JsonInt(m, "batch", 1, kMaxBatch));
    return absl::OkStatus();
  }();
  if (!s.ok()) return In("the one-shot request (SHARDSERVE_REQUEST)", s);
  return run;
}

json EncodeGenerateOutcome(const GenerateOutcome& outcome) {
  json results = json::array();
  for (const GenerationResult& r : outcome.results) {
    json top = json::array();
    for (const auto& step : r.top_logprobs) {
      json alts = json::array();
      for (const TokenLogprob& t : step) alts.push_back({{"id", t.id}, {"logprob", t.logprob}});
      top.push_back(std::move(alts));
    }
    results.push_back({{"tokens", r.tokens},
                       {"logprobs", r.logprobs},
                       {"top_logprobs", top},
                       {"finish_reason", r.finish_reason}});
  }
  return {{"results", results},
          {"seconds", outcome.seconds},
          {"drafted", outcome.drafted},
          {"accepted", outcome.accepted},
          {"drafts", outcome.drafts}};
}

absl::StatusOr<GenerateOutcome> DecodeGenerateOutcome(const json& m) {
  GenerateOutcome out;
  absl::Status s = [&]() -> absl::Status {
    if (!m.is_object()) return absl::DataLossError("not a JSON object");
    ASSIGN_OR_RETURN(out.seconds, JsonNumber(m, "seconds"));
    ASSIGN_OR_RETURN(out.drafted, JsonInt(m, "drafted", 0, kMaxInt64));
    ASSIGN_OR_RETURN(out.accepted, JsonInt(m, "accepted", 0, out.drafted));
    ASSIGN_OR_RETURN(const json* drafts, JsonArray(m, "drafts"));
    for (const json& step : *drafts) {
      std::vector<int32_t> d;
      if (!step.is_array()) return absl::DataLossError("'drafts' holds a value not an array");
      for (const json& t : step) {
        if (!t.is_number_integer()) return absl::DataLossError("a draft is not a token id");
        d.push_back(t.get<int32_t>());
      }
      out.drafts.push_back(std::move(d));
    }
    ASSIGN_OR_RETURN(const json* results, JsonArray(m, "results"));
    for (const json& j : *results) {
      if (!j.is_object()) return absl::DataLossError("a result is not an object");
      GenerationResult r;
      ASSIGN_OR_RETURN(std::vector<int64_t> tokens, JsonInts(j, "tokens", 0, kMaxInt32));
      r.tokens = Narrow(tokens);
      ASSIGN_OR_RETURN(const json* logprobs, JsonArray(j, "logprobs"));
      for (const json& l : *logprobs) {
        if (!l.is_number()) return absl::DataLossError("'logprobs' holds a value not a number");
        r.logprobs.push_back(l.get<float>());
      }
      ASSIGN_OR_RETURN(r.finish_reason, JsonString(j, "finish_reason", 64));
      ASSIGN_OR_RETURN(const json* top, JsonArray(j, "top_logprobs"));
      for (const json& step : *top) {
        if (!step.is_array()) return absl::DataLossError("'top_logprobs' holds a non-array");
        std::vector<TokenLogprob> alts;
        for (const json& t : step) {
          if (!t.is_object()) return absl::DataLossError("an alternative is not an object");
          ASSIGN_OR_RETURN(int64_t id, JsonInt(t, "id", 0, kMaxInt32));
          ASSIGN_OR_RETURN(double logprob, JsonNumber(t, "logprob"));
          alts.push_back({static_cast<int32_t>(id), static_cast<float>(logprob)});
        }
        r.top_logprobs.push_back(std::move(alts));
      }
      out.results.push_back(std::move(r));
    }
    if (out.results.empty()) return absl::DataLossError("'results' is empty");
    return absl::OkStatus();
  }();
  if (!s.ok()) return In("the leader's result", s);
  return out;
}

}  // namespace shardserve
