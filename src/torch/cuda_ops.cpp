// CUDA implementations of oar ops (TORCH_LIBRARY_IMPL(oar, CUDA)). Each op checks its inputs, allocates
// its outputs, and launches the torch-free kernels of src/cuda on the current stream under a device guard.
// Ops without a CUDA kernel yet raise NotImplementedError from the dispatcher (never a silent CPU copy).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks.h"
#include "oar/cuda/kernels.h"

namespace oar::torch_ops {
namespace {

core::DType to_core_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return core::DType::kFloat32;
    case at::kHalf: return core::DType::kFloat16;
    case at::kBFloat16: return core::DType::kBFloat16;
    case at::kDouble: return core::DType::kFloat64;
    default: TORCH_CHECK_VALUE(false, "unsupported dtype ", c10::toString(t));
  }
}

at::Tensor grad_x_input_cuda(const at::Tensor& grad, const at::Tensor& input) {
  check_dim(grad, "grad", 3, "(B, L, H)");
  check_shape(input, "input", grad.sizes(), "(B, L, H) like grad");
  check_float_logits(grad, "grad");
  TORCH_CHECK_VALUE(input.scalar_type() == grad.scalar_type(), "input must have the dtype of grad (",
                    c10::toString(grad.scalar_type()), "), got ", c10::toString(input.scalar_type()));
  check_same_device(grad, "grad", input, "input");
  const c10::cuda::CUDAGuard guard(grad.device());
  auto g = grad.contiguous();
  auto x = input.contiguous();
  auto out = at::empty({grad.size(0), grad.size(1)}, grad.options().dtype(at::kFloat));
  cuda::launch_grad_x_input(to_core_dtype(g.scalar_type()), g.data_ptr(), x.data_ptr(), g.size(0) * g.size(1),
                            g.size(2), out.data_ptr<float>(),
                            reinterpret_cast<cuda::Stream>(c10::cuda::getCurrentCUDAStream().stream()));
  // Same contract as the CPU kernel: never hand back NaN/Inf silently.
  check_finite_result(out, "grad_x_input",
                      "grad or input holds NaN/Inf, or |sum_h grad*input| exceeds the float32 range");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(oar, CUDA, m) { m.impl("grad_x_input", &grad_x_input_cuda); }

}  // namespace oar::torch_ops
