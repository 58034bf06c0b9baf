// The oar configuration schema, shared by C++ (nlohmann_json) and Python (PyYAML -> JSON -> here).
// One schema: configs/*.yaml `oar:` sections are parsed by oar::core::parse_oar_config.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "oar/core/common.h"
#include "oar/core/group_advantages.h"
#include "oar/core/reshape.h"

namespace oar::core {

/// Credit-assignment method (method.md section 8 lists the baselines). JSON names:
///   "grpo"            uniform credit, A_{i,t} = A_i (std-scaled group advantages)
///   "dr_grpo"         uniform credit with Dr. GRPO sequence advantages A_i = r_i - mean (estimator "dr_grpo")
///   "random"          I_t ~ U(0, 1) through the OAR reshaping (sections 5-6)
///   "entropy"         I_t = policy entropy at t, used as importance through the OAR reshaping (sections 5-6)
///   "entropy_shaping" Cheng et al. 2506.14758: A_t = A + min(alpha * H_t, |A| / kappa), no reshaping
///   "ktae"            Sun et al. 2505.16826: A_t = A + key-token score of token t (per group), no reshaping
///   "oar_p", "oar_g"  OAR with perturbation / gradient attribution (sections 3-4)
enum class Method : int32_t {
  kGrpo = 0, kRandom = 1, kEntropy = 2, kOarP = 3, kOarG = 4, kDrGrpo = 5, kEntropyShaping = 6, kKtae = 7
};
Method parse_method(std::string_view name, std::string_view arg = "method");
const char* to_string(Method v);
/// Every method's JSON name, in a fixed documented order (grpo, dr_grpo, random, entropy, entropy_shaping, ktae,
/// oar_p, oar_g).
std::vector<std::string> method_names();
/// The values each string-valued key of the config takes, in the schema's order: exactly what
/// parse_oar_config accepts for "method", "probe", "tiers", "estimator", "preset", "std", "singleton", "screen",
/// "screen_tail", "mask_unit", "credit_rows", "turn_probe" and "turn_credit". Python reads it as `oar._C.CONFIG_CHOICES` (oar.schema's name tuples).
const std::vector<std::pair<std::string, std::vector<std::string>>>& config_choices();

/// Entropy-advantage shaping (Cheng et al., arXiv 2506.14758; method.md section 8):
/// A_{i,t} = A_i + min(alpha * H_t, |A_i| / kappa), H_t the full-vocabulary policy entropy (nats), detached.
/// JSON keys "entropy_alpha", "entropy_kappa".
struct EntropyShapingOptions {
  double alpha = 0.4;  ///< >= 0
  double kappa = 2.0;  ///< > 0; the bonus never exceeds |A_i| / kappa, so it cannot flip a negative A_i's sign
};

/// KTAE key-token scores (Sun et al., arXiv 2505.16826; method.md section 8), per group and token id, from the
/// 2x2 table (token appears / not) x (rollout correct / wrong). JSON keys "ktae_alpha", "ktae_beta",
/// "ktae_tf", "ktae_scale", "ktae_threshold".
struct KtaeOptions {
  double alpha = 1.0;      ///< weight of the Fisher-exact term exp(-2 p) (0 when p = 1); >= 0
  double beta = 1.0;       ///< weight of the information gain (bits); >= 0, alpha + beta > 0
  bool tf = true;          ///< add the BM25-style token-frequency direction term (the authors' default)
  double scale = 1.0;      ///< scores lie in (-scale, scale); > 0
  double threshold = 0.0;  ///< a rollout is correct when its reward > threshold
};

/// Everything that decides per-token advantages. Field names are the JSON/YAML keys.
struct OARConfig {
  Method method = Method::kOarG;
  Probe probe = Probe::kAnswerMean;          ///< "probe": last | answer_mean | answer_joint
  ReshapeOptions reshape;                    ///< "q", "beta", "floor", "tiers": both | boost | suppress
  GroupAdvantageOptions advantages;          ///< "estimator", "std", "eps", "singleton", "skip_nan"
  double sigma = 1e-3;                       ///< OAR-G embedding noise std (absolute)
  int64_t noise_draws = 1;                   ///< OAR-G K
  std::string conclude = "\nTherefore, the final answer is \\boxed{";
  std::string answer_suffix = "}";
  int64_t memory_budget_mb = 1024;           ///< OAR-P chunk planner budget
  int64_t max_variants_per_chunk = 0;        ///< OAR-P, 0 = unlimited
  int64_t seed = 0;                          ///< noise / random-baseline seed
  /// Screened OAR-P (method "oar_p" only; docs/design.md "Screened OAR-P"): a screen ranks the reasoning
  /// tokens, exact masking runs on its top "screen_fraction" plus a uniform sample of "screen_sample" of the
  /// others, and the tokens not masked get the screen's scores scaled onto the exact scale. 1 = exact OAR-P.
  double screen_fraction = 1.0;              ///< in [0, 1]
  /// The screen: "window" (windowed OAR-P: each masked token re-runs only the next "screen_window" reasoning
  /// tokens and the probe tail) or "oar_g" (OAR-G with this config's sigma / noise_draws).
  std::string screen = "window";
  int64_t screen_window = 8;                 ///< >= 0, the "window" screen's re-run reasoning tokens
  /// The probe-side tokens the "window" screen re-runs with each variant: "conclude" (the conclude string and the
  /// probe window, as the full context would) or "probe" (only the probe window; the conclude tokens keep their
  /// clean keys/values: about a third of the cost at long responses; docs/design.md "Windowed OAR-P: the tail") or
  /// "linear" (the tail not re-run: its response to the window's keys/values linearized, Hugging Face Llama / Qwen2
  /// / Qwen3 with unsharded parameters; docs/design.md "Windowed OAR-P: the linear tail").
  std::string screen_tail = "conclude";
  /// in [0, 1]; screen_fraction = screen_sample = 0: the screen's scores alone, nothing masked exactly (with
  /// screen "window": windowed OAR-P, the cheap setting at long responses; docs/method.md section 11)
  double screen_sample = 0.05;
  /// 0 = off; > 1: the masked share is also cut so that a step takes at most screen_budget x a GRPO step
  /// (wall time measured between pipeline calls; then results depend on timing).
  double screen_budget = 0.0;
  /// The masking unit (docs/method.md section 11, our extension): "token" (the paper's), "word" (a run of
  /// letters/digits or of punctuation, split at whitespace), "line" (up to and including a newline) or "sentence"
  /// (a line, also split after . ! ? followed by whitespace). OAR-P masks a whole unit per variant; the token-level
  /// scorers (OAR-G, entropy, random) sum their tokens' scores per unit; every token of a unit gets its unit's score.
  std::string mask_unit = "token";
  /// Which rollouts get token-level credit (docs/method.md section 12, our extension): "all" (the paper's), "positive"
  /// (rows with sequence advantage A > 0; rows with A < 0 keep GRPO's uniform credit and are not scored) or
  /// "negative" (the converse). Applied by the Python pipeline (oar.Pipeline); uniform methods ignore it.
  std::string credit_rows = "all";
  /// Multi-turn sessions (docs/method.md section 13, our extension): a row whose eligible tokens form several runs
  /// (the model's turns, separated by observations such as tool results) is scored turn by turn. "answer": each
  /// turn is a probe row of its own (prefix before it as prompt, the turn as response, the answer probe at its
  /// end); "action": the same turn rows, each probed on its own action (the tokens after its reasoning: a tool
  /// call, or the last turn's own final answer; no reference answer needed, every row scored turn by turn);
  /// "session": one probe at the end of the whole row (observations stay unscored context). A row with one turn is
  /// scored the same under "answer" and "session".
  std::string turn_probe = "answer";
  /// How the session's advantage is split between its turns (mass and sign kept): "uniform" (every eligible token
  /// of every turn carries the session's mass, as GRPO) or "probe" (turn k's weight grows with |change of the
  /// answer's log-likelihood from before turn k to after its observation|) or "rewards" (the batch's per-turn
  /// rewards, e.g. verl's tool_rewards: mass moves toward the turns whose reward agrees with the session's
  /// advantage sign; docs/method.md section 13).
  std::string turn_credit = "uniform";
  EntropyShapingOptions entropy_shaping;     ///< method "entropy_shaping"
  KtaeOptions ktae;                          ///< method "ktae"
};

/// Parses a JSON object (all keys optional, defaults above). Method "dr_grpo" sets the estimator to "dr_grpo"
/// (an explicit other "estimator" is an error). Unknown keys, wrong types, integers beyond int64
/// and out-of-range values throw InvalidArgument naming the key ("oar.q must be in (0, 1), got 1.5"); invalid
/// JSON (numbers beyond double included) throws InvalidArgument too.
OARConfig parse_oar_config(const std::string& json_text);
/// Serializes every field (round-trips through parse_oar_config).
std::string to_json(const OARConfig& cfg);

}  // namespace oar::core
