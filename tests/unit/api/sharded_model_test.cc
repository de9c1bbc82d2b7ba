// ShardedModel manifests: a good one parses with its defaults; each bad one is refused with a
// message that names the field.
#include "api/sharded_model.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <tuple>

#include "api/worker_env.h"

namespace shardserve {
namespace {

constexpr char kGood[] = R"(apiVersion: shardserve.io/v1alpha1
kind: ShardedModel
metadata:
  name: llama
spec:
  replicas: 2
  model: {name: llama-3-70b, uri: "pvc://store/llama"}
  parallelism: {tensor: 8, pipeline: 2}
  worker:
    image: img
    env: [{name: A, value: "1"}]
)";

TEST(ShardedModel, ParsesWithDefaults) {
  auto m = ParseShardedModel(kGood);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->name, "llama");
  EXPECT_EQ(m->spec.replicas, 2);
  EXPECT_EQ(m->spec.gpus_per_replica(), 16);
  EXPECT_EQ(m->spec.effective_micro_batches(), 2);
  EXPECT_EQ(m->spec.failure_policy, "RecreateReplica");
  EXPECT_EQ(m->spec.port, 8000);
  EXPECT_EQ(m->spec.env.size(), 1u);
  auto uri = ParseModelUri(m->spec.model_uri);
  ASSERT_TRUE(uri.ok());
  EXPECT_EQ(uri->claim, "store");
  EXPECT_EQ(uri->path, "llama");
  EXPECT_EQ(m->spec.api_key_secret, "");
  std::string keyed = kGood;
  keyed += "  serving: {apiKeySecret: llama-api-keys}\n";
  auto k = ParseShardedModel(keyed);
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_EQ(k->spec.api_key_secret, "llama-api-keys");
  // Special tokens in chat content: control tokens by default, text when asked; in the contract.
  WorkerEnv w;
  ApplyServing(m->spec, w);
  EXPECT_FALSE(w.special_tokens_as_text);
  auto text = ParseShardedModel(std::string(kGood) + "  serving: {specialTokensInContent: text}\n");
  ASSERT_TRUE(text.ok()) << text.status();
  ApplyServing(text->spec, w);
  EXPECT_TRUE(w.special_tokens_as_text);
  EXPECT_EQ(w.max_batch_size, text->spec.max_batch_size);
  // The tool-call format: the chat template's by default (empty in the contract), or named.
  EXPECT_EQ(w.tool_call_parser, "");
  auto tools = ParseShardedModel(std::string(kGood) + "  serving: {toolCallParser: hermes}\n");
  ASSERT_TRUE(tools.ok()) << tools.status();
  ApplyServing(tools->spec, w);
  EXPECT_EQ(w.tool_call_parser, "hermes");
  // Prefix caching: on by default, off when the manifest says so.
  EXPECT_TRUE(w.prefix_caching);
  auto uncached = ParseShardedModel(std::string(kGood) + "  serving: {prefixCaching: false}\n");
  ASSERT_TRUE(uncached.ok()) << uncached.status();
  ApplyServing(uncached->spec, w);
  EXPECT_FALSE(w.prefix_caching);
  // Prefix cache isolation: none by default; perKey in the contract when the manifest says so.
  EXPECT_FALSE(w.prefix_cache_per_key);
  auto per_key =
      ParseShardedModel(std::string(kGood) + "  serving: {prefixCacheIsolation: perKey}\n");
  ASSERT_TRUE(per_key.ok()) << per_key.status();
  ApplyServing(per_key->spec, w);
  EXPECT_TRUE(w.prefix_cache_per_key);
  // The KV cache's dtype: auto by default, the manifest's in the contract.
  EXPECT_EQ(w.kv_cache_dtype, "auto");
  auto fp8 = ParseShardedModel(std::string(kGood) + "  serving: {kvCacheDtype: fp8}\n");
  ASSERT_TRUE(fp8.ok()) << fp8.status();
  ApplyServing(fp8->spec, w);
  EXPECT_EQ(w.kv_cache_dtype, "fp8");
  // Speculative decoding: none by default, the manifest's method and tokens in the contract.
  EXPECT_EQ(w.speculative_method, "none");
  auto ngram = ParseShardedModel(std::string(kGood) +
                                 "  serving: {speculative: {method: ngram, tokens: 6}}\n");
  ASSERT_TRUE(ngram.ok()) << ngram.status();
  ApplyServing(ngram->spec, w);
  EXPECT_EQ(w.speculative_method, "ngram");
  EXPECT_EQ(w.speculative_tokens, 6);
  auto draft = ParseShardedModel(
      std::string(kGood) +
      "  serving: {speculative: {method: draft, draftModel: 'hf://org/small@abc'}}\n");
  ASSERT_TRUE(draft.ok()) << draft.status();
  EXPECT_EQ(draft->spec.draft_model, "hf://org/small@abc");
  EXPECT_EQ(draft->spec.speculative_tokens, 4);  // not given: 4
  // mtp drafts one token a step: its tokens are 1 unless given (another number is refused).
  for (const char* given : {"{method: mtp}", "{method: mtp, tokens: 1}"}) {
    auto mtp = ParseShardedModel(std::string(kGood) + "  serving: {speculative: " + given + "}\n");
    ASSERT_TRUE(mtp.ok()) << mtp.status();
    ApplyServing(mtp->spec, w);
    EXPECT_EQ(std::tuple(w.speculative_method, w.speculative_tokens), std::tuple("mtp", 1));
  }
  // Start-up bounds: 30 min at the rendezvous and 5 min of loading without progress by default;
  // the manifest's, in the contract.
  ApplyServing(m->spec, w);
  EXPECT_EQ(w.startup_timeout_ms, 1800 * 1000);
  EXPECT_EQ(w.load_stall_ms, 300 * 1000);
  auto patient = ParseShardedModel(std::string(kGood) +
                                   "  startup: {timeoutSeconds: 7200, loadStallSeconds: 60}\n");
  ASSERT_TRUE(patient.ok()) << patient.status();
  ApplyServing(patient->spec, w);
  EXPECT_EQ(w.startup_timeout_ms, 7200 * 1000);
  EXPECT_EQ(w.load_stall_ms, 60 * 1000);
  // The KV cache holds a full batch of full-length sequences: what the memory plan counts.
  EXPECT_EQ(w.kv_cache_tokens, 32 * 4096);
}

TEST(ShardedModel, ParallelismAutoAndGpuMemory) {
  auto m = ParseShardedModel(std::string(kGood) + "    gpuMemory: 80Gi\n");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->spec.gpu_memory, int64_t{80} << 30);
  EXPECT_FALSE(m->spec.tensor_auto || m->spec.pipeline_auto);
  std::string text = kGood;
  text.replace(text.find("{tensor: 8, pipeline: 2}"), 24, "{tensor: auto, pipeline: auto}");
  auto a = ParseShardedModel(text);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->spec.tensor_auto && a->spec.pipeline_auto);
  EXPECT_EQ(a->spec.gpus_per_replica(), 1) << "1 x 1 until a plan chooses";
  // As the apiserver returns it (JSON: a number or the string).
  auto j = ParseShardedModelObject(nlohmann::json::parse(R"({"apiVersion": "shardserve.io/v1alpha1",
      "kind": "ShardedModel", "metadata": {"name": "m"}, "spec": {"model": {"name": "m",
      "uri": "pvc://c/m"}, "parallelism": {"tensor": "auto", "pipeline": 2},
      "worker": {"image": "w", "gpuMemory": "81559Mi"}}})"));
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_TRUE(j->spec.tensor_auto);
  EXPECT_FALSE(j->spec.pipeline_auto);
  EXPECT_EQ(j->spec.pipeline, 2);
  EXPECT_EQ(j->spec.gpu_memory, int64_t{81559} << 20);
}

TEST(ShardedModel, ByteQuantities) {
  EXPECT_EQ(*ParseByteQuantity("141G", "f"), 141000000000);
  EXPECT_EQ(*ParseByteQuantity("1024", "f"), 1024);
  EXPECT_EQ(*ParseByteQuantity("2Ti", "f"), int64_t{2} << 40);
  for (const char* bad : {"", "80GB", "-1Gi", "0", "1.5Gi", "999999999999999Ti", "Gi"}) {
    auto q = ParseByteQuantity(bad, "spec.worker.gpuMemory");
    ASSERT_FALSE(q.ok()) << bad;
    EXPECT_NE(q.status().message().find("spec.worker.gpuMemory"), std::string::npos);
  }
}

TEST(ShardedModel, DisaggregationGivesThePrefillRoleItsShape) {
  auto none = ParseShardedModel(kGood);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->spec.disaggregation.has_value());
  auto m = ParseShardedModel(std::string(kGood).replace(
      std::string(kGood).find("  worker:"), 0,
      "  disaggregation:\n    prefill: {replicas: 3, parallelism: {tensor: 4}}\n"
      "    minPromptTokens: 512\n"));
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(m->spec.disaggregation.has_value());
  const auto& d = *m->spec.disaggregation;
  EXPECT_EQ(
      std::tuple(d.prefill_replicas, d.prefill_tensor, d.prefill_pipeline, d.min_prompt_tokens),
      std::tuple(3, 4, 1, 512));
  EXPECT_EQ(std::tuple(m->spec.replicas, m->spec.tensor, m->spec.pipeline), std::tuple(2, 8, 2))
      << "the decode role keeps spec.replicas and spec.parallelism";
  EXPECT_FALSE(d.prefill_node_selector.has_value());
  // The prefill role as a spec of its own (the operator's NAME-prefill, `shardserve plan`).
  const ShardedModelSpec p = PrefillSpec(m->spec);
  EXPECT_EQ(std::tuple(p.replicas, p.tensor, p.pipeline), std::tuple(3, 4, 1));
  EXPECT_FALSE(p.disaggregation.has_value());
  EXPECT_EQ(p.node_selector, m->spec.node_selector);
  EXPECT_EQ(p.model_uri, m->spec.model_uri);

  auto placed = ParseShardedModel(std::string(kGood).replace(
      std::string(kGood).find("  worker:"), 0,
      "  disaggregation:\n    prefill: {nodeSelector: {pool: cpu}, rollout: {maxSurge: 1, "
      "maxUnavailable: 0}}\n"));
  ASSERT_TRUE(placed.ok()) << placed.status();
  const ShardedModelSpec q = PrefillSpec(placed->spec);
  EXPECT_EQ(q.node_selector, (std::map<std::string, std::string>{{"pool", "cpu"}}));
  EXPECT_EQ(std::tuple(q.max_unavailable, q.max_surge), std::tuple(0, 1));
  EXPECT_EQ(PrefillModelName("llama"), "llama-prefill");
}

TEST(ShardedModel, AdaptersAndTheirBoundsReachTheWorkers) {
  auto none = ParseShardedModel(kGood);
  ASSERT_TRUE(none.ok()) << none.status();
  WorkerEnv off;
  ApplyServing(none->spec, off);
  EXPECT_EQ(off.max_loras, 0) << "LoRA is off unless asked for";
  auto m = ParseShardedModel(
      std::string(kGood).replace(std::string(kGood).find("  worker:"), 0,
                                 "  adapters:\n    - {name: sql, uri: \"pvc://loras/sql\"}\n"
                                 "    - {name: team/chat, uri: \"hostpath:///data/chat\"}\n"
                                 "  lora: {maxLoras: 6, maxLoraRank: 32}\n"));
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->spec.adapters.size(), 2u);
  EXPECT_EQ(std::tuple(m->spec.adapters[1].name, m->spec.adapters[1].uri),
            std::tuple("team/chat", "hostpath:///data/chat"));
  WorkerEnv w;
  ApplyServing(m->spec, w);
  EXPECT_EQ(std::tuple(w.max_loras, w.max_lora_rank, w.max_cpu_loras), std::tuple(6, 32, 24));
  auto bounds = ParseShardedModel(
      std::string(kGood).replace(std::string(kGood).find("  worker:"), 0, "  lora: {}\n"));
  ASSERT_TRUE(bounds.ok()) << bounds.status();
  WorkerEnv d;
  ApplyServing(bounds->spec, d);
  EXPECT_EQ(std::tuple(d.max_loras, d.max_lora_rank, d.max_cpu_loras), std::tuple(4, 64, 16))
      << "the defaults";
  auto kept = ParseShardedModel(std::string(kGood).replace(
      std::string(kGood).find("  worker:"), 0, "  lora: {maxLoras: 2, maxCpuLoras: 40}\n"));
  ASSERT_TRUE(kept.ok()) << kept.status();
  WorkerEnv k;
  ApplyServing(kept->spec, k);
  EXPECT_EQ(k.max_cpu_loras, 40);
  const std::pair<std::string, std::string> bad[] = {
      {"  adapters:\n    - {name: llama-3-70b, uri: \"pvc://l/a\"}\n", "the model's own name"},
      {"  adapters:\n    - {name: a, uri: \"pvc://l/a\"}\n    - {name: a, uri: \"pvc://l/b\"}\n",
       "spec.adapters[1].name 'a'"},
      {"  adapters:\n    - {name: \"a b\", uri: \"pvc://l/a\"}\n", "spec.adapters[0].name"},
      {"  adapters:\n    - {name: a, uri: \"s3://b/a\"}\n",
       "spec.adapters[0].uri 's3://b/a' names"},
      {"  adapters:\n    - {name: a, uri: \"pvc://l/a\", rank: 8}\n", "spec.adapters[0].rank"},
      {"  adapters:\n    - {name: a, uri: \"pvc://l/a\"}\n    - {name: b, uri: \"pvc://l/b\"}\n"
       "  lora: {maxLoras: 1}\n",
       "spec.adapters lists 2 adapters; spec.lora.maxLoras holds 1"},
      {"  lora: {maxLoraRank: 0}\n", "spec.lora.maxLoraRank 0"},
      {"  lora: {maxLoras: 8, maxCpuLoras: 4}\n",
       "spec.lora.maxCpuLoras 4 must be in [maxLoras (8)"},
      {"  lora: {maxLoras: 4, dora: true}\n", "spec.lora.dora"},
      {"  lora: {adminKeySecret: admins}\n", "spec.lora.source must say"},
      {"  lora: {adminKeySecret: admins, source: \"s3://bucket/loras\"}\n",
       "spec.lora.source 's3://bucket/loras' must be"},
      {"  lora: {adminKeySecret: Admins_1, source: \"pvc://l/d\"}\n",
       "spec.lora.adminKeySecret 'Admins_1' is not a Secret's name"},
  };
  for (const auto& [yaml, words] : bad) {
    auto r = ParseShardedModel(
        std::string(kGood).replace(std::string(kGood).find("  worker:"), 0, yaml));
    ASSERT_FALSE(r.ok()) << yaml;
    EXPECT_NE(r.status().message().find(words), std::string::npos) << r.status();
  }
}

TEST(ShardedModel, BadManifestsNameTheField) {
  const std::string base = kGood;
  auto with = [&](const std::string& from, const std::string& to) {
    std::string s = base;
    s.replace(s.find(from), from.size(), to);
    return s;
  };
  const std::pair<std::string, std::string> cases[] = {
      {with("tensor: 8", "tensor: 0"), "spec.parallelism.tensor"},
      {with("pipeline: 2", "pipeline: two"),
       "spec.parallelism.pipeline must be an integer or auto, got 'two'"},
      {with("    image: img", "    image: img\n    gpuMemory: 80GB"),
       "spec.worker.gpuMemory '80GB' is not a memory quantity"},
      {with("replicas: 2", "replicas: -1"), "spec.replicas"},
      {with("uri: \"pvc://store/llama\"", "uri: \"s3://b/k\""), "spec.model.uri"},
      {with("uri: \"pvc://store/llama\"", "uri: \"file://rel\""), "spec.model.uri"},
      {with("name: llama-3-70b, ", ""), "spec.model.name"},
      {with("name: llama\n", "name: Llama_Big\n"), "metadata.name"},
      {with("parallelism:", "paralelism:"), "spec.paralelism"},
      {with("  worker:", "  disaggregation: {prefill: {replicas: -1}}\n  worker:"),
       "spec.disaggregation.prefill.replicas"},
      {with("  worker:", "  disaggregation: {prefill: {parallelism: {tensor: auto}}}\n  worker:"),
       "spec.disaggregation.prefill.parallelism.tensor must be an integer"},
      {with("  worker:",
            "  disaggregation: {prefill: {rollout: {maxUnavailable: 0, maxSurge: 0}}}\n  worker:"),
       "spec.disaggregation.prefill.rollout.maxUnavailable and maxSurge cannot both be 0"},
      {with("  worker:", "  disaggregation: {prefill: {}}\n  prefillOf: x\n  worker:"),
       "spec.prefillOf and spec.disaggregation cannot be set together"},
      {with("  worker:", "  prefillOf: Not_A_Name\n  worker:"),
       "spec.prefillOf 'Not_A_Name' is not a disaggregated model's name"},
      {with("  worker:", "  disaggregation: {prefill: {}, decode: {}}\n  worker:"),
       "spec.disaggregation.decode is not a field of spec.disaggregation"},
      {with("  worker:", "  disaggregation: {minPromptTokens: -5}\n  worker:"),
       "spec.disaggregation.minPromptTokens"},
      {with("  replicas: 2", "  replicas: 2\n  failurePolicy: Sometimes"), "spec.failurePolicy"},
      {with("  replicas: 2", "  replicas: 2\n  rollout: {maxUnavailable: 0, maxSurge: 0}"),
       "spec.rollout.maxUnavailable"},
      {with("  replicas: 2", "  replicas: 2\n  serving: {port: 70000}"), "spec.serving.port"},
      {with("  replicas: 2", "  replicas: 2\n  serving: {maxBatchSize: 0}"),
       "spec.serving.maxBatchSize"},
      {with("env: [{name: A, value: \"1\"}]", "env: [{value: \"1\"}]"), "spec.worker.env[0].name"},
      {with("  replicas: 2", "  replicas: 2\n  serving: {apiKeySecret: Keys_1}"),
       "spec.serving.apiKeySecret"},
      {with("  replicas: 2", "  replicas: 2\n  serving: {specialTokensInContent: plain}"),
       "spec.serving.specialTokensInContent"},
      {with("  replicas: 2", "  replicas: 2\n  serving: {toolCallParser: harmony}"),
       "spec.serving.toolCallParser"},
      {with("  replicas: 2",
            "  replicas: 2\n  serving: {chatTemplate: {inline: x, configMap: {name: t, key: k}}}"),
       "spec.serving.chatTemplate takes inline or configMap, not both"},
      {with("  replicas: 2", "  replicas: 2\n  serving: {chatTemplate: {configMap: {name: t}}}"),
       "spec.serving.chatTemplate.configMap needs its name and the key"},
      {with("  replicas: 2", "  replicas: 2\n  serving: {chatTemplate: {file: t}}"),
       "spec.serving.chatTemplate"},
      {with("  replicas: 2", "  replicas: 2\n  serving: {reasoningParser: gpt_oss}"),
       "spec.serving.reasoningParser 'gpt_oss' must be auto, none, deepseek_r1, qwen3 (<think> "
       "blocks) or openai_gptoss (harmony)"},
      {with("  replicas: 2", "  replicas: 2\n  serving: {trustRequestChatTemplate: maybe}"),
       "spec.serving.trustRequestChatTemplate"},
      {with("  replicas: 2", "  replicas: 2\n  serving: {prefixCacheIsolation: perUser}"),
       "spec.serving.prefixCacheIsolation"},
      {with("  replicas: 2", "  replicas: 2\n  serving: {kvCacheDtype: int8}"),
       "spec.serving.kvCacheDtype 'int8' must be auto, f32, bf16, f16 or fp8"},
      {with("  replicas: 2", "  replicas: 2\n  serving: {speculative: {method: eagle3}}"),
       "spec.serving.speculative.method 'eagle3' must be none, ngram, draft or mtp"},
      {with("  replicas: 2", "  replicas: 2\n  serving: {speculative: {method: draft}}"),
       "spec.serving.speculative.method draft needs spec.serving.speculative.draftModel"},
      {with("  replicas: 2",
            "  replicas: 2\n  serving: {speculative: {method: draft, draftModel: ftp://x}}"),
       "spec.serving.speculative.draftModel 'ftp://x'"},
      {with("  replicas: 2", "  replicas: 2\n  serving: {speculative: {method: mtp, tokens: 3}}"),
       "spec.serving.speculative.tokens is 3; method mtp drafts 1 a step"},
      {with("  replicas: 2", "  replicas: 2\n  serving: {speculative: {tokens: 0}}"),
       "spec.serving.speculative.tokens must be between 1 and 16, got 0"},
      {with("  replicas: 2", "  replicas: 2\n  serving: {speculative: {draftModel: file:///d}}"),
       "spec.serving.speculative.draftModel is the draft method's; the method is none"},
      {with("  replicas: 2", "  replicas: 2\n  serving: {prefixCaching: maybe}"),
       "spec.serving.prefixCaching must be true or false, got"},
      {with("  replicas: 2", "  replicas: 2\n  startup: {timeoutSeconds: 0}"),
       "spec.startup.timeoutSeconds must be between 1 and 86400, got 0"},
      {with("  replicas: 2", "  replicas: 2\n  startup: {loadStallSeconds: 100000}"),
       "spec.startup.loadStallSeconds"},
      {with("  replicas: 2", "  replicas: 2\n  startup: {timeout: 5}"), "spec.startup.timeout"},
      {with("kind: ShardedModel", "kind: Deployment"), "kind"},
      {"spec: [", "not valid YAML"},
  };
  for (const auto& [text, field] : cases) {
    auto m = ParseShardedModel(text);
    ASSERT_FALSE(m.ok()) << text;
    EXPECT_NE(m.status().message().find(field), std::string::npos)
        << "wanted '" << field << "' in: " << m.status().message();
  }
}

}  // namespace
}  // namespace shardserve
