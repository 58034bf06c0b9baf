// CUDA grad x input reduction (method.md section 4): out[r] = |sum_h grad[r,h] * input[r,h]|.
// One warp per row; 16-byte vector loads when the row start is 16-byte aligned and H is a multiple of
// the vector width; fp32 accumulation; warp-shuffle reduction.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "oar/cuda/kernels.h"

namespace oar::cuda {
namespace {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__global__ void grad_x_input_kernel(const T* __restrict__ grad, const T* __restrict__ input, int64_t rows,
                                    int64_t H, bool vectorized, float* __restrict__ out) {
  constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte load
  const int lane = threadIdx.x & 31;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (row >= rows) return;
  const T* g = grad + row * H;
  const T* x = input + row * H;
  float acc = 0.f;
  if (vectorized) {
    const int4* g4 = reinterpret_cast<const int4*>(g);
    const int4* x4 = reinterpret_cast<const int4*>(x);
    const int64_t n4 = H / kVec;
    for (int64_t i = lane; i < n4; i += 32) {
      int4 gv = __ldg(g4 + i);
      int4 xv = __ldg(x4 + i);
      const T* ge = reinterpret_cast<const T*>(&gv);
      const T* xe = reinterpret_cast<const T*>(&xv);
#pragma unroll
      for (int k = 0; k < kVec; ++k) acc = fmaf(to_f(ge[k]), to_f(xe[k]), acc);
    }
  } else {
    for (int64_t i = lane; i < H; i += 32) acc = fmaf(to_f(g[i]), to_f(x[i]), acc);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) out[row] = fabsf(acc);
}

template <typename T>
void launch(const void* grad, const void* input, int64_t rows, int64_t H, float* out, Stream stream) {
  if (rows == 0) return;
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorized = (H % kVec == 0) && (reinterpret_cast<uintptr_t>(grad) % 16 == 0) &&
                          (reinterpret_cast<uintptr_t>(input) % 16 == 0);
  constexpr int kThreads = 256;  // 8 rows per block
  const int64_t blocks = (rows * 32 + kThreads - 1) / kThreads;
  grad_x_input_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      static_cast<const T*>(grad), static_cast<const T*>(input), rows, H, vectorized, out);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("oar grad_x_input kernel launch failed: ") + cudaGetErrorString(err));
}

}  // namespace

void launch_grad_x_input(core::DType dtype, const void* grad, const void* input, int64_t rows, int64_t H,
                         float* out, Stream stream) {
  switch (dtype) {
    case core::DType::kFloat32: return launch<float>(grad, input, rows, H, out, stream);
    case core::DType::kFloat16: return launch<__half>(grad, input, rows, H, out, stream);
    case core::DType::kBFloat16: return launch<__nv_bfloat16>(grad, input, rows, H, out, stream);
    default: throw core::InvalidArgument(std::string("grad_x_input (CUDA): unsupported dtype ") + core::to_string(dtype));
  }
}

}  // namespace oar::cuda
