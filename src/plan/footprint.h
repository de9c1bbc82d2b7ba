#pragma once
// What a model holds in a GPU's memory, layer by layer (pure data): what plan/memory.h weighs.
// model/footprint.h reads it from a model's config; `shardserve-worker inspect` reports it and
// status.model keeps it (JSON, bounded).
//
// Every rank of a stage holds: its share of the weights that tensor parallelism divides (query
// and output heads, MLP columns, experts, vocabulary rows), its KV heads' key/value projections
// (max(1, kv_heads / T) heads: a group smaller than T replicates them), the weights it keeps
// whole (norms, routers, MLA's down-projections); and a KV cache of kv_dtype values per
// position: its KV heads' keys and values, or MLA's compressed latent, which every rank keeps
// whole.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "plan/layer_split.h"

namespace shardserve {

// Consecutive layers that hold the same.
struct LayerFootprint {
  int64_t count = 1;
  double split_bytes = 0;    // divided across the tensor-parallel group
  double kv_head_bytes = 0;  // the key/value projections (and biases) of one KV head
  double whole_bytes = 0;    // held whole by every rank
  int64_t kv_heads = 0;      // KV heads cached per position (0 with MLA)
  int64_t head_values = 0;   // values cached per position and KV head (key and value)
  int64_t whole_values = 0;  // values cached per position that every rank keeps (MLA's latent)
  bool operator==(const LayerFootprint&) const = default;
};

struct ModelFootprint {
  std::string architecture;
  std::string weights;  // the format, for a person: "BF16", "FP8 E4M3 (128x128 blocks) ..."
  int64_t layers = 0;
  // What a tensor-parallel group must divide (0: nothing of that kind).
  int64_t heads = 0, kv_heads = 0, experts = 0, intermediate = 0;
  double params = 0;                  // the parameters counted (layers, embeddings, LM head)
  double embed_bytes = 0;             // the first stage's, divided by vocabulary rows
  double head_bytes = 0;              // the last stage's LM head and final norm, divided likewise
  std::vector<LayerFootprint> kinds;  // in layer order; their counts add up to `layers`
  int64_t full_kv_values = 0;  // per position and layer with full heads (what MLA saves against)
  ModelShape shape;            // the sizes the pipeline split weighs
  std::vector<std::string> notes;  // what is not counted, and why

  // How the KV cache keeps a value (api/kv_cache_dtype.h: f32, bf16, f16, fp8): the model's
  // dtype (kvCacheDtype auto) until UseKvCacheDtype sets a spec's.
  std::string kv_dtype = "bf16";
  // The checkpoint's multi-token-prediction layer (DeepSeek-V3's) as the last stage loads it
  // under speculative method mtp: its decoder layer and KV cache, eh_proj and its norms (whole
  // on every rank), its own embedding and head (vocabulary rows). count 0: the model has none.
  LayerFootprint mtp{.count = 0};
  bool mtp_loaded = false;  // the spec speculates with it (UseSpeculativeMethod)

  // Values cached per position and layer on one rank of a tensor-parallel group of `tp`.
  int64_t KvValuesPerRank(const LayerFootprint& k, int64_t tp) const;
  int64_t KvValueBytes() const;
};

// The footprint with the KV cache a spec's spec.serving.kvCacheDtype keeps (auto: as it is).
void UseKvCacheDtype(ModelFootprint& f, const std::string& kv_cache_dtype);
// The footprint with the layers a spec's spec.serving.speculative.method loads (mtp: the
// multi-token-prediction layer, on the last stage).
void UseSpeculativeMethod(ModelFootprint& f, const std::string& method);

// The footprint as `shardserve-worker inspect` reports it and status.model keeps it, and back
// (bounded: a report is input).
nlohmann::json FootprintToJson(const ModelFootprint& f);
absl::StatusOr<ModelFootprint> FootprintFromJson(const nlohmann::json& j);

}  // namespace shardserve
