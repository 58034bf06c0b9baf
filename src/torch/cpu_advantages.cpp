// CPU implementations of the advantage ops (schemas in schemas.cpp; method.md sections 1, 5, 6):
//   oar::group_advantages, oar::normalize_importance, oar::reshape_advantages.
//
// This file is the adapter boundary: it validates tensors (shape, dtype, device, CSR offsets, masks) with
// messages that name the argument, parses mode strings into core enums once, promotes dtypes, makes the
// inputs contiguous and calls the torch-free core (src/core), whose InvalidArgument becomes a ValueError.
//
// No autograd, by design: advantages and reshaping weights are constants of the policy-gradient loss (the
// scores are detached, trainers.md "The contract"), so there is no derivative to define. There is no
// CompositeExplicitAutograd kernel either (the ops are not composites of other ops). Instead the Autograd
// key gets a fallthrough (bottom of this file): the dispatcher skips autograd, the outputs are plain
// constants (requires_grad=False) even when an input requires grad, and the autograd "not implemented"
// fallback (which warns and may silently produce wrong gradients on backward) never runs. The fallthrough is
// device-independent, so it also covers CUDA kernels registered elsewhere. Fake (meta) kernels for
// torch.compile live in python/oar/ops.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <string_view>
#include <tuple>

#include "checks.h"
#include "op_args.h"
#include "oar/core/common.h"
#include "oar/core/group_advantages.h"
#include "oar/core/importance.h"
#include "oar/core/reshape.h"

namespace oar::torch_ops {
namespace {

at::Tensor group_advantages_cpu(const at::Tensor& rewards, const at::Tensor& offsets, std::string_view estimator,
                                std::string_view std_kind, double eps, std::string_view singleton,
                                bool skip_nan) {
  const core::GroupAdvantageOptions opts =
      group_advantage_args(rewards, offsets, estimator, std_kind, eps, singleton, skip_nan, /*offsets_on_cpu=*/true);

  const at::Tensor r = promote_real(rewards);
  const at::Tensor off = offsets.contiguous();
  const int64_t n = r.numel();
  const int64_t num_groups = off.numel() - 1;
  at::Tensor out = at::empty({n}, rewards.options().dtype(at::kFloat));

  const core::GroupAdvantageStats st = rethrow_as_value_error([&] {
    if (r.scalar_type() == at::kDouble)
      return core::group_advantages(r.const_data_ptr<double>(), n, off.const_data_ptr<int64_t>(), num_groups, opts,
                                    out.mutable_data_ptr<float>());
    return core::group_advantages(r.const_data_ptr<float>(), n, off.const_data_ptr<int64_t>(), num_groups, opts,
                                  out.mutable_data_ptr<float>());
  });
  // Every non-empty group has one response: the group baseline is the reward itself, so every advantage
  // is 0 and nothing is learned. verl's policy gives such groups r / (1 + eps) on purpose, hence no warning.
  if (opts.singleton != core::SingletonPolicy::kVerl && st.singleton_groups > 0 &&
      st.singleton_groups + st.empty_groups == st.num_groups) {
    TORCH_WARN_ONCE("oar.group_advantages: every group has a single response (", st.singleton_groups,
                    " groups), so each reward is its own baseline and every advantage is 0. Sample several "
                    "responses per prompt, check offsets/group_ids, or use singleton=\"verl\".");
  }
  return out;
}

// Validates scores (B, T) and a mask of the same shape; returns (scores promoted + contiguous, bool mask).
std::tuple<at::Tensor, at::Tensor> scores_and_mask(const at::Tensor& scores, const at::Tensor& mask,
                                                   const char* mask_name) {
  at::Tensor m = scores_mask_args(scores, mask, mask_name);
  return {promote_real(scores), m};
}

at::Tensor normalize_importance_cpu(const at::Tensor& scores, const at::Tensor& mask) {
  auto [s, m] = scores_and_mask(scores, mask, "mask");
  const int64_t B = s.size(0), T = s.size(1);
  at::Tensor out = at::empty({B, T}, scores.options().dtype(at::kFloat));
  rethrow_as_value_error([&] {
    if (s.scalar_type() == at::kDouble)
      core::normalize_importance(s.const_data_ptr<double>(), m.const_data_ptr<bool>(), B, T,
                                 out.mutable_data_ptr<float>());
    else
      core::normalize_importance(s.const_data_ptr<float>(), m.const_data_ptr<bool>(), B, T,
                                 out.mutable_data_ptr<float>());
    return 0;
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> reshape_advantages_cpu(const at::Tensor& advantages, const at::Tensor& scores,
                                                          const at::Tensor& reasoning_mask,
                                                          const at::Tensor& response_mask, double q, double beta,
                                                          double floor, std::string_view tiers,
                                                          bool scores_are_normalized) {
  auto [rm, pm] = reshape_mask_args(advantages, scores, reasoning_mask, response_mask);
  const at::Tensor s = promote_real(scores);
  const int64_t B = s.size(0), T = s.size(1);
  if (advantages.scalar_type() == at::kDouble) {
    // Read as float32 below: a finite float64 beyond float32 range would turn into inf and be reported as such.
    const at::Tensor over = advantages.abs() > static_cast<double>(std::numeric_limits<float>::max());
    if (over.any().item<bool>()) {
      const int64_t i = over.nonzero().select(0, 0).item<int64_t>();
      TORCH_CHECK_VALUE(false, "advantages must fit in float32 (|A| <= ", std::numeric_limits<float>::max(),
                        "), got advantages[", i, "] = ", advantages[i].item<double>());
    }
  }
  const at::Tensor a = advantages.to(at::kFloat).contiguous();

  const core::ReshapeOptions opts = reshape_options(q, beta, floor, tiers);

  at::Tensor token_adv = at::empty({B, T}, scores.options().dtype(at::kFloat));
  at::Tensor weights = at::empty({B, T}, scores.options().dtype(at::kFloat));
  // Rows in parallel. With several bad rows, threads may fail in any order: the error path reruns the call
  // on one thread so that the error reported is always the first bad row's (as in the serial core).
  const auto run = [&](core::RowRange rows) {
    if (s.scalar_type() == at::kDouble)
      core::reshape_advantages(a.const_data_ptr<float>(), s.const_data_ptr<double>(), rm.const_data_ptr<bool>(),
                               pm.const_data_ptr<bool>(), B, T, opts, scores_are_normalized,
                               token_adv.mutable_data_ptr<float>(), weights.mutable_data_ptr<float>(), rows);
    else
      core::reshape_advantages(a.const_data_ptr<float>(), s.const_data_ptr<float>(), rm.const_data_ptr<bool>(),
                               pm.const_data_ptr<bool>(), B, T, opts, scores_are_normalized,
                               token_adv.mutable_data_ptr<float>(), weights.mutable_data_ptr<float>(), rows);
  };
  rethrow_as_value_error([&] {
    try {
      const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(T, 1));
      at::parallel_for(0, B, grain, [&](int64_t b0, int64_t b1) { run(core::RowRange{b0, b1}); });
    } catch (const std::exception&) {
      run(core::RowRange{0, B});  // throws the first bad row's error
      throw;                      // (not reached when the serial run fails, as it must)
    }
    return 0;
  });
  return {token_adv, weights};
}

}  // namespace

TORCH_LIBRARY_IMPL(oar, CPU, m) {
  m.impl("group_advantages", &group_advantages_cpu);
  m.impl("normalize_importance", &normalize_importance_cpu);
  m.impl("reshape_advantages", &reshape_advantages_cpu);
}

// Non-differentiable ops: skip the Autograd key (see the header comment), as PyTorch recommends for ops
// whose outputs are constants.
TORCH_LIBRARY_IMPL(oar, Autograd, m) {
  m.impl("group_advantages", torch::CppFunction::makeFallthrough());
  m.impl("normalize_importance", torch::CppFunction::makeFallthrough());
  m.impl("reshape_advantages", torch::CppFunction::makeFallthrough());
}

}  // namespace oar::torch_ops
