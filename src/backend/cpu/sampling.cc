// Token choice on host logits: the reference every backend's VocabSummaries and SampleRows match.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backend/cpu/kernels.h"

namespace shardserve::cpu {
namespace {

// Logit order: larger first, ties to the lower id.
bool Better(float la, int64_t ia, float lb, int64_t ib) { return la > lb || (la == lb && ia < ib); }

// The ids of the k best of n logits, best first.
std::vector<int32_t> TopIds(const float* logits, int64_t n, int64_t k) {
  std::vector<int32_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                    [&](int32_t a, int32_t b) { return Better(logits[a], a, logits[b], b); });
  ids.resize(k);
  return ids;
}

}  // namespace

void VocabSummary(const float* row, int64_t n, int64_t vocab_begin, int64_t K, float* out) {
  std::fill_n(out, 2 + 2 * K, -INFINITY);
  if (n == 0) return;
  const float mx = *std::max_element(row, row + n);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(row[i] - mx));
  out[0] = mx;
  out[1] = static_cast<float>(sum);
  const std::vector<int32_t> best = TopIds(row, n, std::min(K, n));
  for (size_t j = 0; j < best.size(); ++j) {
    out[2 + 2 * j] = row[best[j]];
    out[3 + 2 * j] = static_cast<float>(vocab_begin + best[j]);  // ids < 2^24 are exact
  }
}

void SampleRow(const float* logits, int64_t V, const SampleSpec& spec, int64_t K, int32_t* id,
               float* logprob, int32_t* top_ids, float* top_logprobs) {
  // Log-softmax of the raw logits (the model's distribution, independent of temperature).
  const float mx = *std::max_element(logits, logits + V);
  double sum = 0;
  for (int64_t i = 0; i < V; ++i) sum += std::exp(static_cast<double>(logits[i] - mx));
  const float log_z = mx + static_cast<float>(std::log(sum));

  int32_t chosen;
  if (spec.temperature == 0.0f) {
    chosen = static_cast<int32_t>(std::max_element(logits, logits + V) - logits);
  } else {
    const Distribution d = DistributionOf(logits, V, spec);
    const double u = spec.u * d.total;
    double cum = 0;
    chosen = d.ids.back();
    for (size_t i = 0; i < d.ids.size(); ++i) {
      cum += d.weights[i];
      if (u < cum) {
        chosen = d.ids[i];
        break;
      }
    }
  }
  *id = chosen;
  *logprob = logits[chosen] - log_z;
  if (K <= 0) return;
  const std::vector<int32_t> best = TopIds(logits, V, std::min(K, V));
  for (size_t j = 0; j < best.size(); ++j) {
    top_ids[j] = best[j];
    top_logprobs[j] = logits[best[j]] - log_z;
  }
}

Distribution DistributionOf(const float* logits, int64_t V, const SampleSpec& spec) {
  Distribution d;
  int64_t keep = spec.top_k > 0 && spec.top_k < V ? spec.top_k : V;
  d.ids = TopIds(logits, V, keep);
  const double inv_t = 1.0 / spec.temperature;
  d.weights.resize(keep);
  for (int64_t i = 0; i < keep; ++i) {
    d.weights[i] = std::exp((static_cast<double>(logits[d.ids[i]]) - logits[d.ids[0]]) * inv_t);
    d.total += d.weights[i];
  }
  if (spec.top_p < 1.0f) {
    double cum = 0;
    int64_t n = 0;
    while (n < keep) {
      cum += d.weights[n] / d.total;
      ++n;
      if (cum >= spec.top_p) break;
    }
    d.ids.resize(n);
    d.weights.resize(n);
    d.total = std::accumulate(d.weights.begin(), d.weights.end(), 0.0);
  }
  return d;
}

}  // namespace shardserve::cpu
