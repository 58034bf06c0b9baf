// Argument checks of each oar op that do not read tensor data (shapes, dtypes, devices, option strings), shared
// by the CPU adapters (cpu_*.cpp) and the CUDA adapters (cuda_*.cpp) so that both raise the same ValueError
// messages in the same order. Data-dependent checks (NaN rewards, malformed offsets, out-of-range ids) belong
// to each device: the CPU core throws them, the CUDA kernels report them (docs/design.md).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string_view>

#include "checks.h"
#include "oar/core/common.h"
#include "oar/core/group_advantages.h"
#include "oar/core/reshape.h"

namespace oar::torch_ops {

/// float64 stays float64 (the core accumulates in double anyway); every other real type, bool and integers
/// included, is read as float32 so that statistics never run in half precision or integer arithmetic.
/// Returns a contiguous tensor on the same device.
at::Tensor promote_real(const at::Tensor& t);

/// dtype in {float32, float64, float16, bfloat16}, naming `name`.
void check_floating(const at::Tensor& t, const char* name);

/// group_advantages (method.md section 1): rewards (N,) real, offsets (G + 1,) int64 on the same device
/// (`offsets_on_cpu`: the CPU kernel also requires offsets on the CPU), and the parsed options (eps is copied
/// as given: its range is checked with the data, by the core on the CPU). Raises ValueError.
core::GroupAdvantageOptions group_advantage_args(const at::Tensor& rewards, const at::Tensor& offsets,
                                                 std::string_view estimator, std::string_view std_kind, double eps,
                                                 std::string_view singleton, bool skip_nan, bool offsets_on_cpu);

/// scores (B, T) floating and a mask of the same shape on the same device; returns the mask as a contiguous
/// bool tensor (0/1 integer masks are converted). scores itself is not converted. Raises ValueError.
at::Tensor scores_mask_args(const at::Tensor& scores, const at::Tensor& mask, const char* mask_name);

/// reshape_advantages masks and advantages: (reasoning_mask, response_mask) as contiguous bool (B, T), after
/// checking advantages (B,) floating on the scores' device. Raises ValueError.
std::pair<at::Tensor, at::Tensor> reshape_mask_args(const at::Tensor& advantages, const at::Tensor& scores,
                                                    const at::Tensor& reasoning_mask,
                                                    const at::Tensor& response_mask);

/// Parsed and range-checked reshaping options (q, beta, floor, tiers). Raises ValueError.
core::ReshapeOptions reshape_options(double q, double beta, double floor, std::string_view tiers);

/// Validated probe inputs (method.md section 2), without reading lengths / answer_ids (data checks are
/// per device). clean / pert have a contiguous vocabulary dimension (copied only if it is not).
struct ProbeArgs {
  at::Tensor clean, pert;
  at::Tensor answer_ids;  // (N, S) int64 contiguous, or undefined
  at::Tensor lengths;     // (N,) int64 contiguous, or undefined
  int64_t N = 0, S = 0, V = 0;
  core::Probe probe = core::Probe::kAnswerMean;

  const int64_t* ids_ptr() const { return answer_ids.defined() ? answer_ids.const_data_ptr<int64_t>() : nullptr; }
  const int64_t* len_ptr() const { return lengths.defined() ? lengths.const_data_ptr<int64_t>() : nullptr; }
};
ProbeArgs probe_args(const at::Tensor& clean_logits, const at::Tensor& perturbed_logits,
                     const std::optional<at::Tensor>& answer_ids, const std::optional<at::Tensor>& lengths,
                     std::string_view probe);

/// probe_divergence_backward's grad_out: (N,) floating on the logits' device.
void check_grad_out(const at::Tensor& grad_out, const ProbeArgs& a, const at::Tensor& perturbed_logits);

/// grad_x_input: input (B, L, H) float32/float64/float16/bfloat16, grad of the same shape, dtype, device.
void grad_x_input_args(const at::Tensor& grad, const at::Tensor& input);

/// build_masked_batch: input_ids (B, T) int64, row_index (M,) int64, positions like row_index, one device.
void masked_batch_args(const at::Tensor& input_ids, const at::Tensor& row_index, const at::Tensor& positions);

}  // namespace oar::torch_ops
