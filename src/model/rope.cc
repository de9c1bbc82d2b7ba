#include "model/rope.h"

#include <cmath>

namespace shardserve {

std::vector<float> RopeInvFreq(const ModelConfig& c) {
  const int64_t half = c.head_dim / 2;
  std::vector<float> inv_freq(half);
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(c.head_dim);
    inv_freq[i] = 1.0f / std::pow(static_cast<float>(c.rope_theta), exponent);
  }
  if (c.rope_scaling == RopeScaling::kLinear) {
    for (float& f : inv_freq) f = f / static_cast<float>(c.rope_factor);
  } else if (c.rope_scaling == RopeScaling::kLlama3) {
    const double factor = c.rope_factor, lo = c.rope_low_freq_factor, hi = c.rope_high_freq_factor;
    const double old_len = static_cast<double>(c.rope_original_max_position);
    const double low_freq_wavelen = old_len / lo, high_freq_wavelen = old_len / hi;
    for (float& f : inv_freq) {
      const double wavelen = 2 * M_PI / f;
      if (wavelen > low_freq_wavelen) {
        f = static_cast<float>(f / factor);
      } else if (wavelen >= high_freq_wavelen) {
        const double smooth = (old_len / wavelen - lo) / (hi - lo);
        f = static_cast<float>((1 - smooth) * f / factor + smooth * f);
      }
    }
  }
  return inv_freq;
}

}  // namespace shardserve
