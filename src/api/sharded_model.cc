#include "api/sharded_model.h"

#include <yaml-cpp/yaml.h>

#include <regex>
#include <set>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "api/adapters.h"
#include "api/kv_cache_dtype.h"
#include "common/status.h"

namespace shardserve {
namespace {

// Reads fields of one mapping, naming each by its full path in errors, and refuses fields that
// were not read.
class Fields {
 public:
  Fields(const YAML::Node& node, std::string path) : node_(node), path_(std::move(path)) {}

  absl::Status CheckMap() const {
    if (node_ && !node_.IsNull() && !node_.IsMap()) {
      return absl::InvalidArgumentError(absl::StrCat(path_, " must be a mapping"));
    }
    return absl::OkStatus();
  }
  std::string Path(const std::string& key) const {
    return path_.empty() ? key : absl::StrCat(path_, ".", key);
  }
  YAML::Node Get(const std::string& key) {
    known_.insert(key);
    return node_ && node_.IsMap() ? node_[key] : YAML::Node();
  }
  absl::Status Int(const std::string& key, int64_t& out) {
    YAML::Node n = Get(key);
    if (!n || n.IsNull()) return absl::OkStatus();
    try {
      if (!n.IsScalar()) throw YAML::Exception(YAML::Mark(), "");
      out = n.as<int64_t>();
    } catch (const YAML::Exception&) {
      return absl::InvalidArgumentError(
          absl::StrCat(Path(key), " must be an integer, got ", Describe(n)));
    }
    return absl::OkStatus();
  }
  // An integer, or "auto" (which sets `is_auto`).
  absl::Status IntOrAuto(const std::string& key, int64_t& out, bool& is_auto) {
    YAML::Node n = Get(key);
    if (n && n.IsScalar() && n.Scalar() == "auto") {
      is_auto = true;
      return absl::OkStatus();
    }
    known_.erase(key);
    absl::Status s = Int(key, out);
    if (!s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(Path(key), " must be an integer or auto, got ", Describe(n)));
    }
    return s;
  }
  absl::Status String(const std::string& key, std::string& out) {
    YAML::Node n = Get(key);
    if (!n || n.IsNull()) return absl::OkStatus();
    if (!n.IsScalar()) {
      return absl::InvalidArgumentError(absl::StrCat(Path(key), " must be a string"));
    }
    out = n.Scalar();
    return absl::OkStatus();
  }
  // A list of strings, at most `max` of at most 256 bytes each.
  absl::Status Strings(const std::string& key, std::vector<std::string>& out, size_t max) {
    YAML::Node n = Get(key);
    if (!n || n.IsNull()) return absl::OkStatus();
    if (!n.IsSequence() || n.size() > max) {
      return absl::InvalidArgumentError(
          absl::StrCat(Path(key), " must be a list of at most ", max, " strings"));
    }
    for (const auto& e : n) {
      if (!e.IsScalar() || e.Scalar().empty() || e.Scalar().size() > 256) {
        return absl::InvalidArgumentError(
            absl::StrCat(Path(key), " must hold strings of 1 to 256 characters"));
      }
      out.push_back(e.Scalar());
    }
    return absl::OkStatus();
  }
  absl::Status Bool(const std::string& key, bool& out) {
    YAML::Node n = Get(key);
    if (!n || n.IsNull()) return absl::OkStatus();
    if (!n.IsScalar() || (n.Scalar() != "true" && n.Scalar() != "false")) {
      return absl::InvalidArgumentError(
          absl::StrCat(Path(key), " must be true or false, got ", Describe(n)));
    }
    out = n.Scalar() == "true";
    return absl::OkStatus();
  }
  absl::Status StringMap(const std::string& key, std::map<std::string, std::string>& out) {
    YAML::Node n = Get(key);
    if (!n || n.IsNull()) return absl::OkStatus();
    if (!n.IsMap())
      return absl::InvalidArgumentError(absl::StrCat(Path(key), " must be a mapping"));
    for (const auto& kv : n) {
      if (!kv.second.IsScalar()) {
        return absl::InvalidArgumentError(
            absl::StrCat(Path(key), ".", kv.first.Scalar(), " must be a string"));
      }
      out[kv.first.Scalar()] = kv.second.Scalar();
    }
    return absl::OkStatus();
  }
  // Fields present but never read: misspelt or unsupported.
  absl::Status NoOthers() const {
    if (!node_ || !node_.IsMap()) return absl::OkStatus();
    for (const auto& kv : node_) {
      const std::string key = kv.first.Scalar();
      if (!known_.count(key)) {
        return absl::InvalidArgumentError(
            absl::StrCat(Path(key), " is not a field of ", path_.empty() ? "the resource" : path_,
                         " (known: ", absl::StrJoin(known_, ", "), ")"));
      }
    }
    return absl::OkStatus();
  }

 private:
  static std::string Describe(const YAML::Node& n) {
    return n.IsScalar() ? absl::StrCat("'", n.Scalar(), "'") : "a non-scalar value";
  }
  YAML::Node node_;
  std::string path_;
  std::set<std::string> known_;
};

// A YAML tree of a parsed JSON value (JSON is YAML: the same checks read both).
YAML::Node FromJson(const nlohmann::json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::object: {
      YAML::Node n(YAML::NodeType::Map);
      for (const auto& [k, v] : j.items()) n[k] = FromJson(v);
      return n;
    }
    case nlohmann::json::value_t::array: {
      YAML::Node n(YAML::NodeType::Sequence);
      for (const auto& v : j) n.push_back(FromJson(v));
      return n;
    }
    case nlohmann::json::value_t::string:
      return YAML::Node(j.get<std::string>());
    case nlohmann::json::value_t::null:
    case nlohmann::json::value_t::discarded:
      return YAML::Node(YAML::NodeType::Null);
    default:  // numbers and booleans, as their JSON text
      return YAML::Node(j.dump());
  }
}

// The JSON of a YAML tree (a valueFrom source): booleans stay booleans, other scalars are text.
nlohmann::json ToJson(const YAML::Node& n) {
  if (n.IsMap()) {
    nlohmann::json o = nlohmann::json::object();
    for (const auto& kv : n) o[kv.first.Scalar()] = ToJson(kv.second);
    return o;
  }
  if (n.IsSequence()) {
    nlohmann::json a = nlohmann::json::array();
    for (const auto& v : n) a.push_back(ToJson(v));
    return a;
  }
  if (!n.IsScalar()) return nullptr;
  if (n.Scalar() == "true" || n.Scalar() == "false") return n.Scalar() == "true";
  return n.Scalar();
}

absl::Status ParseEnv(const YAML::Node& env, const std::string& path,
                      std::vector<ShardedModelSpec::EnvVar>& out) {
  if (!env || env.IsNull()) return absl::OkStatus();
  if (!env.IsSequence()) {
    return absl::InvalidArgumentError(absl::StrCat(path, " must be a list of {name, value}"));
  }
  for (size_t i = 0; i < env.size(); ++i) {
    const std::string at = absl::StrCat(path, "[", i, "]");
    Fields e(env[i], at);
    RETURN_IF_ERROR(e.CheckMap());
    if (!env[i].IsMap()) return absl::InvalidArgumentError(absl::StrCat(at, " must be a mapping"));
    ShardedModelSpec::EnvVar var;
    RETURN_IF_ERROR(e.String("name", var.name));
    RETURN_IF_ERROR(e.String("value", var.value));
    if (YAML::Node from = e.Get("valueFrom"); from && !from.IsNull()) {
      if (!from.IsMap()) {
        return absl::InvalidArgumentError(absl::StrCat(at, ".valueFrom must be a mapping"));
      }
      if (!var.value.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(at, " sets both value and valueFrom"));
      }
      var.value_from = ToJson(from).dump();
    }
    RETURN_IF_ERROR(e.NoOthers());
    if (var.name.empty()) return absl::InvalidArgumentError(absl::StrCat(at, ".name is required"));
    out.push_back(std::move(var));
  }
  return absl::OkStatus();
}

absl::Status ParseSpec(const YAML::Node& node, ShardedModelSpec& s) {
  Fields spec(node, "spec");
  RETURN_IF_ERROR(spec.CheckMap());
  RETURN_IF_ERROR(spec.Int("replicas", s.replicas));
  Fields model(spec.Get("model"), "spec.model");
  RETURN_IF_ERROR(model.CheckMap());
  RETURN_IF_ERROR(model.String("name", s.model_name));
  RETURN_IF_ERROR(model.String("uri", s.model_uri));
  RETURN_IF_ERROR(model.Strings("files", s.model_files, 256));
  RETURN_IF_ERROR(model.String("secret", s.model_secret));
  RETURN_IF_ERROR(model.NoOthers());
  Fields par(spec.Get("parallelism"), "spec.parallelism");
  RETURN_IF_ERROR(par.CheckMap());
  RETURN_IF_ERROR(par.IntOrAuto("tensor", s.tensor, s.tensor_auto));
  RETURN_IF_ERROR(par.IntOrAuto("pipeline", s.pipeline, s.pipeline_auto));
  RETURN_IF_ERROR(par.Int("microBatches", s.micro_batches));
  RETURN_IF_ERROR(par.NoOthers());
  if (YAML::Node dn = spec.Get("disaggregation"); dn && !dn.IsNull()) {
    ShardedModelSpec::Disaggregation out;
    Fields d(dn, "spec.disaggregation");
    RETURN_IF_ERROR(d.CheckMap());
    Fields pre(d.Get("prefill"), "spec.disaggregation.prefill");
    RETURN_IF_ERROR(pre.CheckMap());
    RETURN_IF_ERROR(pre.Int("replicas", out.prefill_replicas));
    Fields shape(pre.Get("parallelism"), "spec.disaggregation.prefill.parallelism");
    RETURN_IF_ERROR(shape.CheckMap());
    RETURN_IF_ERROR(shape.Int("tensor", out.prefill_tensor));
    RETURN_IF_ERROR(shape.Int("pipeline", out.prefill_pipeline));
    RETURN_IF_ERROR(shape.NoOthers());
    if (YAML::Node sel = pre.Get("nodeSelector"); sel && !sel.IsNull()) {
      std::map<std::string, std::string> selector;
      RETURN_IF_ERROR(pre.StringMap("nodeSelector", selector));
      out.prefill_node_selector = std::move(selector);
    }
    Fields roll(pre.Get("rollout"), "spec.disaggregation.prefill.rollout");
    RETURN_IF_ERROR(roll.CheckMap());
    RETURN_IF_ERROR(roll.Int("maxUnavailable", out.prefill_max_unavailable));
    RETURN_IF_ERROR(roll.Int("maxSurge", out.prefill_max_surge));
    RETURN_IF_ERROR(roll.NoOthers());
    RETURN_IF_ERROR(pre.NoOthers());
    RETURN_IF_ERROR(d.Int("minPromptTokens", out.min_prompt_tokens));
    RETURN_IF_ERROR(d.NoOthers());
    s.disaggregation = out;
  }
  RETURN_IF_ERROR(spec.String("prefillOf", s.prefill_of));
  if (YAML::Node an = spec.Get("adapters"); an && !an.IsNull()) {
    if (!an.IsSequence()) {
      return absl::InvalidArgumentError("spec.adapters must be a list of {name, uri}");
    }
    for (size_t i = 0; i < an.size(); ++i) {
      Fields a(an[i], absl::StrCat("spec.adapters[", i, "]"));
      RETURN_IF_ERROR(a.CheckMap());
      ShardedModelSpec::Adapter out;
      RETURN_IF_ERROR(a.String("name", out.name));
      RETURN_IF_ERROR(a.String("uri", out.uri));
      RETURN_IF_ERROR(a.NoOthers());
      s.adapters.push_back(std::move(out));
    }
    s.lora = true;
  }
  if (YAML::Node ln = spec.Get("lora"); ln && !ln.IsNull()) {
    Fields lora(ln, "spec.lora");
    RETURN_IF_ERROR(lora.CheckMap());
    RETURN_IF_ERROR(lora.Int("maxLoras", s.max_loras));
    RETURN_IF_ERROR(lora.Int("maxLoraRank", s.max_lora_rank));
    RETURN_IF_ERROR(lora.Int("maxCpuLoras", s.max_cpu_loras));
    RETURN_IF_ERROR(lora.String("adminKeySecret", s.lora_admin_key_secret));
    RETURN_IF_ERROR(lora.String("source", s.lora_source));
    RETURN_IF_ERROR(lora.NoOthers());
    s.lora = true;
  }
  Fields worker(spec.Get("worker"), "spec.worker");
  RETURN_IF_ERROR(worker.CheckMap());
  RETURN_IF_ERROR(worker.String("image", s.image));
  RETURN_IF_ERROR(worker.String("gpuResource", s.gpu_resource));
  RETURN_IF_ERROR(worker.StringMap("nodeSelector", s.node_selector));
  std::string gpu_memory;
  RETURN_IF_ERROR(worker.String("gpuMemory", gpu_memory));
  if (!gpu_memory.empty()) {
    ASSIGN_OR_RETURN(s.gpu_memory, ParseByteQuantity(gpu_memory, "spec.worker.gpuMemory"));
  }
  // Passed through to the pod unchanged.
  worker.Get("resources");
  YAML::Node tolerations = worker.Get("tolerations");
  if (tolerations && !tolerations.IsNull()) {
    if (!tolerations.IsSequence()) {
      return absl::InvalidArgumentError("spec.worker.tolerations must be a list");
    }
    for (size_t i = 0; i < tolerations.size(); ++i) {
      Fields t(tolerations[i], absl::StrCat("spec.worker.tolerations[", i, "]"));
      RETURN_IF_ERROR(t.CheckMap());
      Toleration tol;
      RETURN_IF_ERROR(t.String("key", tol.key));
      RETURN_IF_ERROR(t.String("operator", tol.op));
      RETURN_IF_ERROR(t.String("value", tol.value));
      RETURN_IF_ERROR(t.String("effect", tol.effect));
      int64_t seconds = -1;
      RETURN_IF_ERROR(t.Int("tolerationSeconds", seconds));
      if (seconds >= 0) tol.seconds = seconds;
      RETURN_IF_ERROR(t.NoOthers());
      if (tol.op != "Equal" && tol.op != "Exists") {
        return absl::InvalidArgumentError(absl::StrCat(
            "spec.worker.tolerations[", i, "].operator '", tol.op, "' must be Exists or Equal"));
      }
      s.tolerations.push_back(tol);
    }
  }
  RETURN_IF_ERROR(ParseEnv(worker.Get("env"), "spec.worker.env", s.env));
  RETURN_IF_ERROR(worker.NoOthers());
  Fields placement(spec.Get("placement"), "spec.placement");
  RETURN_IF_ERROR(placement.CheckMap());
  RETURN_IF_ERROR(placement.String("topologyKey", s.topology_key));
  RETURN_IF_ERROR(placement.NoOthers());
  RETURN_IF_ERROR(spec.String("failurePolicy", s.failure_policy));
  Fields rollout(spec.Get("rollout"), "spec.rollout");
  RETURN_IF_ERROR(rollout.CheckMap());
  RETURN_IF_ERROR(rollout.Int("maxUnavailable", s.max_unavailable));
  RETURN_IF_ERROR(rollout.Int("maxSurge", s.max_surge));
  RETURN_IF_ERROR(rollout.NoOthers());
  Fields serving(spec.Get("serving"), "spec.serving");
  RETURN_IF_ERROR(serving.CheckMap());
  RETURN_IF_ERROR(serving.Int("port", s.port));
  RETURN_IF_ERROR(serving.Int("maxBatchSize", s.max_batch_size));
  RETURN_IF_ERROR(serving.Int("maxSequenceLength", s.max_sequence_length));
  RETURN_IF_ERROR(serving.String("apiKeySecret", s.api_key_secret));
  RETURN_IF_ERROR(serving.String("specialTokensInContent", s.special_tokens_in_content));
  RETURN_IF_ERROR(serving.String("kvCacheDtype", s.kv_cache_dtype));
  Fields speculative(serving.Get("speculative"), "spec.serving.speculative");
  RETURN_IF_ERROR(speculative.CheckMap());
  RETURN_IF_ERROR(speculative.String("method", s.speculative_method));
  int64_t tokens = -1;  // not given: the method's default
  RETURN_IF_ERROR(speculative.Int("tokens", tokens));
  RETURN_IF_ERROR(speculative.String("draftModel", s.draft_model));
  RETURN_IF_ERROR(speculative.NoOthers());
  if (s.speculative_method == "mtp") {
    if (tokens != -1 && tokens != kMtpSpeculativeTokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.serving.speculative.tokens is ", tokens, "; method mtp drafts ",
          kMtpSpeculativeTokens, " a step (the checkpoint's one multi-token-prediction layer)"));
    }
    s.speculative_tokens = kMtpSpeculativeTokens;
  } else if (tokens != -1) {
    s.speculative_tokens = tokens;
  }
  RETURN_IF_ERROR(serving.String("toolCallParser", s.tool_call_parser));
  RETURN_IF_ERROR(serving.Bool("trustRequestChatTemplate", s.trust_request_chat_template));
  RETURN_IF_ERROR(serving.String("reasoningParser", s.reasoning_parser));
  Fields flow(serving.Get("flowControl"), "spec.serving.flowControl");
  RETURN_IF_ERROR(flow.CheckMap());
  RETURN_IF_ERROR(flow.String("configMap", s.flow_control_config_map));
  RETURN_IF_ERROR(flow.String("secret", s.flow_control_secret));
  RETURN_IF_ERROR(flow.String("key", s.flow_control_key));
  RETURN_IF_ERROR(flow.NoOthers());
  Fields slo(serving.Get("slo"), "spec.serving.slo");
  RETURN_IF_ERROR(slo.CheckMap());
  RETURN_IF_ERROR(slo.Int("ttftMilliseconds", s.slo_ttft_ms));
  RETURN_IF_ERROR(slo.Int("itlMilliseconds", s.slo_itl_ms));
  RETURN_IF_ERROR(slo.Int("percentile", s.slo_percentile));
  RETURN_IF_ERROR(slo.NoOthers());
  Fields queue(serving.Get("queue"), "spec.serving.queue");
  RETURN_IF_ERROR(queue.CheckMap());
  RETURN_IF_ERROR(queue.Int("maxRequests", s.queue_max_requests));
  RETURN_IF_ERROR(queue.Int("timeoutSeconds", s.queue_timeout_seconds));
  RETURN_IF_ERROR(queue.NoOthers());
  Fields chat_template(serving.Get("chatTemplate"), "spec.serving.chatTemplate");
  RETURN_IF_ERROR(chat_template.CheckMap());
  RETURN_IF_ERROR(chat_template.String("inline", s.chat_template_inline));
  Fields config_map(chat_template.Get("configMap"), "spec.serving.chatTemplate.configMap");
  RETURN_IF_ERROR(config_map.CheckMap());
  RETURN_IF_ERROR(config_map.String("name", s.chat_template_config_map));
  RETURN_IF_ERROR(config_map.String("key", s.chat_template_key));
  RETURN_IF_ERROR(config_map.NoOthers());
  RETURN_IF_ERROR(chat_template.NoOthers());
  RETURN_IF_ERROR(serving.Bool("prefixCaching", s.prefix_caching));
  RETURN_IF_ERROR(serving.String("prefixCacheIsolation", s.prefix_cache_isolation));
  RETURN_IF_ERROR(serving.NoOthers());
  Fields startup(spec.Get("startup"), "spec.startup");
  RETURN_IF_ERROR(startup.CheckMap());
  RETURN_IF_ERROR(startup.Int("timeoutSeconds", s.startup_timeout_seconds));
  RETURN_IF_ERROR(startup.Int("loadStallSeconds", s.load_stall_seconds));
  RETURN_IF_ERROR(startup.NoOthers());
  return spec.NoOthers();
}

// spec.serving.chatTemplate's bytes (an environment variable carries them to the pods).
constexpr size_t kMaxChatTemplateBytes = 100 << 10;

// A day: more than any pull or load takes, and within the int milliseconds of the contract.
constexpr int64_t kMaxStartupSeconds = 86400;

absl::Status AtLeast(const char* field, int64_t v, int64_t min) {
  if (v >= min) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, " must be at least ", min, ", got ", v));
}

}  // namespace

ShardedModelSpec PrefillSpec(const ShardedModelSpec& spec) {
  ShardedModelSpec p = spec;
  const ShardedModelSpec::Disaggregation& d = *spec.disaggregation;
  p.replicas = d.prefill_replicas;
  p.tensor = d.prefill_tensor;
  p.pipeline = d.prefill_pipeline;
  p.tensor_auto = p.pipeline_auto = false;
  p.micro_batches = 0;
  if (d.prefill_node_selector) p.node_selector = *d.prefill_node_selector;
  p.max_unavailable = d.prefill_max_unavailable;
  p.max_surge = d.prefill_max_surge;
  p.disaggregation.reset();
  return p;
}

std::string PrefillModelName(const std::string& model) { return model + "-prefill"; }

namespace {
// A Kubernetes object name (RFC 1123 subdomain).
const std::regex& DnsSubdomain() {
  static const std::regex* re = new std::regex("[a-z0-9]([-a-z0-9.]*[a-z0-9])?");
  return *re;
}

// spec.adapters and spec.lora: names an API may serve, distinct and not the model's; local uris
// (the ranks read the directories); bounds the worker contract takes.
absl::Status CheckAdapters(const ShardedModelSpec& s) {
  if (s.max_loras < 1 || s.max_loras > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.lora.maxLoras ", s.max_loras, " must be in [1, 1024]"));
  }
  if (s.max_cpu_loras != 0 && (s.max_cpu_loras < s.max_loras || s.max_cpu_loras > 4096)) {
    return absl::InvalidArgumentError(absl::StrCat("spec.lora.maxCpuLoras ", s.max_cpu_loras,
                                                   " must be in [maxLoras (", s.max_loras,
                                                   "), 4096]: the adapters a replica "
                                                   "keeps, those in its slots among them"));
  }
  if (s.max_lora_rank < 1 || s.max_lora_rank > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.lora.maxLoraRank ", s.max_lora_rank, " must be in [1, 4096]"));
  }
  if (s.adapters.size() > static_cast<size_t>(s.max_loras)) {
    return absl::InvalidArgumentError(absl::StrCat("spec.adapters lists ", s.adapters.size(),
                                                   " adapters; spec.lora.maxLoras holds ",
                                                   s.max_loras, " at once"));
  }
  if (!s.lora_source.empty()) {
    absl::StatusOr<ModelUri> uri = ParseModelUri(s.lora_source);
    if (!uri.ok() || uri->remote()) {
      return absl::InvalidArgumentError(
          absl::StrCat("spec.lora.source '", s.lora_source,
                       "' must be pvc://CLAIM/PATH, hostpath:///DIR or file:///DIR"));
    }
  }
  if (!s.lora_admin_key_secret.empty() && s.lora_source.empty()) {
    return absl::InvalidArgumentError(
        "spec.lora.adminKeySecret lets admins load adapters at runtime: spec.lora.source must say "
        "the directory they are in");
  }
  if (!s.lora_admin_key_secret.empty() &&
      (s.lora_admin_key_secret.size() > 253 ||
       !std::regex_match(s.lora_admin_key_secret, DnsSubdomain()))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.lora.adminKeySecret '", s.lora_admin_key_secret, "' is not a Secret's name"));
  }
  std::set<std::string> names;
  for (size_t i = 0; i < s.adapters.size(); ++i) {
    const ShardedModelSpec::Adapter& a = s.adapters[i];
    const std::string at = absl::StrCat("spec.adapters[", i, "]");
    if (absl::Status st = CheckAdapterName(a.name); !st.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(at, ".name: ", st.message()));
    }
    if (a.name == s.model_name || !names.insert(a.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, ".name '", a.name, "' is the model's own name or another adapter's"));
    }
    absl::StatusOr<ModelUri> uri = ParseModelUri(a.uri);
    if (!uri.ok()) {
      // ParseModelUri names spec.model.uri; here the field is the adapter's.
      std::string why(uri.status().message());
      if (absl::StartsWith(why, "spec.model.uri ")) why.erase(0, 15);
      return absl::InvalidArgumentError(absl::StrCat(at, ".uri ", why));
    }
  }
  return absl::OkStatus();
}
}  // namespace

void ApplyServing(const ShardedModelSpec& spec, WorkerEnv& w) {
  w.max_batch_size = static_cast<int>(spec.max_batch_size);
  w.max_sequence_length = spec.max_sequence_length;
  w.kv_cache_tokens = spec.kv_cache_tokens();
  w.kv_cache_dtype = spec.kv_cache_dtype;
  w.speculative_method = spec.speculative_method;
  w.speculative_tokens = static_cast<int>(spec.speculative_tokens);
  w.special_tokens_as_text = spec.special_tokens_in_content == "text";
  w.tool_call_parser = spec.tool_call_parser == "auto" ? "" : spec.tool_call_parser;
  w.reasoning_parser = spec.reasoning_parser == "auto"            ? ""
                       : spec.reasoning_parser == "none"          ? "none"
                       : spec.reasoning_parser == "openai_gptoss" ? "harmony"
                                                                  : "think";
  w.chat_template = spec.chat_template_inline;  // a ConfigMap's: the operator's env reference
  w.trust_request_chat_template = spec.trust_request_chat_template;
  w.prefix_caching = spec.prefix_caching;
  w.prefix_cache_per_key = spec.prefix_cache_isolation == "perKey";
  w.slo_ttft_ms = static_cast<int>(spec.slo_ttft_ms);
  w.slo_itl_ms = static_cast<int>(spec.slo_itl_ms);
  w.slo_percentile = static_cast<int>(spec.slo_percentile);
  w.startup_timeout_ms = static_cast<int>(spec.startup_timeout_seconds * 1000);
  w.load_stall_ms = static_cast<int>(spec.load_stall_seconds * 1000);
  w.max_loras = spec.lora ? static_cast<int>(spec.max_loras) : 0;
  w.max_lora_rank = spec.max_lora_rank;
  w.max_cpu_loras =
      static_cast<int>(spec.max_cpu_loras > 0 ? spec.max_cpu_loras : 4 * spec.max_loras);
}

absl::StatusOr<ModelUri> ParseModelUri(const std::string& uri) {
  ModelUri u;
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.model.uri '", uri, "' ", why,
                     "; expected pvc://CLAIM/PATH, hostpath:///DIR, file:///DIR, "
                     "s3://BUCKET/PREFIX, hf://ORG/NAME[@REVISION] or "
                     "oci://REGISTRY/REPO[:TAG|@sha256:DIGEST]"));
  };
  if (uri.rfind("oci://", 0) == 0) {
    const std::string rest = uri.substr(6);
    const size_t slash = rest.find('/');
    if (slash == std::string::npos) return bad("names no repository after its registry");
    u.scheme = ModelUri::Scheme::kOci;
    u.registry = rest.substr(0, slash);
    std::string name = rest.substr(slash + 1);
    if (const size_t at = name.find('@'); at != std::string::npos) {
      u.revision = name.substr(at + 1);
      name.resize(at);
    } else if (const size_t colon = name.rfind(':'); colon != std::string::npos) {
      u.revision = name.substr(colon + 1);
      name.resize(colon);
    } else {
      u.revision = "latest";
    }
    u.repo = name;
    // The distribution spec's grammar: a host[:port]; a repository of lower-case path components
    // joined by '.', '_', '__' or '-'; a tag of at most 128 characters; a sha256 digest.
    static const std::regex kRegistry(
        "[A-Za-z0-9]([A-Za-z0-9.-]{0,252}[A-Za-z0-9])?(:[0-9]{1,5})?");
    static const std::regex kRepoPath(
        "[a-z0-9]+((\\.|_|__|-+)[a-z0-9]+)*(/[a-z0-9]+((\\.|_|__|-+)[a-z0-9]+)*){0,15}");
    static const std::regex kTag("[A-Za-z0-9_][A-Za-z0-9._-]{0,127}");
    static const std::regex kDigest("sha256:[a-f0-9]{64}");
    if (!std::regex_match(u.registry, kRegistry)) return bad("names no registry HOST[:PORT]");
    if (u.repo.size() > 255 || !std::regex_match(u.repo, kRepoPath)) {
      return bad("names no repository (lower-case path components)");
    }
    if (!std::regex_match(u.revision, kTag) && !std::regex_match(u.revision, kDigest)) {
      return bad("names no tag or sha256 digest");
    }
    return u;
  }
  if (uri.rfind("hf://", 0) == 0) {
    const std::string rest = uri.substr(5);
    const size_t at = rest.find('@');
    u.scheme = ModelUri::Scheme::kHf;
    u.repo = rest.substr(0, at);
    u.revision = at == std::string::npos ? "main" : rest.substr(at + 1);
    // The Hub's names: ORG/NAME of letters, digits, '.', '_' and '-'; a revision (a branch may
    // hold '/') of the same and '/'.
    static const std::regex kRepo(
        "[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}");
    static const std::regex kRevision("[A-Za-z0-9._][A-Za-z0-9._/-]{0,255}");
    if (!std::regex_match(u.repo, kRepo)) return bad("names no repository ORG/NAME");
    if (!std::regex_match(u.revision, kRevision) || u.revision.find("..") != std::string::npos) {
      return bad("names no revision (a branch, a tag or a commit)");
    }
    return u;
  }
  if (uri.rfind("s3://", 0) == 0) {
    const std::string rest = uri.substr(5);
    const size_t slash = rest.find('/');
    u.scheme = ModelUri::Scheme::kS3;
    u.bucket = rest.substr(0, slash);
    u.path = slash == std::string::npos ? "" : rest.substr(slash + 1);
    // S3's bucket names: 3 to 63 lower-case letters, digits, dots and hyphens.
    static const std::regex kBucket("[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]");
    if (!std::regex_match(u.bucket, kBucket)) {
      return bad("names no bucket (3 to 63 lower-case letters, digits, '.' and '-')");
    }
    if (u.path.size() > 1024 || u.path.find("..") != std::string::npos) {
      return bad("has a prefix longer than 1024 bytes or holding '..'");
    }
    while (!u.path.empty() && u.path.back() == '/') u.path.pop_back();
    return u;
  }
  if (uri.rfind("pvc://", 0) == 0) {
    const std::string rest = uri.substr(6);
    const size_t slash = rest.find('/');
    u.scheme = ModelUri::Scheme::kPvc;
    u.claim = rest.substr(0, slash);
    u.path = slash == std::string::npos ? "" : rest.substr(slash + 1);
    if (u.claim.empty()) return bad("names no claim");
    return u;
  }
  for (auto [prefix, scheme] : {std::pair{"hostpath://", ModelUri::Scheme::kHostPath},
                                std::pair{"file://", ModelUri::Scheme::kFile}}) {
    const std::string p = prefix;
    if (uri.rfind(p, 0) != 0) continue;
    u.scheme = scheme;
    u.path = uri.substr(p.size());
    if (u.path.empty() || u.path[0] != '/') return bad("must hold an absolute directory");
    return u;
  }
  return bad("has an unknown scheme");
}

absl::StatusOr<int64_t> ParseByteQuantity(const std::string& text, const std::string& field) {
  static const std::regex kQuantity("([0-9]{1,15})(Ki|Mi|Gi|Ti|k|M|G|T)?");
  std::smatch match;
  if (!std::regex_match(text, match, kQuantity)) {
    return absl::InvalidArgumentError(absl::StrCat(field, " '", text.substr(0, 64),
                                                   "' is not a memory quantity (a whole number of "
                                                   "bytes, or with Ki, Mi, Gi, Ti, k, M, G, T)"));
  }
  static const std::map<std::string, int64_t> kUnits = {
      {"", 1},     {"Ki", 1LL << 10}, {"Mi", 1LL << 20}, {"Gi", 1LL << 30},   {"Ti", 1LL << 40},
      {"k", 1000}, {"M", 1000000},    {"G", 1000000000}, {"T", 1000000000000}};
  const int64_t n = std::stoll(match[1].str());
  const int64_t unit = kUnits.at(match[2].str());
  if (n == 0 || n > (int64_t{1} << 52) / unit) {  // a petabyte of GPU memory is no GPU
    return absl::InvalidArgumentError(
        absl::StrCat(field, " '", text, "' must be more than 0 and at most 4 PiB"));
  }
  return n * unit;
}

absl::Status ValidateShardedModel(const ShardedModel& m) {
  static const std::regex kDnsLabel("[a-z0-9]([-a-z0-9]*[a-z0-9])?");
  // Pods are named <name>-<replica>-<stage> and must stay within 63 characters.
  if (m.name.empty() || m.name.size() > 45 || !std::regex_match(m.name, kDnsLabel)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metadata.name '", m.name,
        "' must be 1-45 lowercase letters, digits or '-', starting and ending alphanumeric"));
  }
  const ShardedModelSpec& s = m.spec;
  RETURN_IF_ERROR(AtLeast("spec.replicas", s.replicas, 0));
  if (s.model_name.empty()) return absl::InvalidArgumentError("spec.model.name is required");
  if (s.model_uri.empty()) return absl::InvalidArgumentError("spec.model.uri is required");
  ASSIGN_OR_RETURN(const ModelUri uri, ParseModelUri(s.model_uri));
  if (!s.model_files.empty() && !uri.remote()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.model.files chooses which files of a remote model (s3://, hf://, oci://) to fetch; "
        "spec.model.uri '",
        s.model_uri, "' is read as it is"));
  }
  const auto remote = [](const std::string& u) {
    const absl::StatusOr<ModelUri> at = ParseModelUri(u);
    return at.ok() && at->remote();
  };
  const bool remote_other =  // an adapter or the draft model, whose fetch steps read it too
      std::any_of(s.adapters.begin(), s.adapters.end(),
                  [&](const auto& a) { return remote(a.uri); }) ||
      remote(s.draft_model);
  if (!s.model_secret.empty() && !uri.remote() && !remote_other) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.model.secret holds the credentials of a remote model or adapter (s3://, hf://, "
        "oci://); spec.model.uri '",
        s.model_uri, "', spec.adapters and the draft model need none"));
  }
  if (!s.model_secret.empty() &&
      (s.model_secret.size() > 253 || !std::regex_match(s.model_secret, DnsSubdomain()))) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.model.secret '", s.model_secret, "' is not a Secret's name"));
  }
  RETURN_IF_ERROR(AtLeast("spec.parallelism.tensor", s.tensor, 1));
  RETURN_IF_ERROR(AtLeast("spec.parallelism.pipeline", s.pipeline, 1));
  RETURN_IF_ERROR(AtLeast("spec.parallelism.microBatches", s.micro_batches, 0));
  RETURN_IF_ERROR(CheckAdapters(s));
  if (const auto& d = s.disaggregation) {
    RETURN_IF_ERROR(AtLeast("spec.disaggregation.prefill.replicas", d->prefill_replicas, 0));
    RETURN_IF_ERROR(
        AtLeast("spec.disaggregation.prefill.parallelism.tensor", d->prefill_tensor, 1));
    RETURN_IF_ERROR(
        AtLeast("spec.disaggregation.prefill.parallelism.pipeline", d->prefill_pipeline, 1));
    RETURN_IF_ERROR(AtLeast("spec.disaggregation.minPromptTokens", d->min_prompt_tokens, 0));
    RETURN_IF_ERROR(AtLeast("spec.disaggregation.prefill.rollout.maxUnavailable",
                            d->prefill_max_unavailable, 0));
    RETURN_IF_ERROR(
        AtLeast("spec.disaggregation.prefill.rollout.maxSurge", d->prefill_max_surge, 0));
    if (d->prefill_max_unavailable == 0 && d->prefill_max_surge == 0) {
      return absl::InvalidArgumentError(
          "spec.disaggregation.prefill.rollout.maxUnavailable and maxSurge cannot both be 0");
    }
    if (m.name.size() > kMaxDisaggregatedNameLength) {
      return absl::InvalidArgumentError(absl::StrCat(
          "metadata.name '", m.name, "' of a model with spec.disaggregation must be at most ",
          kMaxDisaggregatedNameLength, " characters (its prefill role is '",
          PrefillModelName(m.name), "')"));
    }
    if (!s.prefill_of.empty()) {
      return absl::InvalidArgumentError(
          "spec.prefillOf and spec.disaggregation cannot be set together (a prefill role is not "
          "disaggregated again)");
    }
  }
  if (!s.prefill_of.empty() && (s.prefill_of.size() > kMaxDisaggregatedNameLength ||
                                !std::regex_match(s.prefill_of, kDnsLabel))) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.prefillOf '", s.prefill_of, "' is not a disaggregated model's name"));
  }
  if (s.failure_policy != "RecreateReplica" && s.failure_policy != "None") {
    return absl::InvalidArgumentError(absl::StrCat("spec.failurePolicy '", s.failure_policy,
                                                   "' must be RecreateReplica or None"));
  }
  RETURN_IF_ERROR(AtLeast("spec.rollout.maxUnavailable", s.max_unavailable, 0));
  RETURN_IF_ERROR(AtLeast("spec.rollout.maxSurge", s.max_surge, 0));
  if (s.max_unavailable == 0 && s.max_surge == 0) {
    return absl::InvalidArgumentError(
        "spec.rollout.maxUnavailable and spec.rollout.maxSurge cannot both be 0");
  }
  if (s.port < 1 || s.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.serving.port must be between 1 and 65535, got ", s.port));
  }
  RETURN_IF_ERROR(AtLeast("spec.serving.maxBatchSize", s.max_batch_size, 1));
  if (s.special_tokens_in_content != "special" && s.special_tokens_in_content != "text") {
    return absl::InvalidArgumentError(absl::StrCat("spec.serving.specialTokensInContent '",
                                                   s.special_tokens_in_content,
                                                   "' must be special or text"));
  }
  if (!ParseKvCacheDtype(s.kv_cache_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("spec.serving.kvCacheDtype '", s.kv_cache_dtype,
                                                   "' must be ", kKvCacheDtypes));
  }
  if (!ParseSpeculativeMethod(s.speculative_method)) {
    return absl::InvalidArgumentError(absl::StrCat("spec.serving.speculative.method '",
                                                   s.speculative_method, "' must be ",
                                                   kSpeculativeMethods));
  }
  if ((s.speculative_method == "draft") != !s.draft_model.empty()) {
    return absl::InvalidArgumentError(
        s.draft_model.empty()
            ? "spec.serving.speculative.method draft needs spec.serving.speculative.draftModel"
            : absl::StrCat("spec.serving.speculative.draftModel is the draft method's; the method "
                           "is ",
                           s.speculative_method));
  }
  if (!s.draft_model.empty()) {
    if (absl::StatusOr<ModelUri> uri = ParseModelUri(s.draft_model); !uri.ok()) {
      std::string why(uri.status().message());  // it names spec.model.uri
      if (absl::StartsWith(why, "spec.model.uri ")) why.erase(0, 15);
      return absl::InvalidArgumentError(absl::StrCat("spec.serving.speculative.draftModel ", why));
    }
  }
  if (s.speculative_tokens < 1 || s.speculative_tokens > kMaxSpeculativeTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.serving.speculative.tokens must be between 1 and ",
                     kMaxSpeculativeTokens, ", got ", s.speculative_tokens));
  }
  if (s.prefix_cache_isolation != "none" && s.prefix_cache_isolation != "perKey") {
    return absl::InvalidArgumentError(absl::StrCat("spec.serving.prefixCacheIsolation '",
                                                   s.prefix_cache_isolation,
                                                   "' must be none or perKey"));
  }
  if (s.tool_call_parser != "auto" && !IsToolCallFormat(s.tool_call_parser)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.serving.toolCallParser '", s.tool_call_parser, "' must be auto, ", kToolCallFormats));
  }
  if (s.reasoning_parser != "auto" && s.reasoning_parser != "none" &&
      s.reasoning_parser != "deepseek_r1" && s.reasoning_parser != "qwen3" &&
      s.reasoning_parser != "openai_gptoss") {
    return absl::InvalidArgumentError(absl::StrCat("spec.serving.reasoningParser '",
                                                   s.reasoning_parser,
                                                   "' must be auto, none, deepseek_r1, qwen3 "
                                                   "(<think> blocks) or openai_gptoss (harmony)"));
  }
  {
    const bool inline_template = !s.chat_template_inline.empty();
    const bool from_config_map =
        !s.chat_template_config_map.empty() || !s.chat_template_key.empty();
    if (inline_template && from_config_map) {
      return absl::InvalidArgumentError(
          "spec.serving.chatTemplate takes inline or configMap, not both");
    }
    if (from_config_map && (s.chat_template_config_map.empty() || s.chat_template_key.empty())) {
      return absl::InvalidArgumentError(
          "spec.serving.chatTemplate.configMap needs its name and the key holding the template");
    }
    // An environment variable carries it (Linux takes 128 KiB in one).
    if (s.chat_template_inline.size() > kMaxChatTemplateBytes) {
      return absl::InvalidArgumentError(absl::StrCat("spec.serving.chatTemplate.inline has ",
                                                     s.chat_template_inline.size(),
                                                     " bytes; at most ", kMaxChatTemplateBytes));
    }
  }
  RETURN_IF_ERROR(AtLeast("spec.serving.maxSequenceLength", s.max_sequence_length, 2));
  for (auto [field, v] : {std::pair{"spec.startup.timeoutSeconds", s.startup_timeout_seconds},
                          std::pair{"spec.startup.loadStallSeconds", s.load_stall_seconds}}) {
    if (v < 1 || v > kMaxStartupSeconds) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " must be between 1 and ", kMaxStartupSeconds, ", got ", v));
    }
  }
  if (!s.api_key_secret.empty() &&
      (s.api_key_secret.size() > 253 || !std::regex_match(s.api_key_secret, DnsSubdomain()))) {
    return absl::InvalidArgumentError(absl::StrCat("spec.serving.apiKeySecret '", s.api_key_secret,
                                                   "' is not a valid Secret name (lower-case "
                                                   "letters, digits, '-' and '.', at most 253)"));
  }
  for (const auto& [field, v, lo, hi] :
       {std::tuple{"spec.serving.slo.ttftMilliseconds", s.slo_ttft_ms, 0, 86400000},
        std::tuple{"spec.serving.slo.itlMilliseconds", s.slo_itl_ms, 0, 86400000},
        std::tuple{"spec.serving.slo.percentile", s.slo_percentile, 1, 99},
        std::tuple{"spec.serving.queue.maxRequests", s.queue_max_requests, 0, 4096},
        std::tuple{"spec.serving.queue.timeoutSeconds", s.queue_timeout_seconds, 0, 86400}}) {
    if (v < lo || v > hi) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " must be between ", lo, " and ", hi, ", got ", v));
    }
  }
  if (!s.flow_control_config_map.empty() && !s.flow_control_secret.empty()) {
    return absl::InvalidArgumentError("spec.serving.flowControl: configMap or secret, not both");
  }
  for (const auto& [field, name] : {std::pair{"configMap", s.flow_control_config_map},
                                    std::pair{"secret", s.flow_control_secret}}) {
    if (!name.empty() && (name.size() > 253 || !std::regex_match(name, DnsSubdomain()))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.serving.flowControl.", field, " '", name,
          "' is not a valid name (lower-case letters, digits, '-' and '.', at most 253)"));
    }
  }
  if (s.flow_control_key.empty() || s.flow_control_key.size() > 253 ||
      !std::regex_match(s.flow_control_key, std::regex("[-._a-zA-Z0-9]+")) ||
      s.flow_control_key == "." || s.flow_control_key == "..") {
    return absl::InvalidArgumentError(absl::StrCat("spec.serving.flowControl.key '",
                                                   s.flow_control_key,
                                                   "' is not a valid ConfigMap or Secret key"));
  }
  return absl::OkStatus();
}

namespace {

absl::StatusOr<ShardedModel> ParseRoot(const YAML::Node& root) {
  if (!root.IsMap()) return absl::InvalidArgumentError("the manifest must be a YAML mapping");
  ShardedModel m;
  Fields top(root, "");
  std::string api_version, kind;
  RETURN_IF_ERROR(top.String("apiVersion", api_version));
  RETURN_IF_ERROR(top.String("kind", kind));
  if (api_version != kApiVersion || kind != kShardedModelKind) {
    return absl::InvalidArgumentError(absl::StrCat("apiVersion/kind is '", api_version, "' / '",
                                                   kind, "', expected ", kApiVersion, " / ",
                                                   kShardedModelKind));
  }
  Fields meta(top.Get("metadata"), "metadata");
  RETURN_IF_ERROR(meta.CheckMap());
  RETURN_IF_ERROR(meta.String("name", m.name));
  RETURN_IF_ERROR(meta.String("namespace", m.namespace_));
  try {
    RETURN_IF_ERROR(ParseSpec(top.Get("spec"), m.spec));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("spec: ", e.what()));
  }
  top.Get("status");
  RETURN_IF_ERROR(top.NoOthers());
  RETURN_IF_ERROR(ValidateShardedModel(m));
  return m;
}

}  // namespace

absl::StatusOr<ShardedModel> ParseShardedModel(const std::string& text) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("not valid YAML: ", e.what()));
  }
  return ParseRoot(root);
}

absl::StatusOr<ShardedModel> ParseShardedModelObject(const nlohmann::json& object) {
  return ParseRoot(FromJson(object));
}

absl::StatusOr<std::vector<ShardedModelSpec::EnvVar>> ParseEnvList(const nlohmann::json& list,
                                                                   const std::string& path) {
  std::vector<ShardedModelSpec::EnvVar> out;
  try {
    RETURN_IF_ERROR(ParseEnv(FromJson(list), path, out));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", e.what()));
  }
  return out;
}

}  // namespace shardserve
