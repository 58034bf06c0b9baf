// grad x input reduction (method.md section 4) against a double-precision loop written here.
#include <gtest/gtest.h>

#include <Eigen/Core>

#include <cmath>
#include <random>
#include <vector>

#include "oar/core/common.h"
#include "oar/core/grad_input.h"
#include "test_util.h"

namespace {

template <typename T>
struct GradInputTyped : ::testing::Test {};
using ElementTypes = ::testing::Types<float, double, Eigen::half, Eigen::bfloat16>;
TYPED_TEST_SUITE(GradInputTyped, ElementTypes);

TYPED_TEST(GradInputTyped, MatchesDoubleReference) {
  using T = TypeParam;
  std::mt19937 rng(0);
  std::normal_distribution<double> d(0.0, 1.0);
  // 1 and 47: tails shorter than a SIMD packet; 1500: crosses the 1024-wide widening block of 16-bit types.
  for (int64_t H : {int64_t{1}, int64_t{47}, int64_t{576}, int64_t{1500}}) {
    const int64_t rows = 13;
    std::vector<T> g(static_cast<size_t>(rows * H)), x(static_cast<size_t>(rows * H));
    for (auto& v : g) v = static_cast<T>(static_cast<float>(d(rng)));
    for (auto& v : x) v = static_cast<T>(static_cast<float>(d(rng)));
    std::vector<float> out(rows, -1.0f);
    oar::core::grad_x_input<T>(g.data(), x.data(), rows, H, out.data());
    for (int64_t r = 0; r < rows; ++r) {
      double want = 0.0, mag = 0.0;
      for (int64_t h = 0; h < H; ++h) {
        const double prod = static_cast<double>(static_cast<float>(g[r * H + h])) *
                            static_cast<double>(static_cast<float>(x[r * H + h]));
        want += prod;
        mag += std::fabs(prod);
      }
      want = std::fabs(want);
      // float32 accumulation of H products in any order: gamma_{H+1} sum |products| (then |.|, exact).
      EXPECT_NEAR(out[r], want, oar::testing::sum_error_bound(H + 1, mag)) << "H=" << H << " r=" << r;
      EXPECT_GE(out[r], 0.0f);
    }
  }
}

TEST(GradInput, HandComputedRows) {
  // Row 0: 1*2 + (-3)*1 + 0.5*4 = 1; row 1: -(1*1 + 2*2 + 3*3) = -14 -> 14 (absolute value).
  const std::vector<float> g = {1.0f, -3.0f, 0.5f, -1.0f, -2.0f, -3.0f};
  const std::vector<float> x = {2.0f, 1.0f, 4.0f, 1.0f, 2.0f, 3.0f};
  std::vector<float> out(2);
  oar::core::grad_x_input<float>(g.data(), x.data(), 2, 3, out.data());
  EXPECT_EQ(out[0], 1.0f);  // small dyadic products and sums: exact in any order
  EXPECT_EQ(out[1], 14.0f);
}

TEST(GradInput, EmptyShapes) {
  std::vector<float> out(3, -1.0f);
  oar::core::grad_x_input<float>(nullptr, nullptr, 0, 8, out.data());  // no rows: nothing written
  EXPECT_EQ(out[0], -1.0f);
  oar::core::grad_x_input<float>(nullptr, nullptr, 3, 0, out.data());  // H = 0: empty sums
  for (float v : out) EXPECT_EQ(v, 0.0f);
}

TEST(GradInput, BadSizesThrow) {
  float out = 0.0f;
  EXPECT_THROW(oar::core::grad_x_input<float>(nullptr, nullptr, -1, 4, &out), oar::core::InvalidArgument);
  EXPECT_THROW(oar::core::grad_x_input<float>(nullptr, nullptr, 1, -4, &out), oar::core::InvalidArgument);
  EXPECT_THROW(oar::core::grad_x_input<float>(nullptr, nullptr, 1, 4, &out), oar::core::InvalidArgument);
}

}  // namespace
