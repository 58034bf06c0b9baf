// CPU implementations of the probe ops (method.md sections 2-4): probe_divergence (+ backward),
// grad_x_input and build_masked_batch. Checks inputs, picks the element type, splits rows across
// at::parallel_for and calls the torch-free core (src/core/probe.cpp, grad_input.cpp, masked_batch.cpp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <Eigen/Core>

#include <algorithm>
#include <optional>
#include <string>
#include <string_view>

#include "checks.h"
#include "op_args.h"
#include "oar/core/common.h"
#include "oar/core/grad_input.h"
#include "oar/core/masked_batch.h"
#include "oar/core/probe.h"

namespace oar::torch_ops {
namespace {

// at::Half / at::BFloat16 and Eigen::half / Eigen::bfloat16 are all a single uint16_t with the IEEE
// binary16 / bfloat16 bit layout, so tensor storage can be read as the Eigen types in place.
static_assert(sizeof(at::Half) == sizeof(Eigen::half) && alignof(at::Half) == alignof(Eigen::half),
              "at::Half and Eigen::half must share a layout");
static_assert(sizeof(at::BFloat16) == sizeof(Eigen::bfloat16) &&
                  alignof(at::BFloat16) == alignof(Eigen::bfloat16),
              "at::BFloat16 and Eigen::bfloat16 must share a layout");

// Calls fn(T{}) with T the core element type matching `dtype` (float32, float16, bfloat16; float64 when
// kAllowDouble). The dtype has been checked before, so any other type is an internal error.
template <bool kAllowDouble, typename Fn>
void dispatch_float(at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat:
      fn(float{});
      return;
    case at::kHalf:
      fn(Eigen::half{});
      return;
    case at::kBFloat16:
      fn(Eigen::bfloat16{});
      return;
    case at::kDouble:
      // A compile-time switch: the double instantiation must not exist where the core has none (with
      // OpenMP the parallel region is outlined, so a runtime `false` would still reference it).
      if constexpr (kAllowDouble) {
        fn(double{});
        return;
      }
      break;
    default:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "oar: unexpected dtype ", c10::toString(dtype));
}

template <typename T>
core::LogitsView<T> view_of(const at::Tensor& t) {
  return core::LogitsView<T>{reinterpret_cast<const T*>(t.const_data_ptr()), t.stride(0), t.stride(1)};
}

// Shared shape/dtype/device checks (op_args.h), then the range checks of lengths / answer_ids, once on the
// whole batch before splitting rows, so the error names the first bad row whatever the thread schedule.
ProbeArgs prepare_probe(const at::Tensor& clean_logits, const at::Tensor& perturbed_logits,
                        const std::optional<at::Tensor>& answer_ids, const std::optional<at::Tensor>& lengths,
                        c10::string_view probe) {
  ProbeArgs a = probe_args(clean_logits, perturbed_logits, answer_ids, lengths,
                           std::string_view(probe.data(), probe.size()));
  rethrow_as_value_error([&] {
    core::check_probe_inputs(a.ids_ptr(), a.len_ptr(), a.N, a.S, a.V, a.probe);
    return 0;
  });
  return a;
}

// Rows per parallel task: a row costs about S x V element reads, so aim for >= 2^16 elements per task.
int64_t row_grain(int64_t S, int64_t V) {
  const int64_t per_row = std::max<int64_t>(1, S * V);
  return std::max<int64_t>(1, (int64_t{1} << 16) / per_row);
}

at::Tensor probe_divergence_cpu(const at::Tensor& clean_logits, const at::Tensor& perturbed_logits,
                                const std::optional<at::Tensor>& answer_ids,
                                const std::optional<at::Tensor>& lengths, c10::string_view probe) {
  const ProbeArgs a = prepare_probe(clean_logits, perturbed_logits, answer_ids, lengths, probe);
  at::Tensor out = at::empty({a.N}, perturbed_logits.options().dtype(at::kFloat));
  if (a.N == 0) return out;
  float* out_ptr = out.data_ptr<float>();
  dispatch_float</*kAllowDouble=*/false>(a.pert.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const auto cv = view_of<T>(a.clean);
    const auto pv = view_of<T>(a.pert);
    rethrow_as_value_error([&] {
      at::parallel_for(0, a.N, row_grain(a.S, a.V), [&](int64_t n0, int64_t n1) {
        core::probe_divergence<T>(cv, pv, a.ids_ptr(), a.len_ptr(), a.N, a.S, a.V, a.probe, out_ptr,
                                  core::RowRange{n0, n1});
      });
      return 0;
    });
  });
  return out;
}

at::Tensor probe_divergence_backward_cpu(const at::Tensor& grad_out, const at::Tensor& clean_logits,
                                         const at::Tensor& perturbed_logits,
                                         const std::optional<at::Tensor>& answer_ids,
                                         const std::optional<at::Tensor>& lengths, c10::string_view probe) {
  const ProbeArgs a = prepare_probe(clean_logits, perturbed_logits, answer_ids, lengths, probe);
  check_grad_out(grad_out, a, perturbed_logits);
  const at::Tensor go = grad_out.to(at::kFloat).contiguous();
  at::Tensor grad = at::empty({a.N, a.S, a.V}, perturbed_logits.options());
  if (grad.numel() == 0) return grad;
  const float* go_ptr = go.const_data_ptr<float>();
  dispatch_float</*kAllowDouble=*/false>(a.pert.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const auto cv = view_of<T>(a.clean);
    const auto pv = view_of<T>(a.pert);
    T* g = reinterpret_cast<T*>(grad.mutable_data_ptr());
    rethrow_as_value_error([&] {
      at::parallel_for(0, a.N, row_grain(a.S, a.V), [&](int64_t n0, int64_t n1) {
        core::probe_divergence_backward<T>(go_ptr, cv, pv, a.ids_ptr(), a.len_ptr(), a.N, a.S, a.V, a.probe, g,
                                           core::RowRange{n0, n1});
      });
      return 0;
    });
  });
  return grad;
}

at::Tensor grad_x_input_cpu(const at::Tensor& grad, const at::Tensor& input) {
  grad_x_input_args(grad, input);
  const int64_t B = input.size(0), L = input.size(1), H = input.size(2);
  at::Tensor out = at::empty({B, L}, input.options().dtype(at::kFloat));
  const int64_t rows = B * L;
  if (rows == 0) return out;
  const at::Tensor g = grad.contiguous();
  const at::Tensor x = input.contiguous();
  float* out_ptr = out.data_ptr<float>();
  dispatch_float</*kAllowDouble=*/true>(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* gp = reinterpret_cast<const T*>(g.const_data_ptr());
    const T* xp = reinterpret_cast<const T*>(x.const_data_ptr());
    rethrow_as_value_error([&] {
      const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, H));
      at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
        core::grad_x_input<T>(gp + r0 * H, xp + r0 * H, r1 - r0, H, out_ptr + r0);
      });
      return 0;
    });
  });
  // NaN/Inf in grad or input, or a sum beyond float32 range, would otherwise reach the scores silently.
  check_finite_result(out, "grad_x_input",
                      "grad and input must be finite and |sum_h grad * input| must fit in float32");
  return out;
}

at::Tensor build_masked_batch_cpu(const at::Tensor& input_ids, const at::Tensor& row_index,
                                  const at::Tensor& positions, int64_t pad_id) {
  masked_batch_args(input_ids, row_index, positions);
  const int64_t B = input_ids.size(0), T_len = input_ids.size(1), M = row_index.size(0);
  const at::Tensor ids = input_ids.contiguous();
  const at::Tensor rows = row_index.contiguous();
  const at::Tensor pos = positions.contiguous();
  at::Tensor out = at::empty({M, T_len}, input_ids.options());
  rethrow_as_value_error([&] {
    core::build_masked_batch(ids.const_data_ptr<int64_t>(), B, T_len, rows.const_data_ptr<int64_t>(),
                             pos.const_data_ptr<int64_t>(), M, pad_id, out.data_ptr<int64_t>());
    return 0;
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(oar, CPU, m) {
  m.impl("probe_divergence", &probe_divergence_cpu);
  m.impl("probe_divergence_backward", &probe_divergence_backward_cpu);
  m.impl("grad_x_input", &grad_x_input_cpu);
  m.impl("build_masked_batch", &build_masked_batch_cpu);
}

}  // namespace oar::torch_ops
