// The oar configuration schema, shared by C++ (nlohmann_json) and Python (PyYAML -> JSON -> here).
// One schema: configs/*.yaml `oar:` sections are parsed by oar::core::parse_oar_config.
#pragma once

#include <cstdint>
#include <string>

#include "oar/core/common.h"
#include "oar/core/group_advantages.h"
#include "oar/core/reshape.h"

namespace oar::core {

/// Credit-assignment method (method.md section 8 lists the baselines).
enum class Method : int32_t { kGrpo = 0, kRandom = 1, kEntropy = 2, kOarP = 3, kOarG = 4 };
Method parse_method(std::string_view name, std::string_view arg = "method");
const char* to_string(Method v);

/// Everything that decides per-token advantages. Field names are the JSON/YAML keys.
struct OARConfig {
  Method method = Method::kOarG;
  Probe probe = Probe::kAnswerMean;          ///< "probe": last | answer_mean | answer_joint
  ReshapeOptions reshape;                    ///< "q", "beta", "floor", "tiers": both | boost | suppress
  GroupAdvantageOptions advantages;          ///< "estimator", "std", "eps", "singleton", "skip_nan"
  double sigma = 1e-3;                       ///< OAR-G embedding noise std (absolute)
  int64_t noise_draws = 1;                   ///< OAR-G K
  std::string conclude = "\nTherefore, the final answer is \\boxed{";
  std::string answer_suffix = "}";
  int64_t memory_budget_mb = 1024;           ///< OAR-P chunk planner budget
  int64_t max_variants_per_chunk = 0;        ///< OAR-P, 0 = unlimited
  int64_t seed = 0;                          ///< noise / random-baseline seed
};

/// Parses a JSON object (all keys optional, defaults above). Unknown keys, wrong types, integers beyond int64
/// and out-of-range values throw InvalidArgument naming the key ("oar.q must be in (0, 1), got 1.5"); invalid
/// JSON (numbers beyond double included) throws InvalidArgument too.
OARConfig parse_oar_config(const std::string& json_text);
/// Serializes every field (round-trips through parse_oar_config).
std::string to_json(const OARConfig& cfg);

}  // namespace oar::core
