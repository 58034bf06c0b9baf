// oar core: shared enums, error type and helpers. Torch-free.
// Source: docs/method.md (the project specification of arXiv 2601.07408).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace oar::core {

/// Raised by every core function on bad user input. The message names the argument, what was expected
/// and what was received. The LibTorch adapter rethrows it as a ValueError (TORCH_CHECK_VALUE).
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// Sequence-advantage estimator (method.md section 1).
enum class Estimator : int32_t {
  kGrpo = 0,    ///< (r - mean_g) / (std_g + eps)
  kDrGrpo = 1,  ///< r - mean_g                       (Liu et al. 2503.20783)
  kBatch = 2,   ///< (r - mean_g) / (std_batch + eps) (TRL scale_rewards="batch")
  kRloo = 3,    ///< r - mean_{j != i} r_j            (leave-one-out)
};

/// Standard deviation convention: unbiased (n - 1, torch.std default; TRL, verl, OpenRLHF) or biased (n).
enum class StdKind : int32_t { kUnbiased = 0, kBiased = 1 };

/// What a group of one response gets. kZero: A = 0 (the baseline is the reward itself).
/// kVerl: verl's quirk, mean 0 and std 1, so A = r / (1 + eps) (grpo) or A = r (dr_grpo).
enum class SingletonPolicy : int32_t { kZero = 0, kVerl = 1 };

/// Which tiers of the bi-level reshaping are active (method.md section 6 ablations).
enum class Tiers : int32_t { kBoth = 0, kBoostOnly = 1, kSuppressOnly = 2 };

/// Outcome probe (method.md section 2).
enum class Probe : int32_t {
  kLast = 0,         ///< KL of softmax(Z[pos_0])
  kAnswerMean = 1,   ///< KL of softmax(mean_k Z[pos_k]) (AS-MEAN)
  kAnswerJoint = 2,  ///< drop of mean_k log softmax(Z[pos_k])[a_k]
};

// String <-> enum. Parsing happens once, at the adapter boundary; strings never reach kernels.
// Each parse_* throws InvalidArgument naming `arg` and listing the accepted values.
Estimator parse_estimator(std::string_view name, std::string_view arg = "estimator");
StdKind parse_std_kind(std::string_view name, std::string_view arg = "std");
SingletonPolicy parse_singleton_policy(std::string_view name, std::string_view arg = "singleton");
Tiers parse_tiers(std::string_view name, std::string_view arg = "tiers");
Probe parse_probe(std::string_view name, std::string_view arg = "probe");
const char* to_string(Estimator v);
const char* to_string(StdKind v);
const char* to_string(SingletonPolicy v);
const char* to_string(Tiers v);
const char* to_string(Probe v);
/// The accepted names of each enum above, in its table's order (what parse_* accepts, nothing else).
std::vector<std::string> estimator_names();
std::vector<std::string> std_kind_names();
std::vector<std::string> singleton_policy_names();
std::vector<std::string> tiers_names();
std::vector<std::string> probe_names();

/// Element types the kernels accept, for launchers that take `const void*` (CUDA headers stay out of
/// users' translation units).
enum class DType : int32_t { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };
const char* to_string(DType v);

/// Library version ("0.1.0") and whether the CUDA kernels were compiled into this build.
const char* version();
bool compiled_with_cuda();

/// Rows [begin, end) of a batch of N rows, for callers that split one batch across threads: data pointers
/// still refer to row 0, outputs are indexed by absolute row and error messages report absolute indices.
struct RowRange {
  int64_t begin = 0;
  int64_t end = 0;
};

}  // namespace oar::core
