#include "model/cuda_transformer.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "backend/cuda/cuda_backend.h"
#include "common/status.h"
#include "model/vocab_parallel.h"

namespace shardserve {
namespace {

struct DevMat {
  cuda::DeviceBuffer buf;
  cuda::DeviceWeight w;
};

// A matrix view of the CPU model (rows of a mapped file, or a column slice of them) copied from
// the mapping to a dense device matrix: only the view's columns travel.
absl::StatusOr<DevMat> Upload(const cpu::WeightMatrix& m) {
  DevMat d;
  if (m.rows == 0) return d;
  const size_t elem = DTypeSize(m.dtype);
  ASSIGN_OR_RETURN(d.buf, cuda::DeviceBuffer::Alloc(static_cast<size_t>(m.rows * m.cols) * elem));
  RETURN_IF_ERROR(cuda::Copy2D(d.buf.data(), m.cols * elem, m.data, m.row_stride * elem,
                               m.cols * elem, m.rows));
  d.w = {m.dtype, d.buf.data(), m.rows, m.cols, m.cols};
  return d;
}

// The device table of one projection's local expert matrices, for cuda::ExpertMatVec.
struct ExpertTable {
  cuda::DeviceBuffer ptrs;
  cuda::ExpertWeights w;
};

// A float vector on the device; empty stays empty (an absent bias).
absl::StatusOr<cuda::DeviceBuffer> Upload(const std::vector<float>& v) {
  if (v.empty()) return cuda::DeviceBuffer();
  ASSIGN_OR_RETURN(cuda::DeviceBuffer b, cuda::DeviceBuffer::Alloc(v.size() * sizeof(float)));
  RETURN_IF_ERROR(b.CopyFromHost(v.data(), v.size() * sizeof(float)));
  return b;
}

template <typename T>
T* Ptr(const cuda::DeviceBuffer& b) {
  return static_cast<T*>(b.data());
}

}  // namespace

struct CudaTransformer::Impl {
  struct Expert {
    DevMat gate, up, down;
  };
  struct Layer {
    cuda::DeviceBuffer input_norm, post_norm, q_bias, k_bias, v_bias, o_bias;
    DevMat q, k, v, o, gate, up, down, router;
    std::vector<Expert> experts;                   // this rank's, from expert_begin_
    ExpertTable gate_table, up_table, down_table;  // empty when the experts differ in dtype
  };

  std::unique_ptr<Transformer> cpu;  // shapes, sharding, batch preparation
  std::unique_ptr<cuda::Context> ctx;
  DevMat embed, lm_head;
  cuda::DeviceBuffer final_norm, inv_freq;
  std::vector<Layer> layers;
  const KvCache* kv_for = nullptr;
  std::vector<cuda::DeviceBuffer> kv_k, kv_v;  // per layer: [blocks][kv_heads][slot][hd]
  // Activations and batch layout, grown as batches grow.
  cuda::DeviceBuffer x, h, q, k, v, attn, o, g, u, d, in, router, ids, pos, table, offsets, sel,
      weights, routes, route_weights, last, logits, padded, gathered, full;
  // The last Run: its rows and sequences (the rows of `logits` on the last stage); the rows of
  // the input in x (-1: none given).
  int64_t rows = 0, seqs = 0, input_rows = -1;

  absl::Status Grow(cuda::DeviceBuffer& b, size_t bytes) {
    if (b.size() >= bytes) return absl::OkStatus();
    ASSIGN_OR_RETURN(b, cuda::DeviceBuffer::Alloc(std::max<size_t>(bytes, 2 * b.size())));
    return absl::OkStatus();
  }
  template <typename T>
  absl::Status Put(cuda::DeviceBuffer& b, const std::vector<T>& v) {
    RETURN_IF_ERROR(Grow(b, std::max<size_t>(1, v.size()) * sizeof(T)));
    return b.CopyFromHost(v.data(), v.size() * sizeof(T));
  }
  absl::Status AllReduce(float* data, size_t count) {
    const Transformer::Options& o = cpu->options_;
    if (o.tp_size == 1) return absl::OkStatus();
    return o.tp_comm->AllReduceSum(data, count);
  }
  absl::Status Gemm(const DevMat& w, const cuda::DeviceBuffer& x_in, int64_t M,
                    cuda::DeviceBuffer& y) {
    RETURN_IF_ERROR(Grow(y, static_cast<size_t>(M * w.w.rows) * sizeof(float)));
    return cuda::Gemm(*ctx, w.w, Ptr<float>(x_in), M, Ptr<float>(y));
  }
  absl::Status Bias(cuda::DeviceBuffer& y, int64_t rows, int64_t cols,
                    const cuda::DeviceBuffer& bias) {
    if (bias.size() == 0) return absl::OkStatus();
    return cuda::AddBias(Ptr<float>(y), rows, cols, Ptr<float>(bias));
  }
  absl::Status Mlp(const Layer& L, int64_t rows);
  absl::Status Moe(const Layer& L, int64_t rows);
  absl::Status MoeGrouped(const Layer& L, int64_t rows);
};

namespace {

// The table of one projection over a layer's local experts; empty unless they share a dtype.
absl::StatusOr<ExpertTable> TableOf(const std::vector<DevMat*>& mats, int64_t expert_begin) {
  ExpertTable t;
  if (mats.empty()) return t;
  std::vector<const void*> ptrs;
  for (const DevMat* m : mats) {
    if (m->w.dtype != mats[0]->w.dtype) return ExpertTable();
    ptrs.push_back(m->w.data);
  }
  ASSIGN_OR_RETURN(t.ptrs, cuda::DeviceBuffer::Alloc(ptrs.size() * sizeof(void*)));
  RETURN_IF_ERROR(t.ptrs.CopyFromHost(ptrs.data(), ptrs.size() * sizeof(void*)));
  t.w = {mats[0]->w.dtype, static_cast<const void* const*>(t.ptrs.data()),
         expert_begin,     static_cast<int64_t>(mats.size()),
         mats[0]->w.rows,  mats[0]->w.cols};
  return t;
}

}  // namespace

CudaTransformer::CudaTransformer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaTransformer::~CudaTransformer() = default;

absl::StatusOr<std::unique_ptr<CudaTransformer>> CudaTransformer::Load(
    const std::string& model_dir, const Transformer::Options& options, int device) {
  if (cuda::DeviceCount() <= device) {
    return absl::FailedPreconditionError(absl::StrCat("CUDA device ", device, " is not available (",
                                                      cuda::DeviceCount(), " GPU(s) visible)"));
  }
  auto impl = std::make_unique<Impl>();
  Transformer::Options o = options;
  o.num_threads = 1;
  ASSIGN_OR_RETURN(impl->cpu, Transformer::Load(model_dir, o));
  ASSIGN_OR_RETURN(impl->ctx, cuda::Context::Create(device));
  const Transformer& t = *impl->cpu;
  if (t.first_stage()) {
    ASSIGN_OR_RETURN(impl->embed, Upload(t.embed_));
  }
  if (t.last_stage()) {
    ASSIGN_OR_RETURN(impl->lm_head, Upload(t.lm_head_));
    ASSIGN_OR_RETURN(impl->final_norm, Upload(t.final_norm_));
  }
  ASSIGN_OR_RETURN(impl->inv_freq, Upload(t.rope_.inv_freq()));
  for (const Transformer::Layer& L : t.layers_) {
    Impl::Layer d;
    ASSIGN_OR_RETURN(d.input_norm, Upload(L.input_norm));
    ASSIGN_OR_RETURN(d.post_norm, Upload(L.post_norm));
    ASSIGN_OR_RETURN(d.q_bias, Upload(L.q_bias));
    ASSIGN_OR_RETURN(d.k_bias, Upload(L.k_bias));
    ASSIGN_OR_RETURN(d.v_bias, Upload(L.v_bias));
    ASSIGN_OR_RETURN(d.o_bias, Upload(L.o_bias));
    ASSIGN_OR_RETURN(d.q, Upload(L.q));
    ASSIGN_OR_RETURN(d.k, Upload(L.k));
    ASSIGN_OR_RETURN(d.v, Upload(L.v));
    ASSIGN_OR_RETURN(d.o, Upload(L.o));
    ASSIGN_OR_RETURN(d.gate, Upload(L.gate));
    ASSIGN_OR_RETURN(d.up, Upload(L.up));
    ASSIGN_OR_RETURN(d.down, Upload(L.down));
    ASSIGN_OR_RETURN(d.router, Upload(L.router));
    for (int64_t e = t.expert_begin_; e < t.expert_end_ && !L.experts.empty(); ++e) {
      Impl::Expert x;
      ASSIGN_OR_RETURN(x.gate, Upload(L.experts[e].gate));
      ASSIGN_OR_RETURN(x.up, Upload(L.experts[e].up));
      ASSIGN_OR_RETURN(x.down, Upload(L.experts[e].down));
      d.experts.push_back(std::move(x));
    }
    std::vector<DevMat*> gates, ups, downs;
    for (Impl::Expert& x : d.experts) {
      gates.push_back(&x.gate);
      ups.push_back(&x.up);
      downs.push_back(&x.down);
    }
    ASSIGN_OR_RETURN(d.gate_table, TableOf(gates, t.expert_begin_));
    ASSIGN_OR_RETURN(d.up_table, TableOf(ups, t.expert_begin_));
    ASSIGN_OR_RETURN(d.down_table, TableOf(downs, t.expert_begin_));
    impl->layers.push_back(std::move(d));
  }
  RETURN_IF_ERROR(cuda::Synchronize());
  t.weights_->DropResidentPages();  // on the device now; the host copy leaves this process
  return std::unique_ptr<CudaTransformer>(new CudaTransformer(std::move(impl)));
}

const ModelConfig& CudaTransformer::config() const { return impl_->cpu->config(); }
int64_t CudaTransformer::vocab_begin() const { return impl_->cpu->vocab_begin(); }
int64_t CudaTransformer::vocab_end() const { return impl_->cpu->vocab_end(); }
int64_t CudaTransformer::logits_stride() const { return impl_->cpu->logits_stride(); }
bool CudaTransformer::first_stage() const { return impl_->cpu->first_stage(); }
bool CudaTransformer::last_stage() const { return impl_->cpu->last_stage(); }
size_t CudaTransformer::shard_weight_bytes() const { return impl_->cpu->shard_weight_bytes(); }
size_t CudaTransformer::stage_weight_bytes() const { return impl_->cpu->stage_weight_bytes(); }

absl::StatusOr<std::unique_ptr<KvCache>> CudaTransformer::NewKvCache(int64_t positions,
                                                                     int64_t block_size) {
  std::unique_ptr<KvCache> cache = impl_->cpu->NewKvCache(positions, block_size);
  const Transformer& t = *impl_->cpu;
  const size_t bytes =
      static_cast<size_t>(cache->num_blocks() * t.kv_heads_ * block_size * t.config().head_dim) *
      sizeof(float);
  impl_->kv_k.clear();
  impl_->kv_v.clear();
  for (size_t l = 0; l < impl_->layers.size(); ++l) {
    ASSIGN_OR_RETURN(cuda::DeviceBuffer k, cuda::DeviceBuffer::Alloc(bytes));
    ASSIGN_OR_RETURN(cuda::DeviceBuffer v, cuda::DeviceBuffer::Alloc(bytes));
    impl_->kv_k.push_back(std::move(k));
    impl_->kv_v.push_back(std::move(v));
  }
  impl_->kv_for = cache.get();
  return cache;
}

absl::Status CudaTransformer::Impl::Mlp(const Layer& L, int64_t rows) {
  RETURN_IF_ERROR(Gemm(L.gate, h, rows, g));
  RETURN_IF_ERROR(Gemm(L.up, h, rows, u));
  RETURN_IF_ERROR(cuda::SiluMul(Ptr<float>(g), Ptr<float>(u), rows * L.gate.w.rows));
  return Gemm(L.down, g, rows, o);
}

absl::Status CudaTransformer::Impl::Moe(const Layer& L, int64_t rows) {
  const ModelConfig& c = cpu->config();
  const int64_t H = c.hidden_size, k = c.experts_per_token, slots = rows * k;
  RETURN_IF_ERROR(Gemm(L.router, h, rows, router));
  RETURN_IF_ERROR(Grow(routes, static_cast<size_t>(slots) * sizeof(int32_t)));
  RETURN_IF_ERROR(Grow(route_weights, static_cast<size_t>(slots) * sizeof(float)));
  RETURN_IF_ERROR(cuda::RouteTopK(Ptr<float>(router), rows, c.num_experts, k, Ptr<int32_t>(routes),
                                  Ptr<float>(route_weights)));
  RETURN_IF_ERROR(Grow(o, static_cast<size_t>(rows * H) * sizeof(float)));
  const bool tables =
      L.gate_table.w.count > 0 && L.up_table.w.count > 0 && L.down_table.w.count > 0;
  if (!tables || slots > L.gate_table.w.count) return MoeGrouped(L, rows);
  // Decode: one matrix-vector product per (row, chosen expert), experts read on the device.
  const int64_t I = L.gate_table.w.rows;
  RETURN_IF_ERROR(Grow(g, static_cast<size_t>(slots * I) * sizeof(float)));
  RETURN_IF_ERROR(Grow(u, static_cast<size_t>(slots * I) * sizeof(float)));
  RETURN_IF_ERROR(Grow(d, static_cast<size_t>(slots * H) * sizeof(float)));
  const int32_t* e = Ptr<int32_t>(routes);
  RETURN_IF_ERROR(cuda::ExpertMatVec(L.gate_table.w, e, slots, Ptr<float>(h), k, Ptr<float>(g)));
  RETURN_IF_ERROR(cuda::ExpertMatVec(L.up_table.w, e, slots, Ptr<float>(h), k, Ptr<float>(u)));
  RETURN_IF_ERROR(cuda::SiluMul(Ptr<float>(g), Ptr<float>(u), slots * I));
  RETURN_IF_ERROR(cuda::ExpertMatVec(L.down_table.w, e, slots, Ptr<float>(g), 1, Ptr<float>(d)));
  return cuda::CombineSlots(Ptr<float>(d), Ptr<float>(route_weights), rows, k, H, Ptr<float>(o));
}

// Larger batches: the routes come back (rows * k ids and weights) to group the rows of each
// local expert, which then run as one cuBLAS GEMM each.
absl::Status CudaTransformer::Impl::MoeGrouped(const Layer& L, int64_t rows) {
  const ModelConfig& c = cpu->config();
  const int64_t H = c.hidden_size, k = c.experts_per_token;
  std::vector<int32_t> experts(rows * k);
  std::vector<float> weight(rows * k);
  RETURN_IF_ERROR(routes.CopyToHost(experts.data(), experts.size() * sizeof(int32_t)));
  RETURN_IF_ERROR(route_weights.CopyToHost(weight.data(), weight.size() * sizeof(float)));
  std::vector<std::vector<int32_t>> ids(c.num_experts);
  std::vector<std::vector<float>> w(c.num_experts);
  for (int64_t i = 0; i < rows * k; ++i) {
    ids[experts[i]].push_back(static_cast<int32_t>(i / k));
    w[experts[i]].push_back(weight[i]);
  }
  RETURN_IF_ERROR(cuda::Zero(o.data(), static_cast<size_t>(rows * H) * sizeof(float)));
  for (int64_t e = cpu->expert_begin_; e < cpu->expert_end_; ++e) {
    if (ids[e].empty()) continue;
    const int64_t n = static_cast<int64_t>(ids[e].size());
    RETURN_IF_ERROR(Put(sel, ids[e]));
    RETURN_IF_ERROR(Put(weights, w[e]));
    RETURN_IF_ERROR(Grow(in, static_cast<size_t>(n * H) * sizeof(float)));
    RETURN_IF_ERROR(cuda::GatherRows(Ptr<float>(h), H, Ptr<int32_t>(sel), n, Ptr<float>(in)));
    const Expert& x = L.experts[e - cpu->expert_begin_];
    RETURN_IF_ERROR(Gemm(x.gate, in, n, g));
    RETURN_IF_ERROR(Gemm(x.up, in, n, u));
    RETURN_IF_ERROR(cuda::SiluMul(Ptr<float>(g), Ptr<float>(u), n * x.gate.w.rows));
    RETURN_IF_ERROR(Gemm(x.down, g, n, d));
    RETURN_IF_ERROR(cuda::ScaleAddRows(Ptr<float>(d), H, Ptr<int32_t>(sel), Ptr<float>(weights), n,
                                       Ptr<float>(o)));
  }
  return absl::OkStatus();
}

absl::Status CudaTransformer::HiddenFromHost(const float* hidden, int64_t rows) {
  Impl& m = *impl_;
  const size_t bytes = static_cast<size_t>(rows * config().hidden_size) * sizeof(float);
  RETURN_IF_ERROR(m.Grow(m.x, bytes));
  RETURN_IF_ERROR(m.x.CopyFromHost(hidden, bytes));
  m.input_rows = rows;
  return absl::OkStatus();
}

absl::Status CudaTransformer::ReceiveHidden(Communicator& link, int peer, int64_t rows) {
  Impl& m = *impl_;
  const size_t bytes = static_cast<size_t>(rows * config().hidden_size) * sizeof(float);
  RETURN_IF_ERROR(m.Grow(m.x, bytes));
  RETURN_IF_ERROR(link.Recv(m.x.data(), bytes, peer));
  m.input_rows = rows;
  return absl::OkStatus();
}

absl::Status CudaTransformer::Run(std::vector<SequenceChunk>& chunks, KvCache& cache) {
  Impl& m = *impl_;
  m.rows = m.seqs = 0;
  const int64_t input_rows = std::exchange(m.input_rows, -1);
  const Transformer& t = *m.cpu;
  const ModelConfig& c = t.config();
  const int64_t H = c.hidden_size, hd = c.head_dim;
  if (&cache != m.kv_for) {
    return absl::FailedPreconditionError("the KV cache must come from this model's NewKvCache");
  }
  int64_t rows = 0;
  for (const SequenceChunk& ch : chunks) rows += static_cast<int64_t>(ch.tokens.size());
  if (!first_stage() && input_rows != rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("a stage after the first needs the hidden states of its ", rows,
                     " rows (given: ", std::max<int64_t>(input_rows, 0), ")"));
  }
  ASSIGN_OR_RETURN(PreparedBatch batch, t.PrepareBatch(chunks, cache));
  // The batch layout: token ids, positions, and each row's offset into the chunks' block tables.
  std::vector<int32_t> ids, pos(rows), table, offsets(rows);
  int64_t max_len = 0;
  {
    int64_t r = 0;
    for (const SequenceChunk& ch : chunks) {
      const int32_t offset = static_cast<int32_t>(table.size());
      table.insert(table.end(), ch.kv->blocks.begin(), ch.kv->blocks.end());
      for (int32_t tok : ch.tokens) {
        ids.push_back(tok);
        pos[r] = static_cast<int32_t>(batch.row_pos[r]);
        offsets[r] = offset;
        max_len = std::max(max_len, batch.row_pos[r] + 1);
        ++r;
      }
    }
  }
  RETURN_IF_ERROR(m.Put(m.ids, ids));
  RETURN_IF_ERROR(m.Put(m.pos, pos));
  RETURN_IF_ERROR(m.Put(m.table, table));
  RETURN_IF_ERROR(m.Put(m.offsets, offsets));
  const size_t x_bytes = static_cast<size_t>(rows * H) * sizeof(float);
  RETURN_IF_ERROR(m.Grow(m.x, x_bytes));
  RETURN_IF_ERROR(m.Grow(m.h, x_bytes));
  if (first_stage()) {
    RETURN_IF_ERROR(cuda::Embed(m.embed.w, Ptr<int32_t>(m.ids), rows, t.vocab_begin(),
                                t.vocab_end(), Ptr<float>(m.x)));
    RETURN_IF_ERROR(m.AllReduce(Ptr<float>(m.x), rows * H));
  }

  const int64_t heads = t.heads_, kv_heads = t.kv_heads_;
  const int64_t group = c.num_heads / c.num_kv_heads, head0 = t.options_.tp_rank * heads;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  RETURN_IF_ERROR(m.Grow(m.attn, static_cast<size_t>(rows * heads * hd) * sizeof(float)));
  for (size_t li = 0; li < m.layers.size(); ++li) {
    const Impl::Layer& L = m.layers[li];
    RETURN_IF_ERROR(
        cuda::RmsNorm(Ptr<float>(m.x), rows, H, Ptr<float>(L.input_norm), eps, Ptr<float>(m.h)));
    RETURN_IF_ERROR(m.Gemm(L.q, m.h, rows, m.q));
    RETURN_IF_ERROR(m.Gemm(L.k, m.h, rows, m.k));
    RETURN_IF_ERROR(m.Gemm(L.v, m.h, rows, m.v));
    RETURN_IF_ERROR(m.Bias(m.q, rows, heads * hd, L.q_bias));
    RETURN_IF_ERROR(m.Bias(m.k, rows, kv_heads * hd, L.k_bias));
    RETURN_IF_ERROR(m.Bias(m.v, rows, kv_heads * hd, L.v_bias));
    RETURN_IF_ERROR(
        cuda::Rope(Ptr<float>(m.q), rows, heads, hd, Ptr<int32_t>(m.pos), Ptr<float>(m.inv_freq)));
    RETURN_IF_ERROR(cuda::Rope(Ptr<float>(m.k), rows, kv_heads, hd, Ptr<int32_t>(m.pos),
                               Ptr<float>(m.inv_freq)));
    const cuda::DeviceKv kv{Ptr<float>(m.kv_k[li]), Ptr<float>(m.kv_v[li]), kv_heads,
                            cache.block_size(), hd};
    RETURN_IF_ERROR(cuda::WriteKv(kv, Ptr<float>(m.k), Ptr<float>(m.v), rows, Ptr<int32_t>(m.pos),
                                  Ptr<int32_t>(m.table), Ptr<int32_t>(m.offsets)));
    RETURN_IF_ERROR(cuda::Attention(*m.ctx, kv, Ptr<float>(m.q), rows, heads, head0, group,
                                    t.kv_head_begin_, Ptr<int32_t>(m.pos), Ptr<int32_t>(m.table),
                                    Ptr<int32_t>(m.offsets), max_len, scale, Ptr<float>(m.attn)));
    // Row-parallel o_proj: partial sums over this rank's heads, then one all-reduce.
    RETURN_IF_ERROR(m.Gemm(L.o, m.attn, rows, m.o));
    RETURN_IF_ERROR(m.AllReduce(Ptr<float>(m.o), rows * H));
    RETURN_IF_ERROR(m.Bias(m.o, rows, H, L.o_bias));
    RETURN_IF_ERROR(cuda::Add(Ptr<float>(m.x), Ptr<float>(m.o), rows * H));
    RETURN_IF_ERROR(
        cuda::RmsNorm(Ptr<float>(m.x), rows, H, Ptr<float>(L.post_norm), eps, Ptr<float>(m.h)));
    RETURN_IF_ERROR(c.moe ? m.Moe(L, rows) : m.Mlp(L, rows));
    RETURN_IF_ERROR(m.AllReduce(Ptr<float>(m.o), rows * H));  // row-parallel down / experts
    RETURN_IF_ERROR(cuda::Add(Ptr<float>(m.x), Ptr<float>(m.o), rows * H));
  }
  for (SequenceChunk& ch : chunks) ch.kv->length += static_cast<int64_t>(ch.tokens.size());
  m.rows = rows;
  m.seqs = static_cast<int64_t>(chunks.size());
  if (!last_stage()) return absl::OkStatus();
  // Vocab-parallel LM head on each sequence's last row: this rank's slice of the logits.
  const int64_t S = m.seqs;
  std::vector<int32_t> last(batch.last_row.begin(), batch.last_row.end());
  RETURN_IF_ERROR(m.Put(m.last, last));
  RETURN_IF_ERROR(m.Grow(m.in, static_cast<size_t>(S * H) * sizeof(float)));
  RETURN_IF_ERROR(cuda::GatherRows(Ptr<float>(m.x), H, Ptr<int32_t>(m.last), S, Ptr<float>(m.in)));
  RETURN_IF_ERROR(
      cuda::RmsNorm(Ptr<float>(m.in), S, H, Ptr<float>(m.final_norm), eps, Ptr<float>(m.h)));
  return m.Gemm(m.lm_head, m.h, S, m.logits);
}

absl::Status CudaTransformer::HiddenToHost(std::vector<float>& out) const {
  const Impl& m = *impl_;
  out.resize(m.rows * config().hidden_size);
  return m.x.CopyToHost(out.data(), out.size() * sizeof(float));
}

absl::Status CudaTransformer::SendHidden(Communicator& link, int peer) {
  const Impl& m = *impl_;
  return link.Send(m.x.data(), static_cast<size_t>(m.rows * config().hidden_size) * sizeof(float),
                   peer);
}

absl::Status CudaTransformer::LogitsToHost(std::vector<float>& out) const {
  const Impl& m = *impl_;
  const int64_t N = m.lm_head.w.rows, ld = logits_stride();
  out.assign(m.seqs * ld, 0.0f);
  return cuda::Copy2D(out.data(), ld * sizeof(float), m.logits.data(), N * sizeof(float),
                      N * sizeof(float), m.seqs);
}

absl::StatusOr<std::vector<SampledToken>> CudaTransformer::Greedy(int64_t top_logprobs,
                                                                  Communicator* tp_group) {
  Impl& m = *impl_;
  const int64_t N = m.lm_head.w.rows;
  std::vector<float> mine(m.seqs * SummaryWidth(top_logprobs));
  RETURN_IF_ERROR(cuda::VocabSummaries(*m.ctx, Ptr<float>(m.logits), m.seqs, N, N, vocab_begin(),
                                       SummaryCandidates(top_logprobs), mine.data()));
  return GreedyFromSummaries(mine, m.seqs, top_logprobs, tp_group);
}

absl::StatusOr<std::vector<SampledToken>> CudaTransformer::Sample(
    const std::vector<Sampler*>& samplers, int64_t top_logprobs) {
  Impl& m = *impl_;
  const Transformer::Options& o = m.cpu->options_;
  const int64_t S = m.seqs, V = config().vocab_size, N = m.lm_head.w.rows;
  const float* logits = Ptr<float>(m.logits);
  if (o.tp_size > 1) {
    // Every rank's slice, padded to the stride, to every rank; then the rows of the vocabulary.
    const int64_t T = o.tp_size, ld = logits_stride();
    const size_t slice = static_cast<size_t>(S * ld) * sizeof(float);
    RETURN_IF_ERROR(m.Grow(m.padded, slice));
    RETURN_IF_ERROR(m.Grow(m.gathered, T * slice));
    RETURN_IF_ERROR(m.Grow(m.full, static_cast<size_t>(S * V) * sizeof(float)));
    RETURN_IF_ERROR(cuda::Copy2D(m.padded.data(), ld * sizeof(float), m.logits.data(),
                                 N * sizeof(float), N * sizeof(float), S));
    RETURN_IF_ERROR(o.tp_comm->AllGather(Ptr<float>(m.padded), S * ld, Ptr<float>(m.gathered)));
    if (samplers.empty()) return std::vector<SampledToken>();
    for (int64_t t = 0; t < T; ++t) {
      const int64_t v0 = V * t / T, n = V * (t + 1) / T - v0;
      RETURN_IF_ERROR(cuda::Copy2D(Ptr<float>(m.full) + v0, V * sizeof(float),
                                   Ptr<float>(m.gathered) + t * S * ld, ld * sizeof(float),
                                   n * sizeof(float), S));
    }
    logits = Ptr<float>(m.full);
  } else if (samplers.empty()) {
    return std::vector<SampledToken>();
  }
  if (static_cast<int64_t>(samplers.size()) != S) {
    return absl::InvalidArgumentError(
        absl::StrCat(samplers.size(), " generators for ", S, " sequences"));
  }
  std::vector<cuda::SampleSpec> specs(S);
  for (int64_t s = 0; s < S; ++s) {
    if (samplers[s] == nullptr) continue;  // not sampled now: a greedy row, its result unused
    const SamplingParams& p = samplers[s]->params();
    specs[s] = {p.temperature, p.top_p, static_cast<int32_t>(p.top_k), samplers[s]->NextDraw()};
  }
  const int64_t K = std::min(top_logprobs, V);
  std::vector<int32_t> ids(S), top_ids(S * K);
  std::vector<float> lps(S), top_lps(S * K);
  RETURN_IF_ERROR(cuda::SampleRows(*m.ctx, logits, S, V, specs.data(), K, ids.data(), lps.data(),
                                   top_ids.data(), top_lps.data()));
  std::vector<SampledToken> out(S);
  for (int64_t s = 0; s < S; ++s) {
    out[s] = {ids[s], lps[s], {}};
    for (int64_t j = 0; j < K; ++j) out[s].top.push_back({top_ids[s * K + j], top_lps[s * K + j]});
  }
  return out;
}

absl::Status CudaTransformer::ForwardStage(std::vector<SequenceChunk>& chunks, KvCache& cache,
                                           const float* hidden_in, std::vector<float>& out) {
  if (hidden_in != nullptr) {
    int64_t rows = 0;
    for (const SequenceChunk& ch : chunks) rows += static_cast<int64_t>(ch.tokens.size());
    RETURN_IF_ERROR(HiddenFromHost(hidden_in, rows));
  }
  RETURN_IF_ERROR(Run(chunks, cache));
  return last_stage() ? LogitsToHost(out) : HiddenToHost(out);
}

absl::Status CudaTransformer::Forward(std::vector<SequenceChunk>& chunks, KvCache& cache,
                                      std::vector<float>& logits) {
  if (!first_stage() || !last_stage() || impl_->cpu->options_.tp_size != 1) {
    return absl::FailedPreconditionError(
        "Forward runs a whole model on one GPU; a stage or a TP rank uses ForwardStage");
  }
  return ForwardStage(chunks, cache, nullptr, logits);  // one rank: the slice is the vocabulary
}

}  // namespace shardserve
