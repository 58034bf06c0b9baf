// Launchers of oar's CUDA kernels (src/cuda/*.cu). Torch-free: raw device pointers, sizes and a
// cudaStream_t; element types are passed as oar::core::DType so that this header needs no CUDA header.
// Every launcher checks its launch (cudaGetLastError) and throws std::runtime_error with the CUDA error
// string. Only available when the library was built with OAR_WITH_CUDA (oar::core::compiled_with_cuda()).
#pragma once

#include <cstdint>

#include "oar/core/common.h"

struct CUstream_st;

namespace oar::cuda {

using Stream = CUstream_st*;  // == cudaStream_t

/// out[r] = |sum_h grad[r,h] * input[r,h]|, fp32 accumulation, one warp per row with 16-byte loads when
/// H and the pointers allow. dtype: kFloat32, kFloat16 or kBFloat16. grad/input: rows x H contiguous.
void launch_grad_x_input(core::DType dtype, const void* grad, const void* input, int64_t rows, int64_t H,
                         float* out, Stream stream);

}  // namespace oar::cuda
