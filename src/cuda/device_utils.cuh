// Internal (not installed): helpers shared by oar's CUDA kernels: element conversions, 16-byte vector loads,
// warp/block reductions, launch checks and the device side of the error record (include/oar/cuda/kernels.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "oar/cuda/kernels.h"

namespace oar::cuda::detail {

constexpr unsigned kFullMask = 0xffffffffu;

// ---- element conversions: exact widening to float / double, round-to-nearest-even narrowing ------------------

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(double x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ double to_d(float x) { return static_cast<double>(x); }
__device__ __forceinline__ double to_d(double x) { return x; }
__device__ __forceinline__ double to_d(__half x) { return static_cast<double>(__half2float(x)); }
__device__ __forceinline__ double to_d(__nv_bfloat16 x) { return static_cast<double>(__bfloat162float(x)); }

template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

/// Elements of T in one 16-byte vector.
template <typename T>
constexpr int vec_width() {
  return static_cast<int>(16 / sizeof(T));
}

/// 16-byte read-only load of vec_width<T>() elements, widened to float.
template <typename T>
__device__ __forceinline__ void load_vec(const T* p, float* out) {
  const int4 raw = __ldg(reinterpret_cast<const int4*>(p));
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int k = 0; k < vec_width<T>(); ++k) out[k] = to_f(e[k]);
}

/// 16-byte store of vec_width<T>() floats narrowed to T.
template <typename T>
__device__ __forceinline__ void store_vec(T* p, const float* in) {
  int4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int k = 0; k < vec_width<T>(); ++k) e[k] = from_f<T>(in[k]);
  *reinterpret_cast<int4*>(p) = raw;
}

// ---- reductions -------------------------------------------------------------------------------------------------

struct SumOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct MinOp {
  __device__ __forceinline__ double operator()(double a, double b) const { return fmin(a, b); }
  __device__ __forceinline__ float operator()(float a, float b) const { return fminf(a, b); }
  __device__ __forceinline__ uint32_t operator()(uint32_t a, uint32_t b) const { return a < b ? a : b; }
};
struct MaxOp {
  __device__ __forceinline__ double operator()(double a, double b) const { return fmax(a, b); }
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}

/// Reduction over the whole block, result returned to every thread. `scratch` holds 32 T in shared memory;
/// every thread of the block must call it (it synchronizes). Safe to call repeatedly with the same scratch.
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T identity, T* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  v = warp_reduce(v, op);
  __syncthreads();  // the previous call's readers are done with scratch
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T r = lane < nwarps ? scratch[lane] : identity;
  return warp_reduce(r, op);
}

// ---- error record -----------------------------------------------------------------------------------------------

/// Records a data error of this call (see ErrorRecord). Cheap enough for the error path only.
__device__ __forceinline__ void report(ErrorSink sink, OpId op, ErrorCode code, int64_t index, double value) {
  const unsigned long long key = (static_cast<unsigned long long>(sink.epoch) << 16) |
                                 (static_cast<unsigned long long>(op) << 8) | static_cast<unsigned long long>(code);
  auto* word = reinterpret_cast<unsigned long long*>(&sink.record->error);
  const unsigned long long old = atomicMax(word, key);
  if (old < key) {
    sink.record->index = index;
    sink.record->value = value;
  }
}

/// Sets op-specific marker i to this call's epoch (every writer stores the same value: no atomics needed).
__device__ __forceinline__ void mark(ErrorSink sink, int i) {
  *reinterpret_cast<volatile unsigned long long*>(&sink.record->flag[i]) = sink.epoch;
}

// ---- host side --------------------------------------------------------------------------------------------------

// Launch checks. CUDA keeps one "last error" per host thread, set by any failing runtime call of any library in
// the process: reading it with cudaGetLastError after a launch alone would blame oar's launch for an error some
// other code left behind (and consume it). So every launcher first calls check_no_pending_error: an error already
// pending is raised as an earlier error, not oar's, before oar launches anything. The cudaGetLastError after each
// launch then reads oar's own launch (or an asynchronous error of earlier device work that this launch surfaced,
// which no host-side check can tell apart). check_cuda clears the error it throws for, so that it is reported once.

/// Throws std::runtime_error if a CUDA error is already pending on this host thread before oar launches: it comes
/// from earlier work (another library, or an earlier failed call), not from oar. A non-sticky error is cleared,
/// so it is raised once; a sticky one (a kernel fault) stays: the CUDA context is unusable from then on.
/// cudaErrorNotReady (a status of an asynchronous query, not a failure) is cleared silently.
inline void check_no_pending_error(const char* what) {
  const cudaError_t err = cudaPeekAtLastError();
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();
  if (err == cudaErrorNotReady) return;
  throw std::runtime_error(std::string("oar ") + what + ": an earlier CUDA error, not from oar, was pending before " +
                           "the launch: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
                           "); nothing was launched");
}

/// Throws std::runtime_error if the launch just made failed (bad configuration, no kernel image for the device...).
/// Call check_no_pending_error before the op's first launch, so that the error read here is the launch's own.
inline void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("oar ") + what + " kernel launch failed: " + cudaGetErrorName(err) + " (" +
                             cudaGetErrorString(err) + ")");
}

/// Throws std::runtime_error naming `what` if a CUDA runtime call failed (and clears that error: it is reported
/// by the exception, not left for the next check).
inline void check_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();
  throw std::runtime_error(std::string("oar ") + what + ": " + cudaGetErrorString(err));
}

/// Prepares `kernel` (a __global__ function) for a launch on the current device with `dynamic_bytes` of dynamic
/// shared memory: throws std::runtime_error naming `what` when its static plus dynamic shared memory exceeds the
/// device's opt-in limit per block, and raises the kernel's cudaFuncAttributeMaxDynamicSharedMemorySize when
/// `dynamic_bytes` exceeds it. The attribute only ever grows (thread-safe), so a concurrent launch of the same
/// kernel with a larger size is never undercut. Defined in error_record.cu.
void allow_dynamic_shared_memory(const void* kernel, size_t dynamic_bytes, const char* what);

/// Static shared memory of `kernel` on the current device (cudaFuncAttributes::sharedSizeBytes; cached).
size_t static_shared_memory(const void* kernel);

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace oar::cuda::detail
