#pragma once
// Rotary position embeddings as Hugging Face computes them (rotate_half layout: dimension i pairs
// with i + head_dim/2), including `linear` and `llama3` frequency scaling.
#include <cstdint>
#include <vector>

#include "model/config.h"

namespace shardserve {

class Rope {
 public:
  explicit Rope(const ModelConfig& config);

  // Rotates the num_heads heads (head_dim each, contiguous) of one row at `position`, in place.
  void Apply(float* x, int64_t num_heads, int64_t position) const;
  const std::vector<float>& inv_freq() const { return inv_freq_; }

 private:
  int64_t head_dim_;
  std::vector<float> inv_freq_;  // head_dim / 2 frequencies, float32 as in the reference
};

}  // namespace shardserve
