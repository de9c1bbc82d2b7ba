#include "backend/cpu/kernels_avx512.h"

#include <immintrin.h>

#include <atomic>
#include <cstring>

#include "backend/cpu/cpu_features.h"
#include "backend/cpu/tile_avx512.h"
#include "backend/cpu/tile_int_avx512.h"

namespace shardserve::cpu::avx512 {
namespace {

std::atomic<int> g_vnni{-1};  // UsesVnni once known: 1 where the CPU has AVX512-VNNI

// The MR x 16 NP tile (MR <= 12) over NP panels of 16 tokens (1 or 2; the second `next` floats
// after the first, its outputs 16 after the first's): each row's weight broadcast into a register
// for every panel's FMA. Two panels make 24 FMAs for 14 loads, where one makes 12 for 13 and waits
// on the load ports. Each output sums the same products in the same order at either NP.
template <int MR, int NP>
void MicroKernel(int64_t kc, const float* a, int64_t lda, const float* panel, int64_t next,
                 float* y, int64_t ldy, bool accumulate) {
  static_assert(MR >= 1 && MR <= kMr && (NP == 1 || NP == 2));
  // A row's sums: lo the first panel's, hi the second's (NP == 2), both taken with the row's
  // broadcast (with every row's broadcast made first and kept live, GCC 12 spilled the sums).
  struct Sums {
    __m512 lo, hi;
  };
  Accumulators<MR, Sums> acc;
  acc.Rows([&](int i, Sums& c) {
    c.lo = accumulate ? _mm512_loadu_ps(y + i * ldy) : _mm512_setzero_ps();
    if constexpr (NP == 2)
      c.hi = accumulate ? _mm512_loadu_ps(y + i * ldy + 16) : _mm512_setzero_ps();
  });
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_load_ps(panel + k * 16);
    const __m512 b1 = NP == 2 ? _mm512_load_ps(panel + next + k * 16) : b0;
    acc.Rows([&](int i, Sums& c) {
      const __m512 w = _mm512_set1_ps(a[i * lda + k]);
      c.lo = _mm512_fmadd_ps(w, b0, c.lo);
      if constexpr (NP == 2) c.hi = _mm512_fmadd_ps(w, b1, c.hi);
    });
  }
  acc.Rows([&](int i, Sums& c) {
    _mm512_storeu_ps(y + i * ldy, c.lo);
    if constexpr (NP == 2) _mm512_storeu_ps(y + i * ldy + 16, c.hi);
  });
}

using TileFn = void (*)(int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t,
                        bool);
template <int NP>
constexpr TileFn kTiles[kMr] = {MicroKernel<1, NP>,  MicroKernel<2, NP>,  MicroKernel<3, NP>,
                                MicroKernel<4, NP>,  MicroKernel<5, NP>,  MicroKernel<6, NP>,
                                MicroKernel<7, NP>,  MicroKernel<8, NP>,  MicroKernel<9, NP>,
                                MicroKernel<10, NP>, MicroKernel<11, NP>, MicroKernel<12, NP>};

}  // namespace

bool UsesVnni() {
  int vnni = g_vnni.load(std::memory_order_relaxed);
  if (vnni < 0) {
    vnni = CpuFeatures::Detect().avx512_vnni ? 1 : 0;
    g_vnni.store(vnni, std::memory_order_relaxed);
  }
  return vnni == 1;
}

void UseVnni(bool on) {
  g_vnni.store(on && CpuFeatures::Detect().avx512_vnni ? 1 : 0, std::memory_order_relaxed);
}

void MicroKernelIntAny(int64_t mr, int panels, int64_t kc, bool transposed, int g, bool has_min,
                       const int16_t* wq, const float* wf, const float* wm, int64_t ld,
                       const int16_t* xq, int64_t q_next, const float* xd, const float* xds,
                       int64_t d_next, float* y, int64_t ldy, bool accumulate) {
  if (UsesVnni()) {
    return MicroKernelIntVnni(mr, panels, kc, transposed, g, has_min, wq, wf, wm, ld, xq, q_next,
                              xd, xds, d_next, y, ldy, accumulate);
  }
  IntTileAny<false>(mr, panels, kc, transposed, g, has_min, wq, wf, wm, ld, xq, q_next, xd, xds,
                    d_next, y, ldy, accumulate);
}

void ExpandHalves(const uint16_t* row, bool bf16, int64_t kc, float* out) {
  int64_t k = 0;
  for (; k + 16 <= kc; k += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
    _mm512_store_ps(out + k,
                    bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                         : _mm512_cvtph_ps(h));
  }
  for (; k < kc; ++k) {
    if (bf16) {
      const uint32_t bits = static_cast<uint32_t>(row[k]) << 16;
      std::memcpy(out + k, &bits, 4);
    } else {
      out[k] = _cvtsh_ss(row[k]);
    }
  }
}

void MicroKernelAny(int64_t mr, int panels, int64_t kc, const float* a, int64_t lda,
                    const float* panel, int64_t next, float* y, int64_t ldy, bool accumulate) {
  const int64_t at = mr < 1 ? 0 : mr > kMr ? kMr - 1 : mr - 1;
  (panels == 2 ? kTiles<2> : kTiles<1>)[at](kc, a, lda, panel, next, y, ldy, accumulate);
}

}  // namespace shardserve::cpu::avx512
