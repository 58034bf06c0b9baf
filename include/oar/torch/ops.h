// C++ API of oar's LibTorch operators: thin functions that call the dispatcher (torch.ops.oar.*), so C++
// users get the same checks, devices and autograd-free semantics as Python users. Link oar::torch.
// Shapes and errors: see the Python docstrings in python/oar/ops.py (one source of truth per op).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>

namespace oar {

/// method.md section 1: rewards (N,) + CSR offsets (G+1,) int64 -> advantages (N,) float32.
/// `preset` ("default", "trl", "verl", "openrlhf") fills std/eps/singleton as oar::core::preset_options does.
at::Tensor group_advantages(const at::Tensor& rewards, const at::Tensor& offsets, const std::string& estimator = "grpo",
                            const std::string& preset = "default", bool skip_nan = false);

/// method.md section 5: scores (B,T), mask (B,T) bool -> (B,T) float32 in [0, 1].
at::Tensor normalize_importance(const at::Tensor& scores, const at::Tensor& mask);

/// method.md sections 5-6: -> (token_advantages (B,T) float32, weights (B,T) float32).
std::tuple<at::Tensor, at::Tensor> reshape_advantages(const at::Tensor& advantages, const at::Tensor& scores,
                                                      const at::Tensor& reasoning_mask, const at::Tensor& response_mask,
                                                      double q = 0.25, double beta = 1.0, double floor = 0.1,
                                                      const std::string& tiers = "both",
                                                      bool scores_are_normalized = false);

/// method.md section 2: logits (N,S,V) -> divergence (N,) float32.
at::Tensor probe_divergence(const at::Tensor& clean_logits, const at::Tensor& perturbed_logits,
                            const std::optional<at::Tensor>& answer_ids = std::nullopt,
                            const std::optional<at::Tensor>& lengths = std::nullopt,
                            const std::string& probe = "answer_mean");

/// method.md section 4: grad, input (B,L,H) -> |sum_h grad*input| (B,L) float32.
at::Tensor grad_x_input(const at::Tensor& grad, const at::Tensor& input);

/// method.md section 3: (M,T) int64 copies of input_ids rows with one position set to pad_id.
at::Tensor build_masked_batch(const at::Tensor& input_ids, const at::Tensor& row_index, const at::Tensor& positions,
                              int64_t pad_id);

}  // namespace oar
