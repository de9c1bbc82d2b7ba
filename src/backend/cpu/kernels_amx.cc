// The prefill tiles in AMX: KernelLevel::kAvx512Bf16's BF16 (kernels_avx512.h's MicroKernelBf16Amx)
// and the AVX-512 levels' quantized types (MicroKernelIntAmx). The only source built for AMX-TILE,
// AMX-BF16 and AMX-INT8, called where the CPU has them and Linux lets the process use the tiles
// (UsesAmx, UsesAmxInt8).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

#include "backend/cpu/cpu_features.h"
#include "backend/cpu/kernels_avx512.h"

namespace shardserve::cpu::avx512 {
namespace {

std::atomic<int> g_amx{-1};  // whether the tiles are used, once known

// Linux keeps the tiles' 8 KiB of state off until a process asks for it (arch/x86's
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a thread that runs a tile instruction without it is
// killed. Asked once; refused (an older kernel, a sandbox) means no AMX.
bool AmxGranted() {
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    const CpuFeatures have = CpuFeatures::Detect();
    return (have.amx_bf16 || have.amx_int8) &&
           syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// The tiles' shapes (palette 1), one configuration loaded at a time in a thread.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// kBf16: 0-2 the F32 sums of 16 rows x 16 tokens, 3-5 16 rows' 16 pairs (32 BF16), 6 the panel's
// 16 pairs of 16 tokens; each 16 rows of 64 bytes. kInt8Groups32 and kInt8Groups16 (groups of G
// values): 0-3 the int32 sums of 16 rows x 16 tokens (16 rows of 64 bytes), 4 and 5 16 rows' G
// bytes, 6 and 7 the panel's G / 4 quads of 16 tokens (G / 4 rows of 64 bytes): several groups'
// products run while an earlier group's sums are scaled.
enum class TileShapes { kNone, kBf16, kInt8Groups32, kInt8Groups16 };

void ConfigureTiles(TileShapes want) {
  thread_local TileShapes loaded = TileShapes::kNone;
  if (loaded == want) return;
  TileConfig config;
  const auto shape = [&](int t, int rows, int bytes) {
    config.rows[t] = static_cast<uint8_t>(rows);
    config.colsb[t] = static_cast<uint16_t>(bytes);
  };
  if (want == TileShapes::kBf16) {
    for (int t = 0; t < 7; ++t) shape(t, 16, 64);
  } else {
    const int g = want == TileShapes::kInt8Groups32 ? 32 : 16;
    for (int t = 0; t < 4; ++t) shape(t, 16, 64);
    for (int t = 4; t < 6; ++t) shape(t, 16, g);
    for (int t = 6; t < 8; ++t) shape(t, g / 4, 64);
  }
  // Not _tile_loadconfig: GCC 12's tells the compiler that it reads the configuration's first 8
  // bytes only, and the shapes' stores were dropped as dead (the tiles left unconfigured, and
  // their first instruction raised #UD).
  asm volatile("ldtilecfg %0" : : "m"(config));
  loaded = want;
}

template <int kTiles>
void Tiles(int64_t kp, const uint16_t* a, int64_t lda, const uint16_t* panel, float* y, int64_t ldy,
           bool accumulate) {
  const size_t ys = static_cast<size_t>(ldy) * sizeof(float), as = lda * sizeof(uint16_t);
  if (accumulate) {
    _tile_loadd(0, y, ys);
    if constexpr (kTiles > 1) _tile_loadd(1, y + 16 * ldy, ys);
    if constexpr (kTiles > 2) _tile_loadd(2, y + 32 * ldy, ys);
  } else {
    _tile_zero(0);
    if constexpr (kTiles > 1) _tile_zero(1);
    if constexpr (kTiles > 2) _tile_zero(2);
  }
  for (int64_t p = 0; p < kp; p += 16) {
    _tile_loadd(6, panel + 32 * p, 64);
    _tile_loadd(3, a + 2 * p, as);
    _tile_dpbf16ps(0, 3, 6);
    if constexpr (kTiles > 1) {
      _tile_loadd(4, a + 16 * lda + 2 * p, as);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (kTiles > 2) {
      _tile_loadd(5, a + 32 * lda + 2 * p, as);
      _tile_dpbf16ps(2, 5, 6);
    }
  }
  _tile_stored(0, y, ys);
  if constexpr (kTiles > 1) _tile_stored(1, y + 16 * ldy, ys);
  if constexpr (kTiles > 2) _tile_stored(2, y + 32 * ldy, ys);
}

// MicroKernelIntAmx for groups of G values: group g's 16 rows x G bytes (tile 4 + g % 2) times
// the panel's G / 4 quads (6 + g % 2) by TDPBSSD into the int32 sums (tile g % 4), stored to
// sums[g % 4] and scaled into the 16 rows' F32 accumulators (registers) while the next 3 groups'
// products run. kSplit (int16 activations as their high bytes, signed, and low bytes, unsigned):
// each group's rows (tile 4 + g % 2) times the high bytes (tile 6) by TDPBSSD into tile 2 (g % 2)
// and times the low bytes (tile 7) by TDPBSUD into tile 2 (g % 2) + 1, one group ahead; the sums
// joined as 256 high + low, exactly the int16 products' sums (at most 32 products of 128 x 32767
// in magnitude: no overflow).
template <int G, bool kMin, bool kSplit>
void GroupsAmx(int64_t mr, int64_t kc, const int8_t* wq, const float* wf, const float* wm,
               int64_t ld, const int8_t* xq, const uint8_t* xlo, const float* xd, const float* xds,
               float* y, int64_t ldy, bool accumulate) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    acc[i] = accumulate && i < mr ? _mm512_loadu_ps(y + i * ldy) : _mm512_setzero_ps();
  }
  alignas(64) int32_t sums[4][16 * 16];
  const size_t ws = static_cast<size_t>(ld);
  // Group g's products into tile C (the sums) from tiles A and B, whose numbers the instructions
  // take as immediates (hence macros, not templates); kSplit's low bytes' into tile CL. Stored to
  // sums[C] (sums[CL]) a step later, once the next group's products have started: a store right
  // after its product waits for it.
#define SHARDSERVE_AMX_GROUP(C, A, B)  \
  _tile_zero(C);                       \
  _tile_loadd(A, wq + g * G, ws);      \
  _tile_loadd(B, xq + g * G * 16, 64); \
  _tile_dpbssd(C, A, B)
#define SHARDSERVE_AMX_SPLIT_GROUP(C, CL, A) \
  SHARDSERVE_AMX_GROUP(C, A, 6);             \
  _tile_zero(CL);                            \
  _tile_loadd(7, xlo + g * G * 16, 64);      \
  _tile_dpbsud(CL, A, 7)
  const auto multiply = [&](int64_t g) {
    if constexpr (kSplit) {
      if (g % 2 == 0) {
        SHARDSERVE_AMX_SPLIT_GROUP(0, 1, 4);
      } else {
        SHARDSERVE_AMX_SPLIT_GROUP(2, 3, 5);
      }
      return;
    }
    switch (g % 4) {
      case 0:
        SHARDSERVE_AMX_GROUP(0, 4, 6);
        break;
      case 1:
        SHARDSERVE_AMX_GROUP(1, 5, 7);
        break;
      case 2:
        SHARDSERVE_AMX_GROUP(2, 4, 6);
        break;
      default:
        SHARDSERVE_AMX_GROUP(3, 5, 7);
        break;
    }
  };
#undef SHARDSERVE_AMX_SPLIT_GROUP
#undef SHARDSERVE_AMX_GROUP
  const auto store = [&](int64_t g) {
    if constexpr (kSplit) {
      if (g % 2 == 0) {
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
      } else {
        _tile_stored(2, sums[2], 64);
        _tile_stored(3, sums[3], 64);
      }
      return;
    }
    switch (g % 4) {
      case 0:
        _tile_stored(0, sums[0], 64);
        break;
      case 1:
        _tile_stored(1, sums[1], 64);
        break;
      case 2:
        _tile_stored(2, sums[2], 64);
        break;
      default:
        _tile_stored(3, sums[3], 64);
        break;
    }
  };
  const int64_t groups = kc / G;
  constexpr int64_t kAhead = kSplit ? 1 : 3;
  for (int64_t g = 0; g < kAhead && g < groups; ++g) multiply(g);
  for (int64_t g = 0; g < groups; ++g) {
    if (g + kAhead < groups) multiply(g + kAhead);
    store(g);
    const int32_t* c = sums[kSplit ? 2 * (g % 2) : g % 4];
    const int64_t b = g * G / 32;
    const __m512 d = _mm512_loadu_ps(xd + b * 16);
    const __m512 s = kMin ? _mm512_loadu_ps(xds + b * 16) : _mm512_setzero_ps();
    // The tiles' float steps (MicroKernelInt8's and MicroKernelInt's): y += sum * factor * d
    // (+ minimum * s).
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      __m512i sum = _mm512_load_si512(c + 16 * i);
      if constexpr (kSplit) {
        sum = _mm512_add_epi32(_mm512_slli_epi32(sum, 8), _mm512_load_si512(c + 256 + 16 * i));
      }
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                               _mm512_mul_ps(_mm512_set1_ps(wf[i * (ld / 16) + g]), d), acc[i]);
      if constexpr (kMin) {
        acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(wm[i * (ld / 32) + b]), s, acc[i]);
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    if (i < mr) _mm512_storeu_ps(y + i * ldy, acc[i]);
  }
}

bool TilesInUse() {
  int amx = g_amx.load(std::memory_order_relaxed);
  if (amx < 0) {
    amx = AmxGranted() ? 1 : 0;
    g_amx.store(amx, std::memory_order_relaxed);
  }
  return amx == 1;
}

}  // namespace

bool UsesAmx() {
  static const bool bf16 = CpuFeatures::Detect().amx_bf16;
  return bf16 && TilesInUse();
}

bool UsesAmxInt8() {
  static const bool int8 = CpuFeatures::Detect().amx_int8;
  return int8 && TilesInUse();
}

void UseAmx(bool on) { g_amx.store(on && AmxGranted() ? 1 : 0, std::memory_order_relaxed); }

void MicroKernelBf16Amx(int tiles, int64_t kp, const uint16_t* a, int64_t lda,
                        const uint16_t* panel, float* y, int64_t ldy, bool accumulate) {
  ConfigureTiles(TileShapes::kBf16);
  switch (tiles) {
    case 3:
      return Tiles<3>(kp, a, lda, panel, y, ldy, accumulate);
    case 2:
      return Tiles<2>(kp, a, lda, panel, y, ldy, accumulate);
    default:
      return Tiles<1>(kp, a, lda, panel, y, ldy, accumulate);
  }
}

void MicroKernelIntAmx(int64_t mr, int64_t kc, int g, bool has_min, const int8_t* wq,
                       const float* wf, const float* wm, int64_t ld, const int8_t* xq,
                       const uint8_t* xlo, const float* xd, const float* xds, float* y, int64_t ldy,
                       bool accumulate) {
  ConfigureTiles(g == 16 ? TileShapes::kInt8Groups16 : TileShapes::kInt8Groups32);
  using Fn =
      void (*)(int64_t, int64_t, const int8_t*, const float*, const float*, int64_t, const int8_t*,
               const uint8_t*, const float*, const float*, float*, int64_t, bool);
  // groups[split][g == 16][has_min]
  constexpr Fn groups[2][2][2] = {{{GroupsAmx<32, false, false>, GroupsAmx<32, true, false>},
                                   {GroupsAmx<16, false, false>, GroupsAmx<16, true, false>}},
                                  {{GroupsAmx<32, false, true>, GroupsAmx<32, true, true>},
                                   {GroupsAmx<16, false, true>, GroupsAmx<16, true, true>}}};
  groups[xlo != nullptr][g == 16][has_min](mr, kc, wq, wf, wm, ld, xq, xlo, xd, xds, y, ldy,
                                           accumulate);
}

}  // namespace shardserve::cpu::avx512
