#include "devtools/quantize_row.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>

namespace shardserve {
namespace {

void PutHalf(std::string& out, float v) {
  const uint16_t h = F32ToF16(v);
  out.append(reinterpret_cast<const char*>(&h), 2);
}

// One Q4_K / Q5_K super-block (bits 4 or 5): per sub-block of 32 an offset (its minimum, if
// negative) and a scale, both quantized to 6 bits against the super-block's d and dmin.
std::string QuantizeK45(const float* x, int bits) {
  const int top = (1 << bits) - 1;
  float scale[8], offset[8];
  for (int j = 0; j < 8; ++j) {
    float lo = 0, hi = 0;
    for (int l = 0; l < 32; ++l) {
      lo = std::min(lo, x[32 * j + l]);
      hi = std::max(hi, x[32 * j + l]);
    }
    scale[j] = (hi - lo) / top;
    offset[j] = -lo;
  }
  const float max_scale = *std::max_element(scale, scale + 8);
  const float max_offset = *std::max_element(offset, offset + 8);
  const float d = max_scale / 63, dmin = max_offset / 63;
  // The F16 values the reader sees.
  const float dr = F16ToF32(F32ToF16(d)), dminr = F16ToF32(F32ToF16(dmin));
  int sc[8], mn[8];
  for (int j = 0; j < 8; ++j) {
    sc[j] = dr > 0 ? std::min(63, static_cast<int>(std::lround(scale[j] / dr))) : 0;
    mn[j] = dminr > 0 ? std::min(63, static_cast<int>(std::lround(offset[j] / dminr))) : 0;
  }
  uint8_t packed[12];
  for (int j = 0; j < 4; ++j) {
    packed[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
    packed[j + 4] = static_cast<uint8_t>(mn[j] | ((mn[j + 4] >> 4) << 6));
    packed[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4));
  }
  int q[256];
  for (int i = 0; i < 256; ++i) {
    const int j = i / 32;
    const float step = dr * sc[j], off = dminr * mn[j];
    q[i] = step > 0 ? std::clamp(static_cast<int>(std::lround((x[i] + off) / step)), 0, top) : 0;
  }
  std::string out;
  PutHalf(out, d);
  PutHalf(out, dmin);
  out.append(reinterpret_cast<const char*>(packed), 12);
  if (bits == 5) {  // bit 2c of byte l: value 64c + l's fifth bit; bit 2c + 1: value 64c + 32 + l's
    uint8_t qh[32] = {};
    for (int c = 0; c < 4; ++c) {
      for (int l = 0; l < 32; ++l) {
        qh[l] |= static_cast<uint8_t>(((q[64 * c + l] >> 4) & 1) << (2 * c));
        qh[l] |= static_cast<uint8_t>(((q[64 * c + 32 + l] >> 4) & 1) << (2 * c + 1));
      }
    }
    out.append(reinterpret_cast<const char*>(qh), 32);
  }
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      out.push_back(static_cast<char>((q[64 * c + l] & 0xF) | ((q[64 * c + 32 + l] & 0xF) << 4)));
    }
  }
  return out;
}

// One Q6_K super-block: 16 sub-blocks of 16 with int8 scales against d; values in [-32, 31].
std::string QuantizeQ6K(const float* x) {
  float scale[16];
  for (int j = 0; j < 16; ++j) {
    float amax = 0;
    for (int l = 0; l < 16; ++l) amax = std::max(amax, std::fabs(x[16 * j + l]));
    scale[j] = amax / 31;
  }
  const float d = *std::max_element(scale, scale + 16) / 127;
  const float dr = F16ToF32(F32ToF16(d));
  int8_t sc[16];
  for (int j = 0; j < 16; ++j) {
    sc[j] = static_cast<int8_t>(dr > 0 ? std::min(127L, std::lround(scale[j] / dr)) : 0);
  }
  int q[256];
  for (int i = 0; i < 256; ++i) {
    const float step = dr * sc[i / 16];
    q[i] = (step > 0 ? std::clamp(static_cast<int>(std::lround(x[i] / step)), -32, 31) : 0) + 32;
  }
  uint8_t ql[128], qh[64];
  for (int half = 0; half < 2; ++half) {
    const int* v = q + 128 * half;
    for (int l = 0; l < 32; ++l) {
      ql[64 * half + l] = static_cast<uint8_t>((v[l] & 0xF) | ((v[l + 64] & 0xF) << 4));
      ql[64 * half + 32 + l] = static_cast<uint8_t>((v[l + 32] & 0xF) | ((v[l + 96] & 0xF) << 4));
      qh[32 * half + l] = static_cast<uint8_t>((v[l] >> 4) | ((v[l + 32] >> 4) << 2) |
                                               ((v[l + 64] >> 4) << 4) | ((v[l + 96] >> 4) << 6));
    }
  }
  std::string out(reinterpret_cast<const char*>(ql), 128);
  out.append(reinterpret_cast<const char*>(qh), 64);
  out.append(reinterpret_cast<const char*>(sc), 16);
  PutHalf(out, d);
  return out;
}

}  // namespace

std::string QuantizeRow(DType type, const float* x, int64_t n) {
  std::string out;
  if (type == DType::kF8_128) {  // scale max|x| / 448 (E4M3's largest), values rounded to E4M3
    for (int64_t b = 0; b < n; b += 128) {
      float amax = 0;
      for (int j = 0; j < 128; ++j) amax = std::max(amax, std::fabs(x[b + j]));
      const float scale = amax > 0 ? amax / 448 : 1;
      out.append(reinterpret_cast<const char*>(&scale), 4);
      for (int j = 0; j < 128; ++j) out.push_back(static_cast<char>(F32ToF8E4M3(x[b + j] / scale)));
    }
    return out;
  }
  if (DTypeBlock(type) == 256) {
    for (int64_t b = 0; b < n; b += 256) {
      out += type == DType::kQ6_K ? QuantizeQ6K(x + b)
                                  : QuantizeK45(x + b, type == DType::kQ5_K ? 5 : 4);
    }
    return out;
  }
  for (int64_t b = 0; b < n; b += 32) {
    const float* v = x + b;
    if (type == DType::kQ8_0) {
      float amax = 0;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float d = amax / 127, id = d != 0 ? 1 / d : 0;
      PutHalf(out, d);
      for (int j = 0; j < 32; ++j) out.push_back(static_cast<char>(std::lround(v[j] * id)));
    } else if (type == DType::kQ4_0) {
      float amax = 0, max = 0;
      for (int j = 0; j < 32; ++j) {
        if (amax < std::fabs(v[j])) {
          amax = std::fabs(v[j]);
          max = v[j];
        }
      }
      const float d = max / -8, id = d != 0 ? 1 / d : 0;
      PutHalf(out, d);
      for (int j = 0; j < 16; ++j) {
        const int lo = std::min(15, static_cast<int>(static_cast<int8_t>(v[j] * id + 8.5f)));
        const int hi = std::min(15, static_cast<int>(static_cast<int8_t>(v[j + 16] * id + 8.5f)));
        out.push_back(static_cast<char>(lo | (hi << 4)));
      }
    } else {  // Q4_1
      float lo_v = FLT_MAX, hi_v = -FLT_MAX;
      for (int j = 0; j < 32; ++j) {
        lo_v = std::min(lo_v, v[j]);
        hi_v = std::max(hi_v, v[j]);
      }
      const float d = (hi_v - lo_v) / 15, id = d != 0 ? 1 / d : 0;
      PutHalf(out, d);
      PutHalf(out, lo_v);
      for (int j = 0; j < 16; ++j) {
        const int lo =
            std::min(15, static_cast<int>(static_cast<int8_t>((v[j] - lo_v) * id + 0.5f)));
        const int hi =
            std::min(15, static_cast<int>(static_cast<int8_t>((v[j + 16] - lo_v) * id + 0.5f)));
        out.push_back(static_cast<char>(lo | (hi << 4)));
      }
    }
  }
  return out;
}

}  // namespace shardserve
