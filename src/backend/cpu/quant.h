#pragma once
// Block-quantized weights on the CPU, and what the kernels share (internal to backend/cpu;
// kernels.h is the interface).
#include <cstdint>
#include <type_traits>
#include <vector>

#include "backend/backend.h"
#include "common/thread_pool.h"

namespace shardserve::cpu {

// The first byte of row r of w (any dtype).
inline const uint8_t* RowPtr(const WeightMatrix& w, int64_t r) {
  return static_cast<const uint8_t*>(w.data) + DTypeBytes(w.dtype, r * w.row_stride);
}

// The first n values (a multiple of the block) of a quantized row as F32.
void Dequantize(DType dtype, const void* row, int64_t n, float* out);

// Up to this many tokens (decode batches) MatMul streams the weights once for all of them, each
// token's result independent of the batch (DecodeRows for quantized weights); beyond it the
// packed GEMM is faster (quantized weight rows unpacked to int16 by UnpackInts; to bytes by
// UnpackBytes at kAvx512Int8).
constexpr int64_t kDecodeMaxTokens = 12;

// Activations of M tokens quantized per block of 32 for the quantized kernels: int16
// values q (scale max|x| / 32767) or, in the int8 orders (kAvx512Int8's), int8 values q8
// (scale max|x| / 127); the block's scale d and d * (the sum of its values), for the minimum's
// term (quant.cc states the accuracy).
struct QuantizedActivations {
  std::vector<int16_t> q;  // [M][K]
  std::vector<int8_t> q8;  // [M][K], the int8 orders
  // [M][K / 16], the int8 sub-transposed order: in each 128 values, lane L (0-7) the sum of
  // 16-value sub-block SubOfLane(L)'s q8 (Q6_KX's values are q - 32: the 32's term)
  std::vector<int32_t> sum16;
  std::vector<float> d;   // [M][K / 32]
  std::vector<float> ds;  // [M][K / 32]
};

// The orders in which the decode kernels read the activations: in order; interleaved (each
// block's values 0-7 with 16-23, 8-15 with 24-31); transposed (Q4_KX: in each 256 values, the
// 8 blocks' quads side by side: value 4u + e of block k at 32u + 4k + e, RepackQ4K's nibbles;
// Q4_1X's last K % 256 values in order); sub-transposed (Q6_KX, RepackQ6K's). Then the int8
// orders: in order; transposed (the same: each 4 bytes, which vpdpbusd sums, are one block's);
// sub-transposed (Q6_KX: in each 128 values, value
// V(r, e) = 8 (r / 2) + 2 (r % 2) + 4 (e / 2) + e % 2 of 16-value sub-block SubOfLane(L) at
// 32r + 4L + e, r < 4, e < 4: SixBitValues' bytes unpacked by 16 bits).
constexpr int kActivationOrders = 7;
constexpr int kInt8InOrder = 4, kInt8Transposed = 5, kInt8SubTransposed = 6;
// The order in which the decode kernels of a quantized dtype read the activations at the active
// kernel level (kAvx512Int8: an int8 order for the types DecodesOnInt8).
int ActivationOrder(DType dtype);
// The types whose decode multiplies int8 activations at KernelLevel::kAvx512Int8 (by vpdpbusd:
// their values fit a byte, unsigned but Q8_0's; Q6_KX's as q, its -32 a term of x's sums); the
// others' decode (Q5_K) keeps the int16 path there.
constexpr bool DecodesOnInt8(DType d) {
  return d == DType::kQ8_0 || d == DType::kQ4_0 || d == DType::kQ4_1 || d == DType::kQ4_KX ||
         d == DType::kQ4_1X || d == DType::kQ6_KX;
}
// M rows of K activations (row stride ldx; K a multiple of 32) quantized in one order.
void QuantizeActivations(const float* x, int64_t M, int64_t ldx, int64_t K, int order,
                         ThreadPool& pool, QuantizedActivations* a);
// The layout the CPU backend keeps a file's type in (Q4_K as Q4_KX, Q6_K as Q6_KX, Q4_1 as
// Q4_1X; the others as they are, but for BF16 at kAvx512Bf16: kernels.h's KeptLayout), and the
// file's type a kept layout was repacked from.
constexpr DType KeptType(DType file) {
#if SHARDSERVE_PORTABLE_KERNELS
  return file;  // the portable kernels read every type as the file has it
#else
  return file == DType::kQ4_K   ? DType::kQ4_KX
         : file == DType::kQ6_K ? DType::kQ6_KX
         : file == DType::kQ4_1 ? DType::kQ4_1X
                                : file;
#endif
}
constexpr DType FileType(DType kept) {
  return kept == DType::kQ4_KX   ? DType::kQ4_K
         : kept == DType::kQ6_KX ? DType::kQ6_K
         : kept == DType::kQ4_1X ? DType::kQ4_1
         : kept == DType::kBF16X ? DType::kBF16
                                 : kept;
}
// Whether a block type's kernels multiply integers (GGUF's types: their values unpack to int16
// with factors); FP8 (kF8_128) takes the float kernels, its values expanded to F32.
constexpr bool UnpacksToInts(DType d) { return IsQuantized(d) && d != DType::kF8_128; }
// Whether a quantized type's weights have a minimum term (factor * q + min).
constexpr bool HasMin(DType d) {
  return FileType(d) != DType::kQ8_0 && FileType(d) != DType::kQ6_K;
}
// Prefill of the quantized types (M > kDecodeMaxTokens) multiplies integers as decode does: the
// activations quantized in order (QuantizeActivations, kActivationsInOrder) and the weights
// unpacked to int16 (UnpackInts), whose values share a factor in groups of IntGroup (Q6_K's
// 16-value sub-blocks; 32 for the others) and a minimum in blocks of 32; at kAvx512Int8 the
// activations in kInt8InOrder and the weights as bytes (UnpackBytes).
constexpr int kActivationsInOrder = 0;
constexpr int64_t IntGroup(DType d) { return FileType(d) == DType::kQ6_K ? 16 : 32; }
// The first n values (a multiple of the block) of a quantized row as int16 q, with
// factor[i / IntGroup] and (HasMin) min[i / 32]: value i is factor * q[at i] + min. In order,
// but for each 256 values of Q4_KX and each group of 8 blocks of Q4_1X (UnpacksTransposed), whose
// bytes are widened where they lie: the pair of values 2p, 2p + 1 of block b at 16p + 2b.
void UnpackInts(DType dtype, const void* row, int64_t n, int16_t* q, float* factor, float* min);
// Whether UnpackInts leaves n values from a multiple of 256 (n <= 256) in the transposed order.
constexpr bool UnpacksTransposed(DType d, int64_t n) {
  return d == DType::kQ4_KX || (d == DType::kQ4_1X && n == 256);
}
// KernelLevel::kAvx512Int8's prefill (quant_vnni.cc; the level requires VNNI): UnpackInts'
// values as signed bytes (each type's fit one: Q8_0's -128 .. 127, the others' within -32 .. 63),
// 4 values of one group side by side, the tile's unit: in order, but for UnpacksTransposed's 256
// values, unless in_order (AMX's tile, whose rows are a group's values), values 4u .. 4u + 3 of
// block b at 32u + 4b; sum[i / IntGroup] the sum of group i's values (the vpdpbusd tile takes
// 128 times it away: its activations carry an offset of 128; none where sum is null, AMX's
// tile); factor and min as UnpackInts'.
void UnpackBytes(DType dtype, const void* row, int64_t n, bool in_order, int8_t* q, int32_t* sum,
                 float* factor, float* min);
// One row of `cols` values of FileType(kept) into the layout kept (RepackQ4K, RepackQ6K,
// RepackQ4_1; a copy for the types kept as they are).
void RepackRow(DType kept, const uint8_t* src, int64_t cols, uint8_t* dst);
// Q4_K rows as DType::kQ4_KX, the layout the CPU keeps them in (148 bytes a super-block, 4 more
// than Q4_K's): d and dmin; the 8 scales and 8 minimums a byte each (Q4_K packs them in 6 bits,
// whose unpacking cost the decode 13 % of its time in L2); then the 128 bytes of quants
// transposed so that byte 32c + 4k + e holds value 8c + e of block k in its low nibble and value
// 8c + 4 + e in its high one (e < 4). A chunk's low nibbles are 8 int32 lanes of one block's 4
// values each, its high ones the next 4: vpdpbusd multiplies them as they lie (the int8 decode
// and prefill, no shuffle); widened to int16, each block's products fill two int32 lanes, one
// horizontal add a super-block. The decode sums a super-block's products lane by lane, with no
// merging of blocks. (Until 2026-12-05 byte 16i + 2k + e held values 4i + e and 4i + 2 + e: one
// int32 lane per block for int16, but two unpacks per 32 bytes for int8.)
void RepackQ4K(const uint8_t* src, int64_t superblocks, uint8_t* dst);
// Q6_K rows as DType::kQ6_KX: the same bytes, but each half super-block's low 4 bits and top 2
// bits of its 128 values rearranged so that, unpacked to int16 in place (SixBitValues in
// quant.cc), the pair in each int32 lane belongs to one 16-value sub-block: the decode sums its
// products lane by lane instead of merging 16 vectors.
void RepackQ6K(const uint8_t* src, int64_t superblocks, uint8_t* dst);
// A Q4_1 row of `blocks` blocks as DType::kQ4_1X: each group of 8 blocks as their 8 F16 factors,
// their 8 minimums and their quants transposed as RepackQ4K's; the last blocks % 8 blocks as they
// were.
void RepackQ4_1(const uint8_t* src, int64_t blocks, uint8_t* dst);

// f(std::integral_constant<DType, D>()) for the GGUF block type or kept layout d (nothing for the
// others): one dispatch from a runtime dtype to the templates, for Dequantize, UnpackInts and
// DecodeRows (quant.cc, quant_portable.cc).
template <typename F>
void ForQuantized(DType d, F f) {
  switch (d) {
    case DType::kQ8_0:
      return f(std::integral_constant<DType, DType::kQ8_0>());
    case DType::kQ4_0:
      return f(std::integral_constant<DType, DType::kQ4_0>());
    case DType::kQ4_1:
      return f(std::integral_constant<DType, DType::kQ4_1>());
    case DType::kQ4_K:
      return f(std::integral_constant<DType, DType::kQ4_K>());
    case DType::kQ5_K:
      return f(std::integral_constant<DType, DType::kQ5_K>());
    case DType::kQ6_K:
      return f(std::integral_constant<DType, DType::kQ6_K>());
    case DType::kQ4_KX:
      return f(std::integral_constant<DType, DType::kQ4_KX>());
    case DType::kQ4_1X:
      return f(std::integral_constant<DType, DType::kQ4_1X>());
    case DType::kQ6_KX:
      return f(std::integral_constant<DType, DType::kQ6_KX>());
    default:
      return;
  }
}

// Decode: rows [n0, n1) of the quantized w against the M tokens of a (quantized in the order
// w.dtype reads), y[t * ldy + n]; integer dot products with each weight block unpacked once for
// up to 3 tokens.
void DecodeRows(const WeightMatrix& w, int64_t n0, int64_t n1, const QuantizedActivations& a,
                int64_t M, float* y, int64_t ldy);

}  // namespace shardserve::cpu
