// See vec_math.h. Every exported loop is a GCC/Clang `target_clones` function on x86-64 ELF platforms:
// the compiler emits an AVX-512, an AVX2 and a baseline body and an ifunc resolver that picks one when the
// library is loaded. Elsewhere (other architectures, other compilers) the baseline body is all there is.
#include "vec_math.h"

#include "widen.h"

#include <algorithm>
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

// log1p(x) for one float x >= 0, branch-free (Cephes logf of u = 1 + x, then the first-order correction
// for the rounding of 1 + x).
inline float log1p_poly(float x) {
  const float u = 1.0f + x;
  uint32_t bits;
  std::memcpy(&bits, &u, sizeof bits);
  int32_t e = static_cast<int32_t>((bits >> 23) & 0xffu) - 126;  // u = m * 2^e, m in [0.5, 1)
  const uint32_t mbits = (bits & 0x007fffffu) | 0x3f000000u;
  float m;
  std::memcpy(&m, &mbits, sizeof m);
  const bool small = m < 0.707106781186547524f;
  e = small ? e - 1 : e;
  m = small ? m + m - 1.0f : m - 1.0f;
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  const float fe = static_cast<float>(e);
  y += -2.12194440e-4f * fe;
  y += -0.5f * z;
  float r = m + y;
  r += 0.693359375f * fe;
  return r + (x - (u - 1.0f)) / u;
}

}  // namespace

OAR_MULTI_ISA void vlog1p(const float* x, float* out, int64_t len) {
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) out[i] = log1p_poly(x[i]);
}

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

// The masks are read as bytes (bool is one byte holding 0 or 1): GCC vectorizes byte compares and blends,
// not loads of `bool`.
OAR_MULTI_ISA bool vmasked_minmax(const float* x, const bool* mask, int64_t len, float* lo, float* hi) {
  constexpr float kInf = __builtin_inff();
  const uint8_t* mk = reinterpret_cast<const uint8_t*>(mask);
  float l = kInf, h = -kInf;
  int bad = 0;
#pragma omp simd reduction(min : l) reduction(max : h) reduction(| : bad)
  for (int64_t i = 0; i < len; ++i) {
    const float v = x[i];
    const bool on = mk[i] != 0;
    const bool ok = (v >= 0.0f) & (v < kInf);  // NaN fails both comparisons
    bad |= (on & !ok) ? 1 : 0;
    const float vl = on ? v : kInf;
    const float vh = on ? v : -kInf;
    l = vl < l ? vl : l;
    h = vh > h ? vh : h;
  }
  *lo = l;
  *hi = h;
  return bad != 0;
}

OAR_MULTI_ISA void vdivide_clamp_masked(float* out, const bool* mask, float den, int64_t len) {
  const uint8_t* mk = reinterpret_cast<const uint8_t*>(mask);
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) {
    float v = out[i] / den;
    v = v < 0.0f ? 0.0f : v;
    v = v > 1.0f ? 1.0f : v;
    out[i] = mk[i] != 0 ? v : 0.0f;
  }
}

OAR_MULTI_ISA void vshift_scale(const float* x, float shift, float scale, float* out, int64_t len) {
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) out[i] = (x[i] - shift) * scale;
}

OAR_MULTI_ISA double vtier_weights_masked(const float* s, const bool* rm, const bool* pm, int64_t len, double tau,
                                         double lo_den, double hi_den, double beta, double floor, float* w) {
  const uint8_t* r = reinterpret_cast<const uint8_t*>(rm);
  const uint8_t* p = reinterpret_cast<const uint8_t*>(pm);
  // Masks enter as 0/1 float factors rather than selects, and the sum runs over the whole row (off the
  // span it adds the integer count of response tokens, subtracted at the end): GCC vectorizes selects and
  // float64 reductions mixed with uint8 loads only with AVX-512. The products are exact (x * 1 = x,
  // x * 0 = 0 for finite x; an infinite x on the span makes the sum non-finite, which the caller reports).
  double sum = 0.0, off = 0.0;
#pragma omp simd reduction(+ : sum, off)
  for (int64_t i = 0; i < len; ++i) {
    const double v = static_cast<double>(s[i]);
    const double q = v / lo_den;
    const double sup = q > floor ? q : floor;
    const double bst = 1.0 + beta * (v - tau) / hi_den;
    const float x = static_cast<float>(v < tau ? sup : bst);
    const float on = static_cast<float>(r[i]);
    const float resp_off = (1.0f - on) * static_cast<float>(p[i]);
    const float out = on * x + resp_off;
    w[i] = out;
    sum += static_cast<double>(out);
    off += static_cast<double>(resp_off);
  }
  return sum - off;  // off is an integer count: exact
}

OAR_MULTI_ISA bool vscale_advantages_masked(float* w, const bool* rm, double scale, float a, float* ta, int64_t len) {
  const uint8_t* r = reinterpret_cast<const uint8_t*>(rm);
  float bad = 0.0f;
#pragma omp simd reduction(+ : bad)
  for (int64_t i = 0; i < len; ++i) {
    const float on = static_cast<float>(r[i]);
    const float scaled = static_cast<float>(static_cast<double>(w[i]) * scale);
    const float wi = on * scaled + (1.0f - on) * w[i];
    const float x = wi * a;
    w[i] = wi;
    ta[i] = x;
    bad += x - x;  // 0 when x is finite, NaN otherwise (and NaN stays NaN)
  }
  return bad != 0.0f;
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
