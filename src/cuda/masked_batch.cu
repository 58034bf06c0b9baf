// CUDA OAR-P masked batch (method.md section 3): out[m, :] = input_ids[row_index[m], :] with
// out[m, positions[m]] = pad_id. A pure copy: one block per (variant, 2048-token tile), 16-byte loads and
// stores when T is even and both base pointers are 16-byte aligned (a contiguous view with an odd storage
// offset is not: it takes the 8-byte path), the PAD substitution fused into the copy (no second write to the
// same element).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "device_utils.cuh"
#include "oar/cuda/kernels.h"

namespace oar::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kTile = kThreads * 2 * 4;  // tokens per block: four 16-byte vectors per thread

__global__ void __launch_bounds__(kThreads)
    masked_batch_kernel(const int64_t* __restrict__ ids, int64_t B, int64_t T, const int64_t* __restrict__ rows,
                        const int64_t* __restrict__ pos, int64_t tiles, int64_t pad, bool vec16,
                        int64_t* __restrict__ out, ErrorSink sink) {
  const int64_t m = blockIdx.x / tiles;
  const int64_t t0 = (blockIdx.x % tiles) * kTile;
  const int64_t t1 = min(T, t0 + kTile);
  const int64_t r = rows[m];
  const int64_t p = pos[m];
  const bool row_ok = r >= 0 && r < B;
  const bool pos_ok = p >= 0 && p < T;
  if (t0 == 0 && threadIdx.x == 0) {
    if (!row_ok) detail::report(sink, OpId::kBuildMaskedBatch, ErrorCode::kBadRowIndex, m, static_cast<double>(r));
    else if (!pos_ok) detail::report(sink, OpId::kBuildMaskedBatch, ErrorCode::kBadPosition, m, static_cast<double>(p));
  }
  int64_t* dst = out + m * T;
  if (!row_ok || !pos_ok) {
    // Never read outside input_ids: the variant becomes all PAD and the call fails.
    for (int64_t t = t0 + threadIdx.x; t < t1; t += blockDim.x) dst[t] = pad;
    return;
  }
  const int64_t* src = ids + r * T;
  if (vec16) {  // T even and aligned bases: every row starts 16-byte aligned, t0 and t1 are even
    const auto* s2 = reinterpret_cast<const longlong2*>(src);
    auto* d2 = reinterpret_cast<longlong2*>(dst);
    for (int64_t i = t0 / 2 + threadIdx.x; i < t1 / 2; i += blockDim.x) {
      longlong2 v = __ldg(s2 + i);
      if (2 * i == p) v.x = pad;
      if (2 * i + 1 == p) v.y = pad;
      d2[i] = v;
    }
  } else {
    for (int64_t t = t0 + threadIdx.x; t < t1; t += blockDim.x) dst[t] = t == p ? pad : __ldg(src + t);
  }
}

}  // namespace

void launch_build_masked_batch(const int64_t* input_ids, int64_t B, int64_t T, const int64_t* row_index,
                               const int64_t* positions, int64_t M, int64_t pad_id, int64_t* out, ErrorSink sink,
                               Stream stream) {
  if (B < 0 || T < 0 || M < 0)
    throw core::InvalidArgument("build_masked_batch: sizes must be >= 0, got B=" + std::to_string(B) +
                                ", T=" + std::to_string(T) + ", M=" + std::to_string(M));
  if (M == 0) return;
  // T == 0 still launches one block per variant: the indices are validated as on the CPU.
  const int64_t tiles = T == 0 ? 1 : detail::ceil_div(T, kTile);
  const int64_t blocks = M * tiles;
  if (blocks > (int64_t{1} << 31) - 1)
    throw core::InvalidArgument("build_masked_batch (CUDA): too many variants for one launch: M=" + std::to_string(M));
  const bool vec16 = T % 2 == 0 && reinterpret_cast<uintptr_t>(input_ids) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(out) % 16 == 0;
  detail::check_no_pending_error("build_masked_batch");
  masked_batch_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      input_ids, B, T, row_index, positions, tiles, pad_id, vec16, out, sink);
  detail::check_launch("build_masked_batch");
}

}  // namespace oar::cuda
