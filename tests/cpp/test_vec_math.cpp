// The multi-ISA float loops of src/core/vec_math.h (internal) against the C library in double.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "../../src/core/vec_math.h"

namespace {

double rel_err(double got, double want) { return std::abs(got - want) / std::max(std::abs(want), 1e-300); }

TEST(VecMath, ExpShiftedSumMatchesLibm) {
  std::mt19937 rng(0);
  std::uniform_real_distribution<float> dist(-80.0f, 0.0f);
  std::vector<float> z(4099), e(z.size());
  for (auto& v : z) v = dist(rng);
  z[7] = 0.0f;
  z[8] = -std::numeric_limits<float>::infinity();
  const float sum = oar::core::detail::vexp_shifted_sum(z.data(), 0.5f, e.data(), static_cast<int64_t>(z.size()));
  double want_sum = 0.0, max_rel = 0.0;
  for (size_t i = 0; i < z.size(); ++i) {
    // The argument z - m is formed in float (as the kernels do): compare the exp of that float.
    const double want = std::exp(static_cast<double>(z[i] - 0.5f));
    want_sum += want;
    if (want > 1e-30) max_rel = std::max(max_rel, rel_err(e[i], want));
  }
  EXPECT_LT(max_rel, 4e-7);                 // a few ulp
  EXPECT_LT(e[8], 1e-37f);                  // -inf: negligible (documented ~1.2e-38)
  EXPECT_LT(rel_err(sum, want_sum), 1e-6);  // float accumulation across lanes
}

TEST(VecMath, Log1pMatchesLibm) {
  std::vector<float> x;
  for (float v = 0.0f; v < 1e30f; v = v * 1.37f + 1e-7f) x.push_back(v);
  x.push_back(1e-30f);
  x.push_back(0.5f);
  x.push_back(std::numeric_limits<float>::max());
  std::vector<float> out(x.size());
  oar::core::detail::vlog1p(x.data(), out.data(), static_cast<int64_t>(x.size()));
  double max_rel = 0.0;
  for (size_t i = 0; i < x.size(); ++i) max_rel = std::max(max_rel, rel_err(out[i], std::log1p(double(x[i]))));
  EXPECT_LT(max_rel, 4e-7) << "over " << x.size() << " arguments in [0, FLT_MAX]";
  EXPECT_EQ(out[0], 0.0f);  // log1p(0) is exactly 0
}

TEST(VecMath, MaxAndDots) {
  std::vector<float> a{1.0f, -2.0f, 3.5f, 0.25f, -std::numeric_limits<float>::infinity()};
  std::vector<float> b{2.0f, 1.0f, -1.0f, 4.0f, 0.0f};
  EXPECT_EQ(oar::core::detail::vmax(a.data(), 5), 3.5f);
  EXPECT_FLOAT_EQ(oar::core::detail::vdot(a.data(), b.data(), 4), 2.0f - 2.0f - 3.5f + 1.0f);
  // vdot_diff: -inf clean entries contribute 0 even against -inf perturbed ones
  std::vector<float> e{1.0f, 1.0f, 1.0f, 1.0f, 1.0f}, zp{0.0f, 0.0f, 0.0f, 0.0f, -std::numeric_limits<float>::infinity()};
  EXPECT_FLOAT_EQ(oar::core::detail::vdot_diff(e.data(), a.data(), zp.data(), 5), 1.0f - 2.0f + 3.5f + 0.25f);
}

}  // namespace
