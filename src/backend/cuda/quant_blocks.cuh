#pragma once
// The blocks of GGUF's quantized types as ggml lays them out (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K),
// and FP8 in blocks of 128 (kF8_128), read 32 values at a time: the CUDA backend's kernels
// (quant.cu) expand them on the device, and tests/unit/backend/quant_blocks_test.cu checks them on
// the host against the CPU's reading. Internal to backend/cuda.
#include <cuda_fp16.h>
#include <vector_types.h>

#include <cstdint>

#include "backend/dtype.h"

namespace shardserve::cuda {

__host__ __device__ __forceinline__ float HalfAt(const uint8_t* p) {  // p 2-byte aligned
  return __half2float(__ushort_as_half(*reinterpret_cast<const uint16_t*>(p)));
}

// Chunk j (32 consecutive values) of the blocks starting at `b` (block-aligned as in the file),
// expanded to floats. Reads only with the alignment the layout guarantees: 2 bytes for Q8_0,
// Q4_0 and Q6_K (blocks of 34, 18 and 210 bytes), 4 for Q4_1 and F8_128 (20, 132), 16 for Q4_K
// and Q5_K (144, 176).
template <DType D>
struct Blocks;

template <>
struct Blocks<DType::kQ8_0> {  // F16 d; 32 x int8: d * q
  static __host__ __device__ void Chunk(const uint8_t* b, int j, float (&v)[32]) {
    b += j * 34;
    const float d = HalfAt(b);
    const uint16_t* q = reinterpret_cast<const uint16_t*>(b + 2);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const uint16_t u = q[i];
      v[2 * i] = d * static_cast<float>(static_cast<int8_t>(u & 0xff));
      v[2 * i + 1] = d * static_cast<float>(static_cast<int8_t>(u >> 8));
    }
  }
};

template <>
struct Blocks<DType::kQ4_0> {  // F16 d; value i in the low nibble of byte i, i + 16 in the high
  static __host__ __device__ void Chunk(const uint8_t* b, int j, float (&v)[32]) {
    b += j * 18;
    const float d = HalfAt(b);
    const uint16_t* q = reinterpret_cast<const uint16_t*>(b + 2);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t u = q[i];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const uint32_t byte = (u >> (8 * e)) & 0xff;
        v[2 * i + e] = d * (static_cast<float>(byte & 15) - 8.f);
        v[2 * i + e + 16] = d * (static_cast<float>(byte >> 4) - 8.f);
      }
    }
  }
};

template <>
struct Blocks<DType::kQ4_1> {  // F16 d, F16 m; nibbles as Q4_0: d * q + m
  static __host__ __device__ void Chunk(const uint8_t* b, int j, float (&v)[32]) {
    b += j * 20;
    const float d = HalfAt(b), m = HalfAt(b + 2);
    const uint32_t* q = reinterpret_cast<const uint32_t*>(b + 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t u = q[i];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t byte = (u >> (8 * e)) & 0xff;
        v[4 * i + e] = d * static_cast<float>(byte & 15) + m;
        v[4 * i + e + 16] = d * static_cast<float>(byte >> 4) + m;
      }
    }
  }
};

// The 6-bit scale and minimum of sub-block j of a Q4_K / Q5_K super-block (ggml's
// get_scale_min_k4).
__host__ __device__ __forceinline__ void ScaleMin(const uint8_t* s, int j, float* sc, float* m) {
  if (j < 4) {
    *sc = static_cast<float>(s[j] & 63);
    *m = static_cast<float>(s[j + 4] & 63);
  } else {
    *sc = static_cast<float>((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
    *m = static_cast<float>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// 32 bytes at p (16-byte aligned) as 8 words.
__host__ __device__ __forceinline__ void Load32(const uint8_t* p, uint32_t (&w)[8]) {
  const uint4 a = reinterpret_cast<const uint4*>(p)[0], b = reinterpret_cast<const uint4*>(p)[1];
  w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
}

// Q4_K and Q5_K: F16 d, F16 dmin, 12 bytes of scales and minimums, (Q5_K: 32 bytes of fifth
// bits: bit j of byte i for value i of sub-block j), then 128 bytes of quants; sub-block j's
// values are the low (even j) or high (odd j) nibbles of bytes 32 (j / 2) .. + 31 of the quants:
// d * scale_j * q - dmin * min_j.
template <bool kFifthBit>
__host__ __device__ __forceinline__ void KQuantChunk(const uint8_t* b, int j, float (&v)[32]) {
  constexpr int kBlockBytes = kFifthBit ? 176 : 144, kQuants = kFifthBit ? 48 : 16;
  b += (j / 8) * kBlockBytes;
  j %= 8;
  float sc, mn;
  ScaleMin(b + 4, j, &sc, &mn);
  const float d = HalfAt(b) * sc, m = HalfAt(b + 2) * mn;
  uint32_t w[8], h[8] = {};
  Load32(b + kQuants + 32 * (j / 2), w);
  if constexpr (kFifthBit) Load32(b + 16, h);
  const int shift = 4 * (j % 2);
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int bit = 8 * (i % 4);
    uint32_t q = (w[i / 4] >> (bit + shift)) & 15;
    if constexpr (kFifthBit) q |= ((h[i / 4] >> (bit + j)) & 1) << 4;
    v[i] = d * static_cast<float>(q) - m;
  }
}

template <>
struct Blocks<DType::kQ4_K> {
  static __host__ __device__ void Chunk(const uint8_t* b, int j, float (&v)[32]) {
    KQuantChunk<false>(b, j, v);
  }
};

template <>
struct Blocks<DType::kQ5_K> {
  static __host__ __device__ void Chunk(const uint8_t* b, int j, float (&v)[32]) {
    KQuantChunk<true>(b, j, v);
  }
};

// Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16 values), F16
// d. In each half of 128 values, chunk c takes the low (c < 2) or high nibbles of low-nibble
// bytes 32 (c % 2) .. + 31 and bit pair c of the half's 32 high-bit bytes: d * scale * (q - 32).
// Q6KChunk locates chunk j (of 8): its low-nibble and high-bit-pair bytes (as 16 uint16), which
// nibble and bit pair, and the scales of its two 16-value halves.
struct Q6KChunk {
  const uint16_t* ql;
  const uint16_t* qh;
  float s0, s1;
  int lshift, hshift;
  __host__ __device__ Q6KChunk(const uint8_t* b, int j) {
    b += (j / 8) * 210;
    j %= 8;
    const int half = j / 4, c = j % 4;
    ql = reinterpret_cast<const uint16_t*>(b + 64 * half + 32 * (c % 2));
    qh = reinterpret_cast<const uint16_t*>(b + 128 + 32 * half);
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192 + 8 * half + 2 * c);
    const float d = HalfAt(b + 208);
    s0 = d * scales[0];
    s1 = d * scales[1];
    lshift = 4 * (c / 2);
    hshift = 2 * c;
  }
};

template <>
struct Blocks<DType::kQ6_K> {
  static __host__ __device__ void Chunk(const uint8_t* b, int j, float (&v)[32]) {
    const Q6KChunk c(b, j);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const uint32_t l = c.ql[i], hb = c.qh[i];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const uint32_t q =
            ((l >> (8 * e + c.lshift)) & 15) | (((hb >> (8 * e + c.hshift)) & 3) << 4);
        v[2 * i + e] = (i < 8 ? c.s0 : c.s1) * (static_cast<float>(q) - 32.f);
      }
    }
  }
};

// FP8 as the backends keep it (DType::kF8_128, model/fp8.h): blocks of an F32 scale and 128 E4M3
// bytes, 4 chunks a block. An E4M3 byte becomes F16 bits (sign to bit 15, the other 7 bits to
// 13-7: the value times 2^-8, subnormals included), undone by the scale times 256: one rounding
// of value x scale, as the CPU's kernels (backend/cpu/kernels.cc, F8x8) and the expansion give.
__host__ __device__ __forceinline__ float F8AsHalfTimes256th(uint32_t byte) {
  const uint16_t h = static_cast<uint16_t>(((byte & 0x7F) << 7) | ((byte & 0x80) << 8));
  return __half2float(__ushort_as_half(h));
}

template <>
struct Blocks<DType::kF8_128> {
  static __host__ __device__ void Chunk(const uint8_t* b, int j, float (&v)[32]) {
    b += (j / 4) * 132;  // 4-byte aligned
    const float s = *reinterpret_cast<const float*>(b) * 256.f;
    const uint32_t* q = reinterpret_cast<const uint32_t*>(b + 4 + 32 * (j % 4));
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t u = q[i];
#pragma unroll
      for (int e = 0; e < 4; ++e) v[4 * i + e] = F8AsHalfTimes256th(u >> (8 * e)) * s;
    }
  }
};

// --- Integer reading (the dp4a decode GEMV, quant.cu): chunk j of a GGUF block type as 32
// integers q, four int8 a word (value 4i + k in byte k of word i), with value i =
// d[i / 16] * q_i + m: the 4- and 5-bit types' quants unsigned (their offset or minimum in m),
// Q8_0's and Q6_K's signed (m = 0; Q6_K's two 16-value scales in d[0] and d[1]; the others'
// d[0] == d[1]). The same values as Chunk, each one float operation from q.
struct IntChunk {
  int32_t q[8];
  float d[2];
  float m;
};

// a . b over four int8 lanes, plus c (the device's __dp4a; the host's the same in C++).
__host__ __device__ __forceinline__ int Dp4a(int32_t a, int32_t b, int c) {
#ifdef __CUDA_ARCH__
  return __dp4a(a, b, c);
#else
  for (int k = 0; k < 4; ++k) {
    c += static_cast<int8_t>(static_cast<uint32_t>(a) >> (8 * k)) *
         static_cast<int8_t>(static_cast<uint32_t>(b) >> (8 * k));
  }
  return c;
#endif
}

// Four bytes of 0..63 less 32 each, as int8 (no borrow crosses a byte: each is 0x80 + b first).
__host__ __device__ __forceinline__ uint32_t Less32(uint32_t x) {
  return ((x | 0x80808080u) - 0x20202020u) ^ 0x80808080u;
}

template <DType D>
struct IntBlocks;

template <>
struct IntBlocks<DType::kQ8_0> {
  static __host__ __device__ void Chunk(const uint8_t* b, int j, IntChunk& c) {
    b += j * 34;
    c.d[0] = c.d[1] = HalfAt(b);
    c.m = 0;
    const uint16_t* q = reinterpret_cast<const uint16_t*>(b + 2);  // 2-byte aligned
#pragma unroll
    for (int i = 0; i < 8; ++i)
      c.q[i] = static_cast<int32_t>(q[2 * i] | (uint32_t{q[2 * i + 1]} << 16));
  }
};

// Q4_0 and Q4_1: value i in the low nibble of byte i, i + 16 in the high one.
template <DType D>
__host__ __device__ __forceinline__ void NibbleChunk(const uint8_t* qs, IntChunk& c) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (D == DType::kQ4_0) {  // 2-byte aligned
      const uint16_t* h = reinterpret_cast<const uint16_t*>(qs);
      w[i] = h[2 * i] | (uint32_t{h[2 * i + 1]} << 16);
    } else {
      w[i] = reinterpret_cast<const uint32_t*>(qs)[i];
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    c.q[i] = static_cast<int32_t>(w[i] & 0x0F0F0F0Fu);
    c.q[i + 4] = static_cast<int32_t>((w[i] >> 4) & 0x0F0F0F0Fu);
  }
}

template <>
struct IntBlocks<DType::kQ4_0> {  // d * (q - 8)
  static __host__ __device__ void Chunk(const uint8_t* b, int j, IntChunk& c) {
    b += j * 18;
    c.d[0] = c.d[1] = HalfAt(b);
    c.m = -8.f * c.d[0];
    NibbleChunk<DType::kQ4_0>(b + 2, c);
  }
};

template <>
struct IntBlocks<DType::kQ4_1> {  // d * q + m
  static __host__ __device__ void Chunk(const uint8_t* b, int j, IntChunk& c) {
    b += j * 20;
    c.d[0] = c.d[1] = HalfAt(b);
    c.m = HalfAt(b + 2);
    NibbleChunk<DType::kQ4_1>(b + 4, c);
  }
};

// Q4_K and Q5_K as KQuantChunk reads them: d * scale_j * q - dmin * min_j.
template <bool kFifthBit>
__host__ __device__ __forceinline__ void KQuantIntChunk(const uint8_t* b, int j, IntChunk& c) {
  constexpr int kBlockBytes = kFifthBit ? 176 : 144, kQuants = kFifthBit ? 48 : 16;
  b += (j / 8) * kBlockBytes;
  j %= 8;
  float sc, mn;
  ScaleMin(b + 4, j, &sc, &mn);
  c.d[0] = c.d[1] = HalfAt(b) * sc;
  c.m = -(HalfAt(b + 2) * mn);
  uint32_t w[8], h[8] = {};
  Load32(b + kQuants + 32 * (j / 2), w);
  if constexpr (kFifthBit) Load32(b + 16, h);
  const int shift = 4 * (j % 2);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    uint32_t q = (w[i] >> shift) & 0x0F0F0F0Fu;
    if constexpr (kFifthBit) q |= ((h[i] >> j) & 0x01010101u) << 4;
    c.q[i] = static_cast<int32_t>(q);
  }
}

template <>
struct IntBlocks<DType::kQ4_K> {
  static __host__ __device__ void Chunk(const uint8_t* b, int j, IntChunk& c) {
    KQuantIntChunk<false>(b, j, c);
  }
};

template <>
struct IntBlocks<DType::kQ5_K> {
  static __host__ __device__ void Chunk(const uint8_t* b, int j, IntChunk& c) {
    KQuantIntChunk<true>(b, j, c);
  }
};

template <>
struct IntBlocks<DType::kQ6_K> {  // as Blocks<kQ6_K>: d * scale * (q - 32), q - 32 signed
  static __host__ __device__ void Chunk(const uint8_t* b, int j, IntChunk& c) {
    const Q6KChunk k(b, j);
    c.d[0] = k.s0;
    c.d[1] = k.s1;
    c.m = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t l = k.ql[2 * i] | (uint32_t{k.ql[2 * i + 1]} << 16);
      const uint32_t h = k.qh[2 * i] | (uint32_t{k.qh[2 * i + 1]} << 16);
      c.q[i] = static_cast<int32_t>(
          Less32(((l >> k.lshift) & 0x0F0F0F0Fu) | (((h >> k.hshift) & 0x03030303u) << 4)));
    }
  }
};

// Whether IntBlocks reads D.
constexpr bool HasIntBlocks(DType d) {
  return d == DType::kQ8_0 || d == DType::kQ4_0 || d == DType::kQ4_1 || d == DType::kQ4_K ||
         d == DType::kQ5_K || d == DType::kQ6_K;
}

// 32 activations quantized for the dp4a GEMV: q_i = round(x_i / scale) in [-127, 127], scale =
// max |x| / 127 (0 for a chunk of zeros), and the sum of the q (for the minimum's term).
__host__ __device__ __forceinline__ void QuantizeChunk(const float* x, int32_t (&q)[8],
                                                       float* scale, int* sum) {
  float amax = 0;
#pragma unroll
  for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(x[i]));
  const float s = amax / 127.f, inv = amax > 0 ? 127.f / amax : 0.f;
  int total = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    uint32_t w = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int v = static_cast<int>(rintf(x[4 * i + k] * inv));
      total += v;
      w |= (static_cast<uint32_t>(v) & 0xFF) << (8 * k);
    }
    q[i] = static_cast<int32_t>(w);
  }
  *scale = s;
  *sum = total;
}

// The dot product of a weight chunk with a quantized activation chunk (scale, sum): each half's
// 16 products in integers, then scaled.
__host__ __device__ __forceinline__ float ChunkDot(const IntChunk& c, const int32_t (&x)[8],
                                                   float x_scale, int x_sum) {
  int lo = 0, hi = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    lo = Dp4a(c.q[i], x[i], lo);
    hi = Dp4a(c.q[i + 4], x[i + 4], hi);
  }
  return x_scale * (c.d[0] * static_cast<float>(lo) + c.d[1] * static_cast<float>(hi) +
                    c.m * static_cast<float>(x_sum));
}

// Values and bytes of a block of D, as constants device code can use.
template <DType D>
struct Layout {
  static constexpr int64_t kBlock = DTypeBlock(D);
  static constexpr int64_t kBytes = static_cast<int64_t>(DTypeBlockBytes(D));
};
// Bytes of n values of D (n a multiple of its block).
template <DType D>
__host__ __device__ constexpr int64_t BytesOf(int64_t n) {
  return n / Layout<D>::kBlock * Layout<D>::kBytes;
}

}  // namespace shardserve::cuda
