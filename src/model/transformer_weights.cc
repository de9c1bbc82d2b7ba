// The Transformer's weights (model/transformer.h): loading a stage, checking that its shapes split
// over the TP group, and binding each rank's slice of every weight to the backend (rows, columns,
// heads, experts; FP8 kept as blocks or expanded, MXFP4 expanded). The forward pass is
// transformer.cc.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_features.h"
#include "backend/cpu/kernels.h"
#include "common/log.h"
#include "common/prefetch.h"
#include "common/status.h"
#include "model/fp8.h"
#include "model/mxfp4.h"
#include "model/rope.h"
#include "model/transformer.h"

namespace shardserve {
namespace {

// Raw bytes (U8) are MXFP4's blocks and scales, which only gpt-oss's experts read.
absl::Status NotBytes(const TensorView& t) {
  if (t.dtype != DType::kU8) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "tensor '", t.name, "' is U8: raw bytes hold only MXFP4 experts' blocks and scales"));
}

absl::Status Divisible(const char* what, int64_t n, int tp) {
  if (n % tp == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, " ", n, " is not divisible by tensor parallelism ", tp));
}

}  // namespace

Transformer::Transformer(ModelConfig config, std::unique_ptr<WeightStore> weights,
                         const Options& options, std::unique_ptr<Backend> backend)
    : config_(std::move(config)),
      options_(options),
      weights_(std::move(weights)),
      backend_(std::move(backend)) {
  for (std::unique_ptr<Buffer>* b :
       {&buf_.x,       &buf_.h,       &buf_.q,         &buf_.k,        &buf_.v,
        &buf_.attn,    &buf_.o,       &buf_.g,         &buf_.u,        &buf_.d,
        &buf_.in,      &buf_.router,  &buf_.ids,       &buf_.pos,      &buf_.table,
        &buf_.offsets, &buf_.sel,     &buf_.weights,   &buf_.routes,   &buf_.route_weights,
        &buf_.last,    &buf_.logits,  &buf_.padded,    &buf_.gathered, &buf_.full,
        &buf_.qa,      &buf_.qr,      &buf_.lat,       &buf_.kr,       &buf_.qlat,
        &buf_.olat,    &buf_.targets, &buf_.lora_rows, &buf_.lora_u}) {
    *b = backend_->NewBuffer();
  }
}

Transformer::~Transformer() = default;
absl::StatusOr<std::unique_ptr<Transformer>> Transformer::Load(const std::string& model_dir,
                                                               const Options& options,
                                                               std::unique_ptr<Backend> backend) {
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(model_dir));
  ASSIGN_OR_RETURN(auto weights, WeightStore::Open(model_dir));
  if (backend == nullptr) {
    RETURN_IF_ERROR(cpu::CheckCpu());
    backend = cpu::NewBackend(options.num_threads);
  }
  if (config.mtp_layers > 0 && !options.mtp && options.tp_rank == 0 && options.layer_begin == 0) {
    LogInfo(model_dir, ": its ", config.mtp_layers,
            " multi-token-prediction layer(s) (num_nextn_predict_layers) are not loaded: they "
            "serve speculative decoding's method mtp, not asked for");
  }
  std::unique_ptr<Transformer> t(
      new Transformer(std::move(config), std::move(weights), options, std::move(backend)));
  absl::Status s = t->CheckSplit();
  if (s.ok()) s = t->BindWeights();
  if (s.ok()) s = t->InitLora();
  t->options_.progress = nullptr;  // loading is over; what it told may be gone
  if (s.ok()) s = t->backend_->Synchronize();
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(model_dir, ": ", s.message()));
  // The pages the binding read leave this process's resident memory: the backends (GPU, and the
  // CPU's own copies, repacked or not) are done with the host's.
  t->weights_->DropResidentPages();
  if (t->backend_->copies_weights()) t->owned_.clear();
  return t;
}

absl::Status Transformer::CheckSplit() const {
  const ModelConfig& c = config_;
  const int T = options_.tp_size;
  if (T < 1 || options_.tp_rank < 0 || options_.tp_rank >= T) {
    return absl::InvalidArgumentError(
        absl::StrCat("tp_rank ", options_.tp_rank, " is outside a group of ", T));
  }
  if (T > 1 && options_.tp_comm == nullptr) {
    return absl::InvalidArgumentError("tensor parallelism needs a communicator");
  }
  RETURN_IF_ERROR(Divisible("num_attention_heads", c.num_heads, T));
  if (!c.mla && c.num_kv_heads % T != 0 && T % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_key_value_heads ", c.num_kv_heads,
                                                   " and tensor parallelism ", T,
                                                   ": one must divide the other"));
  }
  if (c.moe) {
    RETURN_IF_ERROR(Divisible(c.mla ? "n_routed_experts" : "num_local_experts", c.num_experts, T));
    if (c.shared_experts > 0) {
      RETURN_IF_ERROR(Divisible("n_shared_experts x moe_intermediate_size",
                                c.shared_experts * c.intermediate_size, T));
    }
    if (c.first_dense_layers > 0) {
      RETURN_IF_ERROR(Divisible("intermediate_size", c.dense_intermediate_size, T));
    }
  } else {
    RETURN_IF_ERROR(Divisible("intermediate_size", c.intermediate_size, T));
  }
  const int64_t end = options_.layer_end < 0 ? c.num_layers : options_.layer_end;
  if (options_.layer_begin < 0 || options_.layer_begin >= end || end > c.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layers [", options_.layer_begin, ", ", end,
                                                   ") are not a range of the model's ",
                                                   c.num_layers, " layers"));
  }
  return absl::OkStatus();
}

absl::Status Transformer::Fp8Declared(const TensorView& t) const {
  if (config_.fp8()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("tensor '", t.name,
                   "' is F8_E4M3 but config.json has no quantization_config of an FP8 "
                   "checkpoint (quant_method fp8)"));
}

absl::StatusOr<WeightMatrix> Transformer::Expanded(const TensorView& t, int64_t r0, int64_t r1,
                                                   int64_t c0, int64_t c1) {
  const bool fp8 = t.dtype == DType::kF8E4M3;
  if (fp8) RETURN_IF_ERROR(Fp8Declared(t));
  if (!fp8 && (c0 % kMxfp4Block != 0 || c1 % kMxfp4Block != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", t.name, "' (MXFP4, blocks of ", kMxfp4Block,
                     " values) does not split over ", "tensor parallelism ", options_.tp_size,
                     ": its slice [", c0, ", ", c1, ") does not fall on block boundaries"));
  }
  // FP8 stays FP8 (an F32 scale per 128 values) where the slice's columns allow it.
  const bool packed = fp8 && options_.fp8_blocks && Fp8Packs(config_.fp8_blocks, c0, c1);
  const DType to = packed ? DType::kF8_128 : config_.dtype;
  const int64_t rows = r1 - r0, width = c1 - c0;
  const size_t bytes = rows * DTypeBytes(to, width);
  auto buf = std::unique_ptr<uint8_t[]>(new (std::nothrow) uint8_t[std::max<size_t>(bytes, 1)]);
  if (buf == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes to expand '", t.name, "'"));
  }
  if (packed) {
    RETURN_IF_ERROR(PackFp8(t, config_.fp8_blocks, r0, r1, c0, c1, buf.get()));
  } else if (fp8) {
    RETURN_IF_ERROR(ExpandFp8(t, config_.fp8_blocks, r0, r1, c0, c1, to, buf.get()));
  } else {
    RETURN_IF_ERROR(ExpandGgmlMxfp4(t, r0, r1, c0, c1, to, buf.get()));
  }
  shard_bytes_ += bytes;
  stage_bytes_ += t.nbytes;
  owned_.push_back(std::move(buf));
  return backend_->Upload(WeightMatrix{to, owned_.back().get(), rows, width, width});
}

absl::StatusOr<WeightMatrix> Transformer::Picked(const TensorView& t,
                                                 const std::vector<int64_t>& rows,
                                                 int64_t transpose_by) {
  RETURN_IF_ERROR(NotBytes(t));
  const int64_t cols = t.shape[1], n = static_cast<int64_t>(rows.size());
  const bool fp8 = t.dtype == DType::kF8E4M3, quantized = IsQuantized(t.dtype);
  if (fp8) RETURN_IF_ERROR(Fp8Declared(t));
  if (t.dtype == DType::kMXFP4) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", t.name, "' is MXFP4, which only experts are"));
  }
  // The per-head products take F32, F16 or BF16: FP8 expands into the model's dtype, a GGUF
  // block type into F32.
  const DType to = fp8 ? config_.dtype : quantized ? DType::kF32 : t.dtype;
  const size_t elem = DTypeSize(to), row = cols * elem, in_row = DTypeBytes(t.dtype, cols);
  auto picked =
      std::unique_ptr<uint8_t[]>(new (std::nothrow) uint8_t[std::max<size_t>(n * row, 1)]);
  if (picked == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", n * row, " bytes for rows of '", t.name, "'"));
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* src = static_cast<const uint8_t*>(t.data) + rows[i] * in_row;
    if (fp8) {
      RETURN_IF_ERROR(ExpandFp8(t, config_.fp8_blocks, rows[i], rows[i] + 1, 0, cols, to,
                                picked.get() + i * row));
    } else if (quantized) {
      cpu::ToFloat(t.dtype, src, cols, reinterpret_cast<float*>(picked.get() + i * row));
    } else {
      std::memcpy(picked.get() + i * row, src, row);
    }
  }
  shard_bytes_ += n * row;  // the tensor's stage bytes are counted by the caller (once)
  if (transpose_by > 0) {   // each [transpose_by][cols] block to [cols][transpose_by]
    auto out = std::unique_ptr<uint8_t[]>(new (std::nothrow) uint8_t[std::max<size_t>(n * row, 1)]);
    if (out == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", n * row, " bytes to transpose '", t.name, "'"));
    }
    for (int64_t b = 0; b < n / transpose_by; ++b) {
      const uint8_t* in = picked.get() + b * transpose_by * row;
      uint8_t* o = out.get() + b * transpose_by * row;
      for (int64_t r = 0; r < transpose_by; ++r) {
        for (int64_t col = 0; col < cols; ++col) {
          std::memcpy(o + (col * transpose_by + r) * elem, in + (r * cols + col) * elem, elem);
        }
      }
    }
    picked = std::move(out);
    owned_.push_back(std::move(picked));
    return backend_->Upload(
        WeightMatrix{to, owned_.back().get(), n / transpose_by * cols, transpose_by, transpose_by});
  }
  owned_.push_back(std::move(picked));
  return backend_->Upload(WeightMatrix{to, owned_.back().get(), n, cols, cols});
}

absl::Status Transformer::BindLatentAttention(Layer& L, const std::string& p) {
  const ModelConfig& c = config_;
  const WeightStore& w = *weights_;
  const int64_t H = c.hidden_size, Lr = c.kv_lora_rank, R = c.head_dim, nope = c.qk_nope_dim,
                vd = c.v_head_dim, qhd = nope + R, h0 = options_.tp_rank * heads_;
  // Row j of the rotated dims in rotate_half order: HF's interleaved pairs (2i, 2i + 1) become
  // (i, i + R / 2), which rotate alike (model/rope.h).
  auto rotated = [&](int64_t j) {
    if (!c.rope_interleave) return j;
    return j < R / 2 ? 2 * j : 2 * (j - R / 2) + 1;
  };
  std::vector<int64_t> nope_rows, rope_rows, uk_rows, uv_rows;
  for (int64_t h = h0; h < h0 + heads_; ++h) {
    for (int64_t j = 0; j < nope; ++j) nope_rows.push_back(h * qhd + j);
    for (int64_t j = 0; j < R; ++j) rope_rows.push_back(h * qhd + nope + rotated(j));
    for (int64_t j = 0; j < nope; ++j) uk_rows.push_back(h * (nope + vd) + j);
    for (int64_t j = 0; j < vd; ++j) uv_rows.push_back(h * (nope + vd) + nope + j);
  }
  const std::string a = p + "self_attn.";
  TensorView q;
  if (c.q_lora_rank > 0) {
    const int64_t Q = c.q_lora_rank;
    ASSIGN_OR_RETURN(TensorView qa, w.Get(a + "q_a_proj.weight", {Q, H}));
    ASSIGN_OR_RETURN(TensorView qa_norm, w.Get(a + "q_a_layernorm.weight", {Q}));
    ASSIGN_OR_RETURN(L.q_a, Rows(qa, 0, Q));  // replicated: every rank needs the whole latent
    ASSIGN_OR_RETURN(L.q_a_norm, VectorSlice(qa_norm, 0, Q));
    ASSIGN_OR_RETURN(q, w.Get(a + "q_b_proj.weight", {c.num_heads * qhd, Q}));
  } else {
    ASSIGN_OR_RETURN(q, w.Get(a + "q_proj.weight", {c.num_heads * qhd, H}));
  }
  ASSIGN_OR_RETURN(L.q_nope, Picked(q, nope_rows));
  ASSIGN_OR_RETURN(L.q_rope, Picked(q, rope_rows));
  ASSIGN_OR_RETURN(TensorView kva, w.Get(a + "kv_a_proj_with_mqa.weight", {Lr + R, H}));
  ASSIGN_OR_RETURN(TensorView kv_norm, w.Get(a + "kv_a_layernorm.weight", {Lr}));
  ASSIGN_OR_RETURN(TensorView o, w.Get(a + "o_proj.weight", {H, c.num_heads * vd}));
  ASSIGN_OR_RETURN(L.kv_latent, Rows(kva, 0, Lr));
  std::vector<int64_t> kv_rope_rows;
  for (int64_t j = 0; j < R; ++j) kv_rope_rows.push_back(Lr + rotated(j));
  ASSIGN_OR_RETURN(L.kv_rope, Picked(kva, kv_rope_rows));
  ASSIGN_OR_RETURN(L.kv_norm, VectorSlice(kv_norm, 0, Lr));
  ASSIGN_OR_RETURN(L.o, Cols(o, h0 * vd, (h0 + heads_) * vd));
  stage_bytes_ += q.nbytes;  // Picked's; kv_a_proj_with_mqa's by Rows
  // Per head, uk_t [kv_lora_rank][nope] and uv [v_head_dim][kv_lora_rank]: kv_b_proj's key rows
  // transposed and its value rows, or GGUF's k_b and v_b, which hold them so.
  if (w.Has(a + "k_b_proj.weight")) {
    ASSIGN_OR_RETURN(TensorView kb, w.Get(a + "k_b_proj.weight", {c.num_heads * Lr, nope}));
    ASSIGN_OR_RETURN(TensorView vb, w.Get(a + "v_b_proj.weight", {c.num_heads * vd, Lr}));
    std::vector<int64_t> kb_rows;
    for (int64_t r = h0 * Lr; r < (h0 + heads_) * Lr; ++r) kb_rows.push_back(r);
    std::vector<int64_t> vb_rows;
    for (int64_t r = h0 * vd; r < (h0 + heads_) * vd; ++r) vb_rows.push_back(r);
    ASSIGN_OR_RETURN(L.uk_t, Picked(kb, kb_rows));
    ASSIGN_OR_RETURN(L.uv, Picked(vb, vb_rows));
    stage_bytes_ += kb.nbytes + vb.nbytes;
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(TensorView kvb, w.Get(a + "kv_b_proj.weight", {c.num_heads * (nope + vd), Lr}));
  ASSIGN_OR_RETURN(L.uk_t, Picked(kvb, uk_rows, nope));
  ASSIGN_OR_RETURN(L.uv, Picked(kvb, uv_rows));
  stage_bytes_ += kvb.nbytes;
  return absl::OkStatus();
}

absl::StatusOr<WeightMatrix> Transformer::Rows(const TensorView& t, int64_t begin, int64_t end) {
  RETURN_IF_ERROR(NotBytes(t));
  const int64_t cols = t.shape[1];
  if (IsStorageOnly(t.dtype)) return Expanded(t, begin, end, 0, cols);  // FP8, ggml's MXFP4
  const size_t row = DTypeBytes(t.dtype, cols);
  shard_bytes_ += (end - begin) * row;
  stage_bytes_ += t.nbytes;
  return backend_->Upload(WeightMatrix{t.dtype, static_cast<const uint8_t*>(t.data) + begin * row,
                                       end - begin, cols, cols});
}

absl::StatusOr<WeightMatrix> Transformer::Cols(const TensorView& t, int64_t begin, int64_t end) {
  RETURN_IF_ERROR(NotBytes(t));
  const int64_t rows = t.shape[0], cols = t.shape[1], width = end - begin;
  if (IsStorageOnly(t.dtype)) return Expanded(t, 0, rows, begin, end);
  const int64_t block = DTypeBlock(t.dtype);
  if (begin % block != 0 || width % block != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", t.name, "' (", DTypeName(t.dtype), ", blocks of ", block,
        " values) does not split over tensor parallelism ", options_.tp_size, ": its slice [",
        begin, ", ", end, ") of ", cols, " columns does not fall on block boundaries"));
  }
  const size_t len = DTypeBytes(t.dtype, width), row = DTypeBytes(t.dtype, cols);
  shard_bytes_ += rows * len;
  stage_bytes_ += t.nbytes;
  if (width == cols) return backend_->Upload(WeightMatrix{t.dtype, t.data, rows, cols, cols});
  const int fd = ::open(t.file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat(t.file, ": cannot open: ", std::strerror(errno)));
  }
  auto buf = std::make_unique<uint8_t[]>(rows * len);
  for (int64_t r = 0; r < rows; ++r) {
    const ssize_t n =
        ::pread(fd, buf.get() + r * len, len,
                static_cast<off_t>(t.file_offset + r * row + DTypeBytes(t.dtype, begin)));
    if (n != static_cast<ssize_t>(len)) {
      ::close(fd);
      return absl::DataLossError(
          absl::StrCat(t.file, ": reading columns of tensor '", t.name, "' failed"));
    }
  }
  ::close(fd);
  owned_.push_back(std::move(buf));
  return backend_->Upload(WeightMatrix{t.dtype, owned_.back().get(), rows, width, width});
}

absl::StatusOr<const float*> Transformer::VectorSlice(const TensorView& t, int64_t begin,
                                                      int64_t end) {
  if (IsStorageOnly(t.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' is ", DTypeName(t.dtype),
                                                   "; a vector must be F32, F16 or BF16"));
  }
  std::vector<float> v(end - begin);
  cpu::ToFloat(t.dtype, static_cast<const uint8_t*>(t.data) + DTypeBytes(t.dtype, begin),
               end - begin, v.data());
  return backend_->Upload(v);
}

absl::StatusOr<ExpertTable> Transformer::TableOf(const std::vector<const WeightMatrix*>& mats) {
  if (mats.empty()) return ExpertTable();
  std::vector<const void*> ptrs;
  for (const WeightMatrix* m : mats) {
    if (m->dtype != mats[0]->dtype) return ExpertTable();
    ptrs.push_back(m->data);
  }
  tables_.push_back(backend_->NewBuffer());
  Buffer& b = *tables_.back();
  RETURN_IF_ERROR(b.Reserve(ptrs.size() * sizeof(void*)));
  RETURN_IF_ERROR(backend_->CopyFromHost(b.data(), ptrs.data(), ptrs.size() * sizeof(void*)));
  return ExpertTable{mats[0]->dtype, b.as<const void* const>(),
                     expert_begin_,  static_cast<int64_t>(mats.size()),
                     mats[0]->rows,  mats[0]->cols};
}

std::vector<FileRange> Transformer::StagePieces() const {
  const ModelConfig& c = config_;
  const std::string head = c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
  std::vector<FileRange> ranges;
  for (const auto& [name, t] : weights_->tensors()) {
    bool mine = (first_stage() && name == "model.embed_tokens.weight") ||
                (last_stage() && (name == head || name == "model.norm.weight"));
    int64_t layer = -1;
    if (absl::StartsWith(name, "model.layers.")) {
      const std::string rest = name.substr(13);
      mine |= absl::SimpleAtoi(rest.substr(0, rest.find('.')), &layer) && layer >= layer_begin_ &&
              layer < layer_end_;
    }
    if (mine && !t.file.empty() && t.nbytes > 0)
      ranges.push_back({t.file, t.file_offset, t.nbytes});
  }
  return Pieces(std::move(ranges), uint64_t{16} << 20);
}

absl::Status Transformer::BindKvFormat() {
  switch (options_.kv_cache_dtype) {
    case KvCacheDtype::kAuto:
      kv_format_.dtype = config_.kv_auto_dtype;
      break;
    case KvCacheDtype::kF32:
      kv_format_.dtype = DType::kF32;
      break;
    case KvCacheDtype::kBF16:
      kv_format_.dtype = DType::kBF16;
      break;
    case KvCacheDtype::kF16:
      kv_format_.dtype = DType::kF16;
      break;
    case KvCacheDtype::kFP8:
      kv_format_.dtype = DType::kF8E4M3;
      break;
  }
  if (kv_format_.dtype != DType::kF8E4M3) return absl::OkStatus();
  const WeightStore& w = *weights_;
  // One scale: a tensor of one F32, F16 or BF16 value, finite and positive.
  auto scale_of = [&](const std::string& p, const char* kind) -> absl::StatusOr<float> {
    for (const std::string& name : {absl::StrCat(p, "self_attn.", kind, "_scale"),
                                    absl::StrCat(p, "self_attn.", kind, "_proj.output_scale")}) {
      if (!w.Has(name)) continue;
      ASSIGN_OR_RETURN(TensorView t, w.Get(name));
      int64_t n = 1;
      for (int64_t d : t.shape) n *= d;
      if (n != 1 || (t.dtype != DType::kF32 && t.dtype != DType::kF16 && t.dtype != DType::kBF16)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor '", name, "' must be one F32, F16 or BF16 value (a KV cache scale), not ", n,
            " of ", DTypeName(t.dtype)));
      }
      float v = 0;
      cpu::ToFloat(t.dtype, t.data, 1, &v);
      if (!(v > 0) || !std::isfinite(v)) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor '", name, "' is ", v, ", not a finite positive KV cache scale"));
      }
      return v;
    }
    return 1.f;
  };
  kv_format_.k_scale.clear();
  kv_format_.v_scale.clear();
  // The stage's layers, then the MTP layer's (model layer num_layers) where it has one.
  for (int64_t i = layer_begin_; i < layer_begin_ + kv_layers(); ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    ASSIGN_OR_RETURN(const float k, scale_of(p, "k"));
    ASSIGN_OR_RETURN(const float v, scale_of(p, "v"));
    kv_format_.k_scale.push_back(k);
    kv_format_.v_scale.push_back(v);
  }
  return absl::OkStatus();
}

absl::Status Transformer::BindWeights() {
  const ModelConfig& c = config_;
  const int T = options_.tp_size, t = options_.tp_rank;
  const int64_t H = c.hidden_size, V = c.vocab_size;
  layer_begin_ = options_.layer_begin;
  layer_end_ = options_.layer_end < 0 ? c.num_layers : options_.layer_end;
  heads_ = c.num_heads / T;
  if (c.num_kv_heads >= T) {
    kv_heads_ = c.num_kv_heads / T;
    kv_head_begin_ = t * kv_heads_;
  } else {  // more ranks than KV heads: each rank holds the one KV head its query heads use
    kv_heads_ = 1;
    kv_head_begin_ = t * heads_ / (c.num_heads / c.num_kv_heads);
  }
  expert_begin_ = c.moe ? t * c.num_experts / T : 0;
  expert_end_ = c.moe ? (t + 1) * c.num_experts / T : 0;
  vocab_begin_ = V * t / T;
  vocab_end_ = V * (t + 1) / T;

  const WeightStore& w = *weights_;
  // The stage's share of the weight files read into the page cache by threads of their own while
  // the layers are bound, so that the disk works beside the conversions; binding a layer the
  // readers have not reached yet faults its pages in itself. The TP group reads a share each:
  // the node reads each byte once.
  std::thread reader;
  if (options_.read_threads > 0) {
    reader = std::thread([this, pieces = StagePieces()] {
      absl::StatusOr<int64_t> read =
          ReadIntoPageCache(pieces, options_.read_threads, options_.tp_rank, options_.tp_size);
      if (!read.ok()) LogWarning("reading the weights ahead: ", read.status().message());
    });
  }
  absl::Cleanup join_reader = [&reader] {
    if (reader.joinable()) reader.join();
  };
  const int64_t units = layer_end_ - layer_begin_ + 1;  // the layers, and the rest as one
  auto progress = [&](int64_t done) {
    if (options_.progress) options_.progress(static_cast<double>(done) / units);
  };
  progress(0);
  if (first_stage()) {
    ASSIGN_OR_RETURN(TensorView embed, w.Get("model.embed_tokens.weight", {V, H}));
    ASSIGN_OR_RETURN(embed_, Rows(embed, vocab_begin_, vocab_end_));
  }
  if (last_stage()) {
    const char* head_name = c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
    ASSIGN_OR_RETURN(TensorView head, w.Get(head_name, {V, H}));
    ASSIGN_OR_RETURN(lm_head_, Rows(head, vocab_begin_, vocab_end_));
    ASSIGN_OR_RETURN(TensorView norm, w.Get("model.norm.weight", {H}));
    ASSIGN_OR_RETURN(final_norm_, VectorSlice(norm, 0, H));
  }
  ASSIGN_OR_RETURN(inv_freq_, backend_->Upload(RopeInvFreq(c)));
  progress(1);
  layers_.resize(layer_end_ - layer_begin_);
  for (int64_t i = layer_begin_; i < layer_end_; ++i) {
    RETURN_IF_ERROR(BindLayer(layers_[i - layer_begin_], i));
    progress(i - layer_begin_ + 2);
  }
  if (options_.mtp && last_stage()) RETURN_IF_ERROR(BindMtp());
  return BindKvFormat();
}

absl::Status Transformer::BindLayer(Layer& L, int64_t i) {
  const ModelConfig& c = config_;
  const int T = options_.tp_size, t = options_.tp_rank;
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  const int64_t q0 = t * heads_ * hd, q1 = q0 + heads_ * hd;
  const int64_t k0 = kv_head_begin_ * hd, k1 = k0 + kv_heads_ * hd;
  const WeightStore& w = *weights_;
  const std::string p = absl::StrCat("model.layers.", i, ".");
  ASSIGN_OR_RETURN(TensorView in_norm, w.Get(p + "input_layernorm.weight", {H}));
  ASSIGN_OR_RETURN(TensorView post_norm, w.Get(p + "post_attention_layernorm.weight", {H}));
  ASSIGN_OR_RETURN(L.input_norm, VectorSlice(in_norm, 0, H));
  ASSIGN_OR_RETURN(L.post_norm, VectorSlice(post_norm, 0, H));
  L.sparse = c.moe_layer(i);
  L.window = c.window(i);
  if (c.mla) {
    RETURN_IF_ERROR(BindLatentAttention(L, p));
  } else {
    RETURN_IF_ERROR(BindAttention(L, p, q0, q1, k0, k1));
  }
  if (L.sparse) return c.gpt_oss ? BindFusedExperts(L, p) : BindExperts(L, p);
  // Dense: DeepSeek-V3's first layers have their own size.
  const int64_t DI = c.first_dense_layers > 0 ? c.dense_intermediate_size : I;
  ASSIGN_OR_RETURN(TensorView gate, w.Get(p + "mlp.gate_proj.weight", {DI, H}));
  ASSIGN_OR_RETURN(TensorView up, w.Get(p + "mlp.up_proj.weight", {DI, H}));
  ASSIGN_OR_RETURN(TensorView down, w.Get(p + "mlp.down_proj.weight", {H, DI}));
  const int64_t i0 = t * DI / T, i1 = (t + 1) * DI / T;
  ASSIGN_OR_RETURN(L.gate, Rows(gate, i0, i1));  // column-parallel
  ASSIGN_OR_RETURN(L.up, Rows(up, i0, i1));
  ASSIGN_OR_RETURN(L.down, Cols(down, i0, i1));  // row-parallel
  return absl::OkStatus();
}

absl::Status Transformer::BindMtp() {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, V = c.vocab_size, n = c.num_layers;
  if (c.mtp_layers < 1 || !c.mla) {
    return absl::InvalidArgumentError(
        "speculative method mtp needs a DeepSeek-V3 checkpoint with its multi-token-prediction "
        "layer (num_nextn_predict_layers in config.json); this model has none");
  }
  const WeightStore& w = *weights_;
  const std::string p = absl::StrCat("model.layers.", n, ".");
  RETURN_IF_ERROR(BindLayer(mtp_.layer, n));
  ASSIGN_OR_RETURN(TensorView hnorm, w.Get(p + "hnorm.weight", {H}));
  // A GGUF may leave out the shared head's norm (llama.cpp then uses the model's final one).
  const std::string own_norm = p + "shared_head.norm.weight";
  ASSIGN_OR_RETURN(TensorView norm, w.Get(w.Has(own_norm) ? own_norm : "model.norm.weight", {H}));
  ASSIGN_OR_RETURN(TensorView eh, w.Get(p + "eh_proj.weight", {H, 2 * H}));
  ASSIGN_OR_RETURN(mtp_.hnorm, VectorSlice(hnorm, 0, H));
  ASSIGN_OR_RETURN(mtp_.norm, VectorSlice(norm, 0, H));
  // eh_proj reads [embedding, hidden state]: its two halves of columns, each rank all rows.
  ASSIGN_OR_RETURN(mtp_.eh_embed, Cols(eh, 0, H));
  ASSIGN_OR_RETURN(mtp_.eh_hidden, Cols(eh, H, 2 * H));
  // The checkpoint's MTP layer carries its own copies of the embedding and the head (DeepSeek-V3
  // shares them with the model's); a file without them (a GGUF may) uses the model's.
  auto vocab_rows = [&](const std::string& own, const std::string& model) {
    return w.Get(w.Has(own) ? own : model, {V, H});
  };
  ASSIGN_OR_RETURN(TensorView embed,
                   vocab_rows(p + "embed_tokens.weight", "model.embed_tokens.weight"));
  ASSIGN_OR_RETURN(TensorView head, vocab_rows(p + "shared_head.head.weight",
                                               c.tie_word_embeddings ? "model.embed_tokens.weight"
                                                                     : "lm_head.weight"));
  ASSIGN_OR_RETURN(mtp_.embed, Rows(embed, vocab_begin_, vocab_end_));
  ASSIGN_OR_RETURN(mtp_.head, Rows(head, vocab_begin_, vocab_end_));
  // Set last: has_mtp() says the layer is whole.
  ASSIGN_OR_RETURN(TensorView enorm, w.Get(p + "enorm.weight", {H}));
  ASSIGN_OR_RETURN(mtp_.enorm, VectorSlice(enorm, 0, H));
  return absl::OkStatus();
}

absl::Status Transformer::BindAttention(Layer& L, const std::string& p, int64_t q0, int64_t q1,
                                        int64_t k0, int64_t k1) {
  const ModelConfig& c = config_;
  const WeightStore& w = *weights_;
  const int64_t H = c.hidden_size, hd = c.head_dim;
  ASSIGN_OR_RETURN(TensorView q, w.Get(p + "self_attn.q_proj.weight", {c.q_dim(), H}));
  ASSIGN_OR_RETURN(TensorView k, w.Get(p + "self_attn.k_proj.weight", {c.kv_dim(), H}));
  ASSIGN_OR_RETURN(TensorView v, w.Get(p + "self_attn.v_proj.weight", {c.kv_dim(), H}));
  ASSIGN_OR_RETURN(TensorView o, w.Get(p + "self_attn.o_proj.weight", {H, c.q_dim()}));
  // Column-parallel q/k/v: this rank's heads (output rows); row-parallel o: their columns.
  ASSIGN_OR_RETURN(L.q, Rows(q, q0, q1));
  ASSIGN_OR_RETURN(L.k, Rows(k, k0, k1));
  ASSIGN_OR_RETURN(L.v, Rows(v, k0, k1));
  ASSIGN_OR_RETURN(L.o, Cols(o, q0, q1));
  if (c.qkv_bias) {
    ASSIGN_OR_RETURN(TensorView qb, w.Get(p + "self_attn.q_proj.bias", {c.q_dim()}));
    ASSIGN_OR_RETURN(TensorView kb, w.Get(p + "self_attn.k_proj.bias", {c.kv_dim()}));
    ASSIGN_OR_RETURN(TensorView vb, w.Get(p + "self_attn.v_proj.bias", {c.kv_dim()}));
    ASSIGN_OR_RETURN(L.q_bias, VectorSlice(qb, q0, q1));
    ASSIGN_OR_RETURN(L.k_bias, VectorSlice(kb, k0, k1));
    ASSIGN_OR_RETURN(L.v_bias, VectorSlice(vb, k0, k1));
  }
  if (c.qk_norm) {  // over each head's head_dim, the same weights for every head
    ASSIGN_OR_RETURN(TensorView qn, w.Get(p + "self_attn.q_norm.weight", {hd}));
    ASSIGN_OR_RETURN(TensorView kn, w.Get(p + "self_attn.k_norm.weight", {hd}));
    ASSIGN_OR_RETURN(L.q_norm, VectorSlice(qn, 0, hd));
    ASSIGN_OR_RETURN(L.k_norm, VectorSlice(kn, 0, hd));
  }
  if (c.o_bias) {  // added once, after the all-reduce
    ASSIGN_OR_RETURN(TensorView ob, w.Get(p + "self_attn.o_proj.bias", {H}));
    ASSIGN_OR_RETURN(L.o_bias, VectorSlice(ob, 0, H));
  }
  if (c.gpt_oss) {  // this rank's heads' sinks
    ASSIGN_OR_RETURN(TensorView sinks, w.Get(p + "self_attn.sinks", {c.num_heads}));
    const int64_t h0 = options_.tp_rank * heads_;
    ASSIGN_OR_RETURN(L.sinks, VectorSlice(sinks, h0, h0 + heads_));
  }
  return absl::OkStatus();
}

absl::StatusOr<WeightMatrix> Transformer::ExpertColumns(const TensorView& t, int64_t e,
                                                        int64_t first, int64_t step, int64_t n) {
  const int64_t rows = t.shape[1], cols = t.shape[2];
  if (t.dtype != DType::kF32 && t.dtype != DType::kF16 && t.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' is ", DTypeName(t.dtype),
                                                   "; fused experts take F32, F16 or BF16"));
  }
  const size_t elem = DTypeSize(t.dtype);
  auto out =
      std::unique_ptr<uint8_t[]>(new (std::nothrow) uint8_t[std::max<size_t>(n * rows * elem, 1)]);
  if (out == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", n * rows * elem,
                                                     " bytes for an expert of '", t.name, "'"));
  }
  const uint8_t* block = static_cast<const uint8_t*>(t.data) + e * rows * cols * elem;
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(out.get() + (j * rows + r) * elem, block + (r * cols + first + j * step) * elem,
                  elem);
    }
  }
  shard_bytes_ += n * rows * elem;
  owned_.push_back(std::move(out));
  return backend_->Upload(WeightMatrix{t.dtype, owned_.back().get(), n, rows, rows});
}

absl::StatusOr<const float*> Transformer::ExpertBias(const TensorView& t, int64_t e, int64_t first,
                                                     int64_t step, int64_t n) {
  const int64_t cols = t.shape[1];
  if (t.dtype != DType::kF32 && t.dtype != DType::kF16 && t.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' is ", DTypeName(t.dtype),
                                                   "; biases are F32, F16 or BF16"));
  }
  std::vector<float> row(cols), picked(n);
  cpu::ToFloat(t.dtype, static_cast<const uint8_t*>(t.data) + DTypeBytes(t.dtype, e * cols), cols,
               row.data());
  for (int64_t j = 0; j < n; ++j) picked[j] = row[first + j * step];
  return backend_->Upload(picked);
}

absl::StatusOr<WeightMatrix> Transformer::Mxfp4Rows(const TensorView& blocks,
                                                    const TensorView& scales, int64_t first,
                                                    int64_t step, int64_t n, int64_t cols) {
  const DType to = config_.dtype;
  const size_t row = cols * DTypeSize(to);
  auto out = std::unique_ptr<uint8_t[]>(new (std::nothrow) uint8_t[std::max<size_t>(n * row, 1)]);
  if (out == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", n * row, " bytes to expand '", blocks.name, "'"));
  }
  for (int64_t j = 0; j < n; ++j) {
    RETURN_IF_ERROR(
        ExpandMxfp4Row(blocks, scales, first + j * step, cols, to, out.get() + j * row));
  }
  shard_bytes_ += n * row;
  owned_.push_back(std::move(out));
  return backend_->Upload(WeightMatrix{to, owned_.back().get(), n, cols, cols});
}

absl::Status Transformer::BindFusedExperts(Layer& L, const std::string& p) {
  const ModelConfig& c = config_;
  const WeightStore& w = *weights_;
  const int64_t H = c.hidden_size, I = c.intermediate_size, E = c.num_experts;
  const std::string m = p + "mlp.";
  ASSIGN_OR_RETURN(TensorView router, w.Get(m + "router.weight", {E, H}));
  ASSIGN_OR_RETURN(TensorView router_bias, w.Get(m + "router.bias", {E}));
  ASSIGN_OR_RETURN(L.router, Rows(router, 0, E));  // replicated: every rank routes every token
  ASSIGN_OR_RETURN(L.router_bias, VectorSlice(router_bias, 0, E));
  ASSIGN_OR_RETURN(TensorView down_bias, w.Get(m + "experts.down_proj_bias", {E, H}));
  if (w.Has(m + "experts.gate_proj_bias")) {  // GGUF: gate and up apart, each expert [out][in]
    ASSIGN_OR_RETURN(TensorView gate_bias, w.Get(m + "experts.gate_proj_bias", {E, I}));
    ASSIGN_OR_RETURN(TensorView up_bias, w.Get(m + "experts.up_proj_bias", {E, I}));
    for (int64_t e = expert_begin_; e < expert_end_; ++e) {
      const std::string ep = absl::StrCat(m, "experts.", e, ".");
      ASSIGN_OR_RETURN(TensorView gate, w.Get(ep + "gate_proj.weight", {I, H}));
      ASSIGN_OR_RETURN(TensorView up, w.Get(ep + "up_proj.weight", {I, H}));
      ASSIGN_OR_RETURN(TensorView down, w.Get(ep + "down_proj.weight", {H, I}));
      Expert x;
      ASSIGN_OR_RETURN(x.gate_bias, ExpertBias(gate_bias, e, 0, 1, I));
      ASSIGN_OR_RETURN(x.up_bias, ExpertBias(up_bias, e, 0, 1, I));
      ASSIGN_OR_RETURN(x.down_bias, ExpertBias(down_bias, e, 0, 1, H));
      ASSIGN_OR_RETURN(x.gate, Rows(gate, 0, I));
      ASSIGN_OR_RETURN(x.up, Rows(up, 0, I));
      ASSIGN_OR_RETURN(x.down, Rows(down, 0, H));
      L.experts.push_back(x);
    }
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(TensorView gate_up_bias, w.Get(m + "experts.gate_up_proj_bias", {E, 2 * I}));
  for (int64_t e = expert_begin_; e < expert_end_; ++e) {
    Expert x;
    ASSIGN_OR_RETURN(x.gate_bias, ExpertBias(gate_up_bias, e, 0, 2, I));
    ASSIGN_OR_RETURN(x.up_bias, ExpertBias(gate_up_bias, e, 1, 2, I));
    ASSIGN_OR_RETURN(x.down_bias, ExpertBias(down_bias, e, 0, 1, H));
    L.experts.push_back(x);
  }
  if (c.mxfp4()) {  // [E][out][in / 32] blocks and scales; gate: even rows of gate_up, up: odd
    for (const auto& [field, value] : {std::pair{"hidden_size", H}, {"intermediate_size", I}}) {
      if (value % kMxfp4Block != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, " ", value, " is not a multiple of MXFP4's blocks of ", kMxfp4Block));
      }
    }
    const int64_t gh = H / kMxfp4Block, gi = I / kMxfp4Block;
    ASSIGN_OR_RETURN(TensorView gub, w.Get(m + "experts.gate_up_proj_blocks", {E, 2 * I, gh, 16}));
    ASSIGN_OR_RETURN(TensorView gus, w.Get(m + "experts.gate_up_proj_scales", {E, 2 * I, gh}));
    ASSIGN_OR_RETURN(TensorView db, w.Get(m + "experts.down_proj_blocks", {E, H, gi, 16}));
    ASSIGN_OR_RETURN(TensorView ds, w.Get(m + "experts.down_proj_scales", {E, H, gi}));
    for (int64_t e = expert_begin_; e < expert_end_; ++e) {
      Expert& x = L.experts[e - expert_begin_];
      ASSIGN_OR_RETURN(x.gate, Mxfp4Rows(gub, gus, e * 2 * I, 2, I, H));
      ASSIGN_OR_RETURN(x.up, Mxfp4Rows(gub, gus, e * 2 * I + 1, 2, I, H));
      ASSIGN_OR_RETURN(x.down, Mxfp4Rows(db, ds, e * H, 1, H, I));
    }
    stage_bytes_ += gub.nbytes + gus.nbytes + db.nbytes + ds.nbytes;
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(TensorView gate_up, w.Get(m + "experts.gate_up_proj", {E, H, 2 * I}));
  ASSIGN_OR_RETURN(TensorView down, w.Get(m + "experts.down_proj", {E, I, H}));
  for (int64_t e = expert_begin_; e < expert_end_; ++e) {  // gate: even columns, up: odd
    Expert& x = L.experts[e - expert_begin_];
    ASSIGN_OR_RETURN(x.gate, ExpertColumns(gate_up, e, 0, 2, I));
    ASSIGN_OR_RETURN(x.up, ExpertColumns(gate_up, e, 1, 2, I));
    ASSIGN_OR_RETURN(x.down, ExpertColumns(down, e, 0, 1, H));
  }
  stage_bytes_ += gate_up.nbytes + down.nbytes;
  return absl::OkStatus();
}

absl::Status Transformer::BindExperts(Layer& L, const std::string& p) {
  const ModelConfig& c = config_;
  const WeightStore& w = *weights_;
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  // Mixtral's names, or Qwen3-MoE's and DeepSeek-V3's (mlp.gate, mlp.experts.E.gate_proj/...).
  const bool mixtral = c.architecture == "MixtralForCausalLM";
  const std::string m = p + (mixtral ? "block_sparse_moe." : "mlp.");
  ASSIGN_OR_RETURN(TensorView router, w.Get(m + "gate.weight", {c.num_experts, H}));
  // Replicated: every rank routes every token.
  ASSIGN_OR_RETURN(L.router, Rows(router, 0, c.num_experts));
  if (c.sigmoid_routing) {
    ASSIGN_OR_RETURN(TensorView bias, w.Get(m + "gate.e_score_correction_bias", {c.num_experts}));
    ASSIGN_OR_RETURN(L.route_bias, VectorSlice(bias, 0, c.num_experts));
  }
  for (int64_t e = 0; e < c.num_experts; ++e) {
    const std::string ep = absl::StrCat(m, "experts.", e, ".");
    ASSIGN_OR_RETURN(TensorView w1, w.Get(ep + (mixtral ? "w1" : "gate_proj") + ".weight", {I, H}));
    ASSIGN_OR_RETURN(TensorView w2, w.Get(ep + (mixtral ? "w2" : "down_proj") + ".weight", {H, I}));
    ASSIGN_OR_RETURN(TensorView w3, w.Get(ep + (mixtral ? "w3" : "up_proj") + ".weight", {I, H}));
    if (e >= expert_begin_ && e < expert_end_) {  // expert parallelism inside the stage
      Expert x;
      ASSIGN_OR_RETURN(x.gate, Rows(w1, 0, I));
      ASSIGN_OR_RETURN(x.up, Rows(w3, 0, I));
      ASSIGN_OR_RETURN(x.down, Rows(w2, 0, H));
      L.experts.push_back(x);
    }
  }
  std::vector<const WeightMatrix*> gates, ups, downs;
  for (const Expert& x : L.experts) {
    gates.push_back(&x.gate);
    ups.push_back(&x.up);
    downs.push_back(&x.down);
  }
  ASSIGN_OR_RETURN(L.gate_table, TableOf(gates));
  ASSIGN_OR_RETURN(L.up_table, TableOf(ups));
  ASSIGN_OR_RETURN(L.down_table, TableOf(downs));
  if (c.shared_experts > 0) {  // one MLP of n_shared x the experts' size, TP-sliced as a dense one
    const int64_t S = c.shared_experts * I, T = options_.tp_size, t = options_.tp_rank;
    const std::string sp = m + "shared_experts.";
    ASSIGN_OR_RETURN(TensorView gate, w.Get(sp + "gate_proj.weight", {S, H}));
    ASSIGN_OR_RETURN(TensorView up, w.Get(sp + "up_proj.weight", {S, H}));
    ASSIGN_OR_RETURN(TensorView down, w.Get(sp + "down_proj.weight", {H, S}));
    const int64_t s0 = t * S / T, s1 = (t + 1) * S / T;
    ASSIGN_OR_RETURN(L.shared_gate, Rows(gate, s0, s1));
    ASSIGN_OR_RETURN(L.shared_up, Rows(up, s0, s1));
    ASSIGN_OR_RETURN(L.shared_down, Cols(down, s0, s1));
  }
  return absl::OkStatus();
}

}  // namespace shardserve
