// Bi-level (dual-tier) sum-preserving advantage reshaping (method.md section 6).
//
// Per rollout, over its reasoning span R (|R| = L), with normalized scores s_hat in [0, 1]:
//   tau = quantile_q(s_hat)                        (numpy "linear" definition)
//   s < tau : w = max(s / (tau + eps), floor)      suppress tier   (boost-only: w = 1)
//   s >= tau: w = 1 + beta (s - tau) / (1 - tau + eps)   boost tier (suppress-only: w = 1)
//   w <- w * L / sum_R w                            mass preservation
// eps = ReshapeOptions::kEps guards tau -> 0 and tau -> 1. The sum is never 0: the largest score is >= tau
// (a quantile never exceeds the maximum), so at least one weight is >= 1.
// Cost per row: a few vectorized passes over T (normalization, tiers, scaling) and a radix selection for the
// quantile (one histogram pass over the row, then a selection among the entries of one bin).
#include "oar/core/reshape.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <vector>

#include "oar/core/importance.h"
#include "vec_math.h"

namespace oar::core {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw InvalidArgument(msg); }

}  // namespace

void check_reshape_options(const ReshapeOptions& opts) {
  std::ostringstream os;
  if (!(opts.q > 0.0 && opts.q < 1.0)) {
    os << "q must be in (0, 1), got " << opts.q;
    fail(os.str());
  }
  if (!(opts.beta >= 0.0 && std::isfinite(opts.beta))) {
    os << "beta must be finite and >= 0, got " << opts.beta;
    fail(os.str());
  }
  if (!(opts.floor >= 0.0 && opts.floor < 1.0)) {
    os << "floor must be in [0, 1), got " << opts.floor;
    fail(os.str());
  }
  if (opts.tiers != Tiers::kBoth && opts.tiers != Tiers::kBoostOnly && opts.tiers != Tiers::kSuppressOnly) {
    os << "tiers: unknown enum value " << static_cast<int>(opts.tiers);
    fail(os.str());
  }
}

double quantile_linear(float* values, int64_t n, double q) {
  if (n < 1) fail("quantile_linear needs n >= 1 values, got n = " + std::to_string(n));
  if (!(q >= 0.0 && q <= 1.0)) {
    std::ostringstream os;
    os << "q must be in [0, 1], got " << q;
    fail(os.str());
  }
  // numpy "linear": virtual index h = (n - 1) q between order statistics x_(lo) and x_(lo+1).
  const double h = static_cast<double>(n - 1) * q;
  const int64_t lo = std::min<int64_t>(static_cast<int64_t>(std::floor(h)), n - 1);
  const double frac = h - static_cast<double>(lo);
  std::nth_element(values, values + lo, values + n);
  const double a = static_cast<double>(values[lo]);
  if (frac <= 0.0 || lo + 1 >= n) return a;
  // After nth_element every element right of lo is >= values[lo]; the next order statistic is their min.
  const double b = static_cast<double>(*std::min_element(values + lo + 1, values + n));
  return a + frac * (b - a);
}

namespace {

// Order-preserving key of a value in [0, 1]: its bits without the sign (so -0.0 and +0.0 are both 0).
inline uint32_t unit_key(float v) {
  uint32_t k;
  std::memcpy(&k, &v, sizeof(k));
  return k & 0x7FFFFFFFu;
}

// Bin of the histogram `hist` (of `nbins`) holding the k-th smallest counted entry; k becomes the rank
// within that bin.
int64_t select_bin(const uint32_t* hist, int64_t nbins, int64_t* k) {
  int64_t cum = 0;
  for (int64_t d = 0; d < nbins; ++d) {
    if (cum + hist[d] > *k) {
      *k -= cum;
      return d;
    }
    cum += hist[d];
  }
  fail("masked_quantile_unit: rank beyond the counted entries (internal error)");
}

// masked_quantile_unit with the count n >= 1 of masked entries already known (the reshaping has it).
double masked_quantile_unit_counted(const float* values, const uint8_t* m, int64_t len, int64_t n, double q,
                                    float* scratch) {
  const double h = static_cast<double>(n - 1) * q;
  const int64_t lo = std::min<int64_t>(static_cast<int64_t>(std::floor(h)), n - 1);
  const double frac = h - static_cast<double>(lo);

  // Top digit: key bits 30..20 (sign cleared): exponent and 3 mantissa bits; [0, 1] uses bins 0..1016
  // (1.0f is 0x3F800000). The clamp keeps out-of-contract values (> 1, NaN) inside the table.
  // Two interleaved histograms halve the store-to-load chains when neighbours fall into one bin.
  constexpr int kTopShift = 20;
  constexpr int64_t kTopBins = 1024;
  auto top_digit = [](float v) { return std::min<uint32_t>(unit_key(v) >> kTopShift, kTopBins - 1); };
  std::array<uint32_t, 2 * kTopBins> hist2{};
  int64_t t = 0;
  for (; t + 1 < len; t += 2) {
    hist2[top_digit(values[t])] += m[t];
    hist2[kTopBins + top_digit(values[t + 1])] += m[t + 1];
  }
  if (t < len) hist2[top_digit(values[t])] += m[t];
  for (int64_t d = 0; d < kTopBins; ++d) hist2[d] += hist2[kTopBins + d];
  int64_t k = lo;
  const uint32_t top = static_cast<uint32_t>(select_bin(hist2.data(), kTopBins, &k));
  // Candidates: the masked entries of that bin (branch-free compaction: always write, advance on a match).
  int64_t c = 0;
  for (t = 0; t < len; ++t) {
    scratch[c] = values[t];
    c += m[t] & static_cast<uint8_t>(top_digit(values[t]) == top);
  }
  // Refine on the lower bits while the bin is large (e.g. scores clustered in a narrow range).
  int shift = kTopShift;
  std::array<uint32_t, 4096> hist;  // cleared per pass, as far as the digit reaches
  while (c > 512 && shift > 0) {
    const int width = std::min(12, shift);
    shift -= width;
    const uint32_t digit_mask = (1u << width) - 1u;
    std::fill(hist.begin(), hist.begin() + (int64_t{1} << width), 0u);
    for (int64_t i = 0; i < c; ++i) ++hist[(unit_key(scratch[i]) >> shift) & digit_mask];
    const uint32_t d = static_cast<uint32_t>(select_bin(hist.data(), int64_t{1} << width, &k));
    int64_t c2 = 0;
    for (int64_t i = 0; i < c; ++i) {
      scratch[c2] = scratch[i];
      c2 += static_cast<int64_t>(((unit_key(scratch[i]) >> shift) & digit_mask) == d);
    }
    c = c2;
  }
  std::nth_element(scratch, scratch + k, scratch + c);
  const float a = scratch[k];
  if (frac <= 0.0 || lo + 1 >= n) return static_cast<double>(a);
  float b;
  if (k + 1 < c) {
    b = *std::min_element(scratch + k + 1, scratch + c);
  } else {
    // a is the largest candidate: the next order statistic is the smallest masked value above it.
    const uint32_t ka = unit_key(a);
    b = std::numeric_limits<float>::infinity();
    for (t = 0; t < len; ++t) {
      const float v = values[t];
      b = (m[t] != 0 && unit_key(v) > ka && v < b) ? v : b;
    }
  }
  return static_cast<double>(a) + frac * (static_cast<double>(b) - static_cast<double>(a));
}

// Tier weights (method.md section 6) of one row in place: on entry w holds s_hat on rm (in [0, 1]), on
// exit the tier weights there and 1 / 0 elsewhere by pm. L = count of rm. Returns the mass-preservation
// scale L / sum_rm w (1 when L = 0); throws when a huge beta overflows the float32 weights.
double tier_weights_in_place(float* w, const bool* rm, const bool* pm, int64_t len, int64_t L,
                             const ReshapeOptions& opts, float* scratch) {
  const double tau =
      L > 0 ? masked_quantile_unit_counted(w, reinterpret_cast<const uint8_t*>(rm), len, L, opts.q, scratch) : 0.0;
  // One-tier variants: the suppress tier becomes max(s / inf, 1) = 1, the boost tier 1 + 0 = 1.
  const bool suppress = opts.tiers != Tiers::kBoostOnly, boost = opts.tiers != Tiers::kSuppressOnly;
  const double sum = detail::vtier_weights_masked(
      w, rm, pm, len, tau, suppress ? tau + ReshapeOptions::kEps : std::numeric_limits<double>::infinity(),
      1.0 - tau + ReshapeOptions::kEps, boost ? opts.beta : 0.0, suppress ? opts.floor : 1.0, w);
  // A huge beta (~1e38 and beyond) overflows the float32 boost weights; the rescaling would then turn them
  // into NaN (inf * 0). Refuse rather than return NaN weights.
  if (!std::isfinite(sum)) {
    std::ostringstream os;
    os << "beta = " << opts.beta << " makes the boost weights 1 + beta * (s - tau) / (1 - tau) overflow float32; "
       << "use a smaller beta";
    fail(os.str());
  }
  // The sum is never 0 (the largest score is >= tau, so one weight is >= 1). Scaling the stored floats
  // makes the span sum to L up to one rounding per element; when every weight is 1, scale is exactly 1.
  return L > 0 ? static_cast<double>(L) / sum : 1.0;
}

}  // namespace

double masked_quantile_unit(const float* values, const bool* mask, int64_t len, double q, float* scratch) {
  if (!(q >= 0.0 && q <= 1.0)) {
    std::ostringstream os;
    os << "q must be in [0, 1], got " << q;
    fail(os.str());
  }
  const uint8_t* m = reinterpret_cast<const uint8_t*>(mask);
  int64_t n = 0;
  for (int64_t t = 0; t < len; ++t) n += m[t];
  if (n < 1) fail("masked_quantile_unit needs at least one masked value, got none of len = " + std::to_string(len));
  return masked_quantile_unit_counted(values, m, len, n, q, scratch);
}

void reshape_span_weights(const float* s_hat, int64_t L, const ReshapeOptions& opts, float* w, float* scratch) {
  if (L <= 0) return;
  check_reshape_options(opts);
  // The span is the whole (compacted) row: every entry is on the reasoning span.
  const std::vector<uint8_t> on(static_cast<size_t>(L), 1);
  const bool* all = reinterpret_cast<const bool*>(on.data());
  std::copy(s_hat, s_hat + L, w);
  const double scale = tier_weights_in_place(w, all, all, L, L, opts, scratch);
  for (int64_t t = 0; t < L; ++t) w[t] = static_cast<float>(static_cast<double>(w[t]) * scale);
}

template <typename T>
void reshape_advantages(const float* advantages, const T* scores, const bool* reasoning_mask,
                        const bool* response_mask, int64_t B, int64_t T_len, const ReshapeOptions& opts,
                        bool scores_are_normalized, float* token_advantages, float* weights) {
  reshape_advantages(advantages, scores, reasoning_mask, response_mask, B, T_len, opts, scores_are_normalized,
                     token_advantages, weights, RowRange{0, B});
}

template <typename T>
void reshape_advantages(const float* advantages, const T* scores, const bool* reasoning_mask,
                        const bool* response_mask, int64_t B, int64_t T_len, const ReshapeOptions& opts,
                        bool scores_are_normalized, float* token_advantages, float* weights, RowRange rows) {
  check_reshape_options(opts);
  if (B < 0 || T_len < 0) {
    std::ostringstream os;
    os << "scores must be (B, T) with B, T >= 0, got (" << B << ", " << T_len << ")";
    fail(os.str());
  }
  if (rows.begin < 0 || rows.end > B || rows.begin > rows.end) {
    std::ostringstream os;
    os << "rows must be a range within [0, B=" << B << "], got [" << rows.begin << ", " << rows.end << ")";
    fail(os.str());
  }
  if (T_len == 0) {
    for (int64_t b = rows.begin; b < rows.end; ++b) {
      if (!std::isfinite(advantages[b])) {
        std::ostringstream os;
        os << "advantages must be finite, got advantages[" << b << "] = " << advantages[b];
        fail(os.str());
      }
    }
    return;
  }

  // Per row, in place in the row of `weights` (or a row-sized buffer): check, normalize (s_hat on the span,
  // 0 elsewhere), quantile, tier weights, mass preservation, advantages. Every pass but the quantile's
  // histogram is a vectorized loop over the whole row; the span is never compacted.
  const size_t row_len = static_cast<size_t>(T_len);
  std::vector<float> own(weights == nullptr ? row_len : 0);
  std::vector<float> scratch(row_len);
  for (int64_t b = rows.begin; b < rows.end; ++b) {
    if (!std::isfinite(advantages[b])) {
      std::ostringstream os;
      os << "advantages must be finite, got advantages[" << b << "] = " << advantages[b];
      fail(os.str());
    }
    const bool* rm = reasoning_mask + b * T_len;
    const bool* pm = response_mask + b * T_len;
    const uint8_t* rm8 = reinterpret_cast<const uint8_t*>(rm);
    const uint8_t* pm8 = reinterpret_cast<const uint8_t*>(pm);
    uint8_t not_subset = 0;  // branch-free scan; the slow loop below only runs to name the column
    int64_t L = 0;
    for (int64_t t = 0; t < T_len; ++t) {
      not_subset |= rm8[t] & (pm8[t] ^ 1u);
      L += rm8[t];
    }
    for (int64_t t = 0; not_subset != 0 && t < T_len; ++t) {
      if (rm[t] && !pm[t]) {
        std::ostringstream os;
        os << "reasoning_mask must be a subset of response_mask, got reasoning_mask[" << b << ", " << t
           << "] = True where response_mask is False";
        fail(os.str());
      }
    }
    float* w = weights != nullptr ? weights + b * T_len : own.data();
    if (!scores_are_normalized) {
      normalize_importance_row(scores + b * T_len, rm, T_len, w, b);
    } else {
      const T* row = scores + b * T_len;
      uint8_t bad = 0;
      for (int64_t t = 0; t < T_len; ++t) {
        const T v = row[t];
        bad |= rm8[t] & static_cast<uint8_t>(!(v >= T(0) && v <= T(1)));
        w[t] = rm8[t] != 0 ? static_cast<float>(v) : 0.0f;
      }
      for (int64_t t = 0; bad != 0 && t < T_len; ++t) {
        const double v = static_cast<double>(row[t]);
        if (rm[t] && !(v >= 0.0 && v <= 1.0)) {
          std::ostringstream os;
          os << "scores must lie in [0, 1] on reasoning_mask when scores_are_normalized=True, got scores[" << b
             << ", " << t << "] = " << v;
          fail(os.str());
        }
      }
    }
    const float a = advantages[b];
    float* ta = token_advantages + b * T_len;
    const double scale = tier_weights_in_place(w, rm, pm, T_len, L, opts, scratch.data());
    if (detail::vscale_advantages_masked(w, rm, scale, a, ta, T_len)) {
      // A finite weight times a finite advantage can still overflow (|A| near FLT_MAX, weight > 1).
      for (int64_t t = 0; t < T_len; ++t) {
        if (!std::isfinite(ta[t])) {
          std::ostringstream os;
          os << "advantages: advantages[" << b << "] = " << a << " times its weight " << w[t] << " at column "
             << t << " overflows float32; rescale the advantages";
          fail(os.str());
        }
      }
    }
  }
}

template void reshape_advantages<float>(const float*, const float*, const bool*, const bool*, int64_t, int64_t,
                                        const ReshapeOptions&, bool, float*, float*);
template void reshape_advantages<double>(const float*, const double*, const bool*, const bool*, int64_t, int64_t,
                                         const ReshapeOptions&, bool, float*, float*);
template void reshape_advantages<float>(const float*, const float*, const bool*, const bool*, int64_t, int64_t,
                                        const ReshapeOptions&, bool, float*, float*, RowRange);
template void reshape_advantages<double>(const float*, const double*, const bool*, const bool*, int64_t, int64_t,
                                         const ReshapeOptions&, bool, float*, float*, RowRange);

}  // namespace oar::core
