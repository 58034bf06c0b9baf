// CUDA implementations of the probe ops (method.md sections 2-4): probe_divergence (+ backward), grad_x_input
// and build_masked_batch. Same argument checks as cpu_probe.cpp (op_args.h), then the torch-free kernels of
// src/cuda on the current stream under a device guard. These run per chunk inside the attribution loops, so
// by default they never wait for the device: the kernels record bad data (out-of-range lengths / ids / rows,
// NaN divergences, non-finite products) on the device, give the affected rows NaN (or all-PAD variants), and
// the error is raised by the next check on that device (cuda_checks.h). With OAR_CUDA_CHECKS=eager (or
// oar.ops.set_cuda_checks("eager")) each call checks before returning and raises the CPU's exact message.
// probe_divergence's autograd formula is registered from Python (ops.py) and calls the backward op below.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>
#include <string_view>

#include "checks.h"
#include "cuda_checks.h"
#include "cuda_common.h"
#include "oar/core/common.h"
#include "oar/core/probe.h"
#include "oar/cuda/kernels.h"
#include "op_args.h"

namespace oar::torch_ops {
namespace {

using cuda_checks::When;

cuda::LogitsDesc desc(const at::Tensor& t) { return cuda::LogitsDesc{t.const_data_ptr(), t.stride(0), t.stride(1)}; }

// Workspace of a probe plan (the caching allocator: no synchronization, no launch), or an undefined tensor.
at::Tensor workspace(const cuda::ProbePlan& plan, const at::Tensor& like) {
  if (plan.workspace_bytes == 0) return {};
  return at::empty({static_cast<int64_t>(plan.workspace_bytes)}, like.options().dtype(at::kByte));
}

// The CPU's message for a failed probe call: range errors of lengths / answer_ids first (host copies of these
// small tensors through the CPU's own check), then the first NaN row of `out` (forward only).
void probe_exact(const ProbeArgs& a, const cuda::ErrorRecord& rec, const at::Tensor& out) {
  const at::Tensor ids = cpu_copy(a.answer_ids);
  const at::Tensor len = cpu_copy(a.lengths);
  rethrow_as_value_error([&] {
    core::check_probe_inputs(ids.defined() ? ids.const_data_ptr<int64_t>() : nullptr,
                             len.defined() ? len.const_data_ptr<int64_t>() : nullptr, a.N, a.S, a.V, a.probe);
    return 0;
  });
  if (out.defined() && cuda::error_code(rec.error) == cuda::ErrorCode::kNanDivergence) {
    const at::Tensor bad = at::isnan(out).nonzero();
    if (bad.numel() > 0) {
      TORCH_CHECK_VALUE(false, "probe_divergence: row ", bad[0][0].item<int64_t>(), " gives a NaN ",
                        a.probe == core::Probe::kAnswerJoint ? "answer log-likelihood drop" : "KL divergence",
                        "; clean_logits / perturbed_logits must be finite (-inf allowed) with at least one finite "
                        "logit per probed position");
    }
  }
}

at::Tensor probe_divergence_cuda(const at::Tensor& clean_logits, const at::Tensor& perturbed_logits,
                                 const std::optional<at::Tensor>& answer_ids,
                                 const std::optional<at::Tensor>& lengths, c10::string_view probe) {
  const ProbeArgs a = probe_args(clean_logits, perturbed_logits, answer_ids, lengths,
                                 std::string_view(probe.data(), probe.size()));
  const c10::cuda::CUDAGuard guard(perturbed_logits.device());
  at::Tensor out = at::empty({a.N}, perturbed_logits.options().dtype(at::kFloat));
  if (a.N == 0) return out;
  const core::DType dtype = to_core_dtype(a.pert.scalar_type());
  const auto call = cuda_checks::begin(perturbed_logits.device(), cuda::OpId::kProbeDivergence);
  const cuda::ProbePlan plan =
      cuda::plan_probe(dtype, a.N, a.S, a.V, a.probe, /*backward=*/false, cuda::multiprocessor_count(call.device));
  at::Tensor ws = workspace(plan, a.pert);
  rethrow_as_value_error([&] {
    cuda::launch_probe_divergence(dtype, desc(a.clean), desc(a.pert), a.ids_ptr(), a.len_ptr(), a.N, a.S, a.V,
                                  a.probe, plan, ws.defined() ? ws.mutable_data_ptr() : nullptr,
                                  out.mutable_data_ptr<float>(), call.sink, call.stream);
    return 0;
  });
  const auto verdict = cuda_checks::verify(call, When::kIfEager);
  if (verdict.failed) cuda_checks::raise(call, verdict.record, [&] { probe_exact(a, verdict.record, out); });
  return out;
}

at::Tensor probe_divergence_backward_cuda(const at::Tensor& grad_out, const at::Tensor& clean_logits,
                                          const at::Tensor& perturbed_logits,
                                          const std::optional<at::Tensor>& answer_ids,
                                          const std::optional<at::Tensor>& lengths, c10::string_view probe) {
  const ProbeArgs a = probe_args(clean_logits, perturbed_logits, answer_ids, lengths,
                                 std::string_view(probe.data(), probe.size()));
  check_grad_out(grad_out, a, perturbed_logits);
  const c10::cuda::CUDAGuard guard(perturbed_logits.device());
  at::Tensor grad = at::empty({a.N, a.S, a.V}, perturbed_logits.options());
  if (grad.numel() == 0) return grad;
  const at::Tensor go = grad_out.to(at::kFloat).contiguous();
  const core::DType dtype = to_core_dtype(a.pert.scalar_type());
  const auto call = cuda_checks::begin(perturbed_logits.device(), cuda::OpId::kProbeDivergenceBackward);
  const cuda::ProbePlan plan =
      cuda::plan_probe(dtype, a.N, a.S, a.V, a.probe, /*backward=*/true, cuda::multiprocessor_count(call.device));
  at::Tensor ws = workspace(plan, a.pert);
  rethrow_as_value_error([&] {
    cuda::launch_probe_divergence_backward(dtype, go.const_data_ptr<float>(), desc(a.clean), desc(a.pert),
                                           a.ids_ptr(), a.len_ptr(), a.N, a.S, a.V, a.probe, plan,
                                           ws.defined() ? ws.mutable_data_ptr() : nullptr, grad.mutable_data_ptr(),
                                           call.sink, call.stream);
    return 0;
  });
  const auto verdict = cuda_checks::verify(call, When::kIfEager);
  if (verdict.failed) cuda_checks::raise(call, verdict.record, [&] { probe_exact(a, verdict.record, at::Tensor()); });
  return grad;
}

at::Tensor grad_x_input_cuda(const at::Tensor& grad, const at::Tensor& input) {
  grad_x_input_args(grad, input);
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t B = input.size(0), L = input.size(1), H = input.size(2);
  at::Tensor out = at::empty({B, L}, input.options().dtype(at::kFloat));
  if (B * L == 0) return out;
  const at::Tensor g = grad.contiguous();
  const at::Tensor x = input.contiguous();
  const auto call = cuda_checks::begin(input.device(), cuda::OpId::kGradXInput);
  rethrow_as_value_error([&] {
    cuda::launch_grad_x_input(to_core_dtype(x.scalar_type()), g.const_data_ptr(), x.const_data_ptr(), B * L, H,
                              out.mutable_data_ptr<float>(), call.sink, call.stream);
    return 0;
  });
  const auto verdict = cuda_checks::verify(call, When::kIfEager);
  if (verdict.failed) {
    cuda_checks::raise(call, verdict.record, [&] {
      // Same contract and message as the CPU kernel: never hand back NaN/Inf silently.
      check_finite_result(out, "grad_x_input",
                          "grad and input must be finite and |sum_h grad * input| must fit in float32");
    });
  }
  return out;
}

at::Tensor build_masked_batch_cuda(const at::Tensor& input_ids, const at::Tensor& row_index,
                                   const at::Tensor& positions, int64_t pad_id) {
  masked_batch_args(input_ids, row_index, positions);
  const c10::cuda::CUDAGuard guard(input_ids.device());
  const int64_t B = input_ids.size(0), T = input_ids.size(1), M = row_index.size(0);
  at::Tensor out = at::empty({M, T}, input_ids.options());
  if (M == 0) return out;
  const at::Tensor ids = input_ids.contiguous();
  const at::Tensor rows = row_index.contiguous();
  const at::Tensor pos = positions.contiguous();
  const auto call = cuda_checks::begin(input_ids.device(), cuda::OpId::kBuildMaskedBatch);
  rethrow_as_value_error([&] {
    cuda::launch_build_masked_batch(ids.const_data_ptr<int64_t>(), B, T, rows.const_data_ptr<int64_t>(),
                                    pos.const_data_ptr<int64_t>(), M, pad_id, out.mutable_data_ptr<int64_t>(),
                                    call.sink, call.stream);
    return 0;
  });
  const auto verdict = cuda_checks::verify(call, When::kIfEager);
  if (verdict.failed) {
    cuda_checks::raise(call, verdict.record, [&] {
      rerun_on_cpu<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>(
          "oar::build_masked_batch", input_ids.cpu(), row_index.cpu(), positions.cpu(), pad_id);
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(oar, CUDA, m) {
  m.impl("probe_divergence", &probe_divergence_cuda);
  m.impl("probe_divergence_backward", &probe_divergence_backward_cuda);
  m.impl("grad_x_input", &grad_x_input_cuda);
  m.impl("build_masked_batch", &build_masked_batch_cuda);
}

}  // namespace oar::torch_ops
