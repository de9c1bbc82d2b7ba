#pragma once
// The transformer on the CUDA backend (built with SHARDSERVE_CUDA): the same model, the same
// sharding and the same ForwardStage contract as model/transformer.h, with weights, activations
// and the KV cache in device memory. Loading goes through the CPU Transformer (which validates
// every tensor and cuts this rank's slices from the mapped files), whose slices are then copied
// straight to the device; the mappings are released afterwards.
//
// Per step only the batch layout goes to the device (token ids, positions, block tables) and only
// the stage's output comes back (the vocab-parallel logits of each sequence's last token, or the
// hidden states for the next pipeline stage). The TP communicator, when tp_size > 1, must take
// device pointers (NCCL). No CUDA type appears here. Not thread-safe: one ForwardStage at a time.
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/transformer.h"

namespace shardserve {

class CudaTransformer {
 public:
  static absl::StatusOr<std::unique_ptr<CudaTransformer>> Load(const std::string& model_dir,
                                                               const Transformer::Options& options,
                                                               int device = 0);
  ~CudaTransformer();

  const ModelConfig& config() const;
  // Block bookkeeping on the host (the same KvCache class), storage on the device. One cache per
  // model: a new one replaces the previous.
  absl::StatusOr<std::unique_ptr<KvCache>> NewKvCache(int64_t positions, int64_t block_size = 16);
  // As Transformer::ForwardStage; hidden_in and out are host memory.
  absl::Status ForwardStage(std::vector<SequenceChunk>& chunks, KvCache& cache,
                            const float* hidden_in, std::vector<float>& out);
  // As Transformer::Forward (a whole model): full logits of each chunk's last token.
  absl::Status Forward(std::vector<SequenceChunk>& chunks, KvCache& cache,
                       std::vector<float>& logits);
  int64_t vocab_begin() const;
  int64_t vocab_end() const;
  int64_t logits_stride() const;
  bool first_stage() const;
  bool last_stage() const;
  size_t shard_weight_bytes() const;
  size_t stage_weight_bytes() const;

  struct Impl;

 private:
  explicit CudaTransformer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardserve
