// CUDA GRPO-family sequence advantages over ragged (CSR) groups (method.md section 1). Mirrors
// src/core/group_advantages.cpp: statistics in double with two passes (mean, then squared deviations),
// all-equal groups detected by comparing values (min == max over the valid rewards, which is the CPU's
// "every value equals the first" test), NaN rows skipped when skip_nan, verl's singleton quirk.
//
// Segmented layout: one team of threads per group, a warp for typical groups (G responses of a prompt, 4-64)
// or a 256-thread block when groups average 256 rewards or more. A team reads its rewards three times
// (moments, squared deviations, output), all from L1/L2: rewards are few (N ~ 1e3-1e5) and this op is
// latency-bound, so one launch (two for the "batch" estimator, whose divisor needs every reward first)
// is what matters.
#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "device_utils.cuh"
#include "oar/cuda/kernels.h"

namespace oar::cuda {
namespace {

using core::Estimator;
using core::SingletonPolicy;
using core::StdKind;
using detail::block_reduce;
using detail::MaxOp;
using detail::MinOp;
using detail::SumOp;
using detail::warp_reduce;

constexpr int kThreads = 256;
constexpr double kInf = __builtin_huge_val();

struct Params {
  double eps;
  bool unbiased;
  bool verl;
  bool skip_nan;
};

__device__ __forceinline__ double std_of(long long count, double ssq, bool unbiased) {
  const long long dof = unbiased ? count - 1 : count;
  return dof <= 0 ? 0.0 : sqrt(ssq / static_cast<double>(dof));
}

// Reduction over a team: a warp (kTeam == 32, no shared memory) or the whole block (kTeam == kThreads).
template <int kTeam, typename T, typename Op>
__device__ __forceinline__ T team_reduce(T v, Op op, T identity, T* scratch) {
  if constexpr (kTeam == 32) {
    return warp_reduce(v, op);
  } else {
    return block_reduce(v, op, identity, scratch);
  }
}

// Batch divisor of the "batch" estimator: (std of every non-NaN reward, or 1 when it is 0/undefined) + eps.
// One block. NaN/Inf rows are reported by the group kernel, so only overflow is reported here.
template <typename T>
__global__ void __launch_bounds__(1024) batch_stats_kernel(const T* __restrict__ r, int64_t n, Params p,
                                                           double* __restrict__ batch_div, ErrorSink sink) {
  __shared__ double dscratch[32];
  __shared__ long long cscratch[32];
  long long cnt = 0;
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double v = static_cast<double>(r[i]);
    if (isnan(v)) continue;
    sum += v;
    ++cnt;
  }
  cnt = block_reduce(cnt, SumOp{}, 0LL, cscratch);
  sum = block_reduce(sum, SumOp{}, 0.0, dscratch);
  const double mean = cnt > 0 ? sum / static_cast<double>(cnt) : 0.0;
  double ssq = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double v = static_cast<double>(r[i]);
    if (isnan(v)) continue;
    ssq += (v - mean) * (v - mean);
  }
  ssq = block_reduce(ssq, SumOp{}, 0.0, dscratch);
  if (threadIdx.x == 0) {
    if (!(isfinite(mean) && isfinite(ssq))) detail::report(sink, OpId::kGroupAdvantages, ErrorCode::kStatsOverflow, -1, 0.0);
    const double s = std_of(cnt, ssq, p.unbiased);
    *batch_div = (s > 0.0 ? s : 1.0) + p.eps;
  }
}

template <Estimator E>
__device__ __forceinline__ double regular_advantage(double v, double mean, double sum, long long count,
                                                    double group_div, double batch_div) {
  if constexpr (E == Estimator::kGrpo) return (v - mean) / group_div;
  if constexpr (E == Estimator::kDrGrpo) return v - mean;
  if constexpr (E == Estimator::kBatch) return (v - mean) / batch_div;
  if constexpr (E == Estimator::kRloo) return v - (sum - v) / static_cast<double>(count - 1);
}

template <Estimator E>
__device__ __forceinline__ double verl_singleton_advantage(double v, double eps, double batch_div) {
  if constexpr (E == Estimator::kGrpo) return v / (1.0 + eps);
  if constexpr (E == Estimator::kBatch) return v / batch_div;
  return v;  // kDrGrpo, kRloo
}

template <Estimator E, int kTeam, typename T>
__global__ void __launch_bounds__(kThreads) group_kernel(const T* __restrict__ r, int64_t n,
                                                         const int64_t* __restrict__ off, int64_t num_groups, Params p,
                                                         const double* __restrict__ batch_div_ptr,
                                                         float* __restrict__ out, ErrorSink sink) {
  __shared__ double dscratch[32];
  __shared__ long long cscratch[32];
  constexpr int kTeamsPerBlock = kThreads / kTeam;
  const int lane = threadIdx.x % kTeam;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kTeamsPerBlock + threadIdx.x / kTeam;
  if (num_groups == 0) {
    // No group: offsets == [0] and no reward is valid; anything else is malformed.
    if (g == 0 && lane == 0 && (off[0] != 0 || n != 0))
      detail::report(sink, OpId::kGroupAdvantages, ErrorCode::kBadOffsets, 0, static_cast<double>(off[0]));
    return;
  }
  if (g >= num_groups) return;  // whole teams only: block-wide teams have exactly num_groups blocks
  const int64_t b = off[g];
  const int64_t e = off[g + 1];
  const bool bad = (g == 0 && b != 0) || (g == num_groups - 1 && e != n) || e < b || b < 0 || e > n;
  if (bad) {
    // Never read outside [0, n): this group is skipped, the call fails.
    if (lane == 0) detail::report(sink, OpId::kGroupAdvantages, ErrorCode::kBadOffsets, g, 0.0);
    return;
  }

  // Pass 1: count, sum, min, max of the valid (non-NaN) rewards; NaN and Inf checks.
  long long cnt = 0;
  double sum = 0.0, lo = kInf, hi = -kInf;
  for (int64_t i = b + lane; i < e; i += kTeam) {
    const double v = static_cast<double>(r[i]);
    if (isnan(v)) {
      if (!p.skip_nan) detail::report(sink, OpId::kGroupAdvantages, ErrorCode::kNanReward, i, v);
      continue;
    }
    if (isinf(v)) detail::report(sink, OpId::kGroupAdvantages, ErrorCode::kInfReward, i, v);
    ++cnt;
    sum += v;
    lo = fmin(lo, v);
    hi = fmax(hi, v);
  }
  cnt = team_reduce<kTeam>(cnt, SumOp{}, 0LL, cscratch);
  sum = team_reduce<kTeam>(sum, SumOp{}, 0.0, dscratch);
  lo = team_reduce<kTeam>(lo, MinOp{}, kInf, dscratch);
  hi = team_reduce<kTeam>(hi, MaxOp{}, -kInf, dscratch);

  // 0: all zero (empty, singleton without verl, all-equal), 1: verl singleton, 2: regular.
  int kind = 0;
  if (cnt == 1) {
    kind = p.verl ? 1 : 0;
    if (lane == 0) detail::mark(sink, 0);
  } else if (cnt >= 2) {
    kind = lo == hi ? 0 : 2;
    if (lane == 0) detail::mark(sink, 1);
  }
  const double mean = cnt > 0 ? sum / static_cast<double>(cnt) : 0.0;
  double group_div = 1.0;
  if (kind == 2) {
    // Pass 2: squared deviations (two-pass: exact enough that all-equal and std == 0 agree).
    double ssq = 0.0;
    for (int64_t i = b + lane; i < e; i += kTeam) {
      const double v = static_cast<double>(r[i]);
      if (isnan(v)) continue;
      ssq += (v - mean) * (v - mean);
    }
    ssq = team_reduce<kTeam>(ssq, SumOp{}, 0.0, dscratch);
    if (!(isfinite(mean) && isfinite(ssq)) && lane == 0)
      detail::report(sink, OpId::kGroupAdvantages, ErrorCode::kStatsOverflow, g, 0.0);
    if constexpr (E == Estimator::kGrpo) group_div = std_of(cnt, ssq, p.unbiased) + p.eps;
  }
  const double batch_div = E == Estimator::kBatch ? *batch_div_ptr : 1.0 + p.eps;

  // Pass 3: outputs.
  for (int64_t i = b + lane; i < e; i += kTeam) {
    const double v = static_cast<double>(r[i]);
    double a = 0.0;
    if (!isnan(v)) {
      if (kind == 1) a = verl_singleton_advantage<E>(v, p.eps, batch_div);
      else if (kind == 2) a = regular_advantage<E>(v, mean, sum, cnt, group_div, batch_div);
    }
    const float af = static_cast<float>(a);
    if (!isfinite(af)) detail::report(sink, OpId::kGroupAdvantages, ErrorCode::kAdvantageOverflow, i, a);
    out[i] = af;
  }
}

template <Estimator E, typename T>
void launch_typed(const T* r, int64_t n, const int64_t* off, int64_t num_groups, Params p, double* batch_scratch,
                  float* out, ErrorSink sink, cudaStream_t stream) {
  detail::check_no_pending_error("group_advantages");
  if constexpr (E == Estimator::kBatch) {
    if (batch_scratch == nullptr) throw core::InvalidArgument("group_advantages (CUDA): batch_scratch is null");
    batch_stats_kernel<T><<<1, 1024, 0, stream>>>(r, n, p, batch_scratch, sink);
    detail::check_launch("group_advantages (batch statistics)");
  }
  const int64_t teams = num_groups > 0 ? num_groups : 1;
  // Large groups get a block each; typical GRPO groups (4-64 responses) a warp each.
  const bool large = num_groups > 0 && n / num_groups >= 256;
  if (large) {
    group_kernel<E, kThreads, T><<<static_cast<unsigned>(teams), kThreads, 0, stream>>>(r, n, off, num_groups, p,
                                                                                       batch_scratch, out, sink);
  } else {
    const int64_t blocks = detail::ceil_div(teams, kThreads / 32);
    group_kernel<E, 32, T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(r, n, off, num_groups, p,
                                                                                  batch_scratch, out, sink);
  }
  detail::check_launch("group_advantages");
}

template <typename T>
void dispatch_estimator(const T* r, int64_t n, const int64_t* off, int64_t num_groups,
                        const core::GroupAdvantageOptions& o, double* batch_scratch, float* out, ErrorSink sink,
                        cudaStream_t stream) {
  const Params p{o.eps, o.std_kind == StdKind::kUnbiased, o.singleton == SingletonPolicy::kVerl, o.skip_nan};
  switch (o.estimator) {
    case Estimator::kGrpo: return launch_typed<Estimator::kGrpo>(r, n, off, num_groups, p, batch_scratch, out, sink, stream);
    case Estimator::kDrGrpo: return launch_typed<Estimator::kDrGrpo>(r, n, off, num_groups, p, batch_scratch, out, sink, stream);
    case Estimator::kBatch: return launch_typed<Estimator::kBatch>(r, n, off, num_groups, p, batch_scratch, out, sink, stream);
    case Estimator::kRloo: return launch_typed<Estimator::kRloo>(r, n, off, num_groups, p, batch_scratch, out, sink, stream);
  }
  throw core::InvalidArgument("estimator: unknown enum value " + std::to_string(static_cast<int>(o.estimator)));
}

}  // namespace

void launch_group_advantages(core::DType dtype, const void* rewards, int64_t n, const int64_t* offsets,
                             int64_t num_groups, const core::GroupAdvantageOptions& opts, double* batch_scratch,
                             float* out, ErrorSink sink, Stream stream) {
  if (n < 0 || num_groups < 0)
    throw core::InvalidArgument("group_advantages (CUDA): sizes must be >= 0, got N=" + std::to_string(n) +
                                ", G=" + std::to_string(num_groups));
  if (num_groups > (int64_t{1} << 31) - 1)
    throw core::InvalidArgument("group_advantages (CUDA): at most 2^31 - 1 groups, got " + std::to_string(num_groups));
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (dtype) {
    case core::DType::kFloat32:
      return dispatch_estimator(static_cast<const float*>(rewards), n, offsets, num_groups, opts, batch_scratch, out, sink, s);
    case core::DType::kFloat64:
      return dispatch_estimator(static_cast<const double*>(rewards), n, offsets, num_groups, opts, batch_scratch, out, sink, s);
    default:
      throw core::InvalidArgument(std::string("group_advantages (CUDA): rewards must be float32 or float64, got ") +
                                  core::to_string(dtype));
  }
}

}  // namespace oar::cuda
