#pragma once
// The CPU kernels of KernelLevel::kAvx512 (backend/cpu/cpu_features.h), compiled for AVX-512
// (F, BW, VL, DQ) in their own source and called only where the CPU has them. Each computes what
// its AVX2 counterpart in kernels.cc does, in wider registers.
#include <cstdint>

namespace shardserve::cpu {
struct KvRows;
}  // namespace shardserve::cpu

namespace shardserve::cpu::avx512 {

// Rows of the prefill micro-kernel's tile: a row's accumulator is one register of 16 tokens, so
// the tile has twice the AVX2 tile's rows (12 x 16 against 6 x 16).
inline constexpr int64_t kMr = 12;

// kernels.cc's MicroKernelAny for mr <= kMr rows against `panels` (1 or 2) panels of 16 tokens:
// y[i][j] (+)= sum over k < kc of a[i][k] * panel[k][j] for j < 16, a's rows at stride lda, panel
// 64-byte aligned ([kc][16]), y's rows at stride ldy; a second panel `next` floats after the
// first, its outputs 16 after the first's in each row of y (each weight loaded once for both).
// The same bits at either count of panels.
void MicroKernelAny(int64_t mr, int panels, int64_t kc, const float* a, int64_t lda,
                    const float* panel, int64_t next, float* y, int64_t ldy, bool accumulate);

// kernels.h's AttendGroup for head sizes 64 and 128 (hd), every KV dtype: each position's key
// and value rows converted once into 4 or 8 registers; the value pass keeps 4 (2) heads' outputs
// in registers over all positions. Each score and output is kernels.cc's AVX2 arithmetic in its
// order: the same bits.
void AttendGroup(const float* const* q, int64_t G, const KvRows& kv, const void* const* k_blocks,
                 const void* const* v_blocks, int64_t bs, int64_t hd, int64_t begin, int64_t len,
                 float scale, const float* sinks, float* scores, float* const* out);

// Rows of the quantized prefill tile (16 tokens' int16 pairs are one register: twice AVX2's 4).
inline constexpr int64_t kMrInt = 8;

// kernels.cc's MicroKernelIntAny for mr <= kMrInt rows of a quantized matrix, groups of g (16 or
// 32) values, with minimums (has_min) or without; the rows' int16 values, factors and minimums
// at stride `ld` values (ld / 16 factors, ld / 32 minimums), against `panels` (1 or 2) panels of
// 16 tokens: the second's values q_next after the first's, its scales d_next after the first's,
// its outputs 16 after the first's in each row of y. The integer sums are exact and the float
// steps those of the AVX2 tile, in its order: the same bits.
void MicroKernelIntAny(int64_t mr, int panels, int64_t kc, bool transposed, int g, bool has_min,
                       const int16_t* wq, const float* wf, const float* wm, int64_t ld,
                       const int16_t* xq, int64_t q_next, const float* xd, const float* xds,
                       int64_t d_next, float* y, int64_t ldy, bool accumulate);

// MicroKernelIntAny with AVX512-VNNI's vpdpwssd (kernels_avx512vnni.cc): bit for bit the same.
// MicroKernelIntAny takes it where the CPU has VNNI (cpu_features.h's UsesVnni), unless
// UseVnni(false) (tests and benchmarks compare the two).
void MicroKernelIntVnni(int64_t mr, int panels, int64_t kc, bool transposed, int g, bool has_min,
                        const int16_t* wq, const float* wf, const float* wm, int64_t ld,
                        const int16_t* xq, int64_t q_next, const float* xd, const float* xds,
                        int64_t d_next, float* y, int64_t ldy, bool accumulate);
// KernelLevel::kAvx512Int8's prefill tile (kernels_avx512vnni.cc; the level requires VNNI):
// MicroKernelIntAny's, but the rows' values signed bytes in quads (quant.h's UnpackBytes, with
// their groups' sums wsum, strided as the factors) against 16 tokens' quads of int8 activations
// offset by 128 ([kc / 4][16][4] bytes a panel), multiplied by vpdpbusd: exact integer sums,
// the float steps MicroKernelIntAny's.
void MicroKernelInt8(int64_t mr, int panels, int64_t kc, bool transposed, int g, bool has_min,
                     const int8_t* wq, const int32_t* wsum, const float* wf, const float* wm,
                     int64_t ld, const uint8_t* xq, int64_t q_next, const float* xd,
                     const float* xds, int64_t d_next, float* y, int64_t ldy, bool accumulate);

// kernels.cc's ExpandRows for one row of 16-bit floats: kc values of `row` (BF16 when `bf16`,
// else F16) as F32 into out (64-byte aligned).
void ExpandHalves(const uint16_t* row, bool bf16, int64_t kc, float* out);

// KernelLevel::kAvx512Bf16 (kernels_avx512bf16.cc, built for AVX512-BF16 as well): BF16 weights
// against activations rounded to BF16 (nearest even; subnormals flushed, as the instructions
// do), multiplied in pairs by vdpbf16ps (32 products an instruction, F32 sums). Not the AVX2
// arithmetic: each activation is off by at most 2^-8 of itself.

// K floats of x rounded to BF16 into out, zeros after them up to kp (a multiple of 16).
void RoundToBf16(const float* x, int64_t K, int64_t kp, uint16_t* out);

// Decode: rows [n0, n1) of the BF16 w (`rows` at stride `row_stride` values, K values each)
// against M tokens of BF16 activations (xb, row stride ldx >= K rounded up to 32, zero past K),
// y[t * ldy + n]; tokens in groups of 3, each token's sums the same whatever its group.
void GemvBf16(const uint16_t* rows, int64_t row_stride, int64_t K, int64_t n0, int64_t n1,
              const uint16_t* xb, int64_t ldx, int64_t M, float* y, int64_t ldy);

// DType::kBF16X (kernels.h), decode and prefill alike: groups [g0, g1) of 16 rows of the
// rows x K matrix w (K even) against M tokens of BF16 activations (xb, row stride ldx >= K), into
// y[t * ldy + n]. A group's pair p (16 rows, a row a lane) times a token's pair p broadcast, by
// vdpbf16ps, the pairs in order into one F32 sum an output: the same bits for any M, any split
// of the groups and any tile.
void MatMulBf16Pairs(const uint16_t* w, int64_t rows, int64_t K, int64_t g0, int64_t g1,
                     const uint16_t* xb, int64_t ldx, int64_t M, float* y, int64_t ldy);

// Prefill tile of mr <= kMr BF16 rows against 16 tokens: y[i][j] (+)= sum over the kp pairs of
// row i's pair p (a + i * lda values, 2p and 2p + 1) times token j's (panel[p][j][0..1]).
void MicroKernelBf16Any(int64_t mr, int64_t kp, const uint16_t* a, int64_t lda,
                        const uint16_t* panel, float* y, int64_t ldy, bool accumulate);

// MicroKernelBf16Any for any number of rows (the GEMM's block): where UsesAmx, each 16 rows' first
// kp / 16 * 16 pairs in AMX tiles (MicroKernelBf16Amx), the rest in MicroKernelBf16Any's. The
// same products of BF16 pairs, summed in F32 in another order: within kAvx512Bf16's bound.
void GemmBlockBf16(int64_t rows, int64_t kp, const uint16_t* a, int64_t lda, const uint16_t* panel,
                   float* y, int64_t ldy, bool accumulate);

// AMX (kernels_amx.cc, built for AMX-TILE, AMX-BF16 and AMX-INT8): `tiles` (1 to 3) x 16 rows
// against the panel's 16 tokens, kp pairs (a multiple of 16), each 16 rows one tile of F32 sums,
// TDPBF16PS adding 16 pairs of the rows (a tile) times the panel's 16 pairs (a tile) a step.
// Configures the calling thread's tiles where it last ran another configuration (the int8 tile's).
void MicroKernelBf16Amx(int tiles, int64_t kp, const uint16_t* a, int64_t lda,
                        const uint16_t* panel, float* y, int64_t ldy, bool accumulate);
// The quantized types' prefill tile in AMX (kernels_amx.cc, where UsesAmxInt8): for 16 rows (of
// which the first mr are stored; the rest are read from wq, wf and wm and their results dropped)
// and one panel of 16 tokens, the rows' values as signed bytes in order (UnpackBytes' in_order),
// each group's int32 sums by AMX's byte dot products (16 x 16 x G products an instruction), then
// the float steps of the AVX-512 tiles in their order: the same bits. The tokens' quads are
// xq's signed bytes (kAvx512Int8: the int8 activations, MicroKernelInt8's without its offset;
// TDPBSSD), or, where xlo is given (the int16 levels), the int16 activations' high bytes (signed)
// in xq and their low bytes (unsigned, TDPBSUD) in xlo: MicroKernelIntAny's int16 sums, exactly.
// Configures the calling thread's tiles where it last ran another configuration.
void MicroKernelIntAmx(int64_t mr, int64_t kc, int g, bool has_min, const int8_t* wq,
                       const float* wf, const float* wm, int64_t ld, const int8_t* xq,
                       const uint8_t* xlo, const float* xd, const float* xds, float* y, int64_t ldy,
                       bool accumulate);
// Whether GemmBlockBf16 uses AMX: where the CPU has AMX-BF16 and Linux grants the process the
// tiles' state (arch_prctl ARCH_REQ_XCOMP_PERM, asked once), unless UseAmx(false) (tests and
// benchmarks compare the two). UsesAmxInt8: whether the quantized types' prefill (at every
// AVX-512 level) uses MicroKernelIntAmx: likewise, where the CPU has AMX-INT8.
bool UsesAmx();
bool UsesAmxInt8();
void UseAmx(bool on);  // on: where the CPU and the kernel allow it (both kinds of tiles)

}  // namespace shardserve::cpu::avx512
