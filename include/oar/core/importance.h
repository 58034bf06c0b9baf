// Importance normalization per rollout (method.md section 5).
#pragma once

#include <cstdint>

#include "oar/core/common.h"

namespace oar::core {

/// out[b,t] = (log1p(I[b,t]) - min_R) / (max_R - min_R) on positions where mask[b,t] is true (R: the
/// reasoning span of row b), denominator 1 when max == min; out = 0 where mask is false. Rows with an
/// empty mask are all zero. Raw scores on masked positions must be finite and >= 0: otherwise throws
/// InvalidArgument naming `scores` and the offending (row, column, value). Values off the mask are
/// ignored. Row-major contiguous (B, T). T is float or double. Accumulation in double.
template <typename T>
void normalize_importance(const T* scores, const bool* mask, int64_t B, int64_t T_len, float* out);

/// Rows [rows.begin, rows.end) only (pointers still refer to row 0; errors name absolute indices), for
/// adapters that split a batch across threads. Each row is checked, then normalized.
template <typename T>
void normalize_importance(const T* scores, const bool* mask, int64_t B, int64_t T_len, float* out, RowRange rows);

/// One row (T_len,) of normalize_importance: checks, then normalizes; `row` is only used in error messages
/// (the absolute row index of scores_row in the caller's batch).
template <typename T>
void normalize_importance_row(const T* scores_row, const bool* mask_row, int64_t T_len, float* out_row, int64_t row);

/// Same check as normalize_importance, without computing: throws on NaN/Inf/negative masked scores.
template <typename T>
void check_scores(const T* scores, const bool* mask, int64_t B, int64_t T_len, const char* arg = "scores");

}  // namespace oar::core
