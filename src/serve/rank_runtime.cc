#include "serve/rank_runtime.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <deque>
#include <future>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "api/adapters.h"
#include "api/worker_env.h"
#include "comm/handshake.h"
#include "comm/json_frame.h"
#include "comm/kv_transfer.h"
#include "comm/observed_comm.h"
#include "comm/rendezvous.h"
#include "comm/shm_comm.h"
#include "comm/tcp_comm.h"
#include "comm/world.h"
#include "common/log.h"
#include "common/process.h"
#include "common/stall_watchdog.h"
#include "common/status.h"
#include "common/text.h"
#include "metrics/rank_metrics.h"
#include "model/sampler.h"
#include "model/transformer.h"
#include "plan/layer_split.h"
#include "serve/draft_model.h"
#include "serve/kv_layout.h"
#include "serve/stage_backend.h"
#include "serve/step_wire.h"

namespace shardserve {
namespace {

using json = nlohmann::json;

absl::Status SendFrame(Communicator& c, int peer, const std::string& frame) {
  return WriteJsonFrame([&](const void* data, size_t n) { return c.Send(data, n, peer); }, frame);
}

absl::StatusOr<json> RecvFrame(Communicator& c, int peer) {
  return ReadJsonFrame([&](void* data, size_t n) { return c.Recv(data, n, peer); }, kMaxStepMessage,
                       "a step message");
}

uint64_t Fnv(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

class Rank : public StepExecutor {
 public:
  Rank(const RankConfig& config, WorldConfig world) : cfg_(config), world_(world) {}

  absl::Status Init();
  absl::Status Follow();
  const Transformer& model() const { return *model_; }
  LeaderContext Context();
  // What the rank is doing while it starts (its metrics page's /startupz).
  void Starting(const std::string& state) {
    if (metrics_) metrics_->SetStartup(state);
  }
  // This rank gives up: every peer, over both communicators, learns the cause before the
  // connections close, so all ranks report the rank that actually failed.
  absl::Status AbortAll(const absl::Status& s) {
    if (metrics_) metrics_->SetUp(false);
    if (backend_) backend_->Abort(s);
    if (tp_comm_) (void)tp_comm_->Abort(s);
    if (world_comm_) (void)world_comm_->Abort(s);
    return s;
  }

  // StepExecutor, on the leader.
  absl::Status Issue(const StepDesc& step) override;
  absl::StatusOr<StepResult> Collect() override;
  absl::Status Ping() override;
  absl::Status Stop() override;
  absl::Status ImportKv(const KvImport& import, absl::Status* transfer, int64_t* bytes) override;
  absl::Status OrderLora(const LoraOrder& order, absl::Status* result) override;

 private:
  // Disaggregation (WorkerEnv::kv_role): a prefill replica's ranks each run an exporter, whose
  // addresses the leader gathers; a decode replica's ranks each run a puller.
  absl::Status StartKvTransfer();
  // The adapters the contract declares (SHARDSERVE_LORA_ADAPTERS), each into its slot.
  absl::Status LoadDeclaredAdapters();
  // This rank's part of a LoRA order; an install's result (the others': OK).
  absl::Status DoLora(const LoraOrder& order);
  // This rank's share of an import: the ranges of each prefill rank it reads, pulled in turn.
  absl::Status PullKv(const KvImport& import, int64_t* bytes);
  // A frame from the last stage's sampler: a step result, or (during ImportKv) its import answer.
  absl::StatusOr<json> RecvFromSampler();
  // Rank r's answer to an order the leader sent every rank (between steps): from the last
  // stage's sampler, after the step results it sent before (kept for Collect).
  absl::StatusOr<json> AnswerOf(int r, bool (*is_answer)(const json&));
  absl::Status SendToAll(const json& message);
  // Runs this rank's part of one step. Returns the sampled results on the last stage's
  // tp_rank 0 (every step has one, possibly empty) and nothing elsewhere.
  absl::StatusOr<std::optional<StepResult>> ProcessStep(const StepDesc& step);
  // Multi-token prediction on the last stage, every rank of its TP group, after the step's
  // tokens are chosen (`tokens`, by chunk; the sampler's alone unless `greedy`): the MTP layer on
  // every row whose next token is known, and a draft for each sampled chunk's next step.
  absl::StatusOr<std::vector<StepToken>> MtpDrafts(
      const StepDesc& step, const std::vector<bool>& sample, bool greedy,
      const std::vector<std::vector<SampledToken>>& tokens);
  int LastSampler() const { return world_.RankOf(cfg_.env.pp - 1, 0); }
  // Hidden states from the previous stage and to the next: device to device over the backend's
  // link where there is one, through host memory over the mesh otherwise.
  absl::Status ReceiveHidden(int64_t rows) {
    if (Communicator* link = backend_->device_prev()) return model_->ReceiveHidden(*link, 0, rows);
    hidden_.resize(rows * model_->config().hidden_size);
    RETURN_IF_ERROR(
        mesh_->Recv(hidden_.data(), hidden_.size() * sizeof(float), *world_.PrevStageRank()));
    return model_->HiddenFromHost(hidden_.data(), rows);
  }
  absl::Status PassHidden() {
    if (Communicator* link = backend_->device_next()) return model_->SendHidden(*link, 1);
    RETURN_IF_ERROR(model_->HiddenToHost(hidden_));
    return mesh_->Send(hidden_.data(), hidden_.size() * sizeof(float), *world_.NextStageRank());
  }
  void ReportCacheUsage() {
    if (!metrics_) return;
    metrics_->SetKvCacheUsage(static_cast<double>(blocks_held_) /
                              static_cast<double>(cache_->num_blocks()));
  }
  // The blocks the sequences' tables hold (a block shared by several counts once).
  void Hold(const std::vector<int32_t>& ids) {
    for (int32_t b : ids) blocks_held_ += block_refs_[b]++ == 0;
  }
  // LoRA adapters loaded at runtime: each id's preparation (read and laid out on a thread of
  // its own while steps run).
  std::map<int64_t, std::shared_future<absl::StatusOr<PreparedLora>>> lora_prepared_;
  void Drop(int64_t seq) {
    if (auto offer = offers_.find(seq); offer != offers_.end()) {  // its sends end first
      exporter_->Withdraw(offer->second);
      offers_.erase(offer);
    }
    auto it = kv_.find(seq);
    if (it == kv_.end()) return;
    for (int32_t b : it->second.blocks) blocks_held_ -= --block_refs_[b] == 0;
    kv_.erase(it);
  }

  RankConfig cfg_;
  WorldConfig world_;
  std::unique_ptr<TcpCommunicator> world_comm_;
  std::unique_ptr<ShmCommunicator> tp_comm_;
  // The communicators as the runtime uses them: timed into the metrics.
  std::unique_ptr<Communicator> mesh_, tp_group_;
  std::unique_ptr<RankMetrics> metrics_;
  std::unique_ptr<StageBackend> backend_;  // where the stage runs (and its own links)
  std::unique_ptr<Transformer> model_;
  std::shared_ptr<ModelDrafter> drafter_;  // the leader's draft model (speculative decoding)
  std::vector<float> hidden_;              // hidden states crossing the host mesh
  std::unique_ptr<KvCache> cache_;
  std::map<int64_t, SequenceKv> kv_;
  std::vector<int32_t> block_refs_;  // per block: the tables holding it
  int64_t blocks_held_ = 0;
  std::map<int64_t, SamplingParams> params_;  // on the last stage
  std::map<int64_t, Sampler> samplers_;       // on the last stage's tp_rank 0
  // Results not yet collected: the leader's own (PP = 1), or read while waiting for an import.
  std::deque<StepResult> ready_;
  KvRoleShape kv_shape_;                   // how this replica holds the KV
  std::unique_ptr<KvExporter> exporter_;   // prefill role
  std::unique_ptr<KvPuller> puller_;       // decode role
  std::vector<std::string> kv_addresses_;  // the leader: every rank's exporter
  std::map<int64_t, KvTicket> offers_;     // the sequences offered, until released
};

// How the model reached this pod (its fetch step's report, serve/../cli/fetch.h), on the
// metrics of a stage's first rank; a model read from a volume downloaded nothing.
void ReportModelFetch(const WorkerEnv& env, RankMetrics& metrics) {
  std::string node = env.node_name;
  if (node.empty()) {
    char host[256] = {};
    if (::gethostname(host, sizeof(host) - 1) == 0) node = host;
  }
  int64_t fetched = 0, cache_bytes = 0;
  bool hit = true;
  if (!env.fetch_report.empty()) {
    absl::StatusOr<std::string> text = ReadFileToString(env.fetch_report);
    const nlohmann::json j =
        text.ok() ? nlohmann::json::parse(*text, nullptr, false) : nlohmann::json();
    if (!j.is_object()) {
      LogWarning("the fetch step's report ", env.fetch_report, " is unreadable");
      return;
    }
    const auto count = [&j](const char* key) {
      const auto it = j.find(key);
      return it != j.end() && it->is_number_unsigned() ? it->get<int64_t>() : int64_t{0};
    };
    fetched = count("bytes_fetched");
    cache_bytes = count("cache_bytes");
    const auto it = j.find("cache_hit");
    hit = it != j.end() && it->is_boolean() && it->get<bool>();
  }
  metrics.SetModelFetch(node, fetched, hit, cache_bytes);
}

absl::Status Rank::Init() {
  const int rank = world_.rank();
  if (cfg_.metrics_port >= 0) {
    ASSIGN_OR_RETURN(
        metrics_,
        RankMetrics::Start(
            cfg_.host == "127.0.0.1" ? "127.0.0.1" : "0.0.0.0", cfg_.metrics_port,
            {cfg_.env.metrics_model(), std::to_string(cfg_.env.replica),
             std::to_string(cfg_.env.stage), std::to_string(cfg_.env.tp_rank), cfg_.env.kv_role}));
    metrics_->SetUp(false);
    LogInfo("metrics on ", cfg_.host, ":", metrics_->port(), "/metrics");
    if (cfg_.env.tp_rank == 0) ReportModelFetch(cfg_.env, *metrics_);
  }
  auto observe = [this](const char* op, double seconds, size_t bytes) {
    if (metrics_) metrics_->ObserveComm(op, seconds, bytes);
  };
  // The rendezvous and the mesh listen on the rank's own address (the pod's; loopback locally).
  ASSIGN_OR_RETURN(Socket data, Listen(cfg_.bind_host, 0));
  const RankAddress self{rank, cfg_.host, data.port()};
  absl::StatusOr<WorldInfo> info;
  ASSIGN_OR_RETURN(backend_, StageBackend::Choose(cfg_, world_));
  if (world_.world_size() == 1) {
    ASSIGN_OR_RETURN(std::vector<std::string> blobs, backend_->Blobs({self}));
    info = WorldInfo{{self}, std::move(blobs)};
  } else if (world_.is_leader()) {
    ASSIGN_OR_RETURN(RendezvousServer server,
                     RendezvousServer::Listen(cfg_.bind_host, cfg_.leader_port, cfg_.secret));
    info = server.RunMakingBlobs(
        world_, self, [&](const std::vector<RankAddress>& ranks) { return backend_->Blobs(ranks); },
        cfg_.startup_timeout(),
        [this](const std::string& missing) {
          Starting(missing.empty() ? "every rank has joined the rendezvous"
                                   : absl::StrCat("waiting at the rendezvous for ", missing));
        });
  } else {
    Starting(absl::StrCat("waiting at the rendezvous (", cfg_.leader_host, ":", cfg_.leader_port,
                          ") for the leader and the replica's other ranks"));
    // A little longer than the leader: when peers never come, the leader, who knows which,
    // is the one to say so.
    info = JoinRendezvous(cfg_.leader_host, cfg_.leader_port, world_, self, cfg_.secret,
                          cfg_.startup_timeout() + std::chrono::seconds(5));
  }
  if (!info.ok()) return info.status();
  TcpOptions to;
  for (const RankAddress& a : info->ranks) {
    to.members.push_back({a.host, a.port, world_.Describe(a.rank)});
  }
  to.rank = rank;
  to.group_id = Fnv(cfg_.job_id);
  to.secret = cfg_.secret;
  to.peer_timeout = cfg_.peer_timeout();
  ASSIGN_OR_RETURN(world_comm_, TcpCommunicator::Create(to, std::move(data)));
  mesh_ = std::make_unique<ObservedCommunicator>(world_comm_.get(), observe);
  if (cfg_.env.tp > 1) {
    ShmOptions so;
    so.name = ShmGroupName(cfg_);
    so.size = cfg_.env.tp;
    so.rank = cfg_.env.tp_rank;
    so.peer_timeout = cfg_.peer_timeout();
    for (int t = 0; t < cfg_.env.tp; ++t) {
      so.member_names.push_back(world_.Describe(world_.RankOf(cfg_.env.stage, t)));
    }
    auto comm = ShmCommunicator::Create(so);
    if (!comm.ok()) return comm.status();
    tp_comm_ = std::move(*comm);
    tp_group_ = std::make_unique<ObservedCommunicator>(tp_comm_.get(), observe);
  }
  // The split comes with the contract (the operator's plan); a split that does not fit the model
  // is reported to all.
  absl::Status loaded = [&]() -> absl::Status {
    // Loading that stops (a model volume that no longer answers) ends the rank, naming where it
    // stopped; the main thread may be blocked in a read that nothing interrupts.
    StallWatchdog watchdog(std::chrono::milliseconds(cfg_.env.load_stall_ms), [&](double share) {
      const absl::Status why = absl::DeadlineExceededError(absl::StrCat(
          world_.Describe(rank), ": loading made no progress for ", cfg_.env.load_stall_ms / 1000.0,
          " s (stopped at ", static_cast<int>(share * 100), " % of its weights)"));
      LogError(why.message());
      ReportTermination(cfg_.env.termination_log, std::string(why.message()));
      (void)AbortAll(why);
      std::_Exit(1);
    });
    Starting("loading 0 %");
    ASSIGN_OR_RETURN(ModelConfig c, LoadModelConfig(cfg_.env.model_path));
    ASSIGN_OR_RETURN(LayerRange layers, StageLayersOf(cfg_.env, c));
    Transformer::Options o;
    o.num_threads = cfg_.env.threads;
    o.tp_size = cfg_.env.tp;
    o.tp_rank = cfg_.env.tp_rank;
    o.tp_comm = tp_group_.get();
    o.layer_begin = layers.begin;
    o.layer_end = layers.end;
    o.fp8_blocks = cfg_.env.fp8_blocks;
    o.kv_cache_dtype = ParseKvCacheDtype(cfg_.env.kv_cache_dtype).value_or(KvCacheDtype::kAuto);
    o.lora_slots = cfg_.env.max_loras;
    o.lora_max_rank = cfg_.env.max_lora_rank;
    o.mtp = cfg_.env.speculative_method == "mtp";
    o.progress = [&](double share) {
      watchdog.Progress(share);
      if (metrics_) metrics_->SetLoadProgress(share);
    };
    ASSIGN_OR_RETURN(model_, backend_->Load(*info, o, observe, cache_));
    if (metrics_) metrics_->SetBackend(backend_->name(), backend_->kernels());
    RETURN_IF_ERROR(LoadDeclaredAdapters());
    // Speculative decoding with a draft model: the leader runs it (serve/draft_model.h).
    if (rank == 0 && cfg_.env.speculative_method == "draft") {
      Starting("loading the draft model");
      if (cfg_.env.draft_model.empty()) {
        return absl::InvalidArgumentError(
            "speculative decoding with a draft model needs SHARDSERVE_DRAFT_MODEL");
      }
      ASSIGN_OR_RETURN(std::unique_ptr<Backend> draft_backend,
                       backend_->DraftBackend(cfg_.env.threads));
      ASSIGN_OR_RETURN(drafter_,
                       ModelDrafter::Load(cfg_.env.draft_model, c, std::move(draft_backend),
                                          cfg_.env.kv_cache_tokens, cfg_.env.max_step_tokens));
    }
    cache_->FollowTables();  // the leader hands out the blocks (serve/prefix_cache.h)
    block_refs_.assign(cache_->num_blocks(), 0);
    std::vector<LayerRange> split;
    for (int st = 0; st < cfg_.env.pp; ++st) {
      WorkerEnv at = cfg_.env;
      at.stage = st;
      ASSIGN_OR_RETURN(LayerRange r, StageLayersOf(at, c));
      split.push_back(r);
    }
    kv_shape_.tp = cfg_.env.tp;
    for (const LayerRange& r : split) kv_shape_.stages.emplace_back(r.begin, r.end);
    kv_shape_.latent = c.mla;
    kv_shape_.kv_heads = c.mla ? 1 : c.num_kv_heads;
    kv_shape_.block_size = cache_->block_size();
    kv_shape_.dtype = DTypeName(cache_->storage()->format.dtype);
    return absl::OkStatus();
  }();
  if (!loaded.ok()) {
    return world_comm_->Abort(
        absl::Status(loaded.code(), absl::StrCat(world_.Describe(rank), ": ", loaded.message())));
  }
  if (absl::Status s = StartKvTransfer(); !s.ok()) {
    return world_comm_->Abort(
        absl::Status(s.code(), absl::StrCat(world_.Describe(rank), ": ", s.message())));
  }
  Starting("loaded; waiting for the replica's other ranks to load");
  RETURN_IF_ERROR(mesh_->Barrier());  // everyone loaded: start together
  Starting("serving");
  if (metrics_) {
    metrics_->SetWeightsBytes(static_cast<double>(model_->shard_weight_bytes()));
    metrics_->SetUp(true);
  }
  return absl::OkStatus();
}

absl::Status Rank::LoadDeclaredAdapters() {
  ASSIGN_OR_RETURN(const std::vector<AdapterRef> adapters,
                   ParseAdapterList(cfg_.env.lora_adapters));
  if (static_cast<int64_t>(adapters.size()) > cfg_.env.max_loras) {
    return absl::InvalidArgumentError(
        absl::StrCat("SHARDSERVE_LORA_ADAPTERS declares ", adapters.size(),
                     " adapters, SHARDSERVE_MAX_LORAS ", "holds ", cfg_.env.max_loras, " at once"));
  }
  LoraLimits limits;
  limits.max_rank = cfg_.env.max_lora_rank;
  for (size_t i = 0; i < adapters.size(); ++i) {
    Starting(absl::StrCat("loading the LoRA adapter ", adapters[i].name));
    absl::StatusOr<LoraAdapter> a = LoraAdapter::Load(adapters[i].path, model_->config(), limits);
    absl::Status s = a.ok() ? model_->LoadLora(static_cast<int>(i), *a) : a.status();
    if (!s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("the LoRA adapter '", adapters[i].name, "': ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<StepResult>> Rank::ProcessStep(const StepDesc& step) {
  for (int64_t seq : step.release) {  // its blocks are the leader's to reuse
    Drop(seq);
    params_.erase(seq);
    samplers_.erase(seq);
  }
  const bool sampler = world_.rank() == LastSampler();
  std::vector<SequenceChunk> chunks;
  std::vector<int64_t> ids;
  std::vector<bool> sample;
  int64_t rows = 0;
  for (const StepChunk& ch : step.chunks) {
    if (ch.params && model_->last_stage()) {
      params_[ch.seq] = *ch.params;
      samplers_.erase(ch.seq);
      if (sampler) {
        Sampler& s = samplers_.emplace(ch.seq, Sampler(*ch.params, ch.prompt_tokens)).first->second;
        s.Skip(ch.draws);
        s.Observe(ch.history.data(), static_cast<int64_t>(ch.history.size()));
      }
    }
    if (auto it = samplers_.find(ch.seq); sampler && it != samplers_.end()) {
      // Drafts are observed once kept (Sampler::Verify).
      it->second.Observe(ch.tokens.data(), static_cast<int64_t>(ch.tokens.size()) - ch.drafts);
      if (!ch.allowed.empty() && ch.drafts == 0) it->second.Allow(ch.allowed);
    }
    {  // the leader's block table (every id checked: a step is input too)
      if (ch.params) Drop(ch.seq);
      SequenceKv& kv = kv_[ch.seq];
      const int64_t blocks = cache_->num_blocks(), bs = cache_->block_size();
      auto bad = [&](const std::vector<int32_t>& ids) {
        return std::any_of(ids.begin(), ids.end(), [&](int32_t b) { return b < 0 || b >= blocks; });
      };
      if (ch.params) {
        // The start is a cached prefix's (whole blocks) or an imported prompt's (any length).
        if (bad(ch.cached) || (ch.start + bs - 1) / bs != static_cast<int64_t>(ch.cached.size())) {
          return absl::DataLossError(absl::StrCat("sequence ", ch.seq, ": a cached prefix of ",
                                                  ch.cached.size(), " blocks for ", ch.start,
                                                  " positions, or a block outside the cache"));
        }
        kv.blocks = ch.cached;
        kv.length = ch.start;
        Hold(ch.cached);
      }
      if (bad(ch.blocks)) {
        return absl::DataLossError(
            absl::StrCat("sequence ", ch.seq, ": a block outside the cache of ", blocks));
      }
      kv.blocks.insert(kv.blocks.end(), ch.blocks.begin(), ch.blocks.end());
      Hold(ch.blocks);
      if (ch.rewind > kv.length || (ch.rewind > 0 && ch.params)) {
        return absl::DataLossError(absl::StrCat("sequence ", ch.seq, ": a rewind of ", ch.rewind,
                                                " positions from ", kv.length));
      }
      kv.length -= ch.rewind;
    }
    if (ch.sample && model_->last_stage() && !params_.count(ch.seq)) {
      return absl::DataLossError(
          absl::StrCat("a step samples sequence ", ch.seq, ", which has no sampling parameters"));
    }
    SequenceChunk chunk;
    chunk.tokens = ch.tokens;
    chunk.kv = &kv_[ch.seq];
    chunk.lora_slot = ch.lora_slot;
    chunk.logit_rows = 1 + ch.drafts;
    rows += static_cast<int64_t>(chunk.tokens.size());
    chunks.push_back(std::move(chunk));
    ids.push_back(ch.seq);
    sample.push_back(ch.sample);
  }
  StepResult result;
  result.microbatch = step.microbatch;
  if (chunks.empty()) {  // only frees cache
    ReportCacheUsage();
    return sampler ? std::optional<StepResult>(std::move(result)) : std::nullopt;
  }
  if (!model_->first_stage()) RETURN_IF_ERROR(ReceiveHidden(rows));
  const auto t0 = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(model_->Run(chunks, *cache_));
  // The ops may be queued (GPU): wait, so that the forward time is true.
  RETURN_IF_ERROR(model_->backend().Synchronize());
  if (metrics_) {
    metrics_->ObserveForward(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    metrics_->AddTokens(static_cast<double>(rows));
  }
  ReportCacheUsage();
  // The chunks' KV is written: offered before the step goes on (the next stage, the TP group's
  // sampling), so that once the leader has the step's result, every rank holds the offer.
  for (const StepChunk& ch : step.chunks) {
    if (!ch.offer) continue;
    if (!exporter_) return absl::DataLossError("a step offers KV on a replica that exports none");
    const auto hold = absl::Milliseconds(cfg_.env.kv_offer_ms);
    const int64_t layers = model_->layer_end() - model_->layer_begin();
    absl::Status offered = exporter_->Offer(
        *ch.offer, OfferedKv(*cache_->storage(), layers, kv_[ch.seq].blocks), absl::Now() + hold);
    // Not fatal: the decode replica's pull is refused, and it prefills by itself.
    if (!offered.ok()) {
      LogWarning("sequence ", ch.seq, ": its KV is not offered: ", offered.message());
    } else {
      offers_[ch.seq] = *ch.offer;
    }
  }
  if (!model_->last_stage()) {
    RETURN_IF_ERROR(PassHidden());
    return std::nullopt;
  }
  // Greedy steps choose from the vocab slices without gathering the logits; sampled ones
  // gather them so that a seed gives the same tokens at every TP size. Rows of prompt chunks
  // that are not a prompt's last are computed but not sampled; a chunk with drafts has a row
  // for each and one more, verified on the host (Sampler::Verify).
  const int64_t S = static_cast<int64_t>(ids.size());
  bool greedy = true, drafted = false;
  int64_t top_k = 0;
  for (int64_t s = 0; s < S; ++s) {
    if (!sample[s]) continue;
    greedy &= params_[ids[s]].temperature == 0.0f && !params_[ids[s]].ProcessesLogits() &&
              step.chunks[s].allowed.empty();
    drafted |= step.chunks[s].drafts > 0;
    top_k = std::max(top_k, params_[ids[s]].top_logprobs);
  }
  auto sampler_of = [&](int64_t s) -> absl::StatusOr<Sampler*> {
    auto it = samplers_.find(ids[s]);
    if (it == samplers_.end()) {
      return absl::DataLossError(
          absl::StrCat("a step samples sequence ", ids[s], ", which has no sampler"));
    }
    return &it->second;
  };
  // Each chunk's tokens, by chunk (none for a chunk not sampled).
  std::vector<std::vector<SampledToken>> tokens(S);
  if (greedy) {
    ASSIGN_OR_RETURN(std::vector<SampledToken> best, model_->Greedy(top_k, tp_group_.get()));
    size_t row = 0;
    for (int64_t s = 0; s < S; ++s) {
      const StepChunk& ch = step.chunks[s];
      // Drafts are kept while each is the greedy token of the row before it.
      for (int64_t i = 0; i <= ch.drafts && row + i < best.size(); ++i) {
        tokens[s].push_back(best[row + i]);
        if (i == ch.drafts || best[row + i].id != ch.tokens[ch.tokens.size() - ch.drafts + i]) {
          break;
        }
      }
      row += static_cast<size_t>(1 + ch.drafts);
    }
  } else if (drafted) {
    std::vector<float> logits;  // gathered on every rank of the TP group
    RETURN_IF_ERROR(model_->GatherLogits(logits));
    const int64_t V = model_->config().vocab_size;
    int64_t row = 0;
    for (int64_t s = 0; s < S && sampler; row += 1 + step.chunks[s].drafts, ++s) {
      if (!sample[s]) continue;
      const StepChunk& ch = step.chunks[s];
      ASSIGN_OR_RETURN(Sampler * smp, sampler_of(s));
      const std::vector<int32_t> drafts(ch.tokens.end() - ch.drafts, ch.tokens.end());
      tokens[s] = smp->Verify(logits.data() + row * V, V, drafts, RowMasks(ch));
    }
  } else {
    std::vector<Sampler*> samplers;
    for (int64_t s = 0; s < S && sampler; ++s) {
      Sampler* smp = nullptr;
      if (sample[s]) {
        ASSIGN_OR_RETURN(smp, sampler_of(s));
      }
      samplers.push_back(smp);
    }
    ASSIGN_OR_RETURN(std::vector<SampledToken> chosen, model_->Sample(samplers, top_k));
    for (int64_t s = 0; s < S && static_cast<size_t>(s) < chosen.size(); ++s) {
      tokens[s].push_back(std::move(chosen[s]));
    }
  }
  // Echo with logprobs: the prompt's rows (DecodeStep bounded them), after the choice.
  const ScoreRows score = ScoreRowsOf(step);
  std::vector<SampledToken> scored;
  if (!score.rows.empty()) {
    ASSIGN_OR_RETURN(scored, model_->Score(score.rows, score.targets, score.top, tp_group_.get()));
  }
  if (model_->has_mtp()) {
    ASSIGN_OR_RETURN(result.drafts, MtpDrafts(step, sample, greedy, tokens));
  }
  if (!sampler) return std::nullopt;
  for (int64_t s = 0; s < S; ++s) {
    if (!sample[s]) continue;
    for (SampledToken& t : tokens[s]) {
      t.top.resize(std::min<size_t>(t.top.size(), params_[ids[s]].top_logprobs));
      result.tokens.push_back({ids[s], t.id, t.logprob, std::move(t.top)});
    }
  }
  AddPromptScores(step, std::move(scored), result);
  return result;
}

absl::StatusOr<std::vector<StepToken>> Rank::MtpDrafts(
    const StepDesc& step, const std::vector<bool>& sample, bool greedy,
    const std::vector<std::vector<SampledToken>>& tokens) {
  // Each sampled chunk's chosen ids (its kept drafts and one more) on every rank: the sampler
  // broadcasts them, a count and 1 + drafts slots a chunk.
  const size_t S = step.chunks.size();
  std::vector<std::vector<int32_t>> chosen(S);
  if (greedy || cfg_.env.tp == 1) {
    for (size_t s = 0; s < S; ++s) {
      for (const SampledToken& t : tokens[s]) chosen[s].push_back(t.id);
    }
  } else {
    std::vector<int32_t> packed;
    for (size_t s = 0; s < S; ++s) {
      const size_t at = packed.size();
      packed.resize(at + 2 + step.chunks[s].drafts, 0);
      packed[at] = static_cast<int32_t>(tokens[s].size());
      for (size_t j = 0; j < tokens[s].size() && j < packed.size() - at - 1; ++j) {
        packed[at + 1 + j] = tokens[s][j].id;
      }
    }
    RETURN_IF_ERROR(tp_group_->Broadcast(packed.data(), packed.size() * sizeof(int32_t), 0));
    for (size_t s = 0, at = 0; s < S; at += 2 + step.chunks[s].drafts, ++s) {
      const int32_t n = std::clamp<int32_t>(packed[at], 0, 1 + step.chunks[s].drafts);
      chosen[s].assign(packed.begin() + at + 1, packed.begin() + at + 1 + n);
    }
  }
  // Row r of a chunk reads its next token: the chunk's own next row's, the step's chosen tokens
  // after its last token (a sampled chunk's kept drafts and one more: its refused drafts' rows
  // are left out, rewound later), or the leader's `next` after a prompt chunk.
  std::vector<int32_t> rows, next, draft_rows;
  std::vector<int64_t> draft_seqs;
  int32_t row0 = 0;
  for (size_t s = 0; s < S; ++s) {
    const StepChunk& ch = step.chunks[s];
    const int32_t n = static_cast<int32_t>(ch.tokens.size());
    const int32_t own = sample[s] ? n - static_cast<int32_t>(ch.drafts) : n;  // real tokens
    for (int32_t r = 0; r + 1 < own; ++r) {
      rows.push_back(row0 + r);
      next.push_back(ch.tokens[r + 1]);
    }
    const std::vector<int32_t> after =
        sample[s] ? chosen[s]
                  : (ch.next >= 0 ? std::vector<int32_t>{ch.next} : std::vector<int32_t>{});
    for (size_t j = 0; j < after.size(); ++j) {
      rows.push_back(row0 + own - 1 + static_cast<int32_t>(j));
      next.push_back(after[j]);
    }
    if (sample[s] && !after.empty()) {
      draft_rows.push_back(static_cast<int32_t>(rows.size()) - 1);
      draft_seqs.push_back(ch.seq);
    }
    row0 += n;
  }
  std::vector<StepToken> out;
  if (rows.empty()) return out;
  ASSIGN_OR_RETURN(std::vector<int32_t> drafts,
                   model_->Mtp(rows, next, draft_rows, *cache_, tp_group_.get()));
  for (size_t j = 0; j < drafts.size() && j < draft_seqs.size(); ++j) {
    out.push_back({draft_seqs[j], drafts[j], 0, {}});
  }
  return out;
}

absl::Status Rank::Follow() {
  for (;;) {
    ASSIGN_OR_RETURN(json message, RecvFrame(*mesh_, 0));
    ASSIGN_OR_RETURN(StepMessageType type, DecodeStepMessageType(message));
    if (type == StepMessageType::kStop) return absl::OkStatus();
    if (type == StepMessageType::kPing) {
      RETURN_IF_ERROR(mesh_->Barrier());
      continue;
    }
    if (type == StepMessageType::kKvImport) {
      ASSIGN_OR_RETURN(KvImport import, DecodeKvImport(message));
      int64_t bytes = 0;
      const absl::Status pulled = PullKv(import, &bytes);
      RETURN_IF_ERROR(
          SendFrame(*mesh_, 0, EncodeJsonFrame(EncodeKvImported(import.seq, pulled, bytes))));
      continue;
    }
    if (type == StepMessageType::kLora) {
      ASSIGN_OR_RETURN(const LoraOrder order, DecodeLoraOrder(message));
      const absl::Status done = DoLora(order);
      if (order.op == LoraOrder::Op::kInstall) {
        RETURN_IF_ERROR(
            SendFrame(*mesh_, 0, EncodeJsonFrame(EncodeLoraInstalled(order.slot, done))));
      }
      continue;
    }
    ASSIGN_OR_RETURN(StepDesc step, DecodeStep(message));
    ASSIGN_OR_RETURN(std::optional<StepResult> result, ProcessStep(step));
    if (result) RETURN_IF_ERROR(SendFrame(*mesh_, 0, EncodeJsonFrame(EncodeStepResult(*result))));
  }
}

absl::Status Rank::SendToAll(const json& message) {
  const std::string frame = EncodeJsonFrame(message);
  for (int r = 1; r < world_.world_size(); ++r) RETURN_IF_ERROR(SendFrame(*mesh_, r, frame));
  return absl::OkStatus();
}

absl::Status Rank::Issue(const StepDesc& step) {
  RETURN_IF_ERROR(SendToAll(EncodeStep(step)));
  ASSIGN_OR_RETURN(std::optional<StepResult> result, ProcessStep(step));
  if (result) ready_.push_back(std::move(*result));
  return absl::OkStatus();
}

absl::StatusOr<StepResult> Rank::Collect() {
  if (!ready_.empty()) {
    StepResult r = std::move(ready_.front());
    ready_.pop_front();
    return r;
  }
  ASSIGN_OR_RETURN(json res, RecvFromSampler());
  return DecodeStepResult(res);
}

absl::StatusOr<json> Rank::RecvFromSampler() { return RecvFrame(*mesh_, LastSampler()); }

absl::StatusOr<json> Rank::AnswerOf(int r, bool (*is_answer)(const json&)) {
  if (r != LastSampler()) return RecvFrame(*mesh_, r);
  for (;;) {
    ASSIGN_OR_RETURN(json answer, RecvFromSampler());
    if (is_answer(answer)) return answer;
    ASSIGN_OR_RETURN(StepResult early, DecodeStepResult(answer));
    ready_.push_back(std::move(early));
  }
}

absl::Status Rank::StartKvTransfer() {
  const std::string& role = cfg_.env.kv_role;
  // The transfer reads and writes the blocks through host pointers; a KV cache in GPU memory
  // (UCX's CUDA transports) is not wired yet: refused by name, never sent from device memory.
  if (!role.empty() && !cache_->storage()->on_host()) {
    return absl::UnimplementedError(absl::StrCat(
        "SHARDSERVE_KV_ROLE=", role,
        ": disaggregated serving moves host-memory KV caches only; this rank's KV cache is in GPU "
        "memory (the CUDA backend)"));
  }
  if (role == "decode") {
    ASSIGN_OR_RETURN(puller_, KvPuller::Create());
    return absl::OkStatus();
  }
  if (role != "prefill") return absl::OkStatus();
  ASSIGN_OR_RETURN(exporter_, KvExporter::Create());
  if (!world_.is_leader()) {
    return SendFrame(*mesh_, 0,
                     EncodeJsonFrame({{"kv_address", absl::Base64Escape(exporter_->address())}}));
  }
  kv_addresses_ = {exporter_->address()};
  for (int r = 1; r < world_.world_size(); ++r) {
    ASSIGN_OR_RETURN(json m, RecvFrame(*mesh_, r));
    ASSIGN_OR_RETURN(const std::string a, JsonString(m, "kv_address", 1 << 16));
    std::string bytes;
    if (!absl::Base64Unescape(a, &bytes) || bytes.empty()) {
      return absl::DataLossError(
          absl::StrCat(world_.Describe(r), " sent an exporter address that is not base64"));
    }
    kv_addresses_.push_back(std::move(bytes));
  }
  return absl::OkStatus();
}

absl::Status Rank::PullKv(const KvImport& im, int64_t* bytes) {
  *bytes = 0;
  if (!puller_) return absl::FailedPreconditionError("this replica does not take KV from others");
  if (static_cast<int64_t>(im.blocks.size()) * cache_->block_size() < im.positions ||
      std::any_of(im.blocks.begin(), im.blocks.end(),
                  [&](int32_t b) { return b < 0 || b >= cache_->num_blocks(); })) {
    return absl::InvalidArgumentError(absl::StrCat(im.blocks.size(), " blocks for ", im.positions,
                                                   " positions, or a block outside the cache"));
  }
  ASSIGN_OR_RETURN(std::vector<KvPullPlan> plans,
                   PlanKvPull(im.source, kv_shape_, cfg_.env.stage, cfg_.env.tp_rank,
                              *cache_->storage(), im.blocks, static_cast<size_t>(im.skip_blocks)));
  const absl::Time deadline = absl::Now() + absl::Milliseconds(cfg_.env.kv_transfer_timeout_ms);
  for (const KvPullPlan& plan : plans) {
    if (plan.ranges.empty()) continue;
    const size_t from = static_cast<size_t>(plan.stage) * im.source.tp + plan.tp_rank;
    absl::Status s = puller_->Pull(im.addresses[from], im.ticket, plan.ranges,
                                   std::max(deadline - absl::Now(), absl::ZeroDuration()));
    if (!s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("pulling from prefill rank ", from, ": ", s.message()));
    }
    for (const KvRange& r : plan.ranges) *bytes += static_cast<int64_t>(r.size);
  }
  return model_->backend().Synchronize();
}

absl::Status Rank::ImportKv(const KvImport& im, absl::Status* transfer, int64_t* bytes) {
  RETURN_IF_ERROR(SendToAll(EncodeKvImport(im)));
  *transfer = PullKv(im, bytes);
  if (!transfer->ok()) {
    *transfer =
        absl::Status(transfer->code(), absl::StrCat(world_.Describe(0), ": ", transfer->message()));
  }
  for (int r = 1; r < world_.world_size(); ++r) {
    ASSIGN_OR_RETURN(const json answer, AnswerOf(r, IsKvImported));
    absl::Status theirs;
    int64_t their_bytes = 0;
    RETURN_IF_ERROR(DecodeKvImported(answer, im.seq, &theirs, &their_bytes));
    *bytes += their_bytes;
    if (transfer->ok() && !theirs.ok()) {
      *transfer =
          absl::Status(theirs.code(), absl::StrCat(world_.Describe(r), ": ", theirs.message()));
    }
  }
  // Every rank is done with the offer (pulled, or given up): the prefill leader frees it.
  if (!puller_) return absl::OkStatus();
  if (absl::Status released = puller_->Release(im.addresses[0], im.ticket, absl::Seconds(2));
      !released.ok() && transfer->ok()) {
    LogWarning("sequence ", im.seq, ": the prefill replica did not take its KV back (",
               released.message(), "); it frees the KV when its offer expires");
  }
  return absl::OkStatus();
}

absl::Status Rank::DoLora(const LoraOrder& o) {
  switch (o.op) {
    case LoraOrder::Op::kPrepare: {
      LoraLimits limits;
      limits.max_rank = cfg_.env.max_lora_rank;
      const Transformer* model = model_.get();
      lora_prepared_[o.id] = std::async(std::launch::async, [model, limits, path = o.path]() {
                               absl::StatusOr<LoraAdapter> a =
                                   LoraAdapter::Load(path, model->config(), limits);
                               if (!a.ok()) return absl::StatusOr<PreparedLora>(a.status());
                               return model->PrepareLora(*a);
                             }).share();
      return absl::OkStatus();
    }
    case LoraOrder::Op::kInstall: {
      auto it = lora_prepared_.find(o.id);
      if (it == lora_prepared_.end()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "LoRA adapter ", o.id, " was not prepared on ", world_.Describe(world_.rank())));
      }
      const absl::StatusOr<PreparedLora>& prepared = it->second.get();  // normally done by now
      if (!prepared.ok()) return prepared.status();
      return model_->InstallLora(o.slot, *prepared);
    }
    case LoraOrder::Op::kEvict:
      return model_->UnloadLora(o.slot);
    case LoraOrder::Op::kForget:
      lora_prepared_.erase(o.id);
      return absl::OkStatus();
  }
  return absl::OkStatus();
}

absl::Status Rank::OrderLora(const LoraOrder& o, absl::Status* result) {
  RETURN_IF_ERROR(SendToAll(EncodeLoraOrder(o)));
  *result = DoLora(o);
  if (!result->ok()) {
    *result =
        absl::Status(result->code(), absl::StrCat(world_.Describe(0), ": ", result->message()));
  }
  if (o.op != LoraOrder::Op::kInstall) return absl::OkStatus();
  for (int r = 1; r < world_.world_size(); ++r) {
    ASSIGN_OR_RETURN(const json answer, AnswerOf(r, IsLoraInstalled));
    absl::Status theirs;
    RETURN_IF_ERROR(DecodeLoraInstalled(answer, o.slot, &theirs));
    if (result->ok() && !theirs.ok()) {
      *result =
          absl::Status(theirs.code(), absl::StrCat(world_.Describe(r), ": ", theirs.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status Rank::Ping() {
  RETURN_IF_ERROR(SendToAll(EncodePing()));
  return mesh_->Barrier();
}

absl::Status Rank::Stop() { return SendToAll(EncodeStop()); }

LeaderContext Rank::Context() {
  const ModelConfig& c = model_->config();
  LeaderContext ctx;
  ctx.executor = this;
  ctx.config = &c;
  if (metrics_) {
    ctx.registry = metrics_->registry();
    ctx.expose = [m = metrics_.get()](std::shared_ptr<prometheus::Collectable> r) {
      m->Expose(std::move(r));
    };
  }
  const WorkerEnv& env = cfg_.env;
  EngineOptions& o = ctx.engine;
  o.max_batch = env.max_batch_size;
  o.max_queue = env.max_queue;
  o.max_step_tokens = env.max_step_tokens;
  o.microbatches = std::max(1, env.microbatches > 0 ? env.microbatches : env.pp);
  o.kv_blocks = cache_->num_blocks();
  o.kv_block_size = cache_->block_size();
  o.prefix_caching = env.prefix_caching;
  o.lora_slots = env.max_loras;
  o.max_adapters = env.max_cpu_loras;
  if (auto declared = ParseAdapterList(env.lora_adapters); declared.ok()) {  // checked at Init
    o.adapters = *std::move(declared);
  }
  o.kv_offer_hold = std::chrono::milliseconds(env.kv_offer_ms);
  o.speculative.method =
      ParseSpeculativeMethod(env.speculative_method).value_or(SpeculativeMethod::kNone);
  o.speculative.tokens = env.speculative_tokens;
  o.drafter = drafter_;
  o.max_context = env.max_sequence_length > 0 ? std::min(c.max_context, env.max_sequence_length)
                                              : c.max_context;
  o.vocab_size = c.vocab_size;
  o.eos_token_ids = c.eos_token_ids;
  ctx.kv_shape = kv_shape_;
  ctx.kv_addresses = kv_addresses_;
  if (exporter_) {
    ctx.on_kv_release = [e = exporter_.get()](std::function<void(const KvTicket&)> released) {
      e->OnRelease(std::move(released));
    };
  }
  return ctx;
}
}  // namespace

absl::StatusOr<LayerRange> StageLayersOf(const WorkerEnv& env, const ModelConfig& c) {
  std::vector<LayerRange> split;
  if (!env.stage_layers.empty()) {
    auto given = ParseStageLayers(env.stage_layers, c.num_layers, env.pp);
    if (!given.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(kStageLayersEnv, ": ", given.status().message()));
    }
    split = *std::move(given);
  } else {  // a worker started by hand: the plan the launchers would give it
    ASSIGN_OR_RETURN(split, PlanStageLayers(c.shape(), env.pp));
  }
  if (env.stage < 0 || env.stage >= static_cast<int>(split.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("stage ", env.stage, " of a ", split.size(), "-stage pipeline"));
  }
  return split[env.stage];
}

absl::StatusOr<RankConfig> RankConfigFrom(const WorkerEnv& w) {
  RankConfig c;
  if (w.model_path.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", kModelPathEnv, " is not set"));
  }
  c.env = w;
  if (!w.leader_addr.empty()) {  // HOST:PORT, checked by WorkerEnv::FromEnv
    const size_t colon = w.leader_addr.rfind(':');
    c.leader_host = w.leader_addr.substr(0, colon);
    c.leader_port = std::stoi(w.leader_addr.substr(colon + 1));
  }
  // Names this replica's shared memory: one per model replica, so replicas sharing a node
  // never meet.
  c.job_id = w.job_id.empty() ? absl::StrCat(w.model_name, "-r", w.replica) : w.job_id;
  for (char& ch : c.job_id) {
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '-') ch = '-';
  }
  if (!w.host.empty()) {
    c.host = w.host;
  } else if (c.leader_host != "127.0.0.1" && c.leader_host != "localhost") {
    char name[256] = {};
    gethostname(name, sizeof(name) - 1);
    c.host = name;
  }
  c.bind_host = !w.pod_ip.empty() ? w.pod_ip : c.local() ? "127.0.0.1" : "";
  if (!w.rendezvous_secret_file.empty()) {
    ASSIGN_OR_RETURN(c.secret, ReadSecretFile(w.rendezvous_secret_file));
  } else if (w.tp * w.pp > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "environment variable ", kSecretFileEnv,
        " is not set: the ranks of a replica prove a shared secret to each other (the operator "
        "mounts one per replica; shardserve local makes one per run)"));
  }
  if (w.metrics) {
    c.metrics_port =
        w.metrics_port_base >= 0 ? w.metrics_port_base + w.rank() : kMetricsPortBase + w.tp_rank;
  }
  return c;
}

std::string ShmGroupName(const RankConfig& c) {
  return absl::StrCat("/shardserve-", c.job_id, "-stage", c.env.stage);
}

void RefuseReplica(const RankConfig& config, const WorldConfig& world, const absl::Status& why) {
  if (world.world_size() == 1) return;
  auto server = RendezvousServer::Listen(config.bind_host, config.leader_port, config.secret);
  if (!server.ok()) return;
  server->RefuseAll(world, std::string(why.message()),
                    std::min(config.startup_timeout(), std::chrono::milliseconds(30000)));
}

absl::StatusOr<RankOutcome> RunRank(const RankConfig& config, const WorldConfig& world,
                                    const LeaderMain& lead, const std::function<void()>& started) {
  if (world.tp() != config.env.tp || world.pp() != config.env.pp || world.rank() != config.rank()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", config.rank(), " of tp ", config.env.tp, " x pp ", config.env.pp,
                     " was given the world of ", world.Describe(world.rank()), " in tp ",
                     world.tp(), " x pp ", world.pp()));
  }
  Rank rank(config, world);
  if (absl::Status s = rank.Init(); !s.ok()) return rank.AbortAll(s);
  if (started) started();
  RankOutcome outcome;
  if (world.is_leader()) {
    LeaderContext ctx = rank.Context();
    if (absl::Status s = lead(ctx); !s.ok()) return rank.AbortAll(s);
  } else if (absl::Status s = rank.Follow(); !s.ok()) {
    return rank.AbortAll(s);
  }
  outcome.resident_bytes = ResidentBytes();
  outcome.shard_weight_bytes = rank.model().shard_weight_bytes();
  outcome.stage_weight_bytes = rank.model().stage_weight_bytes();
  return outcome;
}

}  // namespace shardserve
