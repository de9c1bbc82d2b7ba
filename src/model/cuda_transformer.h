#pragma once
// The transformer on the CUDA backend (built with SHARDSERVE_CUDA): the same model, the same
// sharding and the same stage contract as model/transformer.h, with weights, activations and the
// KV cache in device memory. Loading goes through the CPU Transformer, which validates every
// tensor and maps this rank's slices of the files; each slice is then copied from the mapping
// straight to the device (a column slice with a pitched copy, only its own columns); the mapped
// pages then leave the process's resident memory (madvise), the files staying mapped.
//
// A step is Run() and then one of its outputs, all of which stay on the device until asked for.
// Per step only the batch layout goes to the device (token ids, positions, block tables), and
// only the choice of the next tokens comes back: the greedy summaries (2 + 2K floats a sequence)
// or the sampled ids and log-probabilities. Hidden states cross pipeline stages through host
// memory or, over an NCCL link, device to device. MoE routing runs on the device; decode batches
// (at most as many (row, expert) pairs as local experts) read only the chosen experts, larger
// batches bring the routes back to group rows per expert for cuBLAS. The TP communicator, when
// tp_size > 1, must take device pointers (NCCL). No CUDA type appears here. Not thread-safe.
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/sampler.h"
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

  // The input of a stage after the first: the previous stage's rows x hidden floats, from host
  // memory or received from member `peer` of an NCCL link (device to device).
  absl::Status HiddenFromHost(const float* hidden, int64_t rows);
  absl::Status ReceiveHidden(Communicator& link, int peer, int64_t rows);
  // Runs this rank's layers on a batch (Transformer::ForwardStage's contract): the first stage
  // embeds the tokens, a later one takes the input given just before for as many rows.
  absl::Status Run(std::vector<SequenceChunk>& chunks, KvCache& cache);
  // After Run on a stage before the last: its hidden states to host memory, or sent to member
  // `peer` of an NCCL link.
  absl::Status HiddenToHost(std::vector<float>& out) const;
  absl::Status SendHidden(Communicator& link, int peer);
  // After Run on the last stage: this rank's vocab-parallel slice of each sequence's logits, row
  // stride logits_stride() (host).
  absl::Status LogitsToHost(std::vector<float>& out) const;
  // After Run on the last stage, every rank of the TP group: each sequence's greedy token, its
  // log-probability and top_logprobs alternatives. tp_group exchanges the summaries (host
  // pointers; null for one rank).
  absl::StatusOr<std::vector<SampledToken>> Greedy(int64_t top_logprobs, Communicator* tp_group);
  // After Run on the last stage, every rank of the TP group (the logits are gathered over the
  // NCCL TP communicator): on the rank that holds the sequences' generators (samplers[s], null
  // for a sequence not sampled now) each sequence's token sampled with its parameters and
  // generator, as Sampler::Sample would; other ranks pass an empty vector and get one back.
  absl::StatusOr<std::vector<SampledToken>> Sample(const std::vector<Sampler*>& samplers,
                                                   int64_t top_logprobs);

  // Run, then HiddenToHost or LogitsToHost: Transformer::ForwardStage with host memory.
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
