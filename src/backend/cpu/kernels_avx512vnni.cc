// The AVX-512 quantized prefill tile with AVX512-VNNI's vpdpwssd (tile_int_avx512.h), and its
// int8 form with vpdpbusd (KernelLevel::kAvx512Int8): the only kernels source built for VNNI,
// called where the CPU has it (kernels_avx512.cc's UsesVnni; the level requires it).
#include "backend/cpu/kernels_avx512.h"
#include "backend/cpu/tile_int_avx512.h"

namespace shardserve::cpu::avx512 {

void MicroKernelIntVnni(int64_t mr, int panels, int64_t kc, bool transposed, int g, bool has_min,
                        const int16_t* wq, const float* wf, const float* wm, int64_t ld,
                        const int16_t* xq, int64_t q_next, const float* xd, const float* xds,
                        int64_t d_next, float* y, int64_t ldy, bool accumulate) {
  IntTileAny<true>(mr, panels, kc, transposed, g, has_min, wq, nullptr, wf, wm, ld, xq, q_next, xd,
                   xds, d_next, y, ldy, accumulate);
}

void MicroKernelInt8(int64_t mr, int panels, int64_t kc, bool transposed, int g, bool has_min,
                     const int8_t* wq, const int32_t* wsum, const float* wf, const float* wm,
                     int64_t ld, const uint8_t* xq, int64_t q_next, const float* xd,
                     const float* xds, int64_t d_next, float* y, int64_t ldy, bool accumulate) {
  IntTileAny<true, true>(mr, panels, kc, transposed, g, has_min, wq, wsum, wf, wm, ld, xq, q_next,
                         xd, xds, d_next, y, ldy, accumulate);
}

}  // namespace shardserve::cpu::avx512
