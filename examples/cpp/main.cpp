// Rewards of one GRPO group + raw importance scores -> per-token advantages, with the torch-free oar core.
//
// Usage: reshape_example [OAR_CONFIG_JSON]   (the `oar` schema of docs/config.md; default "{}")
// Prints one JSON object: the config used, the sequence advantages (B,) and the per-token advantages and
// weights (B x T, row-major). Exit status 2 with a message on a bad config.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "oar/core/config.h"
#include "oar/core/group_advantages.h"
#include "oar/core/reshape.h"

namespace {

void print_array(const char* name, const std::vector<float>& v, bool last = false) {
  std::printf("\"%s\": [", name);
  for (size_t i = 0; i < v.size(); ++i) std::printf("%s%.9g", i ? ", " : "", v[i]);
  std::printf("]%s", last ? "" : ", ");
}

}  // namespace

int main(int argc, char** argv) {
  oar::core::OARConfig cfg;
  try {
    cfg = oar::core::parse_oar_config(argc > 1 ? argv[1] : "{}");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bad config: %s\n", e.what());
    return 2;
  }
  // One prompt, G = 4 rollouts with verifiable rewards 1, 0, 0, 1 (CSR offsets of one group).
  const std::vector<double> rewards{1.0, 0.0, 0.0, 1.0};
  const std::vector<int64_t> offsets{0, 4};
  std::vector<float> seq(rewards.size());
  oar::core::group_advantages<double>(rewards.data(), static_cast<int64_t>(rewards.size()), offsets.data(), 1,
                                      cfg.advantages, seq.data());

  // T = 6 response tokens per rollout: 5 reasoning tokens (scored) + 1 answer token; rollout 2 has one padding token.
  const int64_t B = 4, T = 6;
  const std::vector<float> scores{0.1f, 3.0f, 0.2f, 0.0f, 1.5f, 0.0f,   //
                                  2.0f, 0.1f, 0.1f, 0.4f, 0.3f, 0.0f,   //
                                  0.5f, 0.5f, 0.9f, 0.2f, 0.0f, 0.0f,   //
                                  1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 0.0f};
  bool reasoning[B * T], response[B * T];
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t len = b == 2 ? T - 1 : T;  // rollout 2: 4 reasoning + 1 answer token, then padding
      response[b * T + t] = t < len;
      reasoning[b * T + t] = t < len - 1;
    }
  std::vector<float> tok(B * T), weights(B * T);
  oar::core::reshape_advantages<float>(seq.data(), scores.data(), reasoning, response, B, T, cfg.reshape,
                                       /*scores_are_normalized=*/false, tok.data(), weights.data());
  std::printf("{\"method\": \"%s\", \"tiers\": \"%s\", ", oar::core::to_string(cfg.method),
              oar::core::to_string(cfg.reshape.tiers));
  print_array("sequence_advantages", seq);
  print_array("token_advantages", tok);
  print_array("weights", weights, /*last=*/true);
  std::printf("}\n");
  return 0;
}
