#pragma once
// What the AVX-512 prefill tiles share (internal to kernels_avx512.cc and kernels_avx512bf16.cc,
// the only sources built for AVX-512: include it from no other).

namespace shardserve::cpu::avx512 {

// The accumulators of a tile of MR <= 12 rows, one register of type V a row: named variables (an
// array of them is kept on the stack, and every step stores its result). Rows(f) calls f(i, c)
// with row i's accumulator for each row of the tile.
template <int MR, typename V>
struct Accumulators {
  static_assert(MR >= 1 && MR <= 12);
  V c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11;
  template <typename F>
  inline void Rows(F&& f) {
    f(0, c0);
    if constexpr (MR > 1) f(1, c1);
    if constexpr (MR > 2) f(2, c2);
    if constexpr (MR > 3) f(3, c3);
    if constexpr (MR > 4) f(4, c4);
    if constexpr (MR > 5) f(5, c5);
    if constexpr (MR > 6) f(6, c6);
    if constexpr (MR > 7) f(7, c7);
    if constexpr (MR > 8) f(8, c8);
    if constexpr (MR > 9) f(9, c9);
    if constexpr (MR > 10) f(10, c10);
    if constexpr (MR > 11) f(11, c11);
  }
};

}  // namespace shardserve::cpu::avx512
