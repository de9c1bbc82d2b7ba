// shardserve-worker: the pod entrypoint (DESIGN.md §4).
//   launch  starts the T rank processes of this stage (env: SHARDSERVE_TP, SHARDSERVE_STAGE, ...),
//           supervises them and exits non-zero, naming the rank, when one dies.
//   rank    one rank (env as above plus SHARDSERVE_TP_RANK). The leader serves the OpenAI API
//           (serve/api_server.h) until SIGTERM/SIGINT, then stops the replica cleanly; with
//           SHARDSERVE_REQUEST (JSON) it runs that one request instead and writes the result to
//           SHARDSERVE_RESULT_FILE. The other ranks keep serving until the leader stops them.
//   inspect reads the model at SHARDSERVE_MODEL_PATH (its config and tokenizer) and prints its
//           shape (plan/layer_split.h), also as the termination message: the operator runs it in
//           a pod of its own to plan the layer split before any rank starts. A remote model
//           (SHARDSERVE_MODEL_URI) is listed first, its revision pinned in the report ("source")
//           and its small files fetched into SHARDSERVE_MODEL_PATH.
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "comm/world.h"
#include "common/log.h"
#include "common/process.h"
#include "common/status.h"
#include "model/config.h"
#include "model/footprint.h"
#include "plan/layer_split.h"
#include "serve/api_server.h"
#include "serve/generate_wire.h"
#include "serve/rank_runtime.h"
#include "source/model_cache.h"
#include "source/model_source.h"
#include "tokenizer/tokenizer.h"

namespace shardserve {
namespace {

absl::Status Launch(const WorkerEnv& env) {
  ASSIGN_OR_RETURN(RankConfig cfg, RankConfigFrom(env));
  SetLogIdentity(absl::StrCat("stage ", cfg.env.stage, " launcher"));
  ASSIGN_OR_RETURN(WorldConfig world,
                   WorldConfig::Create(cfg.env.tp, cfg.env.pp, cfg.env.stage * cfg.env.tp));
  // A model of the node's cache (a remote uri): held while the stage runs, so that the cache's
  // eviction passes over it (source/model_cache.h). The descriptor lives as long as the process.
  if (std::filesystem::exists(cfg.env.model_path + "/.inuse")) {
    ASSIGN_OR_RETURN(const int held, source::HoldInUse(cfg.env.model_path));
    (void)held;
  }
  std::vector<Child> ranks;
  const std::string self = SelfDirectory() + "/shardserve-worker";
  for (int t = 0; t < cfg.env.tp; ++t) {
    const int rank = world.RankOf(cfg.env.stage, t);
    auto pid = Spawn(self, {"rank", "--rank", std::to_string(rank)},
                     {{kTpRankEnv, std::to_string(t)}}, /*own_group=*/false);
    if (!pid.ok()) {
      for (const Child& c : ranks) kill(c.pid, SIGKILL);
      return pid.status();
    }
    ranks.push_back({*pid, world.Describe(rank)});
  }
  // Longer than the leader's default drain, so a clean stop is not cut short.
  return SuperviseAll(ranks, std::chrono::milliseconds(10000));
}

// SIGINT/SIGTERM are taken by a thread rather than ending the process, so that the leader can
// end generation and stop every rank on a step boundary. Construct before any other thread.
class StopSignals {
 public:
  StopSignals() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGINT);
    sigaddset(&set_, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set_, nullptr);
    signal(SIGPIPE, SIG_IGN);  // a client that goes away must not end the process
    std::thread([this] {
      int sig;
      while (sigwait(&set_, &sig) == 0) {
        std::function<void()> f;
        {
          absl::MutexLock lock(&mu_);
          stopped_ = true;
          f = on_stop_;
        }
        if (f) f();
      }
    }).detach();
  }
  // Runs `f` on the next stop signal, or now if one came already.
  void OnStop(std::function<void()> f) {
    bool now;
    {
      absl::MutexLock lock(&mu_);
      on_stop_ = f;
      now = stopped_;
    }
    if (now && f) f();
  }

 private:
  sigset_t set_;
  absl::Mutex mu_;
  std::function<void()> on_stop_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

// The leader's serving loop: the API answers from the start (not ready), the engine runs once
// the replica is up, and a stop signal or a replica failure ends it after the requests in
// progress have been answered.
absl::Status Serve(const RankConfig& cfg, const WorldConfig& world, StopSignals& signals) {
  const ServeConfig sc = ServeConfigFrom(cfg.env, cfg.local());
  absl::StatusOr<std::unique_ptr<ApiServer>> started = ApiServer::Start(sc);
  if (!started.ok()) {
    // The other ranks are told at the rendezvous at once, rather than waiting for a leader that
    // will not come.
    LogError("leader: cannot serve: ", started.status().message());
    RefuseReplica(cfg, world, started.status());
    return started.status();
  }
  std::unique_ptr<ApiServer> server = *std::move(started);
  LogInfo("leader: API on http://", sc.host, ":", server->port(), " (model '", cfg.env.model_name,
          "')");
  absl::StatusOr<RankOutcome> outcome = RunRank(cfg, world, [&](LeaderContext& ctx) {
    server->AttachRankMetrics(ctx.registry, ctx.expose);
    const EngineOptions& o = ctx.engine;
    Engine engine(ctx.executor, o, server->Observer());
    server->SetKvSource(ctx.kv_shape, ctx.kv_addresses);
    // A prefill replica: a decode replica done with an offer frees its blocks.
    if (ctx.on_kv_release) {
      ctx.on_kv_release([&engine](const KvTicket& t) { engine.ReleaseOffer(t); });
    }
    server->SetEngine(&engine);
    signals.OnStop([&engine, drain = std::chrono::seconds(cfg.env.drain_seconds)] {
      LogInfo("leader: stopping; draining the requests in progress");
      engine.Shutdown(drain);
    });
    LogInfo("leader: ready");
    const absl::Status s = engine.Run();
    if (ctx.on_kv_release) ctx.on_kv_release(nullptr);
    signals.OnStop(nullptr);
    server->SetEngine(nullptr, s.ok() ? "the server is shutting down"
                                      : absl::StrCat("the model replica failed: ", s.message()));
    server->Stop(std::chrono::seconds(5));  // the failed requests get their answers first
    return s;
  });
  server->Stop(std::chrono::seconds(0));
  return outcome.status();
}

absl::StatusOr<GenerateRun> ReadRun(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  return DecodeGenerateRun(j);
}

// A stop before the replica serves has nothing to drain: the stage's shared memory (should this
// rank have made it) goes, then the process, with success.
void QuitBeforeServing(const RankConfig& cfg) {
  LogInfo("stopped before the replica started");
  if (cfg.env.tp > 1) shm_unlink(ShmGroupName(cfg).c_str());
  std::fflush(stderr);
  std::_Exit(0);
}

absl::Status RunOneRank(const WorkerEnv& env) {
  ASSIGN_OR_RETURN(RankConfig cfg, RankConfigFrom(env));
  ASSIGN_OR_RETURN(WorldConfig world, WorldConfig::Create(cfg.env.tp, cfg.env.pp, cfg.rank()));
  SetLogIdentity(world.Describe(cfg.rank()));
  if (env.request.empty()) {
    // Serving: a stop signal drains through the leader once the replica runs; before that it
    // ends the rank at once. (A one-shot run just ends on one.)
    StopSignals signals;
    signals.OnStop([cfg] { QuitBeforeServing(cfg); });
    if (cfg.rank() == 0) return Serve(cfg, world, signals);
    // Serving, the leader stops this rank on a step boundary.
    return RunRank(cfg, world, nullptr, [&signals] { signals.OnStop(nullptr); }).status();
  }
  ASSIGN_OR_RETURN(const GenerateRun run, ReadRun(env.request));
  const std::vector<GenerationRequest> requests(run.batch, run.request);
  GenerateOutcome result;
  ASSIGN_OR_RETURN(
      RankOutcome outcome, RunRank(cfg, world, [&](LeaderContext& ctx) -> absl::Status {
        const auto t0 = std::chrono::steady_clock::now();
        EngineOptions o = ctx.engine;
        o.max_batch = std::max<int>(1, static_cast<int>(requests.size()));
        EngineObserver observer;
        observer.speculation = [&result](int64_t drafted, int64_t accepted) {
          result.drafted += drafted;
          result.accepted += accepted;
        };
        std::optional<int64_t> first;  // the first sequence that drafts
        observer.drafts = [&result, &first](int64_t seq, const std::vector<int32_t>& drafts) {
          if (!first) first = seq;
          if (seq == *first) result.drafts.push_back(drafts);
        };
        ASSIGN_OR_RETURN(result.results, GenerateAll(ctx.executor, o, requests, observer));
        result.seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        return absl::OkStatus();
      }));
  if (env.report_memory) {
    std::fprintf(stderr,
                 "%s: resident %.0f MB; weight slices %.0f MB of its stage's %.0f MB (1/%d = %.0f "
                 "MB)\n",
                 world.Describe(cfg.rank()).c_str(), outcome.resident_bytes / 1e6,
                 outcome.shard_weight_bytes / 1e6, outcome.stage_weight_bytes / 1e6, cfg.env.tp,
                 outcome.stage_weight_bytes / 1e6 / cfg.env.tp);
  }
  const std::string& out_path = env.result_file;
  if (cfg.rank() != 0 || out_path.empty()) return absl::OkStatus();
  std::ofstream f(out_path, std::ios::trunc);
  f << EncodeGenerateOutcome(result).dump();
  f.close();
  if (!f) return absl::InternalError(absl::StrCat(out_path, ": cannot write the result"));
  return absl::OkStatus();
}

// A remote model's listing, pinned for the stages (status.model.source), and its small files (the
// config, the tokenizer: not the weights) fetched into `scratch`, where Inspect reads them.
struct Listed {
  std::string dir;  // where the small files are
  nlohmann::json source;
};

absl::StatusOr<Listed> ListRemote(const WorkerEnv& env, const std::string& scratch) {
  ASSIGN_OR_RETURN(const ModelUri uri, ParseModelUri(env.model_uri));
  const std::vector<std::string> patterns =
      absl::StrSplit(env.model_files, ',', absl::SkipWhitespace());
  ASSIGN_OR_RETURN(const source::ModelListing listing,
                   source::ListModel(uri, env.model_uri, patterns,
                                     source::SecretEnv(env.credentials_dir, ProcessEnv)));
  std::vector<source::RemoteFile> small;
  int64_t bytes = 0;
  bool config = false;
  for (const source::RemoteFile& f : listing.files) {
    bytes += f.size;
    const bool weights = absl::EndsWith(f.path, ".safetensors") ||
                         absl::EndsWith(f.path, ".gguf") || absl::EndsWith(f.path, ".bin") ||
                         absl::EndsWith(f.path, ".pt") || absl::EndsWith(f.path, ".pth");
    if (!weights && f.size <= (int64_t{64} << 20)) small.push_back(f);
    config |= f.path == "config.json";
  }
  if (!config) {
    return absl::InvalidArgumentError(absl::StrCat(
        env.model_uri, " lists no config.json",
        patterns.empty() ? "" : " among the files spec.model.files chooses",
        " (a cluster reads a remote model's shape from it; a GGUF file is served from pvc:// or "
        "hostpath:// on a cluster)"));
  }
  ASSIGN_OR_RETURN(const source::FetchReport r,
                   source::Materialize(absl::StrCat(scratch, "/", listing.root), env.model_uri,
                                       listing.key, small));
  return Listed{r.dir,
                {{"revision", listing.revision},
                 {"dir", listing.dir()},
                 {"bytes", bytes},
                 {"files", listing.files.size()}}};
}

absl::Status Inspect(const WorkerEnv& env) {
  if (env.model_path.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable ", kModelPathEnv, " is not set"));
  }
  std::string dir = env.model_path;
  nlohmann::json source;
  if (!env.model_uri.empty()) {  // remote: model_path is a scratch directory
    ASSIGN_OR_RETURN(Listed listed, ListRemote(env, env.model_path));
    dir = listed.dir;
    source = std::move(listed.source);
  }
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir));
  RETURN_IF_ERROR(Tokenizer::Load(dir).status());  // the leader would fail on it later
  // What the memory plan weighs, with the shape the layer split weighs (the config's, as the
  // ranks will compute it); one line, well inside a termination message's 4 KiB.
  ASSIGN_OR_RETURN(ModelFootprint footprint, LoadFootprint(dir));
  footprint.shape = config.shape();
  nlohmann::json out = FootprintToJson(footprint);
  if (!source.is_null()) out["source"] = source;
  const std::string report = out.dump();
  if (report.size() > 4000) {  // Kubernetes keeps 4096 bytes of a termination message
    return absl::FailedPreconditionError(
        absl::StrCat("the model's footprint is ", report.size(), " bytes (its layers differ in ",
                     footprint.kinds.size(), " ways), more than a termination message holds"));
  }
  std::printf("%s\n", report.c_str());
  ReportTermination(env.termination_log, report);
  return absl::OkStatus();
}

}  // namespace
}  // namespace shardserve

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "";
  if (cmd != "launch" && cmd != "rank" && cmd != "inspect") {
    std::fprintf(stderr, "usage: shardserve-worker launch | rank | inspect\n");
    return 2;
  }
  // The worker contract, read once for the whole process.
  const absl::StatusOr<shardserve::WorkerEnv> env = shardserve::WorkerEnv::FromEnv();
  const absl::Status s = !env.ok()          ? env.status()
                         : cmd == "launch"  ? shardserve::Launch(*env)
                         : cmd == "inspect" ? shardserve::Inspect(*env)
                                            : shardserve::RunOneRank(*env);
  if (!s.ok()) {
    std::fprintf(stderr, "shardserve-worker %s: %s\n", cmd.c_str(),
                 std::string(s.message()).c_str());
    // When the contract itself is what is wrong, its termination log is still where it says.
    const char* log = shardserve::ProcessEnv(shardserve::kTerminationLogEnv);
    shardserve::ReportTermination(env.ok() ? env->termination_log
                                  : log    ? log
                                           : "",
                                  std::string(s.message()));
    return 1;
  }
  return 0;
}
