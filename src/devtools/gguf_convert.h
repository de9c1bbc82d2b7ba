#pragma once
// Hugging Face model directories (as gen-model writes them) to GGUF files, the way llama.cpp's
// convert_hf_to_gguf.py lays them out, so that llama.cpp's tools and transformers read them too:
// llama.cpp's metadata keys and tensor names, the `llama` q/k rows interleaved, the stacked
// experts (gpt-oss's gate and up apart; its MXFP4 experts as ggml's MXFP4), DeepSeek-V3's
// kv_b_proj as k_b and v_b (`legacy_mla`: as one attn_kv_b, which llama.cpp wrote before), and
// the tokenizer padded to vocab_size with [PADn] tokens (byte-level BPE as
// tokenizer.ggml.model gpt2 with its merges; SentencePiece BPE with byte fallback as llama, with
// scores from which readers recover the merges). Matrices are
// stored as `type`; quantized types are made here from the F32 values (round to nearest, as
// llama.cpp's reference quantizers); norms, biases and the MoE router stay F32.
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "backend/dtype.h"

namespace shardserve {

absl::Status ConvertToGguf(const std::string& hf_dir, const std::string& out_file, DType type,
                           bool legacy_mla = false);

// Splits a GGUF file into `parts` files PREFIX-0000i-of-0000N.gguf as llama.cpp's gguf-split
// does: the tensors in consecutive runs of about equal count, the metadata in the first part,
// split.no / split.count in every part and split.tensors.count in the first. Returns the first
// part's path.
absl::StatusOr<std::string> SplitGguf(const std::string& in_file, const std::string& out_prefix,
                                      int parts);

}  // namespace shardserve
