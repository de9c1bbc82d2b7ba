#include "model/rope.h"

#include <algorithm>
#include <cmath>

namespace shardserve {

std::vector<float> RopeInvFreq(const ModelConfig& c) {
  const int64_t half = c.head_dim / 2;
  std::vector<float> inv_freq(half);
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(c.head_dim);
    inv_freq[i] = 1.0f / std::pow(static_cast<float>(c.rope_theta), exponent);
  }
  if (c.rope_scaling == RopeScaling::kYarn) {
    // transformers' _compute_yarn_parameters: interpolated (divided by the factor) below the
    // beta_slow rotations' dimension, extrapolated (as they are) above beta_fast's, a linear ramp
    // between; in float32 where the reference is.
    const double dim = static_cast<double>(c.head_dim), base = c.rope_theta;
    const double orig = static_cast<double>(c.rope_original_max_position);
    auto correction_dim = [&](double rotations) {
      return dim * std::log(orig / (rotations * 2 * M_PI)) / (2 * std::log(base));
    };
    double low = correction_dim(c.rope_beta_fast), high = correction_dim(c.rope_beta_slow);
    if (c.rope_truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, dim - 1);
    if (low == high) high += 0.001;
    const float factor = static_cast<float>(c.rope_factor);
    for (int64_t i = 0; i < half; ++i) {
      const float pos_freq = std::pow(static_cast<float>(c.rope_theta),
                                      static_cast<float>(2 * i) / static_cast<float>(c.head_dim));
      const float extrapolation = 1.0f / pos_freq, interpolation = 1.0f / (factor * pos_freq);
      const float ramp = std::clamp(
          (static_cast<float>(i) - static_cast<float>(low)) / static_cast<float>(high - low), 0.0f,
          1.0f);
      const float keep = 1.0f - ramp;  // inv_freq_extrapolation_factor
      inv_freq[i] = interpolation * (1.0f - keep) + extrapolation * keep;
    }
  } else if (c.rope_scaling == RopeScaling::kLinear) {
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
