// Enum parsing and the config schema (include/oar/core/common.h, config.h).
#include <gtest/gtest.h>

#include <string>

#include "oar/core/common.h"
#include "oar/core/config.h"
#include "test_util.h"

using oar::testing::expect_invalid;

using namespace oar::core;

TEST(CommonEnums, RoundTripEveryName) {
  for (const char* s : {"grpo", "dr_grpo", "batch", "rloo"}) EXPECT_STREQ(to_string(parse_estimator(s)), s);
  for (const char* s : {"unbiased", "biased"}) EXPECT_STREQ(to_string(parse_std_kind(s)), s);
  for (const char* s : {"zero", "verl"}) EXPECT_STREQ(to_string(parse_singleton_policy(s)), s);
  for (const char* s : {"both", "boost", "suppress"}) EXPECT_STREQ(to_string(parse_tiers(s)), s);
  for (const char* s : {"last", "answer_mean", "answer_joint"}) EXPECT_STREQ(to_string(parse_probe(s)), s);
  for (const char* s : {"grpo", "dr_grpo", "random", "entropy", "entropy_shaping", "ktae", "oar_p", "oar_g"})
    EXPECT_STREQ(to_string(parse_method(s)), s);
  const auto names = method_names();
  ASSERT_EQ(names.size(), 8u);
  for (const auto& n : names) EXPECT_EQ(to_string(parse_method(n)), n);
}

TEST(CommonEnums, UnknownNameListsChoicesAndArgument) {
  expect_invalid([] { parse_probe("mean", "probe"); }, "probe must be one of");
  expect_invalid([] { parse_probe("mean", "probe"); }, "\"answer_mean\"");
  expect_invalid([] { parse_estimator("ppo", "estimator"); }, "got \"ppo\"");
}

TEST(Config, DefaultsFollowMethodMd) {
  const OARConfig c = parse_oar_config("{}");
  EXPECT_EQ(c.method, Method::kOarG);
  EXPECT_EQ(c.probe, Probe::kAnswerMean);
  EXPECT_DOUBLE_EQ(c.reshape.q, 0.25);
  EXPECT_DOUBLE_EQ(c.reshape.beta, 1.0);
  EXPECT_DOUBLE_EQ(c.reshape.floor, 0.1);
  EXPECT_EQ(c.reshape.tiers, Tiers::kBoth);
  EXPECT_DOUBLE_EQ(c.sigma, 1e-3);
  EXPECT_EQ(c.noise_draws, 1);
  EXPECT_EQ(c.conclude, "\nTherefore, the final answer is \\boxed{");
  EXPECT_DOUBLE_EQ(c.screen_fraction, 1.0);  // screening off: exact OAR-P
  EXPECT_DOUBLE_EQ(c.screen_sample, 0.05);
  EXPECT_DOUBLE_EQ(c.screen_budget, 0.0);
  EXPECT_EQ(c.screen, "window");
  EXPECT_EQ(c.screen_window, 8);
  EXPECT_EQ(c.mask_unit, "token");  // the paper's unit
  EXPECT_EQ(c.credit_rows, "all");  // the paper's: every rollout gets token-level credit
  EXPECT_EQ(c.screen_tail, "conclude");
  EXPECT_EQ(c.turn_probe, "answer");    // multi-turn sessions probed turn by turn (docs/method.md section 13)
  EXPECT_EQ(c.turn_credit, "uniform");  // every turn keeps the session's mass per token
}

TEST(Config, ParsesEveryFieldAndRoundTrips) {
  const std::string text = R"({"method": "oar_p", "probe": "answer_joint", "q": 0.5, "beta": 2.0, "floor": 0.2,
    "tiers": "boost", "estimator": "rloo", "preset": "verl", "skip_nan": true, "sigma": 0.01, "noise_draws": 4,
    "conclude": "\nAnswer: ", "answer_suffix": "", "memory_budget_mb": 64, "max_variants_per_chunk": 8, "seed": 7,
    "screen_fraction": 0.1, "screen_sample": 0.02, "screen_budget": 1.5, "screen": "oar_g", "screen_window": 3})";
  const OARConfig c = parse_oar_config(text);
  EXPECT_EQ(c.method, Method::kOarP);
  EXPECT_EQ(c.probe, Probe::kAnswerJoint);
  EXPECT_DOUBLE_EQ(c.reshape.q, 0.5);
  EXPECT_EQ(c.reshape.tiers, Tiers::kBoostOnly);
  EXPECT_EQ(c.advantages.estimator, Estimator::kRloo);
  EXPECT_EQ(c.advantages.singleton, SingletonPolicy::kVerl);  // from the verl preset
  EXPECT_DOUBLE_EQ(c.advantages.eps, 1e-6);
  EXPECT_TRUE(c.advantages.skip_nan);
  EXPECT_EQ(c.noise_draws, 4);
  EXPECT_EQ(c.conclude, "\nAnswer: ");
  EXPECT_EQ(c.max_variants_per_chunk, 8);
  EXPECT_DOUBLE_EQ(c.screen_fraction, 0.1);
  EXPECT_DOUBLE_EQ(c.screen_sample, 0.02);
  EXPECT_DOUBLE_EQ(c.screen_budget, 1.5);
  EXPECT_EQ(c.screen, "oar_g");
  EXPECT_EQ(c.screen_window, 3);

  const OARConfig again = parse_oar_config(to_json(c));
  EXPECT_EQ(to_json(again), to_json(c));
}

TEST(Config, ExplicitFieldsOverridePreset) {
  const OARConfig c = parse_oar_config(R"({"preset": "trl", "eps": 0.5, "std": "biased"})");
  EXPECT_DOUBLE_EQ(c.advantages.eps, 0.5);
  EXPECT_EQ(c.advantages.std_kind, StdKind::kBiased);
}

TEST(Config, ErrorsNameTheKey) {
  expect_invalid([] { parse_oar_config(R"({"q": 1.5})"); }, "oar.q");
  expect_invalid([] { parse_oar_config(R"({"beta": -1})"); }, "oar.beta");
  expect_invalid([] { parse_oar_config(R"({"floor": 1.0})"); }, "oar.floor");
  expect_invalid([] { parse_oar_config(R"({"q": "big"})"); }, "oar.q must be a number");
  expect_invalid([] { parse_oar_config(R"({"probe": "mean"})"); }, "oar.probe must be one of");
  expect_invalid([] { parse_oar_config(R"({"noise_draws": 0})"); }, "oar.noise_draws");
  expect_invalid([] { parse_oar_config(R"({"sigma": 0})"); }, "oar.sigma");
  expect_invalid([] { parse_oar_config(R"({"screen_fraction": 1.5})"); }, "oar.screen_fraction must be in [0, 1]");
  expect_invalid([] { parse_oar_config(R"({"screen_sample": -0.1})"); }, "oar.screen_sample must be in [0, 1]");
  // screen_fraction = screen_sample = 0: the screen alone (windowed OAR-P)
  EXPECT_DOUBLE_EQ(parse_oar_config(R"({"screen_fraction": 0, "screen_sample": 0})").screen_sample, 0.0);
  expect_invalid([] { parse_oar_config(R"({"screen_budget": 1.0})"); }, "oar.screen_budget must be 0 (off) or > 1");
  expect_invalid([] { parse_oar_config(R"({"screen": "entropy"})"); },
                 "oar.screen must be \"window\" or \"oar_g\", got \"entropy\"");
  expect_invalid([] { parse_oar_config(R"({"screen_window": -1})"); }, "oar.screen_window must be >= 0, got -1");
  expect_invalid([] { parse_oar_config(R"({"mask_unit": "step"})"); },
                 "oar.mask_unit must be \"token\", \"word\", \"line\" or \"sentence\", got \"step\"");
  EXPECT_EQ(parse_oar_config(R"({"mask_unit": "line"})").mask_unit, "line");
  expect_invalid([] { parse_oar_config(R"({"credit_rows": "pos"})"); },
                 "oar.credit_rows must be \"all\", \"positive\" or \"negative\", got \"pos\"");
  EXPECT_EQ(parse_oar_config(to_json(parse_oar_config(R"({"credit_rows": "positive"})"))).credit_rows, "positive");
  expect_invalid([] { parse_oar_config(R"({"turn_probe": "turn"})"); },
                 "oar.turn_probe must be \"answer\", \"action\" or \"session\", got \"turn\"");
  expect_invalid([] { parse_oar_config(R"({"turn_credit": "reward"})"); },
                 "oar.turn_credit must be \"uniform\", \"probe\" or \"rewards\", got \"reward\"");
  EXPECT_EQ(parse_oar_config(to_json(parse_oar_config(R"({"turn_probe": "session"})"))).turn_probe, "session");
  EXPECT_EQ(parse_oar_config(to_json(parse_oar_config(R"({"turn_credit": "probe"})"))).turn_credit, "probe");
  EXPECT_EQ(parse_oar_config(to_json(parse_oar_config(R"({"turn_credit": "rewards"})"))).turn_credit, "rewards");
  EXPECT_EQ(parse_oar_config(to_json(parse_oar_config(R"({"turn_probe": "action"})"))).turn_probe, "action");
  expect_invalid([] { parse_oar_config(R"({"screen_tail": "all"})"); },
                 "oar.screen_tail must be \"conclude\", \"probe\" or \"linear\", got \"all\"");
  EXPECT_EQ(parse_oar_config(to_json(parse_oar_config(R"({"screen_tail": "probe"})"))).screen_tail, "probe");
  EXPECT_EQ(parse_oar_config(to_json(parse_oar_config(R"({"screen_tail": "linear"})"))).screen_tail, "linear");
  EXPECT_EQ(parse_oar_config(to_json(parse_oar_config(R"({"mask_unit": "word"})"))).mask_unit, "word");
  expect_invalid([] { parse_oar_config(R"({"qq": 0.3})"); }, "unknown key \"qq\"");
  expect_invalid([] { parse_oar_config(R"([1, 2])"); }, "must be a JSON object");
  expect_invalid([] { parse_oar_config("{not json"); }, "not valid JSON");
}

TEST(Config, BaselineDefaultsFollowMethodMd) {
  const OARConfig c = parse_oar_config("{}");
  // method.md section 8: entropy shaping alpha 0.4, kappa 2; KTAE squashed to (-1, 1), both terms weighted 1.
  EXPECT_DOUBLE_EQ(c.entropy_shaping.alpha, 0.4);
  EXPECT_DOUBLE_EQ(c.entropy_shaping.kappa, 2.0);
  EXPECT_DOUBLE_EQ(c.ktae.alpha, 1.0);
  EXPECT_DOUBLE_EQ(c.ktae.beta, 1.0);
  EXPECT_TRUE(c.ktae.tf);
  EXPECT_DOUBLE_EQ(c.ktae.scale, 1.0);
  EXPECT_DOUBLE_EQ(c.ktae.threshold, 0.0);
}

TEST(Config, BaselineParametersParseAndRoundTrip) {
  const OARConfig c = parse_oar_config(R"({"method": "ktae", "entropy_alpha": 0.2, "entropy_kappa": 4,
    "ktae_alpha": 0.5, "ktae_beta": 0, "ktae_tf": false, "ktae_scale": 2.5, "ktae_threshold": 0.5})");
  EXPECT_EQ(c.method, Method::kKtae);
  EXPECT_DOUBLE_EQ(c.entropy_shaping.alpha, 0.2);
  EXPECT_DOUBLE_EQ(c.entropy_shaping.kappa, 4.0);
  EXPECT_DOUBLE_EQ(c.ktae.alpha, 0.5);
  EXPECT_DOUBLE_EQ(c.ktae.beta, 0.0);
  EXPECT_FALSE(c.ktae.tf);
  EXPECT_DOUBLE_EQ(c.ktae.scale, 2.5);
  EXPECT_DOUBLE_EQ(c.ktae.threshold, 0.5);
  const OARConfig again = parse_oar_config(to_json(c));
  EXPECT_EQ(to_json(again), to_json(c));
  EXPECT_EQ(again.method, Method::kKtae);
  EXPECT_FALSE(again.ktae.tf);
}

TEST(Config, DrGrpoMethodSelectsTheDrGrpoEstimator) {
  EXPECT_EQ(parse_oar_config(R"({"method": "dr_grpo"})").advantages.estimator, Estimator::kDrGrpo);
  EXPECT_EQ(parse_oar_config(R"({"method": "dr_grpo", "estimator": "dr_grpo"})").advantages.estimator,
            Estimator::kDrGrpo);
  // Other methods keep the estimator they are given (default grpo).
  EXPECT_EQ(parse_oar_config(R"({"method": "oar_p"})").advantages.estimator, Estimator::kGrpo);
  EXPECT_EQ(parse_oar_config(R"({"method": "oar_p", "estimator": "dr_grpo"})").advantages.estimator,
            Estimator::kDrGrpo);
  expect_invalid([] { parse_oar_config(R"({"method": "dr_grpo", "estimator": "grpo"})"); }, "oar.estimator must be");
  // The dr_grpo estimator survives a round trip.
  const OARConfig c = parse_oar_config(R"({"method": "dr_grpo", "preset": "trl"})");
  EXPECT_EQ(parse_oar_config(to_json(c)).advantages.estimator, Estimator::kDrGrpo);
  EXPECT_DOUBLE_EQ(c.advantages.eps, 1e-4);
}

TEST(Config, BaselineParameterErrorsNameTheKey) {
  expect_invalid([] { parse_oar_config(R"({"entropy_alpha": -0.1})"); }, "oar.entropy_alpha must be >= 0");
  expect_invalid([] { parse_oar_config(R"({"entropy_kappa": 0})"); }, "oar.entropy_kappa must be > 0");
  expect_invalid([] { parse_oar_config(R"({"entropy_kappa": "two"})"); }, "oar.entropy_kappa must be a number");
  expect_invalid([] { parse_oar_config(R"({"ktae_alpha": -1})"); }, "oar.ktae_alpha must be >= 0");
  expect_invalid([] { parse_oar_config(R"({"ktae_beta": -1})"); }, "oar.ktae_beta must be >= 0");
  expect_invalid([] { parse_oar_config(R"({"ktae_alpha": 0, "ktae_beta": 0})"); }, "both weights are 0");
  expect_invalid([] { parse_oar_config(R"({"ktae_scale": 0})"); }, "oar.ktae_scale must be > 0");
  expect_invalid([] { parse_oar_config(R"({"ktae_tf": 1})"); }, "oar.ktae_tf must be true or false");
  expect_invalid([] { parse_oar_config(R"({"ktae_threshold": null})"); }, "oar.ktae_threshold must be a number");
  expect_invalid([] { parse_oar_config(R"({"method": "entropy-shaping"})"); }, "\"entropy_shaping\"");
}
