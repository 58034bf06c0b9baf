// GoogleTest for oar::core::group_advantages (method.md section 1). Expected values are computed by hand
// (noted next to each) or from the defining formulas written out in the test, never from the code under test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "oar/core/group_advantages.h"
#include "test_util.h"

using oar::testing::error_of;
using oar::testing::gamma;
using oar::testing::kU32;
using oar::testing::ulps_f32;

namespace oar::core {
namespace {

const double kNaN = std::numeric_limits<double>::quiet_NaN();

GroupAdvantageOptions opts_of(Estimator e, double eps = 1e-6, StdKind s = StdKind::kUnbiased,
                              SingletonPolicy p = SingletonPolicy::kZero, bool skip_nan = false) {
  GroupAdvantageOptions o;
  o.estimator = e;
  o.eps = eps;
  o.std_kind = s;
  o.singleton = p;
  o.skip_nan = skip_nan;
  return o;
}

template <typename T>
std::vector<float> run(const std::vector<T>& r, const std::vector<int64_t>& off, const GroupAdvantageOptions& o,
                       GroupAdvantageStats* st = nullptr) {
  std::vector<float> out(r.size(), -123.0f);
  const auto s = group_advantages(r.data(), static_cast<int64_t>(r.size()), off.data(),
                                  static_cast<int64_t>(off.size()) - 1, o, out.data());
  if (st) *st = s;
  return out;
}


TEST(GroupAdvantages, GrpoUnbiasedHandComputed) {
  // {1, 0, 1, 0}: mean 0.5, squared deviations 4 x 0.25 = 1, unbiased var 1/3, std 0.577350269.
  const std::vector<float> r{1, 0, 1, 0};
  const auto a = run(r, {0, 4}, opts_of(Estimator::kGrpo, 1e-6));
  const double d = 0.5 / (std::sqrt(1.0 / 3.0) + 1e-6);
  // Statistics in float64, one rounding to float32: within an ulp (half for the rounding, half for a float64
  // value that differs from this one by float64 rounding on a float32 boundary).
  EXPECT_NEAR(a[0], d, ulps_f32(1, d));
  EXPECT_NEAR(a[1], -d, ulps_f32(1, d));
  EXPECT_NEAR(a[2], d, ulps_f32(1, d));
  EXPECT_NEAR(a[3], -d, ulps_f32(1, d));
}

TEST(GroupAdvantages, GrpoBiasedHandComputed) {
  // {2, 4, 9}: mean 5, deviations -3 -1 4, ssq 26, biased var 26/3.
  const std::vector<double> r{2, 4, 9};
  const auto a = run(r, {0, 3}, opts_of(Estimator::kGrpo, 0.0, StdKind::kBiased));
  const double sd = std::sqrt(26.0 / 3.0);
  EXPECT_NEAR(a[0], -3 / sd, ulps_f32(1, 3 / sd));  // as above
  EXPECT_NEAR(a[1], -1 / sd, ulps_f32(1, 1 / sd));
  EXPECT_NEAR(a[2], 4 / sd, ulps_f32(1, 4 / sd));
}

TEST(GroupAdvantages, DrGrpoIsCentredReward) {
  const std::vector<float> r{3, 1, 2, 10, 20};
  const auto a = run(r, {0, 3, 5}, opts_of(Estimator::kDrGrpo));
  const std::vector<float> want{1, -1, 0, -5, 5};  // means 2 and 15: exact in float64
  for (size_t i = 0; i < r.size(); ++i) EXPECT_EQ(a[i], want[i]) << i;
}

TEST(GroupAdvantages, RlooLeaveOneOut) {
  // {1, 0, 0}: A0 = 1 - (0+0)/2 = 1, A1 = 0 - (1+0)/2 = -0.5, A2 = -0.5.
  // {4, 2}:    A0 = 4 - 2 = 2,       A1 = 2 - 4 = -2.
  const std::vector<float> r{1, 0, 0, 4, 2};
  const auto a = run(r, {0, 3, 5}, opts_of(Estimator::kRloo));
  const std::vector<float> want{1, -0.5f, -0.5f, 2, -2};  // dyadic: exact
  for (size_t i = 0; i < r.size(); ++i) EXPECT_EQ(a[i], want[i]) << i;
}

TEST(GroupAdvantages, BatchUsesBatchStdAndGroupMean) {
  // Batch {1, 0, 1, 1}: mean 0.75, ssq 3 x 0.0625 + 0.5625 = 0.75, unbiased var 0.25, std 0.5.
  // Group {1, 0}: mean 0.5 -> +-0.5 / 0.5 = +-1. Group {1, 1}: all equal -> 0.
  const std::vector<float> r{1, 0, 1, 1};
  GroupAdvantageStats st;
  const auto a = run(r, {0, 2, 4}, opts_of(Estimator::kBatch, 0.0), &st);
  EXPECT_EQ(a[0], 1.0f);  // 0.5 / sqrt(0.25): exact
  EXPECT_EQ(a[1], -1.0f);
  EXPECT_EQ(a[2], 0.0f);
  EXPECT_EQ(a[3], 0.0f);
  EXPECT_EQ(st.zero_std_groups, 1);
}

TEST(GroupAdvantages, AllEqualGroupIsExactlyZero) {
  // 0.1f is not representable: a float mean of three copies need not equal 0.1f, so a std-based check
  // could leave tiny non-zero values scaled by 1/eps. The value comparison must give exact zeros.
  for (Estimator e : {Estimator::kGrpo, Estimator::kDrGrpo, Estimator::kBatch, Estimator::kRloo}) {
    const std::vector<float> r{0.1f, 0.1f, 0.1f, 123456.7f, 123456.7f, 123456.7f, 123456.7f, 123456.7f};
    GroupAdvantageStats st;
    const auto a = run(r, {0, 3, 8}, opts_of(e, 0.0), &st);
    for (float v : a) EXPECT_EQ(v, 0.0f) << "estimator " << static_cast<int>(e);
    EXPECT_EQ(st.zero_std_groups, 2);
  }
}

TEST(GroupAdvantages, SingletonZeroAndVerlQuirk) {
  const std::vector<float> r{3, 1, 0};  // group {3} and group {1, 0}
  const std::vector<int64_t> off{0, 1, 3};
  GroupAdvantageStats st;
  EXPECT_EQ(run(r, off, opts_of(Estimator::kGrpo), &st)[0], 0.0f);
  EXPECT_EQ(st.singleton_groups, 1);
  // verl: mean 0, std 1 -> 3 / (1 + eps) for grpo, 3 for dr_grpo and rloo.
  const double eps = 1e-6;
  EXPECT_NEAR(run(r, off, opts_of(Estimator::kGrpo, eps, StdKind::kUnbiased, SingletonPolicy::kVerl))[0],
              3 / (1 + eps), ulps_f32(1, 3.0));  // one division in float64, rounded once
  EXPECT_EQ(run(r, off, opts_of(Estimator::kDrGrpo, eps, StdKind::kUnbiased, SingletonPolicy::kVerl))[0], 3.0f);
  EXPECT_EQ(run(r, off, opts_of(Estimator::kRloo, eps, StdKind::kUnbiased, SingletonPolicy::kVerl))[0], 3.0f);
  // batch: batch std of {3, 1, 0}: mean 4/3, ssq = (5/3)^2 + (1/3)^2 + (4/3)^2 = 42/9, var 7/3.
  const double bstd = std::sqrt(7.0 / 3.0);
  EXPECT_NEAR(run(r, off, opts_of(Estimator::kBatch, eps, StdKind::kUnbiased, SingletonPolicy::kVerl))[0],
              3 / (bstd + eps), ulps_f32(1, 3 / bstd));
  // The regular group is unaffected by the policy: {1, 0} -> +-0.5 / (sqrt(0.5) + eps).
  const auto a = run(r, off, opts_of(Estimator::kGrpo, eps, StdKind::kUnbiased, SingletonPolicy::kVerl));
  EXPECT_NEAR(a[1], 0.5 / (std::sqrt(0.5) + eps), ulps_f32(1, 0.71));
  EXPECT_NEAR(a[2], -0.5 / (std::sqrt(0.5) + eps), ulps_f32(1, 0.71));
}

TEST(GroupAdvantages, EmptyGroupsAndEmptyInput) {
  const std::vector<float> r{1, 0};
  GroupAdvantageStats st;
  const auto a = run(r, {0, 0, 2, 2}, opts_of(Estimator::kDrGrpo), &st);
  EXPECT_EQ(a[0], 0.5f);  // exact
  EXPECT_EQ(a[1], -0.5f);
  EXPECT_EQ(st.num_groups, 3);
  EXPECT_EQ(st.empty_groups, 2);

  const std::vector<float> none;
  const std::vector<int64_t> off0{0};
  EXPECT_NO_THROW(run(none, off0, opts_of(Estimator::kGrpo)));
}

TEST(GroupAdvantages, NanRaisesUnlessSkipped) {
  const std::vector<double> r{1, kNaN, 0};
  const std::string msg = error_of([&] { run(r, {0, 3}, opts_of(Estimator::kGrpo)); });
  EXPECT_NE(msg.find("rewards[1]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("skip_nan"), std::string::npos) << msg;

  GroupAdvantageStats st;
  const auto a = run(r, {0, 3}, opts_of(Estimator::kGrpo, 0.0, StdKind::kUnbiased, SingletonPolicy::kZero, true), &st);
  // The NaN row is excluded: {1, 0}, unbiased std sqrt(0.5), A = +-0.5 / sqrt(0.5) = +-sqrt(0.5).
  EXPECT_NEAR(a[0], std::sqrt(0.5), ulps_f32(1, 0.71));
  EXPECT_EQ(a[1], 0.0f);
  EXPECT_NEAR(a[2], -std::sqrt(0.5), ulps_f32(1, 0.71));
  EXPECT_EQ(st.nan_rows, 1);

  // A group left with one valid reward is a singleton; an all-NaN group is empty.
  const std::vector<float> r2{2, static_cast<float>(kNaN), static_cast<float>(kNaN), static_cast<float>(kNaN)};
  const auto skip = opts_of(Estimator::kGrpo, 1e-6, StdKind::kUnbiased, SingletonPolicy::kZero, true);
  const auto b = run(r2, {0, 2, 4}, skip, &st);
  for (float v : b) EXPECT_EQ(v, 0.0f);
  EXPECT_EQ(st.singleton_groups, 1);
  EXPECT_EQ(st.empty_groups, 1);
}

TEST(GroupAdvantages, InfAlwaysRaises) {
  const std::vector<float> r{1, std::numeric_limits<float>::infinity()};
  for (bool skip : {false, true}) {
    const std::string msg = error_of(
        [&] { run(r, {0, 2}, opts_of(Estimator::kGrpo, 1e-6, StdKind::kUnbiased, SingletonPolicy::kZero, skip)); });
    EXPECT_NE(msg.find("rewards[1]"), std::string::npos) << msg;
  }
}

TEST(GroupAdvantages, MalformedOffsetsNameTheArgument) {
  const std::vector<float> r{1, 2, 3, 4};
  const auto o = opts_of(Estimator::kGrpo);
  std::string msg = error_of([&] { run(r, {1, 4}, o); });
  EXPECT_NE(msg.find("offsets[0] must be 0"), std::string::npos) << msg;
  msg = error_of([&] { run(r, {0, 3, 2, 4}, o); });
  EXPECT_NE(msg.find("non-decreasing"), std::string::npos) << msg;
  msg = error_of([&] { run(r, {0, 2, 3}, o); });
  EXPECT_NE(msg.find("N = 4"), std::string::npos) << msg;
  EXPECT_NE(msg.find("got 3"), std::string::npos) << msg;
  msg = error_of([&] { run(r, {0, 2, 5}, o); });
  EXPECT_NE(msg.find("offsets"), std::string::npos) << msg;
  // check_offsets on its own, with a custom argument name.
  const std::vector<int64_t> bad{0, 5, 4};
  msg = error_of([&] { check_offsets(bad.data(), 2, 4, "group_offsets"); });
  EXPECT_NE(msg.find("group_offsets"), std::string::npos) << msg;
}

TEST(GroupAdvantages, BadEpsRaises) {
  const std::vector<float> r{1, 0};
  EXPECT_NE(error_of([&] { run(r, {0, 2}, opts_of(Estimator::kGrpo, -1e-3)); }).find("eps"), std::string::npos);
  EXPECT_NE(error_of([&] { run(r, {0, 2}, opts_of(Estimator::kGrpo, kNaN)); }).find("eps"), std::string::npos);
}

TEST(GroupAdvantages, Presets) {
  auto t = preset_options("trl", Estimator::kBatch);
  EXPECT_EQ(t.estimator, Estimator::kBatch);
  EXPECT_EQ(t.std_kind, StdKind::kUnbiased);
  EXPECT_DOUBLE_EQ(t.eps, 1e-4);
  EXPECT_EQ(t.singleton, SingletonPolicy::kZero);
  auto v = preset_options("verl", Estimator::kGrpo);
  EXPECT_DOUBLE_EQ(v.eps, 1e-6);
  EXPECT_EQ(v.singleton, SingletonPolicy::kVerl);
  auto o = preset_options("openrlhf", Estimator::kRloo);
  EXPECT_DOUBLE_EQ(o.eps, 1e-9);
  EXPECT_EQ(o.singleton, SingletonPolicy::kZero);
  auto d = preset_options("default", Estimator::kGrpo);
  EXPECT_DOUBLE_EQ(d.eps, 1e-6);
  EXPECT_EQ(d.singleton, SingletonPolicy::kZero);
  const std::string msg = error_of([] { preset_options("deepspeed", Estimator::kGrpo); });
  EXPECT_NE(msg.find("preset"), std::string::npos) << msg;
  EXPECT_NE(msg.find("deepspeed"), std::string::npos) << msg;
}

TEST(GroupAdvantages, FloatAndDoubleAgree) {
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> u(-2, 2);
  std::vector<float> rf(101);
  for (auto& v : rf) v = u(gen);
  const std::vector<double> rd(rf.begin(), rf.end());
  const std::vector<int64_t> off{0, 3, 3, 50, 51, 101};
  for (Estimator e : {Estimator::kGrpo, Estimator::kDrGrpo, Estimator::kBatch, Estimator::kRloo}) {
    const auto a = run(rf, off, opts_of(e));
    const auto b = run(rd, off, opts_of(e));
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << i;
  }
}

// Invariants over random ragged groups: per-group sums vanish (grpo, dr_grpo, rloo), grpo is invariant to
// shifting and (with eps = 0) to positive scaling, rloo = m / (m - 1) x dr_grpo.
TEST(GroupAdvantages, RandomInvariants) {
  std::mt19937 gen(123);
  std::uniform_real_distribution<double> u(-3, 3);
  std::uniform_int_distribution<int> size(0, 9);
  for (int trial = 0; trial < 30; ++trial) {
    std::vector<int64_t> off{0};
    for (int g = 0; g < 13; ++g) off.push_back(off.back() + size(gen));
    std::vector<double> r(static_cast<size_t>(off.back()));
    for (auto& v : r) v = u(gen);
    std::vector<double> shifted(r), scaled(r);
    for (auto& v : shifted) v += 5.0;
    for (auto& v : scaled) v *= 3.0;
    const auto g0 = run(r, off, opts_of(Estimator::kGrpo, 0.0));
    const auto g1 = run(shifted, off, opts_of(Estimator::kGrpo, 0.0));
    const auto g2 = run(scaled, off, opts_of(Estimator::kGrpo, 0.0));
    const auto dr = run(r, off, opts_of(Estimator::kDrGrpo));
    const auto rl = run(r, off, opts_of(Estimator::kRloo));
    for (size_t g = 0; g + 1 < off.size(); ++g) {
      double s0 = 0, sd = 0, sr = 0, a0 = 0, ad = 0, ar = 0;
      const int64_t m = off[g + 1] - off[g];
      // Every output is a float64 statistic rounded once to float32 (half an ulp). The float64 statistics
      // themselves are off by at most gamma_{4m+8} of the inputs' scale (|r| <= 3, shifted by 5, scaled by 3),
      // divided by the group's std for grpo.
      double mean = 0, ssq = 0;
      for (int64_t i = off[g]; i < off[g + 1]; ++i) mean += r[i] / m;
      for (int64_t i = off[g]; i < off[g + 1]; ++i) ssq += (r[i] - mean) * (r[i] - mean);
      const double sdev = m > 1 ? std::sqrt(ssq / (m - 1)) : 1.0;
      const double f64 = gamma(4 * m + 8, 0x1p-53) * 24.0 / (sdev > 0 ? std::min(sdev, 1.0) : 1.0);
      for (int64_t i = off[g]; i < off[g + 1]; ++i) {
        s0 += g0[i], sd += dr[i], sr += rl[i];
        a0 += std::fabs(g0[i]), ad += std::fabs(dr[i]), ar += std::fabs(rl[i]);
        EXPECT_NEAR(g0[i], g1[i], ulps_f32(1, std::fabs(g0[i]) + f64) + 2 * f64);
        EXPECT_NEAR(g0[i], g2[i], ulps_f32(1, std::fabs(g0[i]) + f64) + 2 * f64);
        if (m >= 2) {  // rl = r - (S - r) / (m - 1) = m / (m - 1) (r - S / m): both rounded once, dr scaled exactly
          const double want = static_cast<double>(dr[i]) * m / (m - 1.0);
          EXPECT_NEAR(rl[i], want, ulps_f32(0.5, rl[i]) + ulps_f32(0.5, want) + 2 * f64);
        }
      }
      // The exact statistics sum to 0 over a group: what is left is one float32 rounding per term (u |A_i|), the
      // float64 errors, and the float64 sum of at most 9 terms here.
      EXPECT_LE(std::fabs(s0), (kU32 + gamma(m, 0x1p-53)) * a0 + m * f64);
      EXPECT_LE(std::fabs(sd), (kU32 + gamma(m, 0x1p-53)) * ad + m * f64);
      EXPECT_LE(std::fabs(sr), (kU32 + gamma(m, 0x1p-53)) * ar + m * f64);
    }
  }
}

}  // namespace
}  // namespace oar::core
