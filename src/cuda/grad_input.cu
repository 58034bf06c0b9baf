// CUDA grad x input reduction (method.md section 4): out[r] = |sum_h grad[r,h] * input[r,h]|.
// One warp per row; 16-byte vector loads (two per tensor in flight per lane) when the row starts are 16-byte
// aligned and H is a multiple of the vector width; fp32 accumulation (fp64 for float64 input, like the CPU);
// warp-shuffle reduction. A non-finite result is reported to the error record (the CPU raises on it).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "device_utils.cuh"
#include "oar/cuda/kernels.h"

namespace oar::cuda {
namespace {

template <typename Acc, typename T>
__device__ __forceinline__ Acc widen(T x) {
  if constexpr (std::is_same_v<Acc, double>) return detail::to_d(x);
  else return detail::to_f(x);
}

template <typename T>
__global__ void grad_x_input_kernel(const T* __restrict__ grad, const T* __restrict__ input, int64_t rows, int64_t H,
                                    bool vectorized, float* __restrict__ out, ErrorSink sink) {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte load
  const int lane = threadIdx.x & 31;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (row >= rows) return;
  const T* g = grad + row * H;
  const T* x = input + row * H;
  Acc acc = 0;
  if (vectorized) {
    const int4* g4 = reinterpret_cast<const int4*>(g);
    const int4* x4 = reinterpret_cast<const int4*>(x);
    const int64_t n4 = H / kVec;
    int64_t i = lane;
    // Two vectors per tensor in flight before the first use.
    for (; i + 32 < n4; i += 64) {
      const int4 ga = __ldg(g4 + i), xa = __ldg(x4 + i);
      const int4 gb = __ldg(g4 + i + 32), xb = __ldg(x4 + i + 32);
      const T* gea = reinterpret_cast<const T*>(&ga);
      const T* xea = reinterpret_cast<const T*>(&xa);
      const T* geb = reinterpret_cast<const T*>(&gb);
      const T* xeb = reinterpret_cast<const T*>(&xb);
#pragma unroll
      for (int k = 0; k < kVec; ++k) acc = fma(widen<Acc>(gea[k]), widen<Acc>(xea[k]), acc);
#pragma unroll
      for (int k = 0; k < kVec; ++k) acc = fma(widen<Acc>(geb[k]), widen<Acc>(xeb[k]), acc);
    }
    for (; i < n4; i += 32) {
      const int4 gv = __ldg(g4 + i), xv = __ldg(x4 + i);
      const T* ge = reinterpret_cast<const T*>(&gv);
      const T* xe = reinterpret_cast<const T*>(&xv);
#pragma unroll
      for (int k = 0; k < kVec; ++k) acc = fma(widen<Acc>(ge[k]), widen<Acc>(xe[k]), acc);
    }
  } else {
    for (int64_t i = lane; i < H; i += 32) acc = fma(widen<Acc>(g[i]), widen<Acc>(x[i]), acc);
  }
  acc = detail::warp_reduce(acc, detail::SumOp{});
  if (lane == 0) {
    const float r = fabsf(static_cast<float>(acc));
    if (!isfinite(r)) detail::report(sink, OpId::kGradXInput, ErrorCode::kNonFiniteResult, row, static_cast<double>(r));
    out[row] = r;
  }
}

template <typename T>
void launch(const void* grad, const void* input, int64_t rows, int64_t H, float* out, ErrorSink sink, Stream stream) {
  if (rows == 0) return;
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorized = (H % kVec == 0) && (reinterpret_cast<uintptr_t>(grad) % 16 == 0) &&
                          (reinterpret_cast<uintptr_t>(input) % 16 == 0);
  constexpr int kThreads = 256;  // 8 rows per block
  const int64_t blocks = detail::ceil_div(rows * 32, kThreads);
  if (blocks > (int64_t{1} << 31) - 1)
    throw core::InvalidArgument("grad_x_input (CUDA): too many rows for one launch: " + std::to_string(rows));
  detail::check_no_pending_error("grad_x_input");
  grad_x_input_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      static_cast<const T*>(grad), static_cast<const T*>(input), rows, H, vectorized, out, sink);
  detail::check_launch("grad_x_input");
}

}  // namespace

void launch_grad_x_input(core::DType dtype, const void* grad, const void* input, int64_t rows, int64_t H, float* out,
                         ErrorSink sink, Stream stream) {
  if (rows < 0 || H < 0)
    throw core::InvalidArgument("grad_x_input (CUDA): rows and H must be >= 0, got rows=" + std::to_string(rows) +
                                ", H=" + std::to_string(H));
  switch (dtype) {
    case core::DType::kFloat32: return launch<float>(grad, input, rows, H, out, sink, stream);
    case core::DType::kFloat64: return launch<double>(grad, input, rows, H, out, sink, stream);
    case core::DType::kFloat16: return launch<__half>(grad, input, rows, H, out, sink, stream);
    case core::DType::kBFloat16: return launch<__nv_bfloat16>(grad, input, rows, H, out, sink, stream);
  }
  throw core::InvalidArgument(std::string("grad_x_input (CUDA): unsupported dtype ") + core::to_string(dtype));
}

}  // namespace oar::cuda
