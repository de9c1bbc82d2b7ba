#pragma once
// What each kernel build (x86: kernels.cc; portable: kernels_portable.cc) and the kernels written
// once for both (kernels_common.cc) call in each other, beside kernels.h.
#include <cstdint>

#include "backend/cpu/kernels.h"

namespace shardserve::cpu {

// The values of the 256 E4M3 bytes (F8E4M3ToF32), built once (kernels_common.cc).
const float* E4M3Values();

// scores[p] = e^(scores[p] - mx) for p < len; returns their sum (per build).
float ExpMinusMax(float* scores, int64_t len, float mx);

// AttendGroup (kernels.h) for any head size: each cached row converted to F32 once for the G
// heads (kernels_common.cc; x86 keeps register-blocked versions for head sizes 64 and 128).
void AttendGroupRows(const float* const* q, int64_t G, const KvRows& kv,
                     const void* const* k_blocks, const void* const* v_blocks, int64_t bs,
                     int64_t hd, int64_t begin, int64_t len, float scale, const float* sinks,
                     float* scores, float* const* out);

}  // namespace shardserve::cpu
