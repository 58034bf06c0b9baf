// Small helpers shared by the CUDA adapters (cuda_advantages.cpp, cuda_probe.cpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKeySet.h>

#include <utility>

#include "checks.h"
#include "oar/core/common.h"

namespace oar::torch_ops {

/// Element type of a floating tensor for the torch-free launchers (the dtype has been checked before).
inline core::DType to_core_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return core::DType::kFloat32;
    case at::kHalf: return core::DType::kFloat16;
    case at::kBFloat16: return core::DType::kBFloat16;
    case at::kDouble: return core::DType::kFloat64;
    default: break;
  }
  TORCH_INTERNAL_ASSERT(false, "oar: unexpected dtype ", c10::toString(t));
}

/// Calls the CPU kernel of op `name` (schema `Sig`) directly, skipping autograd and every other key. The CUDA
/// adapters use it only after the device reported an input error, on host copies of the inputs, so that the
/// ValueError raised is exactly the CPU's (same message, same first offending element).
template <typename Sig, typename... Args>
void rerun_on_cpu(const char* name, Args&&... args) {
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
  op.redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), std::forward<Args>(args)...);
}

/// Host copy of an optional tensor (undefined stays undefined).
inline at::Tensor cpu_copy(const at::Tensor& t) { return t.defined() ? t.cpu() : t; }

}  // namespace oar::torch_ops
