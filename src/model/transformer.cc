#include "model/transformer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardserve {
namespace {

void AddBias(float* y, int64_t rows, int64_t dim, const std::vector<float>& bias) {
  if (bias.empty()) return;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < dim; ++i) y[r * dim + i] += bias[i];
  }
}

absl::Status Divisible(const char* what, int64_t n, int tp) {
  if (n % tp == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, " ", n, " is not divisible by tensor parallelism ", tp));
}

}  // namespace

std::vector<std::vector<std::pair<int64_t, float>>> RouteExperts(const float* router, int64_t rows,
                                                                 int64_t E, int64_t top_k) {
  std::vector<std::vector<std::pair<int64_t, float>>> assigned(E);
  std::vector<int64_t> order(E);
  for (int64_t r = 0; r < rows; ++r) {
    const float* logit = router + r * E;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int64_t a, int64_t b) {
      return logit[a] > logit[b] || (logit[a] == logit[b] && a < b);
    });
    const float mx = logit[order[0]];
    float sum = 0;
    for (int64_t j = 0; j < top_k; ++j) sum += std::exp(logit[order[j]] - mx);
    for (int64_t j = 0; j < top_k; ++j) {
      assigned[order[j]].push_back({r, std::exp(logit[order[j]] - mx) / sum});
    }
  }
  return assigned;
}

Transformer::Transformer(ModelConfig config, std::unique_ptr<WeightStore> weights,
                         const Options& options)
    : config_(std::move(config)),
      options_(options),
      weights_(std::move(weights)),
      pool_(std::make_unique<ThreadPool>(options.num_threads)),
      rope_(config_) {}

absl::StatusOr<std::unique_ptr<Transformer>> Transformer::Load(const std::string& model_dir,
                                                               const Options& options) {
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(model_dir));
  ASSIGN_OR_RETURN(auto weights, WeightStore::Open(model_dir));
  std::unique_ptr<Transformer> t(new Transformer(std::move(config), std::move(weights), options));
  absl::Status s = t->CheckSplit();
  if (s.ok()) s = t->BindWeights();
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(model_dir, ": ", s.message()));
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
  if (c.num_kv_heads % T != 0 && T % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_key_value_heads ", c.num_kv_heads,
                                                   " and tensor parallelism ", T,
                                                   ": one must divide the other"));
  }
  if (c.moe) {
    RETURN_IF_ERROR(Divisible("num_local_experts", c.num_experts, T));
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

cpu::WeightMatrix Transformer::Rows(const TensorView& t, int64_t begin, int64_t end) {
  const int64_t cols = t.shape[1];
  const size_t elem = DTypeSize(t.dtype);
  shard_bytes_ += (end - begin) * cols * elem;
  stage_bytes_ += t.nbytes;
  return {t.dtype, static_cast<const uint8_t*>(t.data) + begin * cols * elem, end - begin, cols,
          cols};
}

absl::StatusOr<cpu::WeightMatrix> Transformer::Cols(const TensorView& t, int64_t begin,
                                                    int64_t end) {
  const int64_t rows = t.shape[0], cols = t.shape[1], width = end - begin;
  const size_t elem = DTypeSize(t.dtype);
  shard_bytes_ += rows * width * elem;
  stage_bytes_ += t.nbytes;
  if (width == cols) return cpu::WeightMatrix{t.dtype, t.data, rows, cols, cols};
  const int fd = ::open(t.file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat(t.file, ": cannot open: ", std::strerror(errno)));
  }
  auto buf = std::make_unique<uint8_t[]>(rows * width * elem);
  for (int64_t r = 0; r < rows; ++r) {
    const size_t len = width * elem;
    const ssize_t n = ::pread(fd, buf.get() + r * len, len,
                              static_cast<off_t>(t.file_offset + (r * cols + begin) * elem));
    if (n != static_cast<ssize_t>(len)) {
      ::close(fd);
      return absl::DataLossError(
          absl::StrCat(t.file, ": reading columns of tensor '", t.name, "' failed"));
    }
  }
  ::close(fd);
  owned_.push_back(std::move(buf));
  return cpu::WeightMatrix{t.dtype, owned_.back().get(), rows, width, width};
}

std::vector<float> Transformer::VectorSlice(const TensorView& t, int64_t begin, int64_t end) {
  std::vector<float> v(end - begin);
  cpu::ToFloat(t.dtype, static_cast<const uint8_t*>(t.data) + begin * DTypeSize(t.dtype),
               end - begin, v.data());
  return v;
}

absl::Status Transformer::BindWeights() {
  const ModelConfig& c = config_;
  const int T = options_.tp_size, t = options_.tp_rank;
  const int64_t H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size, hd = c.head_dim;
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
  inter_ = c.moe ? I : I / T;
  expert_begin_ = c.moe ? t * c.num_experts / T : 0;
  expert_end_ = c.moe ? (t + 1) * c.num_experts / T : 0;
  vocab_begin_ = V * t / T;
  vocab_end_ = V * (t + 1) / T;

  const WeightStore& w = *weights_;
  if (first_stage()) {
    ASSIGN_OR_RETURN(TensorView embed, w.Get("model.embed_tokens.weight", {V, H}));
    embed_ = Rows(embed, vocab_begin_, vocab_end_);
  }
  if (last_stage()) {
    const char* head_name = c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
    ASSIGN_OR_RETURN(TensorView head, w.Get(head_name, {V, H}));
    lm_head_ = Rows(head, vocab_begin_, vocab_end_);
    ASSIGN_OR_RETURN(TensorView norm, w.Get("model.norm.weight", {H}));
    final_norm_ = VectorSlice(norm, 0, H);
  }
  const int64_t q0 = t * heads_ * hd, q1 = q0 + heads_ * hd;
  const int64_t k0 = kv_head_begin_ * hd, k1 = k0 + kv_heads_ * hd;
  layers_.resize(layer_end_ - layer_begin_);
  for (int64_t i = layer_begin_; i < layer_end_; ++i) {
    Layer& L = layers_[i - layer_begin_];
    const std::string p = absl::StrCat("model.layers.", i, ".");
    ASSIGN_OR_RETURN(TensorView in_norm, w.Get(p + "input_layernorm.weight", {H}));
    ASSIGN_OR_RETURN(TensorView post_norm, w.Get(p + "post_attention_layernorm.weight", {H}));
    L.input_norm = VectorSlice(in_norm, 0, H);
    L.post_norm = VectorSlice(post_norm, 0, H);
    ASSIGN_OR_RETURN(TensorView q, w.Get(p + "self_attn.q_proj.weight", {c.q_dim(), H}));
    ASSIGN_OR_RETURN(TensorView k, w.Get(p + "self_attn.k_proj.weight", {c.kv_dim(), H}));
    ASSIGN_OR_RETURN(TensorView v, w.Get(p + "self_attn.v_proj.weight", {c.kv_dim(), H}));
    ASSIGN_OR_RETURN(TensorView o, w.Get(p + "self_attn.o_proj.weight", {H, c.q_dim()}));
    // Column-parallel q/k/v: this rank's heads (output rows); row-parallel o: their columns.
    L.q = Rows(q, q0, q1);
    L.k = Rows(k, k0, k1);
    L.v = Rows(v, k0, k1);
    ASSIGN_OR_RETURN(L.o, Cols(o, q0, q1));
    if (c.qkv_bias) {
      ASSIGN_OR_RETURN(TensorView qb, w.Get(p + "self_attn.q_proj.bias", {c.q_dim()}));
      ASSIGN_OR_RETURN(TensorView kb, w.Get(p + "self_attn.k_proj.bias", {c.kv_dim()}));
      ASSIGN_OR_RETURN(TensorView vb, w.Get(p + "self_attn.v_proj.bias", {c.kv_dim()}));
      L.q_bias = VectorSlice(qb, q0, q1);
      L.k_bias = VectorSlice(kb, k0, k1);
      L.v_bias = VectorSlice(vb, k0, k1);
    }
    if (c.o_bias) {  // added once, after the all-reduce
      ASSIGN_OR_RETURN(TensorView ob, w.Get(p + "self_attn.o_proj.bias", {H}));
      L.o_bias = VectorSlice(ob, 0, H);
    }
    if (c.moe) {
      const std::string m = p + "block_sparse_moe.";
      ASSIGN_OR_RETURN(TensorView router, w.Get(m + "gate.weight", {c.num_experts, H}));
      L.router = Rows(router, 0, c.num_experts);  // replicated: every rank routes every token
      L.experts.resize(c.num_experts);
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const std::string ep = absl::StrCat(m, "experts.", e, ".");
        ASSIGN_OR_RETURN(TensorView w1, w.Get(ep + "w1.weight", {I, H}));
        ASSIGN_OR_RETURN(TensorView w2, w.Get(ep + "w2.weight", {H, I}));
        ASSIGN_OR_RETURN(TensorView w3, w.Get(ep + "w3.weight", {I, H}));
        if (e >= expert_begin_ && e < expert_end_) {  // expert parallelism inside the stage
          L.experts[e] = {Rows(w1, 0, I), Rows(w3, 0, I), Rows(w2, 0, H)};
        }
      }
    } else {
      ASSIGN_OR_RETURN(TensorView gate, w.Get(p + "mlp.gate_proj.weight", {I, H}));
      ASSIGN_OR_RETURN(TensorView up, w.Get(p + "mlp.up_proj.weight", {I, H}));
      ASSIGN_OR_RETURN(TensorView down, w.Get(p + "mlp.down_proj.weight", {H, I}));
      const int64_t i0 = t * inter_, i1 = i0 + inter_;
      L.gate = Rows(gate, i0, i1);  // column-parallel
      L.up = Rows(up, i0, i1);
      ASSIGN_OR_RETURN(L.down, Cols(down, i0, i1));  // row-parallel
    }
  }
  return absl::OkStatus();
}

std::unique_ptr<KvCache> Transformer::NewKvCache(int64_t positions, int64_t block_size) const {
  const int64_t blocks = std::max<int64_t>(1, (positions + block_size - 1) / block_size);
  return std::make_unique<KvCache>(layer_end_ - layer_begin_, kv_heads_, config_.head_dim,
                                   block_size, blocks);
}

absl::Status Transformer::AllReduce(float* data, size_t count) {
  if (options_.tp_size == 1) return absl::OkStatus();
  return options_.tp_comm->AllReduceSum(data, count);
}

absl::Status Transformer::Forward(std::vector<SequenceChunk>& chunks, KvCache& cache,
                                  std::vector<float>& logits) {
  if (!first_stage() || !last_stage()) {
    return absl::FailedPreconditionError("Forward runs a whole model; a stage uses ForwardStage");
  }
  std::vector<float> local;
  RETURN_IF_ERROR(ForwardStage(chunks, cache, nullptr, local));
  return GatherLogits(local, static_cast<int64_t>(chunks.size()), logits);
}

absl::Status Transformer::GatherLogits(const std::vector<float>& local, int64_t rows,
                                       std::vector<float>& logits) {
  return GatherVocabSlices(local, rows, config_.vocab_size, options_.tp_size, options_.tp_comm,
                           logits);
}

absl::Status GatherVocabSlices(const std::vector<float>& local, int64_t rows, int64_t V, int T,
                               Communicator* comm, std::vector<float>& logits) {
  if (T == 1) {  // the stride is the vocabulary
    logits = local;
    return absl::OkStatus();
  }
  const int64_t stride = (V + T - 1) / T;
  std::vector<float> all(T * rows * stride);
  RETURN_IF_ERROR(comm->AllGather(local.data(), rows * stride, all.data()));
  logits.resize(rows * V);
  for (int m = 0; m < T; ++m) {
    const int64_t v0 = V * m / T, n = V * (m + 1) / T - v0;
    for (int64_t s = 0; s < rows; ++s) {
      std::copy_n(all.data() + (m * rows + s) * stride, n, logits.data() + s * V + v0);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<PreparedBatch> Transformer::PrepareBatch(std::vector<SequenceChunk>& chunks,
                                                        KvCache& cache) const {
  const ModelConfig& c = config_;
  // Validate everything before touching the cache.
  PreparedBatch b;
  int64_t extra_blocks = 0;
  for (const SequenceChunk& ch : chunks) {
    if (ch.tokens.empty() || ch.kv == nullptr) {
      return absl::InvalidArgumentError("every sequence chunk needs at least one token");
    }
    const int64_t end = ch.kv->length + static_cast<int64_t>(ch.tokens.size());
    if (end > c.max_context) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence of ", end, " positions exceeds the model's context of ", c.max_context));
    }
    for (int32_t t : ch.tokens) {
      if (t < 0 || t >= c.vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("token id ", t, " is outside the vocabulary [0, ", c.vocab_size, ")"));
      }
    }
    extra_blocks +=
        std::max<int64_t>(0, cache.BlocksFor(end) - static_cast<int64_t>(ch.kv->blocks.size()));
    b.rows += static_cast<int64_t>(ch.tokens.size());
  }
  if (extra_blocks > cache.free_blocks()) {
    return absl::ResourceExhaustedError(absl::StrCat("KV cache full: the batch needs ",
                                                     extra_blocks, " more blocks, ",
                                                     cache.free_blocks(), " are free"));
  }
  b.row_pos.resize(b.rows);
  b.row_seq.resize(b.rows);
  b.last_row.resize(chunks.size());
  int64_t r = 0;
  for (size_t s = 0; s < chunks.size(); ++s) {
    SequenceChunk& ch = chunks[s];
    RETURN_IF_ERROR(cache.Reserve(*ch.kv, ch.kv->length + ch.tokens.size()));
    for (size_t i = 0; i < ch.tokens.size(); ++i, ++r) {
      b.row_pos[r] = ch.kv->length + static_cast<int64_t>(i);
      b.row_seq[r] = ch.kv;
    }
    b.last_row[s] = r - 1;
  }
  return b;
}

absl::Status Transformer::ForwardStage(std::vector<SequenceChunk>& chunks, KvCache& cache,
                                       const float* hidden_in, std::vector<float>& out) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size;
  if (!first_stage() && hidden_in == nullptr) {
    return absl::InvalidArgumentError("a stage after the first needs hidden states");
  }
  ASSIGN_OR_RETURN(PreparedBatch batch, PrepareBatch(chunks, cache));
  const int64_t rows = batch.rows;
  const std::vector<int64_t>& row_pos = batch.row_pos;
  const std::vector<const SequenceKv*>& row_seq = batch.row_seq;
  const std::vector<int64_t>& last_row = batch.last_row;
  std::vector<float> x(rows * H, 0.0f);
  if (first_stage()) {
    int64_t r = 0;
    for (const SequenceChunk& ch : chunks) {
      for (int32_t tok : ch.tokens) {
        // Vocab-parallel embedding: this rank's rows, zeros elsewhere, summed over the group.
        if (tok >= vocab_begin_ && tok < vocab_end_) {
          const uint8_t* src = static_cast<const uint8_t*>(embed_.data) +
                               (tok - vocab_begin_) * embed_.row_stride * DTypeSize(embed_.dtype);
          cpu::ToFloat(embed_.dtype, src, H, x.data() + r * H);
        }
        ++r;
      }
    }
  }
  if (first_stage()) {
    RETURN_IF_ERROR(AllReduce(x.data(), x.size()));
  } else {
    std::copy_n(hidden_in, rows * H, x.data());
  }

  const int64_t hd = c.head_dim, qd = heads_ * hd, kvd = kv_heads_ * hd;
  std::vector<float> h(rows * H), q(rows * qd), k(rows * kvd), v(rows * kvd), attn(rows * qd),
      o(rows * H);
  const float eps = static_cast<float>(c.rms_norm_eps);
  const int64_t bs = cache.block_size();
  for (int64_t li = 0; li < static_cast<int64_t>(layers_.size()); ++li) {
    const Layer& L = layers_[li];
    cpu::RmsNorm(x.data(), rows, H, L.input_norm.data(), eps, h.data());
    cpu::MatMul(L.q, h.data(), rows, H, q.data(), qd, *pool_);
    cpu::MatMul(L.k, h.data(), rows, H, k.data(), kvd, *pool_);
    cpu::MatMul(L.v, h.data(), rows, H, v.data(), kvd, *pool_);
    AddBias(q.data(), rows, qd, L.q_bias);
    AddBias(k.data(), rows, kvd, L.k_bias);
    AddBias(v.data(), rows, kvd, L.v_bias);
    for (int64_t r = 0; r < rows; ++r) {
      rope_.Apply(q.data() + r * qd, heads_, row_pos[r]);
      rope_.Apply(k.data() + r * kvd, kv_heads_, row_pos[r]);
      const int64_t block = row_seq[r]->blocks[row_pos[r] / bs], slot = row_pos[r] % bs;
      for (int64_t kh = 0; kh < kv_heads_; ++kh) {
        std::copy_n(k.data() + r * kvd + kh * hd, hd, cache.K(li, block, kh) + slot * hd);
        std::copy_n(v.data() + r * kvd + kh * hd, hd, cache.V(li, block, kh) + slot * hd);
      }
    }
    Attention(L, li, row_pos, row_seq, q.data(), attn.data(), cache);
    // Row-parallel o_proj: partial sums over this rank's heads, then one all-reduce.
    cpu::MatMul(L.o, attn.data(), rows, qd, o.data(), H, *pool_);
    RETURN_IF_ERROR(AllReduce(o.data(), o.size()));
    AddBias(o.data(), rows, H, L.o_bias);
    for (int64_t i = 0; i < rows * H; ++i) x[i] += o[i];
    cpu::RmsNorm(x.data(), rows, H, L.post_norm.data(), eps, h.data());
    std::fill(o.begin(), o.end(), 0.0f);
    if (c.moe) {
      Moe(L, h.data(), rows, o.data());
    } else {
      Mlp(L, h.data(), rows, o.data());
    }
    RETURN_IF_ERROR(AllReduce(o.data(), o.size()));  // row-parallel down_proj / expert outputs
    for (int64_t i = 0; i < rows * H; ++i) x[i] += o[i];
  }
  for (SequenceChunk& ch : chunks) ch.kv->length += static_cast<int64_t>(ch.tokens.size());

  if (!last_stage()) {
    out = std::move(x);
    return absl::OkStatus();
  }
  // Vocab-parallel LM head on each sequence's last row: this rank's slice of the logits.
  const int64_t S = static_cast<int64_t>(chunks.size());
  std::vector<float> last(S * H), normed(S * H);
  for (int64_t s = 0; s < S; ++s) std::copy_n(x.data() + last_row[s] * H, H, last.data() + s * H);
  cpu::RmsNorm(last.data(), S, H, final_norm_.data(), eps, normed.data());
  out.assign(S * logits_stride(), 0.0f);
  cpu::MatMul(lm_head_, normed.data(), S, H, out.data(), logits_stride(), *pool_);
  return absl::OkStatus();
}

void Transformer::Attention(const Layer& layer, int64_t li, const std::vector<int64_t>& row_pos,
                            const std::vector<const SequenceKv*>& row_seq, const float* q,
                            float* out, KvCache& cache) {
  const ModelConfig& c = config_;
  const int64_t rows = static_cast<int64_t>(row_pos.size());
  const int64_t hd = c.head_dim, group = c.num_heads / c.num_kv_heads, bs = cache.block_size();
  const int64_t qd = heads_ * hd, head0 = options_.tp_rank * heads_;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  pool_->ParallelFor(rows * heads_, 1, [&](int, int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const float*> k_blocks, v_blocks;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / heads_, head = item % heads_;
      const int64_t kh = (head0 + head) / group - kv_head_begin_;  // local KV head
      const int64_t len = row_pos[r] + 1;  // causal: attend to positions [0, pos]
      const SequenceKv& seq = *row_seq[r];
      const int64_t nblocks = cache.BlocksFor(len);
      k_blocks.resize(nblocks);
      v_blocks.resize(nblocks);
      for (int64_t b = 0; b < nblocks; ++b) {
        k_blocks[b] = cache.K(li, seq.blocks[b], kh);
        v_blocks[b] = cache.V(li, seq.blocks[b], kh);
      }
      scores.resize(len);
      cpu::AttendHead(q + r * qd + head * hd, k_blocks.data(), v_blocks.data(), bs, hd, len, scale,
                      scores.data(), out + r * qd + head * hd);
    }
  });
}

void Transformer::Mlp(const Layer& L, const float* h, int64_t rows, float* out) {
  const int64_t H = config_.hidden_size, I = inter_;
  std::vector<float> g(rows * I), u(rows * I);
  cpu::MatMul(L.gate, h, rows, H, g.data(), I, *pool_);
  cpu::MatMul(L.up, h, rows, H, u.data(), I, *pool_);
  cpu::SiluMul(g.data(), u.data(), rows * I, *pool_);
  cpu::MatMul(L.down, g.data(), rows, I, out, H, *pool_);
}

void Transformer::Moe(const Layer& L, const float* h, int64_t rows, float* out) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, I = c.intermediate_size, E = c.num_experts;
  const int64_t top_k = c.experts_per_token;
  std::vector<float> router(rows * E);
  cpu::MatMul(L.router, h, rows, H, router.data(), E, *pool_);
  const auto assigned = RouteExperts(router.data(), rows, E, top_k);
  std::vector<float> in, g, u, d;
  for (int64_t e = expert_begin_; e < expert_end_; ++e) {  // this rank's experts only
    const auto& rows_e = assigned[e];
    if (rows_e.empty()) continue;
    const int64_t n = static_cast<int64_t>(rows_e.size());
    in.resize(n * H);
    g.resize(n * I);
    u.resize(n * I);
    d.resize(n * H);
    for (int64_t j = 0; j < n; ++j) std::copy_n(h + rows_e[j].first * H, H, in.data() + j * H);
    const Expert& ex = L.experts[e];
    cpu::MatMul(ex.gate, in.data(), n, H, g.data(), I, *pool_);
    cpu::MatMul(ex.up, in.data(), n, H, u.data(), I, *pool_);
    cpu::SiluMul(g.data(), u.data(), n * I, *pool_);
    cpu::MatMul(ex.down, g.data(), n, I, d.data(), H, *pool_);
    for (int64_t j = 0; j < n; ++j) {
      cpu::Axpy(rows_e[j].second, d.data() + j * H, out + rows_e[j].first * H, H);
    }
  }
}

}  // namespace shardserve
