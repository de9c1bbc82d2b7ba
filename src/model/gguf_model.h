#pragma once
// A model in a GGUF file (llama.cpp's format) as shardserve runs it: the configuration from the
// file's metadata, the tensors under their Hugging Face names and shapes. Architectures `llama`
// (Llama 2/3, Mistral, SmolLM, TinyLlama; with experts, Mixtral), `qwen2`, `qwen3`, `qwen3moe`,
// `deepseek2` (DeepSeek-V3: its MLA as k_b / v_b or one kv_b) and `gpt-oss`; weight types F32,
// F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, and ggml's MXFP4 for experts. Whatever else a
// file holds that would change the model's arithmetic is refused by name.
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/config.h"
#include "model/gguf.h"
#include "model/safetensors.h"

namespace shardserve {

// llama.cpp's tensor names: blk.N.<gguf> is model.layers.N.<hf>; the stacked experts
// blk.N.<gguf> ([E][rows][cols]) hold model.layers.N.block_sparse_moe.experts.E.<hf>. Outside the
// layers: token_embd, output_norm and output are the embedding, the final norm and the LM head.
// Names no Hugging Face checkpoint has, which the transformer reads from GGUF only: DeepSeek-V3's
// self_attn.k_b_proj ([H * kv_lora_rank][nope]) and v_b_proj ([H * v_head_dim][kv_lora_rank]),
// gpt-oss's mlp.experts.{gate,up}_proj_bias ([E][rows]) beside its per-expert matrices.
struct GgufName {
  const char* gguf;
  const char* hf;
};
extern const std::vector<GgufName> kGgufLayerNames, kGgufExpertNames;
// The Hugging Face names of a layer's tensor (under model.layers.N.) and of expert e's, for the
// model's architecture: Mixtral's block_sparse_moe (w1, w2, w3), the others' mlp (gate_proj,
// down_proj, up_proj; the router mlp.gate, gpt-oss's mlp.router).
std::string GgufLayerHfName(const ModelConfig& c, const GgufName& n);
std::string GgufExpertHfName(const ModelConfig& c, int64_t e, const GgufName& n);

// llama.cpp's converter interleaves the two rotary halves of each `llama` q and k head: the row
// `file_row` of the file is Hugging Face's row GgufRotaryRow(file_row) (h*hd + 2i + j holds
// h*hd + j*hd/2 + i).
int64_t GgufRotaryRow(int64_t file_row, int64_t head_dim);

// The GGUF file a model path names: the path itself when it is a file, or the one .gguf file of
// a directory that holds no safetensors weights (or the first part of the one split model it
// holds); nullopt otherwise (a safetensors model, or nothing: the safetensors reader names what
// is missing). A directory of several other .gguf files is refused naming them.
absl::StatusOr<std::optional<std::string>> FindGgufFile(const std::string& model_path);

// The configuration as config.json would give it. Errors name the metadata key.
absl::StatusOr<ModelConfig> GgufModelConfig(const GgufFile& file);

// Every tensor the model uses, under its Hugging Face name with the Hugging Face shape (GGUF
// lists dimensions fastest first). The `llama` converter interleaves the two rotary halves of
// each q and k head's rows; those rows are put back in Hugging Face order, into memory kept in
// `owned`. Stacked experts become one view per expert. Views into the file otherwise.
absl::StatusOr<std::map<std::string, TensorView>> GgufTensors(
    const GgufFile& file, const ModelConfig& config,
    std::vector<std::unique_ptr<uint8_t[]>>& owned);

// The Hugging Face tokenizer files the metadata stands for, for the tokenizer library to read as
// it reads a model directory's: tokenizer.json (from tokenizer.ggml.*: model `gpt2`, byte-level
// BPE with the pre-tokenizer tokenizer.ggml.pre names; model `llama`, SentencePiece BPE with
// byte fallback as transformers' LlamaTokenizer builds it, the merges from the file or, as
// transformers recovers them, from the tokens' scores) and the tokenizer_config.json fields the
// chat template needs (chat_template, bos_token, eos_token). Errors name the key.
struct GgufTokenizerFiles {
  std::string tokenizer_json;
  std::string tokenizer_config_json;
};
absl::StatusOr<GgufTokenizerFiles> GgufTokenizer(const GgufFile& file);

}  // namespace shardserve
