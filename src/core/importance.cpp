// Importance normalization per rollout (method.md section 5):
//   s_t = log1p(I_t),  s_hat_t = (s_t - min_R s) / (max_R s - min_R s)   (denominator 1 when max == min).
//
// log1p is monotone, so min_R s = log1p(min_R I) and max_R s = log1p(max_R I): one pass finds the raw
// extremes (and validates), a second pass evaluates log1p once per element. Work is O(T) per row.
#include "oar/core/importance.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <sstream>

#include "oar/core/common.h"
#include "vec_math.h"

namespace oar::core {
namespace {

template <typename T>
[[noreturn]] void bad_score(const char* arg, int64_t b, int64_t t, T v) {
  std::ostringstream os;
  os << arg << " must be finite and >= 0 on the masked (reasoning) positions, got " << arg << "[" << b << ", " << t
     << "] = " << static_cast<double>(v);
  throw InvalidArgument(os.str());
}

// Names the first masked score of row b that is NaN, negative or +-inf (the caller found one).
template <typename T>
[[noreturn]] void throw_first_bad_score(const T* s, const bool* m, int64_t T_len, int64_t b) {
  for (int64_t t = 0; t < T_len; ++t) {
    const double v = static_cast<double>(s[t]);
    if (m[t] && (!(v >= 0.0) || std::isinf(v))) bad_score("scores", b, t, s[t]);  // `!(v >= 0)`: also NaN
  }
  throw InvalidArgument("scores: internal error: a bad score was detected but not found");
}

// A row with an empty mask is all zero.
inline void empty_row(float* o, int64_t T_len) { std::fill(o, o + T_len, 0.0f); }

}  // namespace

template <typename T>
void check_scores(const T* scores, const bool* mask, int64_t B, int64_t T_len, const char* arg) {
  if (B < 0 || T_len < 0) {
    std::ostringstream os;
    os << arg << " must be (B, T) with B, T >= 0, got (" << B << ", " << T_len << ")";
    throw InvalidArgument(os.str());
  }
  for (int64_t b = 0; b < B; ++b) {
    const T* s = scores + b * T_len;
    const bool* m = mask + b * T_len;
    for (int64_t t = 0; t < T_len; ++t) {
      if (!m[t]) continue;
      const double v = static_cast<double>(s[t]);
      // `!(v >= 0)` also catches NaN.
      if (!(v >= 0.0) || std::isinf(v)) bad_score(arg, b, t, s[t]);
    }
  }
}

template <typename T>
void normalize_importance(const T* scores, const bool* mask, int64_t B, int64_t T_len, float* out) {
  normalize_importance(scores, mask, B, T_len, out, RowRange{0, B});
}

template <typename T>
void normalize_importance(const T* scores, const bool* mask, int64_t B, int64_t T_len, float* out, RowRange rows) {
  if (B < 0 || T_len < 0) {
    std::ostringstream os;
    os << "scores must be (B, T) with B, T >= 0, got (" << B << ", " << T_len << ")";
    throw InvalidArgument(os.str());
  }
  if (rows.begin < 0 || rows.end > B || rows.begin > rows.end) {
    std::ostringstream os;
    os << "rows must be a range within [0, B=" << B << "], got [" << rows.begin << ", " << rows.end << ")";
    throw InvalidArgument(os.str());
  }
  for (int64_t b = rows.begin; b < rows.end; ++b)
    normalize_importance_row(scores + b * T_len, mask + b * T_len, T_len, out + b * T_len, b);
}

template <typename T>
void normalize_importance_row(const T* s, const bool* m, int64_t T_len, float* o, int64_t b) {
  {
    if constexpr (std::is_same_v<T, float>) {
      // float32 scores: every pass is a vectorized loop of vec_math.h. log1p(s) - log1p(lo) is computed as
      // log1p((s - lo) / (1 + lo)): the argument is the difference itself, so there is no cancellation (a
      // float64 log1p would be needed for the difference of logarithms when the range is narrow); the
      // relative error of s_hat is a few float32 ulps. The row of `o` holds the arguments, then the
      // logarithms; entries off the mask may hold anything there and are set to 0 at the end. s = hi gives
      // exactly 1, s = lo exactly 0.
      float flo = 0.0f, fhi = 0.0f;
      if (detail::vmasked_minmax(s, m, T_len, &flo, &fhi)) throw_first_bad_score(s, m, T_len, b);
      if (flo > fhi) return empty_row(o, T_len);
      const float inv = static_cast<float>(1.0 / (1.0 + static_cast<double>(flo)));
      detail::vshift_scale(s, flo, inv, o, T_len);
      detail::vlog1p(o, o, T_len);
      const float x_hi = (fhi - flo) * inv;
      float range = 0.0f;
      detail::vlog1p(&x_hi, &range, 1);
      detail::vdivide_clamp_masked(o, m, range > 0.0f ? range : 1.0f, T_len);  // max == min: every d is 0
      return;
    }
    // Branch-free check and min/max over the mask (vectorizable; masks are irregular, branches mispredict):
    // off-mask entries are replaced by neutral values. `!(v >= 0)` also catches NaN.
    bool bad = false;
    double lo = std::numeric_limits<double>::infinity(), hi = -std::numeric_limits<double>::infinity();
    for (int64_t t = 0; t < T_len; ++t) {
      const double v = static_cast<double>(s[t]);
      bad |= m[t] & (!(v >= 0.0) | (v == std::numeric_limits<double>::infinity()));
      lo = std::min(lo, m[t] ? v : std::numeric_limits<double>::infinity());
      hi = std::max(hi, m[t] ? v : -std::numeric_limits<double>::infinity());
    }
    if (bad) throw_first_bad_score(s, m, T_len, b);
    if (lo > hi) return empty_row(o, T_len);
    const double s_lo = std::log1p(lo);
    const double range = std::log1p(hi) - s_lo;
    // max == min: every s_t - min is exactly 0, so any denominator works; 1 is the documented choice.
    // A subnormal range (float64 scores below ~1e-308) has no finite reciprocal: divide instead, or
    // 0 * inf would give NaN.
    const double inv = range > 0.0 ? 1.0 / range : 1.0;
    const bool divide = !std::isfinite(inv);
    for (int64_t t = 0; t < T_len; ++t) {
      if (!m[t]) {
        o[t] = 0.0f;
        continue;
      }
      const double d = std::log1p(static_cast<double>(s[t])) - s_lo;
      double v = divide ? d / range : d * inv;
      // Multiplying by the reciprocal may land one ulp outside [0, 1]; the reshaping relies on the range.
      v = v < 0.0 ? 0.0 : (v > 1.0 ? 1.0 : v);
      o[t] = static_cast<float>(v);
    }
  }
}

template void check_scores<float>(const float*, const bool*, int64_t, int64_t, const char*);
template void check_scores<double>(const double*, const bool*, int64_t, int64_t, const char*);
template void normalize_importance<float>(const float*, const bool*, int64_t, int64_t, float*);
template void normalize_importance<double>(const double*, const bool*, int64_t, int64_t, float*);
template void normalize_importance<float>(const float*, const bool*, int64_t, int64_t, float*, RowRange);
template void normalize_importance_row<float>(const float*, const bool*, int64_t, float*, int64_t);
template void normalize_importance_row<double>(const double*, const bool*, int64_t, float*, int64_t);
template void normalize_importance<double>(const double*, const bool*, int64_t, int64_t, float*, RowRange);

}  // namespace oar::core
