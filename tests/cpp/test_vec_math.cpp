// The multi-ISA float loops of src/core/vec_math.h (internal) against the C library in double, on every ISA
// level this machine can run (oar::core::set_cpu_isa; levels it cannot run are reported as skipped), and the
// level switch itself (oar/core/cpu_isa.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../../src/core/vec_math.h"
#include "oar/core/cpu_isa.h"
#include "test_util.h"

namespace {

namespace vm = oar::core::detail;
using oar::core::CpuIsa;
using oar::testing::expect_invalid;
using oar::testing::gamma;
using oar::testing::sum_error_bound;
using oar::testing::ulps_f32;

constexpr float kInfF = std::numeric_limits<float>::infinity();
const CpuIsa kAllIsas[] = {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512f};

// ---- the level switch -----------------------------------------------------------------------------------

TEST(CpuIsa, NamesRoundTripAndUnknownNamesAreRefused) {
  for (CpuIsa isa : kAllIsas) EXPECT_EQ(oar::core::parse_cpu_isa(oar::core::to_string(isa)), isa);
  expect_invalid([] { oar::core::parse_cpu_isa("sse4", "OAR_CPU_ISA"); },
                 "OAR_CPU_ISA must be one of {avx512f, avx2, baseline}, got \"sse4\"");
}

TEST(CpuIsa, SupportedLevelsAreOrderedAndEndWithBaseline) {
  const auto sup = oar::core::supported_cpu_isas();
  ASSERT_FALSE(sup.empty());
  EXPECT_EQ(sup.back(), CpuIsa::kBaseline);
  for (size_t i = 1; i < sup.size(); ++i) EXPECT_GT(static_cast<int>(sup[i - 1]), static_cast<int>(sup[i]));
  for (CpuIsa isa : kAllIsas)
    EXPECT_EQ(oar::core::cpu_isa_supported(isa), std::find(sup.begin(), sup.end(), isa) != sup.end());
#if defined(__x86_64__) && !defined(OAR_NO_MULTI_ISA)
  // The same CPU model the loader reads: AVX2 is offered exactly when the CPU (and OS) have it.
  __builtin_cpu_init();
  EXPECT_EQ(oar::core::cpu_isa_supported(CpuIsa::kAvx2), static_cast<bool>(__builtin_cpu_supports("avx2")));
  EXPECT_EQ(oar::core::cpu_isa_supported(CpuIsa::kAvx512f), static_cast<bool>(__builtin_cpu_supports("avx512f")));
#endif
}

TEST(CpuIsa, SetSwitchesEverySupportedLevelAndRefusesTheOthers) {
  const CpuIsa before = oar::core::cpu_isa();
  for (CpuIsa isa : kAllIsas) {
    if (oar::core::cpu_isa_supported(isa)) {
      oar::core::set_cpu_isa(isa);
      EXPECT_EQ(oar::core::cpu_isa(), isa);
      EXPECT_STREQ(vm::vec_math_isa(), oar::core::to_string(isa));
      EXPECT_EQ(oar::core::cpu_isa_source(), "set_cpu_isa");
    } else {
      expect_invalid([isa] { oar::core::set_cpu_isa(isa); },
                     std::string("cannot run the ") + oar::core::to_string(isa) + " loops; supported here:");
      EXPECT_NE(oar::core::cpu_isa(), isa);  // the refused call changed nothing
    }
  }
  oar::core::set_cpu_isa(before);
}

// ---- the loops, on each level -----------------------------------------------------------------------------

class VecMathOnIsa : public ::testing::TestWithParam<CpuIsa> {
 protected:
  void SetUp() override {
    if (!oar::core::cpu_isa_supported(GetParam()))
      GTEST_SKIP() << oar::core::to_string(GetParam()) << " is not supported on this machine";
    before_ = oar::core::cpu_isa();
    oar::core::set_cpu_isa(GetParam());
  }
  void TearDown() override {
    if (oar::core::cpu_isa_supported(GetParam())) oar::core::set_cpu_isa(before_);
  }
  CpuIsa before_ = CpuIsa::kBaseline;
};

// vec_math.h documents exp_poly at ~2 ulp (Cephes expf: range reduction by a 2-part ln 2, degree-5 minimax
// polynomial); the budget is 3 ulp of the result, plus for the sum the float32 accumulation bound.
TEST_P(VecMathOnIsa, ExpShiftedSumMatchesLibm) {
  std::mt19937 rng(0);
  std::uniform_real_distribution<float> dist(-80.0f, 0.0f);
  std::vector<float> z(4099), e(z.size());
  for (auto& v : z) v = dist(rng);
  z[7] = 0.0f;
  z[8] = -kInfF;
  const auto n = static_cast<int64_t>(z.size());
  const float sum = vm::vexp_shifted_sum(z.data(), 0.5f, e.data(), n);
  double want_sum = 0.0, elem_err = 0.0;
  for (size_t i = 0; i < z.size(); ++i) {
    // The argument z - m is formed in float (as the kernels do): compare the exp of that float.
    const double want = std::exp(static_cast<double>(z[i] - 0.5f));
    want_sum += want;
    if (std::isfinite(z[i])) EXPECT_LE(std::abs(e[i] - want), ulps_f32(3, want)) << "z=" << z[i];
    elem_err += std::abs(e[i] - want);
  }
  EXPECT_LT(e[8], 1e-37f);  // -inf: negligible (documented ~1.2e-38)
  // The sum of the computed terms: their own error plus gamma_{n-1} of the float32 accumulation.
  EXPECT_LE(std::abs(sum - want_sum), elem_err + sum_error_bound(n, want_sum));
}

TEST_P(VecMathOnIsa, ExpShiftedScaledMatchesLibm) {
  std::vector<float> z;
  for (float v = -87.0f; v <= 0.0f; v += 0.37f) z.push_back(v);
  std::vector<float> out(z.size());
  vm::vexp_shifted_scaled(z.data(), -1.0f, 0.25f, out.data(), static_cast<int64_t>(z.size()));
  for (size_t i = 0; i < z.size(); ++i) {
    const double want = std::exp(static_cast<double>(z[i] + 1.0f)) * 0.25;  // z - (-1) is exact here
    EXPECT_LE(std::abs(out[i] - want), ulps_f32(3, want)) << "z=" << z[i];  // 2-3 ulp of exp, exact * 0.25
  }
}

// vec_math.h documents vlog1p at ~2 ulp (Cephes logf of 1 + x with the rounding correction): 3 ulp budget.
TEST_P(VecMathOnIsa, Log1pMatchesLibm) {
  std::vector<float> x;
  for (float v = 0.0f; v < 1e30f; v = v * 1.37f + 1e-7f) x.push_back(v);
  x.push_back(1e-30f);
  x.push_back(0.5f);
  x.push_back(std::numeric_limits<float>::max());
  std::vector<float> out(x.size());
  vm::vlog1p(x.data(), out.data(), static_cast<int64_t>(x.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = std::log1p(static_cast<double>(x[i]));
    EXPECT_LE(std::abs(out[i] - want), ulps_f32(3, want)) << "x=" << x[i];
  }
  EXPECT_EQ(out[0], 0.0f);  // log1p(0) is exactly 0
}

// Small dyadic values: every product and partial sum is exact in float32, so any order gives the exact value.
TEST_P(VecMathOnIsa, MaxAndDotsAreExactOnExactData) {
  std::vector<float> a{1.0f, -2.0f, 3.5f, 0.25f, -kInfF};
  std::vector<float> b{2.0f, 1.0f, -1.0f, 4.0f, 0.0f};
  EXPECT_EQ(vm::vmax(a.data(), 5), 3.5f);
  EXPECT_EQ(vm::vdot(a.data(), b.data(), 4), 2.0f - 2.0f - 3.5f + 1.0f);
  // vdot_diff: -inf clean entries contribute 0 even against -inf perturbed ones
  std::vector<float> e{1.0f, 1.0f, 1.0f, 1.0f, 1.0f}, zp{0.0f, 0.0f, 0.0f, 0.0f, -kInfF};
  EXPECT_EQ(vm::vdot_diff(e.data(), a.data(), zp.data(), 5), 1.0f - 2.0f + 3.5f + 0.25f);
  std::vector<float> all_neg_inf(37, -kInfF);
  EXPECT_EQ(vm::vmax(all_neg_inf.data(), 37), -kInfF);
}

// Random data: the dot products against a float64 sum, within gamma_n of the sum of |products|.
TEST_P(VecMathOnIsa, DotsWithinTheFloat32SumBound) {
  std::mt19937 rng(1);
  std::normal_distribution<float> d(0.0f, 3.0f);
  for (int64_t n : {1, 3, 47, 131, 4099}) {
    std::vector<float> a(n), b(n), zp(n);
    for (int64_t i = 0; i < n; ++i) a[i] = d(rng), b[i] = d(rng), zp[i] = d(rng);
    double want = 0.0, abs_sum = 0.0, want_diff = 0.0, abs_diff = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      want += double(a[i]) * b[i];
      abs_sum += std::abs(double(a[i]) * b[i]);
      want_diff += double(a[i]) * (double(b[i]) - zp[i]);
      abs_diff += std::abs(double(a[i]) * (double(b[i]) - zp[i]));
    }
    // Each term passes through one product rounding and n - 1 additions: gamma_n; vdot_diff first rounds
    // zc - zp to float: gamma_{n+1}.
    EXPECT_LE(std::abs(vm::vdot(a.data(), b.data(), n) - want), gamma(n) * abs_sum) << n;
    EXPECT_LE(std::abs(vm::vdot_diff(a.data(), b.data(), zp.data(), n) - want_diff), gamma(n + 1) * abs_diff) << n;
    float m = a[0];
    for (int64_t i = 1; i < n; ++i) m = std::max(m, a[i]);
    EXPECT_EQ(vm::vmax(a.data(), n), m) << n;  // max is exact
  }
}

// The per-level copy really runs: a float32 sum of [2^24, 1, 1, ...] keeps the ones only in the accumulators
// that do not hold 2^24 (2^24 + 1 rounds back to 2^24), so the result reveals how many partial sums the loop
// keeps: 2^24 + n - n / W for W accumulators (every partial sum is an even integer below 2^25: exact in any
// combining order). Wider vectors keep more partial sums, so W must grow with the level.
int64_t accumulators(CpuIsa isa) {
  const CpuIsa before = oar::core::cpu_isa();
  oar::core::set_cpu_isa(isa);
  const int64_t n = 4096;
  std::vector<float> a(n, 1.0f), ones(n, 1.0f);
  a[0] = 0x1p24f;
  const double got = vm::vdot(a.data(), ones.data(), n);
  oar::core::set_cpu_isa(before);
  const double kept = got - 0x1p24;  // = n - n / W
  return kept >= n ? -1 : static_cast<int64_t>(std::llround(n / (n - kept)));
}

TEST(CpuIsa, EachLevelRunsItsOwnVectorWidth) {
  std::vector<std::pair<CpuIsa, int64_t>> widths;
  for (CpuIsa isa : kAllIsas)
    if (oar::core::cpu_isa_supported(isa)) widths.emplace_back(isa, accumulators(isa));
  std::string seen;
  for (auto [isa, w] : widths) seen += std::string(oar::core::to_string(isa)) + "=" + std::to_string(w) + " ";
  ::testing::Test::RecordProperty("accumulators", seen);
  std::printf("accumulators per level: %s\n", seen.c_str());
  for (size_t i = 1; i < widths.size(); ++i)
    EXPECT_LT(widths[i - 1].second, widths[i].second) << "accumulators per level: " << seen;
  if (widths.size() < 2) GTEST_SKIP() << "only the baseline level runs here (" << seen << ")";
}

// The masked passes of the normalization and reshaping: exact selections, and one rounding per operation
// against the same float expression evaluated in double.
TEST_P(VecMathOnIsa, MaskedPassesMatchAScalarDoubleReference) {
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> d(0.0f, 5.0f);
  const int64_t n = 131;
  std::vector<float> x(n), out(n);
  std::vector<uint8_t> mk(n), pk(n);
  for (int64_t i = 0; i < n; ++i) x[i] = d(rng), mk[i] = (i % 3) != 0, pk[i] = (i % 5) != 0;
  const bool* mask = reinterpret_cast<const bool*>(mk.data());
  const bool* pmask = reinterpret_cast<const bool*>(pk.data());
  float lo = 0, hi = 0, wlo = kInfF, whi = -kInfF;
  for (int64_t i = 0; i < n; ++i)
    if (mk[i]) wlo = std::min(wlo, x[i]), whi = std::max(whi, x[i]);
  EXPECT_FALSE(vm::vmasked_minmax(x.data(), mask, n, &lo, &hi));
  EXPECT_EQ(lo, wlo);
  EXPECT_EQ(hi, whi);
  std::vector<float> bad = x;
  bad[3] = -1.0f;  // masked-off: ignored
  EXPECT_FALSE(vm::vmasked_minmax(bad.data(), mask, n, &lo, &hi));
  bad[4] = std::nanf("");
  EXPECT_TRUE(vm::vmasked_minmax(bad.data(), mask, n, &lo, &hi));

  // (x - shift) * scale: two roundings.
  vm::vshift_scale(x.data(), 0.5f, 0.3f, out.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    const double want = (double(x[i]) - 0.5) * double(0.3f);
    EXPECT_LE(std::abs(out[i] - want), gamma(2) * std::abs(want)) << i;
  }
  // mask ? clamp(out / den, 0, 1) : 0: one rounding of the division; clamps and selections exact.
  std::vector<float> c = x;
  vm::vdivide_clamp_masked(c.data(), mask, 4.0f, n);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(c[i], mk[i] ? std::min(x[i] / 4.0f, 1.0f) : 0.0f) << i;

  // Tier weights in float64, stored as float32 (one rounding each), and their float64 sum over the mask.
  std::vector<float> w(n);
  const double tau = 2.0, lo_den = 2.5, hi_den = 3.0, beta = 1.0, fl = 0.1;
  const double sum = vm::vtier_weights_masked(x.data(), mask, pmask, n, tau, lo_den, hi_den, beta, fl, w.data());
  double want_sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i];
    const double t = v < tau ? std::max(v / lo_den, fl) : 1.0 + beta * (v - tau) / hi_den;
    if (mk[i]) {
      // One rounding to float32 of a float64 value that may itself differ from ours by a few float64 ulps.
      EXPECT_LE(std::abs(w[i] - t), ulps_f32(0.5, t) + gamma(4, 0x1p-53) * t) << i;
      want_sum += w[i];
    } else {
      EXPECT_EQ(w[i], pk[i] ? 1.0f : 0.0f) << i;  // off the span: selections, exact
    }
  }
  // float64 accumulation over the whole row (the n - |span| off-span ones are added, then subtracted exactly)
  EXPECT_LE(std::abs(sum - want_sum), sum_error_bound(n, want_sum + n, 0x1p-53));

  // Mass preservation: w * scale in double, rounded once; token advantages w * a rounded once.
  std::vector<float> w2 = w, ta(n);
  EXPECT_FALSE(vm::vscale_advantages_masked(w2.data(), mask, 1.25, -0.5f, ta.data(), n));
  for (int64_t i = 0; i < n; ++i) {
    const double want_w = mk[i] ? double(w[i]) * 1.25 : double(w[i]);
    EXPECT_LE(std::abs(w2[i] - want_w), ulps_f32(0.5, want_w)) << i;
    EXPECT_EQ(ta[i], w2[i] * -0.5f) << i;  // a power-of-two scale: exact
  }
  w2[5] = kInfF;
  EXPECT_TRUE(vm::vscale_advantages_masked(w2.data(), mask, 1.0, 1.0f, ta.data(), n));
}

// Widening loads and adds: exact conversions (every bfloat16 / binary16 value is a float32), exact adds of
// small integers.
TEST_P(VecMathOnIsa, WideningLoadsAreExact) {
  std::vector<uint16_t> bits(1 << 16);
  for (uint32_t i = 0; i < bits.size(); ++i) bits[i] = static_cast<uint16_t>(i);
  const auto n = static_cast<int64_t>(bits.size());
  std::vector<float> got(n), acc(n, 1.0f);
  vm::vload_bf16(bits.data(), got.data(), n);
  vm::vadd_bf16(bits.data(), acc.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(bits[i]) << 16;
    float want;
    std::memcpy(&want, &u, sizeof want);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got[i])) << i;
    } else {
      EXPECT_EQ(got[i], want) << i;
      EXPECT_EQ(acc[i], 1.0f + want) << i;
    }
  }
  vm::vload_f16(bits.data(), got.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t h = bits[i];
    const int ex = (h >> 10) & 0x1f, man = h & 0x3ff;
    double want = ex == 0 ? std::ldexp(man, -24) : ex == 31 ? (man ? NAN : INFINITY) : std::ldexp(1024 + man, ex - 25);
    if (h & 0x8000) want = -want;
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got[i])) << i;
    } else {
      EXPECT_EQ(got[i], static_cast<float>(want)) << i;
    }
  }
  std::vector<float> src(n), dst(n, 2.0f);
  for (int64_t i = 0; i < n; ++i) src[i] = static_cast<float>(i % 1000);
  vm::vadd_f32(src.data(), dst.data(), n);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(dst[i], 2.0f + src[i]) << i;
}

INSTANTIATE_TEST_SUITE_P(Levels, VecMathOnIsa, ::testing::ValuesIn(kAllIsas),
                         [](const ::testing::TestParamInfo<CpuIsa>& info) { return oar::core::to_string(info.param); });

}  // namespace
