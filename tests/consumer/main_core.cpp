// Reshapes the advantages of two rollouts with the torch-free core and prints them as JSON lines.
#include <cstdio>
#include <vector>

#include "oar/core/group_advantages.h"
#include "oar/core/reshape.h"

int main() {
  using namespace oar::core;
  // One group of 4 rollouts with rewards 1, 0, 0, 1.
  const std::vector<double> rewards{1, 0, 0, 1};
  const std::vector<int64_t> offsets{0, 4};
  std::vector<float> adv(4);
  group_advantages<double>(rewards.data(), 4, offsets.data(), 1, preset_options("trl", Estimator::kGrpo), adv.data());
  // Rollouts 0 and 1, T = 5: 4 reasoning tokens + 1 answer token.
  const int64_t B = 2, T = 5;
  const std::vector<float> scores{0.0f, 2.0f, 0.5f, 8.0f, 0.0f, 1.0f, 1.0f, 1.0f, 1.0f, 0.0f};
  const bool r[] = {1, 1, 1, 1, 0, 1, 1, 1, 1, 0};
  const bool m[] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  std::vector<float> tok(B * T), w(B * T);
  reshape_advantages<float>(adv.data(), scores.data(), r, m, B, T, ReshapeOptions{}, false, tok.data(), w.data());
  std::printf("{\"advantages\": [%.7g, %.7g, %.7g, %.7g]}\n", adv[0], adv[1], adv[2], adv[3]);
  std::printf("{\"token_advantages\": [");
  for (int64_t i = 0; i < B * T; ++i) std::printf("%s%.7g", i ? ", " : "", tok[i]);
  std::printf("]}\n");
  return 0;
}
