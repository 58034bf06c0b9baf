// CUDA outcome-probe divergences (method.md section 2) and their gradient w.r.t. the perturbed logits (section
// 4). Mirrors src/core/probe.cpp: the same probe logits (the mean over positions summed in float then scaled
// by 1/L, bit for bit), KL(p || q) = sum_v p_v (zc_v - zp_v) + lse(zp) - lse(zc) with the first term riding
// along the clean normalizer, -inf logits as zero probability, NaN results reported, the KL clamped at 0.
//
// Online softmax, one pass over the vocabulary per row, nothing materialized: each thread keeps a running
// (max, sum of exp, t) for the clean side and (max, sum of exp) for the perturbed side over 16-byte vectors
// of the row, the block merges them, and the per-row result is combined in double. So that batches with few
// rows still fill the GPU, a row's vocabulary is split across `splits` blocks (ProbePlan); their states then
// go to a small workspace and a merge kernel (one thread per row) finishes. With enough rows every block
// owns a whole row and writes the result itself: one launch.
//
// Backward: pass 1 is the same reduction (normalizers only), pass 2 writes each gradient element once:
//   distribution probes: g[n,s,:] = grad_out[n] (softmax(mean zp) - softmax(mean zc)) / Lp for s < Lp
//   answer_joint:        g[n,s,:] = grad_out[n] (softmax(zp[n,s]) - onehot(a[n,s])) / L   for s < L
// and zeros at the other positions (no separate memset).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "device_utils.cuh"
#include "oar/cuda/kernels.h"

namespace oar::cuda {
namespace {

using core::Probe;
using detail::load_vec;
using detail::report;
using detail::store_vec;
using detail::to_f;
using detail::vec_width;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kStateFloats = 5;  // mc, sc, tc, mp, sp

// Running softmax states of one thread / block. Clean: max mc, sum sc of exp(zc - mc), tc = sum exp(zc - mc)
// (zc - zp); perturbed: max mp, sum sp. A max of -inf means "no mass yet"; NaN is sticky in the sums.
struct State {
  float mc, sc, tc, mp, sp;
};

__device__ __forceinline__ State empty_state() { return State{-INFINITY, 0.0f, 0.0f, -INFINITY, 0.0f}; }

// exp(m_old - m_new) with a -inf old max contributing nothing (its sum is 0, or NaN, which stays NaN). Underflows
// to exactly 0 once the old max is ~87 below the new one (__expf): see scaled for the t sum.
__device__ __forceinline__ float rescale(float m_old, float m_new) {
  return m_old == -INFINITY ? 0.0f : __expf(m_old - m_new);
}

// The t sum rescaled by a factor f = rescale(...) >= 0: a +inf t stays +inf (it holds a term of positive
// probability times an infinite logit difference; a positive factor, however small, keeps it infinite), where
// inf * 0 would give NaN when f underflows. NaN stays NaN.
__device__ __forceinline__ float scaled(float t, float f) { return isinf(t) ? t : t * f; }

// One entry's term of t: e (zc - zp) with e = exp(zc - mc). A -inf clean logit (zero probability) adds exactly 0,
// even against a -inf perturbed one (no -inf - -inf = NaN). A finite clean logit has positive probability even
// where e underflows to 0 (more than ~87 below the max): an infinite difference (perturbed -inf, or a difference
// beyond float) adds +inf there, not 0 * inf = NaN, as on the CPU (whose exp never returns 0 for a finite
// argument). A NaN logit gives NaN.
__device__ __forceinline__ float t_term(float e, float zc, float zp) {
  if (zc == -INFINITY) return 0.0f;
  const float d = zc - zp;
  return d == INFINITY ? INFINITY : e * d;
}

// Adds kN entries. -inf logits add exactly 0 to the sums (and no NaN through -inf - -inf); a NaN logit makes the
// sum NaN. The t sum follows t_term and scaled.
template <int kN, bool kClean, bool kWithT>
__device__ __forceinline__ void update(State& st, const float* zc, const float* zp) {
  if constexpr (kClean) {
    float cmax = zc[0];
#pragma unroll
    for (int k = 1; k < kN; ++k) cmax = fmaxf(cmax, zc[k]);
    if (cmax > st.mc) {
      const float f = rescale(st.mc, cmax);
      st.sc *= f;
      if constexpr (kWithT) st.tc = scaled(st.tc, f);
      st.mc = cmax;
    }
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      const bool zero = zc[k] == -INFINITY;
      const float e = zero ? 0.0f : __expf(zc[k] - st.mc);
      st.sc += e;
      if constexpr (kWithT) st.tc += t_term(e, zc[k], zp[k]);
    }
  }
  float pmax = zp[0];
#pragma unroll
  for (int k = 1; k < kN; ++k) pmax = fmaxf(pmax, zp[k]);
  if (pmax > st.mp) {
    st.sp *= rescale(st.mp, pmax);
    st.mp = pmax;
  }
#pragma unroll
  for (int k = 0; k < kN; ++k) st.sp += zp[k] == -INFINITY ? 0.0f : __expf(zp[k] - st.mp);
}

__device__ __forceinline__ void merge(State& a, const State& b) {
  const float mc = fmaxf(a.mc, b.mc);
  const float fa = rescale(a.mc, mc), fb = rescale(b.mc, mc);
  a.sc = a.sc * fa + b.sc * fb;
  a.tc = scaled(a.tc, fa) + scaled(b.tc, fb);
  a.mc = mc;
  const float mp = fmaxf(a.mp, b.mp);
  a.sp = a.sp * rescale(a.mp, mp) + b.sp * rescale(b.mp, mp);
  a.mp = mp;
}

// Merges the states of the block into thread 0's (returned there; other threads get partial states).
__device__ __forceinline__ State block_merge(State st) {
  __shared__ float sh[kWarps][kStateFloats];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    State o;
    o.mc = __shfl_xor_sync(detail::kFullMask, st.mc, off);
    o.sc = __shfl_xor_sync(detail::kFullMask, st.sc, off);
    o.tc = __shfl_xor_sync(detail::kFullMask, st.tc, off);
    o.mp = __shfl_xor_sync(detail::kFullMask, st.mp, off);
    o.sp = __shfl_xor_sync(detail::kFullMask, st.sp, off);
    merge(st, o);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sh[warp][0] = st.mc;
    sh[warp][1] = st.sc;
    sh[warp][2] = st.tc;
    sh[warp][3] = st.mp;
    sh[warp][4] = st.sp;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) merge(st, State{sh[w][0], sh[w][1], sh[w][2], sh[w][3], sh[w][4]});
  }
  return st;
}

__device__ __forceinline__ void store_state(float* p, const State& st) {
  p[0] = st.mc;
  p[1] = st.sc;
  p[2] = st.tc;
  p[3] = st.mp;
  p[4] = st.sp;
}

__device__ __forceinline__ State load_state(const float* p) { return State{p[0], p[1], p[2], p[3], p[4]}; }

__device__ __forceinline__ State merge_partials(const float* partials, int64_t unit, int64_t splits) {
  State st = load_state(partials + unit * splits * kStateFloats);
  for (int64_t k = 1; k < splits; ++k) merge(st, load_state(partials + (unit * splits + k) * kStateFloats));
  return st;
}

__device__ __forceinline__ double lse_clean(const State& st) {
  return static_cast<double>(st.mc) + log(static_cast<double>(st.sc));
}
__device__ __forceinline__ double lse_pert(const State& st) {
  return static_cast<double>(st.mp) + log(static_cast<double>(st.sp));
}

// KL of a finished row state; NaN is reported and returned, a rounding-negative KL is clamped to 0.
__device__ __forceinline__ float finish_kl(const State& st, int64_t n, ErrorSink sink) {
  const double kl = static_cast<double>(st.tc) / static_cast<double>(st.sc) + (lse_pert(st) - lse_clean(st));
  if (isnan(kl)) {
    report(sink, OpId::kProbeDivergence, ErrorCode::kNanDivergence, n, kl);
    return NAN;
  }
  return static_cast<float>(kl < 0.0 ? 0.0 : kl);
}

__device__ __forceinline__ bool bad_length(int64_t L, int64_t S) { return L < 1 || L > S; }

// The probe logits of one 16-byte vector: position 0, or the mean over positions s < Lp (summed in float in
// position order, then scaled by 1/Lp: the CPU's expression).
template <typename T>
__device__ __forceinline__ void probe_vec(const T* row, int64_t stride_s, int64_t v, int64_t Lp, float inv, float* z) {
  constexpr int kVec = vec_width<T>();
  load_vec(row + v, z);
  if (Lp > 1) {
    for (int64_t s = 1; s < Lp; ++s) {
      float y[kVec];
      load_vec(row + s * stride_s + v, y);
#pragma unroll
      for (int k = 0; k < kVec; ++k) z[k] += y[k];
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) z[k] *= inv;
  }
}

template <typename T>
__device__ __forceinline__ float probe_scalar(const T* row, int64_t stride_s, int64_t v, int64_t Lp, float inv) {
  float z = to_f(row[v]);
  if (Lp > 1) {
    for (int64_t s = 1; s < Lp; ++s) z += to_f(row[s * stride_s + v]);
    z *= inv;
  }
  return z;
}

// Accumulates vocabulary entries [v0, v1) of one probe row (Lp positions averaged) into this thread's state.
template <typename T, bool kClean, bool kWithT>
__device__ __forceinline__ State reduce_range(const T* crow, int64_t cstride_s, const T* prow, int64_t pstride_s,
                                              int64_t v0, int64_t v1, int64_t Lp, bool vec_ok) {
  constexpr int kVec = vec_width<T>();
  const float inv = 1.0f / static_cast<float>(Lp);
  State st = empty_state();
  int64_t v_tail = v0;
  if (vec_ok) {
    const int64_t nvec = (v1 - v0) / kVec;
#pragma unroll 2
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
      const int64_t v = v0 + i * kVec;
      float zc[kVec], zp[kVec];
      if constexpr (kClean) probe_vec(crow, cstride_s, v, Lp, inv, zc);
      probe_vec(prow, pstride_s, v, Lp, inv, zp);
      update<kVec, kClean, kWithT>(st, zc, zp);
    }
    v_tail = v0 + nvec * kVec;
  }
  for (int64_t v = v_tail + threadIdx.x; v < v1; v += blockDim.x) {
    float zc = 0.0f;
    if constexpr (kClean) zc = probe_scalar(crow, cstride_s, v, Lp, inv);
    const float zp = probe_scalar(prow, pstride_s, v, Lp, inv);
    update<1, kClean, kWithT>(st, &zc, &zp);
  }
  return st;
}

// Distribution probes (last, answer_mean), forward (kWithT) or backward pass 1. Block = (row n, split).
// kFinalize: splits == 1, the block writes out[n]; otherwise its state goes to partials.
template <typename T, bool kMean, bool kWithT, bool kFinalize>
__global__ void __launch_bounds__(kThreads)
    dist_reduce_kernel(LogitsDesc c, LogitsDesc p, const int64_t* __restrict__ lengths, int64_t S, int64_t V,
                       int64_t splits, int64_t chunk, bool vec_ok, float* __restrict__ partials,
                       float* __restrict__ out, ErrorSink sink, OpId op) {
  const int64_t n = blockIdx.x / splits;
  const int64_t split = blockIdx.x % splits;
  const int64_t L = lengths != nullptr ? lengths[n] : S;
  if (bad_length(L, S)) {
    // Never read past the row; the row's result is NaN and the call fails.
    if (split == 0 && threadIdx.x == 0) {
      report(sink, op, ErrorCode::kBadLength, n, static_cast<double>(L));
      if constexpr (kFinalize) out[n] = NAN;
    }
    return;
  }
  const int64_t Lp = kMean ? L : 1;
  const T* crow = static_cast<const T*>(c.data) + n * c.stride_n;
  const T* prow = static_cast<const T*>(p.data) + n * p.stride_n;
  const int64_t v0 = split * chunk;
  const int64_t v1 = min(V, v0 + chunk);
  State st = reduce_range<T, true, kWithT>(crow, c.stride_s, prow, p.stride_s, v0, v1, Lp, vec_ok);
  st = block_merge(st);
  if (threadIdx.x != 0) return;
  if constexpr (kFinalize) {
    out[n] = finish_kl(st, n, sink);
  } else {
    store_state(partials + blockIdx.x * static_cast<int64_t>(kStateFloats), st);
  }
}

// Forward merge of the split states: one thread per row.
__global__ void dist_merge_kernel(const float* __restrict__ partials, const int64_t* __restrict__ lengths, int64_t N,
                                  int64_t S, int64_t splits, float* __restrict__ out, ErrorSink sink) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const int64_t L = lengths != nullptr ? lengths[n] : S;
  if (bad_length(L, S)) {
    out[n] = NAN;  // reported by the reduce kernel
    return;
  }
  out[n] = finish_kl(merge_partials(partials, n, splits), n, sink);
}

// answer_joint: per (row, position) log-sum-exps. Block = (n, s, split); positions s >= L do nothing.
template <typename T, bool kClean>
__global__ void __launch_bounds__(kThreads)
    joint_reduce_kernel(LogitsDesc c, LogitsDesc p, const int64_t* __restrict__ lengths, int64_t S, int64_t V,
                        int64_t splits, int64_t chunk, bool vec_ok, float* __restrict__ partials, ErrorSink sink,
                        OpId op) {
  const int64_t unit = blockIdx.x / splits;
  const int64_t split = blockIdx.x % splits;
  const int64_t n = unit / S, s = unit % S;
  const int64_t L = lengths != nullptr ? lengths[n] : S;
  if (bad_length(L, S)) {
    if (s == 0 && split == 0 && threadIdx.x == 0) report(sink, op, ErrorCode::kBadLength, n, static_cast<double>(L));
    return;
  }
  if (s >= L) return;
  const T* crow = kClean ? static_cast<const T*>(c.data) + n * c.stride_n + s * c.stride_s : nullptr;
  const T* prow = static_cast<const T*>(p.data) + n * p.stride_n + s * p.stride_s;
  const int64_t v0 = split * chunk;
  const int64_t v1 = min(V, v0 + chunk);
  State st = reduce_range<T, kClean, false>(crow, 0, prow, 0, v0, v1, 1, vec_ok);
  st = block_merge(st);
  if (threadIdx.x == 0) store_state(partials + blockIdx.x * static_cast<int64_t>(kStateFloats), st);
}

// answer_joint forward: phi_clean - phi_pert = mean_{s<L} (zc[a] - lse_c) - (zp[a] - lse_p). One thread per row.
template <typename T>
__global__ void joint_merge_kernel(LogitsDesc c, LogitsDesc p, const int64_t* __restrict__ ids,
                                   const int64_t* __restrict__ lengths, int64_t N, int64_t S, int64_t V, int64_t splits,
                                   const float* __restrict__ partials, float* __restrict__ out, ErrorSink sink) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const int64_t L = lengths != nullptr ? lengths[n] : S;
  if (bad_length(L, S)) {
    out[n] = NAN;
    return;
  }
  double drop = 0.0;
  bool bad_id = false;
  for (int64_t s = 0; s < L; ++s) {
    const int64_t a = ids[n * S + s];
    if (a < 0 || a >= V) {
      report(sink, OpId::kProbeDivergence, ErrorCode::kBadAnswerId, n * S + s, static_cast<double>(a));
      bad_id = true;
      continue;
    }
    const State st = merge_partials(partials, n * S + s, splits);
    const T* zc = static_cast<const T*>(c.data) + n * c.stride_n + s * c.stride_s;
    const T* zp = static_cast<const T*>(p.data) + n * p.stride_n + s * p.stride_s;
    drop += (static_cast<double>(to_f(zc[a])) - lse_clean(st)) - (static_cast<double>(to_f(zp[a])) - lse_pert(st));
  }
  const double phi = drop / static_cast<double>(L);
  if (bad_id) {
    out[n] = NAN;
  } else if (isnan(phi)) {
    report(sink, OpId::kProbeDivergence, ErrorCode::kNanDivergence, n, phi);
    out[n] = NAN;
  } else {
    out[n] = static_cast<float>(phi);
  }
}

// Backward pass 2, distribution probes. Block = (row n, vocabulary tile); writes all S positions of the tile.
template <typename T, bool kMean>
__global__ void __launch_bounds__(kThreads)
    dist_grad_kernel(const float* __restrict__ grad_out, LogitsDesc c, LogitsDesc p, const int64_t* __restrict__ lengths,
                     int64_t S, int64_t V, int64_t splits, const float* __restrict__ partials, int64_t tiles,
                     int64_t tile, bool vec_ok, T* __restrict__ grad) {
  constexpr int kVec = vec_width<T>();
  __shared__ float lse[2];
  const int64_t n = blockIdx.x / tiles;
  const int64_t v0 = (blockIdx.x % tiles) * tile;
  const int64_t v1 = min(V, v0 + tile);
  const int64_t L = lengths != nullptr ? lengths[n] : S;
  T* g_row = grad + n * S * V;
  if (bad_length(L, S)) {  // reported by pass 1
    for (int64_t s = 0; s < S; ++s)
      for (int64_t v = v0 + threadIdx.x; v < v1; v += blockDim.x) g_row[s * V + v] = detail::from_f<T>(NAN);
    return;
  }
  const int64_t Lp = kMean ? L : 1;
  if (threadIdx.x == 0) {
    const State st = merge_partials(partials, n, splits);
    lse[0] = static_cast<float>(lse_clean(st));
    lse[1] = static_cast<float>(lse_pert(st));
  }
  __syncthreads();
  const float lse_c = lse[0], lse_p = lse[1];
  const float scale = grad_out[n] / static_cast<float>(Lp);
  const float inv = 1.0f / static_cast<float>(Lp);
  const T* crow = static_cast<const T*>(c.data) + n * c.stride_n;
  const T* prow = static_cast<const T*>(p.data) + n * p.stride_n;
  int64_t v_tail = v0;
  if (vec_ok) {
    const int64_t nvec = (v1 - v0) / kVec;
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
      const int64_t v = v0 + i * kVec;
      float zc[kVec], zp[kVec], g[kVec];
      probe_vec(crow, c.stride_s, v, Lp, inv, zc);
      probe_vec(prow, p.stride_s, v, Lp, inv, zp);
#pragma unroll
      for (int k = 0; k < kVec; ++k) g[k] = (__expf(zp[k] - lse_p) - __expf(zc[k] - lse_c)) * scale;
      for (int64_t s = 0; s < Lp; ++s) store_vec(g_row + s * V + v, g);
#pragma unroll
      for (int k = 0; k < kVec; ++k) g[k] = 0.0f;
      for (int64_t s = Lp; s < S; ++s) store_vec(g_row + s * V + v, g);
    }
    v_tail = v0 + nvec * kVec;
  }
  for (int64_t v = v_tail + threadIdx.x; v < v1; v += blockDim.x) {
    const float zc = probe_scalar(crow, c.stride_s, v, Lp, inv);
    const float zp = probe_scalar(prow, p.stride_s, v, Lp, inv);
    const T g = detail::from_f<T>((__expf(zp - lse_p) - __expf(zc - lse_c)) * scale);
    for (int64_t s = 0; s < Lp; ++s) g_row[s * V + v] = g;
    for (int64_t s = Lp; s < S; ++s) g_row[s * V + v] = detail::from_f<T>(0.0f);
  }
}

// Backward pass 2, answer_joint. Block = (n, s, vocabulary tile).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    joint_grad_kernel(const float* __restrict__ grad_out, LogitsDesc p, const int64_t* __restrict__ ids,
                      const int64_t* __restrict__ lengths, int64_t S, int64_t V, int64_t splits,
                      const float* __restrict__ partials, int64_t tiles, int64_t tile, bool vec_ok,
                      T* __restrict__ grad, ErrorSink sink) {
  constexpr int kVec = vec_width<T>();
  __shared__ float lse_sh;
  const int64_t unit = blockIdx.x / tiles;
  const int64_t n = unit / S, s = unit % S;
  const int64_t v0 = (blockIdx.x % tiles) * tile;
  const int64_t v1 = min(V, v0 + tile);
  const int64_t L = lengths != nullptr ? lengths[n] : S;
  T* g = grad + unit * V;
  const bool bad_len = bad_length(L, S);
  const int64_t a = (!bad_len && s < L) ? ids[unit] : 0;
  const bool bad_id = a < 0 || a >= V;
  if (bad_id && v0 == 0 && threadIdx.x == 0)
    report(sink, OpId::kProbeDivergenceBackward, ErrorCode::kBadAnswerId, unit, static_cast<double>(a));
  if (bad_len || bad_id || s >= L) {
    const float fill = (bad_len || bad_id) ? NAN : 0.0f;
    for (int64_t v = v0 + threadIdx.x; v < v1; v += blockDim.x) g[v] = detail::from_f<T>(fill);
    return;
  }
  if (threadIdx.x == 0) lse_sh = static_cast<float>(lse_pert(merge_partials(partials, unit, splits)));
  __syncthreads();
  const float lse = lse_sh;
  const float scale = grad_out[n] / static_cast<float>(L);
  const T* prow = static_cast<const T*>(p.data) + n * p.stride_n + s * p.stride_s;
  int64_t v_tail = v0;
  if (vec_ok) {
    const int64_t nvec = (v1 - v0) / kVec;
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
      const int64_t v = v0 + i * kVec;
      float z[kVec];
      load_vec(prow + v, z);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        z[k] = __expf(z[k] - lse) * scale;
        if (v + k == a) z[k] -= scale;  // the one-hot term in float, before the 16-bit store (as on the CPU)
      }
      store_vec(g + v, z);
    }
    v_tail = v0 + nvec * kVec;
  }
  for (int64_t v = v_tail + threadIdx.x; v < v1; v += blockDim.x) {
    float z = __expf(to_f(prow[v]) - lse) * scale;
    if (v == a) z -= scale;
    g[v] = detail::from_f<T>(z);
  }
}

// ---- host side ----------------------------------------------------------------------------------------------------

size_t dtype_size(core::DType dtype) {
  switch (dtype) {
    case core::DType::kFloat32: return 4;
    case core::DType::kFloat16:
    case core::DType::kBFloat16: return 2;
    default: break;
  }
  throw core::InvalidArgument(std::string("probe_divergence (CUDA): logits must be float32, float16 or bfloat16, got ") +
                              core::to_string(dtype));
}

bool aligned16(const LogitsDesc& d, size_t es) {
  return reinterpret_cast<uintptr_t>(d.data) % 16 == 0 && (d.stride_n * static_cast<int64_t>(es)) % 16 == 0 &&
         (d.stride_s * static_cast<int64_t>(es)) % 16 == 0;
}

// Vocabulary entries per block in the backward write pass (two 16-byte vectors per thread).
int64_t grad_tile(size_t es) { return kThreads * static_cast<int64_t>(16 / es) * 2; }

unsigned grid_of(int64_t blocks, const char* what) {
  if (blocks > (int64_t{1} << 31) - 1)
    throw core::InvalidArgument(std::string(what) + " (CUDA): the problem needs " + std::to_string(blocks) +
                                " blocks, more than one launch allows; split the batch");
  return static_cast<unsigned>(blocks);
}

template <typename T>
void forward_typed(LogitsDesc c, LogitsDesc p, const int64_t* ids, const int64_t* lengths, int64_t N, int64_t S,
                   int64_t V, Probe probe, const ProbePlan& plan, float* ws, float* out, ErrorSink sink,
                   cudaStream_t stream) {
  const bool vec_ok = aligned16(c, sizeof(T)) && aligned16(p, sizeof(T));
  const int64_t splits = plan.splits, chunk = plan.chunk;
  constexpr OpId op = OpId::kProbeDivergence;
  detail::check_no_pending_error("probe_divergence");
  if (probe == Probe::kAnswerJoint) {
    joint_reduce_kernel<T, true><<<grid_of(N * S * splits, "probe_divergence"), kThreads, 0, stream>>>(
        c, p, lengths, S, V, splits, chunk, vec_ok, ws, sink, op);
    detail::check_launch("probe_divergence (answer_joint reduce)");
    joint_merge_kernel<T><<<grid_of(detail::ceil_div(N, 128), "probe_divergence"), 128, 0, stream>>>(
        c, p, ids, lengths, N, S, V, splits, ws, out, sink);
    detail::check_launch("probe_divergence (answer_joint merge)");
    return;
  }
  const bool mean = probe == Probe::kAnswerMean;
  const unsigned blocks = grid_of(N * splits, "probe_divergence");
  if (splits == 1) {
    if (mean) dist_reduce_kernel<T, true, true, true><<<blocks, kThreads, 0, stream>>>(c, p, lengths, S, V, 1, chunk, vec_ok, nullptr, out, sink, op);
    else dist_reduce_kernel<T, false, true, true><<<blocks, kThreads, 0, stream>>>(c, p, lengths, S, V, 1, chunk, vec_ok, nullptr, out, sink, op);
    detail::check_launch("probe_divergence");
    return;
  }
  if (mean) dist_reduce_kernel<T, true, true, false><<<blocks, kThreads, 0, stream>>>(c, p, lengths, S, V, splits, chunk, vec_ok, ws, nullptr, sink, op);
  else dist_reduce_kernel<T, false, true, false><<<blocks, kThreads, 0, stream>>>(c, p, lengths, S, V, splits, chunk, vec_ok, ws, nullptr, sink, op);
  detail::check_launch("probe_divergence (reduce)");
  dist_merge_kernel<<<grid_of(detail::ceil_div(N, 128), "probe_divergence"), 128, 0, stream>>>(ws, lengths, N, S, splits, out, sink);
  detail::check_launch("probe_divergence (merge)");
}

template <typename T>
void backward_typed(const float* grad_out, LogitsDesc c, LogitsDesc p, const int64_t* ids, const int64_t* lengths,
                    int64_t N, int64_t S, int64_t V, Probe probe, const ProbePlan& plan, float* ws, T* grad,
                    ErrorSink sink, cudaStream_t stream) {
  const bool vec_in = aligned16(c, sizeof(T)) && aligned16(p, sizeof(T));
  // The gradient is contiguous (N, S, V) from a 16-byte aligned allocation: rows are aligned when V * size is.
  const bool vec_out = (V * static_cast<int64_t>(sizeof(T))) % 16 == 0 && reinterpret_cast<uintptr_t>(grad) % 16 == 0;
  const int64_t splits = plan.splits, chunk = plan.chunk;
  const int64_t tile = grad_tile(sizeof(T));
  const int64_t tiles = detail::ceil_div(V, tile);
  constexpr OpId op = OpId::kProbeDivergenceBackward;
  detail::check_no_pending_error("probe_divergence_backward");
  if (probe == Probe::kAnswerJoint) {
    joint_reduce_kernel<T, false><<<grid_of(N * S * splits, "probe_divergence_backward"), kThreads, 0, stream>>>(
        c, p, lengths, S, V, splits, chunk, vec_in, ws, sink, op);
    detail::check_launch("probe_divergence_backward (answer_joint reduce)");
    joint_grad_kernel<T><<<grid_of(N * S * tiles, "probe_divergence_backward"), kThreads, 0, stream>>>(
        grad_out, p, ids, lengths, S, V, splits, ws, tiles, tile, vec_in && vec_out, grad, sink);
    detail::check_launch("probe_divergence_backward (answer_joint write)");
    return;
  }
  const bool mean = probe == Probe::kAnswerMean;
  const unsigned blocks = grid_of(N * splits, "probe_divergence_backward");
  if (mean) dist_reduce_kernel<T, true, false, false><<<blocks, kThreads, 0, stream>>>(c, p, lengths, S, V, splits, chunk, vec_in, ws, nullptr, sink, op);
  else dist_reduce_kernel<T, false, false, false><<<blocks, kThreads, 0, stream>>>(c, p, lengths, S, V, splits, chunk, vec_in, ws, nullptr, sink, op);
  detail::check_launch("probe_divergence_backward (reduce)");
  const unsigned gblocks = grid_of(N * tiles, "probe_divergence_backward");
  if (mean) dist_grad_kernel<T, true><<<gblocks, kThreads, 0, stream>>>(grad_out, c, p, lengths, S, V, splits, ws, tiles, tile, vec_in && vec_out, grad);
  else dist_grad_kernel<T, false><<<gblocks, kThreads, 0, stream>>>(grad_out, c, p, lengths, S, V, splits, ws, tiles, tile, vec_in && vec_out, grad);
  detail::check_launch("probe_divergence_backward (write)");
}

void check_sizes(int64_t N, int64_t S, int64_t V, const char* what) {
  if (N < 0 || (N > 0 && (S < 1 || V < 1)))
    throw core::InvalidArgument(std::string(what) + " (CUDA): need N >= 0 and, when N > 0, S >= 1 and V >= 1; got N=" +
                                std::to_string(N) + ", S=" + std::to_string(S) + ", V=" + std::to_string(V));
}

}  // namespace

ProbePlan plan_probe(core::DType dtype, int64_t N, int64_t S, int64_t V, core::Probe probe, bool backward,
                     int num_sms) {
  ProbePlan plan;
  const int64_t es = static_cast<int64_t>(dtype_size(dtype));
  if (N <= 0 || S <= 0 || V <= 0) return plan;
  const int64_t vec = 16 / es;
  // Rows (or (row, position) pairs for answer_joint) that reduce independently.
  const int64_t units = probe == Probe::kAnswerJoint ? N * S : N;
  // About four blocks per multiprocessor; a block should still get >= 4 vectors per thread.
  const int64_t target = 4 * static_cast<int64_t>(num_sms > 0 ? num_sms : 1);
  const int64_t min_chunk = kThreads * vec * 4;
  int64_t splits = units >= target ? 1 : detail::ceil_div(target, units);
  splits = std::max<int64_t>(1, std::min(splits, detail::ceil_div(V, min_chunk)));
  plan.chunk = detail::ceil_div(detail::ceil_div(V, splits), vec) * vec;
  plan.splits = detail::ceil_div(V, plan.chunk);
  const bool needs_ws = backward || probe == Probe::kAnswerJoint || plan.splits > 1;
  plan.workspace_bytes = needs_ws ? static_cast<size_t>(units * plan.splits * kStateFloats) * sizeof(float) : 0;
  return plan;
}

void launch_probe_divergence(core::DType dtype, LogitsDesc clean, LogitsDesc perturbed, const int64_t* answer_ids,
                             const int64_t* lengths, int64_t N, int64_t S, int64_t V, core::Probe probe,
                             const ProbePlan& plan, void* workspace, float* out, ErrorSink sink, Stream stream) {
  check_sizes(N, S, V, "probe_divergence");
  if (N == 0) return;
  if (probe == Probe::kAnswerJoint && answer_ids == nullptr)
    throw core::InvalidArgument("answer_ids (N, S) is required for probe 'answer_joint', got None");
  if (plan.workspace_bytes > 0 && workspace == nullptr)
    throw core::InvalidArgument("probe_divergence (CUDA): the plan needs a workspace, got null");
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  auto* ws = static_cast<float*>(workspace);
  switch (dtype) {
    case core::DType::kFloat32: return forward_typed<float>(clean, perturbed, answer_ids, lengths, N, S, V, probe, plan, ws, out, sink, s);
    case core::DType::kFloat16: return forward_typed<__half>(clean, perturbed, answer_ids, lengths, N, S, V, probe, plan, ws, out, sink, s);
    case core::DType::kBFloat16: return forward_typed<__nv_bfloat16>(clean, perturbed, answer_ids, lengths, N, S, V, probe, plan, ws, out, sink, s);
    default: break;
  }
  dtype_size(dtype);  // throws naming the dtype
}

void launch_probe_divergence_backward(core::DType dtype, const float* grad_out, LogitsDesc clean,
                                      LogitsDesc perturbed, const int64_t* answer_ids, const int64_t* lengths,
                                      int64_t N, int64_t S, int64_t V, core::Probe probe, const ProbePlan& plan,
                                      void* workspace, void* grad_perturbed, ErrorSink sink, Stream stream) {
  check_sizes(N, S, V, "probe_divergence_backward");
  if (N == 0) return;
  if (probe == Probe::kAnswerJoint && answer_ids == nullptr)
    throw core::InvalidArgument("answer_ids (N, S) is required for probe 'answer_joint', got None");
  if (workspace == nullptr) throw core::InvalidArgument("probe_divergence_backward (CUDA): workspace is null");
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  auto* ws = static_cast<float*>(workspace);
  switch (dtype) {
    case core::DType::kFloat32:
      return backward_typed<float>(grad_out, clean, perturbed, answer_ids, lengths, N, S, V, probe, plan, ws,
                                   static_cast<float*>(grad_perturbed), sink, s);
    case core::DType::kFloat16:
      return backward_typed<__half>(grad_out, clean, perturbed, answer_ids, lengths, N, S, V, probe, plan, ws,
                                    static_cast<__half*>(grad_perturbed), sink, s);
    case core::DType::kBFloat16:
      return backward_typed<__nv_bfloat16>(grad_out, clean, perturbed, answer_ids, lengths, N, S, V, probe, plan, ws,
                                           static_cast<__nv_bfloat16*>(grad_perturbed), sink, s);
    default: break;
  }
  dtype_size(dtype);
}

}  // namespace oar::cuda
