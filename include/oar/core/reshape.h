// Bi-level (dual-tier) sum-preserving advantage reshaping (method.md section 6).
#pragma once

#include <cstdint>

#include "oar/core/common.h"

namespace oar::core {

/// Parameters of the reshaping. Defaults follow method.md section 6.
struct ReshapeOptions {
  double q = 0.25;      ///< quantile level of the tier threshold tau, in (0, 1)
  double beta = 1.0;    ///< boost strength, >= 0
  double floor = 0.1;   ///< suppression floor w_min, in [0, 1)
  Tiers tiers = Tiers::kBoth;
  /// Denominator guard for tau -> 0 and tau -> 1 (method.md section 6): w = s/(tau + kEps) and
  /// (s - tau)/(1 - tau + kEps).
  static constexpr double kEps = 1e-8;
};

/// Throws InvalidArgument naming q, beta or floor when outside their ranges (q in (0,1), beta >= 0 and
/// finite, floor in [0,1)).
void check_reshape_options(const ReshapeOptions& opts);

/// numpy-default (linear interpolation) quantile of `values` (n >= 1), which it partially reorders.
double quantile_linear(float* values, int64_t n, double q);

/// numpy-default (linear interpolation) quantile of the entries of `values` (len,) where `mask` is true,
/// for values in [0, 1] (normalized scores; -0.0 counts as 0). Radix selection on the float bits (a
/// histogram pass over the row, then only the entries of the selected bin), so the cost is about one pass
/// over the row instead of a comparison-based selection. Returns exactly the value of quantile_linear on
/// the masked entries. `scratch`: len floats. Throws InvalidArgument when the mask selects nothing or q is
/// outside [0, 1]. Values outside [0, 1] or NaN break the precondition (the result is then unspecified).
double masked_quantile_unit(const float* values, const bool* mask, int64_t len, double q, float* scratch);

/// Weights for one rollout's reasoning span from normalized scores s_hat (L,), each in [0, 1]:
/// tiers, floor, then mass preservation (sum w = L). L == 0 is a no-op. Uses `scratch` (L floats).
void reshape_span_weights(const float* s_hat, int64_t L, const ReshapeOptions& opts, float* w, float* scratch);

/// Full per-row pipeline on (B, T) row-major contiguous inputs:
///   s_hat = normalize_importance(scores, reasoning_mask)   (skipped when scores_are_normalized: then
///           scores must already lie in [0, 1] on the span)
///   w     = tiers + floor + mass preservation over the span; 1 on response tokens outside the span;
///           0 where response_mask is false
///   token_advantages[b,t] = w[b,t] * advantages[b]
/// `weights` may be null. reasoning_mask must be a subset of response_mask (InvalidArgument otherwise,
/// naming the first offending (row, column)). Scores on the span must be finite and >= 0.
/// T is float or double (scores); advantages are float32 (B,), non-finite values throw. Also throws when a
/// huge beta makes the boost weights overflow float32, or a token advantage w * A overflows float32.
template <typename T>
void reshape_advantages(const float* advantages, const T* scores, const bool* reasoning_mask,
                        const bool* response_mask, int64_t B, int64_t T_len, const ReshapeOptions& opts,
                        bool scores_are_normalized, float* token_advantages, float* weights);

/// Rows [rows.begin, rows.end) only (pointers still refer to row 0; outputs written and errors reported at
/// absolute indices), for adapters that split a batch across threads. Rows are checked and reshaped one at
/// a time, so with several bad rows the error reported is the first bad row of the range.
template <typename T>
void reshape_advantages(const float* advantages, const T* scores, const bool* reasoning_mask,
                        const bool* response_mask, int64_t B, int64_t T_len, const ReshapeOptions& opts,
                        bool scores_are_normalized, float* token_advantages, float* weights, RowRange rows);

}  // namespace oar::core
