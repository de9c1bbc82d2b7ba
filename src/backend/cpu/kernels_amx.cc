// KernelLevel::kAvx512Bf16's prefill tile in AMX (kernels_avx512.h's MicroKernelBf16Amx): the only
// source built for AMX-TILE and AMX-BF16, called where the CPU has them and Linux lets the process
// use the tiles (UsesAmx).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

#include "backend/cpu/cpu_features.h"
#include "backend/cpu/kernels_avx512.h"

namespace shardserve::cpu::avx512 {
namespace {

std::atomic<int> g_amx{-1};  // UsesAmx once known

// Linux keeps the tiles' 8 KiB of state off until a process asks for it (arch/x86's
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a thread that runs a tile instruction without it is
// killed. Asked once; refused (an older kernel, a sandbox) means no AMX.
bool AmxGranted() {
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return CpuFeatures::Detect().amx_bf16 &&
           syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// The tiles' shapes (palette 1): 0-2 the F32 sums of 16 rows x 16 tokens, 3-5 16 rows' 16 pairs
// (32 BF16), 6 the panel's 16 pairs of 16 tokens; each 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void ConfigureTiles() {
  thread_local bool configured = false;
  if (configured) return;
  TileConfig config;
  for (int t = 0; t < 7; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
  configured = true;
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

}  // namespace

bool UsesAmx() {
  int amx = g_amx.load(std::memory_order_relaxed);
  if (amx < 0) {
    amx = AmxGranted() ? 1 : 0;
    g_amx.store(amx, std::memory_order_relaxed);
  }
  return amx == 1;
}

void UseAmx(bool on) { g_amx.store(on && AmxGranted() ? 1 : 0, std::memory_order_relaxed); }

void MicroKernelBf16Amx(int tiles, int64_t kp, const uint16_t* a, int64_t lda,
                        const uint16_t* panel, float* y, int64_t ldy, bool accumulate) {
  ConfigureTiles();
  switch (tiles) {
    case 3:
      return Tiles<3>(kp, a, lda, panel, y, ldy, accumulate);
    case 2:
      return Tiles<2>(kp, a, lda, panel, y, ldy, accumulate);
    default:
      return Tiles<1>(kp, a, lda, panel, y, ldy, accumulate);
  }
}

}  // namespace shardserve::cpu::avx512
