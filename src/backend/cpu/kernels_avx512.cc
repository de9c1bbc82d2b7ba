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

// The MR x 16 tile (MR <= 12): each row's weight broadcast from memory into its FMA against the
// panel's 16 tokens.
template <int MR>
inline void MicroKernel(int64_t kc, const float* a, int64_t lda, const float* panel, float* y,
                        int64_t ldy, bool accumulate) {
  static_assert(MR >= 1 && MR <= kMr);
  Accumulators<MR, __m512> acc;
  acc.Rows([&](int, __m512& c) { c = _mm512_setzero_ps(); });
  if (accumulate) acc.Rows([&](int i, __m512& c) { c = _mm512_loadu_ps(y + i * ldy); });
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b = _mm512_load_ps(panel + k * 16);
    acc.Rows([&](int i, __m512& c) { c = _mm512_fmadd_ps(_mm512_set1_ps(a[i * lda + k]), b, c); });
  }
  acc.Rows([&](int i, __m512& c) { _mm512_storeu_ps(y + i * ldy, c); });
}

// The MR x 32 tile: two panels of 16 tokens (the second `next` floats after the first, its
// outputs 16 after the first's), each weight broadcast once into a register for both panels'
// FMAs: 24 FMAs for 14 loads, where the tile above has 12 for 13 and waits on the load ports.
// Each output sums the same products in the same order as MicroKernel's.
template <int MR>
inline void MicroKernel2(int64_t kc, const float* a, int64_t lda, const float* panel, int64_t next,
                         float* y, int64_t ldy, bool accumulate) {
  static_assert(MR >= 1 && MR <= kMr);
  struct Two {
    __m512 lo, hi;
  };
  Accumulators<MR, Two> acc;
  acc.Rows([&](int i, Two& c) {
    c.lo = accumulate ? _mm512_loadu_ps(y + i * ldy) : _mm512_setzero_ps();
    c.hi = accumulate ? _mm512_loadu_ps(y + i * ldy + 16) : _mm512_setzero_ps();
  });
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_load_ps(panel + k * 16), b1 = _mm512_load_ps(panel + next + k * 16);
    acc.Rows([&](int i, Two& c) {
      const __m512 w = _mm512_set1_ps(a[i * lda + k]);
      c.lo = _mm512_fmadd_ps(w, b0, c.lo);
      c.hi = _mm512_fmadd_ps(w, b1, c.hi);
    });
  }
  acc.Rows([&](int i, Two& c) {
    _mm512_storeu_ps(y + i * ldy, c.lo);
    _mm512_storeu_ps(y + i * ldy + 16, c.hi);
  });
}

template <int MR>
void Tile(int64_t kc, const float* a, int64_t lda, const float* panel, float* y, int64_t ldy,
          bool accumulate) {
  MicroKernel<MR>(kc, a, lda, panel, y, ldy, accumulate);
}

template <int MR>
void Tile2(int64_t kc, const float* a, int64_t lda, const float* panel, int64_t next, float* y,
           int64_t ldy, bool accumulate) {
  MicroKernel2<MR>(kc, a, lda, panel, next, y, ldy, accumulate);
}

using TileFn = void (*)(int64_t, const float*, int64_t, const float*, float*, int64_t, bool);
constexpr TileFn kTiles[kMr] = {Tile<1>, Tile<2>, Tile<3>, Tile<4>,  Tile<5>,  Tile<6>,
                                Tile<7>, Tile<8>, Tile<9>, Tile<10>, Tile<11>, Tile<12>};
using Tile2Fn = void (*)(int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t,
                         bool);
constexpr Tile2Fn kTiles2[kMr] = {Tile2<1>, Tile2<2>, Tile2<3>, Tile2<4>,  Tile2<5>,  Tile2<6>,
                                  Tile2<7>, Tile2<8>, Tile2<9>, Tile2<10>, Tile2<11>, Tile2<12>};

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

void MicroKernelAny(int64_t mr, int64_t kc, const float* a, int64_t lda, const float* panel,
                    float* y, int64_t ldy, bool accumulate) {
  kTiles[mr < 1 ? 0 : mr > kMr ? kMr - 1 : mr - 1](kc, a, lda, panel, y, ldy, accumulate);
}

void MicroKernelAny2(int64_t mr, int64_t kc, const float* a, int64_t lda, const float* panel,
                     int64_t next, float* y, int64_t ldy, bool accumulate) {
  kTiles2[mr < 1 ? 0 : mr > kMr ? kMr - 1 : mr - 1](kc, a, lda, panel, next, y, ldy, accumulate);
}

}  // namespace shardserve::cpu::avx512
