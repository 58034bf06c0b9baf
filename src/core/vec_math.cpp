// See vec_math.h. Every exported loop is a GCC/Clang `target_clones` function on x86-64 ELF platforms:
// the compiler emits an AVX-512, an AVX2 and a baseline body and an ifunc resolver that picks one when the
// library is loaded. Elsewhere (other architectures, other compilers) the baseline body is all there is.
#include "vec_math.h"

#include "widen.h"

#include <cstring>

#if defined(__x86_64__) && defined(__ELF__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(OAR_NO_TARGET_CLONES)
#define OAR_MULTI_ISA __attribute__((target_clones("avx512f", "avx2", "default")))
#define OAR_HAS_MULTI_ISA 1
#else
#define OAR_MULTI_ISA
#define OAR_HAS_MULTI_ISA 0
#endif

namespace oar::core::detail {
namespace {

// exp(x) for one float, branch-free so that loops over it vectorize (Cephes expf: x = n ln2 + r,
// |r| <= ln2 / 2, exp(r) by a degree-5 minimax polynomial, 2^n by building the exponent bits).
inline float exp_poly(float x) {
  constexpr float kLo = -87.3365447505f;  // 2^-126: the smallest normal scale
  constexpr float kHi = 88.0f;            // n <= 127
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  x = x < kLo ? kLo : x;                 // NaN stays NaN (the comparison is false)
  x = x > kHi ? kHi : x;
  const float t = x * kLog2e + kRound;
  const float n = t - kRound;
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t ni = static_cast<int32_t>(n);
  const uint32_t bits = static_cast<uint32_t>(ni + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

}  // namespace

OAR_MULTI_ISA float vmax(const float* z, int64_t len) {
  float m = z[0];
#pragma omp simd reduction(max : m)
  for (int64_t i = 1; i < len; ++i) m = z[i] > m ? z[i] : m;
  return m;
}

OAR_MULTI_ISA float vexp_shifted_sum(const float* z, float m, float* e, int64_t len) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < len; ++i) {
    const float v = exp_poly(z[i] - m);
    e[i] = v;
    s += v;
  }
  return s;
}

OAR_MULTI_ISA void vexp_shifted_scaled(const float* z, float shift, float scale, float* out, int64_t len) {
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) out[i] = exp_poly(z[i] - shift) * scale;
}

OAR_MULTI_ISA float vdot(const float* a, const float* b, int64_t len) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < len; ++i) s += a[i] * b[i];
  return s;
}

OAR_MULTI_ISA float vdot_diff(const float* e, const float* zc, const float* zp, int64_t len) {
  constexpr uint32_t kNegInfBits = 0xff800000u;
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < len; ++i) {
    // The -inf test is an integer compare of the bit pattern and the select a bitwise AND (vectorizable
    // without relaxing floating-point semantics).
    const float diff = zc[i] - zp[i];
    uint32_t zbits, dbits;
    std::memcpy(&zbits, &zc[i], sizeof zbits);
    std::memcpy(&dbits, &diff, sizeof dbits);
    dbits &= zbits == kNegInfBits ? 0u : ~0u;
    float d;
    std::memcpy(&d, &dbits, sizeof d);
    s += e[i] * d;
  }
  return s;
}

void vload_f32(const float* src, float* dst, int64_t len) {
  std::memcpy(dst, src, static_cast<size_t>(len) * sizeof(float));
}

OAR_MULTI_ISA void vadd_f32(const float* src, float* dst, int64_t len) {
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) dst[i] += src[i];
}

OAR_MULTI_ISA void vload_bf16(const uint16_t* src, float* dst, int64_t len) {
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) dst[i] = bf16_bits_to_float(src[i]);
}

OAR_MULTI_ISA void vadd_bf16(const uint16_t* src, float* dst, int64_t len) {
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) dst[i] += bf16_bits_to_float(src[i]);
}

OAR_MULTI_ISA void vload_f16(const uint16_t* src, float* dst, int64_t len) {
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) dst[i] = half_bits_to_float(src[i]);
}

OAR_MULTI_ISA void vadd_f16(const uint16_t* src, float* dst, int64_t len) {
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) dst[i] += half_bits_to_float(src[i]);
}

const char* vec_math_isa() {
#if OAR_HAS_MULTI_ISA
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return "avx512f";
  if (__builtin_cpu_supports("avx2")) return "avx2";
#endif
  return "baseline";
}

}  // namespace oar::core::detail
