// shardserve: the user CLI. Subcommands: local, plan, fetch, gen-model, gen-adapter, generate,
// inspect-adapter, bench.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "api/kv_cache_dtype.h"
#include "api/speculative.h"
#include "api/worker_env.h"
#include "backend/cpu/cpu_features.h"
#include "bench/comm_bench.h"
#include "bench/cuda_bench.h"  // its usage is listed in every build; it runs in CUDA ones
#include "bench/disk_bench.h"
#include "bench/informer_bench.h"
#include "bench/kernels_bench.h"
#include "bench/load_bench.h"
#include "bench/lora_bench.h"
#include "bench/runtime_bench.h"
#include "bench/tokenize_bench.h"
#include "cli/fetch.h"
#include "cli/local.h"
#include "cli/plan.h"
#include "comm/handshake.h"
#include "comm/socket.h"
#include "common/args.h"
#include "common/process.h"
#include "common/status.h"
#include "common/text.h"
#include "devtools/gen_adapter.h"
#include "devtools/gen_model.h"
#include "devtools/gguf_convert.h"
#include "model/config.h"
#include "model/generator.h"
#include "model/lora.h"
#include "model/transformer.h"
#include "plan/layer_split.h"
#include "serve/generate_wire.h"
#include "tokenizer/tokenizer.h"

namespace shardserve {
namespace {

constexpr char kGenModelUsage[] =
    "--arch llama|mistral|qwen2|qwen3|qwen3_moe|mixtral|deepseek_v3|gpt_oss --out DIR\n"
    "[--layers N --hidden N --intermediate N --heads N --kv-heads N --head-dim N --vocab N\n"
    "--experts N --top-k N --no-norm-topk-prob\n"
    "--q-lora N --kv-lora N --rope-dim N --nope-dim N --v-dim N --groups N --topk-groups N\n"
    "--shared-experts N --first-dense N --moe-intermediate N --mtp (deepseek_v3)\n"
    "--sliding-window N --swiglu-limit X --mxfp4 (gpt_oss)\n"
    "--dtype bf16|f16|f32 --fp8-block N|tensor --seed N --tie-embeddings --attention-bias\n"
    "--rope-scaling llama3|linear|yarn --max-position N --tokenizer bytelevel|sentencepiece\n"
    "--chat-template auto|llama3|chatml|llama2|mistral|hermes|llama3-tools|mistral-tools|\n"
    "deepseek-tools|chatml-think|qwen3|harmony|none\n"
    "--corpus FILE --shard-size BYTES --think-tokens\n"
    "--format safetensors|gguf --gguf-type f32|f16|bf16|q8_0|q4_0|q4_1|q4_k|q5_k|q6_k\n"
    "--gguf-legacy-mla]\n"
    "(a small random model with a trained tokenizer, for tests and demos; --format gguf: --out\n"
    "names the .gguf file, weights stored as --gguf-type, default the --dtype, MXFP4 experts as\n"
    "MXFP4; --gguf-legacy-mla: DeepSeek-V3's kv_b_proj as one attn_kv_b, as older llama.cpp\n"
    "files hold it; --fp8-block N: the linear weights as a fine-grained FP8 checkpoint, E4M3\n"
    "with a scale per N x N block; tensor: one scale per weight; --think-tokens: <think> and\n"
    "</think> added to the tokenizer, not special, as reasoning models have them)";
constexpr char kGenerateUsage[] =
    "--model DIR (--prompt TEXT | --prompt-ids 1,2,3) [--max-tokens N --temperature T\n"
    "--top-p P --top-k K --seed S --logprobs K --stop-token-ids 1,2 --ignore-eos\n"
    "--min-tokens N --logit-bias ID:BIAS,... --repetition-penalty X --frequency-penalty X\n"
    "--presence-penalty X (as the API's)\n"
    "--threads N --format text|json --tp T --pp P --microbatches M --batch N --max-step-tokens N\n"
    "--metrics-port-base PORT --kv-cache-dtype auto|f32|bf16|f16|fp8\n"
    "--speculative none|ngram|draft|mtp --speculative-tokens K --draft-model DIR|FILE.gguf]\n"
    "(--tp/--pp: P stage launchers x T rank processes on this machine, stages over TCP;\n"
    "--speculative: decode steps draft up to K tokens (4; mtp: 1) that the model verifies;\n"
    "--max-step-tokens: prompt tokens fed a step (512); with either (none too) the run goes\n"
    "through the rank runtime even at one rank)";

constexpr char kGenAdapterUsage[] =
    "--model DIR --out DIR [--rank N --alpha N --seed N]\n"
    "(a random LoRA adapter of the model as PEFT writes one: every attention and MLP projection,\n"
    "F32, for tests and benchmarks)";
constexpr char kInspectAdapterUsage[] =
    "--model DIR --adapter DIR\n"
    "(a LoRA adapter as PEFT wrote it, checked against its base model: each module's layer,\n"
    "projection, rank, sizes, scale and its matrices' sums, as JSON; what shardserve does not run\n"
    "is refused by name)";

// The overview: every command's usage (`shardserve COMMAND --help` prints one with its flags).
std::string Usage() {
  const std::pair<const char*, const char*> commands[] = {{"local", kLocalUsage},
                                                          {"plan", kPlanUsage},
                                                          {"fetch", kFetchUsage},
                                                          {"gen-model", kGenModelUsage},
                                                          {"generate", kGenerateUsage},
                                                          {"gen-adapter", kGenAdapterUsage},
                                                          {"inspect-adapter", kInspectAdapterUsage},
                                                          {"bench [runtime]", kRuntimeBenchUsage},
                                                          {"bench allreduce", kAllReduceBenchUsage},
                                                          {"bench cuda", kCudaBenchUsage},
                                                          {"bench informer", kInformerBenchUsage},
                                                          {"bench kernels", kKernelsBenchUsage},
                                                          {"bench load", kLoadBenchUsage},
                                                          {"bench lora", kLoraBenchUsage},
                                                          {"bench disk", kDiskBenchUsage},
                                                          {"bench tokenize", kTokenizeBenchUsage}};
  std::string out =
      "usage: shardserve COMMAND [flags]   (shardserve COMMAND --help: its flags)\n\ncommands:\n";
  for (const auto& [command, usage] : commands) {
    absl::StrAppend(&out, "  ", command, "\n");
    for (absl::string_view line : absl::StrSplit(usage, '\n')) {
      absl::StrAppend(&out, "      ", line, "\n");
    }
  }
  return out;
}

absl::StatusOr<std::vector<int64_t>> ParseIdList(const std::string& flag, const std::string& s) {
  std::vector<int64_t> ids;
  for (absl::string_view part : absl::StrSplit(s, ',', absl::SkipWhitespace())) {
    int64_t v;
    if (!absl::SimpleAtoi(part, &v)) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", part, "' is not an id"));
    }
    ids.push_back(v);
  }
  return ids;
}

absl::Status GenModel(const std::vector<std::string>& argv) {
  ASSIGN_OR_RETURN(Args a, Args::Parse(argv, {"arch",           "out",
                                              "layers",         "hidden",
                                              "intermediate",   "heads",
                                              "kv-heads",       "head-dim",
                                              "vocab",          "experts",
                                              "top-k",          "dtype",
                                              "seed",           "rope-scaling",
                                              "max-position",   "tokenizer",
                                              "corpus",         "shard-size",
                                              "chat-template",  "format",
                                              "gguf-type",      "fp8-block",
                                              "q-lora",         "kv-lora",
                                              "rope-dim",       "nope-dim",
                                              "v-dim",          "groups",
                                              "topk-groups",    "shared-experts",
                                              "first-dense",    "moe-intermediate",
                                              "sliding-window", "swiglu-limit"},
                                       {"tie-embeddings", "attention-bias", "no-norm-topk-prob",
                                        "mxfp4", "gguf-legacy-mla", "think-tokens", "mtp"},
                                       "shardserve gen-model", kGenModelUsage));
  GenModelOptions o;
  o.arch = a.GetOr("arch", "llama");
  ASSIGN_OR_RETURN(o.out_dir, a.Require("out"));
  ASSIGN_OR_RETURN(o.layers, a.GetInt("layers", o.layers));
  ASSIGN_OR_RETURN(o.hidden, a.GetInt("hidden", o.hidden));
  ASSIGN_OR_RETURN(o.intermediate, a.GetInt("intermediate", o.intermediate));
  ASSIGN_OR_RETURN(o.heads, a.GetInt("heads", o.heads));
  ASSIGN_OR_RETURN(o.kv_heads, a.GetInt("kv-heads", o.kv_heads));
  ASSIGN_OR_RETURN(o.head_dim, a.GetInt("head-dim", 0));
  ASSIGN_OR_RETURN(o.vocab, a.GetInt("vocab", o.vocab));
  ASSIGN_OR_RETURN(o.experts, a.GetInt("experts", o.experts));
  ASSIGN_OR_RETURN(o.top_k, a.GetInt("top-k", o.top_k));
  o.norm_topk_prob = !a.Has("no-norm-topk-prob");
  for (auto [flag, field] : {std::pair{"q-lora", &o.q_lora_rank},
                             {"kv-lora", &o.kv_lora_rank},
                             {"rope-dim", &o.rope_dim},
                             {"nope-dim", &o.nope_dim},
                             {"v-dim", &o.v_dim},
                             {"groups", &o.groups},
                             {"topk-groups", &o.topk_groups},
                             {"shared-experts", &o.shared_experts},
                             {"first-dense", &o.first_dense},
                             {"moe-intermediate", &o.moe_intermediate}}) {
    ASSIGN_OR_RETURN(*field, a.GetInt(flag, *field));
  }
  ASSIGN_OR_RETURN(o.sliding_window, a.GetInt("sliding-window", o.sliding_window));
  o.mxfp4 = a.Has("mxfp4");
  o.mtp = a.Has("mtp");
  ASSIGN_OR_RETURN(o.swiglu_limit, a.GetDouble("swiglu-limit", o.swiglu_limit));
  ASSIGN_OR_RETURN(o.max_position, a.GetInt("max-position", o.max_position));
  ASSIGN_OR_RETURN(int64_t seed, a.GetInt("seed", 0));
  o.seed = static_cast<uint64_t>(seed);
  ASSIGN_OR_RETURN(o.shard_bytes, a.GetInt("shard-size", 0));
  if (a.GetOr("fp8-block", "") == "tensor") {
    o.fp8_block = GenModelOptions::kFp8PerTensor;
  } else {
    ASSIGN_OR_RETURN(o.fp8_block, a.GetInt("fp8-block", 0));
  }
  const std::string dtype = a.GetOr("dtype", "bf16");
  if (dtype == "bf16") {
    o.dtype = DType::kBF16;
  } else if (dtype == "f16") {
    o.dtype = DType::kF16;
  } else if (dtype == "f32") {
    o.dtype = DType::kF32;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--dtype '", dtype, "' is not bf16, f16, f32"));
  }
  const std::string tok = a.GetOr("tokenizer", "bytelevel");
  if (tok == "sentencepiece") {
    o.tokenizer = TokenizerStyle::kSentencePiece;
  } else if (tok != "bytelevel") {
    return absl::InvalidArgumentError(
        absl::StrCat("--tokenizer '", tok, "' is not bytelevel or sentencepiece"));
  }
  o.tie_embeddings = a.Has("tie-embeddings");
  o.attention_bias = a.Has("attention-bias");
  o.rope_scaling = a.GetOr("rope-scaling", "");
  o.corpus_file = a.GetOr("corpus", "");
  o.think_tokens = a.Has("think-tokens");
  o.chat_template = a.GetOr("chat-template", "auto");
  const std::string format = a.GetOr("format", "safetensors");
  if (format == "safetensors") {
    RETURN_IF_ERROR(GenerateModel(o));
    std::cerr << "wrote " << o.arch << " model to " << o.out_dir << "\n";
    return absl::OkStatus();
  }
  if (format != "gguf") {
    return absl::InvalidArgumentError(
        absl::StrCat("--format '", format, "' is not safetensors or gguf"));
  }
  const std::map<std::string, DType> types = {
      {"f32", DType::kF32},   {"f16", DType::kF16},   {"bf16", DType::kBF16},
      {"q8_0", DType::kQ8_0}, {"q4_0", DType::kQ4_0}, {"q4_1", DType::kQ4_1},
      {"q4_k", DType::kQ4_K}, {"q5_k", DType::kQ5_K}, {"q6_k", DType::kQ6_K}};
  auto type = types.find(a.GetOr("gguf-type", dtype));
  if (type == types.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--gguf-type '", a.GetOr("gguf-type", dtype),
                     "' is not f32, f16, bf16, q8_0, q4_0, q4_1, q4_k, q5_k, q6_k"));
  }
  // The Hugging Face directory first (next to the file), then the GGUF file from it.
  const std::string file = o.out_dir;
  o.out_dir = file + ".hf-tmp";
  RETURN_IF_ERROR(GenerateModel(o));
  const absl::Status converted =
      ConvertToGguf(o.out_dir, file, type->second, a.Has("gguf-legacy-mla"));
  std::error_code ec;
  std::filesystem::remove_all(o.out_dir, ec);
  RETURN_IF_ERROR(converted);
  std::cerr << "wrote " << o.arch << " model to " << file << " (GGUF, " << DTypeName(type->second)
            << ")\n";
  return absl::OkStatus();
}

// Runs one request as P stage launchers x T rank processes on this machine (stages talk over TCP
// as if on different nodes) and returns the leader's result.
// The first result of a batch and the generation time (start-up excluded).
struct Generated {
  GenerationResult result;
  double seconds = 0;
  int64_t drafted = 0, accepted = 0;         // speculative decoding's tokens
  std::vector<std::vector<int32_t>> drafts;  // GenerateOutcome::drafts
};

// `base`: what every rank shares (its TP size, threads, serving settings); the stages' places,
// the rendezvous and the one-shot request are added here.
absl::StatusOr<Generated> GenerateSharded(const std::string& dir, const GenerationRequest& req,
                                          int64_t batch, int64_t pp, const WorkerEnv& base) {
  ASSIGN_OR_RETURN(const int port, ChooseFreePort("127.0.0.1"));  // the rendezvous port
  const std::string job = absl::StrCat("gen-", getpid());
  const std::string result_path =
      (std::filesystem::temp_directory_path() / (job + "-result.json")).string();
  const std::string request = EncodeGenerateRun({req, batch}).dump();
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir));
  ASSIGN_OR_RETURN(std::vector<LayerRange> layers,
                   PlanStageLayers(config.shape(), static_cast<int>(pp)));
  ASSIGN_OR_RETURN(SecretFile secret, SecretFile::Create());
  std::vector<Child> stages;
  for (int64_t s = 0; s < pp; ++s) {
    WorkerEnv w = base;
    w.model_path = dir;
    w.rendezvous_secret_file = secret.path();
    w.pp = static_cast<int>(pp);
    w.stage = static_cast<int>(s);
    w.stage_layers = FormatStageLayers(layers);
    w.leader_addr = absl::StrCat("127.0.0.1:", port);
    w.job_id = job;
    w.request = request;
    w.result_file = result_path;
    auto pid = Spawn(SelfDirectory() + "/shardserve-worker", {"launch"}, w.ToEnv());
    if (!pid.ok()) {
      for (const Child& c : stages) kill(c.pid, SIGKILL);
      return pid.status();
    }
    stages.push_back({*pid, absl::StrCat("stage ", s, " launcher")});
  }
  RETURN_IF_ERROR(SuperviseAll(stages, std::chrono::milliseconds(5000)));
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(result_path));
  std::filesystem::remove(result_path);
  ASSIGN_OR_RETURN(GenerateOutcome outcome,
                   DecodeGenerateOutcome(nlohmann::json::parse(text, nullptr, false)));
  return Generated{std::move(outcome.results[0]), outcome.seconds, outcome.drafted,
                   outcome.accepted, std::move(outcome.drafts)};
}

absl::Status Generate(const std::vector<std::string>& argv) {
  ASSIGN_OR_RETURN(Args a, Args::Parse(argv,
                                       {"model",
                                        "prompt",
                                        "prompt-ids",
                                        "max-tokens",
                                        "temperature",
                                        "top-p",
                                        "top-k",
                                        "seed",
                                        "logprobs",
                                        "stop-token-ids",
                                        "threads",
                                        "format",
                                        "tp",
                                        "pp",
                                        "microbatches",
                                        "max-step-tokens",
                                        "batch",
                                        "metrics-port-base",
                                        "min-tokens",
                                        "logit-bias",
                                        "repetition-penalty",
                                        "frequency-penalty",
                                        "presence-penalty",
                                        "kv-cache-dtype",
                                        "speculative",
                                        "speculative-tokens",
                                        "draft-model"},
                                       {"ignore-eos"}, "shardserve generate", kGenerateUsage));
  ASSIGN_OR_RETURN(std::string dir, a.Require("model"));
  const std::string format = a.GetOr("format", "text");
  if (format != "text" && format != "json") {
    return absl::InvalidArgumentError(absl::StrCat("--format '", format, "' is not text or json"));
  }
  if (a.Has("prompt") == a.Has("prompt-ids")) {
    return absl::InvalidArgumentError("give exactly one of --prompt and --prompt-ids");
  }
  GenerationRequest req;
  SamplingParams& p = req.params;
  ASSIGN_OR_RETURN(p.max_tokens, a.GetInt("max-tokens", 16));
  ASSIGN_OR_RETURN(double temperature, a.GetDouble("temperature", 0.0));
  ASSIGN_OR_RETURN(double top_p, a.GetDouble("top-p", 1.0));
  p.temperature = static_cast<float>(temperature);
  p.top_p = static_cast<float>(top_p);
  ASSIGN_OR_RETURN(p.top_k, a.GetInt("top-k", 0));
  ASSIGN_OR_RETURN(int64_t seed, a.GetInt("seed", 0));
  p.seed = static_cast<uint64_t>(seed);
  ASSIGN_OR_RETURN(p.top_logprobs, a.GetInt("logprobs", 0));
  if (a.Has("stop-token-ids")) {
    ASSIGN_OR_RETURN(p.stop_token_ids, ParseIdList("stop-token-ids", *a.Get("stop-token-ids")));
  }
  p.ignore_eos = a.Has("ignore-eos");
  ASSIGN_OR_RETURN(p.min_tokens, a.GetInt("min-tokens", 0));
  for (auto [flag, field] : {std::pair{"repetition-penalty", &p.repetition_penalty},
                             {"frequency-penalty", &p.frequency_penalty},
                             {"presence-penalty", &p.presence_penalty}}) {
    ASSIGN_OR_RETURN(const double v, a.GetDouble(flag, *field));
    *field = static_cast<float>(v);
  }
  if (a.Has("logit-bias")) {  // ID:BIAS,ID:BIAS
    for (const absl::string_view e : absl::StrSplit(*a.Get("logit-bias"), ',')) {
      const std::vector<absl::string_view> kv = absl::StrSplit(e, absl::MaxSplits(':', 1));
      int32_t id;
      float bias;
      if (kv.size() != 2 || !absl::SimpleAtoi(kv[0], &id) || !absl::SimpleAtof(kv[1], &bias)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--logit-bias '", e, "' is not ID:BIAS (e.g. 50256:-100)"));
      }
      p.logit_bias.emplace_back(id, bias);
    }
  }
  RETURN_IF_ERROR(p.Validate());
  ASSIGN_OR_RETURN(int64_t threads,
                   a.GetInt("threads", std::max(1u, std::thread::hardware_concurrency())));

  // The KV cache's dtype: the flag, else the worker contract's SHARDSERVE_KV_CACHE_DTYPE.
  ASSIGN_OR_RETURN(const WorkerEnv contract, WorkerEnv::FromEnv());
  ASSIGN_OR_RETURN(const KvCacheDtype kv_cache_dtype,
                   KvCacheDtypeOf(a.Get("kv-cache-dtype"), contract));
  SpeculativeConfig speculative;
  if (a.Has("speculative")) {
    const std::optional<SpeculativeMethod> m = ParseSpeculativeMethod(*a.Get("speculative"));
    if (!m) {
      return absl::InvalidArgumentError(absl::StrCat("--speculative '", *a.Get("speculative"),
                                                     "' must be ", kSpeculativeMethods));
    }
    speculative.method = *m;
  }
  const bool mtp = speculative.method == SpeculativeMethod::kMtp;
  ASSIGN_OR_RETURN(
      speculative.tokens,
      a.GetInt("speculative-tokens", mtp ? kMtpSpeculativeTokens : kDefaultSpeculativeTokens));
  if (a.Has("speculative-tokens") && !speculative.enabled()) {
    return absl::InvalidArgumentError(
        "--speculative-tokens needs --speculative ngram, draft or mtp");
  }
  if (mtp && speculative.tokens != kMtpSpeculativeTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("--speculative mtp drafts ", kMtpSpeculativeTokens,
                     " token a step (the checkpoint's one multi-token-prediction layer)"));
  }
  if ((speculative.method == SpeculativeMethod::kDraft) != a.Has("draft-model")) {
    return absl::InvalidArgumentError("--speculative draft and --draft-model go together");
  }
  if (speculative.tokens < 1 || speculative.tokens > kMaxSpeculativeTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("--speculative-tokens must be between 1 and ", kMaxSpeculativeTokens));
  }
  ASSIGN_OR_RETURN(int64_t tp, a.GetInt("tp", 1));
  ASSIGN_OR_RETURN(int64_t pp, a.GetInt("pp", 1));
  ASSIGN_OR_RETURN(int64_t microbatches, a.GetInt("microbatches", 0));
  ASSIGN_OR_RETURN(const int64_t max_step_tokens,
                   a.GetInt("max-step-tokens", WorkerEnv::Defaults().max_step_tokens));
  if (max_step_tokens < 1)
    return absl::InvalidArgumentError("--max-step-tokens must be at least 1");
  ASSIGN_OR_RETURN(int64_t batch, a.GetInt("batch", 1));
  if (batch < 1) return absl::InvalidArgumentError("--batch must be at least 1");
  if (tp < 1 || pp < 1) return absl::InvalidArgumentError("--tp and --pp must be at least 1");
  // One rank on the CPU runs in this process; a backend named in SHARDSERVE_BACKEND (other than
  // cpu) goes through the rank runtime, which picks it.
  const char* backend = std::getenv(kBackendEnv);
  const bool on_cpu = backend == nullptr || *backend == '\0' || std::string(backend) == "cpu";
  const bool in_process =
      tp * pp == 1 && !a.Has("speculative") && !a.Has("max-step-tokens") && on_cpu;
  // The CPU kernels (SHARDSERVE_CPU_KERNELS) this process and the ranks it starts run.
  RETURN_IF_ERROR(cpu::UseKernelLevel(contract.cpu_kernels));
  std::unique_ptr<Transformer> model;
  if (in_process) {  // load first: a bad directory is reported as the model's problem
    // The worker contract's settings for how weights compute (SHARDSERVE_FP8), as a rank reads
    // them.
    Transformer::Options o;
    o.num_threads = static_cast<int>(threads);
    o.fp8_blocks = contract.fp8_blocks;
    o.kv_cache_dtype = kv_cache_dtype;
    ASSIGN_OR_RETURN(model, Transformer::Load(dir, o));
  }
  ASSIGN_OR_RETURN(auto tokenizer, Tokenizer::Load(dir));
  if (a.Has("prompt")) {
    ASSIGN_OR_RETURN(req.prompt_ids, tokenizer->Encode(*a.Get("prompt")));
  } else {
    ASSIGN_OR_RETURN(auto ids, ParseIdList("prompt-ids", *a.Get("prompt-ids")));
    req.prompt_ids.assign(ids.begin(), ids.end());
  }
  Generated g;
  if (model) {
    const auto t0 = std::chrono::steady_clock::now();
    ASSIGN_OR_RETURN(auto results,
                     shardserve::Generate(*model, std::vector<GenerationRequest>(batch, req)));
    g.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    g.result = std::move(results[0]);
  } else {
    WorkerEnv base;
    base.tp = static_cast<int>(tp);
    base.threads = static_cast<int>(std::max<int64_t>(1, threads / (tp * pp)));
    base.microbatches = static_cast<int>(microbatches);
    base.max_step_tokens = max_step_tokens;
    base.kv_cache_dtype = KvCacheDtypeName(kv_cache_dtype);
    base.speculative_method = SpeculativeMethodName(speculative.method);
    base.speculative_tokens = static_cast<int>(speculative.tokens);
    base.draft_model = a.GetOr("draft-model", "");
    base.cpu_kernels = contract.cpu_kernels;
    // One-shot runs serve /metrics only when asked (base + global rank).
    ASSIGN_OR_RETURN(int64_t metrics_base, a.GetInt("metrics-port-base", -1));
    base.metrics = metrics_base >= 0;
    base.metrics_port_base = static_cast<int>(std::max<int64_t>(-1, metrics_base));
    ASSIGN_OR_RETURN(g, GenerateSharded(dir, req, batch, pp, base));
  }
  const GenerationResult& r = g.result;
  const std::string text = tokenizer->Decode(r.tokens, /*skip_special_tokens=*/true);
  if (format == "text") {
    std::cout << text << std::endl;
    return absl::OkStatus();
  }
  nlohmann::json out = {{"prompt_ids", req.prompt_ids},
                        {"tokens", r.tokens},
                        {"text", text},
                        {"logprobs", r.logprobs},
                        {"finish_reason", r.finish_reason},
                        {"timing",
                         {{"seconds", g.seconds},
                          {"batch", batch},
                          {"generated_tokens", static_cast<int64_t>(r.tokens.size()) * batch}}}};
  nlohmann::json tops = nlohmann::json::array();
  for (const auto& step : r.top_logprobs) {
    nlohmann::json alts = nlohmann::json::array();
    for (const TokenLogprob& t : step) alts.push_back({{"id", t.id}, {"logprob", t.logprob}});
    tops.push_back(alts);
  }
  out["top_logprobs"] = tops;
  if (on_cpu) out["cpu_kernels"] = cpu::KernelLevelName(cpu::ActiveKernelLevel());
  if (speculative.enabled()) {
    out["speculation"] = {{"method", SpeculativeMethodName(speculative.method)},
                          {"tokens", speculative.tokens},
                          {"drafted", g.drafted},
                          {"accepted", g.accepted},
                          {"drafts", g.drafts}};
  }
  std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
  return absl::OkStatus();
}

// shardserve inspect-adapter: model/lora.h's reading of an adapter, as JSON.
absl::Status InspectAdapter(const std::vector<std::string>& argv) {
  ASSIGN_OR_RETURN(Args a, Args::Parse(argv, {"model", "adapter"}, {}, "shardserve inspect-adapter",
                                       kInspectAdapterUsage));
  ASSIGN_OR_RETURN(std::string model, a.Require("model"));
  ASSIGN_OR_RETURN(std::string dir, a.Require("adapter"));
  ASSIGN_OR_RETURN(ModelConfig base, LoadModelConfig(model));
  ASSIGN_OR_RETURN(LoraAdapter adapter, LoraAdapter::Load(dir, base));
  nlohmann::json modules = nlohmann::json::array();
  for (const LoraModule& m : adapter.modules) {
    double a_sum = 0, a_sq = 0, b_sum = 0, b_sq = 0;
    for (float v : m.a) a_sum += v, a_sq += static_cast<double>(v) * v;
    for (float v : m.b) b_sum += v, b_sq += static_cast<double>(v) * v;
    modules.push_back({{"layer", m.layer},
                       {"target", LoraTargetName(m.target)},
                       {"rank", m.rank},
                       {"in", m.in},
                       {"out", m.out},
                       {"scale", m.scale},
                       {"a_sum", a_sum},
                       {"a_sq", a_sq},
                       {"b_sum", b_sum},
                       {"b_sq", b_sq}});
  }
  const nlohmann::json out = {
      {"base_model", adapter.base_model}, {"max_rank", adapter.max_rank}, {"modules", modules}};
  std::printf("%s\n", out.dump(2).c_str());
  return absl::OkStatus();
}

absl::Status GenAdapter(const std::vector<std::string>& argv) {
  ASSIGN_OR_RETURN(Args a, Args::Parse(argv, {"model", "out", "rank", "alpha", "seed"}, {},
                                       "shardserve gen-adapter", kGenAdapterUsage));
  ASSIGN_OR_RETURN(const std::string model, a.Require("model"));
  ASSIGN_OR_RETURN(const std::string out, a.Require("out"));
  AdapterOptions o;
  ASSIGN_OR_RETURN(o.rank, a.GetInt("rank", 8));
  ASSIGN_OR_RETURN(const int64_t alpha, a.GetInt("alpha", 16));
  ASSIGN_OR_RETURN(const int64_t seed, a.GetInt("seed", 1));
  if (o.rank < 1 || o.rank > 4096 || alpha < 1 || seed < 0) {
    return absl::InvalidArgumentError("--rank must be in [1, 4096], --alpha and --seed positive");
  }
  o.alpha = static_cast<double>(alpha);
  o.seed = static_cast<uint64_t>(seed);
  ASSIGN_OR_RETURN(const ModelConfig base, LoadModelConfig(model));
  RETURN_IF_ERROR(WriteRandomAdapter(out, base, o));
  std::cerr << "wrote a rank-" << o.rank << " LoRA adapter of " << model << " to " << out << "\n";
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h" ||
      std::string(argv[1]) == "help") {
    std::fputs(Usage().c_str(), argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  const std::vector<std::string> rest(argv + 2, argv + argc);
  absl::Status s;
  if (cmd == "local") {
    s = RunLocal(rest);
  } else if (cmd == "plan") {
    s = RunPlan(rest);
  } else if (cmd == "fetch") {
    s = RunFetch(rest);
  } else if (cmd == "gen-model") {
    s = GenModel(rest);
  } else if (cmd == "gen-adapter") {
    s = GenAdapter(rest);
  } else if (cmd == "inspect-adapter") {
    s = InspectAdapter(rest);
  } else if (cmd == "generate") {
    s = Generate(rest);
  } else if (cmd == "bench" && !rest.empty() && rest[0] == "allreduce") {
    s = RunAllReduceBench({rest.begin() + 1, rest.end()});
  } else if (cmd == "bench" && !rest.empty() && rest[0] == "informer") {
    s = RunInformerBench({rest.begin() + 1, rest.end()});
  } else if (cmd == "bench" && !rest.empty() && rest[0] == "kernels") {
    s = RunKernelsBench({rest.begin() + 1, rest.end()});
  } else if (cmd == "bench" && !rest.empty() && rest[0] == "tokenize") {
    s = RunTokenizeBench({rest.begin() + 1, rest.end()});
  } else if (cmd == "bench" && !rest.empty() && rest[0] == "disk") {
    s = RunDiskBench({rest.begin() + 1, rest.end()});
  } else if (cmd == "bench" && !rest.empty() && rest[0] == "load") {
    s = RunLoadBench({rest.begin() + 1, rest.end()});
  } else if (cmd == "bench" && !rest.empty() && rest[0] == "lora") {
    s = RunLoraBench({rest.begin() + 1, rest.end()});
  } else if (cmd == "bench" && !rest.empty() && rest[0] == "cuda") {
#ifdef SHARDSERVE_WITH_CUDA
    s = RunCudaBench({rest.begin() + 1, rest.end()});
#else
    s = absl::FailedPreconditionError(
        "this build has no CUDA backend (build with SHARDSERVE_CUDA)");
#endif
  } else if (cmd == "bench" && !rest.empty() && rest[0] == "runtime") {
    s = RunRuntimeBench({rest.begin() + 1, rest.end()});
  } else if (cmd == "bench") {
    s = RunRuntimeBench(rest);
  } else {
    std::fprintf(stderr, "shardserve: unknown command '%s'\n%s", cmd.c_str(), Usage().c_str());
    return 2;
  }
  if (IsHelp(s)) {
    std::fputs(std::string(s.message()).c_str(), stdout);
    return 0;
  }
  if (!s.ok()) {
    std::fprintf(stderr, "shardserve %s: %s\n", cmd.c_str(), std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace shardserve

int main(int argc, char** argv) { return shardserve::Main(argc, argv); }
