// `shardserve plan -f MANIFEST --nodes NODES.yaml [--pods PODS.yaml]`: where the operator would
// place every replica of a ShardedModel on these nodes, or why it cannot, without a cluster.
// NODES.yaml and PODS.yaml are what `kubectl get nodes -o yaml` / `kubectl get pods -A -o yaml`
// print (a List, a single object, or a YAML list of objects).
#include "cli/plan.h"

#include <yaml-cpp/yaml.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "api/sharded_model.h"
#include "common/args.h"
#include "common/status.h"
#include "common/text.h"
#include "model/footprint.h"
#include "plan/cluster_view.h"
#include "plan/layer_split.h"
#include "plan/memory.h"
#include "source/model_source.h"

namespace shardserve {
namespace {

using json = nlohmann::json;

// A YAML value as JSON; scalars stay strings (the readers accept "8" for 8 and "true" for true).
json ToJson(const YAML::Node& n) {
  if (n.IsMap()) {
    json o = json::object();
    for (const auto& kv : n) o[kv.first.Scalar()] = ToJson(kv.second);
    return o;
  }
  if (n.IsSequence()) {
    json a = json::array();
    for (const auto& v : n) a.push_back(ToJson(v));
    return a;
  }
  if (n.IsScalar()) return n.Scalar();
  return nullptr;
}

// The objects of a `kubectl get -o yaml` document (a List, one object, or a list of objects).
absl::StatusOr<std::vector<json>> Objects(const std::string& path, const std::string& kind) {
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  std::vector<json> out;
  auto add = [&](const YAML::Node& o) {
    json j = ToJson(o);
    if (j.is_object() && j.value("kind", kind) == kind) out.push_back(std::move(j));
  };
  try {
    for (const YAML::Node& doc : YAML::LoadAll(text)) {
      if (doc.IsSequence()) {
        for (const auto& o : doc) add(o);
      } else if (doc["items"] && doc["items"].IsSequence()) {
        for (const auto& o : doc["items"]) add(o);
      } else if (doc.IsMap()) {
        add(doc);
      }
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not valid YAML: ", e.what()));
  }
  return out;
}

absl::StatusOr<std::vector<NodeInfo>> ReadNodes(const std::string& path,
                                                const std::string& resource) {
  ASSIGN_OR_RETURN(std::vector<json> objects, Objects(path, "Node"));
  std::vector<NodeInfo> nodes;
  for (const json& o : objects) {
    auto n = NodeFromObject(o, resource);
    if (!n.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", n.status().message()));
    nodes.push_back(std::move(*n));
  }
  return nodes;
}

// GPUs requested on each node by pods that are bound and not finished.
absl::Status AddPodRequests(const std::string& path, const std::string& resource,
                            std::vector<NodeInfo>& nodes) {
  ASSIGN_OR_RETURN(std::vector<json> objects, Objects(path, "Pod"));
  for (const json& o : objects) {
    const std::string node = o.value("spec", json::object()).value("nodeName", "");
    if (node.empty() || !PodHoldsResources(o)) continue;
    auto gpus = PodRequests(o, resource);
    if (!gpus.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", gpus.status().message()));
    }
    for (NodeInfo& n : nodes) {
      if (n.name == node) n.requested += *gpus;
    }
  }
  return absl::OkStatus();
}

// The config.json of a remote model (s3://), fetched alone into the model cache: a plan reads
// nothing else.
absl::StatusOr<std::string> RemoteConfig(const ModelUri& uri, const std::string& uri_text) {
  source::ResolveOptions o;
  o.env = [](const char* name) { return std::getenv(name); };
  o.cache_root = source::DefaultCacheRoot(o.env);
  o.files = {"config.json"};
  ASSIGN_OR_RETURN(source::FetchReport r, source::ResolveModel(uri, uri_text, o));
  return r.dir;
}

// The model's footprint from --model (a directory, a config.json, a GGUF file or a remote uri),
// else from spec.model.uri when its files are on this machine (file://, or a host path that exists
// here) or remote (s3://: its config.json fetched); nullopt when they are not.
absl::StatusOr<std::optional<ModelFootprint>> FootprintFor(
    const std::string& file, const ShardedModelSpec& spec,
    const std::optional<std::string>& model) {
  std::string path;
  const std::string where = model ? "--model" : absl::StrCat(file, ": spec.model.uri");
  auto fetched = [&](const std::string& uri_text) -> absl::StatusOr<std::string> {
    absl::StatusOr<ModelUri> uri = ParseModelUri(uri_text);
    absl::StatusOr<std::string> dir =
        uri.ok() ? RemoteConfig(*uri, uri_text) : absl::StatusOr<std::string>(uri.status());
    if (!dir.ok()) {
      return absl::Status(dir.status().code(), absl::StrCat(where, ": ", dir.status().message()));
    }
    return dir;
  };
  if (model && ParseModelUri(*model).ok() && ParseModelUri(*model)->remote()) {
    ASSIGN_OR_RETURN(path, fetched(*model));
  } else if (model) {
    path = *model;
    if (std::filesystem::path(path).filename() == "config.json") {
      path = std::filesystem::path(path).parent_path().string();
    }
  } else {
    auto uri = ParseModelUri(spec.model_uri);
    std::error_code ec;
    if (uri.ok() && uri->remote()) {
      ASSIGN_OR_RETURN(path, fetched(spec.model_uri));
    } else if (!uri.ok() || uri->scheme == ModelUri::Scheme::kPvc ||
               !std::filesystem::exists(uri->path, ec)) {
      return std::nullopt;
    } else {
      path = uri->path;
    }
  }
  auto f = LoadFootprint(path);
  if (!f.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(where, ": ", f.status().message()));
  }
  return std::optional<ModelFootprint>(*std::move(f));
}

void PrintMemory(const ModelFootprint& model, const ShardedModelSpec& spec, const SpecPlan& plan) {
  ModelFootprint f = model;
  UseKvCacheDtype(f, spec.kv_cache_dtype);
  UseSpeculativeMethod(f, spec.speculative_method);
  std::printf("model: %s, %.1f B parameters; weights: %s\n", f.architecture.c_str(), f.params / 1e9,
              f.weights.c_str());
  std::printf("%s\n", KvBytesLine(f).c_str());
  for (const std::string& note : f.notes) std::printf("note: %s\n", note.c_str());
  const ParallelismChoice& c = plan.choice;
  std::vector<std::string> stages;
  for (size_t s = 0; s < c.layers.size(); ++s) {
    stages.push_back(absl::StrCat("stage ", s, " ", FormatLayerRange(c.layers[s])));
  }
  if (f.mtp_loaded && f.mtp.count > 0 && !stages.empty()) {
    absl::StrAppend(&stages.back(), " and the multi-token-prediction layer");
  }
  std::printf("layers: %s (of %lld)\n", absl::StrJoin(stages, ", ").c_str(),
              static_cast<long long>(f.layers));
  std::printf(
      "parallelism: TP=%lld x PP=%lld%s; KV cache for %lld positions (maxBatchSize %lld x "
      "maxSequenceLength %lld)\n",
      static_cast<long long>(c.tensor), static_cast<long long>(c.pipeline),
      spec.tensor_auto || spec.pipeline_auto ? " (auto)" : "",
      static_cast<long long>(spec.kv_cache_tokens()), static_cast<long long>(spec.max_batch_size),
      static_cast<long long>(spec.max_sequence_length));
  for (size_t s = 0; s < c.stages.size(); ++s) {
    std::printf("  %s\n", DescribeStage(static_cast<int64_t>(s), c.tensor, c.stages[s]).c_str());
  }
  std::printf("  margin: %s and %.0f %% of weights and cache (CUDA context, NCCL, activations)\n",
              FormatGiB(kMarginBytes).c_str(), kMarginShare * 100);
  if (plan.gpu_memory > 0) {
    std::printf("GPU memory: %s per GPU (the least of the nodes that could hold a stage)\n",
                FormatGiB(static_cast<double>(plan.gpu_memory)).c_str());
  } else {
    std::printf(
        "GPU memory: unknown (no node has the %s label and spec.worker.gpuMemory is "
        "unset): not checked\n",
        kGpuMemoryLabel);
  }
}

}  // namespace

absl::Status RunPlan(std::vector<std::string> argv) {
  ASSIGN_OR_RETURN(Args a, Args::Parse(argv, {"file", "nodes", "pods", "model"}, {"footprint"},
                                       "shardserve plan", kPlanUsage));
  if (a.Has("footprint")) {  // what `shardserve-worker inspect` reports of it to the operator
    ASSIGN_OR_RETURN(std::string model, a.Require("model"));
    ASSIGN_OR_RETURN(std::optional<ModelFootprint> f, FootprintFor("", {}, model));
    std::printf("%s\n", FootprintToJson(*f).dump().c_str());
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(std::string file, a.Require("file"));
  ASSIGN_OR_RETURN(std::string nodes_file, a.Require("nodes"));
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(file));
  auto parsed = ParseShardedModel(text);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", parsed.status().message()));
  }
  const ShardedModelSpec& spec = parsed->spec;
  ASSIGN_OR_RETURN(std::vector<NodeInfo> nodes, ReadNodes(nodes_file, spec.gpu_resource));
  if (auto pods = a.Get("pods")) {
    RETURN_IF_ERROR(AddPodRequests(*pods, spec.gpu_resource, nodes));
  }
  // Each role's replicas placed in turn (the decode role's, or the only one, first), each on
  // the GPUs the ones before it left.
  std::vector<std::pair<std::string, ShardedModelSpec>> roles = {
      {spec.disaggregation ? "decode" : "", spec}};
  if (spec.disaggregation) roles.emplace_back("prefill", PrefillSpec(spec));
  size_t unplaced = 0;
  int64_t wanted = 0;
  for (const auto& [role, rspec] : roles) {
    const std::string prefix = role.empty() ? "" : role + " ";
    std::vector<int64_t> replicas;
    for (int64_t i = 0; i < rspec.replicas; ++i) replicas.push_back(i);
    ASSIGN_OR_RETURN(std::optional<ModelFootprint> footprint,
                     FootprintFor(file, rspec, a.Get("model")));
    std::optional<SpecPlan> plan;
    if (footprint) {
      auto planned = PlanSpec(*footprint, rspec, nodes);
      if (!planned.ok()) {
        return absl::Status(planned.status().code(),
                            absl::StrCat(file, ": ", prefix, planned.status().message()));
      }
      plan = *std::move(planned);
    } else if (rspec.tensor_auto || rspec.pipeline_auto) {
      return absl::FailedPreconditionError(
          absl::StrCat(file,
                       ": spec.parallelism auto needs the model's config: its files are not "
                       "on this machine (give --model DIR or config.json)"));
    }
    const PlacementRequest request =
        plan ? MemoryAwareRequest(rspec, *plan, replicas) : PlacementRequestFor(rspec, replicas);
    ASSIGN_OR_RETURN(PlacementResult result, PlaceReplicas(request, nodes));

    std::printf("%s: %s%lld replica(s) of TP=%lld x PP=%lld, %lld %s per replica, on %zu node(s)\n",
                parsed->name.c_str(), prefix.c_str(), static_cast<long long>(rspec.replicas),
                static_cast<long long>(request.tensor), static_cast<long long>(request.pipeline),
                static_cast<long long>(request.tensor * request.pipeline),
                rspec.gpu_resource.c_str(), nodes.size());
    if (plan) {
      PrintMemory(*footprint, rspec, *plan);
    } else {
      std::printf("layers: split once the operator has read the model (status.plan.stageLayers)\n");
    }
    for (const ReplicaPlacement& p : result.placed) {
      std::vector<std::string> stages;
      for (size_t s = 0; s < p.nodes.size(); ++s) {
        stages.push_back(absl::StrCat("stage ", s, " -> ", p.nodes[s]));
        for (NodeInfo& n : nodes) {  // taken: the next role places on what is left
          if (n.name == p.nodes[s]) n.requested += request.tensor;
        }
      }
      std::printf("%sreplica %lld: %s (%s)\n", prefix.c_str(), static_cast<long long>(p.replica),
                  absl::StrJoin(stages, ", ").c_str(),
                  p.domain.empty() ? ("across " + rspec.topology_key + " values").c_str()
                                   : (rspec.topology_key + "=" + p.domain).c_str());
    }
    for (const auto& [replica, why] : result.unplaced) {
      std::printf("%sreplica %lld: not placed: %s\n", prefix.c_str(),
                  static_cast<long long>(replica), why.c_str());
    }
    unplaced += result.unplaced.size();
    wanted += rspec.replicas;
  }
  if (unplaced > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(unplaced, " of ", wanted,
                     " replica(s) cannot be placed; nothing would be created for them"));
  }
  return absl::OkStatus();
}

}  // namespace shardserve
