// GRPO-family sequence advantages over ragged groups (method.md section 1).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "oar/core/common.h"

namespace oar::core {

struct GroupAdvantageOptions {
  Estimator estimator = Estimator::kGrpo;
  StdKind std_kind = StdKind::kUnbiased;
  double eps = 1e-6;
  SingletonPolicy singleton = SingletonPolicy::kZero;
  /// false: a NaN reward throws InvalidArgument naming its index. true: that row is excluded from every
  /// statistic and gets advantage 0 (TRL's treatment of unscorable completions).
  bool skip_nan = false;
};

/// Diagnostics of one call.
struct GroupAdvantageStats {
  int64_t num_groups = 0;
  int64_t empty_groups = 0;       ///< groups with no (non-NaN) reward (offsets[g] == offsets[g+1], or all NaN)
  int64_t singleton_groups = 0;   ///< groups with exactly one (non-NaN) reward
  int64_t zero_std_groups = 0;    ///< groups of size >= 2 whose rewards are all equal (A = 0)
  int64_t nan_rows = 0;           ///< rows skipped because their reward was NaN (skip_nan only)
};

/// Trainer presets that reproduce each trainer's convention exactly, quirks included:
///   "trl":      unbiased std, eps 1e-4 (trl GRPOTrainer._generate_and_score_completions)
///   "verl":     unbiased std, eps 1e-6, singleton groups -> mean 0, std 1 (verl core_algos
///               compute_grpo_outcome_advantage)
///   "openrlhf": unbiased std, eps 1e-9 (OpenRLHF experience_maker group_norm)
///   "default":  unbiased std, eps 1e-6, singleton -> 0
/// The estimator is kept as given. Throws InvalidArgument naming `preset` for other names.
GroupAdvantageOptions preset_options(std::string_view preset, Estimator estimator);
/// The presets preset_options accepts: default, trl, verl, openrlhf.
std::vector<std::string> preset_names();

/// Throws InvalidArgument unless offsets (num_groups + 1) is a valid CSR array over n rows:
/// offsets[0] == 0, non-decreasing, offsets[num_groups] == n. `arg` names the argument in messages.
void check_offsets(const int64_t* offsets, int64_t num_groups, int64_t n, const char* arg = "offsets");

/// Computes A (n,) float32 from rewards (n,) grouped by CSR `offsets` (num_groups + 1,).
/// Statistics are accumulated in double. Rules (method.md section 1):
///   - a group of size 1, or of all-equal rewards, gets A = 0 (unless singleton == kVerl, see SingletonPolicy);
///   - kBatch divides by the (unbiased/biased) std of all non-NaN rewards in the call;
///   - kRloo: A_i = r_i - mean_{j != i} r_j; a singleton gets 0.
/// Empty groups (offsets[g] == offsets[g+1]) are allowed and contribute nothing.
/// Throws InvalidArgument: malformed offsets, eps < 0 or non-finite, NaN/Inf reward (Inf always throws), a group
/// (or, for kBatch, the batch) whose mean or sum of squared deviations overflows double, an advantage that is
/// not finite in float32.
/// T is float or double.
template <typename T>
GroupAdvantageStats group_advantages(const T* rewards, int64_t n, const int64_t* offsets, int64_t num_groups,
                                     const GroupAdvantageOptions& opts, float* out);

}  // namespace oar::core
