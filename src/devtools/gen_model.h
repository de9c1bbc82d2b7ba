#pragma once
// Writes a complete, loadable Hugging Face model directory with deterministic random weights:
// config.json, model.safetensors (or shards + model.safetensors.index.json), a trained BPE
// tokenizer.json, tokenizer_config.json and generation_config.json.
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "backend/dtype.h"
#include "devtools/bpe_trainer.h"

namespace shardserve {

struct GenModelOptions {
  // llama | mistral | qwen2 | qwen3 | qwen3_moe | mixtral | deepseek_v3 | gpt_oss
  std::string arch = "llama";
  std::string out_dir;
  int64_t layers = 2;
  int64_t hidden = 64;
  int64_t intermediate = 128;
  int64_t heads = 4;
  int64_t kv_heads = 2;
  int64_t head_dim = 0;  // 0 = hidden / heads
  int64_t vocab = 512;
  int64_t experts = 4;         // mixtral
  int64_t top_k = 2;           // mixtral
  bool norm_topk_prob = true;  // qwen3_moe: the k experts' weights renormalized to sum to 1
  // deepseek_v3: multi-head latent attention (q_lora_rank 0: q_proj), its grouped routing,
  // shared experts and dense first layers (`intermediate` theirs, moe_intermediate the experts').
  int64_t q_lora_rank = 0, kv_lora_rank = 32, rope_dim = 16, nope_dim = 16, v_dim = 16;
  int64_t groups = 1, topk_groups = 1, shared_experts = 1, first_dense = 1, moe_intermediate = 64;
  // gpt_oss: sliding and full attention in turn (the sliding layers' window), sinks, biases,
  // fused experts of `intermediate` with the SwiGLU clamped at swiglu_limit.
  int64_t sliding_window = 16;
  double swiglu_limit = 7.0;
  // gpt_oss: its experts in MXFP4 (quant_method mxfp4, model/mxfp4.h), as gpt-oss ships them.
  bool mxfp4 = false;
  bool mtp = false;  // deepseek_v3: its multi-token-prediction layer (num_nextn_predict_layers 1)
  int64_t max_position = 4096;
  DType dtype = DType::kBF16;
  uint64_t seed = 0;
  bool tie_embeddings = false;
  bool attention_bias = false;  // llama: bias on q/k/v/o
  std::string rope_scaling;     // "", "llama3", "linear" or "yarn"
  TokenizerStyle tokenizer = TokenizerStyle::kByteLevel;
  std::string corpus_file;  // train the tokenizer on this text instead of the built-in one
  // The tokenizer also has <think> and </think> as added tokens that are not special (they stay
  // in decoded text), as Qwen3's and DeepSeek-R1's have.
  bool think_tokens = false;
  int64_t shard_bytes = 0;  // > 0: split weights into files of about this size
  // > 0: a fine-grained FP8 checkpoint (model/fp8.h): the attention and MLP projections (the
  // experts' too) as F8_E4M3 with an F32 `_scale_inv` per fp8_block x fp8_block block, the rest
  // in dtype, and quantization_config saying so; kFp8PerTensor: one scale per weight (a scalar
  // `_scale_inv`, weight_block_size null).
  static constexpr int64_t kFp8PerTensor = -1;
  int64_t fp8_block = 0;
  // The chat template written to tokenizer_config.json: llama3, chatml, llama2, mistral, hermes,
  // llama3-tools, mistral-tools, deepseek-tools, chatml-think, qwen3, harmony, none,
  // or auto (chatml for qwen2; llama2 / mistral for SentencePiece llama / others; llama3 for
  // byte-level llama; mistral for byte-level mistral and mixtral).
  std::string chat_template = "auto";

  absl::Status Validate() const;
};

absl::Status GenerateModel(const GenModelOptions& options);

}  // namespace shardserve
