#include "model/rope.h"

#include <cmath>

namespace shardserve {

Rope::Rope(const ModelConfig& c) : head_dim_(c.head_dim) {
  const int64_t half = c.head_dim / 2;
  inv_freq_.resize(half);
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(c.head_dim);
    inv_freq_[i] = 1.0f / std::pow(static_cast<float>(c.rope_theta), exponent);
  }
  if (c.rope_scaling == RopeScaling::kLinear) {
    for (float& f : inv_freq_) f = f / static_cast<float>(c.rope_factor);
  } else if (c.rope_scaling == RopeScaling::kLlama3) {
    const double factor = c.rope_factor, lo = c.rope_low_freq_factor, hi = c.rope_high_freq_factor;
    const double old_len = static_cast<double>(c.rope_original_max_position);
    const double low_freq_wavelen = old_len / lo, high_freq_wavelen = old_len / hi;
    for (float& f : inv_freq_) {
      const double wavelen = 2 * M_PI / f;
      if (wavelen > low_freq_wavelen) {
        f = static_cast<float>(f / factor);
      } else if (wavelen >= high_freq_wavelen) {
        const double smooth = (old_len / wavelen - lo) / (hi - lo);
        f = static_cast<float>((1 - smooth) * f / factor + smooth * f);
      }
    }
  }
}

void Rope::Apply(float* x, int64_t num_heads, int64_t position) const {
  const int64_t half = head_dim_ / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float angle = static_cast<float>(position) * inv_freq_[i];
    const float c = static_cast<float>(std::cos(static_cast<double>(angle)));
    const float s = static_cast<float>(std::sin(static_cast<double>(angle)));
    for (int64_t h = 0; h < num_heads; ++h) {
      float* v = x + h * head_dim_;
      const float a = v[i], b = v[i + half];
      v[i] = a * c - b * s;
      v[i + half] = b * c + a * s;
    }
  }
}

}  // namespace shardserve
