// Outcome-probe divergences over the vocabulary (method.md sections 2-4): fused log-softmax + forward KL,
// fp32 accumulation whatever the input dtype. Torch-free: T is float, Eigen::half or Eigen::bfloat16
// (bit-compatible with at::Half / at::BFloat16).
#pragma once

#include <cstdint>

#include "oar/core/common.h"

namespace oar::core {

/// A strided view of logits (N, S, V): element (n, s, v) at data[n * stride_n + s * stride_s + v]
/// (the vocabulary dimension must be contiguous). stride_n may be 0 to broadcast one row to all N.
template <typename T>
struct LogitsView {
  const T* data;
  int64_t stride_n;
  int64_t stride_s;
};

/// Validates the non-tensor inputs shared by probe_divergence and its backward, with messages that name
/// the argument and, for per-row values, the absolute index ("lengths[3] must be in [1, S=4], got 0"):
/// N >= 0; when N > 0, S >= 1 and V >= 1; each lengths[n] in [1, S] (lengths may be null); for
/// kAnswerJoint, answer_ids non-null and answer_ids[n, s] in [0, V) for s < len[n] (entries at s >= len[n]
/// are padding and never read). Adapters call this once on the whole batch before splitting rows across
/// threads, so that the error reported is the first bad row's. Throws InvalidArgument.
void check_probe_inputs(const int64_t* answer_ids, const int64_t* lengths, int64_t N, int64_t S, int64_t V,
                        Probe probe);

/// out[n] for each of N rows, given clean and perturbed logits (N, S, V), the probe positions s < len[n]
/// (lengths may be null: every row uses all S positions; each length must be in [1, S]):
///   kLast:        KL(softmax(clean[n,0]) || softmax(pert[n,0]))
///   kAnswerMean:  KL(softmax(mean_{s<len} clean[n,s]) || softmax(mean_{s<len} pert[n,s]))
///   kAnswerJoint: phi(clean) - phi(pert), phi = mean_{s<len} log_softmax(Z[n,s])[answer_ids[n,s]]
///                 (NOT clamped here: OAR-P clamps at 0, OAR-G differentiates the raw drop)
/// answer_ids (N, S) row-major int64 is required for kAnswerJoint (ids in [0, V)), ignored otherwise.
/// Throws InvalidArgument on bad lengths/ids (see check_probe_inputs) and on a row whose result is NaN (a NaN
/// or +inf logit, or a probed position without any finite logit); -inf logits are allowed (zero probability).
/// KL is clamped at 0 against rounding below zero. Accumulation: float within 2048-entry vocabulary chunks,
/// double across chunks and positions. Single-threaded; callers parallelize over rows (RowRange overload).
/// Memory: O(1) per row; when clean.stride_n == 0 and more than one row is computed, the clean softmax is
/// computed once per call into one fp32 scratch row of V floats (OAR-P: one clean context, N variants).
template <typename T>
void probe_divergence(LogitsView<T> clean, LogitsView<T> perturbed, const int64_t* answer_ids,
                      const int64_t* lengths, int64_t N, int64_t S, int64_t V, Probe probe, float* out);

/// Same, computing only rows [rows.begin, rows.end) (0 <= begin <= end <= N; out[n] written for those n).
template <typename T>
void probe_divergence(LogitsView<T> clean, LogitsView<T> perturbed, const int64_t* answer_ids,
                      const int64_t* lengths, int64_t N, int64_t S, int64_t V, Probe probe, float* out,
                      RowRange rows);

/// Gradient of out[n] (as above, before the KL clamp) w.r.t. perturbed logits, scaled by grad_out[n]:
///   kLast:        g[n,0,:] = grad_out[n] * (softmax(pert[n,0]) - softmax(clean[n,0])); other s: 0
///   kAnswerMean:  g[n,s,:] = grad_out[n] * (softmax(mean pert) - softmax(mean clean)) / len  for s < len
///   kAnswerJoint: g[n,s,:] = grad_out[n] * (softmax(pert[n,s]) - onehot(a[n,s])) / len       for s < len
/// Positions s >= len get 0. The clean logits are treated as constants (detached).
/// grad_perturbed is (N, S, V) contiguous, of type T.
template <typename T>
void probe_divergence_backward(const float* grad_out, LogitsView<T> clean, LogitsView<T> perturbed,
                               const int64_t* answer_ids, const int64_t* lengths, int64_t N, int64_t S,
                               int64_t V, Probe probe, T* grad_perturbed);

/// Same, computing only rows [rows.begin, rows.end) of grad_perturbed (grad_out and grad_perturbed are
/// still indexed from row 0).
template <typename T>
void probe_divergence_backward(const float* grad_out, LogitsView<T> clean, LogitsView<T> perturbed,
                               const int64_t* answer_ids, const int64_t* lengths, int64_t N, int64_t S,
                               int64_t V, Probe probe, T* grad_perturbed, RowRange rows);

}  // namespace oar::core
