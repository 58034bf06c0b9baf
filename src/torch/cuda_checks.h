// When and how the CUDA adapters read back the data errors that the kernels report on the device
// (docs/design.md, "CUDA input validation"). Summary:
//   - Shape / dtype / device / option checks run on the host before any launch (op_args.h), as on the CPU.
//   - Data checks (NaN rewards, malformed offsets, negative scores, out-of-range ids...) are fused into the
//     compute kernels, which never read or write out of bounds because of bad data and record the error in
//     the device's ErrorRecord (include/oar/cuda/kernels.h). No extra kernel, no memset.
//   - Step-level ops (group_advantages, normalize_importance, reshape_advantages: once per optimizer step, small
//     tensors, outputs that go straight into the loss) always read the record before returning: one 64-byte
//     copy and one wait on the current stream. group_advantages also needs it for its single-response warning.
//   - Hot-path ops (probe_divergence + backward, grad_x_input, build_masked_batch: called per chunk inside the
//     attribution loops) read it only in "eager" mode. In the default "lazy" mode they never wait: a bad row
//     gets NaN (or an all-PAD variant) and the error is raised by the next check on that device (any
//     step-level op, or oar.ops.check_cuda_errors()).
//   - After a failure is read back, the op raises exactly the CPU's ValueError: it re-runs the CPU check on
//     host copies of the (small) offending inputs; the generic record text is the fallback.
// Mode: environment variable OAR_CUDA_CHECKS=lazy|eager (read at the first call), or oar.ops.set_cuda_checks()
// (python/oar/cuda_checks.py, through the ops oar::_set_cuda_checks / _get_cuda_checks / _take_cuda_error).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <string>

#include "oar/cuda/kernels.h"

namespace oar::torch_ops::cuda_checks {

enum class Mode : int { kLazy = 0, kEager = 1 };

/// The process-wide mode (first call: from OAR_CUDA_CHECKS, default lazy; raises ValueError on another value).
Mode mode();
void set_mode(Mode m);

/// Whether an op reads its record back: always (step-level ops) or only in eager mode (hot-path ops).
enum class When { kAlways, kIfEager };

/// One op call on one device: the epoch its kernels report under and the stream they run on.
struct Call {
  int device = 0;
  cuda::OpId op = cuda::OpId::kNone;
  cuda::ErrorSink sink{};
  cuda::Stream stream = nullptr;
};

/// Starts a call on `device` (the caller holds a CUDAGuard for it); the stream is the current one.
Call begin(const at::Device& device, cuda::OpId op);

/// Result of verify: whether the record was read, whether this call failed, and the record read.
struct Verdict {
  bool checked = false;
  bool failed = false;
  cuda::ErrorRecord record{};
};

/// Reads the record back when `when` and the mode ask for it. If an earlier (lazily checked) call recorded an
/// error that nobody raised yet, raises it here as a ValueError naming the op that failed.
Verdict verify(const Call& call, When when);

/// This call failed: runs `exact` (which raises the CPU's ValueError for the same inputs), then, if it did not
/// raise, raises a ValueError built from the record.
[[noreturn]] void raise(const Call& call, const cuda::ErrorRecord& rec, const std::function<void()>& exact);

/// "probe_divergence (CUDA): lengths[n] must be in [1, S] (first recorded at index 3, value 0)".
std::string describe(const cuda::ErrorRecord& rec);

/// The error recorded on `device` and not raised yet, after the work queued on the device's current stream;
/// empty when there is none. Marks it raised.
std::string take_pending(int device);

}  // namespace oar::torch_ops::cuda_checks
