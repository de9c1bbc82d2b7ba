// quant.cc's decode loops built for AVX2 with AVX-VNNI (quant_decode.h's DotAdd becomes the VEX
// vpdpwssd: one instruction for madd and add, the same sums): KernelLevel::kAvx2's decode on CPUs
// that have it (Alder Lake and later, Zen 5; cpu_features.h's UsesVnni), none of AVX-512.
#include "backend/cpu/quant_decode.h"

namespace shardserve::cpu {

void DecodeRowsAvxVnni(const WeightMatrix& w, int64_t n0, int64_t n1, const QuantizedActivations& a,
                       int64_t M, float* y, int64_t ldy) {
  ForQuantized(w.dtype, [&](auto d) { DecodeRowsTyped<d.value>(w, n0, n1, a, M, y, ldy); });
}

}  // namespace shardserve::cpu
