// CUDA importance normalization (method.md section 5) and bi-level sum-preserving reshaping (section 6),
// fused per row. Mirrors src/core/importance.cpp and src/core/reshape.cpp value for value: log1p and the
// min-max in double, the numpy-"linear" quantile on the float32 normalized scores, tier weights in double
// rounded to float32, mass preservation from the double sum of the float32 weights.
//
// One block per row (rollout). Global memory is read once (scores + both masks) and written once (token
// advantages + weights); every other pass runs over the row kept in shared memory:
//   1. read scores and masks: validation, span length L, raw min / max       (global -> shared)
//   2. s_hat = (log1p(s) - log1p(min)) / range                                (shared; skipped if normalized)
//   3. tau = quantile_q(s_hat over the span): radix select of the order statistic k = floor((L-1) q) on the
//      float bits (s_hat >= 0, so the bits order like the values), 4 passes of 8 bits with warp-aggregated
//      shared-memory histograms, plus one min pass for the next order statistic when interpolating
//   4. sum of the tier weights (double)
//   5. write w (rescaled to sum L over the span) and w * A                    (shared -> global)
// A row too long for shared memory keeps its normalized scores in the `weights` output row instead (written
// again, position by position, in pass 5), and re-reads the masks from global memory (L2).
#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "device_utils.cuh"
#include "oar/cuda/kernels.h"

namespace oar::cuda {
namespace {

using core::Tiers;
using detail::block_reduce;
using detail::kFullMask;
using detail::MaxOp;
using detail::MinOp;
using detail::report;
using detail::SumOp;
using detail::to_d;

constexpr int kThreads = 256;
constexpr double kInf = __builtin_huge_val();
constexpr double kEps = core::ReshapeOptions::kEps;
// Shared memory per element when the row is kept on chip: the float score and one byte of mask flags.
constexpr int64_t kSmemPerElement = sizeof(float) + 1;

enum class Mode { kNormalize, kReshape };

struct Params {
  double q;
  double beta;
  double floor;
};

__device__ __forceinline__ bool in_span(const uint8_t* fl, const bool* rrow, int64_t t) {
  return fl != nullptr ? (fl[t] & 1u) != 0 : rrow[t];
}

// Radix key of a normalized score: for s >= 0 the IEEE bits order like the values; -0.0 is mapped to +0.0.
__device__ __forceinline__ uint32_t key_of(float s) {
  const uint32_t u = __float_as_uint(s);
  return u == 0x80000000u ? 0u : u;
}

// The k-th smallest (0-based) key among the span positions of buf, by 4 passes of 8-bit radix selection.
// Returns the key, the number of span keys equal to it (mult) and the rank of the selected one among them.
// Every thread of the block must call it; every thread gets the same results.
__device__ uint32_t radix_select(const float* buf, const uint8_t* fl, const bool* rrow, int64_t T_len, uint32_t k,
                                 uint32_t* hist, uint32_t* sel, uint32_t* mult, uint32_t* rank) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  uint32_t prefix = 0, pmask = 0, count = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    // Warp-uniform trip count, so that __match_any_sync sees the whole warp. Normalized scores cluster in a
    // few exponent bins: aggregating equal bins per warp first keeps the shared atomics from serializing.
    for (int64_t t0 = 0; t0 < T_len; t0 += blockDim.x) {
      const int64_t t = t0 + threadIdx.x;
      int bin = -1;
      if (t < T_len && in_span(fl, rrow, t)) {
        const uint32_t key = key_of(buf[t]);
        if ((key & pmask) == prefix) bin = static_cast<int>((key >> shift) & 255u);
      }
      const unsigned peers = __match_any_sync(kFullMask, bin);
      if (bin >= 0 && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], static_cast<uint32_t>(__popc(peers)));
    }
    __syncthreads();
    if (warp == 0) {
      uint32_t c[8];
      uint32_t s = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        c[j] = hist[lane * 8 + j];
        s += c[j];
      }
      uint32_t incl = s;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const uint32_t y = __shfl_up_sync(kFullMask, incl, off);
        if (lane >= off) incl += y;
      }
      const uint32_t excl = incl - s;
      if (excl <= k && k < incl) {
        uint32_t kk = k - excl;
        int j = 0;
        while (j < 7 && kk >= c[j]) {
          kk -= c[j];
          ++j;
        }
        sel[0] = static_cast<uint32_t>(lane * 8 + j);
        sel[1] = kk;
        sel[2] = c[j];
      }
    }
    __syncthreads();
    // sel is rewritten only after the next pass's two barriers: every thread has read it by then.
    prefix |= sel[0] << shift;
    pmask |= 255u << shift;
    k = sel[1];
    count = sel[2];
  }
  *mult = count;
  *rank = k;
  return prefix;
}

template <Tiers K>
__device__ __forceinline__ double tier_weight(double s, double tau, const Params& p) {
  if (s < tau) {
    if constexpr (K == Tiers::kBoostOnly) return 1.0;
    else return fmax(s / (tau + kEps), p.floor);
  }
  if constexpr (K == Tiers::kSuppressOnly) return 1.0;
  else return 1.0 + p.beta * (s - tau) / (1.0 - tau + kEps);
}

template <Mode M, Tiers K, bool kNormalized, typename T>
__global__ void __launch_bounds__(kThreads)
    row_kernel(const float* __restrict__ adv, const T* __restrict__ scores, const bool* __restrict__ rmask,
               const bool* __restrict__ pmask, int64_t T_len, Params p, bool smem_row, float* __restrict__ out0,
               float* __restrict__ out1, ErrorSink sink) {
  extern __shared__ __align__(16) unsigned char dyn[];
  __shared__ double dscratch[32];
  __shared__ long long cscratch[32];
  __shared__ uint32_t uscratch[32];
  __shared__ uint32_t hist[256];
  __shared__ uint32_t sel[3];
  constexpr OpId kOp = M == Mode::kNormalize ? OpId::kNormalizeImportance : OpId::kReshapeAdvantages;

  const int64_t b = blockIdx.x;
  const int64_t base = b * T_len;
  const T* srow = scores + base;
  const bool* rrow = rmask + base;
  const bool* prow = M == Mode::kReshape ? pmask + base : nullptr;
  float* o0 = out0 + base;
  float* o1 = M == Mode::kReshape ? out1 + base : nullptr;
  // The row buffer: shared memory, or the output row that pass 5 overwrites position by position.
  float* buf = smem_row ? reinterpret_cast<float*>(dyn) : (M == Mode::kReshape ? o1 : o0);
  uint8_t* fl = smem_row ? dyn + T_len * sizeof(float) : nullptr;

  float a = 0.0f;
  if constexpr (M == Mode::kReshape) {
    a = adv[b];
    if (threadIdx.x == 0 && !isfinite(a)) report(sink, kOp, ErrorCode::kNonFiniteAdvantage, b, a);
  }

  // Pass 1: masks, validation, span length and raw extremes (log1p is monotone: min/max of the raw values).
  long long L = 0;
  double lo = kInf, hi = -kInf;
  for (int64_t t = threadIdx.x; t < T_len; t += blockDim.x) {
    const bool r = rrow[t];
    bool pr = false;
    if constexpr (M == Mode::kReshape) {
      pr = prow[t];
      if (r && !pr) report(sink, kOp, ErrorCode::kNotSubset, base + t, 0.0);
    }
    if (fl != nullptr) fl[t] = static_cast<uint8_t>(r) | static_cast<uint8_t>(pr << 1);
    if (!r) continue;
    const double v = to_d(srow[t]);
    if constexpr (kNormalized) {
      if (!(v >= 0.0 && v <= 1.0)) report(sink, kOp, ErrorCode::kScoreOutsideUnit, base + t, v);
    } else {
      if (!(v >= 0.0) || isinf(v)) report(sink, kOp, ErrorCode::kBadScore, base + t, v);
    }
    ++L;
    lo = fmin(lo, v);
    hi = fmax(hi, v);
    buf[t] = static_cast<float>(v);  // exact for float/half/bf16 scores; the span value itself when normalized
  }
  L = block_reduce(L, SumOp{}, 0LL, cscratch);
  if constexpr (!kNormalized) {
    lo = block_reduce(lo, MinOp{}, kInf, dscratch);
    hi = block_reduce(hi, MaxOp{}, -kInf, dscratch);
  }

  // Pass 2: normalized scores (core::normalize_importance, expression for expression).
  if constexpr (!kNormalized) {
    const double s_lo = log1p(lo);
    const double range = log1p(hi) - s_lo;
    const double inv = range > 0.0 ? 1.0 / range : 1.0;
    const bool divide = !isfinite(inv);  // subnormal range: 0 * inf would give NaN
    for (int64_t t = threadIdx.x; t < T_len; t += blockDim.x) {
      if (!in_span(fl, rrow, t)) {
        if constexpr (M == Mode::kNormalize) o0[t] = 0.0f;
        continue;
      }
      // float64 scores are re-read (L2): the row buffer holds them rounded to float.
      const double x = sizeof(T) == 8 ? to_d(srow[t]) : static_cast<double>(buf[t]);
      const double d = log1p(x) - s_lo;
      double v = divide ? d / range : d * inv;
      v = v < 0.0 ? 0.0 : (v > 1.0 ? 1.0 : v);
      buf[t] = static_cast<float>(v);
      if constexpr (M == Mode::kNormalize) o0[t] = buf[t];
    }
  }
  if constexpr (M == Mode::kNormalize) return;

  // Pass 3: tau = numpy-"linear" quantile of the span's normalized scores.
  double tau = 0.0;
  if (L > 0) {
    __syncthreads();  // buf complete before other threads read it
    const double h = static_cast<double>(L - 1) * p.q;
    const long long k = min(static_cast<long long>(floor(h)), L - 1);
    const double frac = h - static_cast<double>(k);
    uint32_t mult = 0, rank = 0;
    const uint32_t key = radix_select(buf, fl, rrow, T_len, static_cast<uint32_t>(k), hist, sel, &mult, &rank);
    const double av = static_cast<double>(__uint_as_float(key));
    tau = av;
    if (frac > 0.0 && k + 1 < L) {
      double bv = av;
      if (rank + 1 >= mult) {
        // The next order statistic is the smallest span key above the selected one.
        uint32_t m = 0xffffffffu;
        for (int64_t t = threadIdx.x; t < T_len; t += blockDim.x) {
          if (!in_span(fl, rrow, t)) continue;
          const uint32_t kk = key_of(buf[t]);
          if (kk > key && kk < m) m = kk;
        }
        m = block_reduce(m, MinOp{}, 0xffffffffu, uscratch);
        bv = static_cast<double>(__uint_as_float(m));
      }
      tau = av + frac * (bv - av);
    }
  }

  // Pass 4: sum of the float32 tier weights, in double (as the CPU sums the stored floats).
  double sum = 0.0;
  for (int64_t t = threadIdx.x; t < T_len; t += blockDim.x) {
    if (!in_span(fl, rrow, t)) continue;
    sum += static_cast<double>(static_cast<float>(tier_weight<K>(static_cast<double>(buf[t]), tau, p)));
  }
  sum = block_reduce(sum, SumOp{}, 0.0, dscratch);
  if (L > 0 && !isfinite(sum) && threadIdx.x == 0) report(sink, kOp, ErrorCode::kBetaOverflow, b, p.beta);
  // scale == 1 exactly (e.g. all-equal scores) leaves the weights exactly as computed, like the CPU.
  const double scale = L > 0 ? static_cast<double>(L) / sum : 1.0;

  // Pass 5: weights and token advantages (w = 1 on response tokens outside the span, 0 on padding).
  for (int64_t t = threadIdx.x; t < T_len; t += blockDim.x) {
    const uint8_t f = fl != nullptr ? fl[t]
                                    : static_cast<uint8_t>(static_cast<uint8_t>(rrow[t]) |
                                                           static_cast<uint8_t>(static_cast<uint8_t>(prow[t]) << 1));
    float w;
    if (f & 1u) {
      w = static_cast<float>(tier_weight<K>(static_cast<double>(buf[t]), tau, p));
      if (scale != 1.0) w = static_cast<float>(static_cast<double>(w) * scale);
    } else {
      w = (f & 2u) ? 1.0f : 0.0f;
    }
    const float x = w * a;
    if (!isfinite(x) && isfinite(a)) report(sink, kOp, ErrorCode::kTokenAdvantageOverflow, base + t, x);
    o0[t] = x;
    o1[t] = w;
  }
}

// Dynamic shared memory of a row kept on chip, or 0 when the row does not fit next to the kernel's static shared
// memory (about 1.7 KB) within the device's opt-in limit per block (it then lives in global memory).
size_t row_smem_bytes(int64_t T_len, size_t static_bytes) {
  int device = 0;
  detail::check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const int64_t limit = static_cast<int64_t>(max_shared_memory_per_block(device)) - static_cast<int64_t>(static_bytes);
  const int64_t bytes = ((T_len * kSmemPerElement + 15) / 16) * 16;
  return bytes <= limit ? static_cast<size_t>(bytes) : 0;
}

template <Mode M, Tiers K, bool kNormalized, typename T>
void launch_rows(const float* adv, const void* scores, const bool* rm, const bool* pm, int64_t B, int64_t T_len,
                 Params p, float* out0, float* out1, ErrorSink sink, cudaStream_t stream) {
  if (B == 0) return;
  if (B > (int64_t{1} << 31) - 1)
    throw core::InvalidArgument("reshape (CUDA): at most 2^31 - 1 rows, got B = " + std::to_string(B));
  const char* what = M == Mode::kNormalize ? "normalize_importance" : "reshape_advantages";
  detail::check_no_pending_error(what);
  auto kernel = row_kernel<M, K, kNormalized, T>;
  const void* fn = reinterpret_cast<const void*>(kernel);
  // Static + dynamic shared memory above 48 KiB needs the kernel's opt-in (from T ~ 9.5k tokens on): allowed here.
  const size_t smem = row_smem_bytes(T_len, detail::static_shared_memory(fn));
  detail::allow_dynamic_shared_memory(fn, smem, what);
  kernel<<<static_cast<unsigned>(B), kThreads, smem, stream>>>(adv, static_cast<const T*>(scores), rm, pm, T_len, p,
                                                               smem > 0, out0, out1, sink);
  detail::check_launch(what);
}

template <Mode M, Tiers K, bool kNormalized>
void dispatch_dtype(core::DType dtype, const float* adv, const void* scores, const bool* rm, const bool* pm,
                    int64_t B, int64_t T_len, Params p, float* out0, float* out1, ErrorSink sink, cudaStream_t s) {
  switch (dtype) {
    case core::DType::kFloat32: return launch_rows<M, K, kNormalized, float>(adv, scores, rm, pm, B, T_len, p, out0, out1, sink, s);
    case core::DType::kFloat64: return launch_rows<M, K, kNormalized, double>(adv, scores, rm, pm, B, T_len, p, out0, out1, sink, s);
    case core::DType::kFloat16: return launch_rows<M, K, kNormalized, __half>(adv, scores, rm, pm, B, T_len, p, out0, out1, sink, s);
    case core::DType::kBFloat16: return launch_rows<M, K, kNormalized, __nv_bfloat16>(adv, scores, rm, pm, B, T_len, p, out0, out1, sink, s);
  }
  throw core::InvalidArgument(std::string("scores (CUDA): unsupported dtype ") + core::to_string(dtype));
}

template <Tiers K>
void dispatch_normalized(bool normalized, core::DType dtype, const float* adv, const void* scores, const bool* rm,
                         const bool* pm, int64_t B, int64_t T_len, Params p, float* out0, float* out1, ErrorSink sink,
                         cudaStream_t s) {
  if (normalized) return dispatch_dtype<Mode::kReshape, K, true>(dtype, adv, scores, rm, pm, B, T_len, p, out0, out1, sink, s);
  return dispatch_dtype<Mode::kReshape, K, false>(dtype, adv, scores, rm, pm, B, T_len, p, out0, out1, sink, s);
}

}  // namespace

void launch_normalize_importance(core::DType dtype, const void* scores, const bool* mask, int64_t B, int64_t T,
                                 float* out, ErrorSink sink, Stream stream) {
  if (B < 0 || T < 0)
    throw core::InvalidArgument("scores must be (B, T) with B, T >= 0, got (" + std::to_string(B) + ", " +
                                std::to_string(T) + ")");
  if (T == 0) return;
  dispatch_dtype<Mode::kNormalize, Tiers::kBoth, false>(dtype, nullptr, scores, mask, nullptr, B, T, Params{}, out,
                                                        nullptr, sink, reinterpret_cast<cudaStream_t>(stream));
}

void launch_reshape_advantages(const float* advantages, core::DType dtype, const void* scores,
                               const bool* reasoning_mask, const bool* response_mask, int64_t B, int64_t T,
                               const core::ReshapeOptions& opts, bool scores_are_normalized, float* token_advantages,
                               float* weights, ErrorSink sink, Stream stream) {
  core::check_reshape_options(opts);
  if (B < 0 || T < 0)
    throw core::InvalidArgument("scores must be (B, T) with B, T >= 0, got (" + std::to_string(B) + ", " +
                                std::to_string(T) + ")");
  // T == 0 still launches (the advantages are validated as on the CPU) and touches no (B, T) buffer: their
  // pointers may be null then (an empty tensor's data pointer).
  if (T > 0 && (weights == nullptr || token_advantages == nullptr || scores == nullptr))
    throw core::InvalidArgument("reshape_advantages (CUDA): scores, token_advantages and weights must not be null");
  const Params p{opts.q, opts.beta, opts.floor};
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (opts.tiers) {
    case Tiers::kBoth:
      return dispatch_normalized<Tiers::kBoth>(scores_are_normalized, dtype, advantages, scores, reasoning_mask,
                                               response_mask, B, T, p, token_advantages, weights, sink, s);
    case Tiers::kBoostOnly:
      return dispatch_normalized<Tiers::kBoostOnly>(scores_are_normalized, dtype, advantages, scores, reasoning_mask,
                                                    response_mask, B, T, p, token_advantages, weights, sink, s);
    case Tiers::kSuppressOnly:
      return dispatch_normalized<Tiers::kSuppressOnly>(scores_are_normalized, dtype, advantages, scores, reasoning_mask,
                                                       response_mask, B, T, p, token_advantages, weights, sink, s);
  }
  throw core::InvalidArgument("tiers: unknown enum value " + std::to_string(static_cast<int>(opts.tiers)));
}

}  // namespace oar::cuda
