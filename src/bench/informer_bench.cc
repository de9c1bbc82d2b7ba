#include "bench/informer_bench.h"

#include <malloc.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/args.h"
#include "common/process.h"
#include "common/status.h"
#include "k8s/client.h"
#include "k8s/informer.h"

namespace shardserve {
namespace {

using Clock = std::chrono::steady_clock;
using k8s::json;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Runs fn(i) for i in [0, n) on `threads` threads; the first error wins.
absl::Status Parallel(int64_t n, int threads, const std::function<absl::Status(int64_t)>& fn) {
  std::atomic<int64_t> next{0};
  absl::Mutex mu;
  absl::Status first;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (int64_t i; (i = next++) < n;) {
        absl::Status s = fn(i);
        if (!s.ok()) {
          absl::MutexLock lock(&mu);
          if (first.ok()) first = s;
        }
      }
    });
  }
  for (auto& t : pool) t.join();
  return first;
}

}  // namespace

absl::Status RunInformerBench(const std::vector<std::string>& argv) {
  ASSIGN_OR_RETURN(Args a, Args::Parse(argv, {"kubeconfig", "pods", "namespace", "updates"}, {},
                                       "shardserve bench informer", kInformerBenchUsage));
  ASSIGN_OR_RETURN(std::string path, a.Require("kubeconfig"));
  ASSIGN_OR_RETURN(int64_t pods, a.GetInt("pods", 10000));
  ASSIGN_OR_RETURN(int64_t updates, a.GetInt("updates", 5000));
  const std::string ns = a.GetOr("namespace", "bench");
  ASSIGN_OR_RETURN(k8s::KubeConfig config, k8s::LoadKubeconfig(path));
  k8s::ClientOptions writer_options;
  writer_options.qps = 5000;  // the load generator, not the operator
  writer_options.burst = 5000;
  ASSIGN_OR_RETURN(auto writer, k8s::Client::Create(config, writer_options));
  const k8s::ResourceType namespaces{"", "v1", "namespaces", "Namespace", false};
  auto ns_created = writer->Create(namespaces, "", {{"metadata", {{"name", ns}}}});
  if (!ns_created.ok() && !k8s::ApiAlreadyExists(ns_created.status())) return ns_created.status();

  // Pods shaped like a worker pod (labels, env, resources, probes); no scheduler takes them.
  auto pod = [&](int64_t i) {
    return json{{"metadata",
                 {{"name", absl::StrCat("w-", i / 16, "-", i % 16)},
                  {"labels",
                   {{"shardserve.io/model", absl::StrCat("m", i / 16)},
                    {"shardserve.io/replica", std::to_string(i % 2)},
                    {"shardserve.io/stage", std::to_string(i % 8)},
                    {"shardserve.io/role", i % 8 == 0 ? "leader" : "worker"}}}}},
                {"spec",
                 {{"schedulerName", "none"},
                  {"containers",
                   {{{"name", "worker"},
                     {"image", "ghcr.io/shardserve/worker:1"},
                     {"env",
                      {{{"name", "SHARDSERVE_MODEL_NAME"}, {"value", "llama"}},
                       {{"name", "SHARDSERVE_TP"}, {"value", "8"}},
                       {{"name", "SHARDSERVE_PP"}, {"value", "2"}},
                       {{"name", "SHARDSERVE_LEADER_ADDR"}, {"value", "m-0-0.m-workers:29500"}}}},
                     {"resources", {{"limits", {{"nvidia.com/gpu", "8"}}}}},
                     {"ports", {{{"containerPort", 8000}}, {{"containerPort", 9400}}}}}}}}}};
  };
  auto t0 = Clock::now();
  RETURN_IF_ERROR(Parallel(pods, 16, [&](int64_t i) {
    auto r = writer->Create(k8s::kPods, ns, pod(i));
    return r.ok() || k8s::ApiAlreadyExists(r.status()) ? absl::OkStatus() : r.status();
  }));
  std::printf("created %lld pods in %.1f s (%.0f/s)\n", static_cast<long long>(pods), Since(t0),
              pods / Since(t0));

  ASSIGN_OR_RETURN(auto client, k8s::Client::Create(config));  // the operator's defaults
  malloc_trim(0);
  const size_t rss_before = ResidentBytes();
  std::atomic<int64_t> updates_seen{0};
  k8s::EventHandlers h;
  h.on_update = [&](const json&, const json&) { ++updates_seen; };
  k8s::InformerOptions io;
  io.namespace_ = ns;
  k8s::Informer informer(client.get(), k8s::kPods, io, h);
  t0 = Clock::now();
  informer.Start();
  if (!informer.WaitForSync(std::chrono::minutes(10))) {
    return absl::DeadlineExceededError("the informer did not sync: " + informer.last_error());
  }
  const double sync = Since(t0);
  malloc_trim(0);
  const size_t rss_after = ResidentBytes();
  const size_t cached = informer.store().size();
  std::printf("informer: listed and watching %zu pods in %.2f s; %lld requests\n", cached, sync,
              static_cast<long long>(client->requests()));
  std::printf(
      "memory: %.2f KB per cached pod (RSS %.1f -> %.1f MB; the objects themselves %.2f "
      "KB each in CBOR)\n",
      (static_cast<double>(rss_after) - rss_before) / cached / 1024, rss_before / 1e6,
      rss_after / 1e6, static_cast<double>(informer.store().bytes()) / cached / 1024);

  // Watch throughput: many writers patch labels; the informer handles the events.
  t0 = Clock::now();
  RETURN_IF_ERROR(Parallel(updates, 16, [&](int64_t i) {
    const int64_t p = i % pods;
    return writer
        ->MergePatch(k8s::kPods, ns, absl::StrCat("w-", p / 16, "-", p % 16),
                     {{"metadata", {{"labels", {{"bench", std::to_string(i)}}}}}})
        .status();
  }));
  const double write = Since(t0);
  while (updates_seen.load() < updates && Since(t0) < 120) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const double handled = Since(t0);
  std::printf(
      "watch: %lld updates written in %.2f s (%.0f/s); the informer handled %lld events "
      "in %.2f s (%.0f/s)\n",
      static_cast<long long>(updates), write, updates / write,
      static_cast<long long>(updates_seen.load()), handled, updates_seen.load() / handled);
  informer.Stop();
  return absl::OkStatus();
}

}  // namespace shardserve
