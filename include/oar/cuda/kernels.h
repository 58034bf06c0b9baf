// Launchers of oar's CUDA kernels (src/cuda/*.cu). Torch-free: raw device pointers, sizes and a stream;
// element types are passed as oar::core::DType and modes as core enums, so that this header needs no CUDA
// header (the kernels turn the enums into template parameters; strings never reach them).
//
// Conventions shared by every launcher:
// - All pointers are device pointers on the current device; `stream` is a cudaStream_t.
// - Every launch is checked (cudaGetLastError); a failure throws std::runtime_error with the CUDA error string.
//   A CUDA error already pending on the calling thread before the launch (left by other code) is thrown as
//   such ("an earlier CUDA error, not from oar") and nothing is launched.
// - Unsupported element types or options throw oar::core::InvalidArgument (the adapters check them first).
// - Data-dependent input errors (a NaN reward, an out-of-range id, ...) are never thrown from here: the kernels
//   find them on the device, never read or write out of bounds because of them, and report the error into an
//   ErrorRecord (below). The caller decides when to read it back (docs/design.md, "CUDA input validation").
// Only available when the library was built with OAR_WITH_CUDA (oar::core::compiled_with_cuda()).
#pragma once

#include <cstddef>
#include <cstdint>

#include "oar/core/common.h"
#include "oar/core/group_advantages.h"
#include "oar/core/reshape.h"

struct CUstream_st;

namespace oar::cuda {

using Stream = CUstream_st*;  // == cudaStream_t

// ---- device-side error reporting ------------------------------------------------------------------------------

/// Which op reported an error (for messages of errors read back later).
enum class OpId : uint32_t {
  kNone = 0,
  kGroupAdvantages = 1,
  kNormalizeImportance = 2,
  kReshapeAdvantages = 3,
  kProbeDivergence = 4,
  kProbeDivergenceBackward = 5,
  kGradXInput = 6,
  kBuildMaskedBatch = 7,
};

/// What was wrong. `index` / `value` of the record are described per code.
enum class ErrorCode : uint32_t {
  kNone = 0,
  kBadOffsets = 1,              ///< index: group g whose CSR bounds are invalid (G for offsets[G] != N)
  kNanReward = 2,               ///< index: row; value: the reward
  kInfReward = 3,               ///< index: row; value: the reward
  kStatsOverflow = 4,           ///< index: group (-1: the batch); mean or squared deviations overflow double
  kAdvantageOverflow = 5,       ///< index: row; value: the advantage (double) that is not finite in float32
  kNonFiniteAdvantage = 6,      ///< index: row b of `advantages`; value: the advantage
  kNotSubset = 7,               ///< index: b * T + t where reasoning_mask is set and response_mask is not
  kBadScore = 8,                ///< index: b * T + t; value: a NaN/Inf/negative raw score on the mask
  kScoreOutsideUnit = 9,        ///< index: b * T + t; value: a normalized score outside [0, 1]
  kBetaOverflow = 10,           ///< index: row; the boost weights overflow float32
  kTokenAdvantageOverflow = 11, ///< index: b * T + t; value: weight * advantage
  kBadLength = 12,              ///< index: row n; value: lengths[n] outside [1, S]
  kBadAnswerId = 13,            ///< index: n * S + s; value: answer_ids[n, s] outside [0, V)
  kNanDivergence = 14,          ///< index: row n whose probe divergence is NaN
  kNonFiniteResult = 15,        ///< index: row; value: the non-finite grad x input result
  kBadRowIndex = 16,            ///< index: variant m; value: row_index[m] outside [0, B)
  kBadPosition = 17,            ///< index: variant m; value: positions[m] outside [0, T)
};

/// One record per device, in device memory, zero-initialized once and never reset: every field is tagged
/// with the epoch (a per-device call counter) of the call that wrote it, so a call needs no memset first.
///   error   = (epoch << 16) | (op << 8) | code of the most recent failing call (written with atomicMax, so
///             a later call's error replaces an earlier one; within one call the largest (op, code) wins);
///   index, value: of that error (best effort when several threads of one call fail);
///   flag[i] = epoch of the last call that set op-specific marker i (group_advantages: 0 = a group of one
///             valid reward was seen, 1 = a group of two or more was seen).
struct ErrorRecord {
  uint64_t error;
  int64_t index;
  double value;
  uint64_t flag[2];
  uint64_t reserved[3];
};
static_assert(sizeof(ErrorRecord) == 64, "ErrorRecord is one 64-byte line");

/// Where a launch reports its data errors: the device's record and the call's epoch.
struct ErrorSink {
  ErrorRecord* record;
  uint64_t epoch;
};

inline uint64_t error_epoch(uint64_t error) { return error >> 16; }
inline OpId error_op(uint64_t error) { return static_cast<OpId>((error >> 8) & 0xffu); }
inline ErrorCode error_code(uint64_t error) { return static_cast<ErrorCode>(error & 0xffu); }
const char* to_string(OpId op);
const char* to_string(ErrorCode code);

/// The error record of `device` (allocated and zeroed on first use; lives until the process exits).
ErrorRecord* device_error_record(int device);
/// A fresh epoch for a call on `device` (1, 2, ...; never 0).
uint64_t next_epoch(int device);
/// Copies the record of `device` to the host after the work queued on `stream` (a 64-byte copy into pinned
/// memory, then a wait on `stream`: this is the one host synchronization of an eagerly checked call).
ErrorRecord fetch_error_record(int device, Stream stream);

/// Multiprocessor count and opt-in shared memory per block of `device` (cached).
int multiprocessor_count(int device);
int max_shared_memory_per_block(int device);

// ---- group advantages (method.md section 1) -------------------------------------------------------------------

/// out (n,) float32 from rewards (n,) (dtype kFloat32 or kFloat64, contiguous) grouped by CSR offsets
/// (num_groups + 1,) int64. Same semantics as oar::core::group_advantages (double accumulation, exact zero
/// for all-equal groups, NaN rows skipped when opts.skip_nan). One team of threads per group (a warp, or a
/// block for large groups); the "batch" estimator first reduces the batch statistics in one block into
/// `batch_scratch` (1 double; may be null for the other estimators). Reports kBadOffsets, kNanReward,
/// kInfReward, kStatsOverflow, kAdvantageOverflow; flag[0]/flag[1] as described at ErrorRecord.
/// opts.eps must be finite and >= 0 (checked by the caller).
void launch_group_advantages(core::DType dtype, const void* rewards, int64_t n, const int64_t* offsets,
                             int64_t num_groups, const core::GroupAdvantageOptions& opts, double* batch_scratch,
                             float* out, ErrorSink sink, Stream stream);

// ---- importance normalization and reshaping (method.md sections 5-6) ------------------------------------------

/// out (B, T) float32 = per-row masked min-max of log1p(scores) (oar::core::normalize_importance).
/// scores: (B, T) contiguous, dtype kFloat32/kFloat64/kFloat16/kBFloat16; mask (B, T) bool contiguous.
/// One block per row. Reports kBadScore.
void launch_normalize_importance(core::DType dtype, const void* scores, const bool* mask, int64_t B, int64_t T,
                                 float* out, ErrorSink sink, Stream stream);

/// Fused per-row reshaping (oar::core::reshape_advantages): log1p + masked min-max (skipped when
/// scores_are_normalized), the q-quantile tau of the span by a 4-pass radix select, tier weights, mass
/// preservation, token advantages. One block per row; the row stays in shared memory when it fits (else in
/// the `weights` output, used as scratch), so global memory is read once and written once.
/// advantages (B,) float32; scores as above; masks (B, T) bool contiguous; outputs (B, T) float32.
/// opts must have passed core::check_reshape_options. Reports kNonFiniteAdvantage, kNotSubset, kBadScore,
/// kScoreOutsideUnit, kBetaOverflow, kTokenAdvantageOverflow.
void launch_reshape_advantages(const float* advantages, core::DType dtype, const void* scores,
                               const bool* reasoning_mask, const bool* response_mask, int64_t B, int64_t T,
                               const core::ReshapeOptions& opts, bool scores_are_normalized, float* token_advantages,
                               float* weights, ErrorSink sink, Stream stream);

// ---- probe divergence (method.md sections 2-4) ----------------------------------------------------------------

/// Logits (N, S, V): element (n, s, v) at data[n * stride_n + s * stride_s + v] (vocabulary contiguous;
/// stride_n may be 0 to broadcast one clean row). Strides in elements.
struct LogitsDesc {
  const void* data;
  int64_t stride_n;
  int64_t stride_s;
};

/// How a probe call is cut: each row's vocabulary is split across `splits` blocks of `chunk` entries so
/// that small batches still fill the GPU; the per-block online-softmax states go to a workspace of
/// `workspace_bytes` (0 when one block per row finalizes directly). Computed by plan_probe; the caller
/// allocates the workspace and passes the plan unchanged to the launcher.
struct ProbePlan {
  int64_t splits = 1;
  int64_t chunk = 0;
  size_t workspace_bytes = 0;
};
ProbePlan plan_probe(core::DType dtype, int64_t N, int64_t S, int64_t V, core::Probe probe, bool backward,
                     int num_sms);

/// out (N,) float32, as oar::core::probe_divergence: online softmax, one pass over the vocabulary per row,
/// no materialized log-probabilities, fp32 accumulation (the final per-row combination in double).
/// dtype kFloat32/kFloat16/kBFloat16; 16-byte loads when every row start is 16-byte aligned.
/// answer_ids (N, S) int64 contiguous (kAnswerJoint only, else may be null); lengths (N,) int64 or null.
/// Reports kBadLength, kBadAnswerId, kNanDivergence (the row's output is then NaN).
void launch_probe_divergence(core::DType dtype, LogitsDesc clean, LogitsDesc perturbed, const int64_t* answer_ids,
                             const int64_t* lengths, int64_t N, int64_t S, int64_t V, core::Probe probe,
                             const ProbePlan& plan, void* workspace, float* out, ErrorSink sink, Stream stream);

/// grad_perturbed (N, S, V) contiguous of `dtype`, as oar::core::probe_divergence_backward: pass 1 reduces
/// the normalizers (split like the forward), pass 2 writes every element once (zeros at s >= the row's
/// probe positions). grad_out (N,) float32. Reports kBadLength, kBadAnswerId (the row's gradient is NaN).
void launch_probe_divergence_backward(core::DType dtype, const float* grad_out, LogitsDesc clean,
                                      LogitsDesc perturbed, const int64_t* answer_ids, const int64_t* lengths,
                                      int64_t N, int64_t S, int64_t V, core::Probe probe, const ProbePlan& plan,
                                      void* workspace, void* grad_perturbed, ErrorSink sink, Stream stream);

// ---- grad x input (method.md section 4) -----------------------------------------------------------------------

/// out[r] = |sum_h grad[r,h] * input[r,h]|, fp32 accumulation (fp64 for kFloat64), one warp per row with
/// 16-byte loads when H and the pointers allow. dtype: kFloat32, kFloat64, kFloat16 or kBFloat16.
/// grad/input: rows x H contiguous. Reports kNonFiniteResult (the output keeps the non-finite value).
void launch_grad_x_input(core::DType dtype, const void* grad, const void* input, int64_t rows, int64_t H,
                         float* out, ErrorSink sink, Stream stream);

// ---- OAR-P masked batch (method.md section 3) -----------------------------------------------------------------

/// out[m, :] = input_ids[row_index[m], :] with out[m, positions[m]] = pad_id; 16-byte copies when T is even and both
/// pointers are 16-byte aligned (8-byte copies otherwise).
/// input_ids (B, T), row_index / positions (M,), out (M, T): int64 contiguous. A variant with an out-of-range
/// row or position is filled with pad_id (never read out of bounds) and reported (kBadRowIndex/kBadPosition).
void launch_build_masked_batch(const int64_t* input_ids, int64_t B, int64_t T, const int64_t* row_index,
                               const int64_t* positions, int64_t M, int64_t pad_id, int64_t* out, ErrorSink sink,
                               Stream stream);

}  // namespace oar::cuda
