#pragma once
// CPU reference kernels (AVX2 + FMA + F16C; cpu_features.h checks the CPU). Activations are F32;
// weights stay in their file dtype (F32, F16, BF16, or the quantized Q8_0, Q4_0, Q4_1, Q4_K,
// Q5_K, Q6_K) and are converted inside the kernels, accumulating in F32 (quantized decode
// batches: integer products with the activations rounded to int16 per block, quant.cc).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "common/thread_pool.h"

namespace shardserve::cpu {

// y[m][n] = sum_k w[n][k] * x[m][k] for m < M, n < w.rows. x has row stride ldx, y has ldy.
// Splits output rows across the pool. M <= 12 (decode batches) streams the weights once, blocks
// of rows staying in L2 for groups of 3 tokens, and each token's result is independent of the
// batch; larger M packs the tokens into F32 panels once, expands weight rows to F32 and runs a
// register-blocked GEMM micro-kernel that broadcasts the weights.
void MatMul(const WeightMatrix& w, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy,
            ThreadPool& pool);

// MatMul of several matrices with the same cols that read the same x (a layer's q, k and v
// projections; gate and up), each into its own y (row stride ldy), with results equal to
// MatMul's for each. Decode batches prepare x once per dtype and take one pass of the pool over
// all the matrices' rows, split by bytes: small matrices (k, v) do not pay for a pass of their own.
struct MatMulTarget {
  const WeightMatrix* w;
  float* y;
  int64_t ldy;
};
void MatMulGroup(const MatMulTarget* targets, size_t n, const float* x, int64_t M, int64_t ldx,
                 ThreadPool& pool);

// out[i] = float(w[i]) for i < n (a vector of any dtype, e.g. a norm weight or an embedding row;
// n a multiple of the block for quantized types).
void ToFloat(DType dtype, const void* data, int64_t n, float* out);

// The layout the backend keeps a matrix of the file's type `file` with `cols` columns in: BF16 of
// an even cols as DType::kBF16X, but where AMX multiplies BF16 (kAvx512Bf16 on a CPU with
// AMX-BF16); otherwise KeptType's (quant.h).
DType KeptLayout(DType file, int64_t cols);
// DType::kBF16X: the rows in groups of 16 (the last one ragged: rows % 16), each group's values as
// [cols / 2][the group's rows][2], the pair of values 2p, 2p + 1 of its rows side by side, so that
// the kernels multiply 16 rows' pairs (a row a lane) by a token's pair, and decode reads one
// stream for 16 rows. At kAvx512Bf16 (BF16 dot products) every output is summed pair by pair in
// one order for decode and prefill alike (bit for bit the same, whatever the batch); at the
// levels without them the decode sums in F32 in its own order (GemvPairs: a token's bits the same
// in any decode batch) and the prefill expands the pairs to F32 rows (the rows' results). A
// group starts where its first row would (RowPtr of a multiple of 16 rows). RepackBf16Pairs
// writes the BF16 host (row stride host.row_stride) into dst in that layout; UnpackBf16Pairs
// writes a kBF16X w back as rows (row stride w.cols); Bf16PairsRow writes row r of w as F32.
void RepackBf16Pairs(const WeightMatrix& host, uint16_t* dst);
void UnpackBf16Pairs(const WeightMatrix& w, uint16_t* dst);
void Bf16PairsRow(const WeightMatrix& w, int64_t r, float* out);

// RMSNorm of each of the M rows of x (dim elements, stride dim): out = x / rms(x) * weight.
void RmsNorm(const float* x, int64_t M, int64_t dim, const float* weight, float eps, float* out);

// a[i] = silu(a[i]) * b[i], split across the pool.
void SiluMul(float* a, const float* b, int64_t n, ThreadPool& pool);

float Dot(const float* a, const float* b, int64_t n);

// How attention reads a KV cache's rows (backend.h KvFormat): values of `dtype` (F32, F16, BF16,
// F8_E4M3), keys times k_scale and values times v_scale (a latent row: k_scale).
struct KvRows {
  DType dtype = DType::kF32;
  float k_scale = 1, v_scale = 1;
};
// n cached values of `dtype` at src as floats times `scale`; n floats x / scale into `dtype` at
// dst (BF16, F16 and E4M3 rounded to nearest even, E4M3 saturated to +-448).
void KvToFloat(DType dtype, const void* src, int64_t n, float scale, float* out);
void FloatToKv(DType dtype, const float* x, int64_t n, float scale, void* dst);

// Causal scaled-dot-product attention of G query heads (q[g]: hd floats each) that read one KV
// head, over positions [begin, len): the key of position p is at k_blocks[p / block_size] +
// (p % block_size) * hd values of kv.dtype, the value likewise in v_blocks; each row is read and
// converted once for the G heads (a GQA group). Writes softmax(q[g]·K^T · scale) · V to out[g],
// the softmax's denominator with e^sinks[g] too (sinks null: none); `scores` holds G * len floats.
void AttendGroup(const float* const* q, int64_t G, const KvRows& kv, const void* const* k_blocks,
                 const void* const* v_blocks, int64_t block_size, int64_t hd, int64_t begin,
                 int64_t len, float scale, const float* sinks, float* scores, float* const* out);
// Attention of one query (dim floats) over positions [0, len) whose keys and values share a row:
// position p's row of `dim` values is at blocks[p / block_size] + (p % block_size) * dim, its
// value the row's first value_dim values (multi-head latent attention). Writes value_dim floats.
void AttendShared(const float* q, const KvRows& kv, const void* const* blocks, int64_t block_size,
                  int64_t dim, int64_t value_dim, int64_t len, float scale, float* scores,
                  float* out);
// One row of Backend::RouteGrouped (DeepSeek-V3's routing).
void RouteGroupedRow(const float* logits, const float* bias, int64_t E, int64_t k, int64_t groups,
                     int64_t topk_groups, bool normalize, float scaling, int32_t* experts,
                     float* weights);
// y[i] += alpha * x[i]
void Axpy(float alpha, const float* x, float* y, int64_t n);

// Token choice on host logits, the definitions Backend::VocabSummaries and Backend::SampleRows
// (backend/backend.h) state and every backend matches: one row's summary (2 + 2K floats to out)
// of n logits starting at vocabulary id vocab_begin, and one row of V logits sampled with spec.
void VocabSummary(const float* row, int64_t n, int64_t vocab_begin, int64_t K, float* out);
void SampleRow(const float* logits, int64_t V, const SampleSpec& spec, int64_t K, int32_t* id,
               float* logprob, int32_t* top_ids, float* top_logprobs);
// The distribution SampleRow draws from at spec.temperature > 0 (softmax at the temperature over
// the top_k best, cut to the top_p nucleus): the kept ids, best first, their weights (not
// normalized) and the weights' sum. SampleRow's draw u takes the first id whose running sum of
// weights passes u * total.
struct Distribution {
  std::vector<int32_t> ids;
  std::vector<double> weights;
  double total = 0;
};
Distribution DistributionOf(const float* logits, int64_t V, const SampleSpec& spec);

}  // namespace shardserve::cpu
