#include "serve/rank_runtime.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "comm/observed_comm.h"
#include "comm/rendezvous.h"
#include "comm/shm_comm.h"
#include "comm/tcp_comm.h"
#include "comm/world.h"
#include "common/process.h"
#include "common/status.h"
#include "metrics/rank_metrics.h"
#include "model/sampler.h"
#include "model/transformer.h"
#include "model/vocab_parallel.h"
#include "plan/layer_split.h"

namespace shardserve {
namespace {

using json = nlohmann::json;
constexpr uint64_t kMaxMessage = 64ull << 20;

absl::Status SendBlob(Communicator& c, int peer, const std::string& s) {
  const uint64_t n = s.size();
  RETURN_IF_ERROR(c.Send(&n, sizeof(n), peer));
  return c.Send(s.data(), n, peer);
}

absl::StatusOr<json> RecvJson(Communicator& c, int peer) {
  uint64_t n;
  RETURN_IF_ERROR(c.Recv(&n, sizeof(n), peer));
  if (n > kMaxMessage) return absl::DataLossError(absl::StrCat("control message of ", n, " bytes"));
  std::string s(n, '\0');
  RETURN_IF_ERROR(c.Recv(s.data(), n, peer));
  try {
    return json::parse(s);
  } catch (const json::exception& e) {
    return absl::DataLossError(absl::StrCat("malformed control message: ", e.what()));
  }
}

json ParamsJson(const SamplingParams& p) {
  return {{"temperature", p.temperature},
          {"top_p", p.top_p},
          {"top_k", p.top_k},
          {"seed", p.seed},
          {"top_logprobs", p.top_logprobs}};
}

SamplingParams ParamsFromJson(const json& j) {
  SamplingParams p;
  p.temperature = j.at("temperature").get<float>();
  p.top_p = j.at("top_p").get<float>();
  p.top_k = j.at("top_k").get<int64_t>();
  p.seed = j.at("seed").get<uint64_t>();
  p.top_logprobs = j.at("top_logprobs").get<int64_t>();
  return p;
}

uint64_t Fnv(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

class Rank {
 public:
  Rank(const RankConfig& config, WorldConfig world) : cfg_(config), world_(world) {}

  absl::Status Init();
  absl::StatusOr<std::vector<GenerationResult>> Lead(const std::vector<GenerationRequest>& reqs);
  absl::Status Follow();
  const Transformer& model() const { return *model_; }
  // This rank gives up: every peer, over both communicators, learns the cause before the
  // connections close, so all ranks report the rank that actually failed.
  absl::Status AbortAll(const absl::Status& s) {
    if (metrics_) metrics_->SetUp(false);
    if (tp_comm_) (void)tp_comm_->Abort(s);
    if (world_comm_) (void)world_comm_->Abort(s);
    return s;
  }

 private:
  // Runs this rank's part of one step. Returns the sampled results on the last stage's
  // tp_rank 0, null elsewhere, and {"stop": true} for the leader's stop message.
  absl::StatusOr<json> ProcessStep(const json& desc);
  int LastSampler() const { return world_.RankOf(cfg_.pp - 1, 0); }

  RankConfig cfg_;
  WorldConfig world_;
  std::unique_ptr<TcpCommunicator> world_comm_;
  std::unique_ptr<ShmCommunicator> tp_comm_;
  // The communicators as the runtime uses them: timed into the metrics.
  std::unique_ptr<Communicator> mesh_, tp_group_;
  std::unique_ptr<RankMetrics> metrics_;
  std::unique_ptr<Transformer> model_;
  std::unique_ptr<KvCache> cache_;
  std::map<int64_t, SequenceKv> kv_;
  std::map<int64_t, SamplingParams> params_;  // on the last stage
  std::map<int64_t, Sampler> samplers_;       // on the last stage's tp_rank 0
};

absl::Status Rank::Init() {
  const int rank = world_.rank();
  if (cfg_.metrics_port >= 0) {
    ASSIGN_OR_RETURN(
        metrics_,
        RankMetrics::Start(cfg_.host == "127.0.0.1" ? "127.0.0.1" : "0.0.0.0", cfg_.metrics_port,
                           {cfg_.model_name, std::to_string(cfg_.replica),
                            std::to_string(cfg_.stage), std::to_string(cfg_.tp_rank)}));
    metrics_->SetUp(false);
    std::fprintf(stderr, "%s: metrics on %s:%d/metrics\n", world_.Describe(rank).c_str(),
                 cfg_.host.c_str(), metrics_->port());
  }
  auto observe = [this](const char* op, double seconds, size_t bytes) {
    if (metrics_) metrics_->ObserveComm(op, seconds, bytes);
  };
  // A loopback rank listens on loopback only; otherwise on every interface.
  ASSIGN_OR_RETURN(Socket data, Listen(cfg_.host == "127.0.0.1" ? "127.0.0.1" : "", 0));
  const RankAddress self{rank, cfg_.host, data.port()};
  absl::StatusOr<WorldInfo> info;
  if (world_.is_leader()) {
    ASSIGN_OR_RETURN(RendezvousServer server, RendezvousServer::Listen("", cfg_.leader_port));
    info = server.Run(world_, self, {}, cfg_.startup_timeout);
  } else {
    info = JoinRendezvous(cfg_.leader_host, cfg_.leader_port, world_, self, cfg_.startup_timeout);
  }
  if (!info.ok()) return info.status();
  TcpOptions to;
  for (const RankAddress& a : info->ranks) {
    to.members.push_back({a.host, a.port, world_.Describe(a.rank)});
  }
  to.rank = rank;
  to.group_id = Fnv(cfg_.job_id);
  to.peer_timeout = cfg_.peer_timeout;
  ASSIGN_OR_RETURN(world_comm_, TcpCommunicator::Create(to, std::move(data)));
  mesh_ = std::make_unique<ObservedCommunicator>(world_comm_.get(), observe);
  if (cfg_.tp > 1) {
    ShmOptions so;
    so.name = absl::StrCat("/shardserve-", cfg_.job_id, "-stage", cfg_.stage);
    so.size = cfg_.tp;
    so.rank = cfg_.tp_rank;
    so.peer_timeout = cfg_.peer_timeout;
    for (int t = 0; t < cfg_.tp; ++t) {
      so.member_names.push_back(world_.Describe(world_.RankOf(cfg_.stage, t)));
    }
    auto comm = ShmCommunicator::Create(so);
    if (!comm.ok()) return comm.status();
    tp_comm_ = std::move(*comm);
    tp_group_ = std::make_unique<ObservedCommunicator>(tp_comm_.get(), observe);
  }
  // Every rank computes the same split; a shape that cannot be sharded is reported to all.
  absl::Status loaded = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(ModelConfig c, LoadModelConfig(cfg_.model_path));
    const double H = c.hidden_size, I = c.intermediate_size;
    const double layer =
        2 * H * c.q_dim() + 2 * H * c.kv_dim() + (c.moe ? c.experts_per_token : 1) * 3 * H * I;
    ASSIGN_OR_RETURN(auto split, SplitLayers(c.num_layers, cfg_.pp, {layer, H, H * c.vocab_size}));
    Transformer::Options o;
    o.num_threads = cfg_.threads;
    o.tp_size = cfg_.tp;
    o.tp_rank = cfg_.tp_rank;
    o.tp_comm = tp_group_.get();
    o.layer_begin = split[cfg_.stage].begin;
    o.layer_end = split[cfg_.stage].end;
    ASSIGN_OR_RETURN(model_, Transformer::Load(cfg_.model_path, o));
    cache_ = model_->NewKvCache(cfg_.kv_cache_tokens);
    return absl::OkStatus();
  }();
  if (!loaded.ok()) {
    return world_comm_->Abort(
        absl::Status(loaded.code(), absl::StrCat(world_.Describe(rank), ": ", loaded.message())));
  }
  RETURN_IF_ERROR(mesh_->Barrier());  // everyone loaded: start together
  if (metrics_) {
    metrics_->SetWeightsBytes(static_cast<double>(model_->shard_weight_bytes()));
    metrics_->SetUp(true);
  }
  return absl::OkStatus();
}

absl::StatusOr<json> Rank::ProcessStep(const json& desc) {
  if (desc.value("type", "") == "stop") return json{{"stop", true}};
  const ModelConfig& c = model_->config();
  try {
    for (const json& id : desc.at("release")) {
      const int64_t seq = id.get<int64_t>();
      if (kv_.count(seq)) cache_->Release(kv_[seq]);
      kv_.erase(seq);
      params_.erase(seq);
      samplers_.erase(seq);
    }
    std::vector<SequenceChunk> chunks;
    std::vector<int64_t> ids;
    int64_t rows = 0;
    for (const json& ch : desc.at("chunks")) {
      const int64_t seq = ch.at("seq").get<int64_t>();
      if (ch.contains("params") && model_->last_stage()) {
        params_[seq] = ParamsFromJson(ch["params"]);
        samplers_.erase(seq);
        if (world_.rank() == LastSampler()) samplers_.emplace(seq, Sampler(params_[seq]));
      }
      SequenceChunk chunk;
      chunk.tokens = ch.at("tokens").get<std::vector<int32_t>>();
      chunk.kv = &kv_[seq];
      rows += static_cast<int64_t>(chunk.tokens.size());
      chunks.push_back(std::move(chunk));
      ids.push_back(seq);
    }
    std::vector<float> hidden_in, out;
    if (!model_->first_stage()) {
      hidden_in.resize(rows * c.hidden_size);
      RETURN_IF_ERROR(
          mesh_->Recv(hidden_in.data(), hidden_in.size() * sizeof(float), *world_.PrevStageRank()));
    }
    const auto t0 = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(
        model_->ForwardStage(chunks, *cache_, hidden_in.empty() ? nullptr : hidden_in.data(), out));
    if (metrics_) {
      metrics_->ObserveForward(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      metrics_->AddTokens(static_cast<double>(rows));
      metrics_->SetKvCacheUsage(1.0 - static_cast<double>(cache_->free_blocks()) /
                                          static_cast<double>(cache_->num_blocks()));
    }
    if (!model_->last_stage()) {
      RETURN_IF_ERROR(mesh_->Send(out.data(), out.size() * sizeof(float), *world_.NextStageRank()));
      return json();
    }
    // Greedy steps choose from the vocab slices without gathering the logits; sampled ones
    // gather them so that a seed gives the same tokens at every TP size.
    const int64_t S = static_cast<int64_t>(ids.size());
    bool greedy = true;
    int64_t top_k = 0;
    for (int64_t seq : ids) {
      greedy &= params_.at(seq).temperature == 0.0f;
      top_k = std::max(top_k, params_.at(seq).top_logprobs);
    }
    std::vector<SampledToken> tokens;
    if (greedy) {
      ASSIGN_OR_RETURN(tokens, GreedyFromVocabSlices(out.data(), S, model_->logits_stride(),
                                                     model_->vocab_begin(), model_->vocab_end(),
                                                     top_k, tp_group_.get()));
    } else {
      std::vector<float> logits;
      RETURN_IF_ERROR(model_->GatherLogits(out, S, logits));
      if (world_.rank() == LastSampler()) {
        for (int64_t s = 0; s < S; ++s) {
          tokens.push_back(
              samplers_.at(ids[s]).Sample(logits.data() + s * c.vocab_size, c.vocab_size));
        }
      }
    }
    if (world_.rank() != LastSampler()) return json();
    json results = json::array();
    for (int64_t s = 0; s < S; ++s) {
      SampledToken& t = tokens[s];
      t.top.resize(std::min<size_t>(t.top.size(), params_.at(ids[s]).top_logprobs));
      json top = json::array();
      for (const TokenLogprob& a : t.top) top.push_back({a.id, a.logprob});
      results.push_back({{"seq", ids[s]}, {"token", t.id}, {"logprob", t.logprob}, {"top", top}});
    }
    return json{{"mb", desc.at("mb")}, {"results", results}};
  } catch (const json::exception& e) {
    return absl::DataLossError(absl::StrCat("malformed step: ", e.what()));
  }
}

absl::Status Rank::Follow() {
  for (;;) {
    ASSIGN_OR_RETURN(json desc, RecvJson(*mesh_, 0));
    ASSIGN_OR_RETURN(json res, ProcessStep(desc));
    if (res.is_object() && res.value("stop", false)) return absl::OkStatus();
    if (!res.is_null()) RETURN_IF_ERROR(SendBlob(*mesh_, 0, res.dump()));
  }
}

absl::StatusOr<std::vector<GenerationResult>> Rank::Lead(
    const std::vector<GenerationRequest>& reqs) {
  const ModelConfig& c = model_->config();
  const int n = static_cast<int>(reqs.size());
  for (int i = 0; i < n; ++i) {
    if (absl::Status s = reqs[i].params.Validate(); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("request ", i, ": ", s.message()));
    }
    if (reqs[i].prompt_ids.empty() ||
        static_cast<int64_t>(reqs[i].prompt_ids.size()) >= c.max_context) {
      return absl::InvalidArgumentError(absl::StrCat("request ", i, ": the prompt must hold 1 to ",
                                                     c.max_context - 1, " tokens, it holds ",
                                                     reqs[i].prompt_ids.size()));
    }
  }
  std::vector<GenerationResult> results(n);
  std::vector<std::vector<int32_t>> next(n);
  std::vector<int64_t> length(n, 0);
  std::vector<bool> started(n, false), done(n, false);
  for (int i = 0; i < n; ++i) next[i] = reqs[i].prompt_ids;
  const int m = std::max(1, std::min(n, cfg_.microbatches > 0 ? cfg_.microbatches : cfg_.pp));
  std::vector<int64_t> release;
  std::deque<json> ready;
  std::deque<int> inflight;
  const int world = world_.world_size();

  auto issue = [&](int mb) -> absl::Status {
    json chunks = json::array();
    for (int i = mb; i < n; i += m) {
      if (done[i]) continue;
      json ch = {{"seq", i}, {"tokens", next[i]}};
      if (!started[i]) ch["params"] = ParamsJson(reqs[i].params);
      started[i] = true;
      length[i] += static_cast<int64_t>(next[i].size());
      chunks.push_back(ch);
    }
    if (chunks.empty()) return absl::OkStatus();
    const json desc = {{"type", "step"}, {"mb", mb}, {"chunks", chunks}, {"release", release}};
    release.clear();
    const std::string wire = desc.dump();
    for (int r = 1; r < world; ++r) RETURN_IF_ERROR(SendBlob(*mesh_, r, wire));
    ASSIGN_OR_RETURN(json res, ProcessStep(desc));
    if (res.is_null()) {
      inflight.push_back(mb);
    } else {
      ready.push_back(std::move(res));
    }
    return absl::OkStatus();
  };
  auto accept = [&](const json& r) {
    const int i = r.at("seq").get<int>();
    const SamplingParams& p = reqs[i].params;
    const int32_t tok = r.at("token").get<int32_t>();
    results[i].tokens.push_back(tok);
    results[i].logprobs.push_back(r.at("logprob").get<float>());
    if (p.top_logprobs > 0) {
      std::vector<TokenLogprob> top;
      for (const json& a : r.at("top")) top.push_back({a[0].get<int32_t>(), a[1].get<float>()});
      results[i].top_logprobs.push_back(std::move(top));
    }
    next[i] = {tok};
    const auto& stops = p.stop_token_ids;
    if (std::find(stops.begin(), stops.end(), tok) != stops.end() ||
        (!p.ignore_eos &&
         std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), tok) != c.eos_token_ids.end())) {
      results[i].finish_reason = "stop";
    } else if (static_cast<int64_t>(results[i].tokens.size()) >= p.max_tokens ||
               length[i] >= c.max_context) {
      results[i].finish_reason = "length";
    }
    if (!results[i].finish_reason.empty()) {
      done[i] = true;
      release.push_back(i);
    }
  };

  for (int mb = 0; mb < m; ++mb) RETURN_IF_ERROR(issue(mb));
  while (!ready.empty() || !inflight.empty()) {
    json res;
    if (!ready.empty()) {
      res = std::move(ready.front());
      ready.pop_front();
    } else {
      inflight.pop_front();
      ASSIGN_OR_RETURN(res, RecvJson(*mesh_, LastSampler()));
    }
    try {
      for (const json& r : res.at("results")) accept(r);
      RETURN_IF_ERROR(issue(res.at("mb").get<int>()));
    } catch (const json::exception& e) {
      return absl::DataLossError(absl::StrCat("malformed results: ", e.what()));
    }
  }
  const std::string stop = json{{"type", "stop"}, {"release", release}}.dump();
  for (int r = 1; r < world; ++r) RETURN_IF_ERROR(SendBlob(*mesh_, r, stop));
  return results;
}

absl::StatusOr<int> EnvInt(const char* name, std::optional<int> def) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') {
    if (def) return *def;
    return absl::InvalidArgumentError(absl::StrCat("environment variable ", name, " is not set"));
  }
  int out;
  if (!absl::SimpleAtoi(v, &out)) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", name, "='", v, "' is not an integer"));
  }
  return out;
}

}  // namespace

absl::StatusOr<RankConfig> RankConfigFromEnv() {
  RankConfig c;
  const char* path = std::getenv("SHARDSERVE_MODEL_PATH");
  if (path == nullptr || *path == '\0') {
    return absl::InvalidArgumentError("environment variable SHARDSERVE_MODEL_PATH is not set");
  }
  c.model_path = path;
  ASSIGN_OR_RETURN(c.tp, EnvInt("SHARDSERVE_TP", 1));
  ASSIGN_OR_RETURN(c.pp, EnvInt("SHARDSERVE_PP", 1));
  ASSIGN_OR_RETURN(c.stage, EnvInt("SHARDSERVE_STAGE", 0));
  ASSIGN_OR_RETURN(c.tp_rank, EnvInt("SHARDSERVE_TP_RANK", 0));
  ASSIGN_OR_RETURN(c.microbatches, EnvInt("SHARDSERVE_MICROBATCHES", 0));
  ASSIGN_OR_RETURN(c.threads, EnvInt("SHARDSERVE_THREADS", 1));
  ASSIGN_OR_RETURN(int peer_ms,
                   EnvInt("SHARDSERVE_PEER_TIMEOUT_MS", static_cast<int>(c.peer_timeout.count())));
  ASSIGN_OR_RETURN(int startup_ms, EnvInt("SHARDSERVE_STARTUP_TIMEOUT_MS",
                                          static_cast<int>(c.startup_timeout.count())));
  if (peer_ms < 100 || startup_ms < 100) {
    return absl::InvalidArgumentError(
        "SHARDSERVE_PEER_TIMEOUT_MS and SHARDSERVE_STARTUP_TIMEOUT_MS must be at least 100");
  }
  c.peer_timeout = std::chrono::milliseconds(peer_ms);
  c.startup_timeout = std::chrono::milliseconds(startup_ms);
  if (const char* leader = std::getenv("SHARDSERVE_LEADER_ADDR"); leader && *leader) {
    const std::string addr = leader;
    const size_t colon = addr.rfind(':');
    if (colon == std::string::npos || !absl::SimpleAtoi(addr.substr(colon + 1), &c.leader_port)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "environment variable SHARDSERVE_LEADER_ADDR='", addr, "' is not HOST:PORT"));
    }
    c.leader_host = addr.substr(0, colon);
  }
  // Names this replica's shared memory: one per model replica, so replicas sharing a node
  // never meet.
  const char* job = std::getenv("SHARDSERVE_JOB_ID");
  const char* name = std::getenv("SHARDSERVE_MODEL_NAME");
  ASSIGN_OR_RETURN(c.replica, EnvInt("SHARDSERVE_REPLICA", 0));
  if (name != nullptr && *name) c.model_name = name;
  c.job_id =
      job != nullptr && *job ? std::string(job) : absl::StrCat(c.model_name, "-r", c.replica);
  if (const char* host = std::getenv("SHARDSERVE_HOST"); host != nullptr && *host) {
    c.host = host;
  } else if (c.leader_host != "127.0.0.1" && c.leader_host != "localhost") {
    char name[256] = {};
    gethostname(name, sizeof(name) - 1);
    c.host = name;
  }
  const char* metrics = std::getenv("SHARDSERVE_METRICS");
  if (metrics == nullptr || std::string(metrics) != "off") {
    ASSIGN_OR_RETURN(int base, EnvInt("SHARDSERVE_METRICS_PORT_BASE", -1));
    c.metrics_port = base >= 0 ? base + c.rank() : 9400 + c.tp_rank;
  }
  for (char& ch : c.job_id) {
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '-') ch = '-';
  }
  return c;
}

absl::StatusOr<RankOutcome> RunRank(const RankConfig& config,
                                    const std::vector<GenerationRequest>& requests) {
  ASSIGN_OR_RETURN(WorldConfig world, WorldConfig::Create(config.tp, config.pp, config.rank()));
  if (config.stage < 0 || config.stage >= config.pp || config.tp_rank < 0 ||
      config.tp_rank >= config.tp) {
    return absl::InvalidArgumentError(absl::StrCat("stage ", config.stage, " / tp_rank ",
                                                   config.tp_rank, " are outside tp ", config.tp,
                                                   " x pp ", config.pp));
  }
  Rank rank(config, world);
  if (absl::Status s = rank.Init(); !s.ok()) return rank.AbortAll(s);
  RankOutcome outcome;
  if (world.is_leader()) {
    const auto t0 = std::chrono::steady_clock::now();
    auto results = rank.Lead(requests);
    if (!results.ok()) return rank.AbortAll(results.status());
    outcome.results = std::move(*results);
    outcome.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } else if (absl::Status s = rank.Follow(); !s.ok()) {
    return rank.AbortAll(s);
  }
  outcome.resident_bytes = ResidentBytes();
  outcome.shard_weight_bytes = rank.model().shard_weight_bytes();
  outcome.stage_weight_bytes = rank.model().stage_weight_bytes();
  return outcome;
}

}  // namespace shardserve
