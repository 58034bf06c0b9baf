// Probe divergences (method.md section 2) against a naive double-precision reference written here:
// explicit log-softmax, explicit KL sum, explicit mean of logits. Covers the three element types, chunk
// boundaries (V > 2048, an all -inf chunk), broadcast strides, lengths, the backward against central
// finite differences of the reference, and the error paths.
#include <gtest/gtest.h>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "oar/core/common.h"
#include "oar/core/probe.h"

// Internal widening helpers (not installed), tested exhaustively below.
#include "../../src/core/widen.h"
#include "test_util.h"

using oar::testing::expect_invalid;

namespace {

using oar::core::InvalidArgument;
using oar::core::LogitsView;
using oar::core::Probe;
using oar::core::RowRange;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Dense (N, S, V) logits in double; the kernels read a copy converted to T.
struct Logits {
  int64_t N, S, V;
  std::vector<double> z;
  double at(int64_t n, int64_t s, int64_t v) const { return z[(n * S + s) * V + v]; }
  double& at(int64_t n, int64_t s, int64_t v) { return z[(n * S + s) * V + v]; }
};

Logits random_logits(int64_t N, int64_t S, int64_t V, double scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> d(0.0, scale);
  Logits l{N, S, V, std::vector<double>(static_cast<size_t>(N * S * V))};
  for (auto& x : l.z) x = d(rng);
  return l;
}

// Rounds the logits to T so that the reference sees exactly what the kernel sees.
template <typename T>
std::vector<T> to_t(Logits& l) {
  std::vector<T> out(l.z.size());
  for (size_t i = 0; i < l.z.size(); ++i) {
    out[i] = static_cast<T>(static_cast<float>(l.z[i]));
    l.z[i] = static_cast<double>(static_cast<float>(out[i]));
  }
  return out;
}

template <typename T>
LogitsView<T> dense_view(const std::vector<T>& d, int64_t S, int64_t V) {
  return LogitsView<T>{d.data(), S * V, V};
}

// The reference formulas, in precision R: double is the truth, float the naive float32 computation that sets the
// error budget (rule 1 of the test tolerances, docs/design.md).
template <typename R = double>
std::vector<R> log_softmax(const std::vector<R>& z) {
  R m = -std::numeric_limits<R>::infinity();
  for (R x : z) m = std::max(m, x);
  R s = 0;
  for (R x : z) s += std::exp(x - m);
  std::vector<R> out(z.size());
  for (size_t i = 0; i < z.size(); ++i) out[i] = z[i] - m - std::log(s);
  return out;
}

template <typename R = double>
R kl(const std::vector<R>& zc, const std::vector<R>& zp) {
  const auto lc = log_softmax<R>(zc), lp = log_softmax<R>(zp);
  R k = 0;
  for (size_t i = 0; i < lc.size(); ++i) {
    const R p = std::exp(lc[i]);
    if (p > 0) k += p * (lc[i] - lp[i]);
  }
  return k;
}

template <typename R = double>
std::vector<R> probe_row(const Logits& l, int64_t n, int64_t L, bool mean) {
  std::vector<R> z(static_cast<size_t>(l.V), 0);
  const int64_t used = mean ? L : 1;
  for (int64_t s = 0; s < used; ++s)
    for (int64_t v = 0; v < l.V; ++v) z[v] += static_cast<R>(l.at(n, s, v));
  for (auto& x : z) x /= static_cast<R>(used);
  return z;
}

// Reference value of one row, unclamped.
template <typename R = double>
R ref_row(const Logits& c, const Logits& p, const std::vector<int64_t>& ids, int64_t n, int64_t L, Probe probe) {
  if (probe == Probe::kLast) return kl<R>(probe_row<R>(c, n, 1, false), probe_row<R>(p, n, 1, false));
  if (probe == Probe::kAnswerMean) return kl<R>(probe_row<R>(c, n, L, true), probe_row<R>(p, n, L, true));
  R drop = 0;
  for (int64_t s = 0; s < L; ++s) {
    std::vector<R> zc(static_cast<size_t>(c.V)), zp(static_cast<size_t>(p.V));
    for (int64_t v = 0; v < c.V; ++v) zc[v] = static_cast<R>(c.at(n, s, v)), zp[v] = static_cast<R>(p.at(n, s, v));
    const int64_t a = ids[n * c.S + s];
    drop += log_softmax<R>(zc)[a] - log_softmax<R>(zp)[a];
  }
  return drop / static_cast<R>(L);
}

// Rule 1 for the probe values of one call: the kernel reads the same T-rounded logits as the references, and its
// error against the float64 reference stays within 4 times the naive float32 formula's largest error over the
// call's rows (k = 4: both sum V terms in float32, in different orders, and their errors add up in the
// log-sum-exp difference), plus an ulp of the largest value and an ulp of the largest |zc - zp| (the kernel's
// KL formula, sum p (zc - zp) + lse(zp) - lse(zc), cancels terms of that size). Returns {references, budget}.
std::pair<std::vector<double>, double> probe_budget(const Logits& c, const Logits& p, const std::vector<int64_t>& ids,
                                                    const std::vector<int64_t>& lengths, Probe probe) {
  std::vector<double> want(static_cast<size_t>(p.N));
  double err32 = 0.0, big = 0.0, dmax = 0.0;
  for (int64_t n = 0; n < p.N; ++n) {
    double w = ref_row<double>(c, p, ids, n, lengths[n], probe);
    double f = static_cast<double>(ref_row<float>(c, p, ids, n, lengths[n], probe));
    if (probe != Probe::kAnswerJoint) w = std::max(w, 0.0), f = std::max(f, 0.0);
    want[n] = w;
    err32 = std::max(err32, std::fabs(f - w));
    big = std::max(big, std::fabs(w));
    for (int64_t s = 0; s < p.S; ++s)
      for (int64_t v = 0; v < p.V; ++v) {
        const double d = c.at(n, s, v) - p.at(n, s, v);
        if (std::isfinite(d)) dmax = std::max(dmax, std::fabs(d));
      }
  }
  return {want, 4.0 * err32 + oar::testing::ulps_f32(1, big) + oar::testing::ulps_f32(1, dmax)};
}

template <typename T>
struct ProbeTyped : ::testing::Test {};
using ElementTypes = ::testing::Types<float, Eigen::half, Eigen::bfloat16>;
TYPED_TEST_SUITE(ProbeTyped, ElementTypes);


TYPED_TEST(ProbeTyped, MatchesReferenceAllProbes) {
  using T = TypeParam;
  // 5000 > 2048 crosses two chunk boundaries with a ragged tail; 7 is a single short chunk.
  for (int64_t V : {int64_t{7}, int64_t{131}, int64_t{5000}}) {
    const int64_t N = 4, S = 3;
    Logits c = random_logits(N, S, V, 2.0, 1);
    Logits p = c;
    std::mt19937 rng(2);
    std::normal_distribution<double> d(0.0, 0.7);
    for (auto& x : p.z) x += d(rng);
    const auto ct = to_t<T>(c);
    const auto pt = to_t<T>(p);
    std::vector<int64_t> lengths = {1, 3, 2, 3};
    std::vector<int64_t> ids(static_cast<size_t>(N * S));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>((i * 37 + 5) % V);
    for (Probe probe : {Probe::kLast, Probe::kAnswerMean, Probe::kAnswerJoint}) {
      std::vector<float> out(N, -1.0f);
      oar::core::probe_divergence<T>(dense_view(ct, S, V), dense_view(pt, S, V), ids.data(), lengths.data(), N,
                                     S, V, probe, out.data());
      const auto [want, budget] = probe_budget(c, p, ids, lengths, probe);
      for (int64_t n = 0; n < N; ++n)
        EXPECT_NEAR(out[n], want[n], budget) << "V=" << V << " probe=" << oar::core::to_string(probe) << " n=" << n;
    }
  }
}

TYPED_TEST(ProbeTyped, IdenticalInputsGiveExactlyZero) {
  using T = TypeParam;
  const int64_t N = 3, S = 2, V = 4099;
  Logits c = random_logits(N, S, V, 3.0, 7);
  const auto ct = to_t<T>(c);
  std::vector<int64_t> ids(static_cast<size_t>(N * S), 4);
  for (Probe probe : {Probe::kLast, Probe::kAnswerMean, Probe::kAnswerJoint}) {
    std::vector<float> out(N, -1.0f);
    oar::core::probe_divergence<T>(dense_view(ct, S, V), dense_view(ct, S, V), ids.data(), nullptr, N, S, V,
                                   probe, out.data());
    for (float x : out) EXPECT_EQ(x, 0.0f);
  }
}

TEST(Probe, BroadcastCleanRowAndPositionStride) {
  // clean (1, S, V) broadcast with stride_n = 0; perturbed rows stored with padding between positions
  // (stride_s = V + 5) and between rows.
  const int64_t N = 3, S = 2, V = 300, pad_s = V + 5, pad_n = S * pad_s + 11;
  Logits c = random_logits(1, S, V, 1.5, 3);
  Logits p = random_logits(N, S, V, 1.5, 4);
  std::vector<float> cbuf(c.z.begin(), c.z.end());
  std::vector<float> pbuf(static_cast<size_t>(N * pad_n), std::numeric_limits<float>::quiet_NaN());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t v = 0; v < V; ++v) pbuf[n * pad_n + s * pad_s + v] = static_cast<float>(p.at(n, s, v));
  Logits cfull{N, S, V, {}};
  for (int64_t n = 0; n < N; ++n) cfull.z.insert(cfull.z.end(), c.z.begin(), c.z.end());
  std::vector<float> out(N);
  oar::core::probe_divergence<float>(LogitsView<float>{cbuf.data(), 0, V}, LogitsView<float>{pbuf.data(), pad_n, pad_s},
                                     nullptr, nullptr, N, S, V, Probe::kAnswerMean, out.data());
  const auto [want, budget] = probe_budget(cfull, p, {}, std::vector<int64_t>(N, S), Probe::kAnswerMean);
  for (int64_t n = 0; n < N; ++n) EXPECT_NEAR(out[n], want[n], budget) << n;
}

TYPED_TEST(ProbeTyped, BroadcastCleanMatchesDenseForwardAndBackward) {
  // stride_n == 0 takes the cached-clean path (clean softmax computed once per call and per length);
  // lengths alternate so the cache is rebuilt; -inf entries on both sides exercise the masking.
  using T = TypeParam;
  const int64_t N = 6, S = 3, V = 2500;
  Logits c1 = random_logits(1, S, V, 2.0, 21);
  Logits p = random_logits(N, S, V, 2.0, 22);
  for (int64_t s = 0; s < S; ++s) c1.at(0, s, 17) = -kInf;  // clean -inf at 17 everywhere
  for (int64_t n = 0; n < N; ++n) p.at(n, 0, 17) = -kInf;    // perturbed too at s = 0
  const auto c1t = to_t<T>(c1);
  const auto pt = to_t<T>(p);
  Logits cdense{N, S, V, {}};
  for (int64_t n = 0; n < N; ++n) cdense.z.insert(cdense.z.end(), c1.z.begin(), c1.z.end());
  const auto cdt = to_t<T>(cdense);
  const std::vector<int64_t> lengths = {3, 1, 1, 2, 3, 3};
  std::vector<int64_t> ids(static_cast<size_t>(N * S));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>((i * 101 + 3) % V);
  const LogitsView<T> bview{c1t.data(), 0, V};
  std::vector<float> go(N);
  for (int64_t n = 0; n < N; ++n) go[n] = 0.5f + static_cast<float>(n);
  for (Probe probe : {Probe::kLast, Probe::kAnswerMean, Probe::kAnswerJoint}) {
    std::vector<float> out_b(N), out_d(N);
    oar::core::probe_divergence<T>(bview, dense_view(pt, S, V), ids.data(), lengths.data(), N, S, V, probe,
                                   out_b.data());
    oar::core::probe_divergence<T>(dense_view(cdt, S, V), dense_view(pt, S, V), ids.data(), lengths.data(), N, S,
                                   V, probe, out_d.data());
    const auto [want, budget] = probe_budget(cdense, p, ids, lengths, probe);
    for (int64_t n = 0; n < N; ++n) {  // both paths (cached clean softmax, dense) within rule 1
      EXPECT_NEAR(out_b[n], want[n], budget) << oar::core::to_string(probe) << n;
      EXPECT_NEAR(out_d[n], want[n], budget) << oar::core::to_string(probe) << n;
    }
    std::vector<T> g_b(static_cast<size_t>(N * S * V)), g_d(static_cast<size_t>(N * S * V));
    oar::core::probe_divergence_backward<T>(go.data(), bview, dense_view(pt, S, V), ids.data(), lengths.data(), N, S,
                                            V, probe, g_b.data());
    oar::core::probe_divergence_backward<T>(go.data(), dense_view(cdt, S, V), dense_view(pt, S, V), ids.data(),
                                            lengths.data(), N, S, V, probe, g_d.data());
    double max_diff = 0.0, max_abs = 0.0;
    for (size_t i = 0; i < g_b.size(); ++i) {
      const double b = static_cast<float>(g_b[i]), d = static_cast<float>(g_d[i]);
      ASSERT_TRUE(std::isfinite(b)) << i;
      max_diff = std::max(max_diff, std::fabs(b - d));
      max_abs = std::max(max_abs, std::fabs(d));
    }
    // Same math, different rounding order (cached softmax); at most a unit in the last place of T.
    const double ulp = std::is_same_v<T, float> ? 1e-6 : (std::is_same_v<T, Eigen::half> ? 1e-3 : 8e-3);
    EXPECT_LE(max_diff, ulp * max_abs) << oar::core::to_string(probe);
  }
  // Identical broadcast inputs: exactly zero for every row.
  std::vector<float> out(N, -1.0f);
  for (Probe probe : {Probe::kLast, Probe::kAnswerMean, Probe::kAnswerJoint}) {
    oar::core::probe_divergence<T>(bview, dense_view(cdt, S, V), ids.data(), lengths.data(), N, S, V, probe,
                                   out.data());
    for (float x : out) EXPECT_EQ(x, 0.0f) << oar::core::to_string(probe);
  }
}

TEST(Probe, NegativeInfinityLogitsAreZeroProbability) {
  // Vocabulary [0, 2048) (a whole chunk) is -inf in both inputs; a few more -inf entries in the clean only.
  const int64_t N = 1, S = 1, V = 2048 + 100;
  Logits c = random_logits(N, S, V, 1.0, 5);
  Logits p = random_logits(N, S, V, 1.0, 6);
  for (int64_t v = 0; v < 2048; ++v) c.at(0, 0, v) = p.at(0, 0, v) = -kInf;
  c.at(0, 0, 2050) = -kInf;
  const auto ct = to_t<float>(c);
  const auto pt = to_t<float>(p);
  float out = -1.0f;
  oar::core::probe_divergence<float>(dense_view(ct, S, V), dense_view(pt, S, V), nullptr, nullptr, N, S, V,
                                     Probe::kLast, &out);
  EXPECT_TRUE(std::isfinite(out));
  {
    // Rule 1 on the finite entries (zero-probability ones contribute nothing; the naive float formula would
    // subtract -inf from -inf there).
    Logits cf{N, S, V - 2048, {}}, pf{N, S, V - 2048, {}};
    for (int64_t v = 2048; v < V; ++v) cf.z.push_back(c.at(0, 0, v)), pf.z.push_back(p.at(0, 0, v));
    const auto [want, budget] = probe_budget(cf, pf, {}, {1}, Probe::kLast);
    EXPECT_NEAR(out, want[0], budget);
  }
  // Perturbed -inf where the clean has mass: the KL is +inf (not NaN, not an error).
  p.at(0, 0, 2060) = -kInf;
  const auto pt2 = to_t<float>(p);
  oar::core::probe_divergence<float>(dense_view(ct, S, V), dense_view(pt2, S, V), nullptr, nullptr, N, S, V,
                                     Probe::kLast, &out);
  EXPECT_TRUE(std::isinf(out) && out > 0);
}

TEST(Probe, PerturbedNegInfFacingAFarBelowCleanLogitIsInfAcrossChunks) {
  // A clean logit of -1e4 has positive probability (its exp underflows only in float64): facing a perturbed -inf it
  // makes the KL +inf. The chunk merges rescale t by exp(chunk max difference), 0 in double here: an infinite t
  // must stay +inf (not inf * 0 = NaN, then "row 0 gives a NaN KL divergence"), whether the far-below chunks come
  // before the maximum (the old t is rescaled) or after it (the new chunk's t is), densely or broadcast (cache).
  const int64_t S = 1, V = 4 * 2048;
  for (const bool low_first : {true, false}) {
    std::vector<float> c(static_cast<size_t>(V), 0.0f);
    const int64_t far0 = low_first ? 0 : V / 2;
    for (int64_t v = far0; v < far0 + V / 2; ++v) c[static_cast<size_t>(v)] = -1e4f;
    std::vector<float> p = c;
    p[static_cast<size_t>(far0)] = -std::numeric_limits<float>::infinity();
    for (Probe probe : {Probe::kLast, Probe::kAnswerMean}) {
      float out = 0.0f;
      oar::core::probe_divergence<float>(dense_view(c, S, V), dense_view(p, S, V), nullptr, nullptr, 1, S, V,
                                         probe, &out);
      EXPECT_TRUE(std::isinf(out) && out > 0) << "low_first=" << low_first << ": " << out;
      std::vector<float> p2 = p;
      p2.insert(p2.end(), p.begin(), p.end());
      float out2[2] = {0.0f, 0.0f};
      oar::core::probe_divergence<float>(LogitsView<float>{c.data(), 0, V}, dense_view(p2, S, V), nullptr, nullptr,
                                         2, S, V, probe, out2);
      EXPECT_TRUE(std::isinf(out2[0]) && out2[0] > 0 && out2[1] == out2[0]) << "broadcast: " << out2[0];
    }
  }
}

TEST(Probe, NaNInputThrowsNamingTheRow) {
  const int64_t N = 3, S = 1, V = 50;
  Logits c = random_logits(N, S, V, 1.0, 8);
  auto ct = to_t<float>(c);
  auto pt = ct;
  pt[2 * V + 7] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> out(N);
  for (Probe probe : {Probe::kLast, Probe::kAnswerMean}) {
    try {
      oar::core::probe_divergence<float>(dense_view(ct, S, V), dense_view(pt, S, V), nullptr, nullptr, N, S, V,
                                         probe, out.data());
      FAIL() << "expected InvalidArgument";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("row 2"), std::string::npos) << e.what();
    }
  }
  // NaN in the clean logits too.
  try {
    oar::core::probe_divergence<float>(dense_view(pt, S, V), dense_view(ct, S, V), nullptr, nullptr, N, S, V,
                                       Probe::kAnswerMean, out.data());
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("row 2"), std::string::npos) << e.what();
  }
  std::vector<int64_t> ids(static_cast<size_t>(N * S), 7);
  EXPECT_THROW(oar::core::probe_divergence<float>(dense_view(ct, S, V), dense_view(pt, S, V), ids.data(), nullptr,
                                                  N, S, V, Probe::kAnswerJoint, out.data()),
               InvalidArgument);
  // A position with no finite logit at all has no distribution.
  std::vector<float> all_neg_inf(ct.size(), -std::numeric_limits<float>::infinity());
  EXPECT_THROW(oar::core::probe_divergence<float>(dense_view(all_neg_inf, S, V), dense_view(ct, S, V), nullptr,
                                                  nullptr, N, S, V, Probe::kLast, out.data()),
               InvalidArgument);
}

TEST(Probe, RowRangeComputesOnlyItsRowsWithAbsoluteIndices) {
  const int64_t N = 5, S = 2, V = 97;
  Logits c = random_logits(N, S, V, 1.0, 9);
  Logits p = random_logits(N, S, V, 1.0, 10);
  const auto ct = to_t<float>(c);
  const auto pt = to_t<float>(p);
  std::vector<float> full(N), part(N, -7.0f);
  oar::core::probe_divergence<float>(dense_view(ct, S, V), dense_view(pt, S, V), nullptr, nullptr, N, S, V,
                                     Probe::kAnswerMean, full.data());
  oar::core::probe_divergence<float>(dense_view(ct, S, V), dense_view(pt, S, V), nullptr, nullptr, N, S, V,
                                     Probe::kAnswerMean, part.data(), RowRange{1, 3});
  EXPECT_EQ(part[0], -7.0f);
  EXPECT_EQ(part[1], full[1]);
  EXPECT_EQ(part[2], full[2]);
  EXPECT_EQ(part[3], -7.0f);
  std::vector<int64_t> lengths = {2, 2, 2, 2, 0};
  try {
    oar::core::probe_divergence<float>(dense_view(ct, S, V), dense_view(pt, S, V), nullptr, lengths.data(), N, S,
                                       V, Probe::kAnswerMean, part.data(), RowRange{3, 5});
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("lengths[4]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(oar::core::probe_divergence<float>(dense_view(ct, S, V), dense_view(pt, S, V), nullptr, nullptr, N,
                                                  S, V, Probe::kAnswerMean, part.data(), RowRange{2, 6}),
               InvalidArgument);
}


TEST(Probe, ValidationErrorsNameTheArgument) {
  constexpr int64_t N = 2, S = 3, V = 10;
  std::vector<float> z(static_cast<size_t>(N * S * V), 0.0f);
  std::vector<float> out(N);
  const auto v = dense_view(z, S, V);
  auto run = [&](const int64_t* ids, const int64_t* len, Probe probe, int64_t s_ = 3, int64_t v_ = 10) {
    oar::core::probe_divergence<float>(v, v, ids, len, N, s_, v_, probe, out.data());
  };
  std::vector<int64_t> bad_len = {3, 4};
  expect_invalid([&] { run(nullptr, bad_len.data(), Probe::kLast); }, "lengths[1] must be in [1, S=3], got 4");
  std::vector<int64_t> zero_len = {0, 1};
  expect_invalid([&] { run(nullptr, zero_len.data(), Probe::kAnswerMean); }, "lengths[0]");
  expect_invalid([&] { run(nullptr, nullptr, Probe::kAnswerJoint); }, "answer_ids");
  std::vector<int64_t> ids = {0, 1, 2, 3, 10, 5};
  expect_invalid([&] { run(ids.data(), nullptr, Probe::kAnswerJoint); },
                 "answer_ids[1, 1] must be in [0, V=10), got 10");
  // The same id beyond the row's length is padding and is not read.
  std::vector<int64_t> len = {3, 1};
  EXPECT_NO_THROW(run(ids.data(), len.data(), Probe::kAnswerJoint));
  std::vector<int64_t> neg_ids = {0, -100, 2, 3, 4, 5};
  expect_invalid([&] { run(neg_ids.data(), nullptr, Probe::kAnswerJoint); }, "answer_ids[0, 1]");
  expect_invalid([&] { run(nullptr, nullptr, static_cast<Probe>(9)); }, "probe");
  expect_invalid([&] { run(nullptr, nullptr, Probe::kLast, 0, V); }, "S (probe positions)");
  expect_invalid([&] { run(nullptr, nullptr, Probe::kLast, S, 0); }, "V (vocabulary size)");
  // N = 0 is a no-op, whatever S and V.
  EXPECT_NO_THROW(oar::core::probe_divergence<float>(v, v, nullptr, nullptr, 0, 0, 0, Probe::kLast, nullptr));
}

TEST(Widen, EveryHalfAndBfloat16BitPatternMatchesEigen) {
  for (uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto bits = static_cast<uint16_t>(b);
    const float h_ref = static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(bits));
    const float h_got = oar::core::detail::half_bits_to_float(bits);
    if (std::isnan(h_ref)) {
      EXPECT_TRUE(std::isnan(h_got)) << std::hex << b;
    } else {
      ASSERT_EQ(h_got, h_ref) << std::hex << b;
      ASSERT_EQ(std::signbit(h_got), std::signbit(h_ref)) << std::hex << b;
    }
    const float bf_ref = static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(bits));
    const float bf_got = oar::core::detail::bf16_bits_to_float(bits);
    if (std::isnan(bf_ref)) {
      EXPECT_TRUE(std::isnan(bf_got)) << std::hex << b;
    } else {
      ASSERT_EQ(bf_got, bf_ref) << std::hex << b;
      ASSERT_EQ(std::signbit(bf_got), std::signbit(bf_ref)) << std::hex << b;
    }
  }
}

// ---- backward ---------------------------------------------------------------------------------------

// Central finite differences of the double reference w.r.t. perturbed logit (n, s, v).
double fd_grad(const Logits& c, Logits p, const std::vector<int64_t>& ids, int64_t n, int64_t L, Probe probe,
               int64_t s, int64_t v) {
  const double h = 1e-5;
  const double x = p.at(n, s, v);
  p.at(n, s, v) = x + h;
  const double up = ref_row(c, p, ids, n, L, probe);
  p.at(n, s, v) = x - h;
  const double down = ref_row(c, p, ids, n, L, probe);
  return (up - down) / (2 * h);
}

TEST(ProbeBackward, MatchesFiniteDifferencesOfTheReference) {
  const int64_t N = 2, S = 3, V = 23;
  Logits c = random_logits(N, S, V, 1.0, 11);
  Logits p = random_logits(N, S, V, 1.0, 12);
  const auto ct = to_t<float>(c);
  const auto pt = to_t<float>(p);
  std::vector<int64_t> lengths = {2, 3};
  std::vector<int64_t> ids = {3, 7, 22, 0, 11, 5};
  const std::vector<float> grad_out = {1.5f, -0.5f};
  for (Probe probe : {Probe::kLast, Probe::kAnswerMean, Probe::kAnswerJoint}) {
    std::vector<float> g(static_cast<size_t>(N * S * V), 123.0f);
    oar::core::probe_divergence_backward<float>(grad_out.data(), dense_view(ct, S, V), dense_view(pt, S, V),
                                                ids.data(), lengths.data(), N, S, V, probe, g.data());
    for (int64_t n = 0; n < N; ++n)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t v = 0; v < V; ++v) {
          const double want = grad_out[n] * fd_grad(c, p, ids, n, lengths[n], probe, s, v);
          EXPECT_NEAR(g[(n * S + s) * V + v], want, 2e-6)
              << oar::core::to_string(probe) << " n=" << n << " s=" << s << " v=" << v;
        }
  }
}

TYPED_TEST(ProbeTyped, BackwardClosedFormAcrossChunks) {
  // V = 4500 spans three chunks; compare with the closed form softmax(mean pert) - softmax(mean clean),
  // and check the gradient sums to 0 over the vocabulary (softmax minus softmax / one-hot).
  using T = TypeParam;
  const int64_t N = 1, S = 2, V = 4500;
  Logits c = random_logits(N, S, V, 2.0, 13);
  Logits p = random_logits(N, S, V, 2.0, 14);
  const auto ct = to_t<T>(c);
  const auto pt = to_t<T>(p);
  const float go = 2.0f;
  std::vector<T> g(static_cast<size_t>(N * S * V));
  oar::core::probe_divergence_backward<T>(&go, dense_view(ct, S, V), dense_view(pt, S, V), nullptr, nullptr, N, S,
                                          V, Probe::kAnswerMean, g.data());
  const auto lc = log_softmax(probe_row(c, 0, S, true));
  const auto lp = log_softmax(probe_row(p, 0, S, true));
  // Output rounding of T: relative eps of the element type on values ~ go / S / V.
  const double out_eps = std::is_same_v<T, float> ? 1e-6 : (std::is_same_v<T, Eigen::half> ? 1e-3 : 8e-3);
  for (int64_t s = 0; s < S; ++s) {
    double sum = 0.0, abs_sum = 0.0;
    for (int64_t v = 0; v < V; ++v) {
      const double want = go * (std::exp(lp[v]) - std::exp(lc[v])) / S;
      const double got = static_cast<double>(static_cast<float>(g[s * V + v]));
      EXPECT_NEAR(got, want, 1e-7 + out_eps * std::fabs(want)) << "s=" << s << " v=" << v;
      sum += got;
      abs_sum += std::fabs(got);
    }
    EXPECT_NEAR(sum, 0.0, 1e-6 + out_eps * abs_sum);
  }
}

TEST(ProbeBackward, PositionsBeyondLengthAndLastProbeGetZero) {
  const int64_t N = 2, S = 3, V = 9;
  Logits c = random_logits(N, S, V, 1.0, 15);
  Logits p = random_logits(N, S, V, 1.0, 16);
  const auto ct = to_t<float>(c);
  const auto pt = to_t<float>(p);
  std::vector<int64_t> lengths = {1, 2};
  std::vector<int64_t> ids(static_cast<size_t>(N * S), 1);
  const std::vector<float> go = {1.0f, 1.0f};
  for (Probe probe : {Probe::kLast, Probe::kAnswerMean, Probe::kAnswerJoint}) {
    std::vector<float> g(static_cast<size_t>(N * S * V), 99.0f);
    oar::core::probe_divergence_backward<float>(go.data(), dense_view(ct, S, V), dense_view(pt, S, V), ids.data(),
                                                lengths.data(), N, S, V, probe, g.data());
    for (int64_t n = 0; n < N; ++n) {
      const int64_t active = probe == Probe::kLast ? 1 : lengths[n];
      for (int64_t s = 0; s < S; ++s) {
        double abs_sum = 0.0;
        for (int64_t v = 0; v < V; ++v) abs_sum += std::fabs(g[(n * S + s) * V + v]);
        if (s < active)
          EXPECT_GT(abs_sum, 0.0) << oar::core::to_string(probe) << " n=" << n << " s=" << s;
        else
          EXPECT_EQ(abs_sum, 0.0) << oar::core::to_string(probe) << " n=" << n << " s=" << s;
      }
    }
  }
}

}  // namespace
