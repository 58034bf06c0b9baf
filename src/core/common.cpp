#include "oar/core/common.h"

#include <array>
#include <sstream>
#include <utility>

#ifndef OAR_VERSION
#define OAR_VERSION "0.0.0"
#endif

namespace oar::core {
namespace {

template <typename E, size_t N>
E parse_enum(std::string_view name, std::string_view arg, const std::array<std::pair<const char*, E>, N>& table) {
  for (const auto& [key, value] : table)
    if (name == key) return value;
  std::ostringstream os;
  os << arg << " must be one of {";
  for (size_t i = 0; i < N; ++i) os << (i ? ", " : "") << '"' << table[i].first << '"';
  os << "}, got \"" << name << '"';
  throw InvalidArgument(os.str());
}

template <typename E, size_t N>
std::vector<std::string> enum_names(const std::array<std::pair<const char*, E>, N>& table) {
  std::vector<std::string> out;
  for (const auto& [key, value] : table) out.emplace_back(key);
  return out;
}

template <typename E, size_t N>
const char* enum_name(E v, const std::array<std::pair<const char*, E>, N>& table) {
  for (const auto& [key, value] : table)
    if (value == v) return key;
  return "?";
}

constexpr std::array<std::pair<const char*, Estimator>, 4> kEstimators{{
    {"grpo", Estimator::kGrpo}, {"dr_grpo", Estimator::kDrGrpo}, {"batch", Estimator::kBatch}, {"rloo", Estimator::kRloo}}};
constexpr std::array<std::pair<const char*, StdKind>, 2> kStdKinds{{{"unbiased", StdKind::kUnbiased}, {"biased", StdKind::kBiased}}};
constexpr std::array<std::pair<const char*, SingletonPolicy>, 2> kSingleton{{{"zero", SingletonPolicy::kZero}, {"verl", SingletonPolicy::kVerl}}};
constexpr std::array<std::pair<const char*, Tiers>, 3> kTiers{{{"both", Tiers::kBoth}, {"boost", Tiers::kBoostOnly}, {"suppress", Tiers::kSuppressOnly}}};
constexpr std::array<std::pair<const char*, Probe>, 3> kProbes{{
    {"last", Probe::kLast}, {"answer_mean", Probe::kAnswerMean}, {"answer_joint", Probe::kAnswerJoint}}};
constexpr std::array<std::pair<const char*, DType>, 4> kDTypes{{
    {"float32", DType::kFloat32}, {"float64", DType::kFloat64}, {"float16", DType::kFloat16}, {"bfloat16", DType::kBFloat16}}};

}  // namespace

Estimator parse_estimator(std::string_view name, std::string_view arg) { return parse_enum(name, arg, kEstimators); }
StdKind parse_std_kind(std::string_view name, std::string_view arg) { return parse_enum(name, arg, kStdKinds); }
SingletonPolicy parse_singleton_policy(std::string_view name, std::string_view arg) { return parse_enum(name, arg, kSingleton); }
Tiers parse_tiers(std::string_view name, std::string_view arg) { return parse_enum(name, arg, kTiers); }
Probe parse_probe(std::string_view name, std::string_view arg) { return parse_enum(name, arg, kProbes); }

std::vector<std::string> estimator_names() { return enum_names(kEstimators); }
std::vector<std::string> std_kind_names() { return enum_names(kStdKinds); }
std::vector<std::string> singleton_policy_names() { return enum_names(kSingleton); }
std::vector<std::string> tiers_names() { return enum_names(kTiers); }
std::vector<std::string> probe_names() { return enum_names(kProbes); }

const char* to_string(Estimator v) { return enum_name(v, kEstimators); }
const char* to_string(StdKind v) { return enum_name(v, kStdKinds); }
const char* to_string(SingletonPolicy v) { return enum_name(v, kSingleton); }
const char* to_string(Tiers v) { return enum_name(v, kTiers); }
const char* to_string(Probe v) { return enum_name(v, kProbes); }
const char* to_string(DType v) { return enum_name(v, kDTypes); }

const char* version() { return OAR_VERSION; }

bool compiled_with_cuda() {
#ifdef OAR_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace oar::core
