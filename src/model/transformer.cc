// The Transformer's forward pass (model/transformer.h): a batch's layout, the layers over the
// Backend, the pipeline's hidden states, logits and sampling. Loading and binding the weights is
// transformer_weights.cc.
#include "model/transformer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "model/vocab_parallel.h"

namespace shardserve {
namespace {

template <typename T>
T* Ptr(const std::unique_ptr<Buffer>& b) {
  return b->as<T>();
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvCache>> Transformer::NewKvCache(int64_t positions,
                                                                 int64_t block_size) {
  const int64_t blocks = std::max<int64_t>(1, (positions + block_size - 1) / block_size);
  const int64_t layers = kv_layers();
  std::unique_ptr<KvStorage> storage;
  if (config_.mla) {  // the latent and the rotated key dims, one vector a position
    ASSIGN_OR_RETURN(storage,
                     backend_->AllocLatentKv(layers, blocks, block_size, config_.kv_lora_rank,
                                             config_.head_dim, kv_format_));
  } else {
    ASSIGN_OR_RETURN(storage, backend_->AllocKv(layers, blocks, kv_heads_, block_size,
                                                config_.head_dim, kv_format_));
  }
  return std::make_unique<KvCache>(block_size, blocks, std::move(storage));
}

size_t Transformer::kv_block_bytes(int64_t block_size) const {
  const int64_t per_position =
      config_.mla ? config_.kv_lora_rank + config_.head_dim : 2 * kv_heads_ * config_.head_dim;
  return static_cast<size_t>(kv_layers() * block_size * per_position) * DTypeSize(kv_format_.dtype);
}

absl::Status Transformer::AllReduce(float* data, size_t count) {
  if (options_.tp_size == 1) return absl::OkStatus();
  return options_.tp_comm->AllReduceSum(data, count);
}

absl::Status Transformer::Gemm(const WeightMatrix& w, const Buffer& x, int64_t M, Buffer& y) {
  RETURN_IF_ERROR(y.Reserve(static_cast<size_t>(M * w.rows) * sizeof(float)));
  return backend_->Gemm(w, x.as<float>(), M, y.as<float>());
}

absl::Status Transformer::GemmGroup(
    std::initializer_list<std::pair<const WeightMatrix*, Buffer*>> outs, const Buffer& x,
    int64_t M) {
  std::vector<const WeightMatrix*> ws;
  std::vector<float*> ys;
  for (const auto& [w, y] : outs) {
    RETURN_IF_ERROR(y->Reserve(static_cast<size_t>(M * w->rows) * sizeof(float)));
    ws.push_back(w);
    ys.push_back(y->as<float>());
  }
  return backend_->GemmGroup(ws.data(), ys.data(), ws.size(), x.as<float>(), M);
}

absl::StatusOr<BatchLayout> Transformer::PrepareBatch(std::vector<SequenceChunk>& chunks,
                                                      KvCache& cache) const {
  const ModelConfig& c = config_;
  if (cache.storage() == nullptr || cache.storage()->owner != backend_.get()) {
    return absl::FailedPreconditionError("the KV cache must come from this model's NewKvCache");
  }
  // Validate everything before touching the cache.
  BatchLayout b;
  int64_t extra_blocks = 0;
  for (const SequenceChunk& ch : chunks) {
    if (ch.tokens.empty() || ch.kv == nullptr) {
      return absl::InvalidArgumentError("every sequence chunk needs at least one token");
    }
    if (ch.logit_rows < 1 || ch.logit_rows > static_cast<int64_t>(ch.tokens.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a chunk of ", ch.tokens.size(), " tokens asks for ", ch.logit_rows, " rows of logits"));
    }
    const int64_t end = ch.kv->length + static_cast<int64_t>(ch.tokens.size());
    if (end > c.max_context) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence of ", end, " positions exceeds the model's context of ", c.max_context));
    }
    if (ch.lora_slot != -1 &&
        (ch.lora_slot < 0 || ch.lora_slot >= static_cast<int32_t>(lora_mem_.size()) ||
         lora_mem_[ch.lora_slot] == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("a sequence runs LoRA slot ", ch.lora_slot, ", which holds no adapter"));
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
  b.ids.reserve(b.rows);
  b.positions.reserve(b.rows);
  b.block_offset.reserve(b.rows);
  const bool lora = std::any_of(chunks.begin(), chunks.end(),
                                [](const SequenceChunk& ch) { return ch.lora_slot >= 0; });
  for (SequenceChunk& ch : chunks) {
    if (lora) b.lora_slots.insert(b.lora_slots.end(), ch.tokens.size(), ch.lora_slot);
    RETURN_IF_ERROR(cache.Reserve(*ch.kv, ch.kv->length + ch.tokens.size()));
    const int32_t offset = static_cast<int32_t>(b.blocks.size());
    b.blocks.insert(b.blocks.end(), ch.kv->blocks.begin(), ch.kv->blocks.end());
    for (size_t i = 0; i < ch.tokens.size(); ++i) {
      b.ids.push_back(ch.tokens[i]);
      b.positions.push_back(static_cast<int32_t>(ch.kv->length + static_cast<int64_t>(i)));
      b.block_offset.push_back(offset);
    }
    b.max_len = std::max<int64_t>(b.max_len, b.positions.back() + 1);
    for (int64_t r = ch.logit_rows; r >= 1; --r) {
      b.last_row.push_back(static_cast<int32_t>(static_cast<int64_t>(b.ids.size()) - r));
    }
  }
  return b;
}

absl::Status Transformer::HiddenFromHost(const float* hidden, int64_t rows) {
  const size_t bytes = static_cast<size_t>(rows * config_.hidden_size) * sizeof(float);
  RETURN_IF_ERROR(buf_.x->Reserve(bytes));
  RETURN_IF_ERROR(backend_->CopyFromHost(buf_.x->data(), hidden, bytes));
  input_rows_ = rows;
  return absl::OkStatus();
}

absl::Status Transformer::ReceiveHidden(Communicator& link, int peer, int64_t rows) {
  const size_t bytes = static_cast<size_t>(rows * config_.hidden_size) * sizeof(float);
  RETURN_IF_ERROR(buf_.x->Reserve(bytes));
  RETURN_IF_ERROR(link.Recv(buf_.x->data(), bytes, peer));
  input_rows_ = rows;
  return absl::OkStatus();
}

absl::Status Transformer::Run(std::vector<SequenceChunk>& chunks, KvCache& cache) {
  Backend& be = *backend_;
  Buffers& m = buf_;
  rows_ = logit_rows_ = 0;
  const int64_t input_rows = std::exchange(input_rows_, -1);
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, hd = c.head_dim;
  int64_t rows = 0;
  for (const SequenceChunk& ch : chunks) rows += static_cast<int64_t>(ch.tokens.size());
  if (!first_stage() && input_rows != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("a stage after the first needs the hidden states of its ", rows,
                     " rows (given: ", std::max<int64_t>(input_rows, 0), ")"));
  }
  ASSIGN_OR_RETURN(const BatchLayout batch, PrepareBatch(chunks, cache));
  const int64_t max_len = batch.max_len;
  RETURN_IF_ERROR(Put(*m.ids, batch.ids));
  RETURN_IF_ERROR(Put(*m.pos, batch.positions));
  RETURN_IF_ERROR(Put(*m.table, batch.blocks));
  RETURN_IF_ERROR(Put(*m.offsets, batch.block_offset));
  lora_batch_ = !batch.lora_slots.empty();
  if (lora_batch_) {
    RETURN_IF_ERROR(Put(*m.lora_rows, batch.lora_slots));
    RETURN_IF_ERROR(
        m.lora_u->Reserve(static_cast<size_t>(rows * options_.lora_max_rank) * sizeof(float)));
  }
  const size_t x_bytes = static_cast<size_t>(rows * H) * sizeof(float);
  RETURN_IF_ERROR(m.x->Reserve(x_bytes));
  RETURN_IF_ERROR(m.h->Reserve(x_bytes));
  if (first_stage()) {
    RETURN_IF_ERROR(
        be.Embed(embed_, Ptr<int32_t>(m.ids), rows, vocab_begin_, vocab_end_, Ptr<float>(m.x)));
    RETURN_IF_ERROR(AllReduce(Ptr<float>(m.x), rows * H));
  }

  const float eps = static_cast<float>(c.rms_norm_eps);
  RETURN_IF_ERROR(m.attn->Reserve(static_cast<size_t>(rows * heads_ * std::max(hd, c.v_head_dim)) *
                                  sizeof(float)));
  // Each layer's input norm is done with the residual add before it (AddRmsNorm), the first
  // layer's here.
  if (!layers_.empty()) {
    RETURN_IF_ERROR(
        be.RmsNorm(Ptr<float>(m.x), rows, H, layers_[0].input_norm, eps, Ptr<float>(m.h)));
  }
  for (size_t li = 0; li < layers_.size(); ++li) {
    RETURN_IF_ERROR(LayerForward(layers_[li], static_cast<int64_t>(li), cache, rows, max_len,
                                 li + 1 < layers_.size() ? layers_[li + 1].input_norm : nullptr));
  }
  for (SequenceChunk& ch : chunks) ch.kv->length += static_cast<int64_t>(ch.tokens.size());
  rows_ = rows;
  logit_rows_ = static_cast<int64_t>(batch.last_row.size());
  if (!last_stage()) return absl::OkStatus();
  if (has_mtp()) batch_ = batch;
  // Vocab-parallel LM head on the logit rows: this rank's slice of the logits.
  const int64_t S = logit_rows_;
  RETURN_IF_ERROR(Put(*m.last, batch.last_row));
  RETURN_IF_ERROR(m.in->Reserve(static_cast<size_t>(S * H) * sizeof(float)));
  RETURN_IF_ERROR(be.GatherRows(Ptr<float>(m.x), H, Ptr<int32_t>(m.last), S, Ptr<float>(m.in)));
  RETURN_IF_ERROR(be.RmsNorm(Ptr<float>(m.in), S, H, final_norm_, eps, Ptr<float>(m.h)));
  return Gemm(lm_head_, *m.h, S, *m.logits);
}

absl::Status Transformer::LayerForward(const Layer& L, int64_t li, const KvCache& cache,
                                       int64_t rows, int64_t max_len, const float* next_norm) {
  Backend& be = *backend_;
  Buffers& m = buf_;
  const int64_t H = config_.hidden_size;
  const float eps = static_cast<float>(config_.rms_norm_eps);
  if (config_.mla) {
    RETURN_IF_ERROR(LatentAttentionLayer(L, li, cache, rows, max_len));
  } else {
    RETURN_IF_ERROR(AttentionLayer(L, li, cache, rows, max_len));
  }
  // Row-parallel o_proj: partial sums over this rank's heads, then one all-reduce.
  RETURN_IF_ERROR(Gemm(L.o, *m.attn, rows, *m.o));
  RETURN_IF_ERROR(ApplyLora(li, LoraTarget::kO, *m.attn, *m.o, rows));  // before the sum
  RETURN_IF_ERROR(AllReduce(Ptr<float>(m.o), rows * H));
  if (L.o_bias != nullptr) RETURN_IF_ERROR(be.AddBias(Ptr<float>(m.o), rows, H, L.o_bias));
  RETURN_IF_ERROR(
      be.AddRmsNorm(Ptr<float>(m.x), Ptr<float>(m.o), rows, H, L.post_norm, eps, Ptr<float>(m.h)));
  RETURN_IF_ERROR(L.sparse ? Moe(L, rows) : Mlp(L, li, rows));
  RETURN_IF_ERROR(AllReduce(Ptr<float>(m.o), rows * H));  // row-parallel down / experts
  if (next_norm == nullptr) return be.Add(Ptr<float>(m.x), Ptr<float>(m.o), rows * H);
  return be.AddRmsNorm(Ptr<float>(m.x), Ptr<float>(m.o), rows, H, next_norm, eps, Ptr<float>(m.h));
}

absl::StatusOr<std::vector<int32_t>> Transformer::Mtp(const std::vector<int32_t>& rows,
                                                      const std::vector<int32_t>& next,
                                                      const std::vector<int32_t>& drafts,
                                                      KvCache& cache, Communicator* tp_group) {
  if (!has_mtp()) return absl::FailedPreconditionError("this model runs no MTP layer");
  Backend& be = *backend_;
  Buffers& m = buf_;
  const int64_t H = config_.hidden_size, n = static_cast<int64_t>(rows.size());
  const float eps = static_cast<float>(config_.rms_norm_eps);
  if (next.size() != rows.size() || n == 0 || n > rows_) {
    return absl::InvalidArgumentError(absl::StrCat("MTP over ", n, " rows with ", next.size(),
                                                   " next tokens, of a batch of ", rows_));
  }
  // The rows' positions and block tables, as the step's Run laid them out.
  std::vector<int32_t> pos(n), offsets(n);
  int64_t max_len = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t r = rows[i];
    if (r < 0 || r >= rows_ || (i > 0 && r <= rows[i - 1]) || next[i] < 0 ||
        next[i] >= config_.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("MTP row ", r, " (next token ", next[i], ") of a batch of ", rows_));
    }
    pos[i] = batch_.positions[r];
    offsets[i] = batch_.block_offset[r];
    max_len = std::max<int64_t>(max_len, pos[i] + 1);
  }
  for (int32_t d : drafts) {
    if (d < 0 || d >= n) return absl::InvalidArgumentError("an MTP draft row outside its rows");
  }
  // The hidden states: the model's final norm, then hnorm (into h).
  const size_t bytes = static_cast<size_t>(n * H) * sizeof(float);
  RETURN_IF_ERROR(Put(*m.last, rows));
  RETURN_IF_ERROR(m.in->Reserve(bytes));
  RETURN_IF_ERROR(m.h->Reserve(bytes));
  RETURN_IF_ERROR(be.GatherRows(Ptr<float>(m.x), H, Ptr<int32_t>(m.last), n, Ptr<float>(m.in)));
  RETURN_IF_ERROR(be.RmsNorm(Ptr<float>(m.in), n, H, final_norm_, eps, Ptr<float>(m.h)));
  RETURN_IF_ERROR(be.RmsNorm(Ptr<float>(m.h), n, H, mtp_.hnorm, eps, Ptr<float>(m.h)));
  // The next tokens' embeddings (zero at position 0), enorm (into in).
  RETURN_IF_ERROR(Put(*m.ids, next));
  RETURN_IF_ERROR(Put(*m.pos, pos));
  RETURN_IF_ERROR(Put(*m.offsets, offsets));
  RETURN_IF_ERROR(Put(*m.table, batch_.blocks));
  RETURN_IF_ERROR(m.x->Reserve(bytes));
  RETURN_IF_ERROR(
      be.Embed(mtp_.embed, Ptr<int32_t>(m.ids), n, vocab_begin_, vocab_end_, Ptr<float>(m.x)));
  RETURN_IF_ERROR(AllReduce(Ptr<float>(m.x), n * H));
  const std::vector<float> zero(H, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    if (pos[i] != 0) continue;
    RETURN_IF_ERROR(be.CopyFromHost(Ptr<float>(m.x) + i * H, zero.data(), H * sizeof(float)));
  }
  RETURN_IF_ERROR(be.RmsNorm(Ptr<float>(m.x), n, H, mtp_.enorm, eps, Ptr<float>(m.in)));
  // x = eh_proj's two halves on them; then the decoder layer on its input norm.
  RETURN_IF_ERROR(Gemm(mtp_.eh_embed, *m.in, n, *m.x));
  RETURN_IF_ERROR(Gemm(mtp_.eh_hidden, *m.h, n, *m.o));
  RETURN_IF_ERROR(be.Add(Ptr<float>(m.x), Ptr<float>(m.o), n * H));
  RETURN_IF_ERROR(be.RmsNorm(Ptr<float>(m.x), n, H, mtp_.layer.input_norm, eps, Ptr<float>(m.h)));
  lora_batch_ = false;  // the MTP layer runs no adapter
  RETURN_IF_ERROR(
      LayerForward(mtp_.layer, static_cast<int64_t>(layers_.size()), cache, n, max_len, nullptr));
  // shared_head on the draft rows, then the greedy token of each.
  const int64_t D = static_cast<int64_t>(drafts.size());
  if (D == 0) return std::vector<int32_t>();
  RETURN_IF_ERROR(Put(*m.last, drafts));
  RETURN_IF_ERROR(be.GatherRows(Ptr<float>(m.x), H, Ptr<int32_t>(m.last), D, Ptr<float>(m.in)));
  RETURN_IF_ERROR(be.RmsNorm(Ptr<float>(m.in), D, H, mtp_.norm, eps, Ptr<float>(m.h)));
  RETURN_IF_ERROR(Gemm(mtp_.head, *m.h, D, *m.logits));
  logit_rows_ = D;
  ASSIGN_OR_RETURN(std::vector<SampledToken> best, Greedy(0, tp_group));
  std::vector<int32_t> out;
  for (const SampledToken& t : best) out.push_back(t.id);
  return out;
}

absl::Status Transformer::AttentionLayer(const Layer& L, int64_t li, const KvCache& cache,
                                         int64_t rows, int64_t max_len) {
  Backend& be = *backend_;
  Buffers& m = buf_;
  const ModelConfig& c = config_;
  const int64_t hd = c.head_dim, group = c.num_heads / c.num_kv_heads;
  const int64_t head0 = options_.tp_rank * heads_;
  const float eps = static_cast<float>(c.rms_norm_eps);
  RETURN_IF_ERROR(GemmGroup({{&L.q, m.q.get()}, {&L.k, m.k.get()}, {&L.v, m.v.get()}}, *m.h, rows));
  RETURN_IF_ERROR(ApplyLora(li, LoraTarget::kQ, *m.h, *m.q, rows));
  RETURN_IF_ERROR(ApplyLora(li, LoraTarget::kK, *m.h, *m.k, rows));
  RETURN_IF_ERROR(ApplyLora(li, LoraTarget::kV, *m.h, *m.v, rows));
  if (L.q_bias != nullptr) {
    RETURN_IF_ERROR(be.AddBias(Ptr<float>(m.q), rows, heads_ * hd, L.q_bias));
    RETURN_IF_ERROR(be.AddBias(Ptr<float>(m.k), rows, kv_heads_ * hd, L.k_bias));
    RETURN_IF_ERROR(be.AddBias(Ptr<float>(m.v), rows, kv_heads_ * hd, L.v_bias));
  }
  if (L.q_norm != nullptr) {  // in place: each head's row of head_dim
    RETURN_IF_ERROR(be.RmsNorm(Ptr<float>(m.q), rows * heads_, hd, L.q_norm, eps, Ptr<float>(m.q)));
    RETURN_IF_ERROR(
        be.RmsNorm(Ptr<float>(m.k), rows * kv_heads_, hd, L.k_norm, eps, Ptr<float>(m.k)));
  }
  RETURN_IF_ERROR(be.Rope(Ptr<float>(m.q), rows, heads_, hd, Ptr<int32_t>(m.pos), inv_freq_));
  RETURN_IF_ERROR(be.Rope(Ptr<float>(m.k), rows, kv_heads_, hd, Ptr<int32_t>(m.pos), inv_freq_));
  const KvStorage& kv = *cache.storage();
  RETURN_IF_ERROR(be.WriteKv(kv, li, Ptr<float>(m.k), Ptr<float>(m.v), rows, Ptr<int32_t>(m.pos),
                             Ptr<int32_t>(m.table), Ptr<int32_t>(m.offsets)));
  return be.Attention(kv, li, Ptr<float>(m.q), rows, heads_, head0, group, kv_head_begin_,
                      Ptr<int32_t>(m.pos), Ptr<int32_t>(m.table), Ptr<int32_t>(m.offsets), max_len,
                      static_cast<float>(c.attention_scale()), {L.window, L.sinks},
                      Ptr<float>(m.attn));
}

// Multi-head latent attention with the latent cache (the "absorbed" form): the query's nope part
// goes through each head's kv_b key rows transposed (q_latent, kv_lora_rank floats a head), so
// that a head scores a position by q_latent . latent + q_rope . k_rope; the attended latent goes
// through the head's kv_b value rows. Equal to transformers' expanded keys and values up to float
// rounding; the cache holds kv_lora_rank + qk_rope_head_dim floats a position for every head.
absl::Status Transformer::LatentAttentionLayer(const Layer& L, int64_t li, const KvCache& cache,
                                               int64_t rows, int64_t max_len) {
  Backend& be = *backend_;
  Buffers& m = buf_;
  const ModelConfig& c = config_;
  const int64_t Lr = c.kv_lora_rank, R = c.head_dim, nope = c.qk_nope_dim, vd = c.v_head_dim;
  // q_a_layernorm and kv_a_layernorm keep transformers' default epsilon, not rms_norm_eps.
  constexpr float kLoraEps = 1e-6f;
  if (L.q_a.rows > 0) {
    RETURN_IF_ERROR(GemmGroup(
        {{&L.q_a, m.qa.get()}, {&L.kv_latent, m.lat.get()}, {&L.kv_rope, m.kr.get()}}, *m.h, rows));
    RETURN_IF_ERROR(
        be.RmsNorm(Ptr<float>(m.qa), rows, L.q_a.rows, L.q_a_norm, kLoraEps, Ptr<float>(m.qa)));
    RETURN_IF_ERROR(GemmGroup({{&L.q_nope, m.q.get()}, {&L.q_rope, m.qr.get()}}, *m.qa, rows));
  } else {
    RETURN_IF_ERROR(GemmGroup({{&L.q_nope, m.q.get()},
                               {&L.q_rope, m.qr.get()},
                               {&L.kv_latent, m.lat.get()},
                               {&L.kv_rope, m.kr.get()}},
                              *m.h, rows));
  }
  RETURN_IF_ERROR(be.RmsNorm(Ptr<float>(m.lat), rows, Lr, L.kv_norm, kLoraEps, Ptr<float>(m.lat)));
  RETURN_IF_ERROR(be.Rope(Ptr<float>(m.qr), rows, heads_, R, Ptr<int32_t>(m.pos), inv_freq_));
  RETURN_IF_ERROR(be.Rope(Ptr<float>(m.kr), rows, 1, R, Ptr<int32_t>(m.pos), inv_freq_));
  const KvStorage& kv = *cache.storage();
  RETURN_IF_ERROR(be.WriteLatentKv(kv, li, Ptr<float>(m.lat), Ptr<float>(m.kr), rows,
                                   Ptr<int32_t>(m.pos), Ptr<int32_t>(m.table),
                                   Ptr<int32_t>(m.offsets)));
  const size_t latents = static_cast<size_t>(rows * heads_ * Lr) * sizeof(float);
  RETURN_IF_ERROR(m.qlat->Reserve(latents));
  RETURN_IF_ERROR(m.olat->Reserve(latents));
  RETURN_IF_ERROR(be.HeadGemm(L.uk_t, heads_, Ptr<float>(m.q), heads_ * nope, nope, rows,
                              Ptr<float>(m.qlat), heads_ * Lr, Lr));
  RETURN_IF_ERROR(be.LatentAttention(kv, li, Ptr<float>(m.qlat), Ptr<float>(m.qr), rows, heads_,
                                     Ptr<int32_t>(m.pos), Ptr<int32_t>(m.table),
                                     Ptr<int32_t>(m.offsets), max_len,
                                     static_cast<float>(c.attention_scale()), Ptr<float>(m.olat)));
  return be.HeadGemm(L.uv, heads_, Ptr<float>(m.olat), heads_ * Lr, Lr, rows, Ptr<float>(m.attn),
                     heads_ * vd, vd);
}

absl::Status Transformer::Mlp(const Layer& L, int64_t li, int64_t rows) {
  Buffers& m = buf_;
  RETURN_IF_ERROR(GemmGroup({{&L.gate, m.g.get()}, {&L.up, m.u.get()}}, *m.h, rows));
  RETURN_IF_ERROR(ApplyLora(li, LoraTarget::kGate, *m.h, *m.g, rows));
  RETURN_IF_ERROR(ApplyLora(li, LoraTarget::kUp, *m.h, *m.u, rows));
  RETURN_IF_ERROR(backend_->SiluMul(Ptr<float>(m.g), Ptr<float>(m.u), rows * L.gate.rows));
  RETURN_IF_ERROR(Gemm(L.down, *m.g, rows, *m.o));
  return ApplyLora(li, LoraTarget::kDown, *m.g, *m.o, rows);  // before the sum
}

absl::Status Transformer::Moe(const Layer& L, int64_t rows) {
  Backend& be = *backend_;
  Buffers& m = buf_;
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, k = c.experts_per_token, slots = rows * k;
  RETURN_IF_ERROR(Gemm(L.router, *m.h, rows, *m.router));
  if (L.router_bias != nullptr) {
    RETURN_IF_ERROR(be.AddBias(Ptr<float>(m.router), rows, c.num_experts, L.router_bias));
  }
  RETURN_IF_ERROR(m.routes->Reserve(static_cast<size_t>(slots) * sizeof(int32_t)));
  RETURN_IF_ERROR(m.route_weights->Reserve(static_cast<size_t>(slots) * sizeof(float)));
  if (c.sigmoid_routing) {
    RETURN_IF_ERROR(be.RouteGrouped(Ptr<float>(m.router), L.route_bias, rows, c.num_experts, k,
                                    c.n_group, c.topk_group, c.norm_topk_prob,
                                    static_cast<float>(c.routed_scaling), Ptr<int32_t>(m.routes),
                                    Ptr<float>(m.route_weights)));
  } else {
    RETURN_IF_ERROR(be.RouteTopK(Ptr<float>(m.router), rows, c.num_experts, k, c.norm_topk_prob,
                                 Ptr<int32_t>(m.routes), Ptr<float>(m.route_weights)));
  }
  RETURN_IF_ERROR(m.o->Reserve(static_cast<size_t>(rows * H) * sizeof(float)));
  const bool tables = L.gate_table.count > 0 && L.up_table.count > 0 && L.down_table.count > 0;
  // Experts with biases (gpt-oss) run grouped: the per-slot products add none.
  if (!be.per_slot_experts() || !tables || slots > L.gate_table.count || c.gpt_oss) {
    RETURN_IF_ERROR(MoeGrouped(L, rows));
    return SharedExperts(L, rows);
  }
  // Decode: one matrix-vector product per (row, chosen expert), experts read in place.
  const int64_t I = L.gate_table.rows;
  RETURN_IF_ERROR(m.g->Reserve(static_cast<size_t>(slots * I) * sizeof(float)));
  RETURN_IF_ERROR(m.u->Reserve(static_cast<size_t>(slots * I) * sizeof(float)));
  RETURN_IF_ERROR(m.d->Reserve(static_cast<size_t>(slots * H) * sizeof(float)));
  const int32_t* e = Ptr<int32_t>(m.routes);
  RETURN_IF_ERROR(be.ExpertMatVec(L.gate_table, e, slots, Ptr<float>(m.h), k, Ptr<float>(m.g)));
  RETURN_IF_ERROR(be.ExpertMatVec(L.up_table, e, slots, Ptr<float>(m.h), k, Ptr<float>(m.u)));
  RETURN_IF_ERROR(be.SiluMul(Ptr<float>(m.g), Ptr<float>(m.u), slots * I));
  RETURN_IF_ERROR(be.ExpertMatVec(L.down_table, e, slots, Ptr<float>(m.g), 1, Ptr<float>(m.d)));
  RETURN_IF_ERROR(
      be.CombineSlots(Ptr<float>(m.d), Ptr<float>(m.route_weights), rows, k, H, Ptr<float>(m.o)));
  return SharedExperts(L, rows);
}

// DeepSeek-V3's shared experts, this rank's slice of them, added to the routed experts' output.
absl::Status Transformer::SharedExperts(const Layer& L, int64_t rows) {
  if (L.shared_gate.rows == 0) return absl::OkStatus();
  Buffers& m = buf_;
  RETURN_IF_ERROR(GemmGroup({{&L.shared_gate, m.g.get()}, {&L.shared_up, m.u.get()}}, *m.h, rows));
  RETURN_IF_ERROR(backend_->SiluMul(Ptr<float>(m.g), Ptr<float>(m.u), rows * L.shared_gate.rows));
  RETURN_IF_ERROR(Gemm(L.shared_down, *m.g, rows, *m.d));
  return backend_->Add(Ptr<float>(m.o), Ptr<float>(m.d), rows * config_.hidden_size);
}

// The routes come to the host (rows * k ids and weights) to group the rows of each local expert,
// which then run as one Gemm each.
absl::Status Transformer::MoeGrouped(const Layer& L, int64_t rows) {
  Backend& be = *backend_;
  Buffers& m = buf_;
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size, k = c.experts_per_token;
  std::vector<int32_t> experts(rows * k);
  std::vector<float> weight(rows * k);
  RETURN_IF_ERROR(
      be.CopyToHost(experts.data(), m.routes->data(), experts.size() * sizeof(int32_t)));
  RETURN_IF_ERROR(
      be.CopyToHost(weight.data(), m.route_weights->data(), weight.size() * sizeof(float)));
  std::vector<std::vector<int32_t>> ids(c.num_experts);
  std::vector<std::vector<float>> w(c.num_experts);
  for (int64_t i = 0; i < rows * k; ++i) {
    ids[experts[i]].push_back(static_cast<int32_t>(i / k));
    w[experts[i]].push_back(weight[i]);
  }
  RETURN_IF_ERROR(be.Zero(m.o->data(), static_cast<size_t>(rows * H) * sizeof(float)));
  for (int64_t e = expert_begin_; e < expert_end_; ++e) {
    if (ids[e].empty()) continue;
    const int64_t n = static_cast<int64_t>(ids[e].size());
    RETURN_IF_ERROR(Put(*m.sel, ids[e]));
    RETURN_IF_ERROR(Put(*m.weights, w[e]));
    RETURN_IF_ERROR(m.in->Reserve(static_cast<size_t>(n * H) * sizeof(float)));
    RETURN_IF_ERROR(be.GatherRows(Ptr<float>(m.h), H, Ptr<int32_t>(m.sel), n, Ptr<float>(m.in)));
    const Expert& x = L.experts[e - expert_begin_];
    const int64_t I = x.gate.rows;
    RETURN_IF_ERROR(GemmGroup({{&x.gate, m.g.get()}, {&x.up, m.u.get()}}, *m.in, n));
    if (x.gate_bias != nullptr) {
      RETURN_IF_ERROR(be.AddBias(Ptr<float>(m.g), n, I, x.gate_bias));
      RETURN_IF_ERROR(be.AddBias(Ptr<float>(m.u), n, I, x.up_bias));
    }
    if (c.gpt_oss) {
      RETURN_IF_ERROR(be.SwiGluClamped(Ptr<float>(m.g), Ptr<float>(m.u), n * I,
                                       static_cast<float>(c.swiglu_alpha),
                                       static_cast<float>(c.swiglu_limit)));
    } else {
      RETURN_IF_ERROR(be.SiluMul(Ptr<float>(m.g), Ptr<float>(m.u), n * I));
    }
    RETURN_IF_ERROR(Gemm(x.down, *m.g, n, *m.d));
    if (x.down_bias != nullptr) RETURN_IF_ERROR(be.AddBias(Ptr<float>(m.d), n, H, x.down_bias));
    RETURN_IF_ERROR(be.ScaleAddRows(Ptr<float>(m.d), H, Ptr<int32_t>(m.sel), Ptr<float>(m.weights),
                                    n, Ptr<float>(m.o)));
  }
  return absl::OkStatus();
}

absl::Status Transformer::HiddenToHost(std::vector<float>& out) {
  out.resize(rows_ * config_.hidden_size);
  return backend_->CopyToHost(out.data(), buf_.x->data(), out.size() * sizeof(float));
}

absl::Status Transformer::SendHidden(Communicator& link, int peer) {
  return link.Send(buf_.x->data(), static_cast<size_t>(rows_ * config_.hidden_size) * sizeof(float),
                   peer);
}

absl::Status Transformer::LogitsToHost(std::vector<float>& out) {
  const int64_t N = lm_head_.rows, ld = logits_stride();
  out.assign(logit_rows_ * ld, 0.0f);
  return backend_->Copy2D(out.data(), ld * sizeof(float), buf_.logits->data(), N * sizeof(float),
                          N * sizeof(float), logit_rows_);
}

absl::StatusOr<std::vector<SampledToken>> Transformer::Greedy(int64_t top_logprobs,
                                                              Communicator* tp_group) {
  const int64_t N = lm_head_.rows;
  std::vector<float> mine(logit_rows_ * SummaryWidth(top_logprobs));
  RETURN_IF_ERROR(backend_->VocabSummaries(Ptr<float>(buf_.logits), logit_rows_, N, N, vocab_begin_,
                                           SummaryCandidates(top_logprobs), mine.data()));
  return GreedyFromSummaries(mine, logit_rows_, top_logprobs, tp_group);
}

absl::StatusOr<std::vector<SampledToken>> Transformer::Score(const std::vector<int32_t>& rows,
                                                             const std::vector<int32_t>& targets,
                                                             int64_t top_logprobs,
                                                             Communicator* tp_group) {
  Backend& be = *backend_;
  Buffers& m = buf_;
  const int64_t H = config_.hidden_size, N = lm_head_.rows, R = static_cast<int64_t>(rows.size());
  if (!last_stage() || targets.size() != rows.size()) {
    return absl::InternalError("Score: on the last stage, a target per row");
  }
  const float eps = static_cast<float>(config_.rms_norm_eps);
  std::vector<SampledToken> out;
  out.reserve(R);
  for (int64_t b = 0; b < R; b += kScoreRows) {
    const int64_t n = std::min(kScoreRows, R - b);
    std::vector<int32_t> picked(rows.begin() + b, rows.begin() + b + n);
    std::vector<int32_t> want(targets.begin() + b, targets.begin() + b + n);
    // Each target's logit, as a one-float row of the logits (row r's first id where the target
    // is outside this rank's slice, masked after).
    std::vector<int32_t> at(n);
    for (int64_t r = 0; r < n; ++r) {
      if (picked[r] < 0 || picked[r] >= rows_ || want[r] < 0 || want[r] >= config_.vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("Score: row ", picked[r], " of ", rows_, ", target ", want[r]));
      }
      const bool here = want[r] >= vocab_begin_ && want[r] < vocab_end_;
      at[r] = static_cast<int32_t>(r * N + (here ? want[r] - vocab_begin_ : 0));
    }
    RETURN_IF_ERROR(Put(*m.last, picked));
    RETURN_IF_ERROR(m.in->Reserve(static_cast<size_t>(n * H) * sizeof(float)));
    RETURN_IF_ERROR(be.GatherRows(Ptr<float>(m.x), H, Ptr<int32_t>(m.last), n, Ptr<float>(m.in)));
    RETURN_IF_ERROR(be.RmsNorm(Ptr<float>(m.in), n, H, final_norm_, eps, Ptr<float>(m.h)));
    RETURN_IF_ERROR(Gemm(lm_head_, *m.h, n, *m.logits));
    std::vector<float> mine(n * SummaryWidth(top_logprobs)), target_logits(n);
    RETURN_IF_ERROR(be.VocabSummaries(Ptr<float>(m.logits), n, N, N, vocab_begin_,
                                      SummaryCandidates(top_logprobs), mine.data()));
    RETURN_IF_ERROR(Put(*m.ids, at));
    RETURN_IF_ERROR(m.targets->Reserve(static_cast<size_t>(n) * sizeof(float)));
    RETURN_IF_ERROR(
        be.GatherRows(Ptr<float>(m.logits), 1, Ptr<int32_t>(m.ids), n, Ptr<float>(m.targets)));
    RETURN_IF_ERROR(be.CopyToHost(target_logits.data(), m.targets->data(), n * sizeof(float)));
    for (int64_t r = 0; r < n; ++r) {
      if (want[r] < vocab_begin_ || want[r] >= vocab_end_) target_logits[r] = -INFINITY;
    }
    ASSIGN_OR_RETURN(std::vector<SampledToken> scored,
                     ScoreFromSummaries(mine, target_logits, want, top_logprobs, tp_group));
    for (SampledToken& t : scored) out.push_back(std::move(t));
  }
  return out;
}

absl::StatusOr<const float*> Transformer::FullLogits() {
  Backend& be = *backend_;
  Buffers& m = buf_;
  if (options_.tp_size == 1) return Ptr<float>(m.logits);  // the slice is the vocabulary
  // Every rank's slice, padded to the stride, to every rank; then the rows of the vocabulary.
  const int64_t S = logit_rows_, V = config_.vocab_size, N = lm_head_.rows;
  const int64_t T = options_.tp_size, ld = logits_stride();
  const size_t slice = static_cast<size_t>(S * ld) * sizeof(float);
  RETURN_IF_ERROR(m.padded->Reserve(slice));
  RETURN_IF_ERROR(m.gathered->Reserve(T * slice));
  RETURN_IF_ERROR(m.full->Reserve(static_cast<size_t>(S * V) * sizeof(float)));
  RETURN_IF_ERROR(be.Copy2D(m.padded->data(), ld * sizeof(float), m.logits->data(),
                            N * sizeof(float), N * sizeof(float), S));
  RETURN_IF_ERROR(
      options_.tp_comm->AllGather(Ptr<float>(m.padded), S * ld, Ptr<float>(m.gathered)));
  for (int64_t t = 0; t < T; ++t) {
    const int64_t v0 = V * t / T, n = V * (t + 1) / T - v0;
    RETURN_IF_ERROR(be.Copy2D(Ptr<float>(m.full) + v0, V * sizeof(float),
                              Ptr<float>(m.gathered) + t * S * ld, ld * sizeof(float),
                              n * sizeof(float), S));
  }
  return Ptr<float>(m.full);
}

absl::StatusOr<std::vector<SampledToken>> Transformer::Sample(const std::vector<Sampler*>& samplers,
                                                              int64_t top_logprobs) {
  ASSIGN_OR_RETURN(const float* logits, FullLogits());
  if (samplers.empty()) return std::vector<SampledToken>();
  const int64_t S = logit_rows_, V = config_.vocab_size;
  if (static_cast<int64_t>(samplers.size()) != S) {
    return absl::InvalidArgumentError(
        absl::StrCat(samplers.size(), " generators for ", S, " sequences"));
  }
  // A sequence whose parameters change its logits is chosen on the host from its row.
  auto processed = [&](int64_t s) {
    return samplers[s] != nullptr && samplers[s]->ProcessesLogits();
  };
  std::vector<SampleSpec> specs(S);
  for (int64_t s = 0; s < S; ++s) {
    if (samplers[s] != nullptr && !processed(s)) specs[s] = samplers[s]->NextSpec();
  }
  const int64_t K = std::min(top_logprobs, V);
  std::vector<int32_t> ids(S), top_ids(S * K);
  std::vector<float> lps(S), top_lps(S * K);
  RETURN_IF_ERROR(backend_->SampleRows(logits, S, V, specs.data(), K, ids.data(), lps.data(),
                                       top_ids.data(), top_lps.data()));
  std::vector<SampledToken> out(S);
  std::vector<float> row;
  for (int64_t s = 0; s < S; ++s) {
    if (processed(s)) {
      row.resize(V);
      RETURN_IF_ERROR(backend_->CopyToHost(row.data(), logits + s * V, V * sizeof(float)));
      out[s] = samplers[s]->Sample(row.data(), V);
      continue;
    }
    out[s] = {ids[s], lps[s], {}};
    for (int64_t j = 0; j < K; ++j) out[s].top.push_back({top_ids[s * K + j], top_lps[s * K + j]});
  }
  return out;
}

absl::Status Transformer::ForwardStage(std::vector<SequenceChunk>& chunks, KvCache& cache,
                                       const float* hidden_in, std::vector<float>& out) {
  if (!first_stage()) {
    if (hidden_in == nullptr) {
      return absl::InvalidArgumentError("a stage after the first needs hidden states");
    }
    int64_t rows = 0;
    for (const SequenceChunk& ch : chunks) rows += static_cast<int64_t>(ch.tokens.size());
    RETURN_IF_ERROR(HiddenFromHost(hidden_in, rows));
  }
  RETURN_IF_ERROR(Run(chunks, cache));
  return last_stage() ? LogitsToHost(out) : HiddenToHost(out);
}

absl::Status Transformer::Forward(std::vector<SequenceChunk>& chunks, KvCache& cache,
                                  std::vector<float>& logits) {
  if (!first_stage() || !last_stage()) {
    return absl::FailedPreconditionError("Forward runs a whole model; a stage uses ForwardStage");
  }
  RETURN_IF_ERROR(Run(chunks, cache));
  return GatherLogits(logits);
}

absl::Status Transformer::GatherLogits(std::vector<float>& logits) {
  ASSIGN_OR_RETURN(const float* full, FullLogits());
  logits.resize(logit_rows_ * config_.vocab_size);
  return backend_->CopyToHost(logits.data(), full, logits.size() * sizeof(float));
}

}  // namespace shardserve
