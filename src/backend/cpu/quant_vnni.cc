// quant.cc's decode loops built for AVX-512 with VNNI (quant_decode.h's DotAdd becomes vpdpwssd,
// and the loops get AVX-512VL's 32 vector registers), and their int8 path (vpdpbusd,
// KernelLevel::kAvx512Int8): called only where the CPU has VNNI.
#include "backend/cpu/quant_decode.h"

namespace shardserve::cpu {

void DecodeRowsVnni(const WeightMatrix& w, int64_t n0, int64_t n1, const QuantizedActivations& a,
                    int64_t M, float* y, int64_t ldy) {
  ForQuantized(w.dtype, [&](auto d) { DecodeRowsTyped<d.value>(w, n0, n1, a, M, y, ldy); });
}

void DecodeRowsInt8(const WeightMatrix& w, int64_t n0, int64_t n1, const QuantizedActivations& a,
                    int64_t M, float* y, int64_t ldy) {
  ForQuantized(w.dtype, [&](auto d) {
    if constexpr (DecodesOnInt8(d.value)) DecodeRowsTyped<d.value, true>(w, n0, n1, a, M, y, ldy);
  });
}

}  // namespace shardserve::cpu
