// Input checks shared by every oar op adapter. Messages name the argument, the expected and the actual
// shape/dtype/device ("scores must be (B, T) = (8, 512), got (8, 511)"). User errors raise
// c10::ValueError (Python ValueError); internal invariants use TORCH_INTERNAL_ASSERT.
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>
#include <string>
#include <vector>

#include "oar/core/common.h"

namespace oar::torch_ops {

/// Human-readable "(8, 512)" for a size list.
std::string shape_str(at::IntArrayRef sizes);

/// t is a defined tensor (a Python None passed for a Tensor argument arrives as an undefined tensor).
/// Every check below calls it first for the tensors it inspects.
void check_defined(const at::Tensor& t, const char* name);
/// t.dim() == dim. `what` describes the dims, e.g. "(B, T)".
void check_dim(const at::Tensor& t, const char* name, int64_t dim, const char* what);
/// t.sizes() == expected exactly; `what` names the dims, e.g. "(B, T)".
void check_shape(const at::Tensor& t, const char* name, at::IntArrayRef expected, const char* what);
/// t.scalar_type() is one of `allowed`.
void check_dtype(const at::Tensor& t, const char* name, std::initializer_list<at::ScalarType> allowed);
/// Every tensor is on the same device as `ref` (named ref_name).
void check_same_device(const at::Tensor& ref, const char* ref_name, const at::Tensor& t, const char* name);
/// Floating dtypes the probe/grad kernels read: float32, float16, bfloat16.
void check_float_logits(const at::Tensor& t, const char* name);
/// Every element of a float result is finite; otherwise raises naming `op`, the first offending index and
/// value, and `hint` (which inputs to check). For outputs whose non-finiteness can only come from bad input.
void check_finite_result(const at::Tensor& out, const char* op, const char* hint);
/// Masks are bool (B, T); integer 0/1 masks are accepted and converted (returns the bool mask).
at::Tensor as_bool_mask(const at::Tensor& t, const char* name, at::IntArrayRef expected, const char* what);
/// Converts oar::core::InvalidArgument thrown by `fn` into a c10::ValueError with the same message.
template <typename Fn>
auto rethrow_as_value_error(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const oar::core::InvalidArgument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

}  // namespace oar::torch_ops
