// Calls oar's LibTorch ops through the C++ API (dispatcher) and prints the results as JSON lines.
#include <cstdio>
#include <string>

#include <ATen/ATen.h>

#include "oar/torch/ops.h"

int main() {
  auto rewards = at::tensor({1.0f, 0.0f, 0.0f, 1.0f, 0.5f, 0.5f});
  auto offsets = at::tensor({int64_t{0}, int64_t{4}, int64_t{6}});
  auto adv = oar::group_advantages(rewards, offsets, "grpo", "verl");
  auto scores = at::tensor({0.0f, 2.0f, 0.5f, 8.0f}).reshape({1, 4});
  auto mask = at::ones({1, 4}, at::kBool);
  auto [tok, w] = oar::reshape_advantages(adv.slice(0, 0, 1), scores, mask, mask);
  std::printf("{\"advantages\": [");
  for (int64_t i = 0; i < adv.numel(); ++i) std::printf("%s%.7g", i ? ", " : "", adv[i].item<float>());
  std::printf("]}\n{\"token_advantages\": [");
  for (int64_t i = 0; i < tok.numel(); ++i) std::printf("%s%.7g", i ? ", " : "", tok.flatten()[i].item<float>());
  std::printf("]}\n");
  try {
    oar::reshape_advantages(adv.slice(0, 0, 1), scores, mask, mask, /*q=*/1.5);
    std::printf("{\"q_error\": false}\n");
  } catch (const c10::ValueError& e) {
    const std::string msg = e.what_without_backtrace();
    std::printf("{\"q_error\": %s}\n", msg.find("q must") != std::string::npos ? "true" : "false");
  }
  return 0;
}
