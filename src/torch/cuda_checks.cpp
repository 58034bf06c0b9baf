// Read-back policy of the CUDA data checks (cuda_checks.h, docs/design.md "CUDA input validation") and its C
// entry points for Python (oar.ops.set_cuda_checks / check_cuda_errors, loaded through ctypes: a mode switch
// and a check are process state, not tensor operators, so they have no schema).
#include "cuda_checks.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
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

// ---- C entry points (python/oar/ops.py, section "CUDA validation") -------------------------------------------
// They never throw across the C boundary: failures come back as a negative status and a message in `buf`.
namespace {

void copy_message(const std::string& msg, char* buf, int buflen) {
  if (buf == nullptr || buflen <= 0) return;
  const size_t n = std::min(msg.size(), static_cast<size_t>(buflen - 1));
  std::memcpy(buf, msg.data(), n);
  buf[n] = '\0';
}

}  // namespace

extern "C" {

/// Sets the mode (0 lazy, 1 eager); returns the previous one, or -1 for an invalid argument.
__attribute__((visibility("default"))) int oar_cuda_set_checks(int mode) {
  using oar::torch_ops::cuda_checks::Mode;
  if (mode != 0 && mode != 1) return -1;
  int prev = 0;
  try {
    prev = static_cast<int>(oar::torch_ops::cuda_checks::mode());
  } catch (...) {
    prev = 0;  // an invalid OAR_CUDA_CHECKS is overridden by the explicit setting
  }
  oar::torch_ops::cuda_checks::set_mode(static_cast<Mode>(mode));
  return prev;
}

/// The current mode (0 lazy, 1 eager), or -1 when OAR_CUDA_CHECKS holds an invalid value (message in buf).
__attribute__((visibility("default"))) int oar_cuda_get_checks(char* buf, int buflen) {
  try {
    return static_cast<int>(oar::torch_ops::cuda_checks::mode());
  } catch (const std::exception& e) {
    copy_message(e.what(), buf, buflen);
    return -1;
  }
}

/// Waits for the current stream of `device` and reads its error record: 1 and the message in buf when an error
/// was recorded and not raised yet (it is then marked raised), 0 when none, -1 on failure (message in buf).
__attribute__((visibility("default"))) int oar_cuda_take_error(int device, char* buf, int buflen) {
  try {
    const std::string msg = oar::torch_ops::cuda_checks::take_pending(device);
    if (msg.empty()) return 0;
    copy_message(msg, buf, buflen);
    return 1;
  } catch (const std::exception& e) {
    copy_message(e.what(), buf, buflen);
    return -1;
  }
}

}  // extern "C"
