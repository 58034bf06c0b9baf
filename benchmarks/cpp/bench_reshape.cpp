// Google Benchmark of the torch-free advantage core (method.md sections 1, 5, 6):
//   BM_GroupAdvantages        N = 4096 rewards in groups of G = 8, per estimator
//   BM_NormalizeReshape       B = 256 rollouts x L = 4096 tokens: normalization + bi-level reshaping
// Throughput is reported in elements (rewards or tokens) per second. Inputs are fixed-seed random: 0/1
// rewards (the common verifiable-reward case) and heavy-tailed importance scores on ~90% of tokens.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "oar/core/group_advantages.h"
#include "oar/core/importance.h"
#include "oar/core/reshape.h"

namespace {

using oar::core::Estimator;

void BM_GroupAdvantages(benchmark::State& state) {
  const int64_t n = state.range(0), g = state.range(1);
  const auto est = static_cast<Estimator>(state.range(2));
  std::mt19937 gen(0);
  std::bernoulli_distribution coin(0.4);
  std::vector<float> r(n);
  for (auto& v : r) v = coin(gen) ? 1.0f : 0.0f;
  std::vector<int64_t> off;
  for (int64_t i = 0; i <= n; i += g) off.push_back(i);
  std::vector<float> out(n);
  oar::core::GroupAdvantageOptions o;
  o.estimator = est;
  for (auto _ : state) {
    auto st = oar::core::group_advantages(r.data(), n, off.data(), static_cast<int64_t>(off.size()) - 1, o, out.data());
    benchmark::DoNotOptimize(st);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.SetLabel(oar::core::to_string(est));
}
BENCHMARK(BM_GroupAdvantages)
    ->ArgNames({"N", "G", "est"})
    ->Args({4096, 8, static_cast<int64_t>(Estimator::kGrpo)})
    ->Args({4096, 8, static_cast<int64_t>(Estimator::kRloo)})
    ->Args({4096, 8, static_cast<int64_t>(Estimator::kBatch)});

struct ReshapeInputs {
  int64_t B, T;
  std::vector<float> adv, scores;
  std::vector<uint8_t> rm, pm;  // bool masks as bytes
  ReshapeInputs(int64_t b, int64_t t) : B(b), T(t), adv(b), scores(b * t), rm(b * t), pm(b * t) {
    std::mt19937 gen(1);
    std::uniform_real_distribution<float> u(0, 1);
    std::normal_distribution<float> nrm(0, 1);
    for (int64_t i = 0; i < b; ++i) {
      adv[i] = nrm(gen);
      const int64_t len = t - static_cast<int64_t>(u(gen) * t * 0.2f);  // response fills 80-100% of T
      for (int64_t j = 0; j < t; ++j) {
        const int64_t k = i * t + j;
        const float x = u(gen);
        scores[k] = x * x * x * 10.0f;
        pm[k] = j < len;
        rm[k] = j < len - 8;  // the last tokens (answer + EOS) are outside the reasoning span
      }
    }
  }
  const bool* r() const { return reinterpret_cast<const bool*>(rm.data()); }
  const bool* p() const { return reinterpret_cast<const bool*>(pm.data()); }
};

void BM_NormalizeImportance(benchmark::State& state) {
  const ReshapeInputs in(state.range(0), state.range(1));
  std::vector<float> out(in.B * in.T);
  for (auto _ : state) {
    oar::core::normalize_importance(in.scores.data(), in.r(), in.B, in.T, out.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * in.B * in.T);
}
BENCHMARK(BM_NormalizeImportance)->ArgNames({"B", "L"})->Args({256, 4096})->Unit(benchmark::kMillisecond);

void BM_NormalizeReshape(benchmark::State& state) {
  const ReshapeInputs in(state.range(0), state.range(1));
  std::vector<float> ta(in.B * in.T), w(in.B * in.T);
  oar::core::ReshapeOptions o;
  o.tiers = static_cast<oar::core::Tiers>(state.range(2));
  for (auto _ : state) {
    oar::core::reshape_advantages(in.adv.data(), in.scores.data(), in.r(), in.p(), in.B, in.T, o,
                                  /*scores_are_normalized=*/false, ta.data(), w.data());
    benchmark::DoNotOptimize(ta.data());
    benchmark::DoNotOptimize(w.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * in.B * in.T);
  state.SetLabel(oar::core::to_string(o.tiers));
}
BENCHMARK(BM_NormalizeReshape)
    ->ArgNames({"B", "L", "tiers"})
    ->Args({256, 4096, static_cast<int64_t>(oar::core::Tiers::kBoth)})
    ->Args({256, 4096, static_cast<int64_t>(oar::core::Tiers::kBoostOnly)})
    ->Unit(benchmark::kMillisecond);

}  // namespace
