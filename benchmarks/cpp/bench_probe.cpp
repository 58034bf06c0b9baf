// Core probe kernels (method.md sections 2-4), single thread (the LibTorch adapter splits rows across
// threads; this measures the per-core kernel). Shapes follow OAR-P / OAR-G use:
//   probe_divergence, answer_mean, N = 64 masked variants of one rollout, S = 4 answer positions,
//   V = 49152 (SmolLM2 / Qwen-like small vocab) and 151936 (Qwen2.5); the clean logits are one (1, S, V)
//   row broadcast with stride_n = 0, as in OAR-P.
//   grad_x_input at (B*L = 16384, H = 576) (SmolLM2-135M embedding width).
// Counters: bytes_per_second counts the bytes the kernel must read (perturbed N x S x V, clean S x V).
#include <benchmark/benchmark.h>

#include <Eigen/Core>

#include <random>
#include <vector>

#include "oar/core/common.h"
#include "oar/core/grad_input.h"
#include "oar/core/probe.h"

namespace {

template <typename T>
std::vector<T> random_values(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(d(rng));
  return v;
}

template <typename T>
void BM_ProbeDivergenceAnswerMean(benchmark::State& state) {
  const int64_t N = 64, S = 4, V = state.range(0);
  const auto clean = random_values<T>(static_cast<size_t>(S * V), 1);
  const auto pert = random_values<T>(static_cast<size_t>(N * S * V), 2);
  std::vector<float> out(N);
  const oar::core::LogitsView<T> cv{clean.data(), 0, V};
  const oar::core::LogitsView<T> pv{pert.data(), S * V, V};
  for (auto _ : state) {
    oar::core::probe_divergence<T>(cv, pv, nullptr, nullptr, N, S, V, oar::core::Probe::kAnswerMean, out.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * (N + 1) * S * V * static_cast<int64_t>(sizeof(T)));
  state.counters["rows_per_s"] = benchmark::Counter(static_cast<double>(state.iterations() * N),
                                                    benchmark::Counter::kIsRate);
}

template <typename T>
void BM_GradXInput(benchmark::State& state) {
  const int64_t rows = state.range(0), H = state.range(1);
  const auto g = random_values<T>(static_cast<size_t>(rows * H), 3);
  const auto x = random_values<T>(static_cast<size_t>(rows * H), 4);
  std::vector<float> out(static_cast<size_t>(rows));
  for (auto _ : state) {
    oar::core::grad_x_input<T>(g.data(), x.data(), rows, H, out.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * 2 * rows * H * static_cast<int64_t>(sizeof(T)));
}

BENCHMARK_TEMPLATE(BM_ProbeDivergenceAnswerMean, float)->Arg(49152)->Arg(151936)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_ProbeDivergenceAnswerMean, Eigen::bfloat16)
    ->Arg(49152)
    ->Arg(151936)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_ProbeDivergenceAnswerMean, Eigen::half)->Arg(49152)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_GradXInput, float)->Args({16384, 576})->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(BM_GradXInput, Eigen::bfloat16)->Args({16384, 576})->Unit(benchmark::kMillisecond);

}  // namespace
