// The backend seam on one GPU: device memory, the kernels of cuda_backend.h, weights copied from
// the host views to dense device matrices (only a view's own columns travel).
#include <algorithm>
#include <deque>
#include <utility>

#include "absl/strings/str_cat.h"
#include "backend/cuda/cuda_backend.h"
#include "common/status.h"

namespace shardserve::cuda {
namespace {

class GpuBuffer : public Buffer {
 public:
  absl::Status Reserve(size_t bytes) override {
    if (b_.size() >= bytes) return absl::OkStatus();
    b_ = DeviceBuffer();  // free first: the old contents need not survive
    ASSIGN_OR_RETURN(b_, DeviceBuffer::Alloc(std::max<size_t>(bytes, 2 * size_)));
    size_ = b_.size();
    return absl::OkStatus();
  }
  void* data() const override { return b_.data(); }
  size_t size() const override { return b_.size(); }

 private:
  DeviceBuffer b_;
  size_t size_ = 0;  // the last size, kept across the free so growth stays geometric
};

// One device buffer of K and one of V per layer.
struct GpuKv : KvStorage {
  std::vector<DeviceBuffer> k, v;
  int64_t kv_heads = 0, block_size = 0, head_dim = 0;
  absl::StatusOr<DeviceKv> Layer(int64_t layer) const {
    if (layer < 0 || layer >= static_cast<int64_t>(k.size())) {
      return absl::FailedPreconditionError(
          absl::StrCat("layer ", layer, " is outside the KV cache's ", k.size(), " layers"));
    }
    return DeviceKv{
        k[layer].data(),      v[layer].data(),     kv_heads, block_size, head_dim, format.dtype,
        format.KScale(layer), format.VScale(layer)};
  }
  void* block_data(int64_t layer, int kv, int64_t block) const override {
    return static_cast<char*>((kv == 0 ? k : v)[layer].data()) + block * block_bytes();
  }
  size_t block_bytes() const override {
    return static_cast<size_t>(kv_heads * block_size * head_dim) * DTypeSize(format.dtype);
  }
  bool on_host() const override { return false; }
};

// One device buffer per layer of a latent cache.
struct GpuLatentKv : KvStorage {
  std::vector<DeviceBuffer> layers;
  int64_t block_size = 0, latent_dim = 0, rope_dim = 0;
  absl::StatusOr<DeviceLatentKv> Layer(int64_t layer) const {
    if (layer < 0 || layer >= static_cast<int64_t>(layers.size())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "layer ", layer, " is outside the latent KV cache's ", layers.size(), " layers"));
    }
    return DeviceLatentKv{layers[layer].data(), block_size,          latent_dim, rope_dim,
                          format.dtype,         format.KScale(layer)};
  }
  void* block_data(int64_t layer, int kv, int64_t block) const override {
    return kv == 0 ? static_cast<char*>(layers[layer].data()) + block * block_bytes() : nullptr;
  }
  size_t block_bytes() const override {
    return static_cast<size_t>(block_size * (latent_dim + rope_dim)) * DTypeSize(format.dtype);
  }
  bool on_host() const override { return false; }
};

class CudaBackend : public Backend {
 public:
  explicit CudaBackend(std::unique_ptr<Context> ctx) : ctx_(std::move(ctx)) {}
  bool copies_weights() const override { return true; }
  bool host_memory() const override { return false; }

  std::unique_ptr<Buffer> NewBuffer() override { return std::make_unique<GpuBuffer>(); }
  absl::StatusOr<WeightMatrix> Upload(const WeightMatrix& m) override {
    if (m.rows == 0) return WeightMatrix{m.dtype, nullptr, 0, m.cols, m.cols};
    if (IsStorageOnly(m.dtype)) {  // the model expands them at load (model/fp8.h, mxfp4.h)
      return absl::UnimplementedError(
          absl::StrCat(DTypeName(m.dtype), " weights reach no kernel of this backend"));
    }
    if (IsQuantized(m.dtype) && !RunsQuantized(m.dtype)) {
      return absl::UnimplementedError(
          absl::StrCat(DTypeName(m.dtype),
                       " weights do not run on the CUDA backend (F32, F16, BF16, Q8_0, "
                       "Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, F8_128)"));
    }
    // Rows of whole blocks, as the file keeps them; 16 bytes past the end, so that the kernels'
    // aligned loads around a row's last bytes stay inside the allocation.
    const size_t row = DTypeBytes(m.dtype, m.cols);
    ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Alloc(static_cast<size_t>(m.rows) * row + 16));
    RETURN_IF_ERROR(
        cuda::Copy2D(b.data(), row, m.data, DTypeBytes(m.dtype, m.row_stride), row, m.rows));
    kept_.push_back(std::move(b));
    return WeightMatrix{m.dtype, kept_.back().data(), m.rows, m.cols, m.cols};
  }
  absl::StatusOr<const float*> Upload(const std::vector<float>& v) override {
    if (v.empty()) return nullptr;
    ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Alloc(v.size() * sizeof(float)));
    RETURN_IF_ERROR(b.CopyFromHost(v.data(), v.size() * sizeof(float)));
    kept_.push_back(std::move(b));
    return static_cast<const float*>(kept_.back().data());
  }
  absl::Status CopyFromHost(void* dst, const void* host, size_t bytes) override {
    return Copy2D(dst, bytes, host, bytes, bytes, 1);
  }
  absl::Status CopyToHost(void* host, const void* src, size_t bytes) override {
    return Copy2D(host, bytes, src, bytes, bytes, 1);
  }
  absl::Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                      size_t height) override {
    if (width == 0 || height == 0) return absl::OkStatus();
    return cuda::Copy2D(dst, dst_pitch, src, src_pitch, width, height);
  }
  absl::Status Zero(void* p, size_t bytes) override { return cuda::Zero(p, bytes); }
  absl::Status Synchronize() override { return cuda::Synchronize(); }

  absl::StatusOr<std::unique_ptr<KvStorage>> AllocKv(int64_t layers, int64_t blocks,
                                                     int64_t kv_heads, int64_t block_size,
                                                     int64_t head_dim,
                                                     const KvFormat& format) override {
    RETURN_IF_ERROR(CheckKvFormat(format));
    auto kv = std::make_unique<GpuKv>();
    kv->owner = this;
    kv->format = format;
    const size_t bytes =
        static_cast<size_t>(blocks * kv_heads * block_size * head_dim) * DTypeSize(format.dtype);
    for (int64_t l = 0; l < layers; ++l) {
      ASSIGN_OR_RETURN(DeviceBuffer k, DeviceBuffer::Alloc(bytes));
      ASSIGN_OR_RETURN(DeviceBuffer v, DeviceBuffer::Alloc(bytes));
      kv->k.push_back(std::move(k));
      kv->v.push_back(std::move(v));
    }
    kv->kv_heads = kv_heads;
    kv->block_size = block_size;
    kv->head_dim = head_dim;
    return kv;
  }

  absl::Status Embed(const WeightMatrix& table, const int32_t* ids, int64_t n, int64_t vocab_begin,
                     int64_t vocab_end, float* out) override {
    return cuda::Embed(table, ids, n, vocab_begin, vocab_end, out);
  }
  absl::Status RmsNorm(const float* x, int64_t M, int64_t dim, const float* w, float eps,
                       float* out) override {
    return cuda::RmsNorm(x, M, dim, w, eps, out);
  }
  absl::Status AddRmsNorm(float* x, const float* y, int64_t M, int64_t dim, const float* w,
                          float eps, float* out) override {
    return cuda::AddRmsNorm(x, y, M, dim, w, eps, out);
  }
  absl::Status Gemm(const WeightMatrix& w, const float* x, int64_t M, float* y) override {
    return cuda::Gemm(*ctx_, w, x, M, y);
  }
  absl::Status GemmGroupSameCols(const WeightMatrix* const* ws, float* const* ys, size_t n,
                                 const float* x, int64_t M) override {
    return cuda::GemmGroup(*ctx_, ws, ys, n, x, M);
  }
  absl::Status AddBias(float* x, int64_t rows, int64_t cols, const float* bias) override {
    return cuda::AddBias(x, rows, cols, bias);
  }
  absl::Status Add(float* x, const float* y, int64_t n) override { return cuda::Add(x, y, n); }
  absl::Status SiluMul(float* a, const float* b, int64_t n) override {
    return cuda::SiluMul(a, b, n);
  }
  absl::Status SwiGluClamped(float* a, const float* b, int64_t n, float alpha,
                             float limit) override {
    return cuda::SwiGluClamped(a, b, n, alpha, limit);
  }
  absl::Status Rope(float* x, int64_t rows, int64_t heads, int64_t head_dim,
                    const int32_t* positions, const float* inv_freq) override {
    return cuda::Rope(x, rows, heads, head_dim, positions, inv_freq);
  }
  absl::Status WriteKv(const KvStorage& storage, int64_t layer, const float* k, const float* v,
                       int64_t rows, const int32_t* positions, const int32_t* blocks,
                       const int32_t* block_offset) override {
    ASSIGN_OR_RETURN(DeviceKv kv, static_cast<const GpuKv&>(storage).Layer(layer));
    return cuda::WriteKv(kv, k, v, rows, positions, blocks, block_offset);
  }
  absl::Status Attention(const KvStorage& storage, int64_t layer, const float* q, int64_t rows,
                         int64_t heads, int64_t head0, int64_t group, int64_t kv_head0,
                         const int32_t* positions, const int32_t* blocks,
                         const int32_t* block_offset, int64_t max_len, float scale,
                         const AttentionExtras& extras, float* out) override {
    ASSIGN_OR_RETURN(DeviceKv kv, static_cast<const GpuKv&>(storage).Layer(layer));
    return cuda::Attention(*ctx_, kv, q, rows, heads, head0, group, kv_head0, positions, blocks,
                           block_offset, max_len, scale, extras, out);
  }
  absl::Status HeadGemm(const WeightMatrix& w, int64_t heads, const float* x, int64_t ldx,
                        int64_t x_head, int64_t rows, float* y, int64_t ldy,
                        int64_t y_head) override {
    return cuda::HeadGemm(w, heads, x, ldx, x_head, rows, y, ldy, y_head);
  }
  absl::StatusOr<std::unique_ptr<KvStorage>> AllocLatentKv(int64_t layers, int64_t blocks,
                                                           int64_t block_size, int64_t latent_dim,
                                                           int64_t rope_dim,
                                                           const KvFormat& format) override {
    RETURN_IF_ERROR(CheckKvFormat(format));
    auto kv = std::make_unique<GpuLatentKv>();
    kv->owner = this;
    kv->format = format;
    const size_t bytes = static_cast<size_t>(blocks * block_size * (latent_dim + rope_dim)) *
                         DTypeSize(format.dtype);
    for (int64_t l = 0; l < layers; ++l) {
      ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Alloc(bytes));
      kv->layers.push_back(std::move(b));
    }
    kv->block_size = block_size;
    kv->latent_dim = latent_dim;
    kv->rope_dim = rope_dim;
    return kv;
  }
  absl::Status WriteLatentKv(const KvStorage& storage, int64_t layer, const float* latent,
                             const float* rope, int64_t rows, const int32_t* positions,
                             const int32_t* blocks, const int32_t* block_offset) override {
    ASSIGN_OR_RETURN(DeviceLatentKv kv, static_cast<const GpuLatentKv&>(storage).Layer(layer));
    return cuda::WriteLatentKv(kv, latent, rope, rows, positions, blocks, block_offset);
  }
  absl::Status LatentAttention(const KvStorage& storage, int64_t layer, const float* q_latent,
                               const float* q_rope, int64_t rows, int64_t heads,
                               const int32_t* positions, const int32_t* blocks,
                               const int32_t* block_offset, int64_t max_len, float scale,
                               float* out) override {
    (void)max_len;
    ASSIGN_OR_RETURN(DeviceLatentKv kv, static_cast<const GpuLatentKv&>(storage).Layer(layer));
    return cuda::LatentAttention(kv, q_latent, q_rope, rows, heads, positions, blocks, block_offset,
                                 scale, out);
  }
  absl::Status GatherRows(const float* x, int64_t dim, const int32_t* rows, int64_t n,
                          float* out) override {
    return cuda::GatherRows(x, dim, rows, n, out);
  }
  absl::Status ScaleAddRows(const float* x, int64_t dim, const int32_t* rows, const float* weight,
                            int64_t n, float* y) override {
    return cuda::ScaleAddRows(x, dim, rows, weight, n, y);
  }
  absl::Status RouteTopK(const float* logits, int64_t rows, int64_t E, int64_t k, bool normalize,
                         int32_t* experts, float* weights) override {
    return cuda::RouteTopK(logits, rows, E, k, normalize, experts, weights);
  }
  absl::Status RouteGrouped(const float* logits, const float* bias, int64_t rows, int64_t E,
                            int64_t k, int64_t groups, int64_t topk_groups, bool normalize,
                            float scaling, int32_t* experts, float* weights) override {
    return cuda::RouteGrouped(logits, bias, rows, E, k, groups, topk_groups, normalize, scaling,
                              experts, weights);
  }
  bool per_slot_experts() const override { return true; }
  absl::Status ExpertMatVec(const ExpertTable& w, const int32_t* experts, int64_t slots,
                            const float* x, int64_t x_div, float* y) override {
    return cuda::ExpertMatVec(w, experts, slots, x, x_div, y);
  }
  absl::Status LoraAdd(const LoraTable& t, const int32_t* row_slot, int64_t rows, const float* x,
                       float* y, float* scratch) override {
    return cuda::LoraAdd(t, row_slot, rows, x, y, scratch);
  }
  absl::Status CombineSlots(const float* x, const float* weights, int64_t rows, int64_t k,
                            int64_t dim, float* y) override {
    return cuda::CombineSlots(x, weights, rows, k, dim, y);
  }
  absl::Status VocabSummaries(const float* logits, int64_t rows, int64_t ld, int64_t n,
                              int64_t vocab_begin, int64_t K, float* out) override {
    return cuda::VocabSummaries(*ctx_, logits, rows, ld, n, vocab_begin, K, out);
  }
  absl::Status SampleRows(const float* logits, int64_t rows, int64_t V, const SampleSpec* specs,
                          int64_t K, int32_t* ids, float* logprobs, int32_t* top_ids,
                          float* top_logprobs) override {
    return cuda::SampleRows(*ctx_, logits, rows, V, specs, K, ids, logprobs, top_ids, top_logprobs);
  }

 private:
  std::unique_ptr<Context> ctx_;
  std::deque<DeviceBuffer> kept_;  // uploaded weights and vectors
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> NewBackend(int device, KernelChoice kernels) {
  if (DeviceCount() <= device) {
    return absl::FailedPreconditionError(absl::StrCat("CUDA device ", device, " is not available (",
                                                      DeviceCount(), " GPU(s) visible)"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Context> ctx, Context::Create(device, kernels));
  return std::unique_ptr<Backend>(std::make_unique<CudaBackend>(std::move(ctx)));
}

}  // namespace shardserve::cuda
