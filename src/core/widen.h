// Internal (not installed): widening loads of float32 / float16 / bfloat16 buffers into float32, written
// as branch-free bit manipulation so that GCC vectorizes them at the baseline ISA (SSE2). Eigen's scalar
// Eigen::half / Eigen::bfloat16 conversions are exact but block vectorization without F16C.
#pragma once

#include <Eigen/Core>

#include <cstdint>
#include <cstring>

namespace oar::core::detail {

/// bfloat16 bits -> float: the bfloat16 is the top half of the float32 (exact, NaN and inf preserved).
inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// IEEE binary16 bits -> float, exact for every pattern (normals, subnormals, +-0, +-inf, NaN payloads).
/// The 15 exponent+mantissa bits are placed in float position, which reads as the right value scaled by
/// 2^-112 (exponent biases 127 vs 15; half subnormals land on float subnormals with the same scaling),
/// so one exact multiply by 2^112 fixes normals and subnormals alike. Exponent 31 (inf/NaN) is then
/// forced to the float all-ones exponent, and the sign is OR-ed back.
inline float half_bits_to_float(uint16_t h) {
  const uint32_t em = static_cast<uint32_t>(h & 0x7fffu) << 13;
  float f;
  std::memcpy(&f, &em, sizeof f);
  f *= 0x1.0p112f;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits |= (h & 0x7c00u) == 0x7c00u ? 0x7f800000u : 0u;
  bits |= static_cast<uint32_t>(h & 0x8000u) << 16;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float widen(float x) { return x; }
inline float widen(double x) { return static_cast<float>(x); }
inline float widen(Eigen::half x) { return half_bits_to_float(x.x); }
inline float widen(Eigen::bfloat16 x) { return bf16_bits_to_float(x.value); }

/// dst[i] = float(src[i]) for i < len.
template <typename T>
inline void widen_load(const T* src, float* dst, int64_t len) {
  for (int64_t i = 0; i < len; ++i) dst[i] = widen(src[i]);
}

/// dst[i] += float(src[i]) for i < len.
template <typename T>
inline void widen_add(const T* src, float* dst, int64_t len) {
  for (int64_t i = 0; i < len; ++i) dst[i] += widen(src[i]);
}

}  // namespace oar::core::detail
