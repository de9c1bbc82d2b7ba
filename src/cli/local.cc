// `shardserve local -f MANIFEST.yaml`: a ShardedModel on this machine (DESIGN.md §4). Every
// replica's stages run as `shardserve-worker launch` processes, each starting its T ranks, with
// the pod contract's environment; ports are offset per replica and global rank and printed.
// Ctrl-C or SIGTERM stops everything cleanly; a replica whose rank fails is restarted (with
// backoff) while the others keep serving.
#include "cli/local.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "api/adapters.h"
#include "api/router_env.h"
#include "api/sharded_model.h"
#include "api/worker_env.h"
#include "comm/handshake.h"
#include "comm/socket.h"
#include "common/args.h"
#include "common/process.h"
#include "common/status.h"
#include "common/text.h"
#include "http/server.h"
#include "model/config.h"
#include "model/footprint.h"
#include "model/lora.h"
#include "plan/layer_split.h"
#include "plan/memory.h"
#include "serve/api_keys.h"
#include "serve/flow_control.h"
#include "serve/rank_runtime.h"
#include "source/model_source.h"
#include "tokenizer/tokenizer.h"

namespace shardserve {
namespace {

struct LocalReplica {
  std::string name;  // "replica 0", "prefill replica 0"
  std::string role;  // WorkerEnv::kv_role
  int index = 0;
  int api_port = 0;
  int rendezvous_port = 0;
  int metrics_base = 0;
};

// Polls every replica's /readyz until all are ready (printing each, and setting its `ready`
// flag), then the router's (port `router`, 0: none; the last flag) until it routes to them all,
// or until `stop` is set.
void AnnounceReady(const std::vector<LocalReplica>& replicas, int router, const ShardedModel& m,
                   const std::atomic<bool>& stop, std::vector<std::atomic<bool>>& ready) {
  size_t left = replicas.size() + (router > 0 ? 1 : 0);
  while (left > 0 && !stop.load()) {
    for (size_t i = 0; i < replicas.size(); ++i) {
      if (ready[i]) continue;
      auto res = http::Fetch("127.0.0.1", replicas[i].api_port, "GET", "/readyz", {}, "",
                             std::chrono::milliseconds(500));
      if (res.ok() && res->status == 200) {
        ready[i] = true;
        --left;
        std::printf("%s ready: http://127.0.0.1:%d/v1 (model '%s')\n", replicas[i].name.c_str(),
                    replicas[i].api_port, m.spec.model_name.c_str());
        std::fflush(stdout);
      }
    }
    if (router > 0 && left == 1) {  // every replica ready: the router follows them all
      auto res = http::Fetch("127.0.0.1", router, "GET", "/readyz", {}, "",
                             std::chrono::milliseconds(500));
      if (res.ok() && res->status == 200 &&
          res->body.find(absl::StrCat("\"routable_replicas\":", replicas.size())) !=
              std::string::npos) {
        --left;
        ready.back() = true;
        std::printf("router ready: http://127.0.0.1:%d/v1 in front of %zu replicas\n", router,
                    replicas.size());
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (left == 0) {
    std::printf("shardserve local: serving; Ctrl-C stops\n");
    std::fflush(stdout);
  }
}

// A remote spec.model.uri fetched into the model cache (its directory, what moved).
// A remote model or adapter (`uri_text`, in manifest field `field`) fetched into the model cache:
// the files `patterns` choose (all when empty).
absl::StatusOr<source::FetchReport> Fetch(const std::string& file, const std::string& field,
                                          const std::string& uri_text,
                                          const std::vector<std::string>& patterns) {
  source::ResolveOptions o;
  o.env = [](const char* name) { return std::getenv(name); };
  o.cache_root = source::DefaultCacheRoot(o.env);
  o.files = patterns;
  int64_t last_report = -1;
  o.progress = [&](int64_t done, int64_t total) {
    const int64_t step = total / 10 + 1;  // a line every tenth
    if (done / step != last_report) {
      last_report = done / step;
      std::fprintf(stderr, "shardserve local: fetching %s: %.1f of %.1f MB\n", uri_text.c_str(),
                   done / 1e6, total / 1e6);
    }
  };
  ASSIGN_OR_RETURN(ModelUri uri, ParseModelUri(uri_text));
  absl::StatusOr<source::FetchReport> r = source::ResolveModel(uri, uri_text, o);
  if (!r.ok()) {
    return absl::Status(r.status().code(),
                        absl::StrCat(file, ": ", field, ": ", r.status().message()));
  }
  std::fprintf(stderr, "shardserve local: %s is %s (%.1f MB%s; %.1f MB fetched now)\n",
               uri_text.c_str(), r->dir.c_str(), r->bytes_total / 1e6,
               r->cache_hit ? ", in the cache already" : "", r->bytes_fetched / 1e6);
  if (!r->weak_checks.empty()) {
    std::fprintf(stderr,
                 "shardserve local: %zu file(s) checked by size alone (the source gives no "
                 "checksum for them): %s\n",
                 r->weak_checks.size(), r->weak_checks.front().c_str());
  }
  return *std::move(r);
}

// What the fetch did, as a pod's fetch step reports it (cli/fetch.h), for the ranks' metrics: a
// file of this run, removed with it.
class FetchReportFile {
 public:
  static absl::StatusOr<FetchReportFile> Write(const source::FetchReport& r, int64_t cache_bytes) {
    char path[] = "/tmp/shardserve-fetch-XXXXXX";
    const int fd = ::mkstemp(path);
    if (fd < 0) return absl::InternalError(absl::StrCat("mkstemp: ", std::strerror(errno)));
    const std::string body = nlohmann::json{
        {"bytes_total", r.bytes_total},
        {"bytes_fetched", r.bytes_fetched},
        {"cache_hit", r.cache_hit},
        {"cache_bytes",
         cache_bytes}}.dump();
    const bool ok = ::write(fd, body.data(), body.size()) == static_cast<ssize_t>(body.size());
    ::close(fd);
    if (!ok) return absl::InternalError(absl::StrCat(path, ": cannot write"));
    return FetchReportFile(path);
  }
  FetchReportFile(FetchReportFile&& o) noexcept : path_(std::move(o.path_)) { o.path_.clear(); }
  FetchReportFile& operator=(FetchReportFile&&) = delete;
  ~FetchReportFile() {
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  const std::string& path() const { return path_; }

 private:
  explicit FetchReportFile(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

}  // namespace

absl::Status RunLocal(std::vector<std::string> argv) {
  ASSIGN_OR_RETURN(Args a,
                   Args::Parse(argv,
                               {"file", "port", "metrics-port-base", "threads", "api-key-file",
                                "router-token-file", "admin-key-file", "flow-control-file"},
                               {"no-router"}, "shardserve local", kLocalUsage));
  ASSIGN_OR_RETURN(std::string file, a.Require("file"));
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(file));
  auto parsed = ParseShardedModel(text);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", parsed.status().message()));
  }
  ShardedModel m = *std::move(parsed);
  ShardedModelSpec& spec = m.spec;
  if (!spec.prefill_of.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(file, ": spec.prefillOf: this is the prefill role the operator made for '",
                     spec.prefill_of, "'; run that model's manifest (its spec.disaggregation)"));
  }
  ASSIGN_OR_RETURN(ModelUri uri, ParseModelUri(spec.model_uri));
  if (uri.scheme == ModelUri::Scheme::kPvc) {
    return absl::FailedPreconditionError(
        absl::StrCat(file, ": spec.model.uri '", spec.model_uri,
                     "' is a PersistentVolumeClaim, which needs a cluster; shardserve local reads "
                     "file:///DIR or hostpath:///DIR"));
  }
  if (spec.replicas == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(file, ": spec.replicas is 0, nothing to run"));
  }
  std::optional<FetchReportFile> fetch_report;
  if (uri.remote()) {  // fetched into the model cache (once: a second run finds it there)
    ASSIGN_OR_RETURN(const source::FetchReport fetched,
                     Fetch(file, "spec.model.uri", spec.model_uri, spec.model_files));
    uri.path = fetched.dir;
    const int64_t cache_bytes =
        source::CacheBytes(source::DefaultCacheRoot([](const char* n) { return std::getenv(n); }));
    ASSIGN_OR_RETURN(FetchReportFile written, FetchReportFile::Write(fetched, cache_bytes));
    fetch_report.emplace(std::move(written));
  }
  auto config = LoadModelConfig(uri.path);
  if (!config.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(file, ": spec.model.uri: ", config.status().message()));
  }
  // The leader would fail on these only after every rank started: say it now.
  if (auto tok = Tokenizer::Load(uri.path); !tok.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(file, ": spec.model.uri: ", tok.status().message()));
  }
  // spec.serving.speculative.draftModel: fetched like the model, its vocabulary checked now.
  std::string draft_path;
  if (!spec.draft_model.empty()) {
    ASSIGN_OR_RETURN(ModelUri at, ParseModelUri(spec.draft_model));
    if (at.scheme == ModelUri::Scheme::kPvc) {
      return absl::FailedPreconditionError(absl::StrCat(
          file, ": spec.serving.speculative.draftModel '", spec.draft_model,
          "' is a PersistentVolumeClaim, which needs a cluster; shardserve local reads "
          "file:///DIR or hostpath:///DIR"));
    }
    if (at.remote()) {
      ASSIGN_OR_RETURN(const source::FetchReport fetched,
                       Fetch(file, "spec.serving.speculative.draftModel", spec.draft_model, {}));
      at.path = fetched.dir;
    }
    auto draft = LoadModelConfig(at.path);
    if (!draft.ok() || draft->vocab_size > config->vocab_size) {
      return absl::FailedPreconditionError(
          absl::StrCat(file, ": spec.serving.speculative.draftModel: ",
                       draft.ok() ? absl::StrCat("a vocabulary of ", draft->vocab_size,
                                                 " ids, more than the model's ", config->vocab_size)
                                  : std::string(draft.status().message())));
    }
    draft_path = at.path;
  }
  // spec.adapters: each read and checked against the model now (a rank would fail on it only
  // after every rank started).
  std::vector<AdapterRef> adapters;
  for (size_t i = 0; i < spec.adapters.size(); ++i) {
    ASSIGN_OR_RETURN(ModelUri at, ParseModelUri(spec.adapters[i].uri));
    if (at.remote()) {  // s3://, hf://, oci://: its files fetched into the model cache
      ASSIGN_OR_RETURN(
          const source::FetchReport fetched,
          Fetch(file, absl::StrCat("spec.adapters[", i, "].uri"), spec.adapters[i].uri, {}));
      at.path = fetched.dir;
    }
    if (at.scheme == ModelUri::Scheme::kPvc) {
      return absl::FailedPreconditionError(absl::StrCat(
          file, ": spec.adapters[", i, "].uri '", spec.adapters[i].uri,
          "' is a PersistentVolumeClaim, which needs a cluster; shardserve local reads "
          "file:///DIR or hostpath:///DIR"));
    }
    LoraLimits limits;
    limits.max_rank = spec.max_lora_rank;
    if (auto checked = LoraAdapter::Load(at.path, *config, limits); !checked.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(file, ": spec.adapters[", i, "] '",
                                                        spec.adapters[i].name,
                                                        "': ", checked.status().message()));
    }
    adapters.push_back({spec.adapters[i].name, at.path});
  }
  const std::string key_file = a.GetOr("api-key-file", "");
  const char* env_key = std::getenv(kApiKeyEnv);
  const char* env_key_file = std::getenv(kApiKeysFileEnv);
  const bool keyed = !key_file.empty() || (env_key != nullptr && *env_key) ||
                     (env_key_file != nullptr && *env_key_file);
  if (!spec.api_key_secret.empty() && !keyed) {
    return absl::FailedPreconditionError(absl::StrCat(
        file, ": spec.serving.apiKeySecret names the Kubernetes Secret '", spec.api_key_secret,
        "' of the API keys, which shardserve local cannot read: give the keys with "
        "--api-key-file FILE (one a line) or ",
        kApiKeyEnv));
  }
  if (spec.prefix_cache_isolation == "perKey" && !keyed) {  // else it would isolate nothing
    return absl::FailedPreconditionError(absl::StrCat(
        file,
        ": spec.serving.prefixCacheIsolation perKey separates the cache by API key, and "
        "this deployment has none: give them with --api-key-file FILE or ",
        kApiKeyEnv));
  }
  if (!spec.chat_template_config_map.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        file, ": spec.serving.chatTemplate.configMap names the Kubernetes ConfigMap '",
        spec.chat_template_config_map,
        "', which shardserve local cannot read: give the template as chatTemplate.inline"));
  }
  if (!key_file.empty()) {  // checked before any rank starts
    RETURN_IF_ERROR(ApiKeys::Create("", key_file).status());
  }
  // Adapters loaded at runtime: the admins' keys from --admin-key-file (the manifest's Secret is
  // a cluster's), the adapters' directory from spec.lora.source.
  const std::string admin_key_file = a.GetOr("admin-key-file", "");
  std::string lora_root;
  if (!spec.lora_source.empty()) {
    ASSIGN_OR_RETURN(const ModelUri at, ParseModelUri(spec.lora_source));
    if (at.scheme == ModelUri::Scheme::kPvc) {
      return absl::FailedPreconditionError(absl::StrCat(
          file, ": spec.lora.source '", spec.lora_source,
          "' is a PersistentVolumeClaim, which needs a cluster; shardserve local reads "
          "file:///DIR or hostpath:///DIR"));
    }
    lora_root = at.path;
  }
  if (admin_key_file.empty() != lora_root.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        file,
        ": adapters loaded at runtime need both the admins' keys (--admin-key-file FILE) "
        "and the directory they are in (spec.lora.source)"));
  }
  if (!admin_key_file.empty()) RETURN_IF_ERROR(ApiKeys::Create("", admin_key_file).status());
  // Flow control: the config a cluster mounts from spec.serving.flowControl's ConfigMap or
  // Secret, from a file here (checked before any rank starts).
  const std::string flow_file = a.GetOr("flow-control-file", "");
  if (!flow_file.empty()) RETURN_IF_ERROR(FlowControl::Open(flow_file).status());
  if (flow_file.empty() &&
      (!spec.flow_control_config_map.empty() || !spec.flow_control_secret.empty())) {
    return absl::FailedPreconditionError(absl::StrCat(
        file, ": spec.serving.flowControl names a Kubernetes ",
        spec.flow_control_secret.empty() ? "ConfigMap" : "Secret",
        ", which shardserve local cannot read: give its config with --flow-control-file FILE"));
  }
  if (spec.tensor_auto || spec.pipeline_auto) {
    // No GPU memory to weigh here: the smallest sizes that divide the model.
    auto footprint = LoadFootprint(uri.path);
    if (!footprint.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat(file, ": spec.model.uri: ", footprint.status().message()));
    }
    auto plan = PlanSpec(*footprint, spec, {});
    if (!plan.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(file, ": ", plan.status().message()));
    }
    spec.tensor = plan->choice.tensor;
    spec.pipeline = plan->choice.pipeline;
    std::printf("parallelism auto: TP=%lld x PP=%lld (no GPU memory to weigh on this machine)\n",
                static_cast<long long>(spec.tensor), static_cast<long long>(spec.pipeline));
  }
  auto layers = PlanStageLayers(config->shape(), static_cast<int>(spec.pipeline));
  if (!layers.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        file, ": spec.parallelism.pipeline ", spec.pipeline, ": ", layers.status().message()));
  }
  // The roles: the replicas (with spec.disaggregation, the decode role's), then the prefill
  // replicas, each role with its shape and its layers' split.
  struct Role {
    std::string name;  // "" (colocated), "decode", "prefill"
    int T, P, count;
    std::vector<LayerRange> layers;
  };
  const auto& dis = spec.disaggregation;
  std::vector<Role> roles = {{dis ? "decode" : "", static_cast<int>(spec.tensor),
                              static_cast<int>(spec.pipeline), static_cast<int>(spec.replicas),
                              *layers}};
  if (dis) {
    auto split = PlanStageLayers(config->shape(), static_cast<int>(dis->prefill_pipeline));
    if (!split.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat(file, ": spec.disaggregation.prefill.parallelism.pipeline ",
                       dis->prefill_pipeline, ": ", split.status().message()));
    }
    roles.push_back({"prefill", static_cast<int>(dis->prefill_tensor),
                     static_cast<int>(dis->prefill_pipeline),
                     static_cast<int>(dis->prefill_replicas), *split});
  }
  int R = 0, ranks = 0;  // replicas and ranks of every role
  for (const Role& role : roles) {
    R += role.count;
    ranks += role.count * role.T * role.P;
  }
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  ASSIGN_OR_RETURN(int64_t threads, a.GetInt("threads", std::max(1, cores / std::max(1, ranks))));
  ASSIGN_OR_RETURN(int64_t port, a.GetInt("port", spec.port));
  ASSIGN_OR_RETURN(int64_t metrics_base, a.GetInt("metrics-port-base", kMetricsPortBase));
  // Several replicas, or two roles: the router takes the port, as a Kubernetes Service would
  // reach it.
  const bool routed = (R > 1 || dis) && !a.Has("no-router");
  if (dis && !routed) {
    return absl::InvalidArgumentError(
        "spec.disaggregation needs the router (it pairs the roles): drop --no-router");
  }
  if (threads < 1 || port < 1 || port + R + 1 > 65536 || metrics_base < 1 ||
      metrics_base + ranks > 65536) {
    return absl::InvalidArgumentError(
        "--threads, --port and --metrics-port-base must be positive "
        "and leave room for every replica's ports");
  }

  std::printf("shardserve local: %s, model '%s' from %s\n", m.name.c_str(), spec.model_name.c_str(),
              uri.path.c_str());
  for (const Role& role : roles) {
    std::printf(
        "plan: %s%d replica(s) x %d stage(s) x %d tensor-parallel rank(s), %lld thread(s) "
        "per rank\n",
        role.name.empty() ? "" : (role.name + ": ").c_str(), role.count, role.P, role.T,
        static_cast<long long>(threads));
  }
  std::vector<LocalReplica> replicas;
  std::vector<SecretFile> secrets;  // one per replica, gone when the run ends
  // The router's proof to the leaders' KV events, and what reads its /metrics: the file given
  // (--router-token-file, to scrape the router), else a new secret.
  std::optional<SecretFile> router_token;
  std::string router_token_file = a.GetOr("router-token-file", "");
  if (!router_token_file.empty()) {
    RETURN_IF_ERROR(ApiKeys::Create("", router_token_file).status());
  } else if (routed) {
    ASSIGN_OR_RETURN(SecretFile token, SecretFile::Create());
    router_token_file = token.path();
    router_token.emplace(std::move(token));
  }
  // Each replica's stage launchers, and the router, as groups: a failed replica is restarted
  // (with backoff, as the operator recreates one) while the others keep serving.
  std::vector<ChildGroup> groups;
  // Whether each replica (and last, the router) has been ready once: one that fails before that
  // has a problem a restart would not mend (its model, its settings), and ends the run.
  std::vector<std::atomic<bool>> ever_ready(R + 1);
  auto was_ready = [&ever_ready](size_t k) {
    return [&ever_ready, k] { return ever_ready[k].load(); };
  };
  const std::string self = SelfDirectory() + "/shardserve-worker";
  int next_metrics = static_cast<int>(metrics_base);
  // The ports this run's processes will listen on (the router's and the replicas' APIs, every
  // rank's metrics, the rendezvous ports chosen so far): no rendezvous port may be one of them,
  // though nothing listens there yet.
  std::vector<int> taken;
  for (int64_t p = port; p < port + R + (routed ? 1 : 0); ++p) taken.push_back(static_cast<int>(p));
  for (int64_t p = metrics_base; p < metrics_base + ranks; ++p) {
    taken.push_back(static_cast<int>(p));
  }
  for (const Role& role : roles) {
    const int T = role.T, P = role.P;
    for (int k = 0; k < role.count; ++k) {
      const int r = static_cast<int>(replicas.size());  // the replica's number over both roles
      LocalReplica rep;
      rep.name = role.name == "prefill" ? absl::StrCat("prefill replica ", k)
                                        : absl::StrCat("replica ", k);
      rep.index = r;
      rep.role = role.name;
      rep.api_port = static_cast<int>(port) + r + (routed ? 1 : 0);
      rep.metrics_base = next_metrics;
      next_metrics += T * P;
      ASSIGN_OR_RETURN(rep.rendezvous_port, ChooseFreePort("127.0.0.1", taken));
      taken.push_back(rep.rendezvous_port);
      ASSIGN_OR_RETURN(SecretFile secret, SecretFile::Create());
      secrets.push_back(std::move(secret));
      std::vector<std::vector<std::pair<std::string, std::string>>> stage_envs;
      std::printf("%s: API http://127.0.0.1:%d/v1%s, rendezvous :%d\n", rep.name.c_str(),
                  rep.api_port, keyed ? " (API keys required)" : "", rep.rendezvous_port);
      for (int s = 0; s < P; ++s) {
        const LayerRange& lr = role.layers[s];
        std::printf("  stage %d: layers %s, metrics", s, FormatLayerRange(lr).c_str());
        for (int t = 0; t < T; ++t) {
          std::printf(" tp%d :%d", t, rep.metrics_base + s * T + t);
        }
        std::printf("\n");
        std::vector<std::pair<std::string, std::string>> env;
        for (const ShardedModelSpec::EnvVar& e : spec.env) {
          if (e.value_from.empty()) env.emplace_back(e.name, e.value);  // valueFrom: pods only
        }
        WorkerEnv w;
        w.model_name = spec.model_name;
        w.deployment = m.name;
        w.model_path = uri.path;
        if (fetch_report) w.fetch_report = fetch_report->path();
        w.replica = r;
        w.stage = s;
        w.stage_layers = FormatStageLayers(role.layers);
        w.tp = T;
        w.pp = P;
        w.leader_addr = absl::StrCat("127.0.0.1:", rep.rendezvous_port);
        w.microbatches =
            static_cast<int>(role.name == "prefill" ? P : spec.effective_micro_batches());
        w.threads = static_cast<int>(threads);
        w.job_id = absl::StrCat(m.name, "-", r, "-", getpid());
        w.metrics_port_base = rep.metrics_base;
        w.api_host = "127.0.0.1";
        w.api_port = rep.api_port;
        ApplyServing(spec, w);
        w.draft_model = draft_path;
        w.lora_adapters = EncodeAdapterList(adapters);
        w.kv_role = role.name;
        w.rendezvous_secret_file = secrets.back().path();
        w.api_keys_file = key_file;
        w.admin_keys_file = admin_key_file;
        w.lora_root = lora_root;
        w.router_token_file = router_token_file;  // "" without a router: nobody reads the events
        w.flow_control_file = flow_file;
        const auto contract = w.ToEnv();
        env.insert(env.end(), contract.begin(), contract.end());
        stage_envs.push_back(std::move(env));
      }
      groups.push_back(
          {rep.name,
           [self, name = rep.name, stage_envs]() -> absl::StatusOr<std::vector<Child>> {
             std::vector<Child> launchers;
             for (size_t s = 0; s < stage_envs.size(); ++s) {
               auto pid = Spawn(self, {"launch"}, stage_envs[s]);
               if (!pid.ok()) {
                 for (const Child& c : launchers) kill(-c.pid, SIGKILL);
                 return pid.status();
               }
               launchers.push_back({*pid, absl::StrCat(name, " stage ", s, " launcher")});
             }
             return launchers;
           },
           was_ready(r)});
      replicas.push_back(rep);
    }
  }
  if (routed) {
    std::vector<std::string> leaders, prefill_leaders;
    for (const LocalReplica& rep : replicas) {
      (rep.role == "prefill" ? prefill_leaders : leaders)
          .push_back(absl::StrCat("127.0.0.1:", rep.api_port));
    }
    RouterEnv r;  // the router's contract (api/router_env.h)
    r.leaders = absl::StrJoin(leaders, ",");
    r.prefill_leaders = absl::StrJoin(prefill_leaders, ",");
    if (dis) r.disaggregate_min_tokens = dis->min_prompt_tokens;
    r.port = static_cast<int>(port);
    r.model_path = uri.path;
    r.token_file = router_token_file;
    r.deployment = m.name;
    r.api_keys_file = key_file;
    r.flow_control_file = flow_file;
    ApplyServing(spec, r);
    const auto env = r.ToEnv();
    groups.push_back({"the router",
                      [env]() -> absl::StatusOr<std::vector<Child>> {
                        ASSIGN_OR_RETURN(pid_t pid, Spawn(SelfDirectory() + "/shardserve-router",
                                                          {"--host", "127.0.0.1"}, env));
                        return std::vector<Child>{{pid, "router"}};
                      },
                      was_ready(R)});
    std::printf("router: API http://127.0.0.1:%lld/v1%s in front of the %d replicas\n",
                static_cast<long long>(port), keyed ? " (API keys required)" : "", R);
  }
  std::fflush(stdout);
  std::atomic<bool> stop{false};
  std::thread announce(
      [&] { AnnounceReady(replicas, routed ? static_cast<int>(port) : 0, m, stop, ever_ready); });
  absl::Status status = SuperviseGroups(groups, std::chrono::milliseconds(15000),
                                        [](const std::string& group, const std::string& why) {
                                          std::printf("shardserve local: %s failed (%s)\n",
                                                      group.c_str(), why.c_str());
                                          std::fflush(stdout);
                                        });
  stop.store(true);
  announce.join();
  if (status.ok()) std::printf("shardserve local: stopped\n");
  return status;
}

}  // namespace shardserve
