// Read-back policy of the CUDA data checks (cuda_checks.h, docs/design.md "CUDA input validation") and the
// three ops that reach it from Python (oar.cuda_checks: set_cuda_checks / cuda_checks / check_cuda_errors).
// They are ops rather than pybind11 functions because the state lives in this library, which oar._C does not
// link (docs/design.md, "The CUDA check switch is reached through torch.ops").
#include "cuda_checks.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <sstream>
#include <string_view>

namespace oar::torch_ops::cuda_checks {
namespace {

constexpr int kMaxDevices = 256;

// -1: not read from the environment yet.
std::atomic<int> g_mode{-1};

// Per device: the largest epoch whose error was already raised (so that each recorded error is raised once).
std::array<std::atomic<uint64_t>, kMaxDevices>& consumed() {
  static std::array<std::atomic<uint64_t>, kMaxDevices> c{};
  return c;
}

void mark_consumed(int device, uint64_t epoch) {
  auto& slot = consumed()[device];
  uint64_t cur = slot.load();
  while (cur < epoch && !slot.compare_exchange_weak(cur, epoch)) {
  }
}

bool unconsumed(int device, const cuda::ErrorRecord& rec) {
  return rec.error != 0 && cuda::error_epoch(rec.error) > consumed()[device].load();
}

int check_device(int device) {
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "oar: CUDA device index ", device, " out of range");
  return device;
}

}  // namespace

Mode mode() {
  int m = g_mode.load(std::memory_order_relaxed);
  if (m >= 0) return static_cast<Mode>(m);
  const char* env = std::getenv("OAR_CUDA_CHECKS");
  const std::string_view v = env != nullptr ? std::string_view(env) : std::string_view("lazy");
  if (v == "lazy" || v.empty()) m = 0;
  else if (v == "eager") m = 1;
  else TORCH_CHECK_VALUE(false, "OAR_CUDA_CHECKS must be 'lazy' or 'eager', got '", v, "'");
  int expected = -1;
  g_mode.compare_exchange_strong(expected, m);  // a concurrent set_mode wins
  return static_cast<Mode>(g_mode.load());
}

void set_mode(Mode m) { g_mode.store(static_cast<int>(m)); }

Call begin(const at::Device& device, cuda::OpId op) {
  Call c;
  c.device = check_device(device.index());
  c.op = op;
  c.sink = cuda::ErrorSink{cuda::device_error_record(c.device), cuda::next_epoch(c.device)};
  c.stream = reinterpret_cast<cuda::Stream>(c10::cuda::getCurrentCUDAStream(c.device).stream());
  return c;
}

std::string describe(const cuda::ErrorRecord& rec) {
  std::ostringstream os;
  os << cuda::to_string(cuda::error_op(rec.error)) << " (CUDA): " << cuda::to_string(cuda::error_code(rec.error))
     << " (first recorded at index " << rec.index << ", value " << rec.value << ")";
  return os.str();
}

Verdict verify(const Call& call, When when) {
  Verdict v;
  if (when == When::kIfEager && mode() == Mode::kLazy) return v;
  v.checked = true;
  v.record = cuda::fetch_error_record(call.device, call.stream);
  if (v.record.error != 0 && cuda::error_epoch(v.record.error) == call.sink.epoch) {
    mark_consumed(call.device, call.sink.epoch);
    v.failed = true;
    return v;
  }
  if (unconsumed(call.device, v.record)) {
    mark_consumed(call.device, cuda::error_epoch(v.record.error));
    TORCH_CHECK_VALUE(false, "oar: an earlier oar CUDA call on cuda:", call.device,
                      " failed its input checks (recorded on the device, raised at this check): ",
                      describe(v.record));
  }
  return v;
}

void raise(const Call& call, const cuda::ErrorRecord& rec, const std::function<void()>& exact) {
  if (exact) exact();
  TORCH_CHECK_VALUE(false, describe(rec));
  (void)call;
  __builtin_unreachable();
}

std::string take_pending(int device) {
  check_device(device);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const auto stream = reinterpret_cast<cuda::Stream>(c10::cuda::getCurrentCUDAStream(device).stream());
  const cuda::ErrorRecord rec = cuda::fetch_error_record(device, stream);
  if (!unconsumed(device, rec)) return {};
  mark_consumed(device, cuda::error_epoch(rec.error));
  return describe(rec);
}

}  // namespace oar::torch_ops::cuda_checks

// ---- ops (schemas in schemas.cpp; python/oar/cuda_checks.py) ----------------------------------------------------
namespace {

using oar::torch_ops::cuda_checks::Mode;

const char* mode_name(Mode m) { return m == Mode::kEager ? "eager" : "lazy"; }

std::string set_cuda_checks_op(c10::string_view mode) {
  const std::string_view v(mode.data(), mode.size());
  TORCH_CHECK_VALUE(v == "lazy" || v == "eager", "mode must be one of ('lazy', 'eager'), got '", v, "'");
  Mode prev = Mode::kLazy;
  try {
    prev = oar::torch_ops::cuda_checks::mode();
  } catch (const c10::ValueError&) {
    // An invalid OAR_CUDA_CHECKS is overridden by the explicit setting; the previous mode reads as the default.
  }
  oar::torch_ops::cuda_checks::set_mode(v == "eager" ? Mode::kEager : Mode::kLazy);
  return mode_name(prev);
}

std::string get_cuda_checks_op() { return mode_name(oar::torch_ops::cuda_checks::mode()); }

std::string take_cuda_error_op(int64_t device) {
  TORCH_CHECK_VALUE(device >= 0 && device < c10::cuda::device_count(), "device must be a CUDA device index in [0, ",
                    static_cast<int>(c10::cuda::device_count()), "), got ", device);
  return oar::torch_ops::cuda_checks::take_pending(static_cast<int>(device));
}

}  // namespace

TORCH_LIBRARY_IMPL(oar, CompositeExplicitAutograd, m) {
  m.impl("_set_cuda_checks", &set_cuda_checks_op);
  m.impl("_get_cuda_checks", &get_cuda_checks_op);
  m.impl("_take_cuda_error", &take_cuda_error_op);
}
