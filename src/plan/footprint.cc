#include "plan/footprint.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "api/kv_cache_dtype.h"
#include "common/status.h"

namespace shardserve {

using json = nlohmann::json;

int64_t ModelFootprint::KvValuesPerRank(const LayerFootprint& k, int64_t tp) const {
  const int64_t heads = k.kv_heads == 0 ? 0 : std::max<int64_t>(1, k.kv_heads / tp);
  return heads * k.head_values + k.whole_values;
}

int64_t ModelFootprint::KvValueBytes() const {
  return KvCacheDtypeBytes(ParseKvCacheDtype(kv_dtype).value_or(KvCacheDtype::kF32), 4);
}

void UseKvCacheDtype(ModelFootprint& f, const std::string& kv_cache_dtype) {
  const std::optional<KvCacheDtype> t = ParseKvCacheDtype(kv_cache_dtype);
  if (t && *t != KvCacheDtype::kAuto) f.kv_dtype = KvCacheDtypeName(*t);
}

namespace {

constexpr double kMaxBytes = 1e16;  // 10 PB: past every model
constexpr int64_t kMaxLayers = int64_t{1}
                               << 12;  // as a config.json may have (model/config_reader.h)
constexpr int64_t kMaxHeads = int64_t{1} << 12;
constexpr int64_t kMaxKinds = 4096;

struct KindField {
  const char* name;
  double LayerFootprint::*bytes = nullptr;
  int64_t LayerFootprint::*count = nullptr;
};
constexpr KindField kKindFields[] = {
    {"count", nullptr, &LayerFootprint::count},
    {"splitBytes", &LayerFootprint::split_bytes},
    {"kvHeadBytes", &LayerFootprint::kv_head_bytes},
    {"wholeBytes", &LayerFootprint::whole_bytes},
    {"kvHeads", nullptr, &LayerFootprint::kv_heads},
    {"headValues", nullptr, &LayerFootprint::head_values},
    {"wholeValues", nullptr, &LayerFootprint::whole_values},
};

json KindToJson(const LayerFootprint& k) {
  json o = json::object();
  for (const KindField& field : kKindFields) {
    if (field.bytes) {
      o[field.name] = std::llround(k.*field.bytes);
    } else {
      o[field.name] = k.*field.count;
    }
  }
  return o;
}

}  // namespace

void UseSpeculativeMethod(ModelFootprint& f, const std::string& method) {
  f.mtp_loaded = method == "mtp";
}

json FootprintToJson(const ModelFootprint& f) {
  json kinds = json::array();
  for (const LayerFootprint& k : f.kinds) kinds.push_back(KindToJson(k));
  json out = {{"architecture", f.architecture},
              {"weights", f.weights},
              {"layers", f.layers},
              {"heads", f.heads},
              {"kvHeads", f.kv_heads},
              {"experts", f.experts},
              {"intermediate", f.intermediate},
              {"params", std::llround(f.params)},
              {"embedBytes", std::llround(f.embed_bytes)},
              {"headBytes", std::llround(f.head_bytes)},
              {"fullKvValues", f.full_kv_values},
              {"kvDtype", f.kv_dtype},
              {"kinds", kinds},
              {"shape", ShapeToJson(f.shape)},
              {"notes", f.notes}};
  if (f.mtp.count > 0) out["mtp"] = KindToJson(f.mtp);  // a report of before has none
  return out;
}

absl::StatusOr<ModelFootprint> FootprintFromJson(const json& j) {
  auto bad = [](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("the model's footprint: ", what));
  };
  if (!j.is_object()) return bad("not a JSON object");
  auto integer = [&](const json& o, const char* key, int64_t max) -> absl::StatusOr<int64_t> {
    auto it = o.find(key);
    if (it == o.end() || !it->is_number_integer())
      return bad(absl::StrCat("no integer '", key, "'"));
    const int64_t v = it->get<int64_t>();
    if (v < 0 || v > max)
      return bad(absl::StrCat("'", key, "' is ", v, ", outside [0, ", max, "]"));
    return v;
  };
  auto text = [&](const char* key) -> absl::StatusOr<std::string> {
    auto it = j.find(key);
    if (it == j.end() || !it->is_string() || it->get<std::string>().size() > 1024) {
      return bad(absl::StrCat("no text '", key, "' of at most 1024 characters"));
    }
    return it->get<std::string>();
  };
  constexpr int64_t kBytes = static_cast<int64_t>(kMaxBytes);
  ModelFootprint f;
  ASSIGN_OR_RETURN(f.architecture, text("architecture"));
  ASSIGN_OR_RETURN(f.weights, text("weights"));
  ASSIGN_OR_RETURN(f.layers, integer(j, "layers", kMaxLayers));
  ASSIGN_OR_RETURN(f.heads, integer(j, "heads", kMaxHeads));
  ASSIGN_OR_RETURN(f.kv_heads, integer(j, "kvHeads", kMaxHeads));
  ASSIGN_OR_RETURN(f.experts, integer(j, "experts", kMaxHeads));
  ASSIGN_OR_RETURN(f.intermediate, integer(j, "intermediate", int64_t{1} << 24));
  ASSIGN_OR_RETURN(int64_t params, integer(j, "params", kBytes));
  ASSIGN_OR_RETURN(int64_t embed, integer(j, "embedBytes", kBytes));
  ASSIGN_OR_RETURN(int64_t head, integer(j, "headBytes", kBytes));
  ASSIGN_OR_RETURN(f.full_kv_values, integer(j, "fullKvValues", int64_t{1} << 30));
  // A report of before the KV cache's dtype: F32, what the ranks kept then.
  f.kv_dtype = j.contains("kvDtype") ? "" : "f32";
  if (f.kv_dtype.empty()) {
    ASSIGN_OR_RETURN(f.kv_dtype, text("kvDtype"));
    const std::optional<KvCacheDtype> t = ParseKvCacheDtype(f.kv_dtype);
    if (!t || *t == KvCacheDtype::kAuto) {
      return bad(absl::StrCat("'kvDtype' is '", f.kv_dtype, "', not f32, bf16, f16 or fp8"));
    }
  }
  f.params = static_cast<double>(params);
  f.embed_bytes = static_cast<double>(embed);
  f.head_bytes = static_cast<double>(head);
  auto kinds = j.find("kinds");
  if (kinds == j.end() || !kinds->is_array() || kinds->empty() ||
      kinds->size() > static_cast<size_t>(kMaxKinds)) {
    return bad(absl::StrCat("'kinds' must be a list of 1 to ", kMaxKinds, " entries"));
  }
  auto kind = [&](const json& o, const std::string& what) -> absl::StatusOr<LayerFootprint> {
    if (!o.is_object()) return bad(absl::StrCat(what, " is not an object"));
    LayerFootprint k;
    for (const KindField& field : kKindFields) {
      ASSIGN_OR_RETURN(int64_t v, integer(o, field.name, field.bytes ? kBytes : int64_t{1} << 30));
      if (field.bytes) {
        k.*field.bytes = static_cast<double>(v);
      } else {
        k.*field.count = v;
      }
    }
    if (k.count < 1) return bad(absl::StrCat(what, " counts no layer"));
    return k;
  };
  int64_t layers = 0;
  for (const json& o : *kinds) {
    ASSIGN_OR_RETURN(LayerFootprint k, kind(o, "an entry of 'kinds'"));
    layers += k.count;
    f.kinds.push_back(k);
  }
  if (layers != f.layers) {
    return bad(absl::StrCat("its kinds count ", layers, " layers, not ", f.layers));
  }
  if (auto mtp = j.find("mtp"); mtp != j.end()) {
    ASSIGN_OR_RETURN(f.mtp, kind(*mtp, "'mtp'"));
  }
  auto shape = j.find("shape");
  if (shape == j.end()) return bad("no 'shape'");
  ASSIGN_OR_RETURN(f.shape, ShapeFromJson(*shape));
  auto notes = j.find("notes");
  if (notes != j.end()) {
    if (!notes->is_array() || notes->size() > 16) return bad("'notes' must be a short list");
    for (const json& n : *notes) {
      if (!n.is_string() || n.get<std::string>().size() > 1024) return bad("a note is not text");
      f.notes.push_back(n.get<std::string>());
    }
  }
  return f;
}

}  // namespace shardserve
