// The AVX-512 quantized prefill tile with AVX512-VNNI's vpdpwssd (tile_int_avx512.h): the only
// source built for VNNI, called where the CPU has it (kernels_avx512.cc's UsesVnni).
#include "backend/cpu/kernels_avx512.h"
#include "backend/cpu/tile_int_avx512.h"

namespace shardserve::cpu::avx512 {

void MicroKernelIntVnni(int64_t mr, int64_t kc, bool transposed, int g, bool has_min,
                        const int16_t* wq, const float* wf, const float* wm, int64_t ld,
                        const int16_t* xq, const float* xd, const float* xds, float* y, int64_t ldy,
                        bool accumulate) {
  IntTileAny<true>(mr, kc, transposed, g, has_min, wq, wf, wm, ld, xq, xd, xds, y, ldy, accumulate);
}

}  // namespace shardserve::cpu::avx512
