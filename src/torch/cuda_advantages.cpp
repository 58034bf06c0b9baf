// CUDA implementations of the advantage ops (schemas in schemas.cpp; method.md sections 1, 5, 6):
//   oar::group_advantages, oar::normalize_importance, oar::reshape_advantages.
// Same argument checks as cpu_advantages.cpp (op_args.h), then the torch-free kernels of src/cuda on the
// current stream under a device guard. These are step-level ops: each reads its device error record back
// before returning (one 64-byte copy and one wait; cuda_checks.h) and raises the CPU's exact ValueError on bad
// data. The Autograd fallthrough registered in cpu_advantages.cpp covers these kernels too.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <string_view>
#include <tuple>

#include "checks.h"
#include "cuda_checks.h"
#include "cuda_common.h"
#include "oar/core/common.h"
#include "oar/cuda/kernels.h"
#include "op_args.h"

namespace oar::torch_ops {
namespace {

using cuda_checks::When;

at::Tensor group_advantages_cuda(const at::Tensor& rewards, const at::Tensor& offsets, std::string_view estimator,
                                 std::string_view std_kind, double eps, std::string_view singleton, bool skip_nan) {
  const core::GroupAdvantageOptions opts =
      group_advantage_args(rewards, offsets, estimator, std_kind, eps, singleton, skip_nan, /*offsets_on_cpu=*/false);
  const c10::cuda::CUDAGuard guard(rewards.device());
  const auto exact = [&] {
    rerun_on_cpu<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, c10::string_view, double,
                            c10::string_view, bool)>("oar::group_advantages", rewards.cpu(), offsets.cpu(), estimator,
                                                     std_kind, eps, singleton, skip_nan);
  };
  if (!(std::isfinite(eps) && eps >= 0.0)) {
    // The CPU core checks eps after the offsets: let it pick the message.
    exact();
    TORCH_CHECK_VALUE(false, "eps must be finite and >= 0, got ", eps);
  }
  const at::Tensor r = promote_real(rewards);
  const at::Tensor off = offsets.contiguous();
  const int64_t n = r.numel();
  const int64_t num_groups = off.numel() - 1;
  at::Tensor out = at::empty({n}, rewards.options().dtype(at::kFloat));
  at::Tensor batch_div;
  if (opts.estimator == core::Estimator::kBatch) batch_div = at::empty({1}, rewards.options().dtype(at::kDouble));

  const auto call = cuda_checks::begin(rewards.device(), cuda::OpId::kGroupAdvantages);
  rethrow_as_value_error([&] {
    cuda::launch_group_advantages(to_core_dtype(r.scalar_type()), r.const_data_ptr(), n,
                                  off.const_data_ptr<int64_t>(), num_groups, opts,
                                  batch_div.defined() ? batch_div.mutable_data_ptr<double>() : nullptr,
                                  out.mutable_data_ptr<float>(), call.sink, call.stream);
    return 0;
  });
  const auto verdict = cuda_checks::verify(call, When::kAlways);
  if (verdict.failed) cuda_checks::raise(call, verdict.record, exact);
  // Same condition as the CPU kernel's warning: a group of one valid reward was seen, none of two or more.
  if (opts.singleton != core::SingletonPolicy::kVerl && verdict.record.flag[0] == call.sink.epoch &&
      verdict.record.flag[1] != call.sink.epoch) {
    TORCH_WARN_ONCE("oar.group_advantages: every group has a single response, so each reward is its own baseline "
                    "and every advantage is 0. Sample several responses per prompt, check offsets/group_ids, or use "
                    "singleton=\"verl\".");
  }
  return out;
}

at::Tensor normalize_importance_cuda(const at::Tensor& scores, const at::Tensor& mask) {
  const at::Tensor m = scores_mask_args(scores, mask, "mask");
  const c10::cuda::CUDAGuard guard(scores.device());
  const int64_t B = scores.size(0), T = scores.size(1);
  at::Tensor out = at::empty({B, T}, scores.options().dtype(at::kFloat));
  if (B == 0 || T == 0) return out;
  const at::Tensor s = scores.contiguous();
  const auto call = cuda_checks::begin(scores.device(), cuda::OpId::kNormalizeImportance);
  rethrow_as_value_error([&] {
    cuda::launch_normalize_importance(to_core_dtype(s.scalar_type()), s.const_data_ptr(), m.const_data_ptr<bool>(),
                                      B, T, out.mutable_data_ptr<float>(), call.sink, call.stream);
    return 0;
  });
  const auto verdict = cuda_checks::verify(call, When::kAlways);
  if (verdict.failed) {
    cuda_checks::raise(call, verdict.record, [&] {
      rerun_on_cpu<at::Tensor(const at::Tensor&, const at::Tensor&)>("oar::normalize_importance", scores.cpu(),
                                                                     mask.cpu());
    });
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> reshape_advantages_cuda(const at::Tensor& advantages, const at::Tensor& scores,
                                                           const at::Tensor& reasoning_mask,
                                                           const at::Tensor& response_mask, double q, double beta,
                                                           double floor, std::string_view tiers,
                                                           bool scores_are_normalized) {
  const auto [rm, pm] = reshape_mask_args(advantages, scores, reasoning_mask, response_mask);
  const core::ReshapeOptions opts = reshape_options(q, beta, floor, tiers);
  const c10::cuda::CUDAGuard guard(scores.device());
  const int64_t B = scores.size(0), T = scores.size(1);
  at::Tensor token_adv = at::empty({B, T}, scores.options().dtype(at::kFloat));
  at::Tensor weights = at::empty({B, T}, scores.options().dtype(at::kFloat));
  if (B == 0) return {token_adv, weights};
  const at::Tensor s = scores.contiguous();
  // float64 advantages beyond float32 range become inf here; the kernel reports them and the CPU re-run
  // names the float64 value.
  const at::Tensor a = advantages.to(at::kFloat).contiguous();
  const auto call = cuda_checks::begin(scores.device(), cuda::OpId::kReshapeAdvantages);
  rethrow_as_value_error([&] {
    cuda::launch_reshape_advantages(a.const_data_ptr<float>(), to_core_dtype(s.scalar_type()), s.const_data_ptr(),
                                    rm.const_data_ptr<bool>(), pm.const_data_ptr<bool>(), B, T, opts,
                                    scores_are_normalized, token_adv.mutable_data_ptr<float>(),
                                    weights.mutable_data_ptr<float>(), call.sink, call.stream);
    return 0;
  });
  const auto verdict = cuda_checks::verify(call, When::kAlways);
  if (verdict.failed) {
    cuda_checks::raise(call, verdict.record, [&] {
      rerun_on_cpu<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&, double, double, double, c10::string_view,
                                                      bool)>(
          "oar::reshape_advantages", advantages.cpu(), scores.cpu(), reasoning_mask.cpu(), response_mask.cpu(), q,
          beta, floor, tiers, scores_are_normalized);
    });
  }
  return {token_adv, weights};
}

}  // namespace

TORCH_LIBRARY_IMPL(oar, CUDA, m) {
  m.impl("group_advantages", &group_advantages_cuda);
  m.impl("normalize_importance", &normalize_importance_cuda);
  m.impl("reshape_advantages", &reshape_advantages_cuda);
}

}  // namespace oar::torch_ops
