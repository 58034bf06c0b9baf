// The OAR-P attribution engine for C++ users (method.md section 3), over the small model interface that
// Python adapters implement for Hugging Face models (python/oar/attribution/model.py, `ProbeModel`).
//
// A C++ trainer implements oar::ProbeModel for its own module (three calls: the vocabulary size, the logits of
// the last `keep` positions and the activation memory one token costs), builds an oar::ProbeBatch (the same left-padded layout as Python's
// oar.attribution.ProbeBatch) and calls oar::oar_p_scores. The engine plans chunks of masked variants in
// C++ under a memory budget (oar::core::plan_masked_chunks), builds each chunk with the build_masked_batch
// op, runs the model once per chunk and scores each variant with the fused probe_divergence op, on the
// device of the batch tensors. Link oar::torch. The planner's decisions are logged at debug level
// (OAR_LOG_LEVEL=debug, oar/core/log.h).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace oar {

/// What the engine needs from a causal LM. All tensors on the model's device.
class ProbeModel {
 public:
  virtual ~ProbeModel() = default;

  /// Vocabulary size V of the logits.
  virtual int64_t vocab_size() const = 0;

  /// Logits (B, keep, V) (any floating dtype) of the last `keep` positions of input_ids (B, T) int64, with
  /// attention_mask (B, T) int64 (0 on left padding) and position_ids (B, T) int64. Called without grad.
  virtual at::Tensor tail_logits(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                 const at::Tensor& position_ids, int64_t keep) = 0;

  /// Peak activation bytes one context token costs in a forward over contexts of `width` tokens (without
  /// grad), for chunk planning: the engine keeps variants x padded width x this + variants x 8 x keep x V under
  /// the memory budget. An estimate is enough (too small risks running out of memory, too large runs smaller
  /// chunks); Python's HFProbeModel uses bytes_per_element x (4 hidden + 2 intermediate) + 4 x heads x width.
  virtual int64_t activation_bytes_per_token(int64_t width) const = 0;
};

/// Left-padded probe contexts: prompt + reasoning + conclude + answer tokens (method.md section 2).
/// Same fields and meaning as Python's oar.attribution.ProbeBatch.
struct ProbeBatch {
  at::Tensor input_ids;        ///< (B, T) int64, left-padded with pad_id
  at::Tensor attention_mask;   ///< (B, T) int64, 0 on padding
  at::Tensor position_ids;     ///< (B, T) int64
  at::Tensor reasoning_start;  ///< (B,) int64 column of the first reasoning token
  at::Tensor reasoning_len;    ///< (B,) int64 L_b >= 0
  at::Tensor answer_ids;       ///< (B, K) int64 answer tokens, padded past answer_len
  at::Tensor answer_len;       ///< (B,) int64 in [1, K]
  at::Tensor probe_start;      ///< (B,) int64 index in the kept window of the position predicting answer token 0
  int64_t keep = 0;            ///< trailing positions whose logits are needed
  int64_t pad_id = 0;          ///< the id that replaces a masked token
};

/// Engine options.
struct OarPOptions {
  std::string probe = "answer_mean";       ///< last | answer_mean | answer_joint
  int64_t memory_budget_mb = 1024;         ///< per-chunk activation + logits budget
  int64_t max_variants_per_chunk = 0;      ///< 0: no cap beyond the budget
};

/// OAR-P scores (B, T_r) float32 on the CPU, T_r = max_b reasoning_len[b]: scores[b, j] = the divergence
/// of masking reasoning token j of row b (answer_joint: max(0, phi_clean - phi_masked)); 0 past L_b.
/// Exact: equals masking each token in its own forward (tested against that loop).
/// Throws c10::ValueError naming the argument for a malformed batch (shapes, dtypes, ranges), an unknown
/// probe or a budget < 1, and when a divergence is not finite (the model's logits contain NaN/Inf or put
/// zero probability where the clean distribution has mass).
at::Tensor oar_p_scores(ProbeModel& model, const ProbeBatch& batch, const OarPOptions& options = {});

}  // namespace oar
