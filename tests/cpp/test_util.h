// Helpers shared by the GoogleTest files.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "oar/core/common.h"

namespace oar::testing {

// ---- error budgets (docs/design.md, "Test tolerances") ----------------------------------------------------
// A float32 result is compared with a float64 reference under the bound of the computation that produced
// it (its number of rounded operations and the size of the terms), never under a number tuned on one CPU:
// the AVX-512, AVX2 and baseline loops, other compilers and other BLAS round differently but all stay
// within these bounds.

/// Unit roundoff of float32: half an ulp of 1 (|fl(x) - x| <= kU32 |x| for one rounding).
constexpr double kU32 = 0x1p-24;

/// Higham's gamma_k = k u / (1 - k u): relative error bound of k chained roundings (Accuracy and Stability
/// of Numerical Algorithms, 2nd ed., lemma 3.1).
inline double gamma(int64_t k, double u = kU32) { return static_cast<double>(k) * u / (1.0 - k * u); }

/// Worst-case error of a sum of n terms accumulated in precision u in any order (sequential, SIMD lanes,
/// pairwise): gamma_{n-1} * sum_i |x_i| (Higham eq. 4.4; also bounds a dot product's sum of products
/// with gamma_n).
inline double sum_error_bound(int64_t n, double sum_abs, double u = kU32) {
  return n > 1 ? gamma(n - 1, u) * sum_abs : 0.0;
}

/// k ulps of a float32 value of magnitude |want| (an ulp is at most 2 u |want|, and 2^-149 at the bottom).
inline double ulps_f32(double k, double want) {
  return k * std::max(2.0 * kU32 * std::abs(want), 0x1p-149);
}

/// Runs `fn` and returns the oar::core::InvalidArgument message it threw ("" when nothing was thrown).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const oar::core::InvalidArgument& e) {
    return e.what();
  }
  return "";
}

/// Expects `fn` to throw oar::core::InvalidArgument whose message contains `needle`.
template <typename Fn>
void expect_invalid(Fn&& fn, const std::string& needle) {
  const std::string msg = error_of(fn);
  if (msg.empty()) {
    ADD_FAILURE() << "expected InvalidArgument mentioning '" << needle << "'";
    return;
  }
  EXPECT_NE(msg.find(needle), std::string::npos) << "message was: " << msg;
}

}  // namespace oar::testing
