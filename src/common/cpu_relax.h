#pragma once
// A spin-wait loop's pause: x86's PAUSE, ARM's YIELD (the other thread on the core runs, the
// loop draws less power); nothing elsewhere.
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace shardserve {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__) || defined(__arm__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace shardserve
