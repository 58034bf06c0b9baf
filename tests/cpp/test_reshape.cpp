// GoogleTest for importance normalization and bi-level reshaping (method.md sections 5-6). Expected values are
// hand-computed (derivations in comments) or follow from the section 6 invariants.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "oar/core/importance.h"
#include "oar/core/reshape.h"
#include "test_util.h"

using oar::testing::error_of;

namespace oar::core {
namespace {

constexpr double kE = ReshapeOptions::kEps;


// std::vector<bool> has no data(); masks are byte vectors of 0/1 read as bool.
std::vector<uint8_t> mask_of(std::initializer_list<int> v) { return std::vector<uint8_t>(v.begin(), v.end()); }
const bool* bp(const std::vector<uint8_t>& m) { return reinterpret_cast<const bool*>(m.data()); }

ReshapeOptions opts_of(double q, double beta, double floor, Tiers tiers = Tiers::kBoth) {
  ReshapeOptions o;
  o.q = q;
  o.beta = beta;
  o.floor = floor;
  o.tiers = tiers;
  return o;
}

// --- quantile --------------------------------------------------------------------------------------------

TEST(Quantile, NumpyLinearHandValues) {
  // Sorted {1, 2, 3, 4}: h = 3q. q = 0.25 -> h = 0.75 -> 1 + 0.75 = 1.75; q = 0.5 -> 2.5; q = 1 -> 4; q = 0 -> 1.
  for (auto [q, want] : std::vector<std::pair<double, double>>{{0.25, 1.75}, {0.5, 2.5}, {1.0, 4.0}, {0.0, 1.0}}) {
    std::vector<float> v{4, 1, 3, 2};
    EXPECT_DOUBLE_EQ(quantile_linear(v.data(), 4, q), want) << q;
  }
  std::vector<float> one{0.7f};
  EXPECT_FLOAT_EQ(static_cast<float>(quantile_linear(one.data(), 1, 0.3)), 0.7f);
}

TEST(Quantile, MatchesSortedDefinitionOnRandomInput) {
  std::mt19937 gen(1);
  std::uniform_real_distribution<float> u(0, 1);
  for (int n : {1, 2, 3, 47, 131}) {
    for (double q : {0.1, 0.25, 0.5, 0.9}) {
      std::vector<float> v(n);
      for (auto& x : v) x = u(gen);
      std::vector<float> sorted(v);
      std::sort(sorted.begin(), sorted.end());
      const double h = (n - 1) * q;
      const int lo = static_cast<int>(std::floor(h));
      const int hi = std::min(lo + 1, n - 1);
      const double want = sorted[lo] + (h - lo) * (static_cast<double>(sorted[hi]) - sorted[lo]);
      EXPECT_NEAR(quantile_linear(v.data(), n, q), want, 1e-12) << "n=" << n << " q=" << q;
    }
  }
}

// masked_quantile_unit must return exactly quantile_linear of the masked entries (same order statistics,
// same interpolation), whatever the distribution: spread, clustered in one radix bin (forcing the refining
// passes), heavy duplicates, zeros of both signs, a single entry.
TEST(MaskedQuantileUnit, EqualsQuantileLinearOfTheMaskedEntries) {
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> u(0, 1);
  std::uniform_int_distribution<int> pick(0, 7);
  auto draw = [&](int kind) -> float {
    switch (kind) {
      case 0: return u(gen);                                      // spread over [0, 1]
      case 1: return 0.5f + u(gen) * 1e-3f;                       // one top-level bin: refining passes
      case 2: return std::floor(u(gen) * 4.0f) / 4.0f;            // 4 distinct values
      case 3: return u(gen) < 0.5f ? (u(gen) < 0.5f ? 0.0f : -0.0f) : u(gen);  // many (signed) zeros
      case 4: return 0.75f;                                       // all equal
      case 5: return std::pow(u(gen), 12.0f);                     // down to ~1e-30 (many exponents)
      case 6: return 0.5f + static_cast<float>(pick(gen)) * 1.1920929e-7f;  // 8 adjacent floats
      default: return u(gen) < 0.01f ? 1.0f : 0.3f + u(gen) * 1e-6f;
    }
  };
  for (int trial = 0; trial < 400; ++trial) {
    const int kind = trial % 8;
    const int len = std::vector<int>{1, 2, 3, 17, 600, 1500, 5000}[trial % 7];
    std::vector<float> v(len), scratch(len), picked;
    std::vector<uint8_t> m(len);
    for (int t = 0; t < len; ++t) {
      v[t] = draw(kind);
      m[t] = u(gen) < 0.8f || t == len / 2;  // at least one masked entry
      if (m[t]) picked.push_back(v[t]);
    }
    for (double q : {0.0, 0.01, 0.25, 0.5, 0.77, 0.999, 1.0}) {
      std::vector<float> ref(picked);
      const double want = quantile_linear(ref.data(), static_cast<int64_t>(ref.size()), q);
      const double got = masked_quantile_unit(v.data(), bp(m), len, q, scratch.data());
      EXPECT_EQ(got, want) << "kind=" << kind << " len=" << len << " q=" << q;
    }
  }
}

TEST(MaskedQuantileUnit, Errors) {
  std::vector<float> v{0.1f, 0.2f}, scratch(2);
  const auto none = mask_of({0, 0});
  EXPECT_NE(error_of([&] { masked_quantile_unit(v.data(), bp(none), 2, 0.5, scratch.data()); }).find("at least one"),
            std::string::npos);
  const auto all = mask_of({1, 1});
  EXPECT_NE(error_of([&] { masked_quantile_unit(v.data(), bp(all), 2, 1.5, scratch.data()); }).find("q must be"),
            std::string::npos);
}

// --- normalize_importance --------------------------------------------------------------------------------

TEST(NormalizeImportance, HandValues) {
  // Row 0: I = {0, e - 1, e^2 - 1, masked-out 99}: s = log1p(I) = {0, 1, 2} -> s_hat = {0, 0.5, 1}, 0 off-mask.
  // Row 1: all equal -> 0. Row 2: empty mask -> 0 (its NaN is off the mask, hence ignored).
  const double e = std::exp(1.0);
  const std::vector<double> I{0, e - 1, e * e - 1, 99, 5, 5, 5, 5, std::nan(""), 1, 2, 3};
  const auto m = mask_of({1, 1, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0});
  std::vector<float> out(12, -1.0f);
  normalize_importance(I.data(), bp(m), 3, 4, out.data());
  const std::vector<float> want{0, 0.5f, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  // float64 path: a float64 value rounded once (an ulp covers the rounding and the float64 log1p error).
  for (int i = 0; i < 12; ++i) EXPECT_NEAR(out[i], want[i], oar::testing::ulps_f32(1, want[i])) << i;
}

TEST(NormalizeImportance, RangeAndOrder) {
  std::mt19937 gen(3);
  std::uniform_real_distribution<float> u(0, 50);
  std::vector<float> I(47 * 3);
  for (auto& v : I) v = u(gen);
  std::vector<uint8_t> m(I.size(), 1);
  std::vector<float> out(I.size());
  normalize_importance(I.data(), bp(m), 3, 47, out.data());
  for (int b = 0; b < 3; ++b) {
    float lo = 2, hi = -1;
    for (int t = 0; t < 47; ++t) {
      lo = std::min(lo, out[b * 47 + t]);
      hi = std::max(hi, out[b * 47 + t]);
      for (int u2 = 0; u2 < 47; ++u2)  // monotone: the order of raw scores is kept
        if (I[b * 47 + t] < I[b * 47 + u2]) EXPECT_LE(out[b * 47 + t], out[b * 47 + u2]);
    }
    EXPECT_EQ(lo, 0.0f);
    EXPECT_EQ(hi, 1.0f);
  }
}

TEST(NormalizeImportance, BadScoresNameTheArgumentAndPosition) {
  const auto m = mask_of({1, 1, 1, 1});
  std::vector<float> out(4);
  for (float bad : {-0.5f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    const std::vector<float> I{0, 1, 2, bad};
    const std::string msg = error_of([&] { normalize_importance(I.data(), bp(m), 2, 2, out.data()); });
    EXPECT_NE(msg.find("scores[1, 1]"), std::string::npos) << msg;
  }
  const std::vector<double> I{0, -1, 2, 3};
  EXPECT_NE(error_of([&] { check_scores(I.data(), bp(m), 2, 2, "importance"); }).find("importance[0, 1]"),
            std::string::npos);
}

// --- reshape_span_weights --------------------------------------------------------------------------------


// Three float32 roundings relative to the exact weight (tier weight stored, sum, scaled weight stored).
const double kW3 = oar::testing::gamma(3);

TEST(SpanWeights, HandComputedBothTiers) {
  // s = {0, 0.5, 1, 0.25}, q = 0.5: sorted {0, .25, .5, 1}, h = 1.5 -> tau = 0.25 + 0.5 * 0.25 = 0.375.
  // s=0   : max(0 / tau, 0.1) = 0.1          s=0.25: 0.25 / 0.375 = 2/3
  // s=0.5 : 1 + (0.125) / (0.625) = 1.2      s=1   : 1 + 0.625 / 0.625 = 2
  // sum = 0.1 + 1.2 + 2 + 2/3 = 3.966667, scale 4 / sum.
  const std::vector<float> s{0, 0.5f, 1, 0.25f};
  std::vector<float> w(4), scratch(4);
  reshape_span_weights(s.data(), 4, opts_of(0.5, 1.0, 0.1), w.data(), scratch.data());
  const double tau = 0.375;
  const double raw[4] = {0.1, 1 + 0.125 / (1 - tau + kE), 1 + 0.625 / (1 - tau + kE), 0.25 / (tau + kE)};
  const double sum = raw[0] + raw[1] + raw[2] + raw[3];
  // Tier weights computed in float64 and stored as float32 (one rounding, which also moves their float64 sum by
  // at most u), then scaled in float64 and rounded once more: 3 roundings relative to the exact weight.
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(w[i], raw[i] * 4 / sum, kW3 * raw[i] * 4 / sum) << i;
  // The four weights sum to 4 up to their own roundings (u each) and 3 float32 additions here.
  EXPECT_NEAR(w[0] + w[1] + w[2] + w[3], 4.0, (oar::testing::gamma(3) + oar::testing::kU32) * 4.0);
  // The input is left untouched (the quantile works on scratch).
  EXPECT_EQ(s[1], 0.5f);
}

TEST(SpanWeights, BoostOnlyAndSuppressOnly) {
  const std::vector<float> s{0, 0.5f, 1, 0.25f};  // tau = 0.375 as above
  std::vector<float> w(4), scratch(4);
  // Boost only: below tau -> 1; raw {1, 1.2, 2, 1}, sum 5.2.
  reshape_span_weights(s.data(), 4, opts_of(0.5, 1.0, 0.1, Tiers::kBoostOnly), w.data(), scratch.data());
  const double b1 = 1 + 0.125 / (0.625 + kE), b2 = 1 + 0.625 / (0.625 + kE), sb = 2 + b1 + b2;
  EXPECT_NEAR(w[0], 4 / sb, kW3 * 4 / sb);  // 3 roundings, as above
  EXPECT_NEAR(w[1], b1 * 4 / sb, kW3 * b1 * 4 / sb);
  EXPECT_NEAR(w[2], b2 * 4 / sb, kW3 * b2 * 4 / sb);
  EXPECT_NEAR(w[3], 4 / sb, kW3 * 4 / sb);
  // Suppress only: at/above tau -> 1; raw {0.1, 1, 1, 2/3}, sum 2.766667.
  reshape_span_weights(s.data(), 4, opts_of(0.5, 1.0, 0.1, Tiers::kSuppressOnly), w.data(), scratch.data());
  const double s3 = 0.25 / (0.375 + kE), ss = 0.1 + 2 + s3;
  EXPECT_NEAR(w[0], 0.1 * 4 / ss, kW3 * 0.1 * 4 / ss);
  EXPECT_NEAR(w[1], 4 / ss, kW3 * 4 / ss);
  EXPECT_NEAR(w[2], 4 / ss, kW3 * 4 / ss);
  EXPECT_NEAR(w[3], s3 * 4 / ss, kW3 * s3 * 4 / ss);
}

TEST(SpanWeights, AllEqualScoresGiveExactlyOne) {
  for (int L : {1, 2, 3, 47}) {
    std::vector<float> s(L, 0.0f), w(L), scratch(L);
    for (Tiers t : {Tiers::kBoth, Tiers::kBoostOnly, Tiers::kSuppressOnly}) {
      reshape_span_weights(s.data(), L, opts_of(0.25, 1.0, 0.1, t), w.data(), scratch.data());
      for (float v : w) EXPECT_EQ(v, 1.0f);
    }
  }
}

TEST(SpanWeights, BetaZeroFloorZeroAndEmpty) {
  // beta = 0: boost tier is 1. floor = 0: s = 0 gets weight 0 (and stays non-negative).
  const std::vector<float> s{0, 0.5f, 1, 0.25f};
  std::vector<float> w(4), scratch(4);
  reshape_span_weights(s.data(), 4, opts_of(0.5, 0.0, 0.0), w.data(), scratch.data());
  const double s3 = 0.25 / (0.375 + kE), sum = 2 + s3;
  EXPECT_EQ(w[0], 0.0f);
  EXPECT_NEAR(w[1], 4 / sum, kW3 * 4 / sum);
  EXPECT_NEAR(w[3], s3 * 4 / sum, kW3 * s3 * 4 / sum);
  EXPECT_NO_THROW(reshape_span_weights(s.data(), 0, opts_of(0.5, 1, 0.1), w.data(), scratch.data()));
}

// --- reshape_advantages ----------------------------------------------------------------------------------

TEST(ReshapeAdvantages, LayoutHandExample) {
  // Row 0: T = 6, response = first 5, reasoning = tokens 1..3 with equal scores -> span weights 1;
  //        token 0 and 4 are response outside R -> 1; token 5 padding -> 0.
  // Row 1: A = 0 -> stays 0 everywhere.
  const std::vector<float> adv{2.0f, 0.0f};
  const std::vector<float> scores{9, 3, 3, 3, 9, 9, 1, 2, 3, 4, 5, 6};
  const auto rm = mask_of({0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0});
  const auto pm = mask_of({1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1});
  std::vector<float> ta(12), w(12);
  reshape_advantages(adv.data(), scores.data(), bp(rm), bp(pm), 2, 6, ReshapeOptions{}, false, ta.data(), w.data());
  const std::vector<float> w0{1, 1, 1, 1, 1, 0};
  for (int t = 0; t < 6; ++t) {
    EXPECT_EQ(w[t], w0[t]) << t;
    EXPECT_EQ(ta[t], 2.0f * w0[t]) << t;
    EXPECT_EQ(ta[6 + t], 0.0f) << t;
  }
  EXPECT_EQ(w[6], 1.0f);   // response, outside R
  EXPECT_EQ(w[11], 1.0f);  // response, outside R
}

TEST(ReshapeAdvantages, MatchesSpanWeightsOnNormalizedScores) {
  // scores_are_normalized: the span values go straight to reshape_span_weights.
  const std::vector<float> adv{-1.5f};
  const std::vector<float> s{0.3f, 0, 0.5f, 1, 0.25f, 0.9f};
  const auto rm = mask_of({0, 1, 1, 1, 1, 0});
  const auto pm = mask_of({1, 1, 1, 1, 1, 0});
  std::vector<float> ta(6), w(6);
  const auto o = opts_of(0.5, 1.0, 0.1);
  reshape_advantages(adv.data(), s.data(), bp(rm), bp(pm), 1, 6, o, true, ta.data(), w.data());
  const std::vector<float> span{0, 0.5f, 1, 0.25f};
  std::vector<float> ws(4), scratch(4);
  reshape_span_weights(span.data(), 4, o, ws.data(), scratch.data());
  EXPECT_EQ(w[0], 1.0f);
  for (int k = 0; k < 4; ++k) {
    EXPECT_EQ(w[1 + k], ws[k]);
    EXPECT_EQ(ta[1 + k], -1.5f * ws[k]);
  }
  EXPECT_EQ(w[5], 0.0f);
  // Weights output is optional.
  std::vector<float> ta2(6);
  reshape_advantages(adv.data(), s.data(), bp(rm), bp(pm), 1, 6, o, true, ta2.data(), nullptr);
  EXPECT_EQ(ta, ta2);
}

TEST(ReshapeAdvantages, RandomInvariants) {
  std::mt19937 gen(11);
  std::uniform_real_distribution<double> u(0, 1);
  std::normal_distribution<float> nrm(0, 1);
  for (int trial = 0; trial < 40; ++trial) {
    const int B = 1 + trial % 5, T = std::vector<int>{1, 3, 47, 131}[trial % 4];
    std::vector<double> s(B * T);
    std::vector<uint8_t> rm(B * T), pm(B * T);
    std::vector<float> adv(B);
    for (int b = 0; b < B; ++b) {
      adv[b] = b == 0 ? 0.0f : nrm(gen);
      const int len = static_cast<int>(u(gen) * (T + 1));  // response length, may be 0
      for (int t = 0; t < T; ++t) {
        pm[b * T + t] = t < len;
        rm[b * T + t] = t < len && u(gen) < 0.8;
        s[b * T + t] = u(gen) < 0.2 ? 0.0 : std::pow(u(gen), 3) * 100;
      }
    }
    for (Tiers tiers : {Tiers::kBoth, Tiers::kBoostOnly, Tiers::kSuppressOnly}) {
      const auto o = opts_of(0.05 + 0.9 * u(gen), 2 * u(gen), 0.5 * u(gen), tiers);
      std::vector<float> ta(B * T), w(B * T);
      reshape_advantages(adv.data(), s.data(), bp(rm), bp(pm), B, T, o, false, ta.data(), w.data());
      for (int b = 0; b < B; ++b) {
        double sum_ta = 0, sum_span = 0, abs_ta = 0;
        int n_resp = 0, n_span = 0;
        for (int t = 0; t < T; ++t) {
          const int i = b * T + t;
          EXPECT_GE(w[i], 0.0f);
          if (!pm[i]) EXPECT_EQ(w[i], 0.0f);
          if (pm[i] && !rm[i]) EXPECT_EQ(w[i], 1.0f);
          if (rm[i]) {
            sum_span += w[i];
            ++n_span;
            EXPECT_GE(w[i], 0.0f);
          }
          EXPECT_GE(static_cast<double>(ta[i]) * adv[b], 0.0);  // sign never flips
          if (adv[b] == 0.0f) EXPECT_EQ(ta[i], 0.0f);
          sum_ta += ta[i];
          abs_ta += std::fabs(ta[i]);
          n_resp += pm[i];
        }
        // The op scales the span's weights in float64 so that they sum to its length, then rounds each to float32
        // (u w_i), and each w_i * A once more (u |ta_i|); these sums run in float64.
        const double f64 = oar::testing::gamma(T, 0x1p-53);
        EXPECT_NEAR(sum_span, n_span, (oar::testing::kU32 + f64) * sum_span);
        EXPECT_NEAR(sum_ta, n_resp * static_cast<double>(adv[b]), (oar::testing::gamma(2) + f64) * abs_ta);
      }
    }
  }
}

TEST(ReshapeAdvantages, ErrorsNameTheArgument) {
  const std::vector<float> adv{1.0f};
  const std::vector<float> s{0.5f, 0.5f, 0.5f};
  const auto rm = mask_of({1, 1, 0});
  const auto pm = mask_of({1, 1, 1});
  std::vector<float> ta(3), w(3);
  auto call = [&](const ReshapeOptions& o, const std::vector<float>& a, const std::vector<float>& sc,
                  const std::vector<uint8_t>& r, const std::vector<uint8_t>& p, bool norm) {
    return error_of([&] { reshape_advantages(a.data(), sc.data(), bp(r), bp(p), 1, 3, o, norm, ta.data(), w.data()); });
  };
  const ReshapeOptions ok;
  EXPECT_NE(call(opts_of(0.0, 1, 0.1), adv, s, rm, pm, false).find("q must be in (0, 1)"), std::string::npos);
  EXPECT_NE(call(opts_of(1.0, 1, 0.1), adv, s, rm, pm, false).find("q must be in (0, 1)"), std::string::npos);
  EXPECT_NE(call(opts_of(0.5, -1, 0.1), adv, s, rm, pm, false).find("beta"), std::string::npos);
  EXPECT_NE(call(opts_of(0.5, 1, 1.0), adv, s, rm, pm, false).find("floor"), std::string::npos);
  EXPECT_NE(call(opts_of(0.5, 1, -0.1), adv, s, rm, pm, false).find("floor"), std::string::npos);
  EXPECT_NE(call(ok, {std::nanf("")}, s, rm, pm, false).find("advantages[0]"), std::string::npos);
  const std::string sub = call(ok, adv, s, mask_of({1, 1, 1}), mask_of({1, 1, 0}), false);
  EXPECT_NE(sub.find("reasoning_mask"), std::string::npos) << sub;
  EXPECT_NE(sub.find("[0, 2]"), std::string::npos) << sub;
  EXPECT_NE(call(ok, adv, {0.5f, -1.0f, 0.5f}, rm, pm, false).find("scores[0, 1]"), std::string::npos);
  EXPECT_NE(call(ok, adv, {0.5f, 1.5f, 0.5f}, rm, pm, true).find("scores[0, 1]"), std::string::npos);
  // Off-span values are not checked (they are never read).
  EXPECT_EQ(call(ok, adv, {0.5f, 0.5f, -7.0f}, rm, pm, false), "");
}

TEST(ReshapeOptionsCheck, Ranges) {
  EXPECT_NO_THROW(check_reshape_options(ReshapeOptions{}));
  EXPECT_NO_THROW(check_reshape_options(opts_of(0.01, 0.0, 0.0)));
  EXPECT_THROW(check_reshape_options(opts_of(std::nan(""), 1, 0.1)), InvalidArgument);
  EXPECT_THROW(check_reshape_options(opts_of(0.5, std::numeric_limits<double>::infinity(), 0.1)), InvalidArgument);
}

}  // namespace
}  // namespace oar::core
