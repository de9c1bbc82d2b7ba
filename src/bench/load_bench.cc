#include "bench/load_bench.h"

#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/args.h"
#include "common/status.h"

namespace shardserve {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

struct Sample {
  double ttft = 0;
  std::vector<double> itl;
  int64_t tokens = 0;
  int64_t prompt_tokens = 0, cached_tokens = 0;  // the answer's usage
  bool ok = false;
  std::string error;
};

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

std::pair<std::string, int> HostPort(const std::string& s) {
  const size_t colon = s.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(s.substr(colon + 1), &port)) return {"", 0};
  return {s.substr(0, colon), port};
}

// One streamed completion; every event carries one token's logprob, so tokens are counted
// exactly even when their text is held back.
Sample StreamOnce(const std::string& host, int port, const std::string& api_key, const json& body) {
  Sample s;
  httplib::Client client(host, port);
  client.set_read_timeout(600, 0);
  const auto t0 = Clock::now();
  auto last = t0;
  std::string buffer;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  if (!api_key.empty()) req.set_header("Authorization", "Bearer " + api_key);
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    buffer.append(data, n);
    size_t end;
    while ((end = buffer.find("\n\n")) != std::string::npos) {
      const std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0 || event == "data: [DONE]") continue;
      const json j = json::parse(event.substr(6), nullptr, false);
      if (j.is_discarded() || j.contains("error")) {
        s.error = event;
        return false;
      }
      if (j.contains("usage") && j["usage"].is_object()) {  // stream_options.include_usage
        s.prompt_tokens = j["usage"].value("prompt_tokens", 0);
        if (auto d = j["usage"].find("prompt_tokens_details"); d != j["usage"].end()) {
          s.cached_tokens = d->value("cached_tokens", 0);
        }
      }
      if (j["choices"].empty() || !j["choices"][0]["logprobs"].is_object()) continue;
      const auto now = Clock::now();
      const int64_t k = j["choices"][0]["logprobs"]["tokens"].size();
      if (k == 0) continue;
      if (s.tokens == 0) {
        s.ttft = Seconds(now - t0);
      } else {
        s.itl.push_back(Seconds(now - last));
      }
      for (int64_t i = 1; i < k; ++i) s.itl.push_back(0);
      s.tokens += k;
      last = now;
    }
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  const bool sent = client.send(req, res, err);
  s.ok = sent && res.status == 200 && s.error.empty();
  if (!sent && s.error.empty()) s.error = httplib::to_string(err);
  return s;
}

// Sum and count of shardserve_rank_forward_seconds on a rank's page.
std::pair<double, double> ForwardTotals(const std::string& host, int port) {
  if (port == 0) return {0, 0};
  httplib::Client client(host, port);
  auto res = client.Get("/metrics");
  double sum = 0, count = 0;
  if (!res) return {0, 0};
  std::istringstream in(res->body);
  std::string line;
  while (std::getline(in, line)) {
    double v;
    const size_t sp = line.rfind(' ');
    if (sp == std::string::npos || !absl::SimpleAtod(line.substr(sp + 1), &v)) continue;
    if (line.rfind("shardserve_rank_forward_seconds_sum{", 0) == 0) sum += v;
    if (line.rfind("shardserve_rank_forward_seconds_count{", 0) == 0) count += v;
  }
  return {sum, count};
}

}  // namespace

absl::Status RunLoadBench(const std::vector<std::string>& argv) {
  ASSIGN_OR_RETURN(Args a, Args::Parse(argv,
                                       {"url", "model", "concurrency", "requests-per-client",
                                        "max-tokens", "prompt-tokens", "vocab", "rank-metrics",
                                        "api-key", "shared-prefix-tokens", "turns"},
                                       {}, "shardserve bench load", kLoadBenchUsage));
  // Named copies, not structured bindings: the client threads below capture them.
  std::vector<std::pair<std::string, int>> urls;
  for (absl::string_view u : absl::StrSplit(a.GetOr("url", "127.0.0.1:8000"), ',')) {
    urls.push_back(HostPort(std::string(u)));
    if (urls.back().second == 0) {
      return absl::InvalidArgumentError("--url must be HOST:PORT[,HOST:PORT...]");
    }
  }
  const std::string host = urls[0].first;
  const int port = urls[0].second;
  ASSIGN_OR_RETURN(int64_t turns, a.GetInt("turns", 1));
  if (turns < 1) return absl::InvalidArgumentError("--turns must be at least 1");
  const auto [mhost, mport] = HostPort(a.GetOr("rank-metrics", ""));
  const std::string model = a.GetOr("model", "model");
  const std::string api_key = a.GetOr("api-key", "");
  ASSIGN_OR_RETURN(int64_t per_client, a.GetInt("requests-per-client", 2));
  ASSIGN_OR_RETURN(int64_t max_tokens, a.GetInt("max-tokens", 64));
  ASSIGN_OR_RETURN(int64_t prompt_tokens, a.GetInt("prompt-tokens", 64));
  ASSIGN_OR_RETURN(int64_t vocab, a.GetInt("vocab", 32000));
  // A start every prompt shares (a long system prompt): what prefix caching reuses.
  ASSIGN_OR_RETURN(int64_t shared, a.GetInt("shared-prefix-tokens", 0));
  std::vector<int32_t> prefix(std::max<int64_t>(0, shared));
  {
    std::mt19937 rng(7);
    for (auto& t : prefix) t = static_cast<int32_t>(3 + rng() % (vocab - 3));
  }
  std::vector<int> levels;
  for (absl::string_view c : absl::StrSplit(a.GetOr("concurrency", "1,4,16"), ',')) {
    int v;
    if (!absl::SimpleAtoi(c, &v) || v < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--concurrency: '", c, "' is not a count"));
    }
    levels.push_back(v);
  }
  std::printf(
      "load: %s model '%s', prompts of %lld shared and %lld random tokens, %lld greedy output "
      "tokens, %lld %s per client\n",
      a.GetOr("url", "127.0.0.1:8000").c_str(), model.c_str(),
      static_cast<long long>(prefix.size()), static_cast<long long>(prompt_tokens),
      static_cast<long long>(max_tokens), static_cast<long long>(per_client),
      turns > 1 ? absl::StrCat("conversations of ", turns, " turns").c_str() : "requests");
  if (mport != 0) {
    // Overhead probe: one client, a one-token prompt, so every step is a one-token decode step;
    // what the client waits beyond the leader rank's forward pass is HTTP, scheduling and
    // sampling.
    const json body = {{"model", model},   {"prompt", {3}},      {"max_tokens", 48},
                       {"temperature", 0}, {"ignore_eos", true}, {"stream", true},
                       {"logprobs", 0}};
    (void)StreamOnce(host, port, api_key, body);  // warm-up
    const auto before = ForwardTotals(mhost, mport);
    Sample s = StreamOnce(host, port, api_key, body);
    const auto after = ForwardTotals(mhost, mport);
    if (!s.ok) return absl::UnavailableError(absl::StrCat("probe failed: ", s.error));
    double itl = 0;
    for (double v : s.itl) itl += v;
    itl /= std::max<size_t>(1, s.itl.size());
    const double step = (after.first - before.first) / std::max(1.0, after.second - before.second);
    std::printf(
        "overhead probe (batch 1 decode): inter-token %.2f ms, leader forward %.2f ms, "
        "HTTP + scheduling + sampling %.2f ms = %.1f%% of the step\n",
        1e3 * itl, 1e3 * step, 1e3 * (itl - step), 100 * (itl - step) / itl);
  }
  std::printf("%-11s %10s %9s %9s %9s %9s %9s %9s\n", "concurrency", "out tok/s", "ttft p50",
              "ttft p99", "itl p50", "itl p99", "hit rate", "own hit");
  double base_tps = 0;
  for (int c : levels) {
    absl::Mutex mu;
    std::vector<Sample> samples;
    const auto t0 = Clock::now();
    std::vector<std::thread> clients;
    for (int i = 0; i < c; ++i) {
      clients.emplace_back([&, i] {
        std::mt19937 rng(1000 * c + i);
        auto random_tokens = [&](std::vector<int32_t>& to, int64_t n) {
          for (int64_t k = 0; k < n; ++k)
            to.push_back(static_cast<int32_t>(3 + rng() % (vocab - 3)));
        };
        for (int64_t r = 0; r < per_client; ++r) {
          std::vector<int32_t> history;  // the conversation's earlier turns
          for (int64_t turn = 0; turn < turns; ++turn) {
            std::vector<int32_t> prompt(prefix);
            prompt.insert(prompt.end(), history.begin(), history.end());
            const size_t own = prompt.size();
            random_tokens(prompt, prompt_tokens);
            const json body = {{"model", model},
                               {"prompt", prompt},
                               {"max_tokens", max_tokens},
                               {"temperature", 0},
                               {"ignore_eos", true},
                               {"stream", true},
                               {"stream_options", {{"include_usage", true}}},
                               {"logprobs", 0}};
            const auto& [h, p] = urls.size() == 1 ? urls[0] : urls[rng() % urls.size()];
            Sample s = StreamOnce(h, p, api_key, body);
            {
              absl::MutexLock lock(&mu);
              samples.push_back(std::move(s));
            }
            // The next turn resends this one: its new tokens and the answer (as many tokens).
            history.insert(history.end(), prompt.begin() + own, prompt.end());
            random_tokens(history, max_tokens);
          }
        }
      });
    }
    for (auto& t : clients) t.join();
    const double wall = Seconds(Clock::now() - t0);
    std::vector<double> ttft, itl;
    int64_t tokens = 0, failed = 0, prompted = 0, cached = 0, own = 0, own_cached = 0;
    for (const Sample& s : samples) {
      if (!s.ok) {
        ++failed;
        std::fprintf(stderr, "request failed: %s\n", s.error.c_str());
        continue;
      }
      ttft.push_back(s.ttft);
      itl.insert(itl.end(), s.itl.begin(), s.itl.end());
      tokens += s.tokens;
      prompted += s.prompt_tokens;
      cached += s.cached_tokens;
      // Past the shared start: the conversation's own tokens, and those found cached.
      own += std::max<int64_t>(0, s.prompt_tokens - static_cast<int64_t>(prefix.size()));
      own_cached += std::max<int64_t>(0, s.cached_tokens - static_cast<int64_t>(prefix.size()));
    }
    if (failed > 0) return absl::UnavailableError(absl::StrCat(failed, " requests failed"));
    const double tps = tokens / wall;
    if (base_tps == 0) base_tps = tps;
    std::printf("%-11d %10.1f %8.3fs %8.3fs %8.4fs %8.4fs %8.1f%% %8.1f%%   (x%.2f of c=%d)\n", c,
                tps, Percentile(ttft, 0.5), Percentile(ttft, 0.99), Percentile(itl, 0.5),
                Percentile(itl, 0.99), prompted > 0 ? 100.0 * cached / prompted : 0.0,
                own > 0 ? 100.0 * own_cached / own : 0.0, tps / base_tps, levels.front());
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

}  // namespace shardserve
