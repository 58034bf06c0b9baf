// Internal (not installed): the float32 loops on the hot path of the CPU probe divergence (and reshaping),
// compiled once per ISA level (AVX-512F, AVX2, baseline) and picked at load time, so that a build for the
// generic x86-64 baseline still runs at the width of the machine it lands on. The level is public API
// (oar/core/cpu_isa.h: cpu_isa(), set_cpu_isa(), the OAR_CPU_ISA environment variable); the bodies are in
// vec_math_kernels.inc, the per-level copies and the dispatch in vec_math.cpp.
//
// Why not Eigen here: Eigen's packet math is chosen at compile time, and compiling Eigen code for several
// ISAs in one library would instantiate the same inline templates with different instruction sets (an ODR
// hazard: the linker keeps one of them). These loops are plain C++ that GCC/Clang auto-vectorize; only
// this translation unit is built with -fopenmp-simd (for the `omp simd` reductions, no OpenMP runtime) and
// -fno-trapping-math (if-conversion of float64 selects; results are unchanged).
//
// Accuracy: vexp_* use a Cephes-style exp (range reduction by ln 2, degree-5 polynomial): max relative
// error ~2 ulp for arguments in [-87.3, 88]; arguments below -87.3 (including -inf) give ~1.2e-38 instead
// of 0, which is negligible in a sum whose largest term is 1 (softmax shifted by its max). NaN propagates.
// Sums are accumulated in float32 across SIMD lanes (pairwise across lanes, sequential within a lane), so
// they differ between levels by float32 rounding (the relative error of a sum of n terms of one sign is at
// most ~n * 2^-24 on every level). Every loop throws InvalidArgument when OAR_CPU_ISA named a level this
// machine cannot run (see cpu_isa.h).
#pragma once

#include <cstdint>

namespace oar::core::detail {

/// max_i z[i] for i < len (len >= 1); -inf when every entry is -inf. NaN entries may be ignored.
float vmax(const float* z, int64_t len);

/// e[i] = exp(z[i] - m) for i < len; returns sum_i e[i]. e may alias z.
float vexp_shifted_sum(const float* z, float m, float* e, int64_t len);

/// out[i] = exp(z[i] - shift) * scale for i < len. out may alias z.
void vexp_shifted_scaled(const float* z, float shift, float scale, float* out, int64_t len);

/// sum_i a[i] * b[i] for i < len.
float vdot(const float* a, const float* b, int64_t len);

/// sum_i e[i] * d[i] with d[i] = zc[i] - zp[i], or 0 where zc[i] is -inf (a zero-probability clean entry
/// contributes nothing, even when zp[i] is -inf too: no -inf - -inf = NaN).
float vdot_diff(const float* e, const float* zc, const float* zp, int64_t len);

/// out[i] = log1p(x[i]) for x[i] >= 0 (Cephes-style log of u = 1 + x with the (x - (u - 1)) / u correction:
/// ~2 ulp). Negative or NaN x give NaN or garbage: callers select such entries away. out may alias x.
void vlog1p(const float* x, float* out, int64_t len);

/// Over entries with mask[i]: *lo = min, *hi = max (+inf / -inf when none); returns true when one of them
/// is NaN, negative or +inf (the caller then finds and names it).
bool vmasked_minmax(const float* x, const bool* mask, int64_t len, float* lo, float* hi);

/// out[i] = mask[i] ? clamp(out[i] / den, 0, 1) : 0.
void vdivide_clamp_masked(float* out, const bool* mask, float den, int64_t len);

/// out[i] = (x[i] - shift) * scale.
void vshift_scale(const float* x, float shift, float scale, float* out, int64_t len);

/// Tier weights of one row before mass preservation (method.md section 6), for the reshaping:
///   w[i] = rm[i] ? float(tier(s[i])) : (pm[i] ? 1 : 0),
///   tier(s) = s < tau ? max(s / lo_den, floor) : 1 + beta (s - tau) / hi_den,
/// computed in float64 and stored as float32 (lo_den = +inf with floor = 1 gives the weight 1 below tau,
/// beta = 0 the weight 1 above it: the one-tier variants). Returns the float64 sum of the stored w over rm
/// (lanes summed pairwise: the order differs from a sequential loop by float64 rounding only). s may alias w.
double vtier_weights_masked(const float* s, const bool* rm, const bool* pm, int64_t len, double tau, double lo_den,
                            double hi_den, double beta, double floor, float* w);

/// Mass preservation and advantages of one row: w[i] = rm[i] ? float(double(w[i]) * scale) : w[i], then
/// ta[i] = w[i] * a. Returns true when some ta[i] is not finite (the caller finds and names it).
bool vscale_advantages_masked(float* w, const bool* rm, double scale, float a, float* ta, int64_t len);

/// dst[i] = float(src[i]) (bits of IEEE binary16 / bfloat16; exact) or dst[i] += ... for the *_add forms.
void vload_f32(const float* src, float* dst, int64_t len);
void vadd_f32(const float* src, float* dst, int64_t len);
void vload_bf16(const uint16_t* src, float* dst, int64_t len);
void vadd_bf16(const uint16_t* src, float* dst, int64_t len);
void vload_f16(const uint16_t* src, float* dst, int64_t len);
void vadd_f16(const uint16_t* src, float* dst, int64_t len);

/// Name of the ISA level the loops run at now ("avx512f", "avx2" or "baseline"; oar::core::cpu_isa()), for
/// logs and benchmark headers.
const char* vec_math_isa();

}  // namespace oar::core::detail
