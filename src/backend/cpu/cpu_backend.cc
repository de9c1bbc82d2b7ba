#include "backend/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <new>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/quant.h"
#include "common/huge_pages.h"
#include "common/status.h"
#include "common/thread_pool.h"

namespace shardserve::cpu {
namespace {

class HostBuffer : public Buffer {
 public:
  ~HostBuffer() override { Free(); }
  absl::Status Reserve(size_t bytes) override {
    if (bytes <= size_) return absl::OkStatus();
    const size_t grown = std::max(bytes, 2 * size_);
    Free();
    data_ = ::operator new[](grown, std::align_val_t(64), std::nothrow);
    if (data_ == nullptr) {
      size_ = 0;
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", grown, " bytes of host memory"));
    }
    size_ = grown;
    return absl::OkStatus();
  }
  void* data() const override { return data_; }
  size_t size() const override { return size_; }

 private:
  void Free() {
    if (data_ != nullptr) ::operator delete[](data_, std::align_val_t(64));
    data_ = nullptr;
  }
  void* data_ = nullptr;
  size_t size_ = 0;
};

// Per layer, K then V: [blocks][kv_heads][block_size][head_dim] values of format.dtype each.
struct HostKv : KvStorage {
  std::unique_ptr<uint8_t[]> data;
  int64_t blocks = 0, kv_heads = 0, block_size = 0, head_dim = 0;
  uint8_t* Slab(int64_t layer, int kv, int64_t block, int64_t kv_head) const {
    return data.get() + (((layer * 2 + kv) * blocks + block) * kv_heads + kv_head) * block_size *
                            head_dim * DTypeSize(format.dtype);
  }
  void* block_data(int64_t layer, int kv, int64_t block) const override {
    return Slab(layer, kv, block, 0);
  }
  size_t block_bytes() const override {
    return static_cast<size_t>(kv_heads * block_size * head_dim) * DTypeSize(format.dtype);
  }
  bool on_host() const override { return true; }
};

// A latent cache (Backend::AllocLatentKv): per layer [blocks][block_size][dim] values.
struct HostLatentKv : KvStorage {
  std::unique_ptr<uint8_t[]> data;
  int64_t blocks = 0, block_size = 0, latent_dim = 0, rope_dim = 0;
  int64_t dim() const { return latent_dim + rope_dim; }
  uint8_t* Block(int64_t layer, int64_t block) const {
    return data.get() + (layer * blocks + block) * block_size * dim() * DTypeSize(format.dtype);
  }
  void* block_data(int64_t layer, int kv, int64_t block) const override {
    return kv == 0 ? Block(layer, block) : nullptr;
  }
  size_t block_bytes() const override {
    return static_cast<size_t>(block_size * dim()) * DTypeSize(format.dtype);
  }
  bool on_host() const override { return true; }
};

// `values` values of format.dtype, uninitialized on purpose: pages commit on first write.
absl::StatusOr<std::unique_ptr<uint8_t[]>> AllocKvBytes(const KvFormat& format, size_t values,
                                                        const char* what) {
  RETURN_IF_ERROR(CheckKvFormat(format));
  const size_t bytes = std::max<size_t>(values * DTypeSize(format.dtype), 1);
  std::unique_ptr<uint8_t[]> data(new (std::nothrow) uint8_t[bytes]);
  if (data == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", what, " of ", bytes,
                                                     " bytes (", DTypeName(format.dtype), ")"));
  }
  return data;
}

absl::Status HalfOrFloat(const WeightMatrix& w, const char* op) {
  if (w.dtype == DType::kF32 || w.dtype == DType::kF16 || w.dtype == DType::kBF16 ||
      w.dtype == DType::kBF16X) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(op, " takes F32, F16 or BF16 weights, not ", DTypeName(w.dtype)));
}

class CpuBackend : public Backend {
 public:
  explicit CpuBackend(int threads) : pool_(threads) {}
  bool copies_weights() const override { return true; }
  bool host_memory() const override { return true; }

  std::unique_ptr<Buffer> NewBuffer() override { return std::make_unique<HostBuffer>(); }
  // Weights are copied into the backend's own (anonymous) memory, in huge pages where Linux
  // grants them (common/huge_pages.h), Q4_K, Q4_1 and Q6_K into the
  // layouts of the CPU's decode kernels (Q4_KX, Q4_1X, Q6_KX), BF16 at kAvx512Bf16 as BF16X
  // (KeptLayout), the others as they are: read from
  // the model file's shared mapping, the decode was slower (TinyLlama BF16 at one thread 70-75 %
  // of the read bandwidth against 78-84 % from a copy, alternating runs).
  absl::StatusOr<WeightMatrix> Upload(const WeightMatrix& host) override {
    if (IsStorageOnly(host.dtype)) {  // the model expands them at load (model/fp8.h, mxfp4.h)
      return absl::UnimplementedError(
          absl::StrCat(DTypeName(host.dtype), " weights reach no kernel of this backend"));
    }
    const DType kept = KeptLayout(host.dtype, host.cols);
    const size_t row = DTypeBytes(kept, host.cols);
    HugePagesArray copy = AllocateHugePages(host.rows * row);
    if (copy == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot allocate ", host.rows * row, " bytes for a ", DTypeName(host.dtype), " matrix"));
    }
    if (kept == DType::kBF16X) {
      RepackBf16Pairs(host, reinterpret_cast<uint16_t*>(copy.get()));
    } else {
      for (int64_t r = 0; r < host.rows; ++r) {
        RepackRow(kept, RowPtr(host, r), host.cols, copy.get() + r * row);
      }
    }
    copies_.push_back(std::move(copy));
    return WeightMatrix{kept, copies_.back().get(), host.rows, host.cols, host.cols};
  }
  absl::StatusOr<const float*> Upload(const std::vector<float>& host) override {
    if (host.empty()) return nullptr;
    vectors_.push_back(host);
    return vectors_.back().data();
  }
  absl::Status CopyFromHost(void* dst, const void* host, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, host, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* host, const void* src, size_t bytes) override {
    return CopyFromHost(host, src, bytes);
  }
  absl::Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                      size_t height) override {
    for (size_t r = 0; r < height; ++r) {
      std::memcpy(static_cast<uint8_t*>(dst) + r * dst_pitch,
                  static_cast<const uint8_t*>(src) + r * src_pitch, width);
    }
    return absl::OkStatus();
  }
  absl::Status Zero(void* p, size_t bytes) override {
    if (bytes > 0) std::memset(p, 0, bytes);
    return absl::OkStatus();
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }

  absl::StatusOr<std::unique_ptr<KvStorage>> AllocKv(int64_t layers, int64_t blocks,
                                                     int64_t kv_heads, int64_t block_size,
                                                     int64_t head_dim,
                                                     const KvFormat& format) override {
    auto kv = std::make_unique<HostKv>();
    kv->owner = this;
    kv->format = format;
    ASSIGN_OR_RETURN(kv->data, AllocKvBytes(format,
                                            static_cast<size_t>(layers * 2 * blocks * kv_heads *
                                                                block_size * head_dim),
                                            "a KV cache"));
    kv->blocks = blocks;
    kv->kv_heads = kv_heads;
    kv->block_size = block_size;
    kv->head_dim = head_dim;
    return kv;
  }

  absl::Status Embed(const WeightMatrix& table, const int32_t* ids, int64_t n, int64_t vocab_begin,
                     int64_t vocab_end, float* out) override {
    const int64_t H = table.cols;
    std::fill_n(out, n * H, 0.0f);
    for (int64_t r = 0; r < n; ++r) {
      if (ids[r] < vocab_begin || ids[r] >= vocab_end) continue;
      if (table.dtype == DType::kBF16X) {
        Bf16PairsRow(table, ids[r] - vocab_begin, out + r * H);
        continue;
      }
      const uint8_t* src = static_cast<const uint8_t*>(table.data) +
                           DTypeBytes(table.dtype, (ids[r] - vocab_begin) * table.row_stride);
      ToFloat(table.dtype, src, H, out + r * H);
    }
    return absl::OkStatus();
  }
  absl::Status RmsNorm(const float* x, int64_t M, int64_t dim, const float* w, float eps,
                       float* out) override {
    cpu::RmsNorm(x, M, dim, w, eps, out);
    return absl::OkStatus();
  }
  absl::Status Gemm(const WeightMatrix& w, const float* x, int64_t M, float* y) override {
    MatMul(w, x, M, w.cols, y, w.rows, pool_);
    return absl::OkStatus();
  }
  absl::Status GemmGroupSameCols(const WeightMatrix* const* ws, float* const* ys, size_t n,
                                 const float* x, int64_t M) override {
    std::vector<MatMulTarget> targets(n);
    for (size_t i = 0; i < n; ++i) targets[i] = {ws[i], ys[i], ws[i]->rows};
    if (n > 0) MatMulGroup(targets.data(), n, x, M, ws[0]->cols, pool_);
    return absl::OkStatus();
  }
  absl::Status AddBias(float* x, int64_t rows, int64_t cols, const float* bias) override {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) x[r * cols + c] += bias[c];
    }
    return absl::OkStatus();
  }
  absl::Status Add(float* x, const float* y, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) x[i] += y[i];
    return absl::OkStatus();
  }
  absl::Status SiluMul(float* a, const float* b, int64_t n) override {
    cpu::SiluMul(a, b, n, pool_);
    return absl::OkStatus();
  }
  absl::Status SwiGluClamped(float* a, const float* b, int64_t n, float alpha,
                             float limit) override {
    for (int64_t i = 0; i < n; ++i) {
      const float g = std::min(a[i], limit), u = std::clamp(b[i], -limit, limit);
      a[i] = (u + 1.0f) * (g / (1.0f + std::exp(-alpha * g)));
    }
    return absl::OkStatus();
  }
  absl::Status Rope(float* x, int64_t rows, int64_t heads, int64_t head_dim,
                    const int32_t* positions, const float* inv_freq) override {
    const int64_t half = head_dim / 2;
    for (int64_t r = 0; r < rows; ++r) {
      float* row = x + r * heads * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float angle = static_cast<float>(positions[r]) * inv_freq[i];
        const float c = static_cast<float>(std::cos(static_cast<double>(angle)));
        const float s = static_cast<float>(std::sin(static_cast<double>(angle)));
        for (int64_t h = 0; h < heads; ++h) {
          float* v = row + h * head_dim;
          const float a = v[i], b = v[i + half];
          v[i] = a * c - b * s;
          v[i + half] = b * c + a * s;
        }
      }
    }
    return absl::OkStatus();
  }
  absl::Status WriteKv(const KvStorage& storage, int64_t layer, const float* k, const float* v,
                       int64_t rows, const int32_t* positions, const int32_t* blocks,
                       const int32_t* block_offset) override {
    const HostKv& kv = static_cast<const HostKv&>(storage);
    const int64_t hd = kv.head_dim, bs = kv.block_size, kvd = kv.kv_heads * hd;
    const DType t = kv.format.dtype;
    const size_t at = static_cast<size_t>(hd) * DTypeSize(t);  // a slot's bytes
    const float ks = kv.format.KScale(layer), vs = kv.format.VScale(layer);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t block = blocks[block_offset[r] + positions[r] / bs], slot = positions[r] % bs;
      for (int64_t kh = 0; kh < kv.kv_heads; ++kh) {
        FloatToKv(t, k + r * kvd + kh * hd, hd, ks, kv.Slab(layer, 0, block, kh) + slot * at);
        FloatToKv(t, v + r * kvd + kh * hd, hd, vs, kv.Slab(layer, 1, block, kh) + slot * at);
      }
    }
    return absl::OkStatus();
  }
  absl::Status Attention(const KvStorage& storage, int64_t layer, const float* q, int64_t rows,
                         int64_t heads, int64_t head0, int64_t group_heads, int64_t kv_head0,
                         const int32_t* positions, const int32_t* blocks,
                         const int32_t* block_offset, int64_t max_len, float scale,
                         const AttentionExtras& extras, float* out) override {
    (void)max_len;
    if (rows == 0 || heads == 0) return absl::OkStatus();
    const HostKv& kv = static_cast<const HostKv&>(storage);
    const int64_t hd = kv.head_dim, bs = kv.block_size, qd = heads * hd;
    const KvRows rows_of{kv.format.dtype, kv.format.KScale(layer), kv.format.VScale(layer)};
    // Items: (row, local KV head, part of its query heads). A KV head's rows are read and
    // converted once for the heads of a part; the heads split into parts only as far as the
    // threads need items (a decode batch of one: TinyLlama's 4 KV heads on 2 threads take their
    // 8 heads each whole).
    const int64_t kvh = kv.kv_heads;
    std::vector<std::pair<int64_t, int64_t>> heads_of(kvh, {0, 0});  // each KV head's
    int64_t widest = 1;
    for (int64_t kh = 0; kh < kvh; ++kh) {
      heads_of[kh].first = std::clamp<int64_t>((kh + kv_head0) * group_heads - head0, 0, heads);
      heads_of[kh].second =
          std::clamp<int64_t>((kh + kv_head0 + 1) * group_heads - head0, 0, heads);
      widest = std::max(widest, heads_of[kh].second - heads_of[kh].first);
    }
    const int64_t want = (pool_.num_threads() + rows * kvh - 1) / (rows * kvh);
    const int64_t parts = std::clamp<int64_t>(want, 1, widest);
    const int64_t per = (widest + parts - 1) / parts;
    pool_.ParallelFor(rows * kvh * parts, 1, [&](int, int64_t begin, int64_t end) {
      std::vector<float> scores;
      std::vector<const void*> k_blocks, v_blocks;
      std::vector<const float*> qs;
      std::vector<float*> outs;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t r = item / (kvh * parts), kh = item / parts % kvh, part = item % parts;
        const int64_t h0 = heads_of[kh].first + part * per;
        const int64_t h1 = std::min(heads_of[kh].second, h0 + per);
        if (h0 >= h1) continue;
        const int64_t G = h1 - h0;
        const int64_t len = positions[r] + 1;  // causal: attend to positions [0, pos]
        const int64_t nblocks = (len + bs - 1) / bs;
        k_blocks.resize(nblocks);
        v_blocks.resize(nblocks);
        for (int64_t b = 0; b < nblocks; ++b) {
          k_blocks[b] = kv.Slab(layer, 0, blocks[block_offset[r] + b], kh);
          v_blocks[b] = kv.Slab(layer, 1, blocks[block_offset[r] + b], kh);
        }
        scores.resize(G * len);
        qs.resize(G);
        outs.resize(G);
        for (int64_t g = 0; g < G; ++g) {
          qs[g] = q + r * qd + (h0 + g) * hd;
          outs[g] = out + r * qd + (h0 + g) * hd;
        }
        const int64_t first = extras.window > 0 ? std::max<int64_t>(0, len - extras.window) : 0;
        AttendGroup(qs.data(), G, rows_of, k_blocks.data(), v_blocks.data(), bs, hd, first, len,
                    scale, extras.sinks != nullptr ? extras.sinks + h0 : nullptr, scores.data(),
                    outs.data());
      }
    });
    return absl::OkStatus();
  }
  absl::Status HeadGemm(const WeightMatrix& w, int64_t heads, const float* x, int64_t ldx,
                        int64_t x_head, int64_t rows, float* y, int64_t ldy,
                        int64_t y_head) override {
    RETURN_IF_ERROR(HalfOrFloat(w, "HeadGemm"));
    const int64_t N = w.rows / heads;
    std::vector<float> groups_y;
    for (int64_t h = 0; h < heads; ++h) {
      if (w.dtype != DType::kBF16X || N % 16 == 0) {
        const WeightMatrix wh{w.dtype, RowPtr(w, h * N), N, w.cols, w.row_stride};
        MatMul(wh, x + h * x_head, rows, ldx, y + h * y_head, ldy, pool_);
        continue;
      }
      // BF16X's groups of 16 rows hold parts of two heads: the groups holding head h's rows
      // [r0, r0 + N) are multiplied and the head's rows kept.
      const int64_t r0 = h * N, first = r0 / 16 * 16;
      const int64_t last = std::min(w.rows, (r0 + N + 15) / 16 * 16), n = last - first;
      const WeightMatrix groups{w.dtype, RowPtr(w, first), n, w.cols, w.row_stride};
      groups_y.resize(rows * n);
      MatMul(groups, x + h * x_head, rows, ldx, groups_y.data(), n, pool_);
      for (int64_t r = 0; r < rows; ++r) {
        std::copy_n(&groups_y[r * n + r0 - first], N, y + r * ldy + h * y_head);
      }
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<KvStorage>> AllocLatentKv(int64_t layers, int64_t blocks,
                                                           int64_t block_size, int64_t latent_dim,
                                                           int64_t rope_dim,
                                                           const KvFormat& format) override {
    auto kv = std::make_unique<HostLatentKv>();
    kv->owner = this;
    kv->format = format;
    ASSIGN_OR_RETURN(kv->data, AllocKvBytes(format,
                                            static_cast<size_t>(layers * blocks * block_size *
                                                                (latent_dim + rope_dim)),
                                            "a latent KV cache"));
    kv->blocks = blocks;
    kv->block_size = block_size;
    kv->latent_dim = latent_dim;
    kv->rope_dim = rope_dim;
    return kv;
  }
  absl::Status WriteLatentKv(const KvStorage& storage, int64_t layer, const float* latent,
                             const float* rope, int64_t rows, const int32_t* positions,
                             const int32_t* blocks, const int32_t* block_offset) override {
    const HostLatentKv& kv = static_cast<const HostLatentKv&>(storage);
    const int64_t bs = kv.block_size, L = kv.latent_dim, R = kv.rope_dim;
    const DType t = kv.format.dtype;
    const float scale = kv.format.KScale(layer);
    for (int64_t r = 0; r < rows; ++r) {
      uint8_t* at = kv.Block(layer, blocks[block_offset[r] + positions[r] / bs]) +
                    (positions[r] % bs) * kv.dim() * DTypeSize(t);
      FloatToKv(t, latent + r * L, L, scale, at);
      FloatToKv(t, rope + r * R, R, scale, at + L * DTypeSize(t));
    }
    return absl::OkStatus();
  }
  absl::Status LatentAttention(const KvStorage& storage, int64_t layer, const float* q_latent,
                               const float* q_rope, int64_t rows, int64_t heads,
                               const int32_t* positions, const int32_t* blocks,
                               const int32_t* block_offset, int64_t max_len, float scale,
                               float* out) override {
    (void)max_len;
    const HostLatentKv& kv = static_cast<const HostLatentKv&>(storage);
    const int64_t bs = kv.block_size, L = kv.latent_dim, R = kv.rope_dim, D = kv.dim();
    const KvRows rows_of{kv.format.dtype, kv.format.KScale(layer), kv.format.KScale(layer)};
    pool_.ParallelFor(rows * heads, 1, [&](int, int64_t begin, int64_t end) {
      std::vector<float> q(D), scores;
      std::vector<const void*> cache_blocks;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t r = item / heads;
        std::copy_n(q_latent + item * L, L, q.data());  // item = r * heads + head
        std::copy_n(q_rope + item * R, R, q.data() + L);
        const int64_t len = positions[r] + 1;
        cache_blocks.resize((len + bs - 1) / bs);
        for (size_t b = 0; b < cache_blocks.size(); ++b) {
          cache_blocks[b] = kv.Block(layer, blocks[block_offset[r] + b]);
        }
        scores.resize(len);
        AttendShared(q.data(), rows_of, cache_blocks.data(), bs, D, L, len, scale, scores.data(),
                     out + item * L);
      }
    });
    return absl::OkStatus();
  }
  absl::Status GatherRows(const float* x, int64_t dim, const int32_t* rows, int64_t n,
                          float* out) override {
    for (int64_t i = 0; i < n; ++i) std::copy_n(x + rows[i] * dim, dim, out + i * dim);
    return absl::OkStatus();
  }
  absl::Status ScaleAddRows(const float* x, int64_t dim, const int32_t* rows, const float* weight,
                            int64_t n, float* y) override {
    for (int64_t i = 0; i < n; ++i) Axpy(weight[i], x + i * dim, y + rows[i] * dim, dim);
    return absl::OkStatus();
  }

  // Rows grouped by adapter (Punica's segments), so that each adapter's factors are read once a
  // step however many of its rows there are; two passes over the pool: every (adapter, j < rank)
  // pair's row of A against that adapter's rows (u = scale * A x), then every block of output
  // columns of each adapter's rows, y += sum_j u[j] * bt[j] (contiguous rows of B transposed),
  // so that a decode batch of a few rows still spreads over every thread.
  absl::Status LoraAdd(const LoraTable& t, const int32_t* row_slot, int64_t rows, const float* x,
                       float* y, float* scratch) override {
    std::vector<std::vector<int64_t>> by_slot(t.slots);
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t s = row_slot[r];
      if (s >= 0 && s < t.slots && t.rank[s] > 0) by_slot[s].push_back(r);
    }
    std::vector<std::pair<int32_t, int32_t>> pairs;  // (slot, j)
    for (int32_t s = 0; s < t.slots; ++s) {
      if (by_slot[s].empty()) continue;
      for (int32_t j = 0; j < t.rank[s]; ++j) pairs.emplace_back(s, j);
    }
    if (pairs.empty()) return absl::OkStatus();
    const int64_t R = t.max_rank;
    pool_.ParallelFor(static_cast<int64_t>(pairs.size()), 1, [&](int, int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const auto [s, j] = pairs[i];
        const float* a = t.a[s] + j * t.in;
        for (int64_t r : by_slot[s]) scratch[r * R + j] = t.scale[s] * Dot(a, x + r * t.in, t.in);
      }
    });
    constexpr int64_t kColumns = 256;
    pool_.ParallelFor((t.out + kColumns - 1) / kColumns, 1, [&](int, int64_t begin, int64_t end) {
      const int64_t n0 = begin * kColumns, n = std::min(end * kColumns, t.out) - n0;
      for (int32_t s = 0; s < t.slots; ++s) {
        for (int64_t r : by_slot[s]) {
          for (int64_t j = 0; j < t.rank[s]; ++j) {
            Axpy(scratch[r * R + j], t.bt[s] + j * t.out + n0, y + r * t.out + n0, n);
          }
        }
      }
    });
    return absl::OkStatus();
  }

  absl::Status RouteTopK(const float* logits, int64_t rows, int64_t E, int64_t k, bool normalize,
                         int32_t* experts, float* weights) override {
    std::vector<int32_t> order(E);
    for (int64_t r = 0; r < rows; ++r) {
      const float* logit = logits + r * E;
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
        return logit[a] > logit[b] || (logit[a] == logit[b] && a < b);
      });
      const float mx = logit[order[0]];
      float sum = 0;
      for (int64_t j = 0; j < (normalize ? k : E); ++j) sum += std::exp(logit[order[j]] - mx);
      for (int64_t j = 0; j < k; ++j) {
        experts[r * k + j] = order[j];
        weights[r * k + j] = std::exp(logit[order[j]] - mx) / sum;
      }
    }
    return absl::OkStatus();
  }
  absl::Status RouteGrouped(const float* logits, const float* bias, int64_t rows, int64_t E,
                            int64_t k, int64_t groups, int64_t topk_groups, bool normalize,
                            float scaling, int32_t* experts, float* weights) override {
    for (int64_t r = 0; r < rows; ++r) {
      RouteGroupedRow(logits + r * E, bias, E, k, groups, topk_groups, normalize, scaling,
                      experts + r * k, weights + r * k);
    }
    return absl::OkStatus();
  }
  // Grouped GEMMs read each chosen expert once; one product per slot gains nothing on the host.
  bool per_slot_experts() const override { return false; }
  absl::Status ExpertMatVec(const ExpertTable& w, const int32_t* experts, int64_t slots,
                            const float* x, int64_t x_div, float* y) override {
    for (int64_t s = 0; s < slots; ++s) {
      const int64_t e = experts[s] - w.expert_begin;
      if (e < 0 || e >= w.count) {
        std::fill_n(y + s * w.rows, w.rows, 0.0f);
        continue;
      }
      const WeightMatrix m{w.dtype, w.data[e], w.rows, w.cols, w.cols};
      MatMul(m, x + (s / x_div) * w.cols, 1, w.cols, y + s * w.rows, w.rows, pool_);
    }
    return absl::OkStatus();
  }
  absl::Status CombineSlots(const float* x, const float* weights, int64_t rows, int64_t k,
                            int64_t dim, float* y) override {
    std::fill_n(y, rows * dim, 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < k; ++j)
        Axpy(weights[r * k + j], x + (r * k + j) * dim, y + r * dim, dim);
    }
    return absl::OkStatus();
  }

  absl::Status VocabSummaries(const float* logits, int64_t rows, int64_t ld, int64_t n,
                              int64_t vocab_begin, int64_t K, float* out) override {
    for (int64_t r = 0; r < rows; ++r) {
      VocabSummary(logits + r * ld, n, vocab_begin, K, out + r * (2 + 2 * K));
    }
    return absl::OkStatus();
  }
  absl::Status SampleRows(const float* logits, int64_t rows, int64_t V, const SampleSpec* specs,
                          int64_t K, int32_t* ids, float* logprobs, int32_t* top_ids,
                          float* top_logprobs) override {
    for (int64_t r = 0; r < rows; ++r) {
      SampleRow(logits + r * V, V, specs[r], K, ids + r, logprobs + r, top_ids + r * K,
                top_logprobs + r * K);
    }
    return absl::OkStatus();
  }

 private:
  ThreadPool pool_;
  std::vector<std::vector<float>> vectors_;  // Upload()ed vectors: their data never moves
  std::vector<HugePagesArray> copies_;       // Upload()ed matrices, in the kept layouts
};

}  // namespace

std::unique_ptr<Backend> NewBackend(int threads) { return std::make_unique<CpuBackend>(threads); }

}  // namespace shardserve::cpu
