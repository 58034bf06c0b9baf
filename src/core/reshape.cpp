// Bi-level (dual-tier) sum-preserving advantage reshaping (method.md section 6).
//
// Per rollout, over its reasoning span R (|R| = L), with normalized scores s_hat in [0, 1]:
//   tau = quantile_q(s_hat)                        (numpy "linear" definition)
//   s < tau : w = max(s / (tau + eps), floor)      suppress tier   (boost-only: w = 1)
//   s >= tau: w = 1 + beta (s - tau) / (1 - tau + eps)   boost tier (suppress-only: w = 1)
//   w <- w * L / sum_R w                            mass preservation
// eps = ReshapeOptions::kEps guards tau -> 0 and tau -> 1. The sum is never 0: the largest score is >= tau
// (a quantile never exceeds the maximum), so at least one weight is >= 1.
// Cost per row: O(T) plus one nth_element over the span for the quantile.
#include "oar/core/reshape.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <vector>

#include "oar/core/importance.h"

namespace oar::core {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw InvalidArgument(msg); }

template <Tiers K>
void tier_weights(const float* s_hat, int64_t L, double tau, const ReshapeOptions& o, float* w) {
  const double lo_den = tau + ReshapeOptions::kEps;
  const double hi_den = 1.0 - tau + ReshapeOptions::kEps;
  double sum = 0.0;
  for (int64_t t = 0; t < L; ++t) {
    const double s = static_cast<double>(s_hat[t]);
    // Both tiers computed, then selected: branch-free (s < tau is unpredictable along a span).
    double suppress = 1.0, boost = 1.0;
    if constexpr (K != Tiers::kBoostOnly) suppress = std::max(s / lo_den, o.floor);
    if constexpr (K != Tiers::kSuppressOnly) boost = 1.0 + o.beta * (s - tau) / hi_den;
    const double x = s < tau ? suppress : boost;
    w[t] = static_cast<float>(x);
    sum += static_cast<double>(w[t]);
  }
  // A huge beta (~1e38 and beyond) overflows the float32 boost weights; the rescaling would then turn them
  // into NaN (inf * 0). Refuse rather than return NaN weights.
  if (!std::isfinite(sum)) {
    std::ostringstream os;
    os << "beta = " << o.beta << " makes the boost weights 1 + beta * (s - tau) / (1 - tau) overflow float32; "
       << "use a smaller beta";
    fail(os.str());
  }
  // Sum the stored floats, so that the rescaled floats sum to L up to one rounding per element. When every
  // weight is 1 (e.g. all-equal scores), scale is exactly 1 and the weights stay exactly 1.
  const double scale = static_cast<double>(L) / sum;
  if (scale == 1.0) return;
  for (int64_t t = 0; t < L; ++t) w[t] = static_cast<float>(static_cast<double>(w[t]) * scale);
}

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

void reshape_span_weights(const float* s_hat, int64_t L, const ReshapeOptions& opts, float* w, float* scratch) {
  if (L <= 0) return;
  std::copy(s_hat, s_hat + L, scratch);
  const double tau = quantile_linear(scratch, L, opts.q);
  switch (opts.tiers) {
    case Tiers::kBoth: tier_weights<Tiers::kBoth>(s_hat, L, tau, opts, w); return;
    case Tiers::kBoostOnly: tier_weights<Tiers::kBoostOnly>(s_hat, L, tau, opts, w); return;
    case Tiers::kSuppressOnly: tier_weights<Tiers::kSuppressOnly>(s_hat, L, tau, opts, w); return;
  }
  fail("tiers: unknown enum value " + std::to_string(static_cast<int>(opts.tiers)));
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

  // Per row: check, normalize (into the row of `weights`, or a row-sized buffer), reshape the span.
  const size_t row_len = static_cast<size_t>(T_len);
  std::vector<float> own(weights == nullptr && !scores_are_normalized ? row_len : 0);
  std::vector<float> span(row_len + 1), wspan(row_len), scratch(row_len);
  std::vector<int64_t> cols(row_len + 1);  // column of each span entry (+1: the branch-free compaction's spill)
  for (int64_t b = rows.begin; b < rows.end; ++b) {
    if (!std::isfinite(advantages[b])) {
      std::ostringstream os;
      os << "advantages must be finite, got advantages[" << b << "] = " << advantages[b];
      fail(os.str());
    }
    const bool* rm = reasoning_mask + b * T_len;
    const bool* pm = response_mask + b * T_len;
    bool not_subset = false;  // branch-free scan; the slow loop below only runs to name the column
    for (int64_t t = 0; t < T_len; ++t) not_subset |= rm[t] & !pm[t];
    for (int64_t t = 0; not_subset && t < T_len; ++t) {
      if (rm[t] && !pm[t]) {
        std::ostringstream os;
        os << "reasoning_mask must be a subset of response_mask, got reasoning_mask[" << b << ", " << t
           << "] = True where response_mask is False";
        fail(os.str());
      }
    }
    int64_t L = 0;
    if (!scores_are_normalized) {
      // s_hat of this row: into weights[b] (overwritten below) or the row buffer.
      float* s_hat = weights != nullptr ? weights + b * T_len : own.data();
      normalize_importance_row(scores + b * T_len, rm, T_len, s_hat, b);
      for (int64_t t = 0; t < T_len; ++t) {  // compaction without a branch: always write, advance on the mask
        span[L] = s_hat[t];
        cols[L] = t;
        L += rm[t];
      }
    } else {
      const T* row = scores + b * T_len;
      for (int64_t t = 0; t < T_len; ++t) {
        if (!rm[t]) continue;
        const double v = static_cast<double>(row[t]);
        if (!(v >= 0.0 && v <= 1.0)) {
          std::ostringstream os;
          os << "scores must lie in [0, 1] on reasoning_mask when scores_are_normalized=True, got scores[" << b
             << ", " << t << "] = " << v;
          fail(os.str());
        }
        span[L] = static_cast<float>(row[t]);
        cols[L++] = t;
      }
    }
    reshape_span_weights(span.data(), L, opts, wspan.data(), scratch.data());

    const float a = advantages[b];
    float* ta = token_advantages + b * T_len;
    float* wr = weights != nullptr ? weights + b * T_len : nullptr;
    // Off the span: weight 1 on the response, 0 elsewhere (vectorizable); then the span's weights by column.
    for (int64_t t = 0; t < T_len; ++t) {
      const float w = pm[t] ? 1.0f : 0.0f;
      ta[t] = w * a;
      if (wr != nullptr) wr[t] = w;
    }
    for (int64_t k = 0; k < L; ++k) {
      const int64_t t = cols[k];
      const float w = wspan[k];
      const float x = w * a;
      // A finite weight times a finite advantage can still overflow (|A| near FLT_MAX, weight > 1).
      if (!std::isfinite(x)) {
        std::ostringstream os;
        os << "advantages: advantages[" << b << "] = " << a << " times its weight " << w << " at column " << t
           << " overflows float32; rescale the advantages";
        fail(os.str());
      }
      ta[t] = x;
      if (wr != nullptr) wr[t] = w;
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
