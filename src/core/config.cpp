#include "oar/core/config.h"

#include <nlohmann/json.hpp>

#include <array>
#include <cmath>
#include <limits>
#include <set>
#include <sstream>

namespace oar::core {
namespace {

using json = nlohmann::json;

constexpr std::array<std::pair<const char*, Method>, 8> kMethods{{
    {"grpo", Method::kGrpo}, {"dr_grpo", Method::kDrGrpo}, {"random", Method::kRandom},
    {"entropy", Method::kEntropy}, {"entropy_shaping", Method::kEntropyShaping}, {"ktae", Method::kKtae},
    {"oar_p", Method::kOarP}, {"oar_g", Method::kOarG}}};

// The values of the string keys that are no enum (stored as strings in OARConfig), in the schema's order.
constexpr std::array<const char*, 2> kScreens{"window", "oar_g"};
constexpr std::array<const char*, 3> kScreenTails{"conclude", "probe", "linear"};
constexpr std::array<const char*, 4> kMaskUnits{"token", "word", "line", "sentence"};
constexpr std::array<const char*, 3> kCreditRows{"all", "positive", "negative"};
constexpr std::array<const char*, 3> kTurnProbes{"answer", "action", "session"};
constexpr std::array<const char*, 3> kTurnCredits{"uniform", "probe", "rewards"};

[[noreturn]] void fail(const std::string& key, const std::string& what) {
  throw InvalidArgument("oar." + key + " " + what);
}

template <size_t N>
std::vector<std::string> names_of(const std::array<const char*, N>& table) {
  return std::vector<std::string>(table.begin(), table.end());
}

// Fails with `oar.<key> must be "a", "b" or "c", got "x"` unless `value` is in `table`.
template <size_t N>
void check_choice(const std::string& key, const std::string& value, const std::array<const char*, N>& table) {
  for (const char* v : table)
    if (value == v) return;
  std::string list;
  for (size_t i = 0; i < N; ++i)
    list += std::string(i == 0 ? "" : (i + 1 == N ? " or " : ", ")) + '"' + table[i] + '"';
  fail(key, "must be " + list + ", got " + json(value).dump());
}

// A value for messages: its type and JSON text ("string \"x\"", "number 1.5"), or just "null".
std::string describe(const json& v) {
  return v.is_null() ? std::string("null") : std::string(v.type_name()) + " " + v.dump();
}

double get_number(const json& obj, const char* key, double dflt) {
  if (!obj.contains(key)) return dflt;
  const auto& v = obj.at(key);
  if (!v.is_number()) fail(key, "must be a number, got " + describe(v));
  double d = v.get<double>();
  if (!std::isfinite(d)) fail(key, "must be finite, got " + v.dump());
  return d;
}

int64_t get_int(const json& obj, const char* key, int64_t dflt) {
  if (!obj.contains(key)) return dflt;
  const auto& v = obj.at(key);
  if (!v.is_number_integer()) fail(key, "must be an integer, got " + describe(v));
  // JSON integers above INT64_MAX parse as unsigned; get<int64_t>() would wrap them to negative values.
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    fail(key, "must fit in a signed 64-bit integer, got " + v.dump());
  return v.get<int64_t>();
}

bool get_bool(const json& obj, const char* key, bool dflt) {
  if (!obj.contains(key)) return dflt;
  const auto& v = obj.at(key);
  if (!v.is_boolean()) fail(key, std::string("must be true or false, got ") + v.dump());
  return v.get<bool>();
}

std::string get_string(const json& obj, const char* key, const std::string& dflt) {
  if (!obj.contains(key)) return dflt;
  const auto& v = obj.at(key);
  if (!v.is_string()) fail(key, "must be a string, got " + describe(v));
  return v.get<std::string>();
}

// Re-raises a parse error with the "oar." prefix (the inner message starts with the key name).
template <typename F>
auto parse_key(const char* /*key*/, F&& f) {
  try {
    return f();
  } catch (const InvalidArgument& e) {
    // get_string already prefixes its messages ("oar.method must be a string ..."): do not prefix twice.
    const std::string msg = e.what();
    throw InvalidArgument(msg.rfind("oar.", 0) == 0 ? msg : "oar." + msg);
  }
}

const std::set<std::string>& known_keys() {
  static const std::set<std::string> keys{
      "method", "probe", "q", "beta", "floor", "tiers", "estimator", "std", "eps", "singleton", "skip_nan",
      "sigma", "noise_draws", "conclude", "answer_suffix", "memory_budget_mb", "max_variants_per_chunk", "seed",
      "screen_fraction", "screen_sample", "screen_budget", "screen", "screen_window",
      "screen_tail", "mask_unit", "credit_rows", "turn_probe", "turn_credit",
      "preset", "entropy_alpha", "entropy_kappa", "ktae_alpha", "ktae_beta", "ktae_tf", "ktae_scale",
      "ktae_threshold"};
  return keys;
}

}  // namespace

Method parse_method(std::string_view name, std::string_view arg) {
  for (const auto& [key, value] : kMethods)
    if (name == key) return value;
  std::ostringstream os;
  os << arg << " must be one of {";
  for (size_t i = 0; i < kMethods.size(); ++i) os << (i ? ", " : "") << '"' << kMethods[i].first << '"';
  os << "}, got \"" << name << '"';
  throw InvalidArgument(os.str());
}

std::vector<std::string> method_names() {
  std::vector<std::string> out;
  for (const auto& [key, value] : kMethods) out.emplace_back(key);
  return out;
}

const std::vector<std::pair<std::string, std::vector<std::string>>>& config_choices() {
  static const std::vector<std::pair<std::string, std::vector<std::string>>> choices{
      {"method", method_names()},          {"probe", probe_names()},
      {"tiers", tiers_names()},            {"estimator", estimator_names()},
      {"preset", preset_names()},          {"std", std_kind_names()},
      {"singleton", singleton_policy_names()}, {"screen", names_of(kScreens)},
      {"screen_tail", names_of(kScreenTails)}, {"mask_unit", names_of(kMaskUnits)},
      {"credit_rows", names_of(kCreditRows)}, {"turn_probe", names_of(kTurnProbes)},
      {"turn_credit", names_of(kTurnCredits)}};
  return choices;
}

const char* to_string(Method v) {
  for (const auto& [key, value] : kMethods)
    if (value == v) return key;
  return "?";
}

OARConfig parse_oar_config(const std::string& json_text) {
  json obj;
  try {
    obj = json::parse(json_text);
  } catch (const json::exception& e) {
    // parse_error, and out_of_range for numbers beyond double ("1e400").
    throw InvalidArgument(std::string("oar config is not valid JSON: ") + e.what());
  }
  if (obj.is_null()) obj = json::object();
  if (!obj.is_object()) throw InvalidArgument("oar config must be a JSON object, got " + std::string(obj.type_name()));
  for (const auto& item : obj.items()) {
    if (!known_keys().count(item.key())) {
      std::ostringstream os;
      os << "oar config has unknown key \"" << item.key() << "\"; known keys: ";
      bool first = true;
      for (const auto& k : known_keys()) {
        os << (first ? "" : ", ") << k;
        first = false;
      }
      throw InvalidArgument(os.str());
    }
  }

  OARConfig cfg;
  cfg.method = parse_key("method", [&] { return parse_method(get_string(obj, "method", to_string(cfg.method)), "method"); });
  cfg.probe = parse_key("probe", [&] { return parse_probe(get_string(obj, "probe", to_string(cfg.probe)), "probe"); });

  cfg.reshape.q = get_number(obj, "q", cfg.reshape.q);
  cfg.reshape.beta = get_number(obj, "beta", cfg.reshape.beta);
  cfg.reshape.floor = get_number(obj, "floor", cfg.reshape.floor);
  cfg.reshape.tiers = parse_key("tiers", [&] { return parse_tiers(get_string(obj, "tiers", to_string(cfg.reshape.tiers)), "tiers"); });
  parse_key("", [&] {
    check_reshape_options(cfg.reshape);
    return 0;
  });

  // Dr. GRPO is a choice of sequence estimator (no std scaling, method.md section 1) with uniform credit.
  const bool dr = cfg.method == Method::kDrGrpo;
  const auto estimator = parse_key(
      "estimator", [&] { return parse_estimator(get_string(obj, "estimator", dr ? "dr_grpo" : "grpo"), "estimator"); });
  if (dr && estimator != Estimator::kDrGrpo)
    fail("estimator", std::string("must be \"dr_grpo\" (or absent) when oar.method is \"dr_grpo\", got \"") +
                          to_string(estimator) + "\"");
  const std::string preset = get_string(obj, "preset", "default");
  cfg.advantages = parse_key("preset", [&] { return preset_options(preset, estimator); });
  if (obj.contains("std"))
    cfg.advantages.std_kind = parse_key("std", [&] { return parse_std_kind(get_string(obj, "std", ""), "std"); });
  cfg.advantages.eps = get_number(obj, "eps", cfg.advantages.eps);
  if (cfg.advantages.eps < 0) fail("eps", "must be >= 0, got " + obj.at("eps").dump());
  if (obj.contains("singleton"))
    cfg.advantages.singleton =
        parse_key("singleton", [&] { return parse_singleton_policy(get_string(obj, "singleton", ""), "singleton"); });
  cfg.advantages.skip_nan = get_bool(obj, "skip_nan", cfg.advantages.skip_nan);

  cfg.sigma = get_number(obj, "sigma", cfg.sigma);
  if (!(cfg.sigma > 0)) fail("sigma", "must be > 0, got " + obj.at("sigma").dump());
  cfg.noise_draws = get_int(obj, "noise_draws", cfg.noise_draws);
  if (cfg.noise_draws < 1) fail("noise_draws", "must be >= 1, got " + std::to_string(cfg.noise_draws));
  cfg.conclude = get_string(obj, "conclude", cfg.conclude);
  cfg.answer_suffix = get_string(obj, "answer_suffix", cfg.answer_suffix);
  cfg.memory_budget_mb = get_int(obj, "memory_budget_mb", cfg.memory_budget_mb);
  if (cfg.memory_budget_mb < 1) fail("memory_budget_mb", "must be >= 1, got " + std::to_string(cfg.memory_budget_mb));
  cfg.max_variants_per_chunk = get_int(obj, "max_variants_per_chunk", cfg.max_variants_per_chunk);
  if (cfg.max_variants_per_chunk < 0)
    fail("max_variants_per_chunk", "must be >= 0 (0 = unlimited), got " + std::to_string(cfg.max_variants_per_chunk));
  cfg.seed = get_int(obj, "seed", cfg.seed);
  cfg.screen_fraction = get_number(obj, "screen_fraction", cfg.screen_fraction);
  if (!(cfg.screen_fraction >= 0 && cfg.screen_fraction <= 1))
    fail("screen_fraction", "must be in [0, 1] (1 = exact OAR-P), got " + obj.at("screen_fraction").dump());
  cfg.screen_sample = get_number(obj, "screen_sample", cfg.screen_sample);
  if (!(cfg.screen_sample >= 0 && cfg.screen_sample <= 1))
    fail("screen_sample", "must be in [0, 1], got " + json(cfg.screen_sample).dump());
  cfg.screen = get_string(obj, "screen", cfg.screen);
  check_choice("screen", cfg.screen, kScreens);
  cfg.screen_window = get_int(obj, "screen_window", cfg.screen_window);
  if (cfg.screen_window < 0) fail("screen_window", "must be >= 0, got " + std::to_string(cfg.screen_window));
  cfg.screen_tail = get_string(obj, "screen_tail", cfg.screen_tail);
  check_choice("screen_tail", cfg.screen_tail, kScreenTails);
  cfg.mask_unit = get_string(obj, "mask_unit", cfg.mask_unit);
  check_choice("mask_unit", cfg.mask_unit, kMaskUnits);
  cfg.credit_rows = get_string(obj, "credit_rows", cfg.credit_rows);
  check_choice("credit_rows", cfg.credit_rows, kCreditRows);
  cfg.turn_probe = get_string(obj, "turn_probe", cfg.turn_probe);
  check_choice("turn_probe", cfg.turn_probe, kTurnProbes);
  cfg.turn_credit = get_string(obj, "turn_credit", cfg.turn_credit);
  check_choice("turn_credit", cfg.turn_credit, kTurnCredits);
  cfg.screen_budget = get_number(obj, "screen_budget", cfg.screen_budget);
  if (!(cfg.screen_budget == 0 || cfg.screen_budget > 1))
    fail("screen_budget", "must be 0 (off) or > 1 (a step at most screen_budget x a GRPO step), got " +
                              obj.at("screen_budget").dump());

  auto& es = cfg.entropy_shaping;
  es.alpha = get_number(obj, "entropy_alpha", es.alpha);
  if (es.alpha < 0) fail("entropy_alpha", "must be >= 0, got " + obj.at("entropy_alpha").dump());
  es.kappa = get_number(obj, "entropy_kappa", es.kappa);
  if (!(es.kappa > 0)) fail("entropy_kappa", "must be > 0, got " + obj.at("entropy_kappa").dump());

  auto& kt = cfg.ktae;
  kt.alpha = get_number(obj, "ktae_alpha", kt.alpha);
  if (kt.alpha < 0) fail("ktae_alpha", "must be >= 0, got " + obj.at("ktae_alpha").dump());
  kt.beta = get_number(obj, "ktae_beta", kt.beta);
  if (kt.beta < 0) fail("ktae_beta", "must be >= 0, got " + obj.at("ktae_beta").dump());
  if (!(kt.alpha + kt.beta > 0))
    fail("ktae_alpha", "+ oar.ktae_beta must be > 0 (both weights are 0), got " + std::to_string(kt.alpha) + " + " +
                           std::to_string(kt.beta));
  kt.tf = get_bool(obj, "ktae_tf", kt.tf);
  kt.scale = get_number(obj, "ktae_scale", kt.scale);
  if (!(kt.scale > 0)) fail("ktae_scale", "must be > 0, got " + obj.at("ktae_scale").dump());
  kt.threshold = get_number(obj, "ktae_threshold", kt.threshold);
  return cfg;
}

std::string to_json(const OARConfig& cfg) {
  json j;
  j["method"] = to_string(cfg.method);
  j["probe"] = to_string(cfg.probe);
  j["q"] = cfg.reshape.q;
  j["beta"] = cfg.reshape.beta;
  j["floor"] = cfg.reshape.floor;
  j["tiers"] = to_string(cfg.reshape.tiers);
  j["estimator"] = to_string(cfg.advantages.estimator);
  j["std"] = to_string(cfg.advantages.std_kind);
  j["eps"] = cfg.advantages.eps;
  j["singleton"] = to_string(cfg.advantages.singleton);
  j["skip_nan"] = cfg.advantages.skip_nan;
  j["sigma"] = cfg.sigma;
  j["noise_draws"] = cfg.noise_draws;
  j["conclude"] = cfg.conclude;
  j["answer_suffix"] = cfg.answer_suffix;
  j["memory_budget_mb"] = cfg.memory_budget_mb;
  j["max_variants_per_chunk"] = cfg.max_variants_per_chunk;
  j["seed"] = cfg.seed;
  j["screen_fraction"] = cfg.screen_fraction;
  j["screen_sample"] = cfg.screen_sample;
  j["screen_budget"] = cfg.screen_budget;
  j["screen"] = cfg.screen;
  j["screen_window"] = cfg.screen_window;
  j["screen_tail"] = cfg.screen_tail;
  j["mask_unit"] = cfg.mask_unit;
  j["credit_rows"] = cfg.credit_rows;
  j["turn_probe"] = cfg.turn_probe;
  j["turn_credit"] = cfg.turn_credit;
  j["entropy_alpha"] = cfg.entropy_shaping.alpha;
  j["entropy_kappa"] = cfg.entropy_shaping.kappa;
  j["ktae_alpha"] = cfg.ktae.alpha;
  j["ktae_beta"] = cfg.ktae.beta;
  j["ktae_tf"] = cfg.ktae.tf;
  j["ktae_scale"] = cfg.ktae.scale;
  j["ktae_threshold"] = cfg.ktae.threshold;
  return j.dump(2);
}

}  // namespace oar::core
