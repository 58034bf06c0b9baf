// Host side of the device error records (include/oar/cuda/kernels.h), cached device properties and the
// dynamic shared-memory limits of oar's kernels (device_utils.cuh).
//
// Why a persistent record tagged by epochs: a per-call record would need zeroing before the kernel (a memset or
// a fill kernel: one more operation in every step's profile). A record that is only ever raised with atomicMax
// on (epoch << 16 | op << 8 | code), with epochs that grow per call, needs no reset: the host compares the
// epoch it read back with the epoch of its own call.
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "device_utils.cuh"
#include "oar/cuda/kernels.h"

namespace oar::cuda {
namespace {

constexpr int kMaxDevices = 256;

struct DeviceState {
  std::once_flag once;
  ErrorRecord* record = nullptr;
  int sms = 0;
  int smem_optin = 0;
  std::atomic<uint64_t> epoch{0};
};

std::array<DeviceState, kMaxDevices>& states() {
  static std::array<DeviceState, kMaxDevices> s;
  return s;
}

DeviceState& state(int device) {
  if (device < 0 || device >= kMaxDevices)
    throw std::runtime_error("oar: CUDA device index " + std::to_string(device) + " out of range [0, " +
                             std::to_string(kMaxDevices) + ")");
  DeviceState& st = states()[device];
  std::call_once(st.once, [&] {
    int prev = 0;
    detail::check_cuda(cudaGetDevice(&prev), "cudaGetDevice");
    detail::check_cuda(cudaSetDevice(device), "cudaSetDevice");
    ErrorRecord* rec = nullptr;
    // Plain device allocation (never freed: 64 bytes per device for the life of the process). The memset is
    // synchronous and happens once per device.
    detail::check_cuda(cudaMalloc(&rec, sizeof(ErrorRecord)), "cudaMalloc of the error record");
    detail::check_cuda(cudaMemset(rec, 0, sizeof(ErrorRecord)), "cudaMemset of the error record");
    detail::check_cuda(cudaDeviceGetAttribute(&st.sms, cudaDevAttrMultiProcessorCount, device),
                       "cudaDeviceGetAttribute(MultiProcessorCount)");
    detail::check_cuda(cudaDeviceGetAttribute(&st.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                       "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
    detail::check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize after the error record set-up");
    st.record = rec;
    detail::check_cuda(cudaSetDevice(prev), "cudaSetDevice");
  });
  return st;
}

// Pinned host landing buffer, one per host thread (the copy is waited for before it is read).
ErrorRecord* pinned_buffer() {
  thread_local ErrorRecord* buf = nullptr;
  if (buf == nullptr) {
    void* p = nullptr;
    detail::check_cuda(cudaMallocHost(&p, sizeof(ErrorRecord)), "cudaMallocHost of the error record copy");
    buf = static_cast<ErrorRecord*>(p);
  }
  return buf;
}

// Shared memory of one kernel on one device: static bytes, and the dynamic bytes its launches may use (the
// function attribute MaxDynamicSharedMemorySize as last read or raised by oar).
struct KernelSmem {
  size_t static_bytes = 0;
  size_t max_dynamic = 0;
};

std::mutex& smem_mutex() {
  static std::mutex m;
  return m;
}

// Keyed by (device, kernel). Only read and written under smem_mutex().
std::map<std::pair<int, const void*>, KernelSmem>& smem_table() {
  static std::map<std::pair<int, const void*>, KernelSmem> t;
  return t;
}

// The entry of `kernel` on `device`, read from cudaFuncGetAttributes on first use. Call with smem_mutex() held.
KernelSmem& kernel_smem(int device, const void* kernel) {
  auto& table = smem_table();
  const auto key = std::make_pair(device, kernel);
  auto it = table.find(key);
  if (it != table.end()) return it->second;
  cudaFuncAttributes attr{};
  detail::check_cuda(cudaFuncGetAttributes(&attr, kernel), "cudaFuncGetAttributes");
  KernelSmem k;
  k.static_bytes = attr.sharedSizeBytes;
  k.max_dynamic = attr.maxDynamicSharedSizeBytes > 0 ? static_cast<size_t>(attr.maxDynamicSharedSizeBytes) : 0;
  return table.emplace(key, k).first->second;
}

}  // namespace

namespace detail {

size_t static_shared_memory(const void* kernel) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const std::lock_guard<std::mutex> lock(smem_mutex());
  return kernel_smem(device, kernel).static_bytes;
}

void allow_dynamic_shared_memory(const void* kernel, size_t dynamic_bytes, const char* what) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const size_t optin = static_cast<size_t>(max_shared_memory_per_block(device));
  const std::lock_guard<std::mutex> lock(smem_mutex());
  KernelSmem& k = kernel_smem(device, kernel);
  if (k.static_bytes + dynamic_bytes > optin)
    throw std::runtime_error(std::string("oar ") + what + ": a block needs " +
                             std::to_string(k.static_bytes + dynamic_bytes) + " bytes of shared memory (" +
                             std::to_string(k.static_bytes) + " static + " + std::to_string(dynamic_bytes) +
                             " dynamic), more than the " + std::to_string(optin) + " bytes per block of cuda:" +
                             std::to_string(device));
  // The default limit is 48 KiB minus the static part: static + dynamic above 48 KiB needs the opt-in, even
  // when the dynamic part alone is below 48 KiB. Raised only, never lowered: another thread may be launching
  // this kernel with the larger size right now.
  if (dynamic_bytes <= k.max_dynamic) return;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dynamic_bytes)),
             "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  k.max_dynamic = dynamic_bytes;
}

}  // namespace detail

const char* to_string(OpId op) {
  switch (op) {
    case OpId::kNone: return "none";
    case OpId::kGroupAdvantages: return "group_advantages";
    case OpId::kNormalizeImportance: return "normalize_importance";
    case OpId::kReshapeAdvantages: return "reshape_advantages";
    case OpId::kProbeDivergence: return "probe_divergence";
    case OpId::kProbeDivergenceBackward: return "probe_divergence_backward";
    case OpId::kGradXInput: return "grad_x_input";
    case OpId::kBuildMaskedBatch: return "build_masked_batch";
  }
  return "unknown op";
}

const char* to_string(ErrorCode code) {
  switch (code) {
    case ErrorCode::kNone: return "no error";
    case ErrorCode::kBadOffsets: return "offsets are not valid CSR offsets (offsets[0] == 0, non-decreasing, offsets[G] == N)";
    case ErrorCode::kNanReward: return "rewards must not contain NaN (pass skip_nan=True to exclude NaN rows)";
    case ErrorCode::kInfReward: return "rewards must be finite";
    case ErrorCode::kStatsOverflow: return "the reward statistics overflow double; rescale the rewards";
    case ErrorCode::kAdvantageOverflow: return "an advantage is not finite in float32; rescale the rewards or use eps > 0";
    case ErrorCode::kNonFiniteAdvantage: return "advantages must be finite (and fit in float32)";
    case ErrorCode::kNotSubset: return "reasoning_mask must be a subset of response_mask";
    case ErrorCode::kBadScore: return "scores must be finite and >= 0 on the masked (reasoning) positions";
    case ErrorCode::kScoreOutsideUnit: return "scores must lie in [0, 1] on reasoning_mask when scores_are_normalized=True";
    case ErrorCode::kBetaOverflow: return "beta makes the boost weights overflow float32; use a smaller beta";
    case ErrorCode::kTokenAdvantageOverflow: return "a token advantage (weight x advantage) overflows float32";
    case ErrorCode::kBadLength: return "lengths[n] must be in [1, S]";
    case ErrorCode::kBadAnswerId: return "answer_ids[n, s] must be in [0, V)";
    case ErrorCode::kNanDivergence: return "a row gives a NaN divergence (NaN/+inf logits, or no finite logit at a probed position)";
    case ErrorCode::kNonFiniteResult: return "the result is not finite (NaN/Inf in grad or input, or beyond float32)";
    case ErrorCode::kBadRowIndex: return "row_index[m] must be in [0, B)";
    case ErrorCode::kBadPosition: return "positions[m] must be in [0, T)";
  }
  return "unknown error";
}

ErrorRecord* device_error_record(int device) { return state(device).record; }

uint64_t next_epoch(int device) { return state(device).epoch.fetch_add(1, std::memory_order_relaxed) + 1; }

ErrorRecord fetch_error_record(int device, Stream stream) {
  const ErrorRecord* rec = device_error_record(device);
  ErrorRecord* host = pinned_buffer();
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  // The read-back waits on the stream, which a stream being captured into a CUDA graph does not allow (the wait
  // would fail and invalidate the capture): say so instead (docs/design.md, "CUDA ops and CUDA graphs").
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  detail::check_cuda(cudaStreamIsCapturing(s, &capture), "cudaStreamIsCapturing");
  if (capture != cudaStreamCaptureStatusNone)
    throw std::runtime_error(
        "oar: reading the CUDA error record back waits on the stream, which is not allowed while the stream is "
        "captured into a CUDA graph: group_advantages, normalize_importance and reshape_advantages (always) and "
        "the other ops in eager check mode cannot be captured; run them outside the captured region "
        "(docs/design.md, \"CUDA ops and CUDA graphs\")");
  detail::check_cuda(cudaMemcpyAsync(host, rec, sizeof(ErrorRecord), cudaMemcpyDeviceToHost, s),
                     "copy of the error record");
  detail::check_cuda(cudaStreamSynchronize(s), "wait for the error record");
  return *host;
}

int multiprocessor_count(int device) { return state(device).sms; }
int max_shared_memory_per_block(int device) { return state(device).smem_optin; }

}  // namespace oar::cuda
