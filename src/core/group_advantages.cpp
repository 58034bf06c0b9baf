// GRPO-family sequence advantages over ragged (CSR) groups (method.md section 1).
//
// Every statistic is accumulated in double with two passes (mean, then squared deviations): rewards are
// few (N ~ 1e3-1e4) and the two-pass form keeps the std exact enough that "all rewards equal" and
// "std == 0" agree. All-equal groups are detected by comparing values, never by testing a computed std
// against a tolerance, so a group of identical rewards gets exactly 0 whatever their magnitude.
#include "oar/core/group_advantages.h"

#include <cmath>
#include <limits>
#include <sstream>
#include <string>

namespace oar::core {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw InvalidArgument(msg); }

// Moments of one group's non-NaN rewards.
struct Moments {
  int64_t count = 0;
  double sum = 0.0;
  double mean = 0.0;
  double ssq = 0.0;        // sum of squared deviations from the mean
  bool all_equal = true;   // every non-NaN reward compares equal to the first one
};

template <typename T>
Moments group_moments(const T* r, int64_t begin, int64_t end) {
  Moments m;
  double first = 0.0;
  for (int64_t i = begin; i < end; ++i) {
    const double v = static_cast<double>(r[i]);
    if (std::isnan(v)) continue;
    if (m.count == 0) first = v;
    else if (v != first) m.all_equal = false;
    m.sum += v;
    ++m.count;
  }
  if (m.count == 0) return m;
  m.mean = m.sum / static_cast<double>(m.count);
  for (int64_t i = begin; i < end; ++i) {
    const double v = static_cast<double>(r[i]);
    if (std::isnan(v)) continue;
    m.ssq += (v - m.mean) * (v - m.mean);
  }
  return m;
}

// Throws unless the group's mean and sum of squared deviations are finite in double.
void check_moments_finite(const Moments& m, const std::string& where) {
  if (std::isfinite(m.mean) && std::isfinite(m.ssq)) return;
  std::ostringstream os;
  os << "rewards: the statistics of " << where << " overflow double (mean = " << m.mean
     << ", sum of squared deviations = " << m.ssq << "); rescale the rewards";
  fail(os.str());
}

// Standard deviation from the moments; 0 when undefined (fewer than 2 values for unbiased, none for biased).
double std_of(const Moments& m, StdKind kind) {
  const int64_t dof = kind == StdKind::kUnbiased ? m.count - 1 : m.count;
  if (dof <= 0) return 0.0;
  return std::sqrt(m.ssq / static_cast<double>(dof));
}

// Advantage of reward v in a group of >= 2 non-NaN, not-all-equal rewards.
template <Estimator E>
double regular_advantage(double v, const Moments& g, double group_div, double batch_div) {
  if constexpr (E == Estimator::kGrpo) return (v - g.mean) / group_div;
  if constexpr (E == Estimator::kDrGrpo) return v - g.mean;
  if constexpr (E == Estimator::kBatch) return (v - g.mean) / batch_div;
  if constexpr (E == Estimator::kRloo) return v - (g.sum - v) / static_cast<double>(g.count - 1);
}

// verl's singleton quirk: baseline mean 0 and group std 1 (so grpo divides by 1 + eps). The batch
// estimator keeps its batch divisor; rloo has no divisor (verl's RLOO leaves a lone reward unchanged).
template <Estimator E>
double verl_singleton_advantage(double v, double eps, double batch_div) {
  if constexpr (E == Estimator::kGrpo) return v / (1.0 + eps);
  if constexpr (E == Estimator::kBatch) return v / batch_div;
  return v;  // kDrGrpo, kRloo
}

template <Estimator E, typename T>
GroupAdvantageStats run(const T* r, int64_t n, const int64_t* off, int64_t num_groups,
                        const GroupAdvantageOptions& o, float* out) {
  GroupAdvantageStats st;
  st.num_groups = num_groups;

  // Finite check first, so that nothing is written when the call throws.
  for (int64_t i = 0; i < n; ++i) {
    const double v = static_cast<double>(r[i]);
    if (std::isnan(v)) {
      if (!o.skip_nan) {
        std::ostringstream os;
        os << "rewards must not contain NaN, got rewards[" << i << "] = nan (pass skip_nan=True to exclude "
           << "NaN rows from every statistic and give them advantage 0)";
        fail(os.str());
      }
      ++st.nan_rows;
    } else if (std::isinf(v)) {
      std::ostringstream os;
      os << "rewards must be finite, got rewards[" << i << "] = " << v << " (skip_nan does not cover infinities)";
      fail(os.str());
    }
  }

  // Batch divisor (TRL scale_rewards="batch"): std over every non-NaN reward of the call. A zero or
  // undefined batch std (all rewards equal, or a single reward) is replaced by 1, verl's convention for a
  // degenerate std: then every group of >= 2 is all-equal (A = 0) and only verl-policy singletons read it.
  double batch_div = 1.0 + o.eps;
  if constexpr (E == Estimator::kBatch) {
    const Moments all = group_moments(r, 0, n);
    check_moments_finite(all, "the batch");
    const double s = std_of(all, o.std_kind);
    batch_div = (s > 0.0 ? s : 1.0) + o.eps;
  }

  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t b = off[g], e = off[g + 1];
    const Moments m = group_moments(r, b, e);
    int kind;  // 0: all zero, 1: verl singleton, 2: regular
    if (m.count == 0) {
      ++st.empty_groups;
      kind = 0;
    } else if (m.count == 1) {
      ++st.singleton_groups;
      kind = o.singleton == SingletonPolicy::kVerl ? 1 : 0;
    } else if (m.all_equal) {
      ++st.zero_std_groups;
      kind = 0;
    } else {
      kind = 2;
      // Finite rewards whose sum or squared deviations overflow double (|r| ~ 1e154 and beyond, float64
      // input only) would give a mean or std of inf, hence advantages of 0 or NaN: refuse instead.
      check_moments_finite(m, "group " + std::to_string(g));
    }
    const double group_div = E == Estimator::kGrpo ? std_of(m, o.std_kind) + o.eps : 1.0;
    for (int64_t i = b; i < e; ++i) {
      const double v = static_cast<double>(r[i]);
      double a = 0.0;
      if (!std::isnan(v)) {
        if (kind == 1) a = verl_singleton_advantage<E>(v, o.eps, batch_div);
        else if (kind == 2) a = regular_advantage<E>(v, m, group_div, batch_div);
      }
      const float af = static_cast<float>(a);
      // Reachable only at the edges of double/float range (std underflow with eps = 0, sums overflowing,
      // advantages beyond float32): refuse rather than return inf or NaN.
      if (!std::isfinite(af)) {
        std::ostringstream os;
        os << "rewards: the advantage of rewards[" << i << "] = " << v << " in group " << g
           << " is not finite in float32 (got " << a << "); rescale the rewards or use eps > 0";
        fail(os.str());
      }
      out[i] = af;
    }
  }
  return st;
}

}  // namespace

std::vector<std::string> preset_names() { return {"default", "trl", "verl", "openrlhf"}; }

GroupAdvantageOptions preset_options(std::string_view preset, Estimator estimator) {
  GroupAdvantageOptions o;
  o.estimator = estimator;
  o.std_kind = StdKind::kUnbiased;
  o.singleton = SingletonPolicy::kZero;
  if (preset == "default") {
    o.eps = 1e-6;
  } else if (preset == "trl") {
    o.eps = 1e-4;
  } else if (preset == "verl") {
    o.eps = 1e-6;
    o.singleton = SingletonPolicy::kVerl;
  } else if (preset == "openrlhf") {
    o.eps = 1e-9;
  } else {
    std::string names;
    for (const auto& n : preset_names()) names += (names.empty() ? "\"" : ", \"") + n + "\"";
    fail("preset must be one of {" + names + "}, got \"" + std::string(preset) + "\"");
  }
  return o;
}

void check_offsets(const int64_t* offsets, int64_t num_groups, int64_t n, const char* arg) {
  std::ostringstream os;
  if (num_groups < 0) {
    os << arg << " must have G + 1 >= 1 entries, got G = " << num_groups;
    fail(os.str());
  }
  if (n < 0) {
    os << "the number of rewards N must be >= 0, got " << n;
    fail(os.str());
  }
  if (offsets == nullptr) {
    os << arg << " must not be null";
    fail(os.str());
  }
  if (offsets[0] != 0) {
    os << arg << "[0] must be 0 (CSR offsets start at row 0), got " << offsets[0];
    fail(os.str());
  }
  for (int64_t g = 0; g < num_groups; ++g) {
    if (offsets[g + 1] < offsets[g]) {
      os << arg << " must be non-decreasing, got " << arg << "[" << g << "] = " << offsets[g] << " > " << arg << "["
         << g + 1 << "] = " << offsets[g + 1];
      fail(os.str());
    }
  }
  if (offsets[num_groups] != n) {
    os << arg << "[-1] (= " << arg << "[G], G = " << num_groups << ") must equal the number of rewards N = " << n
       << ", got " << offsets[num_groups];
    fail(os.str());
  }
}

template <typename T>
GroupAdvantageStats group_advantages(const T* rewards, int64_t n, const int64_t* offsets, int64_t num_groups,
                                     const GroupAdvantageOptions& opts, float* out) {
  check_offsets(offsets, num_groups, n, "offsets");
  if (!(std::isfinite(opts.eps) && opts.eps >= 0.0)) {
    std::ostringstream os;
    os << "eps must be finite and >= 0, got " << opts.eps;
    fail(os.str());
  }
  if (n > 0 && (rewards == nullptr || out == nullptr)) fail("rewards and out must not be null when N > 0");
  switch (opts.estimator) {
    case Estimator::kGrpo: return run<Estimator::kGrpo>(rewards, n, offsets, num_groups, opts, out);
    case Estimator::kDrGrpo: return run<Estimator::kDrGrpo>(rewards, n, offsets, num_groups, opts, out);
    case Estimator::kBatch: return run<Estimator::kBatch>(rewards, n, offsets, num_groups, opts, out);
    case Estimator::kRloo: return run<Estimator::kRloo>(rewards, n, offsets, num_groups, opts, out);
  }
  fail("estimator: unknown enum value " + std::to_string(static_cast<int>(opts.estimator)));
}

template GroupAdvantageStats group_advantages<float>(const float*, int64_t, const int64_t*, int64_t,
                                                     const GroupAdvantageOptions&, float*);
template GroupAdvantageStats group_advantages<double>(const double*, int64_t, const int64_t*, int64_t,
                                                      const GroupAdvantageOptions&, float*);

}  // namespace oar::core
