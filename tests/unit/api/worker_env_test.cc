// The worker contract (api/worker_env.h): what ToEnv writes, FromEnv reads back unchanged, and
// each malformed variable is refused naming it.
#include "api/worker_env.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>

#include "api/router_env.h"

namespace shardserve {
namespace {

using ::testing::HasSubstr;

EnvLookup From(const std::map<std::string, std::string>& vars) {
  return [vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

template <typename Env>
std::map<std::string, std::string> AsMap(const Env& w) {
  std::map<std::string, std::string> m;
  for (const auto& [k, v] : w.ToEnv()) {
    EXPECT_TRUE(m.emplace(k, v).second) << k << " written twice";
  }
  return m;
}

TEST(WorkerEnvTest, EveryFieldSurvivesTheRoundTrip) {
  WorkerEnv w;
  w.model_path = "/models/llama";
  w.model_name = "llama-3";
  w.deployment = "llama";
  w.replica = 3;
  w.job_id = "llama-3";
  w.stage_layers = "0-11,12-23";
  w.tp = 4;
  w.pp = 2;
  w.stage = 1;
  w.tp_rank = 2;
  w.microbatches = 4;
  w.threads = 8;
  w.backend = "cuda";
  w.kv_cache_tokens = 65536;
  w.kv_cache_dtype = "fp8";
  w.speculative_method = "ngram";
  w.speculative_tokens = 7;
  w.draft_model = "/models/draft";
  w.max_sequence_length = 4096;
  w.leader_addr = "llama-3-0.llama-workers.ml.svc:29500";
  w.host = "llama-3-1.llama-workers.ml.svc";
  w.pod_ip = "10.1.2.3";
  w.rendezvous_secret_file = "/var/run/secret";
  w.peer_timeout_ms = 10000;
  w.startup_timeout_ms = 300000;
  w.load_stall_ms = 60000;
  w.metrics = false;
  w.metrics_port_base = 9500;
  w.termination_log = "/dev/termination-log";
  w.api_host = "127.0.0.1";
  w.api_port = 8080;
  w.max_batch_size = 16;
  w.max_queue = 7;
  w.max_step_tokens = 256;
  w.max_body_bytes = 1 << 16;
  w.drain_seconds = 30;
  w.http_header_timeout_ms = 2000;
  w.http_body_timeout_ms = 9000;
  w.http_max_connections = 64;
  w.api_metrics_auth = false;
  w.special_tokens_as_text = true;
  w.tool_call_parser = "llama3_json";
  w.chat_template = "{{ messages[0].content }}";
  w.reasoning_parser = "think";
  w.trust_request_chat_template = true;
  w.api_key = "sk-0123456789abcdef";
  w.api_keys_file = "/keys";
  w.router_token_file = "/router-token";
  w.request = R"({"prompt_ids":[1,2]})";
  w.result_file = "/tmp/r.json";
  w.report_memory = true;
  w.prefix_caching = false;
  w.prefix_cache_per_key = true;
  w.fp8_blocks = false;
  w.cuda_attention_kernel = "split";
  w.cuda_quant_gemv = "float";
  w.cuda_fp8_gemv = "staged";
  w.cpu_kernels = "avx2";
  w.model_uri = "hf://o/m";
  w.model_files = "*.json";
  w.credentials_dir = "/creds";
  w.fetch_report = "/fetch/report.json";
  w.node_name = "gpu-7";
  w.kv_role = "decode";
  w.kv_offer_ms = 5000;
  w.kv_transfer_timeout_ms = 3000;
  w.max_loras = 8;
  w.max_lora_rank = 16;
  w.max_cpu_loras = 40;
  w.cuda_lora = false;
  w.lora_adapters = R"([{"name":"sql","path":"/adapters/sql"}])";
  w.admin_keys_file = "/admin-keys";
  w.lora_root = "/adapters/dynamic";
  w.flow_control_file = "/flow/flow.yaml";
  w.slo_ttft_ms = 500;
  w.slo_itl_ms = 40;
  w.slo_percentile = 95;
  const auto written = AsMap(w);
  // Every variable of the table differs from its default here, so each is written: a setting
  // added to the table and not to this test fails here.
  EXPECT_EQ(written.size(), WorkerEnv::Names().size());
  for (const std::string& name : WorkerEnv::Names()) EXPECT_TRUE(written.count(name)) << name;
  auto back = WorkerEnv::FromEnv(From(written));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, w);
  EXPECT_EQ(back->rank(), 1 * 4 + 2);
}

TEST(WorkerEnvTest, DefaultsStayUnwrittenButTheReplicasIdentityIsAlwaysThere) {
  WorkerEnv w;
  w.model_path = "/m";
  const auto m = AsMap(w);
  for (const char* name : {"SHARDSERVE_MODEL_PATH", "SHARDSERVE_MODEL_NAME", "SHARDSERVE_REPLICA",
                           "SHARDSERVE_TP", "SHARDSERVE_PP", "SHARDSERVE_STAGE"}) {
    EXPECT_TRUE(m.count(name)) << name;
  }
  EXPECT_EQ(m.size(), 6u);
  auto back = WorkerEnv::FromEnv(From(m));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, w);
  auto empty = WorkerEnv::FromEnv(From({}));
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, WorkerEnv());
}

TEST(WorkerEnvTest, MalformedVariablesAreNamed) {
  auto error = [](std::map<std::string, std::string> vars) {
    auto w = WorkerEnv::FromEnv(From(vars));
    EXPECT_FALSE(w.ok());
    return std::string(w.status().message());
  };
  EXPECT_THAT(error({{"SHARDSERVE_TP", "four"}}),
              HasSubstr("environment variable SHARDSERVE_TP='four' must be an integer in [1, "));
  EXPECT_THAT(error({{"SHARDSERVE_PEER_TIMEOUT_MS", "5"}}),
              HasSubstr("SHARDSERVE_PEER_TIMEOUT_MS='5' must be an integer in [100, "));
  EXPECT_THAT(error({{"SHARDSERVE_API_PORT", "70000"}}),
              HasSubstr("SHARDSERVE_API_PORT='70000' must be an integer in [0, 65535]"));
  EXPECT_THAT(error({{"SHARDSERVE_KV_CACHE_TOKENS", "8"}}),
              HasSubstr("SHARDSERVE_KV_CACHE_TOKENS='8'"));
  EXPECT_THAT(error({{"SHARDSERVE_KV_CACHE_DTYPE", "int4"}}),
              HasSubstr("SHARDSERVE_KV_CACHE_DTYPE='int4' must be auto, f32, bf16, f16 or fp8"));
  EXPECT_THAT(error({{"SHARDSERVE_SPECULATIVE_METHOD", "eagle"}}),
              HasSubstr("SHARDSERVE_SPECULATIVE_METHOD='eagle' must be none, ngram, draft or mtp"));
  EXPECT_THAT(error({{"SHARDSERVE_CPU_KERNELS", "sse4"}}),
              HasSubstr("SHARDSERVE_CPU_KERNELS='sse4' must be auto, avx2, avx512, avx512bf16, "
                        "avx512int8 or portable"));
  EXPECT_THAT(error({{"SHARDSERVE_SPECULATIVE_TOKENS", "17"}}),
              HasSubstr("SHARDSERVE_SPECULATIVE_TOKENS='17'"));
  EXPECT_THAT(
      error({{"SHARDSERVE_SPECULATIVE_METHOD", "mtp"}, {"SHARDSERVE_SPECULATIVE_TOKENS", "2"}}),
      HasSubstr("SHARDSERVE_SPECULATIVE_TOKENS='2': method mtp drafts 1 a step"));
  EXPECT_THAT(error({{"SHARDSERVE_LEADER_ADDR", "leader"}}),
              HasSubstr("SHARDSERVE_LEADER_ADDR='leader' is not HOST:PORT"));
  EXPECT_THAT(error({{"SHARDSERVE_LEADER_ADDR", "leader:0"}}), HasSubstr("is not HOST:PORT"));
  EXPECT_THAT(error({{"SHARDSERVE_METRICS", "maybe"}}),
              HasSubstr("SHARDSERVE_METRICS='maybe' must be on or off"));
  EXPECT_THAT(error({{"SHARDSERVE_API_METRICS_AUTH", "yes"}}),
              HasSubstr("SHARDSERVE_API_METRICS_AUTH='yes' must be true or false"));
  EXPECT_THAT(error({{"SHARDSERVE_MAX_BODY_BYTES", "10"}}),
              HasSubstr("SHARDSERVE_MAX_BODY_BYTES='10' must be an integer in [1024, "));
  EXPECT_THAT(error({{"SHARDSERVE_MAX_BATCH_SIZE", "0"}}),
              HasSubstr("SHARDSERVE_MAX_BATCH_SIZE='0' must be an integer in [1, "));
  EXPECT_THAT(error({{"SHARDSERVE_TOOL_CALL_PARSER", "xlam"}}),
              HasSubstr("SHARDSERVE_TOOL_CALL_PARSER='xlam' must be hermes, llama3_json, mistral, "
                        "pythonic, qwen3_coder, deepseek_v3, deepseek_v31, kimi_k2 or openai"));
  EXPECT_THAT(error({{"SHARDSERVE_REASONING_PARSER", "gpt_oss"}}),
              HasSubstr("SHARDSERVE_REASONING_PARSER='gpt_oss' must be think, harmony or none"));
  EXPECT_THAT(error({{"SHARDSERVE_KV_ROLE", "both"}}),
              HasSubstr("SHARDSERVE_KV_ROLE='both' must be prefill or decode"));
  EXPECT_THAT(error({{"SHARDSERVE_FP8", "fast"}}),
              HasSubstr("environment variable SHARDSERVE_FP8='fast' must be blocks or expand"));
  EXPECT_THAT(error({{"SHARDSERVE_TP", "2"}, {"SHARDSERVE_TP_RANK", "2"}}),
              HasSubstr("SHARDSERVE_STAGE 0 / SHARDSERVE_TP_RANK 2 are outside SHARDSERVE_TP 2"));
  EXPECT_THAT(error({{"SHARDSERVE_PP", "2"}, {"SHARDSERVE_STAGE", "2"}}),
              HasSubstr("SHARDSERVE_STAGE 2"));
}

// The router's contract as one table, as the worker's: every setting differing from its default
// is written, and reads back equal; a bad value is named.
TEST(RouterEnvTest, EveryFieldSurvivesTheRoundTrip) {
  RouterEnv r;
  r.leaders = "dns:m-leaders.ns.svc:8000";
  r.port = 9000;
  r.model_path = "/models/m";
  r.deployment = "m";
  r.api_key = "sk-0123456789abcdef";
  r.api_keys_file = "/keys";
  r.token_file = "/router-token";
  r.special_tokens_as_text = true;
  r.prefix_cache_per_key = true;
  r.chat_template = "{{ messages[0].content }}";
  r.trust_request_chat_template = true;
  r.max_body_bytes = 1 << 16;
  r.prefill_leaders = "dns:m-prefill-leaders.ns.svc:8000";
  r.disaggregate_min_tokens = 256;
  r.model_name = "llama";
  r.flow_control_file = "/flow/flow.yaml";
  r.flow_share = 2;
  r.queue_max = 17;
  r.queue_timeout_ms = 9000;
  r.slo_ttft_ms = 500;
  r.slo_itl_ms = 40;
  r.slo_percentile = 95;
  r.metrics_port = 9400;
  const auto written = AsMap(r);
  EXPECT_EQ(written.size(), RouterEnv::Names().size());
  for (const std::string& name : RouterEnv::Names()) EXPECT_TRUE(written.count(name)) << name;
  auto back = RouterEnv::FromEnv(From(written));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, r);
  auto bad = written;
  bad["SHARDSERVE_PREFIX_CACHE_ISOLATION"] = "perUser";
  EXPECT_THAT(std::string(RouterEnv::FromEnv(From(bad)).status().message()),
              HasSubstr("SHARDSERVE_PREFIX_CACHE_ISOLATION='perUser' must be perKey or none"));
  bad = written;
  bad["SHARDSERVE_ROUTER_PORT"] = "70000";
  EXPECT_FALSE(RouterEnv::FromEnv(From(bad)).ok());
}

}  // namespace
}  // namespace shardserve
