#include "model/transformer.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardserve {
namespace {

cpu::WeightMatrix Matrix(const TensorView& t) {
  return {t.dtype, t.data, t.shape[0], t.shape[1], t.shape[1]};
}

std::vector<float> Vector(const TensorView& t) {
  std::vector<float> v(t.numel());
  cpu::ToFloat(t.dtype, t.data, t.numel(), v.data());
  return v;
}

void AddBias(float* y, int64_t rows, int64_t dim, const std::vector<float>& bias) {
  if (bias.empty()) return;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < dim; ++i) y[r * dim + i] += bias[i];
  }
}

}  // namespace

Transformer::Transformer(ModelConfig config, std::unique_ptr<WeightStore> weights,
                         const Options& options)
    : config_(std::move(config)),
      weights_(std::move(weights)),
      pool_(std::make_unique<ThreadPool>(options.num_threads)),
      rope_(config_) {}

absl::StatusOr<std::unique_ptr<Transformer>> Transformer::Load(const std::string& model_dir,
                                                               const Options& options) {
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(model_dir));
  ASSIGN_OR_RETURN(auto weights, WeightStore::Open(model_dir));
  std::unique_ptr<Transformer> t(new Transformer(std::move(config), std::move(weights), options));
  absl::Status s = t->BindWeights();
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(model_dir, ": ", s.message()));
  return t;
}

absl::Status Transformer::BindWeights() {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, I = c.intermediate_size, V = c.vocab_size;
  const WeightStore& w = *weights_;
  ASSIGN_OR_RETURN(TensorView embed, w.Get("model.embed_tokens.weight", {V, H}));
  embed_ = Matrix(embed);
  if (c.tie_word_embeddings) {
    lm_head_ = embed_;
  } else {
    ASSIGN_OR_RETURN(TensorView head, w.Get("lm_head.weight", {V, H}));
    lm_head_ = Matrix(head);
  }
  ASSIGN_OR_RETURN(TensorView norm, w.Get("model.norm.weight", {H}));
  final_norm_ = Vector(norm);

  layers_.resize(c.num_layers);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    Layer& L = layers_[i];
    const std::string p = absl::StrCat("model.layers.", i, ".");
    ASSIGN_OR_RETURN(TensorView in_norm, w.Get(p + "input_layernorm.weight", {H}));
    ASSIGN_OR_RETURN(TensorView post_norm, w.Get(p + "post_attention_layernorm.weight", {H}));
    L.input_norm = Vector(in_norm);
    L.post_norm = Vector(post_norm);
    ASSIGN_OR_RETURN(TensorView q, w.Get(p + "self_attn.q_proj.weight", {c.q_dim(), H}));
    ASSIGN_OR_RETURN(TensorView k, w.Get(p + "self_attn.k_proj.weight", {c.kv_dim(), H}));
    ASSIGN_OR_RETURN(TensorView v, w.Get(p + "self_attn.v_proj.weight", {c.kv_dim(), H}));
    ASSIGN_OR_RETURN(TensorView o, w.Get(p + "self_attn.o_proj.weight", {H, c.q_dim()}));
    L.q = Matrix(q);
    L.k = Matrix(k);
    L.v = Matrix(v);
    L.o = Matrix(o);
    if (c.qkv_bias) {
      ASSIGN_OR_RETURN(TensorView qb, w.Get(p + "self_attn.q_proj.bias", {c.q_dim()}));
      ASSIGN_OR_RETURN(TensorView kb, w.Get(p + "self_attn.k_proj.bias", {c.kv_dim()}));
      ASSIGN_OR_RETURN(TensorView vb, w.Get(p + "self_attn.v_proj.bias", {c.kv_dim()}));
      L.q_bias = Vector(qb);
      L.k_bias = Vector(kb);
      L.v_bias = Vector(vb);
    }
    if (c.o_bias) {
      ASSIGN_OR_RETURN(TensorView ob, w.Get(p + "self_attn.o_proj.bias", {H}));
      L.o_bias = Vector(ob);
    }
    if (c.moe) {
      const std::string m = p + "block_sparse_moe.";
      ASSIGN_OR_RETURN(TensorView router, w.Get(m + "gate.weight", {c.num_experts, H}));
      L.router = Matrix(router);
      L.experts.resize(c.num_experts);
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const std::string ep = absl::StrCat(m, "experts.", e, ".");
        ASSIGN_OR_RETURN(TensorView w1, w.Get(ep + "w1.weight", {I, H}));
        ASSIGN_OR_RETURN(TensorView w2, w.Get(ep + "w2.weight", {H, I}));
        ASSIGN_OR_RETURN(TensorView w3, w.Get(ep + "w3.weight", {I, H}));
        L.experts[e] = {Matrix(w1), Matrix(w3), Matrix(w2)};
      }
    } else {
      ASSIGN_OR_RETURN(TensorView gate, w.Get(p + "mlp.gate_proj.weight", {I, H}));
      ASSIGN_OR_RETURN(TensorView up, w.Get(p + "mlp.up_proj.weight", {I, H}));
      ASSIGN_OR_RETURN(TensorView down, w.Get(p + "mlp.down_proj.weight", {H, I}));
      L.gate = Matrix(gate);
      L.up = Matrix(up);
      L.down = Matrix(down);
    }
  }
  return absl::OkStatus();
}

std::unique_ptr<KvCache> Transformer::NewKvCache(int64_t positions, int64_t block_size) const {
  const int64_t blocks = std::max<int64_t>(1, (positions + block_size - 1) / block_size);
  return std::make_unique<KvCache>(config_.num_layers, config_.num_kv_heads, config_.head_dim,
                                   block_size, blocks);
}

absl::Status Transformer::Forward(std::vector<SequenceChunk>& chunks, KvCache& cache,
                                  std::vector<float>& logits) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size;
  // Validate everything before touching the cache.
  int64_t rows = 0;
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
    rows += static_cast<int64_t>(ch.tokens.size());
  }
  if (extra_blocks > cache.free_blocks()) {
    return absl::ResourceExhaustedError(absl::StrCat("KV cache full: the batch needs ",
                                                     extra_blocks, " more blocks, ",
                                                     cache.free_blocks(), " are free"));
  }
  std::vector<int64_t> row_pos(rows);
  std::vector<const SequenceKv*> row_seq(rows);
  std::vector<int64_t> last_row(chunks.size());
  std::vector<float> x(rows * H);
  {
    int64_t r = 0;
    for (size_t s = 0; s < chunks.size(); ++s) {
      SequenceChunk& ch = chunks[s];
      RETURN_IF_ERROR(cache.Reserve(*ch.kv, ch.kv->length + ch.tokens.size()));
      for (size_t i = 0; i < ch.tokens.size(); ++i, ++r) {
        row_pos[r] = ch.kv->length + static_cast<int64_t>(i);
        row_seq[r] = ch.kv;
        const uint8_t* src = static_cast<const uint8_t*>(embed_.data) +
                             ch.tokens[i] * embed_.row_stride * DTypeSize(embed_.dtype);
        cpu::ToFloat(embed_.dtype, src, H, x.data() + r * H);
      }
      last_row[s] = r - 1;
    }
  }

  const int64_t qd = c.q_dim(), kvd = c.kv_dim();
  std::vector<float> h(rows * H), q(rows * qd), k(rows * kvd), v(rows * kvd), attn(rows * qd),
      o(rows * H);
  const float eps = static_cast<float>(c.rms_norm_eps);
  for (int64_t li = 0; li < c.num_layers; ++li) {
    const Layer& L = layers_[li];
    cpu::RmsNorm(x.data(), rows, H, L.input_norm.data(), eps, h.data());
    cpu::MatMul(L.q, h.data(), rows, H, q.data(), qd, *pool_);
    cpu::MatMul(L.k, h.data(), rows, H, k.data(), kvd, *pool_);
    cpu::MatMul(L.v, h.data(), rows, H, v.data(), kvd, *pool_);
    AddBias(q.data(), rows, qd, L.q_bias);
    AddBias(k.data(), rows, kvd, L.k_bias);
    AddBias(v.data(), rows, kvd, L.v_bias);
    const int64_t bs = cache.block_size();
    for (int64_t r = 0; r < rows; ++r) {
      rope_.Apply(q.data() + r * qd, c.num_heads, row_pos[r]);
      rope_.Apply(k.data() + r * kvd, c.num_kv_heads, row_pos[r]);
      const int64_t block = row_seq[r]->blocks[row_pos[r] / bs], slot = row_pos[r] % bs;
      for (int64_t kh = 0; kh < c.num_kv_heads; ++kh) {
        std::copy_n(k.data() + r * kvd + kh * c.head_dim, c.head_dim,
                    cache.K(li, block, kh) + slot * c.head_dim);
        std::copy_n(v.data() + r * kvd + kh * c.head_dim, c.head_dim,
                    cache.V(li, block, kh) + slot * c.head_dim);
      }
    }
    Attention(L, li, row_pos, row_seq, q.data(), attn.data(), cache);
    cpu::MatMul(L.o, attn.data(), rows, qd, o.data(), H, *pool_);
    AddBias(o.data(), rows, H, L.o_bias);
    for (int64_t i = 0; i < rows * H; ++i) x[i] += o[i];
    cpu::RmsNorm(x.data(), rows, H, L.post_norm.data(), eps, h.data());
    if (c.moe) {
      Moe(L, h.data(), rows, x.data());
    } else {
      Mlp(L, h.data(), rows, x.data());
    }
  }
  for (SequenceChunk& ch : chunks) ch.kv->length += static_cast<int64_t>(ch.tokens.size());

  const int64_t S = static_cast<int64_t>(chunks.size());
  std::vector<float> last(S * H), normed(S * H);
  for (int64_t s = 0; s < S; ++s) std::copy_n(x.data() + last_row[s] * H, H, last.data() + s * H);
  cpu::RmsNorm(last.data(), S, H, final_norm_.data(), eps, normed.data());
  logits.resize(S * c.vocab_size);
  cpu::MatMul(lm_head_, normed.data(), S, H, logits.data(), c.vocab_size, *pool_);
  return absl::OkStatus();
}

void Transformer::Attention(const Layer& layer, int64_t li, const std::vector<int64_t>& row_pos,
                            const std::vector<const SequenceKv*>& row_seq, const float* q,
                            float* out, KvCache& cache) {
  const ModelConfig& c = config_;
  const int64_t rows = static_cast<int64_t>(row_pos.size());
  const int64_t hd = c.head_dim, group = c.num_heads / c.num_kv_heads, bs = cache.block_size();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  pool_->ParallelFor(rows * c.num_heads, 1, [&](int, int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const float*> k_blocks, v_blocks;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / c.num_heads, head = item % c.num_heads, kh = head / group;
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
      cpu::AttendHead(q + r * c.q_dim() + head * hd, k_blocks.data(), v_blocks.data(), bs, hd, len,
                      scale, scores.data(), out + r * c.q_dim() + head * hd);
    }
  });
}

void Transformer::Mlp(const Layer& L, const float* h, int64_t rows, float* x) {
  const int64_t H = config_.hidden_size, I = config_.intermediate_size;
  std::vector<float> g(rows * I), u(rows * I), d(rows * H);
  cpu::MatMul(L.gate, h, rows, H, g.data(), I, *pool_);
  cpu::MatMul(L.up, h, rows, H, u.data(), I, *pool_);
  cpu::SiluMul(g.data(), u.data(), rows * I, *pool_);
  cpu::MatMul(L.down, g.data(), rows, I, d.data(), H, *pool_);
  for (int64_t i = 0; i < rows * H; ++i) x[i] += d[i];
}

void Transformer::Moe(const Layer& L, const float* h, int64_t rows, float* x) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, I = c.intermediate_size, E = c.num_experts;
  const int64_t top_k = c.experts_per_token;
  std::vector<float> router(rows * E);
  cpu::MatMul(L.router, h, rows, H, router.data(), E, *pool_);
  // Per expert: the rows routed to it and their weights (softmax over the top-k router logits).
  std::vector<std::vector<std::pair<int64_t, float>>> assigned(E);
  std::vector<int64_t> order(E);
  for (int64_t r = 0; r < rows; ++r) {
    const float* logit = router.data() + r * E;
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
  std::vector<float> in, g, u, d;
  for (int64_t e = 0; e < E; ++e) {
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
      cpu::Axpy(rows_e[j].second, d.data() + j * H, x + rows_e[j].first * H, H);
    }
  }
}

}  // namespace shardserve
