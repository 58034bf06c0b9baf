// Outcome-probe divergences (method.md section 2), used by OAR-P (section 3) and OAR-G (section 4).
//
// Why chunked online softmax: a probe row has V ~ 1.5e5 logits and answer_mean reads S of them per
// vocabulary entry. Materializing log-probabilities per row would cost V floats of scratch per row and a
// second trip through memory. Instead the vocabulary is walked in L1-sized chunks: each chunk's logits (or
// mean logits) are widened to float in a small stack buffer (float32 single positions are read in place),
// reduced with the multi-ISA max/exp/sum loops of vec_math.h, and merged into a running (max, sum) state
// kept in double. One pass over the input per forward row; the
// backward needs two (normalizers first, then the gradient).
//
// KL(p || q) over logits zc (clean) and zp (perturbed), with lse = log-sum-exp:
//   KL = sum_v p_v (zc_v - zp_v) + (lse(zp) - lse(zc))
// and sum_v p_v (zc_v - zp_v) = t / s_c where t = sum_v exp(zc_v - m_c) (zc_v - zp_v) rides along with
// s_c = sum_v exp(zc_v - m_c) under the same rescaling when the running max m_c changes. Taking the
// difference zc - zp per entry (not E_p[zc] - E_p[zp]) keeps small KLs accurate, and identical inputs
// give exactly 0 because both normalizers go through the same code.
//
// Broadcast clean logits (stride_n == 0, OAR-P's one clean context against N masked variants): the clean
// probabilities are computed once per call into one fp32 scratch row of V entries, so each perturbed row
// costs one exp per vocabulary entry instead of two.
#include "oar/core/probe.h"

#include "vec_math.h"
#include "widen.h"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace oar::core {
namespace {

// 2048 floats = 8 KiB per buffer: three buffers stay in L1 and the chunk count per row stays small
// (75 chunks at V = 151936), so the double-precision merges are negligible.
constexpr int64_t kChunk = 2048;
constexpr double kNegInf = -std::numeric_limits<double>::infinity();
constexpr float kNegInfF = -std::numeric_limits<float>::infinity();

using ArrF = Eigen::Array<float, Eigen::Dynamic, 1>;
using MapF = Eigen::Map<ArrF, Eigen::Aligned16>;
using CMapF = Eigen::Map<const ArrF, Eigen::Aligned16>;
using CMapFU = Eigen::Map<const ArrF>;  // unaligned (slices of the scratch row)

template <typename T>
inline const T* row_ptr(const LogitsView<T>& z, int64_t n, int64_t s) {
  return z.data + n * z.stride_n + s * z.stride_s;
}

// Widening loads (float16 / bfloat16 -> float32): the multi-ISA loops of vec_math.h for the three logits
// dtypes, src/core/widen.h for anything else.
template <typename T>
inline const uint16_t* bits_of(const T* p) {
  static_assert(sizeof(T) == sizeof(uint16_t), "16-bit element type");
  return reinterpret_cast<const uint16_t*>(p);
}
template <typename T>
inline void load(const T* src, float* dst, int64_t len) {
  if constexpr (std::is_same_v<T, float>) {
    detail::vload_f32(src, dst, len);
  } else if constexpr (std::is_same_v<T, Eigen::bfloat16>) {
    detail::vload_bf16(bits_of(src), dst, len);
  } else if constexpr (std::is_same_v<T, Eigen::half>) {
    detail::vload_f16(bits_of(src), dst, len);
  } else {
    detail::widen_load(src, dst, len);
  }
}
template <typename T>
inline void load_add(const T* src, float* dst, int64_t len) {
  if constexpr (std::is_same_v<T, float>) {
    detail::vadd_f32(src, dst, len);
  } else if constexpr (std::is_same_v<T, Eigen::bfloat16>) {
    detail::vadd_bf16(bits_of(src), dst, len);
  } else if constexpr (std::is_same_v<T, Eigen::half>) {
    detail::vadd_f16(bits_of(src), dst, len);
  } else {
    detail::widen_add(src, dst, len);
  }
}

// buf[0, len) = the logits entering the probe distribution over vocabulary entries [v0, v0 + len):
// position 0 (kLast, L = 1) or the mean over positions s < L (kAnswerMean). Sum in float, then scale by
// 1/L.
template <typename T>
inline void probe_logits(const LogitsView<T>& z, int64_t n, int64_t L, int64_t v0, int64_t len, float* buf) {
  load(row_ptr(z, n, 0) + v0, buf, len);
  if (L == 1) return;
  for (int64_t s = 1; s < L; ++s) load_add(row_ptr(z, n, s) + v0, buf, len);
  MapF(buf, len) *= 1.0f / static_cast<float>(L);
}

// The probe logits of chunk [v0, v0 + len): a pointer into the input itself when no widening or averaging
// is needed (float32, one position), else probe_logits into buf. Read-only either way.
template <typename T>
inline const float* probe_view(const LogitsView<T>& z, int64_t n, int64_t L, int64_t v0, int64_t len,
                               float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    if (L == 1) return row_ptr(z, n, 0) + v0;
  }
  probe_logits(z, n, L, v0, len, buf);
  return buf;
}

// e[i] = exp(z[i] - m); returns sum_i e[i]. The one exp+sum routine of this file: clean and perturbed
// normalizers go through it, so identical inputs give bit-identical normalizers.
// (The vectorized exp of vec_math.h returns ~1e-38, not 0, far below the max; harmless in sums, and -inf
// logits are masked explicitly where it matters, see detail::vdot_diff.)
inline float exp_shifted_sum(const float* z, float m, float* e, int64_t len) {
  return detail::vexp_shifted_sum(z, m, e, len);
}

// Running log-sum-exp: lse = m + log(s), s = sum exp(z - m).
struct Lse {
  double m = kNegInf;
  double s = 0.0;

  // Merges a chunk with max cm and sum cs = sum exp(z - cm); returns the factors applied to the old sum and
  // to cs, so that a quantity riding along (t of the KL) is rescaled identically. A NaN cm or cs ends up in
  // s, which the callers detect on the final value.
  std::pair<double, double> merge(float cm, float cs) {
    if (cm > m) {
      const double f = std::exp(m - static_cast<double>(cm));
      s = s * f + cs;
      m = cm;
      return {f, 1.0};
    }
    const double f = std::exp(static_cast<double>(cm) - m);
    s += cs * f;
    return {1.0, f};
  }
  double value() const { return m + std::log(s); }
};

// Adds one chunk to `acc`; e receives exp(z - chunk max). Returns false (e untouched) for a chunk without
// mass (all -inf).
inline bool lse_chunk(const float* z, float* e, int64_t len, Lse& acc) {
  const float cm = detail::vmax(z, len);
  if (cm == kNegInfF) return false;
  acc.merge(cm, exp_shifted_sum(z, cm, e, len));
  return true;
}

[[noreturn]] void throw_non_finite(int64_t n, const char* what) {
  throw InvalidArgument("probe_divergence: row " + std::to_string(n) + " gives a NaN " + what +
                        "; clean_logits / perturbed_logits must be finite (-inf allowed) with at least one "
                        "finite logit per probed position");
}

void check_probe_enum(Probe probe) {
  if (probe != Probe::kLast && probe != Probe::kAnswerMean && probe != Probe::kAnswerJoint)
    throw InvalidArgument("probe must be one of {last, answer_mean, answer_joint}, got enum value " +
                          std::to_string(static_cast<int32_t>(probe)));
}

inline int64_t length_of(const int64_t* lengths, int64_t n, int64_t S) { return lengths ? lengths[n] : S; }

// Number of positions averaged by a distribution probe for a row of length L.
inline int64_t probe_positions(Probe probe, int64_t L) { return probe == Probe::kLast ? 1 : L; }

// Clean side of a broadcast clean row (stride_n == 0), for one probe length L, in the one fp32 scratch
// row: e[v] = exp(zc[v] - m) with m the max clean probe logit, sum = sum_v e[v] in double, so that
// softmax(zc) = e / sum with the normalization applied to the same rounded e the KL weights use (no
// systematic error from rounding lse to float), and lse = log-sum-exp computed by the same online routine
// as the perturbed side (identical inputs then give bit-identical normalizers, hence KL exactly 0).
// Rebuilt only when L changes (rows of one rollout usually share it).
template <typename T>
class CleanCache {
 public:
  explicit CleanCache(int64_t V) : V_(V) {}

  void ensure(const LogitsView<T>& clean, int64_t L) {
    if (L == L_) return;
    if (e_.empty()) e_.resize(static_cast<size_t>(V_));
    alignas(64) float bc[kChunk];
    alignas(64) float be[kChunk];
    Lse acc;
    for (int64_t v0 = 0; v0 < V_; v0 += kChunk) {
      const int64_t len = std::min(kChunk, V_ - v0);
      probe_logits(clean, 0, L, v0, len, bc);
      lse_chunk(bc, be, len, acc);
    }
    lse_ = acc.value();
    const float m = static_cast<float>(acc.m);  // the max itself: a float logit, exact
    sum_ = 0.0;
    for (int64_t v0 = 0; v0 < V_; v0 += kChunk) {
      const int64_t len = std::min(kChunk, V_ - v0);
      probe_logits(clean, 0, L, v0, len, bc);
      sum_ += exp_shifted_sum(bc, m, e_.data() + v0, len);
    }
    L_ = L;
  }
  const float* e() const { return e_.data(); }  ///< exp(zc - max), unnormalized
  double sum() const { return sum_; }
  double lse() const { return lse_; }

 private:
  int64_t V_;
  int64_t L_ = -1;
  double lse_ = 0.0;
  double sum_ = 0.0;
  std::vector<float> e_;
};

// t (or a chunk's t) under a merge factor f >= 0 of Lse::merge. A +inf t holds a term of positive clean
// probability against a perturbed -inf logit: it stays +inf under any factor, where inf * f would give NaN once
// f underflows to 0 (chunk maxima more than ~745 apart, e.g. a chunk of -1e4-masked logits). NaN stays NaN.
inline double rescaled(double t, double f) { return std::isinf(t) ? t : t * f; }

// KL of one row, general strides: clean and perturbed exps per chunk.
template <typename T>
double kl_row(const LogitsView<T>& clean, const LogitsView<T>& pert, int64_t n, int64_t Lp, int64_t V) {
  alignas(64) float bc[kChunk];
  alignas(64) float bp[kChunk];
  alignas(64) float be[kChunk];
  Lse c, p;
  double t = 0.0;
  for (int64_t v0 = 0; v0 < V; v0 += kChunk) {
    const int64_t len = std::min(kChunk, V - v0);
    const float* zc = probe_view(clean, n, Lp, v0, len, bc);
    const float* zp = probe_view(pert, n, Lp, v0, len, bp);
    lse_chunk(zp, be, len, p);
    const float cm = detail::vmax(zc, len);
    if (cm == kNegInfF) continue;  // no clean mass in this chunk
    const float cs = exp_shifted_sum(zc, cm, be, len);
    const float ct = detail::vdot_diff(be, zc, zp, len);
    const auto [f_old, f_new] = c.merge(cm, cs);
    t = rescaled(t, f_old) + rescaled(ct, f_new);
  }
  return t / c.s + (p.value() - c.value());
}

// KL of one row against a cached broadcast clean distribution: one exp per vocabulary entry.
template <typename T>
double kl_row_cached(const LogitsView<T>& clean, const LogitsView<T>& pert, const CleanCache<T>& cache,
                     int64_t n, int64_t Lp, int64_t V) {
  alignas(64) float bc[kChunk];
  alignas(64) float bp[kChunk];
  alignas(64) float be[kChunk];
  Lse p;
  double t = 0.0;
  for (int64_t v0 = 0; v0 < V; v0 += kChunk) {
    const int64_t len = std::min(kChunk, V - v0);
    const float* zc = probe_view(clean, n, Lp, v0, len, bc);  // L2-resident: the same clean row for every n
    const float* zp = probe_view(pert, n, Lp, v0, len, bp);
    lse_chunk(zp, be, len, p);
    t += detail::vdot_diff(cache.e() + v0, zc, zp, len);
  }
  return t / cache.sum() + (p.value() - cache.lse());
}

// log-sum-exp of one position's logits.
template <typename T>
double lse_position(const T* z, int64_t V) {
  alignas(64) float buf[kChunk];
  alignas(64) float be[kChunk];
  Lse acc;
  for (int64_t v0 = 0; v0 < V; v0 += kChunk) {
    const int64_t len = std::min(kChunk, V - v0);
    if constexpr (std::is_same_v<T, float>) {
      lse_chunk(z + v0, be, len, acc);  // float input: no widening copy
    } else {
      load(z + v0, buf, len);
      lse_chunk(buf, be, len, acc);
    }
  }
  return acc.value();
}

template <typename T>
inline double logit_at(const T* z) {
  return detail::widen(*z);
}

// kAnswerJoint for one row: phi_clean - phi_pert, phi = mean_s log_softmax(z_s)[a_s]. clean_lse, when
// non-null, holds the log-sum-exp of each clean position (broadcast clean rows).
template <typename T>
double joint_row(const LogitsView<T>& clean, const LogitsView<T>& pert, const int64_t* ids,
                 const double* clean_lse, int64_t n, int64_t L, int64_t S, int64_t V) {
  double drop = 0.0;
  for (int64_t s = 0; s < L; ++s) {
    const int64_t a = ids[n * S + s];
    const T* zc = row_ptr(clean, n, s);
    const T* zp = row_ptr(pert, n, s);
    const double lse_c = clean_lse ? clean_lse[s] : lse_position(zc, V);
    drop += (logit_at(zc + a) - lse_c) - (logit_at(zp + a) - lse_position(zp, V));
  }
  return drop / static_cast<double>(L);
}

// Range-checks lengths / answer_ids of rows [begin, end).
void check_rows(const int64_t* answer_ids, const int64_t* lengths, int64_t S, int64_t V, Probe probe,
                int64_t begin, int64_t end) {
  if (lengths) {
    for (int64_t n = begin; n < end; ++n)
      if (lengths[n] < 1 || lengths[n] > S)
        throw InvalidArgument("lengths[" + std::to_string(n) + "] must be in [1, S=" + std::to_string(S) +
                              "], got " + std::to_string(lengths[n]));
  }
  if (probe != Probe::kAnswerJoint) return;
  if (!answer_ids) throw InvalidArgument("answer_ids (N, S) is required for probe 'answer_joint', got None");
  for (int64_t n = begin; n < end; ++n) {
    const int64_t L = length_of(lengths, n, S);
    for (int64_t s = 0; s < L; ++s) {
      const int64_t a = answer_ids[n * S + s];
      if (a < 0 || a >= V)
        throw InvalidArgument("answer_ids[" + std::to_string(n) + ", " + std::to_string(s) +
                              "] must be in [0, V=" + std::to_string(V) + "), got " + std::to_string(a));
    }
  }
}

void check_sizes(int64_t N, int64_t S, int64_t V, Probe probe) {
  check_probe_enum(probe);
  if (N < 0) throw InvalidArgument("N (rows of the logits) must be >= 0, got " + std::to_string(N));
  if (N == 0) return;
  if (S < 1) throw InvalidArgument("S (probe positions) must be >= 1, got " + std::to_string(S));
  if (V < 1) throw InvalidArgument("V (vocabulary size) must be >= 1, got " + std::to_string(V));
}

void check_range(RowRange rows, int64_t N) {
  if (rows.begin < 0 || rows.begin > rows.end || rows.end > N)
    throw InvalidArgument("rows must satisfy 0 <= begin <= end <= N=" + std::to_string(N) + ", got [" +
                          std::to_string(rows.begin) + ", " + std::to_string(rows.end) + ")");
}

}  // namespace

void check_probe_inputs(const int64_t* answer_ids, const int64_t* lengths, int64_t N, int64_t S, int64_t V,
                        Probe probe) {
  check_sizes(N, S, V, probe);
  if (N > 0) check_rows(answer_ids, lengths, S, V, probe, 0, N);
}

// Whether to cache the clean side: the clean logits are one row broadcast over N (stride_n == 0) and the
// call covers more than one row (the cache costs about two clean passes, a row without it one).
template <typename T>
bool use_clean_cache(const LogitsView<T>& clean, RowRange rows) {
  return clean.stride_n == 0 && rows.end - rows.begin > 1;
}

template <typename T>
void probe_divergence(LogitsView<T> clean, LogitsView<T> perturbed, const int64_t* answer_ids,
                      const int64_t* lengths, int64_t N, int64_t S, int64_t V, Probe probe, float* out,
                      RowRange rows) {
  check_sizes(N, S, V, probe);
  check_range(rows, N);
  if (rows.begin == rows.end) return;
  check_rows(answer_ids, lengths, S, V, probe, rows.begin, rows.end);
  const bool cached = use_clean_cache(clean, rows);

  if (probe == Probe::kAnswerJoint) {
    std::vector<double> clean_lse;
    if (cached) {
      clean_lse.resize(static_cast<size_t>(S));
      for (int64_t s = 0; s < S; ++s) clean_lse[s] = lse_position(row_ptr(clean, 0, s), V);
    }
    for (int64_t n = rows.begin; n < rows.end; ++n) {
      const double drop = joint_row(clean, perturbed, answer_ids, cached ? clean_lse.data() : nullptr, n,
                                    length_of(lengths, n, S), S, V);
      if (std::isnan(drop)) throw_non_finite(n, "answer log-likelihood drop");
      out[n] = static_cast<float>(drop);
    }
    return;
  }

  CleanCache<T> cache(cached ? V : 0);
  for (int64_t n = rows.begin; n < rows.end; ++n) {
    const int64_t Lp = probe_positions(probe, length_of(lengths, n, S));
    double kl;
    if (cached) {
      cache.ensure(clean, Lp);
      kl = kl_row_cached(clean, perturbed, cache, n, Lp, V);
    } else {
      kl = kl_row(clean, perturbed, n, Lp, V);
    }
    if (std::isnan(kl)) throw_non_finite(n, "KL divergence");
    out[n] = static_cast<float>(kl < 0.0 ? 0.0 : kl);  // a true KL is >= 0: clamp rounding
  }
}

template <typename T>
void probe_divergence(LogitsView<T> clean, LogitsView<T> perturbed, const int64_t* answer_ids,
                      const int64_t* lengths, int64_t N, int64_t S, int64_t V, Probe probe, float* out) {
  probe_divergence<T>(clean, perturbed, answer_ids, lengths, N, S, V, probe, out, RowRange{0, N < 0 ? 0 : N});
}

namespace {

// Writes the float chunk buf[0, len) to g[0, len) in T.
template <typename T>
inline void store(const float* buf, T* g, int64_t len) {
  for (int64_t i = 0; i < len; ++i) g[i] = static_cast<T>(buf[i]);
}

// d(-phi_pert)/dz[n, s] = (softmax(z[n, s]) - onehot(a_s)) * scale, scale = grad_out / L; the clean logits
// do not enter.
template <typename T>
void joint_backward_row(const LogitsView<T>& pert, const int64_t* ids, int64_t n, int64_t L, int64_t S,
                        int64_t V, float scale, T* g_row) {
  alignas(64) float bp[kChunk];
  for (int64_t s = 0; s < L; ++s) {
    const T* zp = row_ptr(pert, n, s);
    const float lse = static_cast<float>(lse_position(zp, V));
    const int64_t a = ids[n * S + s];
    T* g = g_row + s * V;
    for (int64_t v0 = 0; v0 < V; v0 += kChunk) {
      const int64_t len = std::min(kChunk, V - v0);
      load(zp + v0, bp, len);
      detail::vexp_shifted_scaled(bp, lse, scale, bp, len);
      // The one-hot term is applied in float, before the (possibly 16-bit) store.
      if (a >= v0 && a < v0 + len) bp[a - v0] -= scale;
      store(bp, g + v0, len);
    }
  }
}

// Distribution probes: go * (softmax(zp) - softmax(zc)) / Lp written to the Lp active positions.
// Pass 1 gets the normalizers, pass 2 writes. With a cache, the clean softmax is read from it.
template <typename T>
void kl_backward_row(const LogitsView<T>& clean, const LogitsView<T>& pert, const CleanCache<T>* cache,
                     int64_t n, int64_t Lp, int64_t V, float go, T* g_row) {
  alignas(64) float bc[kChunk];
  alignas(64) float bp[kChunk];
  alignas(64) float be[kChunk];
  Lse lc, lp;
  for (int64_t v0 = 0; v0 < V; v0 += kChunk) {
    const int64_t len = std::min(kChunk, V - v0);
    if (!cache) {
      probe_logits(clean, n, Lp, v0, len, bc);
      lse_chunk(bc, be, len, lc);
    }
    probe_logits(pert, n, Lp, v0, len, bp);
    lse_chunk(bp, be, len, lp);
  }
  const float lse_c = static_cast<float>(cache ? cache->lse() : lc.value());
  const float lse_p = static_cast<float>(lp.value());
  const float scale = go / static_cast<float>(Lp);
  const float inv_sum_c = cache ? static_cast<float>(1.0 / cache->sum()) : 0.0f;
  for (int64_t v0 = 0; v0 < V; v0 += kChunk) {
    const int64_t len = std::min(kChunk, V - v0);
    probe_logits(pert, n, Lp, v0, len, bp);
    detail::vexp_shifted_scaled(bp, lse_p, 1.0f, bp, len);
    MapF b(bp, len);
    if (cache) {
      b = (b - CMapFU(cache->e() + v0, len) * inv_sum_c) * scale;
    } else {
      probe_logits(clean, n, Lp, v0, len, bc);
      detail::vexp_shifted_scaled(bc, lse_c, 1.0f, bc, len);
      b = (b - CMapF(bc, len)) * scale;
    }
    for (int64_t s = 0; s < Lp; ++s) store(bp, g_row + s * V + v0, len);
  }
}

}  // namespace

template <typename T>
void probe_divergence_backward(const float* grad_out, LogitsView<T> clean, LogitsView<T> perturbed,
                               const int64_t* answer_ids, const int64_t* lengths, int64_t N, int64_t S,
                               int64_t V, Probe probe, T* grad_perturbed, RowRange rows) {
  check_sizes(N, S, V, probe);
  check_range(rows, N);
  if (rows.begin == rows.end) return;
  check_rows(answer_ids, lengths, S, V, probe, rows.begin, rows.end);
  const bool cached = probe != Probe::kAnswerJoint && use_clean_cache(clean, rows);
  CleanCache<T> cache(cached ? V : 0);
  for (int64_t n = rows.begin; n < rows.end; ++n) {
    const int64_t L = length_of(lengths, n, S);
    const int64_t Lp = probe_positions(probe, L);
    T* g_row = grad_perturbed + n * S * V;
    // Positions that carry no gradient: s >= 1 for kLast, s >= L otherwise.
    std::fill(g_row + Lp * V, g_row + S * V, T(0.0f));
    if (probe == Probe::kAnswerJoint) {
      joint_backward_row(perturbed, answer_ids, n, L, S, V, grad_out[n] / static_cast<float>(L), g_row);
    } else {
      if (cached) cache.ensure(clean, Lp);
      kl_backward_row(clean, perturbed, cached ? &cache : nullptr, n, Lp, V, grad_out[n], g_row);
    }
  }
}

template <typename T>
void probe_divergence_backward(const float* grad_out, LogitsView<T> clean, LogitsView<T> perturbed,
                               const int64_t* answer_ids, const int64_t* lengths, int64_t N, int64_t S,
                               int64_t V, Probe probe, T* grad_perturbed) {
  probe_divergence_backward<T>(grad_out, clean, perturbed, answer_ids, lengths, N, S, V, probe, grad_perturbed,
                               RowRange{0, N < 0 ? 0 : N});
}

#define OAR_INSTANTIATE_PROBE(T)                                                                           \
  template void probe_divergence<T>(LogitsView<T>, LogitsView<T>, const int64_t*, const int64_t*, int64_t,  \
                                    int64_t, int64_t, Probe, float*);                                      \
  template void probe_divergence<T>(LogitsView<T>, LogitsView<T>, const int64_t*, const int64_t*, int64_t,  \
                                    int64_t, int64_t, Probe, float*, RowRange);                            \
  template void probe_divergence_backward<T>(const float*, LogitsView<T>, LogitsView<T>, const int64_t*,    \
                                             const int64_t*, int64_t, int64_t, int64_t, Probe, T*);         \
  template void probe_divergence_backward<T>(const float*, LogitsView<T>, LogitsView<T>, const int64_t*,    \
                                             const int64_t*, int64_t, int64_t, int64_t, Probe, T*, RowRange);

OAR_INSTANTIATE_PROBE(float)
OAR_INSTANTIATE_PROBE(Eigen::half)
OAR_INSTANTIATE_PROBE(Eigen::bfloat16)

#undef OAR_INSTANTIATE_PROBE

}  // namespace oar::core
