#include "op_args.h"

#include <string>

#include "oar/core/common.h"

namespace oar::torch_ops {

at::Tensor promote_real(const at::Tensor& t) {
  if (t.scalar_type() == at::kDouble) return t.contiguous();
  return t.to(at::kFloat).contiguous();
}

void check_floating(const at::Tensor& t, const char* name) {
  check_dtype(t, name, {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16});
}

core::GroupAdvantageOptions group_advantage_args(const at::Tensor& rewards, const at::Tensor& offsets,
                                                 std::string_view estimator, std::string_view std_kind, double eps,
                                                 std::string_view singleton, bool skip_nan, bool offsets_on_cpu) {
  check_dim(rewards, "rewards", 1, "(N,)");
  TORCH_CHECK_VALUE(!at::isComplexType(rewards.scalar_type()),
                    "rewards must be real (float, integer or bool), got dtype ", c10::toString(rewards.scalar_type()));
  check_dim(offsets, "offsets", 1, "(G + 1,)");
  check_dtype(offsets, "offsets", {at::kLong});
  if (offsets_on_cpu)
    TORCH_CHECK_VALUE(offsets.device().is_cpu(), "offsets must be a CPU tensor for the CPU kernel, got device ",
                      offsets.device());
  check_same_device(rewards, "rewards", offsets, "offsets");
  TORCH_CHECK_VALUE(offsets.numel() >= 1, "offsets must have G + 1 >= 1 entries (CSR row starts plus N), got shape ",
                    shape_str(offsets.sizes()));
  core::GroupAdvantageOptions opts;
  rethrow_as_value_error([&] {
    opts.estimator = core::parse_estimator(estimator, "estimator");
    opts.std_kind = core::parse_std_kind(std_kind, "std");
    opts.singleton = core::parse_singleton_policy(singleton, "singleton");
    return 0;
  });
  opts.eps = eps;
  opts.skip_nan = skip_nan;
  return opts;
}

at::Tensor scores_mask_args(const at::Tensor& scores, const at::Tensor& mask, const char* mask_name) {
  check_dim(scores, "scores", 2, "(B, T)");
  check_floating(scores, "scores");
  check_same_device(scores, "scores", mask, mask_name);
  return as_bool_mask(mask, mask_name, scores.sizes(), "(B, T)").contiguous();
}

std::pair<at::Tensor, at::Tensor> reshape_mask_args(const at::Tensor& advantages, const at::Tensor& scores,
                                                    const at::Tensor& reasoning_mask,
                                                    const at::Tensor& response_mask) {
  at::Tensor rm = scores_mask_args(scores, reasoning_mask, "reasoning_mask");
  check_same_device(scores, "scores", response_mask, "response_mask");
  at::Tensor pm = as_bool_mask(response_mask, "response_mask", scores.sizes(), "(B, T)").contiguous();
  check_same_device(scores, "scores", advantages, "advantages");
  check_shape(advantages, "advantages", {scores.size(0)}, "(B,) with B = scores.size(0)");
  check_floating(advantages, "advantages");
  return {rm, pm};
}

core::ReshapeOptions reshape_options(double q, double beta, double floor, std::string_view tiers) {
  core::ReshapeOptions opts;
  opts.q = q;
  opts.beta = beta;
  opts.floor = floor;
  rethrow_as_value_error([&] {
    opts.tiers = core::parse_tiers(tiers, "tiers");
    core::check_reshape_options(opts);
    return 0;
  });
  return opts;
}

namespace {

// The kernels need a contiguous vocabulary dimension; N and S strides are free (0 from .expand() too).
at::Tensor vocab_contiguous(const at::Tensor& t) {
  return (t.size(2) <= 1 || t.stride(2) == 1) ? t : t.contiguous();
}

}  // namespace

ProbeArgs probe_args(const at::Tensor& clean_logits, const at::Tensor& perturbed_logits,
                     const std::optional<at::Tensor>& answer_ids, const std::optional<at::Tensor>& lengths,
                     std::string_view probe) {
  ProbeArgs a;
  a.probe = rethrow_as_value_error([&] { return core::parse_probe(probe); });
  check_dim(perturbed_logits, "perturbed_logits", 3, "(N, S, V)");
  check_float_logits(perturbed_logits, "perturbed_logits");
  a.N = perturbed_logits.size(0);
  a.S = perturbed_logits.size(1);
  a.V = perturbed_logits.size(2);
  check_shape(clean_logits, "clean_logits", perturbed_logits.sizes(), "(N, S, V) like perturbed_logits");
  TORCH_CHECK_VALUE(clean_logits.scalar_type() == perturbed_logits.scalar_type(),
                    "clean_logits must have the dtype of perturbed_logits (",
                    c10::toString(perturbed_logits.scalar_type()), "), got ",
                    c10::toString(clean_logits.scalar_type()));
  check_same_device(perturbed_logits, "perturbed_logits", clean_logits, "clean_logits");
  if (a.N > 0) {
    TORCH_CHECK_VALUE(a.S >= 1, "perturbed_logits must have S >= 1 probe positions, got shape ",
                      shape_str(perturbed_logits.sizes()));
    TORCH_CHECK_VALUE(a.V >= 1, "perturbed_logits must have V >= 1 vocabulary entries, got shape ",
                      shape_str(perturbed_logits.sizes()));
  }
  a.clean = vocab_contiguous(clean_logits);
  a.pert = vocab_contiguous(perturbed_logits);
  if (lengths.has_value()) {
    check_shape(*lengths, "lengths", {a.N}, "(N,)");
    check_dtype(*lengths, "lengths", {at::kLong});
    check_same_device(perturbed_logits, "perturbed_logits", *lengths, "lengths");
    a.lengths = lengths->contiguous();
  }
  if (a.probe == core::Probe::kAnswerJoint) {
    TORCH_CHECK_VALUE(answer_ids.has_value(), "answer_ids (N, S) int64 is required for probe='answer_joint', got None");
    check_shape(*answer_ids, "answer_ids", {a.N, a.S}, "(N, S)");
    check_dtype(*answer_ids, "answer_ids", {at::kLong});
    check_same_device(perturbed_logits, "perturbed_logits", *answer_ids, "answer_ids");
    a.answer_ids = answer_ids->contiguous();
  }
  return a;
}

void check_grad_out(const at::Tensor& grad_out, const ProbeArgs& a, const at::Tensor& perturbed_logits) {
  check_shape(grad_out, "grad_out", {a.N}, "(N,)");
  check_dtype(grad_out, "grad_out", {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16});
  check_same_device(perturbed_logits, "perturbed_logits", grad_out, "grad_out");
}

void grad_x_input_args(const at::Tensor& grad, const at::Tensor& input) {
  check_dim(input, "input", 3, "(B, L, H)");
  check_dtype(input, "input", {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble});
  check_shape(grad, "grad", input.sizes(), "(B, L, H) like input");
  TORCH_CHECK_VALUE(grad.scalar_type() == input.scalar_type(), "grad must have the dtype of input (",
                    c10::toString(input.scalar_type()), "), got ", c10::toString(grad.scalar_type()));
  check_same_device(input, "input", grad, "grad");
}

void masked_batch_args(const at::Tensor& input_ids, const at::Tensor& row_index, const at::Tensor& positions) {
  check_dim(input_ids, "input_ids", 2, "(B, T)");
  check_dtype(input_ids, "input_ids", {at::kLong});
  check_dim(row_index, "row_index", 1, "(M,)");
  check_dtype(row_index, "row_index", {at::kLong});
  check_shape(positions, "positions", row_index.sizes(), "(M,) like row_index");
  check_dtype(positions, "positions", {at::kLong});
  check_same_device(input_ids, "input_ids", row_index, "row_index");
  check_same_device(input_ids, "input_ids", positions, "positions");
}

}  // namespace oar::torch_ops
